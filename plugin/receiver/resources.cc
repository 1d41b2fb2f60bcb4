#include "plugin/receiver/resources.h"

#include <cstring>
#include <thread>

#ifdef HAVE_NCCL
#include "transport/cuda/cuda_copy_ops.h"
#include "transport/cuda/nccl_comm.h"
#include "transport/fabric/nccl_fabric.h"
#endif
#ifdef REFIT_HAVE_CONVERT_KERNEL
#include "transport/convert/convert_cuda.h"
#endif
#include "plugin/host_memory.h"
#include "transport/cuda/host_copy_ops.h"
#include "transport/cuda/pointer_probe.h"
#include "transport/fabric/cma_fabric.h"
#include "transport/fabric/ucx_fabric.h"

namespace refit::plugin::receiver {

namespace {

#ifdef HAVE_NCCL
// The NCCL fabric on the config's device, and the copy stream that landing
// copies run on (*copy_ops), which the fabric's sends are ordered after.
Result<std::unique_ptr<fabric::LocalFabric>> make_nccl_fabric(const AgentConfig& config,
                                                              std::unique_ptr<cuda::CopyOps>* copy_ops, int* gpu,
                                                              const ThreadFactory& threads) {
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
  nc.threads = threads;
  nc.pack.pack_bytes = config.local_pack_bytes;
  nc.pack.pack_threshold = config.local_pack_threshold;
  Result<std::unique_ptr<fabric::NcclFabric>> f = fabric::NcclFabric::create(nc, std::move(comms).value());
  if (!f.is_ok()) return f.status();
  return std::unique_ptr<fabric::LocalFabric>(std::move(f).value());
}
#endif

// The local fabric the config asks for. "cma" falls back to "ucx" where the
// kernel forbids cross-memory attach (the ranks of a host all decide alike).
Result<std::unique_ptr<fabric::LocalFabric>> make_fabric(const AgentConfig& config, const Log& log,
                                                         std::unique_ptr<cuda::CopyOps>* copy_ops, int* gpu,
                                                         const ThreadFactory& threads) {
  if (config.local_fabric == "nccl") {
#ifdef HAVE_NCCL
    return make_nccl_fabric(config, copy_ops, gpu, threads);
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
  fc.threads = threads;
  fc.transports = config.local.transports;
  fc.limits.chunk_bytes = config.chunk_bytes;
  fc.limits.max_bytes_in_flight = config.window_bytes;
  fc.limits.max_bytes_per_endpoint = config.window_bytes;
  Result<std::unique_ptr<fabric::UcxFabric>> ucx = fabric::UcxFabric::create(fc);
  if (!ucx.is_ok()) return ucx.status();
  return std::unique_ptr<fabric::LocalFabric>(std::move(ucx).value());
}

}  // namespace

Result<std::unique_ptr<Resources>> Resources::create(const AgentConfig& config, const Log& log,
                                                     bool force_landing_ring, const ThreadFactory& threads) {
  std::unique_ptr<Resources> r(new Resources(config, log));
  ucx::ContextConfig net;
  net.name = "network";
  net.transports = config.network.transports;
  net.devices = config.network.devices;
  net.route_to = config.coordinator.host;  // the default device (transport/ucx/route.h)
  Result<ucx::Context> nc = ucx::Context::create(net);
  if (!nc.is_ok()) return nc.status().with_context("config: \"network\"");
  r->net_context_.emplace(std::move(nc).value());
  Result<ucx::Worker> worker = ucx::Worker::create(*r->net_context_, ucx::ThreadMode::kSerialized);
  if (!worker.is_ok()) return worker.status();
  r->net_worker_.emplace(std::move(worker).value());
  Result<std::unique_ptr<fabric::LocalFabric>> fabric = make_fabric(config, log, &r->copy_ops_, &r->fabric_gpu_, threads);
  if (!fabric.is_ok()) return fabric.status().with_context("config: \"local\"");
  r->fabric_ = std::move(fabric).value();
  if (!r->copy_ops_ && force_landing_ring) {
    // The GPU path's landing logic on host buffers (docs/receiver.md).
    Result<std::unique_ptr<cuda::HostCopyOps>> ops = cuda::HostCopyOps::create(std::chrono::microseconds(0), threads);
    if (!ops.is_ok()) return ops.status().with_context("\"test\": {\"force_landing_ring\": true}");
    r->copy_ops_ = std::move(ops).value();
    log.info("\"test\": {\"force_landing_ring\": true}: GETs land in the landing ring and are copied on");
  }
  return r;
}

Resources::~Resources() {
  gpu_work_.reset();  // waits for its stream, frees its scratch
  fabric_.reset();
  copy_ops_.reset();  // waits for its copies, before the memory they touch goes
  sources_.clear();   // endpoints before their worker
  buffers_.clear();   // memory before the context
  ring_region_.reset();
  ring_memory_.reset();
  convert_region_.reset();
  convert_memory_.reset();
  net_worker_.reset();
  net_context_.reset();
}

bool Resources::has_buffer(const std::string& name) const {
  for (const Buffer& b : buffers_) {
    if (b.part.name == name) return true;
  }
  return false;
}

// The "nccl" fabric passes GPU memory of its device, the others host memory
// (the probe asks the driver, and makes no CUDA context).
Status Resources::check_memory(const Buffer& b) const {
  const cuda::PointerKind kind = cuda::probe_pointer(b.live);
  if (kind.device && config_.local_fabric != "nccl") {
    return Status::invalid("buffer \"" + b.part.name + "\" is GPU memory (device " + std::to_string(kind.ordinal) +
                           "); GPU buffers need \"local\": {\"fabric\": \"nccl\"}");
  }
  if (kind.device && kind.ordinal != fabric_gpu_) {
    return Status::invalid("buffer \"" + b.part.name + "\" is memory of GPU " + std::to_string(kind.ordinal) +
                           ", the receiver's NCCL fabric runs on GPU " + std::to_string(fabric_gpu_) +
                           " (\"local\": {\"device\": ...})");
  }
  if (!kind.device && config_.local_fabric == "nccl") {
    return Status::invalid("buffer \"" + b.part.name + "\" is host memory; the \"nccl\" local fabric passes GPU "
                           "memory only (use \"cma\" or \"ucx\" for host buffers)");
  }
  return Status::ok();
}

// Staged mode: refreshes land in a copy; commit() copies them into `live`.
Status Resources::stage(Buffer* b) {
  if (b->device) return device_staging(b);
  b->staging = map_host_memory(b->bytes);
  if (!b->staging) {
    return Status::invalid("buffer \"" + b->part.name + "\": cannot allocate " + std::to_string(b->bytes) +
                           " bytes of staging memory");
  }
  std::memcpy(b->staging.get(), b->live, b->bytes);  // bytes outside the segments stay as they were
  b->data = b->staging.get();
  return Status::ok();
}

Status Resources::add_buffer(BufferPart part, uint8_t* data, uint64_t bytes) {
  Buffer b;
  b.part = std::move(part);
  b.part.bytes = static_cast<int64_t>(bytes);
  b.live = data;
  b.data = data;
  b.bytes = bytes;
  b.device = cuda::probe_pointer(b.live).device;
  REFIT_RETURN_IF_ERROR(check_memory(b));
  if (config_.staged) REFIT_RETURN_IF_ERROR(stage(&b));
  Result<ucx::MemoryRegion> net = ucx::MemoryRegion::map(*net_context_, b.data, bytes, b.part.name);
  if ((b.device && (!net.is_ok() || net->type() != ucx::MemoryType::kCuda || !config_.network.has_rdma())) ||
      (!b.device && copy_ops_)) {
    // This UCX cannot write device memory, or not without the CPU (no RDMA
    // transport: refit's own GETs copy): GETs land in the landing ring.
    REFIT_RETURN_IF_ERROR(make_landing_ring(/*pinned=*/b.device).with_context("buffer \"" + b.part.name + "\""));
    b.through_slot = true;
  } else if (!net.is_ok()) {
    return net.status();
  }
  Result<std::vector<uint8_t>> key = fabric_->register_buffer(b.part.name, b.data, bytes);
  if (!key.is_ok()) return key.status();
  if (!b.through_slot) b.net_region.emplace(std::move(net).value());
  b.local_key = std::move(key).value();
  buffers_.push_back(std::move(b));
  return Status::ok();
}

Status Resources::device_staging(Buffer* b) {
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

Status Resources::copy_and_wait(const std::vector<cuda::Copy>& copies) {
  // Local copies end in bounded time: a generous bound only catches a
  // broken device.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  REFIT_RETURN_IF_ERROR(copy_ops_->copy_all(copies));
  Result<uint64_t> ticket = copy_ops_->record();
  if (!ticket.is_ok()) return ticket.status();
  while (true) {
    Result<bool> done = copy_ops_->done(*ticket);
    if (!done.is_ok()) return done.status();
    if (*done) return Status::ok();
    if (std::chrono::steady_clock::now() >= deadline) return Status::timeout("GPU copies did not finish within 60 s");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Status Resources::make_landing_ring(bool pinned) {
  if (ring_memory_) return Status::ok();
  const uint64_t bytes = config_.landing_bytes;
  std::shared_ptr<uint8_t> memory;
  if (!pinned) {  // the test-only landing ring for host buffers
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

std::vector<LocalBuffer> Resources::local_buffers() const {
  std::vector<LocalBuffer> out;
  out.reserve(buffers_.size());
  for (const Buffer& b : buffers_) out.push_back(LocalBuffer{b.part.name, b.data, b.bytes, b.through_slot, b.device});
  return out;
}

control::RegisterReceiver Resources::registration(const AgentConfig& config) const {
  control::RegisterReceiver m;
  m.rank = config.rank;
  m.instance = config.instance;
  m.domain = config.domain;
  m.instance_ranks = config.instance_ranks;
  m.weight_block_size = config.weight_block_size;
  m.worker_address = fabric_->contact();
  for (const Buffer& b : buffers_) {
    control::MemberBuffer mb;
    mb.name = b.part.name;
    mb.dtype = b.part.dtype;
    mb.bytes = static_cast<int64_t>(b.bytes);
    mb.address = reinterpret_cast<uint64_t>(b.data);
    mb.rkey = b.local_key;
    mb.segments = b.part.segments;
    m.buffers.push_back(std::move(mb));
  }
  return m;
}

Result<ucx::Endpoint*> Resources::endpoint(int32_t rank, const std::vector<uint8_t>& address) {
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

uint64_t Resources::rkey_id(int32_t rank, const std::string& buffer, const std::vector<uint8_t>& rkey) {
  Peer& p = sources_[rank];
  std::string key = buffer;
  key.push_back('\0');
  key.append(rkey.begin(), rkey.end());
  auto [it, inserted] = p.rkey_ids.emplace(std::move(key), 0);
  if (inserted) it->second = next_rkey_id_++;
  return it->second;
}

Result<TransferSetup> Resources::transfer_setup(const CompiledPart& part) {
  TransferSetup s;
  for (const auto& [rank, address] : part.source_addresses) {
    Result<ucx::Endpoint*> ep = endpoint(rank, address);
    if (!ep.is_ok()) return ep.status();
    auto keys = part.source_keys.find(rank);
    if (keys != part.source_keys.end()) {
      for (const auto& [id, packed] : keys->second) REFIT_RETURN_IF_ERROR((*ep)->import_rkey(id, packed));
    }
    s.endpoints[rank] = *ep;
  }
  s.rank = config_.rank;
  s.fabric = fabric_.get();
  s.worker = &*net_worker_;
  for (const Buffer& b : buffers_) {
    if (b.net_region) s.regions.push_back(&*b.net_region);
  }
  if (ring_region_) s.regions.push_back(&*ring_region_);
  if (convert_region_ && part.staging_bytes > 0) s.regions.push_back(&*convert_region_);
  s.transfer_chunk_bytes = config_.chunk_bytes;
  s.gather = config_.gather;
  s.window_bytes = config_.window_bytes;
  s.copy_ops = copy_ops_.get();
  if (ring_memory_) s.landing_ring = std::span<uint8_t>(ring_memory_.get(), config_.landing_bytes);
  s.landing_slot_bytes = landing_slot_bytes(config_);
  s.fabric_waits_for_copies = config_.local_fabric == "nccl";
#ifdef REFIT_HAVE_CONVERT_KERNEL
  // Kept across refreshes: its stream and scratch are made at the first
  // conversion into GPU memory (none without one).
  if (!gpu_work_) gpu_work_ = std::make_shared<convert::GpuWork>();
#endif
  s.gpu_work = gpu_work_;
  return s;
}

Result<uint8_t*> Resources::conversion_staging(uint64_t bytes) {
  if (convert_memory_ && convert_bytes_ >= bytes) return convert_memory_.get();
  convert_region_.reset();
  convert_memory_.reset();
  convert_bytes_ = 0;
  std::shared_ptr<uint8_t> memory = map_host_memory(bytes);
  if (!memory) {
    return Status::io_error("cannot allocate " + std::to_string(bytes) + " bytes of host memory for conversion staging");
  }
  Result<ucx::MemoryRegion> region = ucx::MemoryRegion::map(*net_context_, memory.get(), bytes, "conversion staging");
  if (!region.is_ok()) return region.status();
  convert_region_.emplace(std::move(region).value());
  convert_memory_ = std::move(memory);
  convert_bytes_ = bytes;
  return convert_memory_.get();
}

Status Resources::commit(const std::vector<Ranges>& ranges) {
  std::vector<cuda::Copy> on_gpu;  // issued together on the copy stream, then waited for
  for (size_t i = 0; i < buffers_.size() && i < ranges.size(); ++i) {
    const Buffer& b = buffers_[i];
    for (const auto& [off, n] : ranges[i]) {
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
  return on_gpu.empty() ? Status::ok() : copy_and_wait(on_gpu);
}

}  // namespace refit::plugin::receiver
