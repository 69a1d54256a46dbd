#include "rdma/verbs_device.h"

#include <fcntl.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
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

const char* WcStatusName(int wc_status) {
  return ibv_wc_status_str(static_cast<ibv_wc_status>(wc_status));
}

struct VerbsZone::Impl {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  VerbsOptions options;
  ibv_port_attr port_attr{};
  ibv_device_attr device_attr{};
  std::mutex mu;                           // guards mrs, remote_mrs
  std::map<uintptr_t, ibv_mr*> mrs;        // local buffers, by start address
  std::map<uint32_t, ibv_mr*> remote_mrs;  // remote-readable regions, by rkey (one per grant)

  ~Impl() {
    for (auto& [start, mr] : mrs) ibv_dereg_mr(mr);
    for (auto& [rkey, mr] : remote_mrs) ibv_dereg_mr(mr);
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

bool SetNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

// ibv_reg_mr is a macro that ANDs its access argument with an enum of another type; passing
// an ibv_access_flags constant straight in is deprecated enum arithmetic (an error for clang's
// -Werror builds). An int parameter keeps the macro's arithmetic on int.
ibv_mr* RegisterMr(ibv_pd* pd, void* data, size_t size_bytes, int access) {
  return ibv_reg_mr(pd, data, size_bytes, access);
}

}  // namespace

StatusOr<std::shared_ptr<VerbsZone>> VerbsZone::Open(const VerbsOptions& options) {
  KVTIER_RETURN_IF_ERROR(ValidateVerbsOptions(options));
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr || n == 0) {
    if (list != nullptr) ibv_free_device_list(list);
    return Status::Unavailable("no RDMA device (ibv_get_device_list is empty)");
  }
  ibv_device* chosen = nullptr;
  for (int i = 0; i < n && chosen == nullptr; ++i) {
    if (options.device.empty() || options.device == ibv_get_device_name(list[i])) {
      chosen = list[i];
    }
  }
  auto impl = std::make_shared<Impl>();
  impl->options = options;
  if (chosen != nullptr) impl->ctx = ibv_open_device(chosen);
  ibv_free_device_list(list);
  if (chosen == nullptr) return Status::NotFound("no RDMA device named " + options.device);
  if (impl->ctx == nullptr) return VerbsError("ibv_open_device");
  if (ibv_query_device(impl->ctx, &impl->device_attr) != 0) return VerbsError("ibv_query_device");
  if (ibv_query_port(impl->ctx, options.port, &impl->port_attr) != 0) {
    return VerbsError("ibv_query_port");
  }
  impl->pd = ibv_alloc_pd(impl->ctx);
  if (impl->pd == nullptr) return VerbsError("ibv_alloc_pd");
  impl->channel = ibv_create_comp_channel(impl->ctx);
  if (impl->channel == nullptr) return VerbsError("ibv_create_comp_channel");
  if (!SetNonBlocking(impl->channel->fd) || !SetNonBlocking(impl->ctx->async_fd)) {
    return VerbsError("fcntl(O_NONBLOCK)");
  }
  const int cq_depth = static_cast<int>(
      std::min<uint32_t>(options.cq_depth, static_cast<uint32_t>(impl->device_attr.max_cqe)));
  impl->cq = ibv_create_cq(impl->ctx, cq_depth, nullptr, impl->channel, 0);
  if (impl->cq == nullptr) return VerbsError("ibv_create_cq");
  return std::shared_ptr<VerbsZone>(new VerbsZone(std::move(impl)));
}

VerbsZone::VerbsZone(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
VerbsZone::~VerbsZone() = default;

StatusOr<RemoteRegion> VerbsZone::RegisterRemoteReadable(const uint8_t* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty region");
  // Read-only mapping: remote read only, no local write.
  ibv_mr* mr =
      RegisterMr(impl_->pd, const_cast<uint8_t*>(data), size_bytes, IBV_ACCESS_REMOTE_READ);
  if (mr == nullptr) return VerbsError("ibv_reg_mr(remote read)");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->remote_mrs.emplace(mr->rkey, mr).second) {
    ibv_dereg_mr(mr);
    return Status::Internal("the device returned an rkey that is already live");
  }
  return RemoteRegion{reinterpret_cast<uintptr_t>(data), mr->rkey, size_bytes};
}

Status VerbsZone::DeregisterRemote(uint32_t rkey) {
  ibv_mr* mr = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->remote_mrs.find(rkey);
    if (it == impl_->remote_mrs.end()) return Status::NotFound("no remote region with this key");
    mr = it->second;
    impl_->remote_mrs.erase(it);
  }
  if (ibv_dereg_mr(mr) != 0) return VerbsError("ibv_dereg_mr(remote read)");
  return Status::Ok();
}

StatusOr<uint32_t> VerbsZone::RegisterLocalWritable(uint8_t* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty buffer");
  ibv_mr* mr = RegisterMr(impl_->pd, data, size_bytes, IBV_ACCESS_LOCAL_WRITE);
  if (mr == nullptr) return VerbsError("ibv_reg_mr(local write)");
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto [it, inserted] = impl_->mrs.emplace(reinterpret_cast<uintptr_t>(data), mr);
  if (!inserted) {
    ibv_dereg_mr(mr);
    return Status::InvalidArgument("memory at this address is already registered");
  }
  return mr->lkey;
}

Status VerbsZone::Deregister(const void* data) {
  ibv_mr* mr = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->mrs.find(reinterpret_cast<uintptr_t>(data));
    if (it == impl_->mrs.end()) return Status::NotFound("no memory region at this address");
    mr = it->second;
    impl_->mrs.erase(it);
  }
  if (ibv_dereg_mr(mr) != 0) return VerbsError("ibv_dereg_mr");
  return Status::Ok();
}

ibv_cq* VerbsZone::cq() const { return impl_->cq; }
ibv_comp_channel* VerbsZone::channel() const { return impl_->channel; }
ibv_context* VerbsZone::context() const { return impl_->ctx; }
int VerbsZone::completion_fd() const { return impl_->channel->fd; }
int VerbsZone::async_fd() const { return impl_->ctx->async_fd; }

StatusOr<std::unique_ptr<VerbsQp>> VerbsZone::CreateQp(uint32_t send_queue_depth, QpRole role) {
  if (send_queue_depth == 0) return Status::InvalidArgument("send_queue_depth is 0");
  const VerbsOptions& o = impl_->options;
  std::unique_ptr<VerbsQp> q(new VerbsQp());
  q->zone_ = impl_;
  q->role_ = role;
  ibv_qp_init_attr init{};
  init.send_cq = impl_->cq;
  init.recv_cq = impl_->cq;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // only the last WR of a chain is signaled (verbs_plan.h)
  if (send_queue_depth > static_cast<uint32_t>(impl_->device_attr.max_qp_wr)) {
    return Status::InvalidArgument("send_queue_depth above the device's max_qp_wr (" +
                                   std::to_string(impl_->device_attr.max_qp_wr) + ")");
  }
  init.cap.max_send_wr = send_queue_depth;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  q->qp_ = ibv_create_qp(impl_->pd, &init);
  if (q->qp_ == nullptr) return VerbsError("ibv_create_qp");
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = o.port;
  // The reader end grants nothing; the responder end allows remote reads of its PD's MRs
  // (which are only ever table rows registered with IBV_ACCESS_REMOTE_READ).
  attr.qp_access_flags = role == QpRole::kResponder ? IBV_ACCESS_REMOTE_READ : 0;
  if (ibv_modify_qp(q->qp_, &attr,
                    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
    return VerbsError("ibv_modify_qp(INIT)");
  }
  DeviceCaps caps;
  caps.active_mtu = static_cast<uint8_t>(impl_->port_attr.active_mtu);
  caps.max_qp_rd_atom = static_cast<uint32_t>(std::max(0, impl_->device_attr.max_qp_rd_atom));
  caps.max_qp_init_rd_atom =
      static_cast<uint32_t>(std::max(0, impl_->device_attr.max_qp_init_rd_atom));
  caps.link_layer = impl_->port_attr.link_layer;
  caps.gid_table_len = static_cast<uint32_t>(std::max(0, impl_->port_attr.gid_tbl_len));
  caps.lid = impl_->port_attr.lid;
  KVTIER_RETURN_IF_ERROR(LocalPathCaps(o, caps, role == QpRole::kResponder, &q->local_));
  q->local_.qpn = q->qp_->qp_num;
  q->local_.psn = std::random_device()() & 0xffffff;
  ibv_gid gid{};
  if (ibv_query_gid(impl_->ctx, o.port, o.gid_index, &gid) == 0) {
    std::memcpy(q->local_.gid.data(), gid.raw, 16);
  } else if (impl_->port_attr.lid == 0) {
    return VerbsError("ibv_query_gid (the port has no LID, so a GID is required)");
  }
  return q;
}

VerbsQp::~VerbsQp() {
  if (qp_ != nullptr) ibv_destroy_qp(qp_);
}

Status VerbsQp::ConnectTo(const QpParams& peer) {
  const VerbsZone::Impl& z = *zone_;
  // Both ends negotiate the same MTU and read depth (verbs_plan.h, NegotiatePath).
  KVTIER_ASSIGN_OR_RETURN(PathAttributes path, NegotiatePath(local_, peer));
  // The depth that matters is the requester's max_rd_atomic and the responder's
  // max_dest_rd_atomic (both path.rd_atomic); the other direction carries no reads, so it
  // only has to stay within this device.
  const auto within = [](uint32_t want, int device_max) {
    return static_cast<uint8_t>(std::min<uint32_t>(want, std::max(0, device_max)));
  };
  const uint8_t dest_rd_atomic = role_ == QpRole::kResponder
                                     ? path.rd_atomic
                                     : within(path.rd_atomic, z.device_attr.max_qp_rd_atom);
  const uint8_t init_rd_atomic = role_ == QpRole::kReader
                                     ? path.rd_atomic
                                     : within(path.rd_atomic, z.device_attr.max_qp_init_rd_atom);
  ibv_qp_attr rtr{};
  rtr.qp_state = IBV_QPS_RTR;
  rtr.path_mtu = static_cast<ibv_mtu>(path.path_mtu);
  rtr.dest_qp_num = peer.qpn;
  rtr.rq_psn = peer.psn;
  rtr.max_dest_rd_atomic = dest_rd_atomic;
  rtr.min_rnr_timer = 12;
  rtr.ah_attr.dlid = peer.lid;
  rtr.ah_attr.sl = 0;
  rtr.ah_attr.src_path_bits = 0;
  rtr.ah_attr.port_num = z.options.port;
  if (path.use_grh) {  // RoCE (or IB across subnets): route by GID
    rtr.ah_attr.is_global = 1;
    std::memcpy(rtr.ah_attr.grh.dgid.raw, peer.gid.data(), 16);
    rtr.ah_attr.grh.sgid_index = local_.gid_index;
    rtr.ah_attr.grh.hop_limit = 64;
  }
  if (ibv_modify_qp(qp_, &rtr,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
    return VerbsError("ibv_modify_qp(RTR)");
  }
  ibv_qp_attr rts{};
  rts.qp_state = IBV_QPS_RTS;
  rts.timeout = 14;  // 4.096 us * 2^14 = 67 ms per retry
  rts.retry_cnt = 7;
  rts.rnr_retry = 7;
  rts.sq_psn = local_.psn;
  rts.max_rd_atomic = init_rd_atomic;
  if (ibv_modify_qp(qp_, &rts,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
    return VerbsError("ibv_modify_qp(RTS)");
  }
  return Status::Ok();
}

Status VerbsQp::PostReadChain(std::span<const PlannedRead> chain) {
  if (chain.empty()) return Status::InvalidArgument("empty chain");
  std::vector<ibv_sge> sges(chain.size());
  std::vector<ibv_send_wr> wrs(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) {
    const PlannedRead& r = chain[i];
    sges[i].addr = r.local_addr;
    sges[i].length = r.length_bytes;
    sges[i].lkey = r.lkey;
    ibv_send_wr& wr = wrs[i];
    wr = ibv_send_wr{};
    wr.wr_id = r.wr_id;
    wr.sg_list = &sges[i];
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = r.signaled ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = r.remote_addr;
    wr.wr.rdma.rkey = r.rkey;
    wr.next = i + 1 < chain.size() ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(qp_, wrs.data(), &bad); rc != 0) {
    return Status::IOError(std::string("ibv_post_send failed: ") + std::strerror(rc));
  }
  return Status::Ok();
}

Status VerbsQp::ForceError() {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  if (ibv_modify_qp(qp_, &attr, IBV_QP_STATE) != 0) return VerbsError("ibv_modify_qp(ERR)");
  return Status::Ok();
}

}  // namespace kvtier::rdma::verbs
