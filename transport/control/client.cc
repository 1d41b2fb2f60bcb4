#include "transport/control/client.h"

#include <boost/asio.hpp>
#include <thread>

#include "transport/control/auth.h"

namespace refit::control {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;

// All members belong to the thread inside the current call.
class Client::Impl {
 public:
  explicit Impl(ClientOptions o) : options_(o), socket_(io_), decoder_(o.decoder), buf_(65536) {}

  // Runs one async operation started by `start` for at most `timeout`;
  // cancels it at the deadline and reports timed_out.
  template <typename Start>
  error_code run(std::chrono::milliseconds timeout, Start start) {
    error_code result = asio::error::would_block;
    bool done = false;
    io_.restart();
    start([&](error_code ec, auto&&...) {
      result = ec;
      done = true;
    });
    io_.run_for(timeout);
    if (!done) {
      error_code ignored;
      socket_.cancel(ignored);
      io_.restart();
      io_.run();
      return asio::error::timed_out;
    }
    return result;
  }

  Status connect(const std::string& host, uint16_t port) {
    error_code ec;
    asio::ip::address addr = asio::ip::make_address(host, ec);
    if (ec) return Status::invalid("client: \"" + host + "\" is not an IP address");
    tcp::endpoint ep(addr, port);
    ec = run(options_.timeout, [&](auto h) { socket_.async_connect(ep, h); });
    if (ec) {
      const std::string what = "client: cannot connect to " + host + ":" + std::to_string(port) + ": " + ec.message();
      // No route now (the host's link was down, or its neighbour entry
      // still says so after it came back): a timeout, which a caller with
      // time left tries again; a refusal is an answer.
      if (ec == asio::error::host_unreachable || ec == asio::error::network_unreachable) {
        return Status::timeout(what);
      }
      return Status::io_error(what);
    }
    socket_.set_option(tcp::no_delay(true), ec);
    return Status::ok();
  }

  Status write(const uint8_t* data, size_t size) {
    error_code ec = run(options_.timeout, [&](auto h) { asio::async_write(socket_, asio::buffer(data, size), h); });
    if (ec) return Status::io_error("client: write failed: " + ec.message());
    return Status::ok();
  }

  Result<Frame> read_frame(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      Result<std::optional<Frame>> f = decoder_.next();
      if (!f.is_ok()) return f.status().with_context("client");
      if (f->has_value()) return std::move(**f);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return Status::io_error("client: no frame from the coordinator within " +
                                                     std::to_string(timeout.count()) + " ms");
      size_t got = 0;
      error_code ec = run(left, [&](auto h) {
        socket_.async_read_some(asio::buffer(buf_), [&got, h](error_code e, size_t n) mutable {
          got = n;
          h(e);
        });
      });
      if (ec == asio::error::eof) return Status::io_error("client: the coordinator closed the connection");
      if (ec) return Status::io_error("client: read failed: " + ec.message());
      decoder_.feed(buf_.data(), got);
    }
  }

  bool cut() const { return cut_; }

  Status authenticate(const Credential& credential) {
    const AuthRole role = options_.role;
    Result<Mac> key = credential.key_for(role);
    if (!key.is_ok()) return key.status();
    Result<Frame> ch = read_frame(options_.timeout);
    if (!ch.is_ok()) {
      cut_ = ch.status().code() == Code::kIoError;
      return ch.status().with_context("auth: waiting for the challenge");
    }
    const Json& b = ch->body;
    if (ch->type != MsgType::kChallenge || !b.is_object() || !b.contains("nonce") || !b["nonce"].is_binary() ||
        b["nonce"].get_binary().size() != kNonceBytes) {
      return Status::invalid(std::string("auth: expected a challenge, got ") + type_name(ch->type));
    }
    Nonce server{};
    std::copy(b["nonce"].get_binary().begin(), b["nonce"].get_binary().end(), server.begin());
    Result<Nonce> client = make_nonce();
    if (!client.is_ok()) return client.status();
    Result<Mac> mac = client_proof(*key, role, server, *client);
    if (!mac.is_ok()) return mac.status();
    Status sent = send_frame(MsgType::kAuthResponse,
                             Json{{"role", auth_role_name(role)},
                                  {"nonce", Json::binary(std::vector<uint8_t>(client->begin(), client->end()))},
                                  {"mac", Json::binary(std::vector<uint8_t>(mac->begin(), mac->end()))}});
    if (!sent.is_ok()) {
      cut_ = sent.code() == Code::kIoError;
      return sent;
    }
    Result<Frame> ok = read_frame(options_.timeout);
    if (!ok.is_ok()) {
      cut_ = ok.status().code() == Code::kIoError;
      return ok.status().with_context(std::string("auth: waiting for the answer to the proof for the role \"") +
                                      auth_role_name(role) + "\"");
    }
    if (ok->type == MsgType::kError) {
      const Json& e = ok->body;
      return Status::invalid(std::string("auth: the coordinator refused the connection: ") +
                             (e.is_object() && e.contains("reason") && e["reason"].is_string()
                                  ? e["reason"].get<std::string>() : std::string("no reason given")));
    }
    if (ok->type != MsgType::kAuthOk) return Status::invalid(std::string("auth: expected auth_ok, got ") + type_name(ok->type));
    // The coordinator proves it holds the role's key too: a peer that does
    // not (a stranger in the middle) is refused here.
    Result<Mac> expected = server_proof(*key, role, server, *client);
    const Json* proof = ok->body.is_object() && ok->body.contains("mac") ? &ok->body["mac"] : nullptr;
    if (!expected.is_ok() || !proof || !proof->is_binary() || !mac_equal(*expected, proof->get_binary())) {
      return Status::invalid("auth: the coordinator's proof does not match: it does not hold the key of the role \"" +
                             std::string(auth_role_name(role)) + "\" (a wrong address, or someone in the middle)");
    }
    Result<SessionKeys> keys = session_keys(*key, role, server, *client);
    if (!keys.is_ok()) return keys.status();
    sealer_ = FrameSealer(keys->client_to_server);
    decoder_.expect_seals(keys->server_to_client);
    return Status::ok();
  }

  Status send_frame(MsgType type, const Json& body, uint32_t id = 0) {
    Result<std::vector<uint8_t>> bytes = encode_frame(type, body, options_.decoder.max_frame_bytes, id);
    if (!bytes.is_ok()) return bytes.status();
    REFIT_RETURN_IF_ERROR(sealer_.seal(*bytes));
    return write(bytes->data(), bytes->size());
  }

  Result<Json> request(MsgType type, const Json& body) {
    const uint32_t id = next_id_++;
    if (next_id_ == 0) next_id_ = 1;
    REFIT_RETURN_IF_ERROR(send_frame(type, body, id));
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) left = std::chrono::milliseconds(1);
      Result<Frame> f = read_frame(left);
      if (!f.is_ok()) return f.status().with_context(type_name(type));
      if (is_notice(f->type)) {
        if (notices_.size() < 1024) notices_.push_back(std::move(*f));
        continue;
      }
      // The late reply of an earlier request that timed out: not ours.
      if (f->type == MsgType::kReply && f->id != id) continue;
      return reply_result(type_name(type), std::move(f).value());
    }
  }

  AuthenticatedSocket release() {
    AuthenticatedSocket out;
    out.fd = socket_.release();
    out.sealer = sealer_;
    out.decoder = std::move(decoder_);
    out.next_id = next_id_;
    return out;
  }

  static bool is_notice(MsgType t) {
    return t == MsgType::kVersionNotify || t == MsgType::kCommit || t == MsgType::kAbort ||
           t == MsgType::kDrained;
  }

  Result<Frame> wait_notice(std::chrono::milliseconds timeout) {
    if (notices_.empty()) {
      Result<Frame> f = read_frame(timeout);
      if (!f.is_ok()) return f.status();
      if (!is_notice(f->type)) {
        return Status::invalid(std::string("client: expected a notice, got ") + type_name(f->type));
      }
      return f;
    }
    Frame f = std::move(notices_.front());
    notices_.pop_front();
    return f;
  }

  bool wait_closed(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      error_code ec = run(left, [&](auto h) {
        socket_.async_read_some(asio::buffer(buf_), [h](error_code e, size_t) mutable { h(e); });
      });
      if (ec == asio::error::timed_out) return false;
      if (ec) return true;  // eof, reset
    }
  }

  ClientOptions options_;
  // The last authenticate() failed on the connection itself (closed, reset,
  // silent), not on what the coordinator said.
  bool cut_ = false;
  asio::io_context io_;
  tcp::socket socket_;
  FrameDecoder decoder_;
  FrameSealer sealer_;
  uint32_t next_id_ = 1;
  std::vector<uint8_t> buf_;
  std::deque<Frame> notices_;
};

Result<Json> reply_result(const char* request, Frame f) {
  if (f.type == MsgType::kError) {
    std::string reason = f.body.is_object() && f.body.contains("reason") && f.body["reason"].is_string()
                             ? f.body["reason"].get<std::string>() : "no reason given";
    return Status::invalid(std::string(request) + ": the coordinator closed the connection: " + reason);
  }
  if (f.type != MsgType::kReply || !f.body.is_object()) {
    return Status::invalid(std::string(request) + ": expected a reply, got " + type_name(f.type));
  }
  const auto ok = f.body.find("ok");
  if (ok == f.body.end() || !ok->is_boolean() || !ok->get<bool>()) {
    std::string error = f.body.contains("error") && f.body["error"].is_string()
                            ? f.body["error"].get<std::string>() : "refused without a reason";
    const auto why = f.body.find("reason");
    const Reason reason = why != f.body.end() && why->is_string() ? reason_from_name(why->get<std::string>())
                                                                  : Reason::kNone;
    const auto nf = f.body.find("not_found");
    if (nf != f.body.end() && nf->is_boolean() && nf->get<bool>()) {
      return Status::not_found(std::move(error)).with_reason(reason);
    }
    return Status::invalid(std::move(error)).with_reason(reason);
  }
  return std::move(f.body);
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::connect_raw(const std::string& host, uint16_t port, ClientOptions options) {
  auto impl = std::make_unique<Impl>(options);
  REFIT_RETURN_IF_ERROR(impl->connect(host, port));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Result<std::unique_ptr<Client>> Client::connect(const std::string& host, uint16_t port, const Credential& credential,
                                                ClientOptions options) {
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  for (std::chrono::milliseconds pause(20);; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
    auto impl = std::make_unique<Impl>(options);
    REFIT_RETURN_IF_ERROR(impl->connect(host, port));
    Status st = impl->authenticate(credential);
    if (st.is_ok()) return std::unique_ptr<Client>(new Client(std::move(impl)));
    const auto now = std::chrono::steady_clock::now();
    if (!options.on_cut || !impl->cut() || now + pause >= deadline) return st;
    options.on_cut(st.message(), pause);
    std::this_thread::sleep_for(pause);
    options.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - (now + pause));
  }
}

Result<std::unique_ptr<Client>> Client::connect(const std::string& host, uint16_t port, const std::string& token,
                                                ClientOptions options) {
  return connect(host, port, credential_from_token(token), options);
}

Result<Json> Client::request(MsgType type, const Json& body) { return impl_->request(type, body); }
Result<Frame> Client::wait_notice(std::chrono::milliseconds t) { return impl_->wait_notice(t); }
Status Client::send_raw(const uint8_t* d, size_t n) { return impl_->write(d, n); }
Status Client::send_frame(MsgType type, const Json& body, uint32_t id) { return impl_->send_frame(type, body, id); }
AuthenticatedSocket Client::release() { return impl_->release(); }
Result<Frame> Client::read_frame(std::chrono::milliseconds t) { return impl_->read_frame(t); }
bool Client::wait_closed(std::chrono::milliseconds t) { return impl_->wait_closed(t); }

}  // namespace refit::control
