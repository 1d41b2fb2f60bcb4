#include "plugin/coordinator_link.h"

#include "transport/control/auth.h"

namespace refit::plugin {

using control::MsgType;

Result<std::unique_ptr<CoordinatorLink>> CoordinatorLink::connect(const AgentConfig& config, const Log& log) {
  Result<std::string> token = control::read_token_file(config.coordinator.token_file);
  if (!token.is_ok()) return token.status().with_context("config: \"coordinator.token_file\"");
  std::unique_ptr<CoordinatorLink> link(new CoordinatorLink(config, log));
  uint16_t port = config.coordinator.port;
  if (config.coordinator.embedded) {
    control::CoordinatorConfig cc;
    cc.host = config.coordinator.host;
    cc.port = config.coordinator.port;
    cc.token = *token;
    const Log* lp = &log;
    cc.log = [lp](const std::string& line) { lp->info("coordinator: " + line); };
    Result<std::unique_ptr<control::Coordinator>> started = control::Coordinator::start(std::move(cc));
    if (!started.is_ok()) {
      return started.status().with_context("config: \"coordinator.embedded\": cannot start the coordinator on " +
                                           config.coordinator.host + ":" + std::to_string(config.coordinator.port));
    }
    link->embedded_ = std::move(started).value();
    port = link->embedded_->port();
  }
  control::ClientOptions options;
  options.timeout = config.coordinator.timeout;
  Result<std::unique_ptr<control::Client>> client =
      control::Client::connect(config.coordinator.host, port, *token, options);
  if (!client.is_ok()) {
    return client.status().with_context("coordinator " + config.coordinator.host + ":" + std::to_string(port));
  }
  link->client_ = std::move(client).value();
  return link;
}

CoordinatorLink::~CoordinatorLink() {
  stop_heartbeat();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    client_.reset();
  }
  if (embedded_) embedded_->stop();
}

uint16_t CoordinatorLink::embedded_port() const { return embedded_ ? embedded_->port() : 0; }

Result<control::Json> CoordinatorLink::request(MsgType type, const control::Json& body) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!client_) return Status::io_error("the coordinator connection is closed");
  Result<control::Json> reply = client_->request(type, body);
  if (!reply.is_ok()) return reply.status().with_context(control::type_name(type));
  return reply;
}

Result<std::optional<control::Json>> CoordinatorLink::wait_notice(MsgType type,
                                                                   std::chrono::steady_clock::time_point deadline) {
  Result<std::optional<control::Frame>> f = wait_notice_of({type}, deadline);
  if (!f.is_ok()) return f.status();
  if (!f->has_value()) return std::optional<control::Json>();
  return std::optional<control::Json>(std::move((**f).body));
}

Result<std::optional<control::Frame>> CoordinatorLink::wait_notice_of(
    std::initializer_list<MsgType> types, std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  while (true) {
    const auto now = steady_clock::now();
    if (now >= deadline) return std::optional<control::Frame>();
    // Short slices, so that heartbeats get the client in between.
    const auto slice = std::min(duration_cast<milliseconds>(deadline - now) + milliseconds(1), milliseconds(50));
    std::lock_guard<std::mutex> lock(mutex_);
    if (!client_) return Status::io_error("the coordinator connection is closed");
    Result<control::Frame> frame = client_->wait_notice(slice);
    if (!frame.is_ok()) {
      // A slice that ends without a frame is not an error.
      const std::string& m = frame.status().message();
      if (m.find("timed out") != std::string::npos || m.find("no frame") != std::string::npos) {
        continue;
      }
      return frame.status().with_context("waiting for a notice");
    }
    for (MsgType t : types) {
      if (frame->type == t) return std::optional<control::Frame>(std::move(frame).value());
    }
  }
}

void CoordinatorLink::start_heartbeat(control::MemberRef member) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    member_ = member;
    dropped_.store(false, std::memory_order_release);
  }
  if (heartbeat_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(hb_mutex_);
    hb_stop_ = false;
  }
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

void CoordinatorLink::stop_heartbeat() {
  {
    std::lock_guard<std::mutex> lock(hb_mutex_);
    hb_stop_ = true;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

void CoordinatorLink::heartbeat_loop() {
  std::unique_lock<std::mutex> hb(hb_mutex_);
  while (!hb_cv_.wait_for(hb, config_.heartbeat, [this] { return hb_stop_; })) {
    hb.unlock();
    Status st;
    bool dropped = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (client_ && member_) {
        Result<control::Json> reply = client_->request(MsgType::kHeartbeat, control::to_json(*member_));
        st = reply.status();
        if (st.code() == Code::kNotFound) {  // declared dead: no use going on
          member_.reset();
          dropped_.store(true, std::memory_order_release);
          dropped = true;
        }
      }
    }
    if (dropped) {
      log_.warn("heartbeat: " + st.message() +
                ": the coordinator declared this member dead (its heartbeats came later than the coordinator's "
                "timeout); it registers again at its next refresh or publish");
    } else if (!st.is_ok()) {
      log_.warn("heartbeat: " + st.message());
    }
    hb.lock();
  }
}

}  // namespace refit::plugin
