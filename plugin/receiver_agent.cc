#include "plugin/receiver_agent.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <set>
#include <tuple>

#ifdef HAVE_NCCL
#include "transport/cuda/cuda_copy_ops.h"
#include "transport/cuda/nccl_comm.h"
#include "transport/fabric/nccl_fabric.h"
#endif
#include "planner/dtype.h"
#include "plugin/host_memory.h"
#include "plugin/verify.h"
#include "transport/cuda/host_copy_ops.h"
#include "transport/cuda/pointer_probe.h"
#include "transport/cuda/staging.h"
#include "transport/fabric/cma_fabric.h"
#include "transport/fabric/ucx_fabric.h"
#include "transport/ucx/gather_ops.h"
#include "transport/ucx/get_engine.h"

namespace refit::plugin {

using control::Json;
using control::MsgType;
using Clock = std::chrono::steady_clock;

namespace {

// Between attempts of a refresh that failed in a way a new attempt can fix.
constexpr std::chrono::milliseconds kRetryPause{200};
// How often a running refresh asks whether the membership changed.
constexpr std::chrono::milliseconds kMembershipCheck{250};
// Staged mode: how long the watcher holds the coordinator connection while
// it listens for an abort; the refresh waits up to this long for it to stop.
constexpr std::chrono::milliseconds kAbortSlice{5};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Renews a lease while the refresh that holds it runs (docs/refresh.md,
// "Leases"): three times per lease timeout, on a thread of its own, so that
// a refresh of any length keeps it. If a renewal is refused (the lease
// expired or was revoked: the sources may be overwriting the version), it
// stops and lost() says why; the refresh then fails.
class LeaseKeeper {
 public:
  LeaseKeeper(CoordinatorLink* link, Json lease, std::chrono::milliseconds timeout)
      : link_(link), lease_(std::move(lease)) {
    lease_["renew"] = true;
    const auto period = std::max(timeout / 3, std::chrono::milliseconds(10));
    thread_ = std::thread([this, period] { run(period); });
  }
  ~LeaseKeeper() { stop(); }
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // Why the lease was lost; "" while it holds. Call after stop().
  const std::string& lost() const { return lost_; }

 private:
  void run(std::chrono::milliseconds period) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
      lock.unlock();
      Result<Json> r = link_->request(MsgType::kLease, lease_);
      lock.lock();
      // A refusal is final; a connection that failed may recover before
      // the lease expires, and the release at the end tells either way.
      if (!r.is_ok() && r.status().code() == Code::kNotFound) {
        lost_ = r.status().message();
        return;
      }
    }
  }

  CoordinatorLink* link_;
  Json lease_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::string lost_;   // written by the thread, read after stop()
  std::thread thread_;
};

}  // namespace

// One receiver's part of the plan of one membership epoch, compiled.
struct CompiledPart {
  struct Get {
    int32_t source = 0;
    std::vector<uint8_t> address;  // the source's worker address
    uint64_t rkey_id = 0;
    uint64_t remote = 0;
    uint8_t* local = nullptr;
    uint64_t bytes = 0;
    uint8_t* device = nullptr;  // through the landing ring: where it goes (`local` unused)
  };
  uint64_t epoch = 0;
  bool device_landing = false;  // some GETs land in the landing ring first
  std::vector<Get> net;
  ucx::GatherOps gathers;  // small runs of `net` that travel together (docs/refresh.md, "Gathers")
  std::map<int32_t, std::vector<std::pair<uint64_t, std::vector<uint8_t>>>> source_keys;  // rank -> (id, packed)
  std::map<int32_t, std::vector<uint8_t>> source_addresses;
  fabric::Schedule schedule;                       // version set per refresh
  std::vector<uint32_t> send_deps;                 // per send: network runs still to land
  std::vector<std::vector<uint32_t>> dependents;   // per network run: the sends it feeds
  uint64_t network_bytes = 0;
  uint64_t local_bytes = 0;
  int64_t minimum_network_bytes = -1;
  bool solo = false;  // the coordinator's solo plan: no local runs (docs/refresh.md, "Retries")
  // Per buffer (index in buffers_): the byte ranges a refresh writes, sorted
  // and merged; staged mode commits exactly these.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> written;
};

namespace {

// The local fabric the config asks for. "cma" falls back to "ucx" where the
// kernel forbids cross-memory attach (the ranks of a host all decide alike).
// REFIT_LANDING_RING=1 (a test knob): host buffers take the GPU path's
// landing ring and copies.
bool landing_ring_forced() {
  const char* v = std::getenv("REFIT_LANDING_RING");
  return v != nullptr && std::string(v) == "1";
}

// With "nccl", also the copy stream that landing copies run on (*copy_ops),
// which the fabric's sends are ordered after.
Result<std::unique_ptr<fabric::LocalFabric>> make_fabric(const AgentConfig& config, const Log& log,
                                                         std::unique_ptr<cuda::CopyOps>* copy_ops, int* gpu) {
  if (config.local_fabric == "nccl") {
#ifdef HAVE_NCCL
    int device = config.local_device;
    if (device < 0) {
      Result<int> current = cuda::current_device();
      if (!current.is_ok()) return current.status();
      device = *current;
    }
    Result<std::unique_ptr<cuda::CudaCopyOps>> ops = cuda::CudaCopyOps::create(device);
    if (!ops.is_ok()) return ops.status();
    void* upstream = (*ops)->stream();
    *copy_ops = std::move(ops).value();
    *gpu = device;
    Result<std::unique_ptr<cuda::CommFactory>> comms = cuda::nccl_comm_factory(device, upstream);
    if (!comms.is_ok()) return comms.status();
    fabric::NcclFabricConfig nc;
    nc.rank = config.rank;
    Result<std::unique_ptr<fabric::NcclFabric>> f = fabric::NcclFabric::create(nc, std::move(comms).value());
    if (!f.is_ok()) return f.status();
    return std::unique_ptr<fabric::LocalFabric>(std::move(f).value());
#else
    (void)copy_ops;
    (void)gpu;
    return Status::unsupported("\"fabric\": \"nccl\" needs a build of refit with CUDA and NCCL");
#endif
  }
  if (config.local_fabric == "cma") {
    Result<std::unique_ptr<fabric::CmaFabric>> cma = fabric::CmaFabric::create({config.rank});
    if (cma.is_ok()) return std::unique_ptr<fabric::LocalFabric>(std::move(cma).value());
    if (cma.status().code() != Code::kUnsupported) return cma.status();
    log.warn(cma.status().message() + "; using the UCX fabric");
  }
  fabric::UcxFabricConfig fc;
  fc.rank = config.rank;
  fc.transports = config.local.transports;
  fc.limits.chunk_bytes = config.chunk_bytes;
  fc.limits.max_bytes_in_flight = config.window_bytes;
  fc.limits.max_bytes_per_endpoint = config.window_bytes;
  Result<std::unique_ptr<fabric::UcxFabric>> ucx = fabric::UcxFabric::create(fc);
  if (!ucx.is_ok()) return ucx.status();
  return std::unique_ptr<fabric::LocalFabric>(std::move(ucx).value());
}

}  // namespace

struct ReceiverAgent::Report {
  int64_t version = 0;
  uint64_t epoch = 0;
  uint64_t network_bytes = 0;
  uint64_t local_bytes = 0;
  int64_t minimum_network_bytes = -1;
  bool solo = false;
  uint64_t pulls = 0;
  uint64_t gathers = 0, gathered_runs = 0, gather_unpacked = 0;  // docs/refresh.md, "Gathers"
  uint64_t pushes = 0;
  uint64_t retries = 0;
  double plan_s = 0, network_s = 0, local_s = 0, total_s = 0;
  // Verification ("verify": true).
  uint64_t verified_boxes = 0, verified_bytes = 0, unverified_bytes = 0;
  double verify_s = 0;
  bool verify_failed = false;  // a hash differed: not retried
  // The landing ring, when GETs went through it (transport/cuda/staging.h).
  bool landing = false;
  uint64_t landing_slots = 0, landing_chunks = 0, landing_copies = 0, landing_held = 0;
  bool touched = false;        // some attempt began writing the buffers
  bool lease_lost = false;     // the lease expired or was revoked under the refresh: not retried
};

ReceiverAgent::ReceiverAgent(AgentConfig config)
    : config_(std::move(config)), log_("receiver " + std::to_string(config_.rank), config_.log_level) {}

Result<std::unique_ptr<ReceiverAgent>> ReceiverAgent::create(std::string_view config_json) {
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
  if (!config.is_ok()) return config.status();
  std::unique_ptr<ReceiverAgent> a(new ReceiverAgent(std::move(config).value()));
  if (a->config_.recipe) {
    Result<std::shared_ptr<const RecipeLayout>> recipe = load_recipe(*a->config_.recipe);
    if (!recipe.is_ok()) return recipe.status();
    a->recipe_ = std::move(recipe).value();
  }
  ucx::ContextConfig net;
  net.name = "network";
  net.transports = a->config_.network.transports;
  net.devices = a->config_.network.devices;
  net.route_to = a->config_.coordinator.host;  // the default device (transport/ucx/route.h)
  Result<ucx::Context> nc = ucx::Context::create(net);
  if (!nc.is_ok()) return nc.status().with_context("config: \"network\"");
  a->net_context_.emplace(std::move(nc).value());
  Result<ucx::Worker> worker = ucx::Worker::create(*a->net_context_, ucx::ThreadMode::kSerialized);
  if (!worker.is_ok()) return worker.status();
  a->net_worker_.emplace(std::move(worker).value());
  Result<std::unique_ptr<fabric::LocalFabric>> fabric = make_fabric(a->config_, a->log_, &a->copy_ops_, &a->fabric_gpu_);
  if (fabric.is_ok() && !a->copy_ops_ && landing_ring_forced()) {
    // The GPU path's landing logic on host buffers (docs/refresh.md).
    a->copy_ops_ = std::make_unique<cuda::HostCopyOps>();
    a->log_.info("REFIT_LANDING_RING: GETs land in the landing ring and are copied on to the host buffers");
  }
  if (!fabric.is_ok()) return fabric.status().with_context("config: \"local\"");
  a->fabric_ = std::move(fabric).value();
  Result<std::unique_ptr<CoordinatorLink>> link = CoordinatorLink::connect(a->config_, a->log_);
  if (!link.is_ok()) return link.status();
  a->link_ = std::move(link).value();
  return a;
}

ReceiverAgent::~ReceiverAgent() {
  if (async_.joinable()) async_.join();
  if (link_ && joined_) {
    link_->stop_heartbeat();
    Result<Json> r = link_->request(MsgType::kUnregister,
                                    control::to_json(control::MemberRef{control::Role::kReceiver, config_.rank}));
    if (!r.is_ok()) log_.info("leaving: " + r.status().message());
  }
  link_.reset();
  compiled_.reset();
  fabric_.reset();
  copy_ops_.reset();  // waits for its copies, before the memory they touch goes
  sources_.clear();  // endpoints before their worker
  buffers_.clear();  // memory before the context
  ring_region_.reset();
  ring_memory_.reset();
  net_worker_.reset();
  net_context_.reset();
}

Status ReceiverAgent::add_buffer(std::string_view description, void* data, uint64_t bytes) {
  if (refresh_running()) return Status::invalid("add_buffer: a refresh is running");
  Result<BufferPart> part = parse_receiver_buffer(description, config_.rank, recipe_.get());
  if (!part.is_ok()) return part.status();
  for (const Buf& b : buffers_) {
    if (b.part.name == part->name) return Status::invalid("buffer \"" + b.part.name + "\" was already added");
  }
  if (data == nullptr || bytes == 0) return Status::invalid("buffer \"" + part->name + "\": data is NULL or bytes is 0");
  if (part->bytes > 0 && static_cast<uint64_t>(part->bytes) > bytes) {
    return Status::invalid("buffer \"" + part->name + "\": its layout needs " + std::to_string(part->bytes) +
                           " bytes, the buffer given has " + std::to_string(bytes));
  }
  REFIT_RETURN_IF_ERROR(check_segments_fit(*part, bytes));
  if (part->segments.empty()) return Status::ok();  // this rank holds no part of it
  Buf b;
  b.part = std::move(part).value();
  b.part.bytes = static_cast<int64_t>(bytes);
  b.live = static_cast<uint8_t*>(data);
  b.data = b.live;
  b.bytes = bytes;
  // The "nccl" fabric passes GPU memory of its device, the others host
  // memory (the probe asks the driver, and makes no CUDA context).
  const cuda::PointerKind kind = cuda::probe_pointer(b.live);
  b.device = kind.device;
  if (b.device && config_.local_fabric != "nccl") {
    return Status::invalid("buffer \"" + b.part.name + "\" is GPU memory (device " + std::to_string(kind.ordinal) +
                           "); GPU buffers need \"local\": {\"fabric\": \"nccl\"}");
  }
  if (b.device && kind.ordinal != fabric_gpu_) {
    return Status::invalid("buffer \"" + b.part.name + "\" is memory of GPU " + std::to_string(kind.ordinal) +
                           ", the receiver's NCCL fabric runs on GPU " + std::to_string(fabric_gpu_) +
                           " (\"local\": {\"device\": ...})");
  }
  if (!b.device && config_.local_fabric == "nccl") {
    return Status::invalid("buffer \"" + b.part.name + "\" is host memory; the \"nccl\" local fabric passes GPU "
                           "memory only (use \"cma\" or \"ucx\" for host buffers)");
  }
  if (config_.staged) {  // refreshes land here; commit() copies them into `live`
    if (b.device) {
      REFIT_RETURN_IF_ERROR(device_staging(&b));
    } else {
      b.staging = map_host_memory(bytes);
      if (!b.staging) return Status::invalid("buffer \"" + b.part.name + "\": cannot allocate " +
                                             std::to_string(bytes) + " bytes of staging memory");
      std::memcpy(b.staging.get(), b.live, bytes);  // bytes outside the segments stay as they were
      b.data = b.staging.get();
    }
  }
  Result<ucx::MemoryRegion> net = ucx::MemoryRegion::map(*net_context_, b.data, bytes, b.part.name);
  if ((b.device && (!net.is_ok() || net->type() != ucx::MemoryType::kCuda)) || (!b.device && copy_ops_)) {
    // This UCX cannot write device memory: GETs land in the landing ring.
    REFIT_RETURN_IF_ERROR(landing_ring(/*pinned=*/b.device).with_context("buffer \"" + b.part.name + "\""));
    b.ring = true;
  } else if (!net.is_ok()) {
    return net.status();
  }
  Result<std::vector<uint8_t>> key = fabric_->register_buffer(b.part.name, b.data, bytes);
  if (!key.is_ok()) return key.status();
  if (!b.ring) b.net_region.emplace(std::move(net).value());
  b.local_key = std::move(key).value();
  buffers_.push_back(std::move(b));
  changed_ = true;
  return Status::ok();
}

Status ReceiverAgent::device_staging(Buf* b) {
#ifdef HAVE_CUDA
  Result<cuda::DeviceBuffer> staging = cuda::DeviceBuffer::allocate(fabric_gpu_, b->bytes);
  if (!staging.is_ok()) return staging.status().with_context("buffer \"" + b->part.name + "\": staging copy");
  auto owner = std::make_shared<cuda::DeviceBuffer>(std::move(staging).value());
  // Bytes outside the segments stay as they were.
  cuda::Copy c;
  c.dst = owner->data();
  c.src = b->live;
  c.width = b->bytes;
  REFIT_RETURN_IF_ERROR(copy_and_wait({c}).with_context("buffer \"" + b->part.name + "\": staging copy"));
  b->data = owner->data();
  b->device_memory = std::shared_ptr<void>(owner, owner.get());
  return Status::ok();
#else
  return Status::internal("buffer \"" + b->part.name + "\": GPU memory in a build without CUDA");
#endif
}

Status ReceiverAgent::copy_and_wait(const std::vector<cuda::Copy>& copies) {
  // Local copies end in bounded time: a generous bound only catches a
  // broken device.
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(60);
  REFIT_RETURN_IF_ERROR(copy_ops_->copy_all(copies));
  Result<uint64_t> ticket = copy_ops_->record();
  if (!ticket.is_ok()) return ticket.status();
  while (true) {
    Result<bool> done = copy_ops_->done(*ticket);
    if (!done.is_ok()) return done.status();
    if (*done) return Status::ok();
    if (Clock::now() >= deadline) return Status::timeout("GPU copies did not finish within 60 s");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Status ReceiverAgent::landing_ring(bool pinned) {
  if (ring_memory_) return Status::ok();
  const uint64_t bytes = config_.landing_bytes;
  std::shared_ptr<uint8_t> memory;
  if (!pinned) {  // REFIT_LANDING_RING on host buffers
    memory = map_host_memory(bytes);
    if (!memory) return Status::invalid("cannot allocate the landing ring (" + std::to_string(bytes) + " bytes)");
  } else {
#ifdef HAVE_CUDA
    Result<cuda::PinnedBuffer> pinned_memory = cuda::PinnedBuffer::allocate(bytes);
    if (!pinned_memory.is_ok()) return pinned_memory.status().with_context("landing ring (\"landing_bytes\")");
    auto owner = std::make_shared<cuda::PinnedBuffer>(std::move(pinned_memory).value());
    memory = std::shared_ptr<uint8_t>(owner, owner->data());
#else
    return Status::internal("GPU memory in a build without CUDA");
#endif
  }
  Result<ucx::MemoryRegion> region = ucx::MemoryRegion::map(*net_context_, memory.get(), bytes, "landing ring");
  if (!region.is_ok()) return region.status();
  ring_region_.emplace(std::move(region).value());
  ring_memory_ = std::move(memory);
  return Status::ok();
}

Status ReceiverAgent::join() {
  if (joined_ && link_->dropped()) joined_ = false;  // declared dead: the coordinator holds nothing of it
  if (joined_ && !changed_) return Status::ok();
  if (buffers_.empty()) return Status::invalid("join: add at least one buffer first");
  const control::MemberRef me{control::Role::kReceiver, config_.rank};
  if (joined_) {
    link_->stop_heartbeat();
    Result<Json> r = link_->request(MsgType::kUnregister, control::to_json(me));
    if (!r.is_ok()) return r.status().with_context("re-registering");
    joined_ = false;
  }
  control::RegisterReceiver m;
  m.rank = config_.rank;
  m.instance = config_.instance;
  m.domain = config_.domain;
  m.instance_ranks = config_.instance_ranks;
  m.worker_address = fabric_->contact();
  for (const Buf& b : buffers_) {
    control::MemberBuffer mb;
    mb.name = b.part.name;
    mb.dtype = b.part.dtype;
    mb.bytes = static_cast<int64_t>(b.bytes);
    mb.address = reinterpret_cast<uint64_t>(b.data);
    mb.rkey = b.local_key;
    mb.segments = b.part.segments;
    m.buffers.push_back(std::move(mb));
  }
  Result<Json> r = link_->request(MsgType::kRegisterReceiver, control::to_json(m));
  if (!r.is_ok()) return r.status();
  joined_ = true;
  changed_ = false;
  compiled_.reset();
  link_->start_heartbeat(me);
  return Status::ok();
}

Result<ucx::Endpoint*> ReceiverAgent::endpoint(int32_t rank, const std::vector<uint8_t>& address) {
  Peer& p = sources_[rank];
  if (p.ep && (p.ep->failed() || p.address != address)) {
    p.ep.reset();
    p.rkey_ids.clear();
  }
  if (!p.ep) {
    Result<ucx::Endpoint> ep = ucx::Endpoint::create(*net_worker_, address, "source " + std::to_string(rank));
    if (!ep.is_ok()) return ep.status();
    p.ep.emplace(std::move(ep).value());
    p.address = address;
  }
  return &*p.ep;
}

uint64_t ReceiverAgent::rkey_id(int32_t rank, const std::string& buffer, const std::vector<uint8_t>& rkey) {
  Peer& p = sources_[rank];
  std::string key = buffer;
  key.push_back('\0');
  key.append(rkey.begin(), rkey.end());
  auto [it, inserted] = p.rkey_ids.emplace(std::move(key), 0);
  if (inserted) it->second = next_rkey_id_++;
  return it->second;
}

Result<std::shared_ptr<CompiledPart>> ReceiverAgent::compile(const Json& reply) {
  auto part = std::make_shared<CompiledPart>();
  part->epoch = reply.value("epoch", uint64_t{0});
  part->schedule.epoch = part->epoch;
  if (reply.contains("plan")) {
    part->minimum_network_bytes = reply["plan"].value("minimum_network_bytes", int64_t{-1});
    part->solo = reply["plan"].value("solo", false);
  }
  const int32_t me = config_.rank;
  auto bad = [](const std::string& why) { return Status::invalid("plan from the coordinator: " + why); };
  try {
    // Where the peers' buffers are. Sources: address and rkey id for the
    // GETs. Receivers of the domain: a fabric peer with the buffers named.
    struct SourceBuf {
      uint64_t address = 0;
      uint64_t rkey_id = 0;
    };
    std::map<std::pair<int32_t, std::string>, SourceBuf> source_bufs;
    std::map<int32_t, uint32_t> fabric_peer;                          // receiver rank -> schedule peer
    std::map<std::pair<int32_t, std::string>, uint32_t> fabric_buf;   // (rank, buffer) -> index in its peer
    const Json& peers = reply.at("peers");
    for (const Json& p : peers.at("sources")) {
      const int32_t rank = p.at("rank").get<int32_t>();
      part->source_addresses[rank] = p.at("worker_address").get_binary();
      for (const Json& b : p.at("buffers")) {
        const std::string name = b.at("name").get<std::string>();
        const std::vector<uint8_t>& key = b.at("rkey").get_binary();
        const uint64_t id = rkey_id(rank, name, key);
        part->source_keys[rank].emplace_back(id, key);
        source_bufs[{rank, name}] = SourceBuf{b.at("address").get<uint64_t>(), id};
      }
    }
    if (peers.contains("domain")) {
      for (const Json& m : peers.at("domain")) {
        part->schedule.domain.push_back(
            fabric::DomainMember{m.at("rank").get<int32_t>(), m.at("worker_address").get_binary()});
      }
    }
    for (const Json& p : peers.at("receivers")) {
      fabric::Peer peer;
      peer.rank = p.at("rank").get<int32_t>();
      peer.contact = p.at("worker_address").get_binary();
      for (const Json& b : p.at("buffers")) {
        fabric_buf[{peer.rank, b.at("name").get<std::string>()}] = static_cast<uint32_t>(peer.buffers.size());
        peer.buffers.push_back(fabric::RemoteBuffer{b.at("address").get<uint64_t>(), b.at("rkey").get_binary()});
      }
      fabric_peer[peer.rank] = static_cast<uint32_t>(part->schedule.peers.size());
      part->schedule.peers.push_back(std::move(peer));
    }
    std::map<std::string, size_t> mine;
    for (size_t i = 0; i < buffers_.size(); ++i) mine[buffers_[i].part.name] = i;
    part->written.assign(buffers_.size(), {});
    // Resolves a run's end in this rank; `writes` records the range as written.
    auto my_range = [&](const Json& end, uint64_t bytes, const std::string& what, uint8_t** out,
                        bool writes = false, const Buf** which = nullptr) -> Status {
      const std::string name = end.at("buffer").get<std::string>();
      const uint64_t offset = end.at("offset").get<uint64_t>();
      auto it = mine.find(name);
      if (it == mine.end()) return bad(what + " names buffer \"" + name + "\", which this rank does not have");
      const Buf& b = buffers_[it->second];
      if (offset > b.bytes || bytes > b.bytes - offset) {
        return bad(what + " [" + std::to_string(offset) + ", +" + std::to_string(bytes) + ") lies outside buffer \"" +
                   name + "\" (" + std::to_string(b.bytes) + " bytes)");
      }
      *out = b.data + offset;
      if (which) *which = &b;
      if (writes) part->written[it->second].emplace_back(offset, bytes);
      return Status::ok();
    };
    struct Interval {
      const uint8_t* begin;
      const uint8_t* end;
      uint32_t net;
    };
    std::vector<Interval> landed;
    std::vector<std::pair<const uint8_t*, const uint8_t*>> reads;  // per send
    const Json& runs = reply.at("runs");
    for (size_t i = 0; i < runs.size(); ++i) {
      const Json& run = runs[i];
      const std::string what = "run " + std::to_string(i);
      const uint64_t bytes = run.at("bytes").get<uint64_t>();
      if (bytes == 0) return bad(what + " has no bytes");
      const Json& from = run.at("from");
      const Json& to = run.at("to");
      const int32_t from_rank = from.at("rank").get<int32_t>();
      const int32_t to_rank = to.at("rank").get<int32_t>();
      if (run.at("kind") == "net") {
        if (to_rank != me || from.at("side") != "source") return bad(what + " is a network run for another rank");
        CompiledPart::Get g;
        const Buf* target = nullptr;
        REFIT_RETURN_IF_ERROR(my_range(to, bytes, what, &g.local, /*writes=*/true, &target));
        uint8_t* const final_place = g.local;
        auto sb = source_bufs.find({from_rank, from.at("buffer").get<std::string>()});
        if (sb == source_bufs.end()) {
          return bad(what + " reads buffer \"" + from.at("buffer").get<std::string>() + "\" of source rank " +
                     std::to_string(from_rank) + ", which is not among the peers");
        }
        g.source = from_rank;
        g.rkey_id = sb->second.rkey_id;
        g.remote = sb->second.address + from.at("offset").get<uint64_t>();
        g.bytes = bytes;
        if (target->ring) {  // lands in the landing ring, then goes on to the device
          g.device = final_place;
          g.local = nullptr;
          part->device_landing = true;
        }
        landed.push_back({final_place, final_place + bytes, static_cast<uint32_t>(part->net.size())});
        part->net.push_back(std::move(g));
        part->network_bytes += bytes;
        continue;
      }
      if (from.at("side") != "receiver") return bad(what + " is a local run that reads a source");
      if (from_rank != me) {
        if (to_rank != me) return bad(what + " is a local run between two other ranks");
        auto fp = fabric_peer.find(from_rank);
        if (fp == fabric_peer.end()) return bad(what + " comes from receiver rank " + std::to_string(from_rank) + ", not among the peers");
        fabric::Recv r;
        r.peer = fp->second;
        REFIT_RETURN_IF_ERROR(my_range(to, bytes, what, &r.dst, /*writes=*/true));
        r.bytes = bytes;
        part->schedule.recvs.push_back(r);
        continue;
      }
      fabric::Send s;
      uint8_t* src = nullptr;
      REFIT_RETURN_IF_ERROR(my_range(from, bytes, what, &src));
      s.src = src;
      s.bytes = bytes;
      if (to_rank == me) {
        REFIT_RETURN_IF_ERROR(my_range(to, bytes, what, &s.self_dst, /*writes=*/true));
      } else {
        auto fp = fabric_peer.find(to_rank);
        auto fb = fabric_buf.find({to_rank, to.at("buffer").get<std::string>()});
        if (fp == fabric_peer.end() || fb == fabric_buf.end()) {
          return bad(what + " writes buffer \"" + to.at("buffer").get<std::string>() + "\" of receiver rank " +
                     std::to_string(to_rank) + ", which is not among the peers");
        }
        s.peer = fp->second;
        s.buffer = fb->second;
        s.offset = to.at("offset").get<uint64_t>();
        part->local_bytes += bytes;
      }
      reads.push_back({src, src + bytes});
      part->schedule.sends.push_back(s);
    }
    // Gathers: small host runs of one source travel as one request
    // (docs/refresh.md, "Gathers"); device runs stay plain GETs.
    {
      std::vector<ucx::NetRunRef> refs;
      for (const CompiledPart::Get& g : part->net) {
        refs.push_back(ucx::NetRunRef{g.source, ucx::GatherPart{g.rkey_id, g.remote, g.local, g.bytes},
                                      g.device == nullptr});
      }
      part->gathers = ucx::make_gather_ops(refs, config_.gather);
    }
    // Each send waits for the network runs that bring the bytes it reads.
    std::sort(landed.begin(), landed.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
    part->dependents.assign(part->net.size(), {});
    part->send_deps.assign(reads.size(), 0);
    for (uint32_t op = 0; op < reads.size(); ++op) {
      const auto [begin, end] = reads[op];
      auto it = std::upper_bound(landed.begin(), landed.end(), begin,
                                 [](const uint8_t* p, const Interval& iv) { return p < iv.begin; });
      if (it != landed.begin()) --it;
      const uint8_t* covered = begin;
      for (; it != landed.end() && it->begin < end; ++it) {
        if (it->end <= covered) continue;
        if (it->begin > covered) break;
        part->dependents[it->net].push_back(op);
        ++part->send_deps[op];
        covered = it->end;
      }
      if (covered < end) {
        return bad("local run " + std::to_string(op) + " passes on bytes that this rank does not pull");
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return bad(std::string("malformed: ") + e.what());
  }
  for (auto& ranges : part->written) {  // sort and merge
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uint64_t, uint64_t>> merged;
    for (const auto& [off, n] : ranges) {
      if (!merged.empty() && merged.back().first + merged.back().second >= off) {
        merged.back().second = std::max(merged.back().first + merged.back().second, off + n) - merged.back().first;
      } else {
        merged.emplace_back(off, n);
      }
    }
    ranges = std::move(merged);
  }
  return part;
}

Status ReceiverAgent::execute(const CompiledPart& part, int64_t version, Clock::time_point deadline, Report* report) {
  fabric::Schedule schedule = part.schedule;  // a copy: the version is this refresh's
  schedule.version = version;
  // Network endpoints, keys and the engine, while no engine runs. If that
  // fails, the peers of the domain are told at once (a failed flag) rather
  // than left waiting for this rank until their deadline.
  std::map<int32_t, ucx::Endpoint*> eps;
  std::unique_ptr<ucx::GetEngine> net;
  auto setup = [&]() -> Status {
    for (const auto& [rank, address] : part.source_addresses) {
      Result<ucx::Endpoint*> ep = endpoint(rank, address);
      if (!ep.is_ok()) return ep.status();
      auto keys = part.source_keys.find(rank);
      if (keys != part.source_keys.end()) {
        for (const auto& [id, packed] : keys->second) REFIT_RETURN_IF_ERROR((*ep)->import_rkey(id, packed));
      }
      eps[rank] = *ep;
    }
    ucx::GetEngineOptions options;
    options.progress_thread = true;
    options.limits.chunk_bytes = config_.chunk_bytes;
    options.limits.max_bytes_in_flight = config_.window_bytes;
    options.limits.max_bytes_per_endpoint = config_.window_bytes;
    Result<std::unique_ptr<ucx::GetEngine>> engine = ucx::GetEngine::create(*net_worker_, options);
    if (!engine.is_ok()) return engine.status();
    net = std::move(engine).value();
    return Status::ok();
  };
  if (Status st = setup(); !st.is_ok()) {
    if (fabric_->begin(schedule, deadline).is_ok()) (void)fabric_->finish(/*failed=*/true);
    fabric_->end();
    return st;
  }
  for (const Buf& b : buffers_) {
    if (b.net_region) net->add_local_region(*b.net_region);
  }
  if (ring_region_) net->add_local_region(*ring_region_);
  // The engine's runs: a GET straight into its place for each network run,
  // or, for a run through the landing ring, one per chunk of the ring, into
  // a slot (the ring's gate holds it until a slot is free).
  std::vector<ucx::GetRun> gets;
  std::vector<int64_t> get_chunk;      // per engine run: its ring chunk, or -1
  std::vector<uint32_t> get_net;       // per engine run: its network run (direct)
  std::vector<uint32_t> ring_net;      // per ring run: its network run
  std::unique_ptr<cuda::LandingRing> ring;
  if (part.device_landing) {
    std::vector<cuda::StagedRun> ring_runs;
    for (uint32_t i = 0; i < part.net.size(); ++i) {
      if (part.net[i].device == nullptr) continue;
      ring_runs.push_back(cuda::StagedRun{{cuda::DevicePlace{part.net[i].device, part.net[i].bytes}}});
      ring_net.push_back(i);
    }
    Result<std::unique_ptr<cuda::LandingRing>> made = cuda::LandingRing::create(
        *copy_ops_, std::span<uint8_t>(ring_memory_.get(), config_.landing_bytes),
        cuda::StagingOptions{config_.chunk_bytes, static_cast<uint32_t>(config_.landing_bytes / config_.chunk_bytes)},
        std::move(ring_runs));
    if (!made.is_ok()) {
      if (fabric_->begin(schedule, deadline).is_ok()) (void)fabric_->finish(/*failed=*/true);
      fabric_->end();
      return made.status();
    }
    ring = std::move(made).value();
  }
  for (uint32_t i = 0; i < part.net.size(); ++i) {
    const CompiledPart::Get& g = part.net[i];
    if (g.device != nullptr || part.gathers.gathered[i]) continue;
    gets.push_back(ucx::GetRun{eps.at(g.source), g.rkey_id, g.remote, g.local, g.bytes});
    get_chunk.push_back(-1);
    get_net.push_back(i);
  }
  if (ring) {
    const std::vector<cuda::StagedChunk>& chunks = ring->chunks();
    for (uint32_t k = 0; k < chunks.size(); ++k) {
      const CompiledPart::Get& g = part.net[ring_net[chunks[k].run]];
      // Named at the ring's start; the gate moves it to the slot it gets.
      gets.push_back(ucx::GetRun{eps.at(g.source), g.rkey_id, g.remote + chunks[k].offset, ring->base(),
                                 chunks[k].bytes});
      get_chunk.push_back(k);
      get_net.push_back(ring_net[chunks[k].run]);
    }
  }

  // Gathers: one engine run each, releasing the sends of all its runs.
  std::vector<int64_t> get_gather(gets.size(), -1);  // per engine run: its gather, or -1
  for (uint32_t k = 0; k < part.gathers.ops.size(); ++k) {
    const ucx::GatherOps::Op& op = part.gathers.ops[k];
    gets.push_back(ucx::GetRun{eps.at(op.peer), 0, 0, nullptr, op.bytes, ucx::Op::kGet, op.parts});
    get_chunk.push_back(-1);
    get_net.push_back(op.runs.front());
    get_gather.push_back(k);
  }

  // The fan-out: sends become ready as the network runs they read land.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint32_t> ready;
  bool net_done = false;
  bool net_ok = false;
  std::vector<uint32_t> deps = part.send_deps;
  for (uint32_t i = 0; i < deps.size(); ++i) {
    if (deps[i] == 0) ready.push_back(i);
  }
  // Releases the sends that read network run `run` once nothing else holds
  // them back; REQUIRES mu. Returns whether any became ready.
  auto release = [&](uint32_t run) {
    bool any = false;
    for (uint32_t op : part.dependents[run]) {
      if (--deps[op] == 0) {
        ready.push_back(op);
        any = true;
      }
    }
    return any;
  };
  // Through the landing ring (GPU buffers, a UCX without CUDA support): the
  // lander runs the ring's copy stage, which copies each chunk on to device
  // memory as it lands and releases a run's sends once all of it is there
  // (the NCCL fabric's stream waits for the copies; the host fabrics read
  // the bytes at once, so for them "there" means the copies completed).
  // The fan-out ends once the lander has seen every copy through.
  bool landing_done = !part.device_landing;   // guarded by mu
  Status landing_status;                      // the lander's
  auto inputs_done = [&] { return net_done && landing_done; };  // REQUIRES mu
  Status fan_status = fabric_->begin(schedule, deadline);
  Clock::time_point fan_end = Clock::now();
  // A watcher cancels the wait for peers at once instead of at the deadline
  // when the instance aborts (staged: another rank failed) or the
  // membership changes (a peer of the domain died or left: the next attempt
  // runs the new plan).
  // It must stop as soon as the transfer ends (the refresh waits for it):
  // it sleeps on a condition variable, and listens for an abort in short
  // slices (the coordinator connection cannot be woken).
  // Whether the fabric began: read here, before the fan-out thread (which
  // writes fan_status) starts.
  const bool begun = fan_status.is_ok();
  std::atomic<bool> watching{begun};
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  std::string abort_reason;       // the instance aborted: not retried
  std::atomic<bool> replanned{false};
  std::thread watcher;
  if (watching.load()) {
    watcher = std::thread([&] {
      auto next_check = Clock::now() + kMembershipCheck;
      while (watching.load(std::memory_order_acquire) && Clock::now() < deadline) {
        if (config_.staged) {
          const auto until = std::min({deadline, next_check, Clock::now() + kAbortSlice});
          Result<std::optional<control::Frame>> n = link_->wait_notice_of({MsgType::kAbort}, until);
          if (n.is_ok() && n->has_value() && (**n).body.value("version", int64_t{0}) == version) {
            abort_reason = (**n).body.value("reason", std::string("no reason given"));
            // Only the wait for peers ends: the network goes on, since the
            // ranks of other instances in the domain may still need the
            // slices this rank pulls and passes on.
            fabric_->cancel();
            return;
          }
        } else {
          std::unique_lock<std::mutex> lock(watch_mu);
          watch_cv.wait_until(lock, std::min(deadline, next_check),
                              [&] { return !watching.load(std::memory_order_acquire); });
        }
        if (Clock::now() < next_check || !watching.load(std::memory_order_acquire)) continue;
        next_check = Clock::now() + kMembershipCheck;
        Result<Json> p = link_->request(MsgType::kFetchPlan, Json{{"rank", config_.rank}, {"epoch", part.epoch}});
        if (p.is_ok() && !p->value("unchanged", false)) {
          replanned.store(true, std::memory_order_release);
          fabric_->cancel();  // as for an abort, the network goes on for the peers
          return;
        }
      }
    });
  }
  std::thread fan;
  if (begun) {
    fan = std::thread([&] {
      size_t done = 0;
      bool finished = false;
      while (fan_status.is_ok() && !finished) {
        std::vector<uint32_t> take;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return !ready.empty() || inputs_done(); });
          take.swap(ready);
          finished = inputs_done();
        }
        if (!take.empty()) fan_status = fabric_->send(take);
        done += take.size();
      }
      if (fan_status.is_ok() && net_ok && landing_status.is_ok() && done != schedule.sends.size()) {
        fan_status = Status::internal(std::to_string(schedule.sends.size() - done) + " local runs never became ready");
      }
      const Status finished_status = fabric_->finish(!fan_status.is_ok() || !net_ok || !landing_status.is_ok());
      if (fan_status.is_ok() && net_ok) fan_status = finished_status;
      fan_end = Clock::now();
    });
  }

  std::thread lander;
  if (ring && begun) {
    lander = std::thread([&] {
      const bool fabric_waits = config_.local_fabric == "nccl";
      // Copies are local and end in bounded time, also past the refresh's
      // deadline (a failed refresh must not leave copies writing the
      // buffers after it returned); the bound only catches a broken device.
      const Clock::time_point bound = std::max(deadline, Clock::now() + std::chrono::seconds(60));
      landing_status = ring->run(
          [&](uint32_t ring_run) {
            std::lock_guard<std::mutex> lock(mu);
            if (release(ring_net[ring_run])) cv.notify_one();
          },
          [&] { net->wake(); }, fabric_waits, bound);
      if (!landing_status.is_ok()) net->halt(landing_status);  // the refresh failed: stop pulling
      {
        std::lock_guard<std::mutex> lock(mu);
        landing_done = true;
      }
      cv.notify_one();
    });
  }

  const Clock::time_point start = Clock::now();
  ucx::BatchReport r;
  if (begun) {
    r = net->run_batch(
        gets, deadline,
        [&](uint32_t run, const Status& st) {
          // A failed run fails the refresh: the rest need not be pulled (a
          // new attempt plans anew).
          if (!st.is_ok()) net->halt(st);
          if (get_chunk[run] >= 0) {
            ring->landed(static_cast<uint32_t>(get_chunk[run]), st);
            return;
          }
          if (!st.is_ok()) return;
          std::lock_guard<std::mutex> lock(mu);
          bool any = false;
          if (get_gather[run] >= 0) {
            for (uint32_t n : part.gathers.ops[get_gather[run]].runs) any = release(n) || any;
          } else {
            any = release(get_net[run]);
          }
          if (any) cv.notify_one();
        },
        ring ? ucx::GetEngine::Gate([&](uint32_t run, void** local) {
          return get_chunk[run] < 0 || ring->acquire(static_cast<uint32_t>(get_chunk[run]), local);
        })
             : ucx::GetEngine::Gate());
  }
  if (ring) ring->network_over();
  const Clock::time_point net_end = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    net_done = true;
    net_ok = r.status.is_ok();
  }
  cv.notify_one();
  if (lander.joinable()) lander.join();
  if (fan.joinable()) fan.join();
  {
    std::lock_guard<std::mutex> lock(watch_mu);
    watching.store(false, std::memory_order_release);
  }
  watch_cv.notify_all();
  if (watcher.joinable()) watcher.join();
  fabric_->end();
  if (fabric_->contact_changed()) changed_ = true;  // registered anew before the next refresh
  if (replanned.load() && !fan_status.is_ok()) {
    return Status::io_error("the membership changed during the refresh (a peer died or left): " +
                            fan_status.message());
  }
  if (!abort_reason.empty()) {
    aborted_ = true;
    return Status::io_error("instance " + std::to_string(config_.instance) + " aborted version " +
                            std::to_string(version) + ": " + abort_reason);
  }
  report->network_s = seconds_between(start, net_end);
  report->local_s = seconds_between(start, fan_end);
  report->pulls = part.net.size();
  report->gathers = part.gathers.ops.size();
  report->gathered_runs = part.gathers.gathered_runs;
  report->gather_unpacked = part.gathers.unpacked;
  report->pushes = schedule.sends.size();
  if (ring) {
    report->landing = true;
    const cuda::StagingStats stats = ring->stats();
    report->landing_slots = ring->slots();
    report->landing_chunks = stats.chunks;
    report->landing_copies = stats.copies;
    report->landing_held = stats.held;
  }
  report->network_bytes = r.bytes_done;
  report->local_bytes = part.local_bytes;
  if (!r.status.is_ok()) return r.status.with_context("network");
  if (!landing_status.is_ok()) return landing_status.with_context("landing copies");
  return fan_status;
}

Status ReceiverAgent::run_refresh(int64_t requested, Clock::time_point deadline, Report* report) {
  const Clock::time_point t0 = Clock::now();
  REFIT_RETURN_IF_ERROR(join());
  Result<Json> sub = link_->request(MsgType::kSubscribe, Json::object());
  if (!sub.is_ok()) return sub.status();
  int64_t latest = sub->value("version", int64_t{0});
  int64_t want = requested == -1 ? 1 : requested;
  std::string drained;  // REFIT_LATEST: why the latest known version was passed over
  int64_t version = 0;
  Json lease;
  std::chrono::milliseconds lease_timeout{60000};
  while (true) {
    while (latest < want) {
      Result<std::optional<Json>> n = link_->wait_notice(MsgType::kVersionNotify, deadline);
      if (!n.is_ok()) return n.status();
      if (!n->has_value()) {
        if (!drained.empty()) {
          return Status::timeout("no version newer than " + std::to_string(latest) +
                                 " was published before the deadline, and that one can no longer be read: " +
                                 drained);
        }
        return Status::timeout(requested == -1 ? std::string("no version was published before the deadline")
                                               : "version " + std::to_string(requested) +
                                                     " was not published before the deadline (the latest is " +
                                                     std::to_string(latest) + ")");
      }
      latest = std::max(latest, (**n).value("version", int64_t{0}));
    }
    version = requested == -1 ? latest : requested;
    if (version < latest) {
      return Status::not_found("version " + std::to_string(version) + " is older than " + std::to_string(latest) +
                               ", the latest published: the sources hold only the latest");
    }
    lease = Json{{"rank", config_.rank}, {"version", version}};
    Result<Json> leased = link_->request(MsgType::kLease, lease);
    if (leased.is_ok()) {
      lease_timeout = std::chrono::milliseconds(leased->value("timeout_ms", int64_t{60000}));
      break;
    }
    const std::string& why = leased.status().message();
    if (requested == -1 && leased.status().code() == Code::kNotFound &&
        why.find("was drained") != std::string::npos) {
      // The sources are overwriting it: the latest is the next version.
      drained = why;
      want = version + 1;
      continue;
    }
    if (why.find("(\"instance_ranks\") registered") == std::string::npos) return leased.status();
    // A rank of the instance has not joined (yet): wait for it.
    if (Clock::now() + kRetryPause >= deadline) return Status::timeout(why + ", until the deadline");
    std::this_thread::sleep_for(kRetryPause);
    Result<Json> again = link_->request(MsgType::kSubscribe, Json::object());
    if (!again.is_ok()) return again.status();
    latest = std::max(latest, again->value("version", int64_t{0}));
  }
  report->version = version;
  if (log_.enabled(LogLevel::kDebug)) {
    log_.debug("refresh to " + std::to_string(version) + ": version known after " +
               std::to_string(seconds_between(t0, Clock::now())) + " s");
  }
  std::optional<LeaseKeeper> keeper;
  keeper.emplace(link_.get(), lease, lease_timeout);
  Json fetch{{"rank", config_.rank}};
  if (compiled_) fetch["epoch"] = compiled_->epoch;  // the coordinator then sends only "unchanged"
  Result<Json> plan = link_->request(MsgType::kFetchPlan, fetch);
  Status st = plan.status();
  if (st.is_ok() && !plan->value("unchanged", false)) {
    Result<std::shared_ptr<CompiledPart>> c = compile(*plan);
    st = c.status();
    if (st.is_ok()) compiled_ = std::move(c).value();
  }
  const Clock::time_point t1 = Clock::now();
  report->plan_s = seconds_between(t0, t1);
  if (log_.enabled(LogLevel::kDebug)) {
    log_.debug("refresh to " + std::to_string(version) + ": plan " +
               (plan.is_ok() && plan->value("unchanged", false) ? "unchanged" : "fetched") + " after " +
               std::to_string(report->plan_s) + " s");
  }
  if (st.is_ok()) {
    report->epoch = compiled_->epoch;
    report->minimum_network_bytes = compiled_->minimum_network_bytes;
    report->solo = compiled_->solo;
    st = execute(*compiled_, version, deadline, report);
  }
  if (st.is_ok() && config_.verify) st = verify(version, report);
  keeper->stop();
  Result<Json> released = link_->request(MsgType::kRelease, lease);
  if (!keeper->lost().empty() || (!released.is_ok() && released.status().code() == Code::kNotFound)) {
    // The sources may have overwritten what this refresh read.
    report->lease_lost = true;
    const std::string why = keeper->lost().empty() ? released.status().message() : keeper->lost();
    if (st.is_ok()) st = Status::io_error("the lease on version " + std::to_string(version) +
                                          " was lost during the refresh, so what it read cannot be trusted: " + why);
  } else if (st.is_ok() && !released.is_ok()) {
    st = released.status().with_context("the lease on version " + std::to_string(version) +
                                         " could not be released");
  }
  return st;
}

Status ReceiverAgent::verify(int64_t version, Report* report) {
  const Clock::time_point t0 = Clock::now();
  Result<Json> r = link_->request(MsgType::kVersionHashes, Json{{"rank", config_.rank}, {"version", version}});
  if (!r.is_ok()) return r.status().with_context("verify");
  const Json& hashes = (*r)["hashes"];
  for (const Json& h : hashes) {
    const size_t bi = h.value("buffer", size_t{0}), si = h.value("segment", size_t{0});
    if (bi >= buffers_.size() || si >= buffers_[bi].part.segments.size()) {
      return Status::internal("version_hashes: the coordinator named buffer " + std::to_string(bi) + " segment " +
                              std::to_string(si) + ", which this receiver did not register");
    }
    const Buf& b = buffers_[bi];
    const control::Segment& seg = b.part.segments[si];
    const std::optional<DType> dt = parse_dtype(seg.dtype.empty() ? b.part.dtype : seg.dtype);
    const int elem = dt ? dtype_bytes(*dt) : 1;
    const std::vector<int64_t> start = h.value("start", std::vector<int64_t>());
    const std::vector<int64_t> size = h.value("size", std::vector<int64_t>());
    Result<uint64_t> mine = hash_box(b.data, b.bytes, seg, elem, start, size);
    if (!mine.is_ok()) return mine.status().with_context("verify");
    const uint64_t theirs = h.value("hash", uint64_t{0});
    if (*mine != theirs) {
      report->verify_failed = true;
      return Status::io_error("verify: version " + std::to_string(version) + " of tensor \"" + seg.tensor +
                              "\" start " + h["start"].dump() + " size " + h["size"].dump() + " in buffer \"" +
                              b.part.name + "\" hashes to " + std::to_string(*mine) + ", but source rank " +
                              std::to_string(h.value("rank", -1)) + " published " + std::to_string(theirs) +
                              " for it: the bytes that arrived are not the ones published");
    }
    uint64_t n = static_cast<uint64_t>(elem);
    for (int64_t v : size) n *= static_cast<uint64_t>(v);
    ++report->verified_boxes;
    report->verified_bytes += n;
  }
  report->unverified_bytes = r->value("unverified_bytes", uint64_t{0});
  if (report->unverified_bytes > 0) {
    const Json& first = r->value("unverified", Json::array());
    log_.warn("verify: " + std::to_string(report->unverified_bytes) + " bytes of version " + std::to_string(version) +
              " have no published hash (a source without \"verify\", or a layout registered after the publish)" +
              (first.empty() ? std::string() : ", e.g. " + first[0].dump()));
  }
  report->verify_s = seconds_between(t0, Clock::now());
  return Status::ok();
}

Status ReceiverAgent::stage_barrier(Status st, int64_t version, Clock::time_point deadline) {
  // All or nothing for the instance: say how this rank did, then wait for
  // the coordinator's word for the whole instance.
  const Json body{{"rank", config_.rank}, {"version", version}};
  if (!st.is_ok()) {
    Json failed = body;
    failed["reason"] = st.message().substr(0, 1000);
    Result<Json> r = link_->request(MsgType::kReportFailed, failed);
    if (!r.is_ok()) log_.warn(r.status().message());
    return st;
  }
  Result<Json> r = link_->request(MsgType::kReportStaged, body);
  if (!r.is_ok()) return r.status();
  while (true) {
    // In slices, to notice at once when the coordinator declared this rank
    // dead: it then aborts the instance's version and tells this rank nothing.
    const Clock::time_point until = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    Result<std::optional<control::Frame>> n = link_->wait_notice_of({MsgType::kCommit, MsgType::kAbort}, until);
    if (!n.is_ok()) return n.status();
    if (!n->has_value() && link_->dropped()) {
      aborted_ = true;
      return Status::io_error("staged version " + std::to_string(version) +
                              ", but the coordinator declared this receiver dead meanwhile (its heartbeats came "
                              "later than the coordinator's timeout), so its instance aborted the version");
    }
    if (!n->has_value() && Clock::now() < deadline) continue;
    if (!n->has_value()) {
      // The deadline passed with every notice sent so far read: withdraw.
      // The coordinator answers in order, so its reply is the decision for
      // the whole instance: committed already (then this rank commits too;
      // commit is final), or aborted by this withdrawal.
      Json failed = body;
      failed["reason"] = "no commit before its deadline";
      Result<Json> w = link_->request(MsgType::kReportFailed, failed);
      if (w.is_ok() && w->value("committed", false)) {
        log_.info("staged version " + std::to_string(version) + ": the deadline passed, but the instance had "
                  "committed it; committing it too");
        staged_version_ = version;
        staged_ranges_ = compiled_->written;
        return Status::ok();
      }
      aborted_ = true;
      if (!w.is_ok()) {
        return Status::timeout("staged version " + std::to_string(version) +
                               ", but the instance did not commit before the deadline, and the coordinator could "
                               "not be told (the instance may still commit it without this rank): " +
                               w.status().message());
      }
      return Status::timeout("staged version " + std::to_string(version) +
                             ", but the instance did not commit before the deadline; it aborted the version");
    }
    const control::Frame& f = **n;
    if (f.body.value("version", int64_t{0}) != version) continue;  // an old barrier's word
    if (f.type == MsgType::kAbort) {
      aborted_ = true;
      return Status::io_error("instance " + std::to_string(config_.instance) + " aborted version " +
                              std::to_string(version) + ": " + f.body.value("reason", std::string()));
    }
    staged_version_ = version;
    staged_ranges_ = compiled_->written;
    return Status::ok();
  }
}

Status ReceiverAgent::commit() {
  if (refresh_running()) return Status::invalid("commit: a refresh is running");
  if (!config_.staged) return Status::invalid("commit: this receiver refreshes in \"direct\" mode");
  if (staged_version_ == 0) return Status::invalid("commit: no version is staged");
  const Clock::time_point t0 = Clock::now();
  std::vector<cuda::Copy> on_gpu;  // issued together on the copy stream, then waited for
  for (size_t i = 0; i < buffers_.size() && i < staged_ranges_.size(); ++i) {
    const Buf& b = buffers_[i];
    for (const auto& [off, n] : staged_ranges_[i]) {
      if (!b.device) {
        std::memcpy(b.live + off, b.data + off, n);
        continue;
      }
      cuda::Copy c;
      c.dst = b.live + off;
      c.src = b.data + off;
      c.width = n;
      on_gpu.push_back(c);
    }
  }
  if (!on_gpu.empty()) {
    if (Status st = copy_and_wait(on_gpu); !st.is_ok()) {
      version_.store(0);
      staged_version_ = 0;
      log_.error("commit failed part way; the live buffers are torn: " + st.message());
      return st.with_context("commit (the live buffers are torn)");
    }
  }
  const double pause = seconds_between(t0, Clock::now());
  version_.store(staged_version_);
  Json report = Json::parse(report_, nullptr, false);
  if (report.is_object()) {
    report["pause_seconds"] = pause;
    report["committed"] = true;
    report_ = report.dump();
  }
  staged_version_ = 0;
  return Status::ok();
}

void ReceiverAgent::finish(Status status, const Report& r) {
  Json j{{"version", r.version},
         {"mode", config_.staged ? "staged" : "direct"},
         {"ok", status.is_ok()},
         {"error", status.message()},
         {"epoch", r.epoch},
         {"network_bytes", r.network_bytes},
         {"local_bytes", r.local_bytes},
         {"pulls", r.pulls},
         {"pushes", r.pushes},
         {"retries", r.retries},
         {"seconds", {{"plan", r.plan_s}, {"network", r.network_s}, {"local", r.local_s}, {"total", r.total_s}}},
         // Direct: the server pauses for the whole refresh. Staged: only for
         // commit(), which fills this in.
         {"pause_seconds", config_.staged ? 0.0 : r.total_s}};
  if (config_.staged) j["committed"] = false;
  if (r.minimum_network_bytes >= 0) j["minimum_network_bytes"] = r.minimum_network_bytes;
  if (r.solo) j["solo"] = true;  // the plan part pulled everything itself (docs/refresh.md, "Retries")
  if (config_.verify) {
    j["verify"] = {{"boxes", r.verified_boxes}, {"bytes", r.verified_bytes},
                   {"unverified_bytes", r.unverified_bytes}, {"seconds", r.verify_s}};
  }
  if (r.gathers > 0 || r.gather_unpacked > 0) {
    j["gathers"] = {{"ops", r.gathers}, {"runs", r.gathered_runs}, {"unpacked", r.gather_unpacked}};
  }
  if (r.landing) {
    j["landing"] = {{"slots", r.landing_slots}, {"chunks", r.landing_chunks}, {"copies", r.landing_copies},
                    {"held", r.landing_held}};
  }
  report_ = j.dump();
  if (config_.staged) {
    if (!status.is_ok()) log_.warn("refresh failed; the live buffers keep version " + std::to_string(version_.load()) +
                                   ": " + status.message());
    return;
  }
  if (status.is_ok()) {
    version_.store(r.version);
  } else if (!r.touched) {  // it failed before any transfer began: nothing was written
    log_.warn("refresh failed before it wrote anything; the buffers keep version " +
              std::to_string(version_.load()) + ": " + status.message());
  } else {
    version_.store(0);
    log_.warn("refresh failed; the buffers are torn: " + status.message());
  }
}

Status ReceiverAgent::refresh(int64_t version, std::chrono::milliseconds timeout) {
  if (refresh_running()) return Status::invalid("refresh: a started refresh is still running");
  if (version < 1 && version != -1) {
    return Status::invalid("refresh: version must be positive or REFIT_LATEST, got " + std::to_string(version));
  }
  if (async_.joinable()) async_.join();
  return refresh_now(version, timeout);
}

Status ReceiverAgent::refresh_now(int64_t version, std::chrono::milliseconds timeout) {
  staged_version_ = 0;  // a staged version not committed is overwritten
  const Clock::time_point t0 = Clock::now();
  const Clock::time_point deadline = t0 + timeout;
  Report report;
  Status st;
  uint64_t retries = 0;
  bool touched = false;  // some attempt began its transfer (direct: the buffers may be torn)
  while (true) {
    aborted_ = false;
    report = Report{};
    st = run_refresh(version, deadline, &report);
    touched = touched || report.epoch != 0;
    // Retry what a new attempt can fix: a peer or source that failed (the
    // coordinator replans without it once it is declared dead, and the
    // ranks of the domain fail and retry together), or ranks of the domain
    // on different memberships. Not an abort of the instance, nor bad input.
    const bool retryable = !aborted_ && !report.verify_failed && !report.lease_lost && report.version > 0 &&
                           (st.code() == Code::kIoError ||
                            st.message().find("another membership") != std::string::npos);
    if (st.is_ok() || !retryable || Clock::now() + kRetryPause * 2 >= deadline) break;
    ++retries;
    log_.info("refresh to " + std::to_string(report.version) + ", attempt " + std::to_string(retries) +
              " failed, retrying: " + st.message());
    std::this_thread::sleep_for(kRetryPause);
  }
  report.retries = retries;
  report.touched = touched;
  // Staged: the instance commits all or nothing, failures included (a rank
  // that failed says so, and the others are told to abort).
  if (config_.staged && report.version > 0) st = stage_barrier(st, report.version, deadline);
  report.total_s = seconds_between(t0, Clock::now());
  finish(st, report);
  return st;
}

bool ReceiverAgent::refresh_running() const {
  std::lock_guard<std::mutex> lock(async_mutex_);
  return !async_done_;
}

Status ReceiverAgent::refresh_start(int64_t version, std::chrono::milliseconds timeout) {
  if (refresh_running()) return Status::invalid("refresh_start: a started refresh is still running");
  if (version < 1 && version != -1) {
    return Status::invalid("refresh_start: version must be positive or REFIT_LATEST, got " + std::to_string(version));
  }
  if (async_.joinable()) async_.join();
  {
    std::lock_guard<std::mutex> lock(async_mutex_);
    async_done_ = false;
    async_status_ = Status::ok();
  }
  report_ = "{}";
  async_ = std::thread([this, version, timeout] {
    Status st = refresh_now(version, timeout);
    {
      std::lock_guard<std::mutex> lock(async_mutex_);
      async_status_ = st;
      async_done_ = true;
    }
    async_cv_.notify_all();
  });
  return Status::ok();
}

std::optional<Status> ReceiverAgent::refresh_poll() { return refresh_wait(std::chrono::milliseconds(0)); }

std::optional<Status> ReceiverAgent::refresh_wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(async_mutex_);
  if (!async_cv_.wait_for(lock, timeout, [this] { return async_done_; })) return std::nullopt;
  return async_status_;
}

}  // namespace refit::plugin
