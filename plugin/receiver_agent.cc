#include "plugin/receiver_agent.h"

#include <algorithm>
#include <system_error>

#include "plugin/receiver/refresh_session.h"

namespace refit::plugin {

using control::Json;
using control::MsgType;
using receiver::ReceiverState;
using Clock = std::chrono::steady_clock;

namespace {

// Between attempts of a refresh that failed in a way a new attempt can fix.
constexpr std::chrono::milliseconds kRetryPause{200};
// The most a refresh's summary for the metrics may add to the refresh: one
// request on the open connection takes well under a millisecond; a
// coordinator that does not answer in this time loses the summary.
constexpr std::chrono::milliseconds kSummaryBound{250};
constexpr size_t kMaxQueuedSummaries = 64;
// What the destructor gives the summaries still queued, all together: a
// coordinator that is slow or gone must not hold up the server's shutdown
// (64 summaries at kSummaryBound each would take 16 s). The rest are
// dropped, with a log line.
constexpr std::chrono::milliseconds kSummaryDrain{500};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

ReceiverAgent::ReceiverAgent(AgentConfig config)
    : config_(std::move(config)), log_("receiver", config_.rank, config_.log_level, config_.log_format) {
  if (config_.test.refuse_threads_after >= 0) {
    threads_ = ThreadFactory::refusing_after(config_.test.refuse_threads_after);
  }
  threads_.set_log([this](const std::string& line) { log_.error(line); });
}

Result<std::unique_ptr<ReceiverAgent>> ReceiverAgent::create(std::string_view config_json) {
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
  if (!config.is_ok()) return config.status();
  std::unique_ptr<ReceiverAgent> a(new ReceiverAgent(std::move(config).value()));
  if (a->config_.recipe) {
    Result<std::shared_ptr<const RecipeLayout>> recipe = load_recipe(*a->config_.recipe);
    if (!recipe.is_ok()) return recipe.status();
    a->recipe_ = std::move(recipe).value();
  }
  if (!a->config_.trace.empty()) {
    Result<std::unique_ptr<Trace>> trace = Trace::open(a->config_.trace, "receiver", a->config_.rank, a->log_);
    if (!trace.is_ok()) return trace.status();
    a->trace_ = std::move(trace).value();
  }
  Result<std::unique_ptr<receiver::Resources>> resources =
      receiver::Resources::create(a->config_, a->log_, a->config_.test.force_landing_ring, a->threads_);
  if (!resources.is_ok()) return resources.status();
  a->resources_ = std::move(resources).value();
  Result<std::unique_ptr<CoordinatorLink>> link = CoordinatorLink::connect(a->config_, a->log_, a->threads_);
  if (!link.is_ok()) return link.status();
  a->link_ = std::move(link).value();
  return a;
}

ReceiverAgent::~ReceiverAgent() {
  if (async_.joinable()) async_.join();
  stop_summaries();  // before leaving: the coordinator counts only members' summaries
  if (link_ && joined_) {
    link_->stop_heartbeat();
    Result<Json> r = link_->request(MsgType::kUnregister,
                                    control::to_json(control::MemberRef{control::Role::kReceiver, config_.rank}));
    if (!r.is_ok()) log_.info("leaving: " + r.status().message());
  }
  link_.reset();
  compiled_.reset();
  resources_.reset();
}

Status ReceiverAgent::add_buffer(std::string_view description, void* data, uint64_t bytes) {
  if (refresh_running()) return Status::invalid("add_buffer: a refresh is running");
  Result<BufferPart> part = parse_receiver_buffer(description, config_.rank, recipe_.get());
  if (!part.is_ok()) return part.status();
  if (resources_->has_buffer(part->name)) return Status::invalid("buffer \"" + part->name + "\" was already added");
  if (data == nullptr || bytes == 0) return Status::invalid("buffer \"" + part->name + "\": data is NULL or bytes is 0");
  if (part->exact_bytes && static_cast<uint64_t>(part->bytes) != bytes) {
    // A parameter of another size than the recipe's is another layout: the
    // server split or padded it otherwise (another tp, head_dim or padding).
    return Status::invalid("buffer \"" + part->name + "\": the recipe lays out this parameter for receiver rank " +
                           std::to_string(config_.rank) + " in " + std::to_string(part->bytes) +
                           " bytes, the buffer given has " + std::to_string(bytes) +
                           ": the server's parameter differs from the recipe's layout (check tp and the model's "
                           "config)");
  }
  if (part->bytes > 0 && static_cast<uint64_t>(part->bytes) > bytes) {
    return Status::invalid("buffer \"" + part->name + "\": its layout needs " + std::to_string(part->bytes) +
                           " bytes, the buffer given has " + std::to_string(bytes));
  }
  REFIT_RETURN_IF_ERROR(check_segments_fit(*part, bytes));
  if (part->segments.empty()) return Status::ok();  // this rank holds no part of it
  REFIT_RETURN_IF_ERROR(resources_->add_buffer(std::move(part).value(), static_cast<uint8_t*>(data), bytes));
  changed_ = true;
  return Status::ok();
}

// Registration is not bounded by a refresh's deadline: a registration the
// coordinator applied but whose reply came too late would leave the rank
// registered there and not here, refused at its next try.
Status ReceiverAgent::join() {
  if (joined_ && link_->dropped()) joined_ = false;  // declared dead: the coordinator holds nothing of it
  if (joined_ && !changed_) {
    enter(ReceiverState::kJoined);
    return Status::ok();
  }
  if (resources_->buffers().empty()) return Status::invalid("join: add at least one buffer first");
  const control::MemberRef me{control::Role::kReceiver, config_.rank};
  if (joined_) {
    link_->stop_heartbeat();
    Result<Json> r = link_->request(MsgType::kUnregister, control::to_json(me));
    if (!r.is_ok()) return r.status().with_context("re-registering");
    joined_ = false;
  }
  Result<Json> r = link_->request(MsgType::kRegisterReceiver, control::to_json(resources_->registration(config_)));
  if (!r.is_ok()) return r.status();
  joined_ = true;
  changed_ = false;
  compiled_.reset();
  if (Status hb = link_->start_heartbeat(me); !hb.is_ok()) {
    // Without heartbeats the coordinator would declare the member dead
    // later: it leaves now, and the next join registers it again.
    joined_ = false;
    (void)link_->request(MsgType::kUnregister, control::to_json(me));
    return hb.with_context("join");
  }
  enter(ReceiverState::kJoined);
  return Status::ok();
}

Status ReceiverAgent::commit() {
  if (refresh_running()) return Status::invalid("commit: a refresh is running");
  if (!config_.staged) return Status::invalid("commit: this receiver refreshes in \"direct\" mode");
  if (staged_version_ == 0) return Status::invalid("commit: no version is staged");
  log_.set_version(staged_version_);
  const Clock::time_point t0 = Clock::now();
  TraceSpan span(trace_.get(), "commit");
  span.arg("version", staged_version_);
  Status committed = resources_->commit(staged_ranges_);
  const double pause = seconds_between(t0, Clock::now());
  span.arg("ok", committed.is_ok());
  span.end();
  if (trace_) trace_->flush();
  if (Status st = committed; !st.is_ok()) {
    control::RefreshSummary summary;
    summary.rank = config_.rank;
    summary.version = staged_version_;
    summary.event = control::RefreshSummary::Event::kCommit;
    summary.staged = true;
    summary.outcome = control::RefreshSummary::Outcome::kFailed;
    summary.reason = st.reason();
    send_summary(summary);
    version_.store(0);
    staged_version_ = 0;
    enter(ReceiverState::kFailed);
    log_.error("commit failed part way; the live buffers are torn: " + st.message());
    return st.with_context("commit (the live buffers are torn)");
  }
  control::RefreshSummary summary;
  summary.rank = config_.rank;
  summary.version = staged_version_;
  summary.event = control::RefreshSummary::Event::kCommit;
  summary.staged = true;
  summary.seconds = std::min(pause, control::kMaxSummarySeconds);
  send_summary(summary);
  version_.store(staged_version_);
  staged_version_ = 0;
  enter(ReceiverState::kCommitted);
  Json report = Json::parse(reports_.back(), nullptr, false);
  if (report.is_object()) {
    report["pause_seconds"] = pause;
    report["committed"] = true;
    reports_.push_back(report.dump());  // the earlier report's string stays valid (include/refit/refit.h)
  }
  return Status::ok();
}

void ReceiverAgent::finish(const Status& status, const receiver::RefreshReport& r) {
  reports_.clear();
  reports_.push_back(receiver::report_json(r, status, config_));
  if (config_.staged) {
    if (!status.is_ok()) {
      log_.warn("refresh failed; the live buffers keep version " + std::to_string(version_.load()) + ": " +
                status.message());
    }
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

// Attempts until one succeeds, a failure's reason says a new attempt cannot
// fix it, or too little time is left.
Status ReceiverAgent::attempts(int64_t version, Clock::time_point deadline, receiver::RefreshReport* report) {
  receiver::RefreshSession session(*link_, config_, log_, *resources_, threads_,
                                   [this](ReceiverState s) { enter(s); }, trace_.get(), &progress_);
  uint64_t retries = 0;
  bool touched = false;  // some attempt began its transfer (direct: the buffers may be torn)
  while (true) {
    *report = receiver::RefreshReport{};
    progress_.version.store(0);
    progress_.planned.store(0);
    progress_.landed.store(0);
    progress_.attempt.store(static_cast<uint32_t>(retries + 1));
    Status st = join();
    if (st.is_ok()) st = session.attempt(version, deadline, &compiled_, report);
    if (resources_->fabric().contact_changed()) changed_ = true;  // registered anew before the next attempt
    touched = touched || report->touched;
    report->retries = retries;
    report->touched = touched;
    if (st.is_ok()) {
      if (!config_.verify) enter(ReceiverState::kVerified);
      return st;
    }
    enter(ReceiverState::kFailed);
    // Declared dead before this refresh heard of it (its lease was refused):
    // the next attempt registers again, whatever version it had reached.
    const bool unregistered = st.reason() == Reason::kNotRegistered;
    const bool again = (report->version > 0 || unregistered) && receiver::RefreshSession::retryable(st) &&
                       Clock::now() + kRetryPause * 2 < deadline;
    if (!again) return st;
    report->retries = ++retries;
    log_.info("refresh to " + std::to_string(report->version) + ", attempt " + std::to_string(retries) +
              " failed, retrying: " + st.message());
    std::this_thread::sleep_for(kRetryPause);
  }
}

Status ReceiverAgent::refresh_now(int64_t version, std::chrono::milliseconds timeout) {
  staged_version_ = 0;  // a staged version not committed is overwritten
  const Clock::time_point t0 = Clock::now();
  const Clock::time_point deadline = t0 + timeout;
  receiver::RefreshReport report;
  if (version > 0) log_.set_version(version);  // REFIT_LATEST: once the lease names one
  TraceSpan span(trace_.get(), "refresh");
  Status st = attempts(version, deadline, &report);
  // Staged: the instance commits all or nothing, failures included (a rank
  // that failed says so, and the others are told to abort).
  if (config_.staged && report.version > 0) {
    receiver::RefreshSession session(*link_, config_, log_, *resources_, threads_,
                                     [this](ReceiverState s) { enter(s); }, trace_.get());
    TraceSpan barrier(trace_.get(), "barrier");
    barrier.arg("version", report.version);
    st = session.barrier(st, report.version, deadline);
    barrier.arg("ok", st.is_ok());
    barrier.end();
    if (st.is_ok()) {
      staged_version_ = report.version;
      staged_ranges_ = compiled_->written;
      enter(ReceiverState::kStaged);
    } else if (st.reason() == Reason::kInstanceAborted || st.code() == Code::kTimeout) {
      enter(ReceiverState::kAborted);
    }
  } else if (st.is_ok()) {
    enter(ReceiverState::kCommitted);
  }
  report.total_s = seconds_between(t0, Clock::now());
  finish(st, report);
  control::RefreshSummary summary;
  summary.rank = config_.rank;
  summary.version = std::max<int64_t>(report.version, 0);
  summary.staged = config_.staged;
  summary.outcome = st.is_ok()                                 ? control::RefreshSummary::Outcome::kOk
                    : st.reason() == Reason::kInstanceAborted ? control::RefreshSummary::Outcome::kAborted
                                                               : control::RefreshSummary::Outcome::kFailed;
  summary.reason = st.reason();
  summary.seconds = std::min(report.total_s, control::kMaxSummarySeconds);
  summary.network_bytes = std::min<uint64_t>(report.transfer.network_bytes, control::kMaxSummaryBytes);
  summary.local_bytes = std::min<uint64_t>(report.local_bytes, control::kMaxSummaryBytes);
  summary.retries = static_cast<uint32_t>(std::min<uint64_t>(report.retries, control::kMaxSummaryRetries));
  send_summary(summary);
  span.arg("version", report.version);
  span.arg("ok", st.is_ok());
  span.arg("retries", report.retries);
  if (!st.is_ok()) span.arg("error", st.message());
  span.end();
  if (trace_) trace_->flush();
  return st;
}

void ReceiverAgent::send_summary(const control::RefreshSummary& summary) {
  if (!link_ || !joined_) return;  // the coordinator counts only registered ranks' summaries
  std::lock_guard<std::mutex> lock(summary_mu_);
  if (summary_stop_) return;
  if (summaries_.size() >= kMaxQueuedSummaries) {
    log_.info("the coordinator is slow to take refresh summaries for its metrics; one was dropped");
    return;
  }
  summaries_.push_back(summary);
  if (!summary_thread_.joinable()) {
    // No thread, or one that failed: the metrics lose the summaries, nothing else.
    Result<std::thread> t = threads_.start("refresh summary", [this] { summary_loop(); }, [this](const Status&) {
      std::lock_guard<std::mutex> guard(summary_mu_);
      summaries_.clear();
      summary_stop_ = true;
    });
    if (!t.is_ok()) {
      summaries_.clear();
      log_.info("no thread to send refresh summaries for the metrics: " + t.status().message());
      return;
    }
    summary_thread_ = std::move(t).value();
  }
  summary_cv_.notify_one();
}

void ReceiverAgent::summary_loop() {
  std::unique_lock<std::mutex> lock(summary_mu_);
  while (true) {
    summary_cv_.wait(lock, [this] { return summary_stop_ || !summaries_.empty(); });
    if (summaries_.empty()) return;  // stopping, and everything was sent
    if (summary_stop_ && Clock::now() >= summary_drain_until_) {
      log_.info(std::to_string(summaries_.size()) + " refresh summaries for the metrics were dropped: the "
                "coordinator did not take them within " + std::to_string(kSummaryDrain.count()) + " ms of leaving");
      summaries_.clear();
      return;
    }
    const control::RefreshSummary s = summaries_.front();
    summaries_.pop_front();
    const Clock::time_point until =
        summary_stop_ ? std::min(Clock::now() + kSummaryBound, summary_drain_until_) : Clock::now() + kSummaryBound;
    lock.unlock();
    Result<Json> r = link_->request(MsgType::kRefreshSummary, control::to_json(s), until);
    if (!r.is_ok()) log_.info("a refresh's summary for the metrics was not counted: " + r.status().message());
    lock.lock();
  }
}

void ReceiverAgent::stop_summaries() {
  {
    std::lock_guard<std::mutex> lock(summary_mu_);
    summary_stop_ = true;
    summary_drain_until_ = Clock::now() + kSummaryDrain;
  }
  summary_cv_.notify_one();
  if (summary_thread_.joinable()) summary_thread_.join();
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
  reports_.clear();
  reports_.push_back("{}");
  auto done = [this](const Status& st) {
    {
      std::lock_guard<std::mutex> lock(async_mutex_);
      async_status_ = st;
      async_done_ = true;
    }
    async_cv_.notify_all();
  };
  Result<std::thread> t =
      threads_.start("refresh", [this, version, timeout, done] { done(refresh_now(version, timeout)); }, done);
  if (!t.is_ok()) {
    std::lock_guard<std::mutex> lock(async_mutex_);
    async_done_ = true;
    return t.status();
  }
  async_ = std::move(t).value();
  return Status::ok();
}

std::optional<Status> ReceiverAgent::refresh_poll() { return refresh_wait(std::chrono::milliseconds(0)); }

std::optional<Status> ReceiverAgent::refresh_wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(async_mutex_);
  if (!async_cv_.wait_for(lock, timeout, [this] { return async_done_; })) return std::nullopt;
  return async_status_;
}

}  // namespace refit::plugin
