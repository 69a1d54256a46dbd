#include "rdma/verbs_device.h"

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace kvtier::rdma::verbs {

std::vector<std::string> ListDevices() {
  std::vector<std::string> out;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) return out;
  for (int i = 0; i < n; ++i) out.emplace_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  return out;
}

struct VerbsZone::Impl {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  std::vector<ibv_mr*> mrs;
  uint8_t port = 1;
  QpParams local;

  ~Impl() {
    for (ibv_mr* mr : mrs) ibv_dereg_mr(mr);
    if (qp != nullptr) ibv_destroy_qp(qp);
    if (cq != nullptr) ibv_destroy_cq(cq);
    if (channel != nullptr) ibv_destroy_comp_channel(channel);
    if (pd != nullptr) ibv_dealloc_pd(pd);
    if (ctx != nullptr) ibv_close_device(ctx);
  }
};

namespace {
Status VerbsError(const char* call) {
  return Status::IOError(std::string(call) + " failed: " + std::strerror(errno));
}
}  // namespace

StatusOr<std::unique_ptr<VerbsZone>> VerbsZone::Open(const std::string& device, uint8_t port,
                                                     uint32_t cq_depth, uint32_t send_queue_depth) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr || n == 0) {
    if (list != nullptr) ibv_free_device_list(list);
    return Status::Unavailable("no RDMA device (ibv_get_device_list is empty)");
  }
  ibv_device* chosen = nullptr;
  for (int i = 0; i < n && chosen == nullptr; ++i) {
    if (device.empty() || device == ibv_get_device_name(list[i])) chosen = list[i];
  }
  auto impl = std::make_unique<Impl>();
  impl->port = port;
  if (chosen != nullptr) impl->ctx = ibv_open_device(chosen);
  ibv_free_device_list(list);
  if (chosen == nullptr) return Status::NotFound("no RDMA device named " + device);
  if (impl->ctx == nullptr) return VerbsError("ibv_open_device");
  impl->pd = ibv_alloc_pd(impl->ctx);
  if (impl->pd == nullptr) return VerbsError("ibv_alloc_pd");
  impl->channel = ibv_create_comp_channel(impl->ctx);
  if (impl->channel == nullptr) return VerbsError("ibv_create_comp_channel");
  impl->cq = ibv_create_cq(impl->ctx, static_cast<int>(cq_depth), nullptr, impl->channel, 0);
  if (impl->cq == nullptr) return VerbsError("ibv_create_cq");
  ibv_qp_init_attr init{};
  init.send_cq = impl->cq;
  init.recv_cq = impl->cq;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // only the last WR of a chain is signaled (verbs_plan.h)
  init.cap.max_send_wr = send_queue_depth;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  impl->qp = ibv_create_qp(impl->pd, &init);
  if (impl->qp == nullptr) return VerbsError("ibv_create_qp");
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = port;
  attr.qp_access_flags = 0;  // the client end is only ever the reader
  if (ibv_modify_qp(impl->qp, &attr,
                    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
    return VerbsError("ibv_modify_qp(INIT)");
  }
  ibv_port_attr port_attr{};
  if (ibv_query_port(impl->ctx, port, &port_attr) != 0) return VerbsError("ibv_query_port");
  impl->local.qpn = impl->qp->qp_num;
  impl->local.psn = std::random_device()() & 0xffffff;
  impl->local.lid = port_attr.lid;
  impl->local.port = port;
  ibv_gid gid{};
  if (ibv_query_gid(impl->ctx, port, 0, &gid) == 0) {
    std::memcpy(impl->local.gid.data(), gid.raw, 16);
  }
  return std::unique_ptr<VerbsZone>(new VerbsZone(std::move(impl)));
}

VerbsZone::VerbsZone(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VerbsZone::~VerbsZone() = default;

StatusOr<RemoteRegion> VerbsZone::RegisterRemoteReadable(const uint8_t* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty region");
  // Read-only mapping: remote read only, no local write.
  ibv_mr* mr =
      ibv_reg_mr(impl_->pd, const_cast<uint8_t*>(data), size_bytes, IBV_ACCESS_REMOTE_READ);
  if (mr == nullptr) return VerbsError("ibv_reg_mr(remote read)");
  impl_->mrs.push_back(mr);
  return RemoteRegion{reinterpret_cast<uintptr_t>(data), mr->rkey, size_bytes};
}

StatusOr<uint32_t> VerbsZone::RegisterLocalWritable(uint8_t* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty buffer");
  ibv_mr* mr = ibv_reg_mr(impl_->pd, data, size_bytes, IBV_ACCESS_LOCAL_WRITE);
  if (mr == nullptr) return VerbsError("ibv_reg_mr(local write)");
  impl_->mrs.push_back(mr);
  return mr->lkey;
}

QpParams VerbsZone::LocalParams() const { return impl_->local; }

}  // namespace kvtier::rdma::verbs
