// The coordinator over loopback (127.0.0.1, port 0): many clients at once,
// and every kind of bad peer, each refused with a logged reason while the
// others go on being served.
#include "transport/control/coordinator.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <mutex>
#include <random>
#include <thread>

#include "planner/layout_json.h"
#include "planner/plan.h"
#include "transport/control/client.h"

namespace refit::control {
namespace {

using namespace std::chrono_literals;
const std::string kToken = "test-token-0123456789abcdef";

class Coordinators : public ::testing::Test {
 protected:
  void start(CoordinatorConfig c = {}) {
    c.token = kToken;
    c.log = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      logs_.push_back(line);
    };
    auto r = Coordinator::start(std::move(c));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    co_ = std::move(r).value();
  }
  void TearDown() override {
    if (co_) co_->stop();
    if (HasFailure()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& l : logs_) std::fprintf(stderr, "log: %s\n", l.c_str());
    }
  }
  // The first log line containing every one of `parts`, waiting up to `timeout`.
  std::string wait_log(std::initializer_list<std::string> parts, std::chrono::milliseconds timeout = 3000ms) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    do {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& l : logs_) {
          bool all = true;
          for (const auto& p : parts) all = all && l.find(p) != std::string::npos;
          if (all) return l;
        }
      }
      std::this_thread::sleep_for(10ms);
    } while (std::chrono::steady_clock::now() < deadline);
    return "";
  }
  std::unique_ptr<Client> good_client() {
    auto c = Client::connect("127.0.0.1", co_->port(), kToken);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    return c.is_ok() ? std::move(c).value() : nullptr;
  }
  // A fresh client can still authenticate and be served.
  void expect_serving() {
    auto c = good_client();
    ASSERT_TRUE(c);
    auto r = c->request(MsgType::kSubscribe, Json::object());
    EXPECT_TRUE(r.is_ok()) << r.status().message();
  }
  std::unique_ptr<Client> raw_client() {
    auto c = Client::connect_raw("127.0.0.1", co_->port());
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    return c.is_ok() ? std::move(c).value() : nullptr;
  }

  std::unique_ptr<Coordinator> co_;
  std::mutex mu_;
  std::vector<std::string> logs_;
};

Json receiver_body(int rank) {
  RegisterReceiver m;
  m.rank = rank;
  m.instance = rank / 8;
  m.domain = rank / 4;
  m.worker_address = {1, 2, 3, 4};
  m.buffers.push_back(MemberBuffer{"model", "BF16", 2048, 0, {}, {Segment{"w", {0}, {1024}, 0, {1}}}});
  return to_json(m);
}

Json source_body(int rank) {
  RegisterSource m;
  m.rank = rank;
  m.domain = rank / 4;
  m.worker_address = {5, 6};
  m.tensors.push_back(TensorDecl{"w", "BF16", {1024}});
  m.buffers.push_back(MemberBuffer{"w", "BF16", 2048, 0x1000, {1, 2}, {Segment{"w", {0}, {1024}, 0, {1}}}});
  return to_json(m);
}

TEST_F(Coordinators, TwoHundredClientsRegisterAndHeartbeat) {
  CoordinatorConfig c;
  c.heartbeat_timeout = 20s;
  start(c);
  constexpr int kThreads = 10, kPerThread = 20, kBeats = 5;
  std::atomic<int> registered{0}, beats{0}, failures{0};
  std::atomic<int> connected{0};
  std::atomic<bool> release{false};
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::unique_ptr<Client>> clients;
      for (int i = 0; i < kPerThread; ++i) {
        auto cl = Client::connect("127.0.0.1", co_->port(), kToken);
        if (!cl.is_ok()) {
          ++failures;
          continue;
        }
        clients.push_back(std::move(cl).value());
      }
      ++connected;
      // Hold every connection open until all 200 are up: they are concurrent.
      while (connected.load() < kThreads) std::this_thread::sleep_for(1ms);
      for (int i = 0; i < static_cast<int>(clients.size()); ++i) {
        const int rank = t * kPerThread + i;
        const bool src = rank % 2 == 0;
        auto r = clients[i]->request(src ? MsgType::kRegisterSource : MsgType::kRegisterReceiver,
                                     src ? source_body(rank) : receiver_body(rank));
        if (r.is_ok()) ++registered;
        else ++failures;
      }
      for (int b = 0; b < kBeats; ++b) {
        for (int i = 0; i < static_cast<int>(clients.size()); ++i) {
          const int rank = t * kPerThread + i;
          auto r = clients[i]->request(MsgType::kHeartbeat,
                                       Json{{"role", rank % 2 == 0 ? "source" : "receiver"}, {"rank", rank}});
          if (r.is_ok()) ++beats;
          else ++failures;
        }
      }
      ++connected;  // done; keep the clients open until the stats are taken
      while (!release.load()) std::this_thread::sleep_for(1ms);
    });
  }
  // Check while all 200 connections are still open.
  while (connected.load() < 2 * kThreads) std::this_thread::sleep_for(5ms);
  auto st = co_->stats();
  release = true;
  for (auto& th : threads) th.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(registered.load(), 200);
  EXPECT_EQ(beats.load(), 200 * kBeats);
  EXPECT_EQ(st->sources, 100u);
  EXPECT_EQ(st->receivers, 100u);
  EXPECT_EQ(st->connections, 200u);
  std::printf("200 clients: %d registrations, %d heartbeats in %.2f s\n", registered.load(), beats.load(), secs);
}

TEST_F(Coordinators, DropsHalfFrameStallerAtItsDeadlineWhileOthersGoOn) {
  CoordinatorConfig c;
  c.read_timeout = 500ms;
  start(c);
  auto staller = good_client();
  auto other = good_client();
  ASSERT_TRUE(staller && other);
  ASSERT_TRUE(other->request(MsgType::kRegisterSource, source_body(0)).is_ok());
  auto frame = encode_frame(MsgType::kHeartbeat, Json{{"role", "source"}, {"rank", 0}});
  ASSERT_TRUE(frame.is_ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(staller->send_raw(frame->data(), frame->size() / 2).is_ok());
  // The other client is served throughout the staller's wait.
  int served = 0;
  while (std::chrono::steady_clock::now() - t0 < 400ms) {
    auto r = other->request(MsgType::kHeartbeat, Json{{"role", "source"}, {"rank", 0}});
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    ++served;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(staller->wait_closed(3s));
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, 450ms);
  EXPECT_LT(waited, 2500ms);
  EXPECT_GT(served, 5);
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "sent part of a frame and did not finish it within 500 ms"}), "");
  EXPECT_TRUE(other->request(MsgType::kHeartbeat, Json{{"role", "source"}, {"rank", 0}}).is_ok());
}

TEST_F(Coordinators, DropsClientThatNeverAnswersTheChallenge) {
  CoordinatorConfig c;
  c.auth_timeout = 300ms;
  start(c);
  auto raw = raw_client();
  ASSERT_TRUE(raw);
  auto ch = raw->read_frame(2s);
  ASSERT_TRUE(ch.is_ok());
  EXPECT_EQ(ch->type, MsgType::kChallenge);
  EXPECT_TRUE(raw->wait_closed(3s));
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "did not authenticate within 300 ms"}), "");
  expect_serving();
}

TEST_F(Coordinators, RefusesOversizeFrame) {
  CoordinatorConfig c;
  c.decoder.max_frame_bytes = 1 << 20;
  start(c);
  auto cl = good_client();
  ASSERT_TRUE(cl);
  uint8_t h[kHeaderBytes] = {'R', 'F', 'C', 'P', 0, 1, 0, 16, 0x04, 0x2c, 0x1d, 0x80};  // 70000000 bytes
  ASSERT_TRUE(cl->send_raw(h, sizeof h).is_ok());
  auto f = cl->read_frame(2s);  // authenticated: the reason is sent back
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  EXPECT_EQ(f->type, MsgType::kError);
  EXPECT_EQ(f->body["reason"], "frame: length 70000000 exceeds the limit of 1048576 bytes");
  EXPECT_TRUE(cl->wait_closed(2s));
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "frame: length 70000000 exceeds the limit of 1048576 bytes"}), "");
  // Before authenticating, anything bigger than an auth response is refused.
  auto raw = raw_client();
  ASSERT_TRUE(raw);
  uint8_t pre[kHeaderBytes] = {'R', 'F', 'C', 'P', 0, 1, 0, 2, 0, 0, 0x13, 0x88};  // 5000 bytes
  ASSERT_TRUE(raw->send_raw(pre, sizeof pre).is_ok());
  EXPECT_TRUE(raw->wait_closed(2s));
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "frame: length 5000 exceeds the limit of 1024 bytes (before authenticating)"}), "");
  expect_serving();
}

TEST_F(Coordinators, RefusesWrongProtocolVersion) {
  start();
  auto raw = raw_client();
  ASSERT_TRUE(raw);
  auto frame = encode_frame(MsgType::kAuthResponse, Json{{"mac", Json::binary({1})}});
  ASSERT_TRUE(frame.is_ok());
  (*frame)[5] = 2;
  ASSERT_TRUE(raw->send_raw(frame->data(), frame->size()).is_ok());
  auto ch = raw->read_frame(2s);
  ASSERT_TRUE(ch.is_ok());
  EXPECT_EQ(ch->type, MsgType::kChallenge);
  EXPECT_TRUE(raw->wait_closed(2s)) << "nothing but the challenge before authenticating";
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "frame: protocol version 2 is not supported"}), "");
  expect_serving();
}

TEST_F(Coordinators, RefusesWrongToken) {
  start();
  auto c = Client::connect("127.0.0.1", co_->port(), "not-the-token-0123456789");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("auth: the coordinator refused the token"), std::string::npos)
      << c.status().message();
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "auth: wrong token"}), "");
  expect_serving();
  auto st = co_->stats();
  ASSERT_TRUE(st.is_ok());
  EXPECT_GE(st->refused, 1u);
}

TEST_F(Coordinators, RefusesRandomBytes) {
  start();
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    auto raw = raw_client();
    ASSERT_TRUE(raw);
    std::vector<uint8_t> junk(1 + rng() % 4096);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    junk[0] = 'X';
    ASSERT_TRUE(raw->send_raw(junk.data(), junk.size()).is_ok() || true);
    EXPECT_TRUE(raw->wait_closed(2s));
  }
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "frame: bad magic byte 0 (0x58)"}), "");
  expect_serving();
}

TEST_F(Coordinators, RefusesRequestsBeforeAuthentication) {
  start();
  auto raw = raw_client();
  ASSERT_TRUE(raw);
  auto ch = raw->read_frame(2s);
  ASSERT_TRUE(ch.is_ok());
  ASSERT_TRUE(raw->send_frame(MsgType::kRegisterSource, source_body(0)).is_ok());
  EXPECT_TRUE(raw->wait_closed(2s));
  EXPECT_NE(wait_log({"refused 127.0.0.1:", "sent register_source before authenticating"}), "");
  auto st = co_->stats();
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->sources, 0u);
}

TEST_F(Coordinators, RefusesBadRequestsWithAReasonAndKeepsTheConnection) {
  start();
  auto cl = good_client();
  ASSERT_TRUE(cl);
  ASSERT_TRUE(cl->request(MsgType::kRegisterSource, source_body(1)).is_ok());
  auto dup = cl->request(MsgType::kRegisterSource, source_body(1));
  ASSERT_FALSE(dup.is_ok());
  EXPECT_EQ(dup.status().message(), "register_source: source rank 1 is already registered; unregister it first");
  Json bad = source_body(2);
  bad["rank"] = 1 << 30;
  auto out = cl->request(MsgType::kRegisterSource, bad);
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.status().message().find("register_source: rank must be an integer in [0, 1048575]"),
            std::string::npos);
  // Nested too deeply: refused by the decoder, which closes the connection.
  Json deep = 1;
  for (int i = 0; i < 40; ++i) deep = Json::array({deep});
  auto d = cl->request(MsgType::kRegisterSource, Json{{"x", deep}});
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("nesting deeper than 16 levels"), std::string::npos) << d.status().message();
  expect_serving();
}

TEST_F(Coordinators, NotifiesSubscribersOfPublishedVersions) {
  start();
  auto src = good_client();
  auto sub = good_client();
  ASSERT_TRUE(src && sub);
  ASSERT_TRUE(sub->request(MsgType::kSubscribe, Json::object()).is_ok());
  ASSERT_TRUE(src->request(MsgType::kRegisterSource, source_body(0)).is_ok());
  ASSERT_TRUE(src->request(MsgType::kPublishVersion, Json{{"version", 5}}).is_ok());
  auto n = sub->wait_notice(2s);
  ASSERT_TRUE(n.is_ok()) << n.status().message();
  EXPECT_EQ(n->type, MsgType::kVersionNotify);
  EXPECT_EQ(n->body["version"], 5);
  EXPECT_FALSE(src->request(MsgType::kPublishVersion, Json{{"version", 4}}).is_ok());
  EXPECT_FALSE(sub->request(MsgType::kPublishVersion, Json{{"version", 9}}).is_ok()) << "not a source";
}

TEST_F(Coordinators, DeclaresAKilledClientDeadByHeartbeatTimeout) {
  CoordinatorConfig c;
  c.heartbeat_timeout = 400ms;
  start(c);
  const uint16_t port = co_->port();
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: register, heartbeat, say so, then hang until killed.
    close(pipefd[0]);
    auto cl = Client::connect("127.0.0.1", port, kToken);
    if (!cl.is_ok()) _exit(2);
    if (!(*cl)->request(MsgType::kRegisterReceiver, receiver_body(999)).is_ok()) _exit(3);
    if (!(*cl)->request(MsgType::kHeartbeat, Json{{"role", "receiver"}, {"rank", 999}}).is_ok()) _exit(4);
    char ok = 1;
    if (write(pipefd[1], &ok, 1) != 1) _exit(5);
    for (;;) pause();
  }
  close(pipefd[1]);
  char ok = 0;
  ASSERT_EQ(read(pipefd[0], &ok, 1), 1) << "the child did not register";
  close(pipefd[0]);
  auto st = co_->stats();
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->receivers, 1u);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  EXPECT_NE(wait_log({"receiver rank 999 declared dead after", "its state is removed"}, 5s), "");
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 3s);
  st = co_->stats();
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->receivers, 0u);
  expect_serving();
}

// The plan part each receiver fetches equals the runs refit-plan writes
// (write_runs_json) for the same layout file, and is replanned when the
// membership changes.
TEST_F(Coordinators, ServesThePlanPartThatRefitPlanComputes) {
  const char* root = std::getenv("REFIT_SOURCE_ROOT");
  if (!root) GTEST_SKIP() << "REFIT_SOURCE_ROOT is not set (meson test sets it)";
  const std::string path = std::string(root) + "/examples/layouts/cross-dim.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  std::stringstream text;
  text << in.rdbuf();
  Result<Layout> layout = parse_layout_json(text.str(), path);
  ASSERT_TRUE(layout.is_ok()) << layout.status().message();
  Result<Plan> plan = make_plan(*layout);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const Json runs = Json::parse(write_runs_json(*plan))["runs"];
  const Json doc = Json::parse(write_layout_json(*layout));

  start();
  // Each member registers its own part of the explicit layout.
  auto buffers_of = [&](const char* side, int rank) {
    std::vector<MemberBuffer> out;
    for (const Json& b : doc["buffers"]) {
      if (b["side"] != side || b["rank"] != rank) continue;
      MemberBuffer mb{b["name"], b["dtype"], b["bytes"], 0, {7}, {}};
      for (const Json& sg : b["segments"]) {
        mb.segments.push_back(Segment{sg["tensor"], sg["start"].get<std::vector<int64_t>>(),
                                      sg["size"].get<std::vector<int64_t>>(), sg["offset"],
                                      sg["strides"].get<std::vector<int64_t>>()});
      }
      out.push_back(std::move(mb));
    }
    return out;
  };
  std::vector<std::unique_ptr<Client>> sources, receivers;
  std::vector<Json> receiver_regs;
  for (const Json& s : doc["sources"]) {
    RegisterSource m;
    m.rank = s["rank"];
    m.domain = s["domain"];
    m.worker_address = {1};
    for (const Json& t : doc["tensors"]) {
      m.tensors.push_back(TensorDecl{t["name"], t["dtype"], t["shape"].get<std::vector<int64_t>>()});
    }
    m.buffers = buffers_of("source", m.rank);
    sources.push_back(good_client());
    auto r = sources.back()->request(MsgType::kRegisterSource, to_json(m));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
  }
  for (const Json& rj : doc["receivers"]) {
    RegisterReceiver m;
    m.rank = rj["rank"];
    m.domain = rj["domain"];
    m.instance = rj["instance"];
    m.worker_address = {2};
    m.buffers = buffers_of("receiver", m.rank);
    receivers.push_back(good_client());
    receiver_regs.push_back(to_json(m));
    auto r = receivers.back()->request(MsgType::kRegisterReceiver, receiver_regs.back());
    ASSERT_TRUE(r.is_ok()) << r.status().message();
  }
  size_t served = 0;
  for (size_t i = 0; i < receivers.size(); ++i) {
    const int rank = doc["receivers"][i]["rank"];
    Json expected = Json::array();
    for (const Json& run : runs) {
      if (run["to"]["rank"] == rank || (run["kind"] == "local" && run["from"]["rank"] == rank)) {
        expected.push_back(run);
      }
    }
    auto part = receivers[i]->request(MsgType::kFetchPlan, Json{{"rank", rank}});
    ASSERT_TRUE(part.is_ok()) << part.status().message();
    EXPECT_EQ((*part)["runs"], expected) << "receiver rank " << rank;
    // The peers it needs: both sources (cross-dim pulls from each), with the
    // rkeys they registered.
    const Json& peers = (*part)["peers"]["sources"];
    ASSERT_EQ(peers.size(), 2u) << (*part)["peers"].dump();
    EXPECT_EQ(peers[0]["worker_address"], Json::binary({1}));
    ASSERT_FALSE(peers[0]["buffers"].empty());
    EXPECT_EQ(peers[0]["buffers"][0]["rkey"], Json::binary({7}));
    EXPECT_FALSE(expected.empty());
    served += (*part)["runs"].size();
  }
  EXPECT_GE(served, runs.size());
  auto st = co_->stats();
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->plans, 1u) << "one plan per membership";
  // Another connection may not fetch a receiver's part.
  EXPECT_FALSE(sources[0]->request(MsgType::kFetchPlan, Json{{"rank", 0}}).is_ok());
  // A member leaves: the next fetch replans.
  ASSERT_TRUE(receivers[1]->request(MsgType::kUnregister, Json{{"role", "receiver"}, {"rank", 1}}).is_ok());
  auto again = receivers[0]->request(MsgType::kFetchPlan, Json{{"rank", 0}});
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  st = co_->stats();
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->plans, 2u);
  // Pipelined requests get their replies in order, though planning runs off
  // the I/O thread: a membership change, then fetch_plan and heartbeat in one write.
  ASSERT_TRUE(receivers[1]->request(MsgType::kRegisterReceiver, receiver_regs[1]).is_ok());
  auto fetch = encode_frame(MsgType::kFetchPlan, Json{{"rank", 0}});
  auto beat = encode_frame(MsgType::kHeartbeat, Json{{"role", "receiver"}, {"rank", 0}});
  ASSERT_TRUE(fetch.is_ok() && beat.is_ok());
  std::vector<uint8_t> both = *fetch;
  both.insert(both.end(), beat->begin(), beat->end());
  ASSERT_TRUE(receivers[0]->send_raw(both.data(), both.size()).is_ok());
  auto first = receivers[0]->read_frame(5s);
  auto second = receivers[0]->read_frame(5s);
  ASSERT_TRUE(first.is_ok() && second.is_ok());
  ASSERT_TRUE(first->body.contains("runs")) << first->body.dump();
  EXPECT_EQ(first->body["runs"].size(), 12u);
  EXPECT_EQ(second->body, (Json{{"ok", true}}));
  std::printf("plan parts: %zu runs served over %zu receivers; %zu runs in refit-plan's output\n", served,
              receivers.size(), runs.size());
}

TEST_F(Coordinators, CommitsAnInstanceWhenAllRanksStaged) {
  start();
  auto r0 = good_client();
  auto r1 = good_client();
  ASSERT_TRUE(r0 && r1);
  ASSERT_TRUE(r0->request(MsgType::kRegisterReceiver, receiver_body(0)).is_ok());
  ASSERT_TRUE(r1->request(MsgType::kRegisterReceiver, receiver_body(1)).is_ok());
  ASSERT_TRUE(r0->request(MsgType::kReportStaged, Json{{"rank", 0}, {"version", 2}}).is_ok());
  ASSERT_TRUE(r1->request(MsgType::kReportStaged, Json{{"rank", 1}, {"version", 2}}).is_ok());
  for (auto* c : {r0.get(), r1.get()}) {
    auto n = c->wait_notice(2s);
    ASSERT_TRUE(n.is_ok()) << n.status().message();
    EXPECT_EQ(n->type, MsgType::kCommit);
    EXPECT_EQ(n->body["version"], 2);
  }
  ASSERT_TRUE(r0->request(MsgType::kReportStaged, Json{{"rank", 0}, {"version", 3}}).is_ok());
  ASSERT_TRUE(r1->request(MsgType::kReportFailed, Json{{"rank", 1}, {"version", 3}, {"reason", "out of memory"}}).is_ok());
  for (auto* c : {r0.get(), r1.get()}) {
    auto n = c->wait_notice(2s);
    ASSERT_TRUE(n.is_ok()) << n.status().message();
    EXPECT_EQ(n->type, MsgType::kAbort);
    EXPECT_EQ(n->body["reason"], "receiver rank 1 failed: out of memory");
  }
}

TEST_F(Coordinators, TellsASourceWhenItsVersionIsDrained) {
  start();
  auto src = good_client();
  auto rcv = good_client();
  ASSERT_TRUE(src && rcv);
  ASSERT_TRUE(src->request(MsgType::kRegisterSource, source_body(0)).is_ok());
  ASSERT_TRUE(rcv->request(MsgType::kRegisterReceiver, receiver_body(0)).is_ok());
  ASSERT_TRUE(src->request(MsgType::kPublishVersion, Json{{"version", 1}}).is_ok());
  ASSERT_TRUE(rcv->request(MsgType::kLease, Json{{"rank", 0}, {"version", 1}}).is_ok());
  auto w = src->request(MsgType::kWaitDrained, Json{{"version", 1}});
  ASSERT_TRUE(w.is_ok()) << w.status().message();
  EXPECT_EQ((*w)["drained"], false);
  ASSERT_TRUE(rcv->request(MsgType::kRelease, Json{{"rank", 0}, {"version", 1}}).is_ok());
  auto n = src->wait_notice(2s);
  ASSERT_TRUE(n.is_ok()) << n.status().message();
  EXPECT_EQ(n->type, MsgType::kDrained);
  EXPECT_EQ(n->body["version"], 1);
}

}  // namespace
}  // namespace refit::control
