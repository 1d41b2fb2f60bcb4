// ucx_test_peer TRANSPORTS SEED BYTES [ucx|source]: serves a buffer of pattern(SEED) over
// UCX for the multi-process tests (peer_process.h). Talks to its parent on
// fd 3: sends worker address, packed rkey and buffer address, then progresses
// until the parent closes the socket or writes a byte: kDumpCommand makes it
// send its whole buffer back (so the parent can check what it PUT there), any
// other byte stops it.

#include <poll.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "tests/transport/ucx/peer_process.h"
#include "transport/ucx/active_message.h"
#include "transport/ucx/am_rma.h"
#include "transport/ucx/context.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

using namespace refit::ucx;
using namespace refit::ucx::testing;

int main(int argc, char** argv) {
  const int fd = 3;
  auto fail = [&](const std::string& msg) {
    std::vector<uint8_t> e(msg.begin(), msg.end());
    send_blob(fd, {});
    send_blob(fd, e);
    ::_exit(2);
  };
  if (argc != 4 && argc != 5) fail("usage: ucx_test_peer TRANSPORTS SEED BYTES [ucx|source]");
  // "ucx": the buffer is allocated by UCX (MemoryRegion::allocate), as a
  // source does for the shared-memory fast path; otherwise plain memory.
  const bool ucx_memory = argc == 5 && std::string(argv[4]) == "ucx";
  // "source": the buffer is served as SourceAgent serves a shard: the
  // context serves only (no UCX RMA feature), the memory is mapped
  // remote-read-only and the AmRmaServer refuses PUTs.
  const bool as_source = argc == 5 && std::string(argv[4]) == "source";
  ContextConfig cfg;
  if (as_source) cfg.serves_only = true;
  cfg.name = "peer";
  std::stringstream ss(argv[1]);
  for (std::string t; std::getline(ss, t, ',');) cfg.transports.push_back(t);
  for (const auto& t : cfg.transports) {
    if (t == "tcp") cfg.devices = {"lo"};
  }
  uint32_t seed = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  uint64_t bytes = std::strtoull(argv[3], nullptr, 10);
  auto ctx = Context::create(cfg);
  if (!ctx) fail(ctx.status().message());
  auto worker = Worker::create(*ctx);
  if (!worker) fail(worker.status().message());
  std::vector<uint8_t> plain;
  refit::Result<MemoryRegion> region = refit::Status::internal("unset");
  if (ucx_memory) {
    region = MemoryRegion::allocate(*ctx, bytes, "peer buffer");
  } else {
    plain.resize(bytes);
    region = MemoryRegion::map(*ctx, plain.data(), plain.size(), "peer buffer",
                               as_source ? Access::kRemoteRead : Access::kRemoteReadWrite);
  }
  if (!region) fail(region.status().message());
  uint8_t* const buf = region->base();
  for (uint64_t i = 0; i < bytes; ++i) buf[i] = pattern_byte(seed, i);
  // Serves the engine's GETs and PUTs on endpoints without an RMA lane
  // (tcp), as every refit process that exports memory must.
  auto server = AmRmaServer::create(*worker, as_source ? AmRmaServer::Puts::kRefused
                                                       : AmRmaServer::Puts::kServed);
  if (!server) fail(server.status().message());
  (*server)->export_region(*region);
  // For active_message_test: kEchoId answers "echo:" + the request
  // reversed; kFailId fails with a message naming the request size.
  auto am = ActiveMessages::create(*worker);
  if (!am) fail(am.status().message());
  refit::Status st = (*am)->serve(kEchoId, [](std::span<const uint8_t> req) {
    std::vector<uint8_t> out = {'e', 'c', 'h', 'o', ':'};
    out.insert(out.end(), req.rbegin(), req.rend());
    return refit::Result<std::vector<uint8_t>>(std::move(out));
  });
  if (st.is_ok()) {
    st = (*am)->serve(kFailId, [](std::span<const uint8_t> req) {
      return refit::Result<std::vector<uint8_t>>(refit::Status::invalid(
          "test handler refuses " + std::to_string(req.size()) + " bytes"));
    });
  }
  if (!st.is_ok()) fail(st.message());
  auto addr = worker->address();
  if (!addr) fail(addr.status().message());
  uint64_t base = reinterpret_cast<uint64_t>(buf);
  std::vector<uint8_t> base_bytes(8);
  std::memcpy(base_bytes.data(), &base, 8);
  if (!send_blob(fd, *addr) || !send_blob(fd, region->packed_rkey()) ||
      !send_blob(fd, base_bytes)) {
    return 3;
  }
  // tcp GETs and PUTs need this side's progress; cma does not.
  while (true) {
    while (worker->progress() != 0) {
    }
    pollfd pf = {fd, POLLIN, 0};
    if (::poll(&pf, 1, 0) > 0) {
      uint8_t cmd = 0;
      if (::read(fd, &cmd, 1) != 1 || cmd != kDumpCommand) break;
      if (!send_blob(fd, std::vector<uint8_t>(buf, buf + bytes))) break;
      continue;
    }
    (void)worker->wait(std::chrono::milliseconds(1));
  }
  return 0;
}
