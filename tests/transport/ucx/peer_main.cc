// ucx_test_peer TRANSPORTS SEED BYTES: serves a buffer of pattern(SEED) over
// UCX for the multi-process tests (peer_process.h). Talks to its parent on
// fd 3: sends worker address, packed rkey and buffer address, then progresses
// until the parent writes a byte or closes the socket.

#include <poll.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "tests/transport/ucx/peer_process.h"
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
  if (argc != 4) fail("usage: ucx_test_peer TRANSPORTS SEED BYTES");
  ContextConfig cfg;
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
  std::vector<uint8_t> buf(bytes);
  for (uint64_t i = 0; i < bytes; ++i) buf[i] = pattern_byte(seed, i);
  auto region = MemoryRegion::map(*ctx, buf.data(), buf.size(), "peer buffer");
  if (!region) fail(region.status().message());
  auto addr = worker->address();
  if (!addr) fail(addr.status().message());
  uint64_t base = reinterpret_cast<uint64_t>(buf.data());
  std::vector<uint8_t> base_bytes(8);
  std::memcpy(base_bytes.data(), &base, 8);
  if (!send_blob(fd, *addr) || !send_blob(fd, region->packed_rkey()) ||
      !send_blob(fd, base_bytes)) {
    return 3;
  }
  // tcp GETs need this side's progress; cma does not.
  while (true) {
    while (worker->progress() != 0) {
    }
    pollfd pf = {fd, POLLIN, 0};
    if (::poll(&pf, 1, 0) > 0) break;
    (void)worker->wait(std::chrono::milliseconds(1));
  }
  return 0;
}
