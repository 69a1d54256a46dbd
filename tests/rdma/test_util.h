// Helpers shared by the rdma tests: temporary table files and a started RowServer.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "common/temp_dir.h"
#include "rdma/engram_table.h"
#include "rdma/row_server.h"
#include "rdma/tcp_transport.h"

namespace kvtier::rdma::testing {

using ::kvtier::TempDir;  // common/temp_dir.h

inline constexpr uint64_t kSeed = 0x5eed;

// Writes a synthetic table of `row_count` rows of `row_dim` starting at global row
// `row_begin` (stride = unpadded row bytes + `pad`).
inline std::string MakeTable(const TempDir& dir, const std::string& name, uint64_t row_begin,
                             uint64_t row_count, uint32_t row_dim = 64, uint32_t pad = 0) {
  EngramTableHeader h;
  h.row_dim = row_dim;
  h.row_begin = row_begin;
  h.row_count = row_count;
  h.row_stride_bytes = EngramRowBytes(row_dim) + pad;
  h.layer_id = 1;
  const std::string path = dir.File(name);
  Status st = GenerateEngramTable(path, h, kSeed);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return path;
}

inline TransportOptions FastOptions() {
  TransportOptions o;
  o.request_timeout_ms = 3000;
  o.connect_timeout_ms = 1000;
  return o;
}

inline std::unique_ptr<TcpTransport> Connect(uint16_t port, TransportOptions o = FastOptions()) {
  auto t = TcpTransport::Create(TcpEndpoint{"127.0.0.1", port}, o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

}  // namespace kvtier::rdma::testing
