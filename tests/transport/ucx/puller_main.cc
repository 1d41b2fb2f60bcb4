// ucx_test_puller TRANSPORTS: a process that pulls from a target as hard as
// it can, for the tests of what a target does when its puller stalls or dies
// (dead_puller_test.cc). Reads from fd 3 what handshake() got from a peer
// (worker address, packed rkey, buffer address, buffer bytes), then runs
// batches over the whole buffer in a loop, GETs and PUTs by turns (the PUTs
// write back what the GETs read, so the target's bytes stay its pattern),
// many small operations in flight so that the target always has requests
// queued. Writes 'P' on fd 3 after the first batch has landed bit-exact, 'E'
// and exits 2 on an error, and otherwise pulls until it is killed.

#include <unistd.h>

#include <cstring>
#include <sstream>

#include "tests/transport/ucx/peer_process.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/get_engine.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

using namespace refit::ucx;
using namespace refit::ucx::testing;

int main(int argc, char** argv) {
  const int fd = 3;
  auto fail = [&](const std::string& msg) {
    uint8_t e = 'E';
    write_all(fd, &e, 1);
    send_blob(fd, std::vector<uint8_t>(msg.begin(), msg.end()));
    ::_exit(2);
  };
  if (argc != 3) fail("usage: ucx_test_puller TRANSPORTS SEED");
  const uint32_t seed = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  std::vector<uint8_t> address, rkey, base_b, bytes_b;
  if (!recv_blob(fd, &address, deadline) || !recv_blob(fd, &rkey, deadline) ||
      !recv_blob(fd, &base_b, deadline) || !recv_blob(fd, &bytes_b, deadline) ||
      base_b.size() != 8 || bytes_b.size() != 8) {
    fail("puller: handshake from parent truncated");
  }
  uint64_t base = 0, bytes = 0;
  std::memcpy(&base, base_b.data(), 8);
  std::memcpy(&bytes, bytes_b.data(), 8);

  ContextConfig cfg;
  cfg.name = "puller";
  std::stringstream ss(argv[1]);
  for (std::string t; std::getline(ss, t, ',');) cfg.transports.push_back(t);
  for (const auto& t : cfg.transports) {
    if (t == "tcp") cfg.devices = {"lo"};
  }
  auto ctx = Context::create(cfg);
  if (!ctx) fail(ctx.status().message());
  auto worker = Worker::create(*ctx);
  if (!worker) fail(worker.status().message());
  auto ep = Endpoint::create(*worker, address, "target");
  if (!ep) fail(ep.status().message());
  if (refit::Status s = ep->import_rkey(1, rkey); !s.is_ok()) fail(s.message());
  std::vector<uint8_t> local(bytes);
  auto region = MemoryRegion::map(*ctx, local.data(), local.size(), "puller buffer");
  if (!region) fail(region.status().message());
  GetEngineOptions opts;
  opts.limits.chunk_bytes = 64 << 10;
  opts.limits.max_bytes_per_endpoint = 16 << 20;
  opts.limits.max_bytes_in_flight = 16 << 20;
  opts.limits.max_ops_per_endpoint = 256;
  opts.limits.max_ops_in_flight = 256;
  auto engine = GetEngine::create(*worker, opts);
  if (!engine) fail(engine.status().message());
  (*engine)->add_local_region(*region);
  std::vector<GetRun> runs;
  for (uint64_t off = 0; off < bytes; off += 64 << 10) {
    runs.push_back(GetRun{&*ep, 1, base + off, local.data() + off,
                          std::min<uint64_t>(64 << 10, bytes - off)});
  }
  for (bool first = true;; first = false) {
    for (auto& r : runs) r.op = first || r.op == Op::kPut ? Op::kGet : Op::kPut;
    auto report = (*engine)->run_batch(runs, std::chrono::steady_clock::now() +
                                                 std::chrono::seconds(30));
    if (!report.status.is_ok()) fail(report.status.message());
    if (first) {
      for (uint64_t i = 0; i < bytes; ++i) {
        if (local[i] != pattern_byte(seed, i)) fail("puller: byte " + std::to_string(i) + " differs");
      }
      uint8_t p = 'P';
      if (!write_all(fd, &p, 1)) return 3;
    }
  }
}
