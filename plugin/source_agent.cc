#include "plugin/source_agent.h"

#include <algorithm>
#include <array>
#include <map>
#include <optional>
#include <set>
#include <cstring>

#include "planner/dtype.h"
#include "plugin/describe.h"
#ifdef HAVE_CUDA
#include "transport/cuda/cuda_copy_ops.h"
#endif
#include "plugin/host_memory.h"
#include "plugin/source_convert.h"
#include "plugin/verify.h"
#include "transport/cuda/pointer_probe.h"

namespace refit::plugin {

// The buffer a source serves its converted copies from ("quantize": "source").
constexpr const char* kConvertedBuffer = "refit.converted";

using control::MsgType;

SourceAgent::SourceAgent(AgentConfig config)
    : config_(std::move(config)), log_("source", config_.rank, config_.log_level, config_.log_format) {
  if (config_.test.refuse_threads_after >= 0) {
    threads_ = ThreadFactory::refusing_after(config_.test.refuse_threads_after);
  }
  threads_.set_log([this](const std::string& line) { log_.error(line); });
}

Result<std::unique_ptr<SourceAgent>> SourceAgent::create(std::string_view config_json) {
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/false);
  if (!config.is_ok()) return config.status();
  std::unique_ptr<SourceAgent> a(new SourceAgent(std::move(config).value()));
  ucx::ContextConfig cc;
  cc.name = "network";
  cc.transports = a->config_.network.transports;
  cc.devices = a->config_.network.devices;
  cc.route_to = a->config_.coordinator.host;  // the default device (transport/ucx/route.h)
  cc.serves_only = true;  // a source accepts no writes (docs/security.md)
  Result<ucx::Context> context = ucx::Context::create(cc);
  if (!context.is_ok()) return context.status().with_context("config: \"network\"");
  a->context_.emplace(std::move(context).value());
  Result<ucx::Worker> worker = ucx::Worker::create(*a->context_, ucx::ThreadMode::kSerialized);
  if (!worker.is_ok()) return worker.status();
  a->worker_.emplace(std::move(worker).value());
  Result<std::vector<uint8_t>> address = a->worker_->address();
  if (!address.is_ok()) return address.status();
  a->worker_address_ = std::move(address).value();
  Result<std::unique_ptr<ucx::AmRmaServer>> server = ucx::AmRmaServer::create(*a->worker_, ucx::AmRmaServer::Puts::kRefused,
                                                                               a->config_.gather_reply_bytes);
  if (!server.is_ok()) return server.status();
  a->rma_server_ = std::move(server).value();
  Result<std::unique_ptr<CoordinatorLink>> link = CoordinatorLink::connect(a->config_, a->log_, a->threads_);
  if (!link.is_ok()) return link.status();
  a->link_ = std::move(link).value();
  a->log_.info("connected to the coordinator");
  return a;
}

SourceAgent::~SourceAgent() {
  if (link_ && joined_) {
    link_->stop_heartbeat();
    Result<control::Json> r =
        link_->request(MsgType::kUnregister, control::to_json(control::MemberRef{control::Role::kSource, config_.rank}));
    if (!r.is_ok()) log_.info("leaving: " + r.status().message());
  }
  link_.reset();
  stop_progress();
  rma_server_.reset();
  buffers_.clear();  // memory regions before the worker and context
  converted_.reset();
  worker_.reset();
  context_.reset();
}

Status SourceAgent::start_progress() {
  if (progress_.joinable()) return Status::ok();
  stop_.store(false);
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    progress_error_ = Status::ok();
  }
  // A body that throws stops serving GETs: the next join or publish fails.
  Result<std::thread> t = threads_.start(
      "progress",
      [this] {
        while (!stop_.load(std::memory_order_acquire)) {
          Status st = worker_->wait(std::chrono::milliseconds(100));
          if (!st.is_ok()) {
            log_.error("progress: " + st.message());
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
      },
      [this](const Status& why) {
        std::lock_guard<std::mutex> lock(progress_mu_);
        progress_error_ = why;
      });
  if (!t.is_ok()) return t.status();
  progress_ = std::move(t).value();
  return Status::ok();
}

Status SourceAgent::progress_error() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  return progress_error_;
}

void SourceAgent::stop_progress() {
  if (!progress_.joinable()) return;
  stop_.store(true, std::memory_order_release);
  (void)worker_->signal();
  progress_.join();
}

Status SourceAgent::add_tensor(std::string_view description, void* data, uint64_t bytes) {
  Result<SourceTensor> t = parse_source_tensor(description, config_.rank);
  if (!t.is_ok()) return t.status();
  for (const control::TensorDecl& d : tensors_) {
    if (d.name == t->decl.name) return Status::invalid("tensor \"" + d.name + "\" was already added");
  }
  if (t->buffer.name == kConvertedBuffer) {
    return Status::invalid("tensor \"" + t->decl.name + "\": the buffer name \"" + kConvertedBuffer +
                           "\" is refit's own (the converted copies of \"quantize\": \"source\"); choose another");
  }
  if (t->buffer.segments.empty()) {  // this rank holds no part of it
    tensors_.push_back(t->decl);
    changed_ = true;
    return Status::ok();
  }
  if (data == nullptr || bytes == 0) {
    return Status::invalid("tensor \"" + t->decl.name + "\": data is NULL or bytes is 0");
  }
  if (t->buffer.bytes > 0 && static_cast<uint64_t>(t->buffer.bytes) != bytes) {
    return Status::invalid("tensor \"" + t->decl.name + "\": this rank's shard is " +
                           std::to_string(t->buffer.bytes) + " bytes, the buffer given is " + std::to_string(bytes));
  }
  REFIT_RETURN_IF_ERROR(check_segments_fit(t->buffer, bytes).with_context("tensor \"" + t->decl.name + "\""));
  auto it = std::find_if(buffers_.begin(), buffers_.end(), [&](const Buf& b) { return b.name == t->buffer.name; });
  if (it != buffers_.end()) {  // a fused buffer: one more tensor in it
    if (it->data != data || it->bytes != bytes) {
      return Status::invalid("tensor \"" + t->decl.name + "\": buffer \"" + it->name +
                             "\" was added with another address or size");
    }
    // A buffer is bytes: tensors of several dtypes may share it. Then it is
    // U8, and each segment names its own dtype.
    BufferPart fused{it->name, it->dtype, 0, it->segments};
    const bool mixed = it->dtype != t->buffer.dtype;
    if (mixed) fused.dtype = "U8";
    for (control::Segment& seg : fused.segments) {
      if (mixed && seg.dtype.empty()) seg.dtype = it->dtype;
    }
    for (control::Segment seg : t->buffer.segments) {
      if (mixed && t->buffer.dtype != fused.dtype) seg.dtype = t->buffer.dtype;
      fused.segments.push_back(std::move(seg));
    }
    REFIT_RETURN_IF_ERROR(check_segments_apart(fused).with_context("tensor \"" + t->decl.name + "\""));
    it->dtype = fused.dtype;
    it->segments = std::move(fused.segments);
  } else {
    Buf b;
    b.name = t->buffer.name;
    b.dtype = t->buffer.dtype;
    b.data = static_cast<uint8_t*>(data);
    b.bytes = bytes;
    b.segments = t->buffer.segments;
    b.device = cuda::probe_pointer(data).device;  // asks the driver; makes no CUDA context
    if (!b.device && config_.snapshot) {
      b.snapshot = map_host_memory(bytes);
      if (!b.snapshot) {
        return Status::invalid("tensor \"" + t->decl.name + "\": cannot allocate " + std::to_string(bytes) +
                               " bytes for its snapshot");
      }
    }
    const bool running = progress_.joinable();
    stop_progress();  // registration must not race the worker's progress
    Status st = b.device ? gpu_mirror(&b).with_context("tensor \"" + t->decl.name + "\"") : Status::ok();
    Result<ucx::MemoryRegion> region = st.is_ok() ? ucx::MemoryRegion::map(*context_, b.served(), bytes, b.name,
                                                                           ucx::Access::kRemoteRead)
                                                  : Result<ucx::MemoryRegion>(st);
    if (running) {
      Status restarted = start_progress();
      if (!restarted.is_ok()) return restarted.with_context("tensor \"" + t->decl.name + "\"");
    }
    if (!region.is_ok()) return region.status();
    log_.info("buffer \"" + b.name + "\" (" + std::to_string(bytes) + " bytes) mapped for peers with " +
              ucx::protection_names(region->protection()));
    if (published_ > 0) {  // receivers may read it before the next publish fills it
      if (b.snapshot) std::memcpy(b.snapshot.get(), b.data, bytes);
#ifdef HAVE_CUDA
      if (b.mirror) REFIT_RETURN_IF_ERROR(cuda::copy_now(b.mirror, b.data, bytes).with_context("tensor \"" + t->decl.name + "\""));
#endif
    }
    buffers_.push_back(std::move(b));
    buffers_.back().region.emplace(std::move(region).value());
    rma_server_->export_region(*buffers_.back().region);
  }
  tensors_.push_back(t->decl);
  changed_ = true;
  return Status::ok();
}

Status SourceAgent::join() {
  if (joined_ && link_->dropped()) joined_ = false;  // declared dead: the coordinator holds nothing of it
  REFIT_RETURN_IF_ERROR(progress_error());
  if (joined_ && !changed_) return Status::ok();
  if (tensors_.empty()) return Status::invalid("join: add at least one tensor first");
  // Only the buffers changed (the converted copies of a publish): the
  // coordinator replaces them in place, and the source never leaves, so
  // its tensors never lack a source in between.
  const bool replace = joined_ && registered_tensors_ == tensors_.size();
  if (joined_ && !replace) {
    link_->stop_heartbeat();
    Result<control::Json> r =
        link_->request(MsgType::kUnregister, control::to_json(control::MemberRef{control::Role::kSource, config_.rank}));
    if (!r.is_ok()) return r.status().with_context("re-registering");
    joined_ = false;
  }
  control::RegisterSource m;
  m.rank = config_.rank;
  m.domain = config_.domain;
  m.worker_address = worker_address_;
  m.tensors = tensors_;
  for (const Buf& b : buffers_) {
    control::MemberBuffer mb;
    mb.name = b.name;
    mb.dtype = b.dtype;
    mb.bytes = static_cast<int64_t>(b.bytes);
    mb.address = reinterpret_cast<uint64_t>(b.served());
    mb.rkey = b.region->packed_rkey();
    mb.segments = b.segments;
    m.buffers.push_back(std::move(mb));
  }
  if (converted_ && !converted_->segments.empty()) {
    control::MemberBuffer mb;
    mb.name = kConvertedBuffer;
    mb.dtype = "U8";
    mb.bytes = static_cast<int64_t>(converted_->bytes);
    mb.address = reinterpret_cast<uint64_t>(converted_->memory.get());
    mb.rkey = converted_->region->packed_rkey();
    mb.segments = converted_->segments;
    m.buffers.push_back(std::move(mb));
  }
  REFIT_RETURN_IF_ERROR(start_progress().with_context("join"));
  const control::Json body = control::to_json(m);
  std::string text = body.dump();
  if (replace && text == registered_) {  // nothing the coordinator does not hold
    changed_ = false;
    return Status::ok();
  }
  Result<control::Json> r = link_->request(MsgType::kRegisterSource, body);
  if (!r.is_ok()) return r.status();
  joined_ = true;
  changed_ = false;
  registered_tensors_ = tensors_.size();
  registered_ = std::move(text);
  if (replace) {
    log_.info("registered its buffers again (" + std::to_string(m.buffers.size()) + ")");
    return Status::ok();
  }
  const control::MemberRef me{control::Role::kSource, config_.rank};
  if (Status hb = link_->start_heartbeat(me); !hb.is_ok()) {
    // Without heartbeats the coordinator would declare the member dead
    // later: it leaves now, and the next join registers it again.
    joined_ = false;
    (void)link_->request(MsgType::kUnregister, control::to_json(me));
    return hb.with_context("join");
  }
  log_.info("joined with " + std::to_string(tensors_.size()) + " tensors in " + std::to_string(buffers_.size()) +
            " buffers");
  return Status::ok();
}

Status SourceAgent::publish(int64_t version) {
  if (version <= published_) {
    return Status::invalid("publish: version " + std::to_string(version) + " is not newer than " +
                           std::to_string(published_) + ", the last this source published");
  }
  REFIT_RETURN_IF_ERROR(join());
  // "quantize": "source" rewrites its copies, or registers other ones, at
  // every publish: it waits as a snapshot does.
  const bool copies = std::any_of(buffers_.begin(), buffers_.end(), [](const Buf& b) { return b.copied_at_publish(); }) ||
                      config_.quantize_at_source;
  if (copies) {
    // The copy receivers read must not change under a lease on it.
    if (published_ > 0) {
      REFIT_RETURN_IF_ERROR(wait_drained(published_, config_.coordinator.timeout)
                                .with_context("publish " + std::to_string(version) + " (copying the shards)"));
    }
    for (Buf& b : buffers_) {
      if (b.snapshot) std::memcpy(b.snapshot.get(), b.data, b.bytes);
#ifdef HAVE_CUDA
      if (b.mirror) {
        REFIT_RETURN_IF_ERROR(cuda::copy_now(b.mirror, b.data, b.bytes)
                                  .with_context("publish " + std::to_string(version) + ": buffer \"" + b.name + "\""));
      }
#endif
    }
  }
  log_.set_version(version);
  if (config_.quantize_at_source) {
    REFIT_RETURN_IF_ERROR(convert_at_publish(version).with_context("publish " + std::to_string(version)));
    REFIT_RETURN_IF_ERROR(join());  // registers the copies when they changed
  }
  // Twice at most: a source the coordinator declared dead before its
  // heartbeat heard of it (a partition that healed) hears it here, and
  // registers again (join) before the second try.
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) REFIT_RETURN_IF_ERROR(join());
    control::Json body{{"version", version}};
    Status st;
    if (config_.verify) {
      Result<control::Json> hashes = hash_served();
      if (hashes.is_ok()) body["hashes"] = std::move(hashes).value();
      else st = hashes.status().with_context("publish " + std::to_string(version) + ": verify");
    }
    if (st.is_ok()) st = link_->request(MsgType::kPublishVersion, body).status();
    if (st.reason() == Reason::kNotRegistered && attempt == 0) continue;
    if (!st.is_ok()) return st;
    published_ = version;
    return Status::ok();
  }
}

Status SourceAgent::convert_at_publish(int64_t version) {
  Result<control::Json> reply = link_->request(MsgType::kVerifyBoxes, control::Json::object());
  if (!reply.is_ok()) return reply.status().with_context("asking which tensors to convert");
  std::vector<ConvertRequest> requests;
  for (const control::Json& c : reply->value("convert", control::Json::array())) {
    const std::optional<DType> to = parse_dtype(c.value("dtype", std::string()));
    if (!to) continue;
    const std::array<int64_t, 2> block = c.value("block", std::array<int64_t, 2>{128, 128});
    if (block[0] < 1 || block[1] < 1 || block[0] > (1 << 20) || block[1] > (1 << 20)) {
      return Status::internal("the coordinator's list of tensors to convert has block [" + std::to_string(block[0]) +
                              ", " + std::to_string(block[1]) + "], outside 1..2^20");
    }
    requests.push_back({c.value("tensor", std::string()), *to, block});
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const control::TensorDecl& d : tensors_) shapes[d.name] = d.shape;
  std::vector<ServedBuffer> served;
  for (const Buf& b : buffers_) served.push_back({b.dtype, b.segments, !b.device || b.mirror});
  ConvertLayout plan = plan_converted(served, shapes, requests, config_.quantize_source_bytes);
  for (const std::string& t : plan.left_out) {
    log_.warn("tensor \"" + t + "\": its converted copies pass \"quantize_source_bytes\" (" +
              std::to_string(config_.quantize_source_bytes) + "): the rest of it travels unconverted");
  }
  // Reuse the memory registered for the same copies (wait_drained has
  // run: nobody reads it), else fill new memory and register it.
  const bool same = converted_ && converted_->key == plan.key;
  std::shared_ptr<uint8_t> memory = same ? converted_->memory : map_host_memory(std::max<uint64_t>(plan.bytes, 64));
  if (!memory) return Status::invalid("cannot allocate " + std::to_string(plan.bytes) + " bytes for converted copies");
  std::set<std::string> refused;
  for (const ConvertJob& j : plan.jobs) {
    if (refused.count(j.segment.tensor)) continue;
    const Buf& b = buffers_[j.buffer];
    bool nan = false;
    Status st = convert_box(b.served(), b.bytes, j.segment, j.from, j.to, j.block, j.start, j.size,
                            memory.get() + j.data_offset, reinterpret_cast<float*>(memory.get() + j.scale_offset), &nan);
    if (st.is_ok()) continue;
    if (!nan) return st;
    // NaN or infinity: this version of the tensor is served unconverted, and
    // the receivers' own conversion refuses it, naming the block.
    log_.warn("version " + std::to_string(version) + ": not serving a converted copy of tensor \"" + j.segment.tensor +
              "\": " + st.message());
    refused.insert(j.segment.tensor);
  }
  if (!refused.empty()) {
    std::vector<ConvertJob> kept;
    for (ConvertJob& j : plan.jobs)
      if (!refused.count(j.segment.tensor)) kept.push_back(std::move(j));
    plan.jobs = std::move(kept);
  }
  std::vector<control::Segment> segments = converted_segments(plan);
  auto text = [](const std::vector<control::Segment>& segs) {
    control::Json j = control::Json::array();
    for (const control::Segment& g : segs) j.push_back({g.tensor, g.start, g.size, g.offset, g.strides, g.dtype});
    return j.dump();
  };
  if (same && text(segments) == text(converted_->segments)) return Status::ok();
  const uint64_t bytes = std::max<uint64_t>(plan.bytes, 64);
  const bool running = progress_.joinable();
  stop_progress();  // registration must not race the worker's progress
  Result<ucx::MemoryRegion> region =
      ucx::MemoryRegion::map(*context_, memory.get(), bytes, kConvertedBuffer, ucx::Access::kRemoteRead);
  if (region.is_ok()) {
    // The AM server holds the region it serves: the old one leaves it
    // before it is released, the new one joins it where it stays.
    if (converted_ && converted_->region) rma_server_->unexport_region(*converted_->region);
    converted_.reset();
    converted_.emplace();
    converted_->memory = std::move(memory);
    converted_->bytes = bytes;
    converted_->key = plan.key;
    converted_->segments = std::move(segments);
    converted_->region.emplace(std::move(region).value());
    rma_server_->export_region(*converted_->region);
    changed_ = true;  // the coordinator holds the old address: the next join registers this one
  }
  if (running) REFIT_RETURN_IF_ERROR(start_progress());
  if (!region.is_ok()) return region.status().with_context("registering converted copies");
  log_.info("serving " + std::to_string(plan.jobs.size()) + " converted copies (" + std::to_string(bytes) + " bytes)");
  changed_ = true;
  return Status::ok();
}

Result<control::Json> SourceAgent::hash_served() {
  const auto t0 = std::chrono::steady_clock::now();
  Result<control::Json> boxes = link_->request(MsgType::kVerifyBoxes, control::Json::object());
  if (!boxes.is_ok()) return boxes.status();
  const control::Json* list = boxes->contains("boxes") ? &(*boxes)["boxes"] : nullptr;
  if (!list || !list->is_array()) return Status::internal("verify_boxes: the reply has no list of boxes");
  control::Json hashes = control::Json::array();
  uint64_t bytes = 0;
  for (const control::Json& box : *list) {
    if (box.value("rank", -1) != config_.rank) continue;
    const std::string tensor = box.value("tensor", std::string());
    const std::vector<int64_t> start = box.value("start", std::vector<int64_t>());
    const std::vector<int64_t> size = box.value("size", std::vector<int64_t>());
    // A receiver of another dtype checks the converted bytes (docs/conversion.md).
    const std::string to_name = box.value("dtype", std::string());
    const std::optional<DType> to = to_name.empty() ? std::nullopt : parse_dtype(to_name);
    if (!to_name.empty() && !to) return Status::internal("verify_boxes: unknown dtype \"" + to_name + "\"");
    const std::array<int64_t, 2> block = box.value("block", std::array<int64_t, 2>{128, 128});
    // To F8_E4M3, the boxes of the scale tensor to hash too: the box's
    // blocks' scales, cut by the receivers' scale segments.
    std::vector<IndexBox> scale_boxes;
    for (const control::Json& sb : box.value("scales", control::Json::array())) {
      scale_boxes.push_back(IndexBox{sb.value("start", std::vector<int64_t>()), sb.value("size", std::vector<int64_t>())});
    }
    bool done = false;
    for (const Buf& b : buffers_) {
      for (const control::Segment& seg : b.segments) {
        if (done || seg.tensor != tensor) continue;
        const std::optional<DType> dt = parse_dtype(seg.dtype.empty() ? b.dtype : seg.dtype);
        const int elem = dt ? dtype_bytes(*dt) : 1;
        bool refused = false;
        Result<ConvertedHashes> h = ConvertedHashes{};
        if (to && dt) {
          h = hash_converted_box(b.served(), b.bytes, seg, *dt, *to, block, start, size, scale_boxes, &refused);
        } else if (Result<uint64_t> plain = hash_box(b.served(), b.bytes, seg, elem, start, size); plain.is_ok()) {
          h = ConvertedHashes{*plain, {}};
        } else {
          h = plain.status();
        }
        // NaN or infinity in a block: the receivers refuse it at their
        // conversion; the publish goes on, and the box has no hash.
        if (refused) {
          log_.warn("verify: " + h.status().message());
          done = true;
          continue;
        }
        if (!h.is_ok()) continue;  // another segment of the tensor may hold it
        hashes.push_back(control::to_json(control::BoxHash{config_.rank, tensor, start, size, h->hash, to_name}));
        uint64_t n = static_cast<uint64_t>(elem);
        for (int64_t s : size) n *= static_cast<uint64_t>(s);
        bytes += n;
        for (size_t i = 0; i < h->scale_hashes.size(); ++i) {
          const IndexBox& sb = scale_boxes[i];
          hashes.push_back(control::to_json(
              control::BoxHash{config_.rank, scale_tensor_name(tensor), sb.start, sb.size, h->scale_hashes[i], ""}));
          uint64_t k = sizeof(float);
          for (int64_t s : sb.size) k *= static_cast<uint64_t>(s);
          bytes += k;
        }
        done = true;
      }
    }
    if (!done) {
      return Status::internal("the coordinator asked for a hash of tensor \"" + tensor + "\" start " +
                              box["start"].dump() + " size " + box["size"].dump() +
                              ", which no segment of this source holds");
    }
  }
  log_.debug("verify: hashed " + std::to_string(hashes.size()) + " boxes, " + std::to_string(bytes) + " bytes, in " +
             std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) + " s");
  return hashes;
}

Status SourceAgent::gpu_mirror(Buf* b) {
#ifdef HAVE_CUDA
  // Always from a pinned host mirror: receivers gather small runs
  // (docs/refresh.md, "Gathers"), and the source's replies to a gather, as
  // to any GET over tcp, are CPU copies, which GPU memory would fault
  // (transport/ucx/am_rma.h refuses them). Serving GPU shards in place
  // waits for gathers served from GPU memory.
  Result<cuda::PinnedBuffer> mirror = cuda::PinnedBuffer::allocate(b->bytes);
  if (!mirror.is_ok()) return mirror.status().with_context("pinned mirror of a GPU shard");
  auto owner = std::make_shared<cuda::PinnedBuffer>(std::move(mirror).value());
  b->mirror = owner->data();
  b->mirror_owner = std::shared_ptr<void>(owner, owner.get());
  return Status::ok();
#else
  return Status::unsupported("buffer \"" + b->name + "\" is GPU memory; this build of refit has no CUDA");
#endif
}

Status SourceAgent::wait_drained(int64_t version, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (!joined_) return Status::invalid("wait_drained: this source has not joined");
  Result<control::Json> r = link_->request(MsgType::kWaitDrained, control::Json{{"version", version}});
  if (!r.is_ok() && r.status().reason() == Reason::kNotRegistered) {
    // Declared dead (a partition that healed): registered again, it waits
    // like any source; receivers may still hold leases on the version.
    REFIT_RETURN_IF_ERROR(join());
    r = link_->request(MsgType::kWaitDrained, control::Json{{"version", version}});
  }
  if (!r.is_ok()) return r.status();
  bool drained = r->value("drained", false);
  while (!drained) {
    Result<std::optional<control::Json>> n = link_->wait_notice(MsgType::kDrained, deadline);
    if (!n.is_ok()) return n.status();
    if (!n->has_value()) {
      return Status::timeout("wait_drained: version " + std::to_string(version) + " still leased after " +
                              std::to_string(timeout.count()) + " ms");
    }
    drained = (**n).value("version", int64_t{0}) >= version;
  }
  // No lease is left, but this process's progress thread may still be
  // copying or sending a reply from the shards; the owner overwrites them
  // next. Replies still in flight after a second (or at the deadline) go to
  // pullers that gave up: they do not hold the call longer.
  const auto grace = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1));
  if (rma_server_ && !rma_server_->quiesce(grace)) {
    log_.info("wait_drained: version " + std::to_string(version) +
              ": replies to pullers that gave up were still being sent");
  }
  return Status::ok();
}

}  // namespace refit::plugin
