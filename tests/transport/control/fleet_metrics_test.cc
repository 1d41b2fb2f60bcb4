// The fleet's metrics: refresh_summary as untrusted input, its aggregation
// into the coordinator's metrics, and a coordinator that counts what its
// registered receivers send over real sockets.

#include "transport/control/fleet_metrics.h"

#include <cmath>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "transport/control/client.h"
#include "transport/control/coordinator.h"

namespace refit::control {
namespace {

const std::string kToken = "fleet-metrics-token-0123456789ab";

RefreshSummary summary(int32_t rank, int64_t version, bool staged, RefreshSummary::Outcome outcome,
                       Reason reason, double seconds) {
  RefreshSummary s;
  s.rank = rank;
  s.version = version;
  s.staged = staged;
  s.outcome = outcome;
  s.reason = reason;
  s.seconds = seconds;
  s.network_bytes = 1000;
  s.local_bytes = 10;
  return s;
}

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos;
}

TEST(RefreshSummaryMessage, RoundTrips) {
  RefreshSummary s = summary(3, 7, true, RefreshSummary::Outcome::kAborted, Reason::kInstanceAborted, 1.25);
  s.retries = 2;
  Result<RefreshSummary> back = parse_refresh_summary(to_json(s), MessageLimits{});
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->rank, 3);
  EXPECT_EQ(back->version, 7);
  EXPECT_TRUE(back->staged);
  EXPECT_EQ(back->outcome, RefreshSummary::Outcome::kAborted);
  EXPECT_EQ(back->reason, Reason::kInstanceAborted);
  EXPECT_DOUBLE_EQ(back->seconds, 1.25);
  EXPECT_EQ(back->network_bytes, 1000u);
  EXPECT_EQ(back->local_bytes, 10u);
  EXPECT_EQ(back->retries, 2u);
}

TEST(RefreshSummaryMessage, RefusesWhatWouldGrowOrPoisonTheMetrics) {
  const Json good = to_json(summary(0, 1, false, RefreshSummary::Outcome::kOk, Reason::kNone, 0.5));
  ASSERT_TRUE(parse_refresh_summary(good, MessageLimits{}).is_ok());
  struct Case {
    const char* key;
    Json value;
    const char* says;
  };
  const Case cases[] = {
      {"reason", "made_up", "reason must be a failure reason"},
      {"outcome", "partly", "outcome must be one of"},
      {"mode", "sideways", "mode must be one of"},
      {"event", "reboot", "event must be one of"},
      {"seconds", -1.0, "seconds must be a number in"},
      {"seconds", std::numeric_limits<double>::infinity(), "seconds must be a number in"},
      {"seconds", std::nan(""), "seconds must be a number in"},
      {"seconds", 1e300, "seconds must be a number in"},
      {"seconds", "fast", "seconds must be a number in"},
      {"network_bytes", -5, "network_bytes must be an integer in"},
      {"local_bytes", Json(uint64_t{1} << 63), "local_bytes must be an integer in"},
      {"retries", 10000001, "retries must be an integer in"},
      {"rank", -1, "rank must be an integer in"},
  };
  for (const Case& c : cases) {
    Json body = good;
    body[c.key] = c.value;
    Result<RefreshSummary> r = parse_refresh_summary(body, MessageLimits{});
    ASSERT_FALSE(r.is_ok()) << c.key << " = " << c.value.dump();
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().rfind("refresh_summary: ", 0), 0u) << r.status().message();
  }
  Json missing = good;
  missing.erase("seconds");
  EXPECT_NE(parse_refresh_summary(missing, MessageLimits{}).status().message().find("seconds is missing"),
            std::string::npos);
  Json commit = good;
  commit["event"] = "commit";  // a commit in direct mode does not exist
  EXPECT_FALSE(parse_refresh_summary(commit, MessageLimits{}).is_ok());
  Json ok_with_reason = good;
  ok_with_reason["reason"] = "peer_lost";
  EXPECT_FALSE(parse_refresh_summary(ok_with_reason, MessageLimits{}).is_ok());
}

TEST(FleetMetrics, AggregatesRefreshesByModeOutcomeAndReason) {
  using O = RefreshSummary::Outcome;
  FleetMetrics m;
  m.record(summary(0, 1, false, O::kOk, Reason::kNone, 0.02), 0);
  m.record(summary(1, 1, false, O::kOk, Reason::kNone, 0.3), 0);
  RefreshSummary retried = summary(2, 2, false, O::kFailed, Reason::kPeerLost, 4);
  retried.retries = 3;
  m.record(retried, 1);
  m.record(summary(3, 2, true, O::kAborted, Reason::kInstanceAborted, 0.2), 2);
  m.record(summary(4, 2, true, O::kOk, Reason::kNone, 0.2), 3);
  RefreshSummary commit = summary(4, 2, true, O::kOk, Reason::kNone, 0.0004);
  commit.event = RefreshSummary::Event::kCommit;
  m.record(commit, 3);
  m.record(summary(5, 0, false, O::kFailed, Reason::kNone, 30), 0);  // a timeout: no reason

  const MetricsRegistry& r = m.registry();
  EXPECT_EQ(r.value("refit_refresh_seconds", {{"mode", "direct"}, {"outcome", "ok"}}), 2);
  EXPECT_EQ(r.value("refit_refresh_seconds", {{"mode", "direct"}, {"outcome", "failed"}}), 2);
  EXPECT_EQ(r.value("refit_refresh_seconds", {{"mode", "staged"}, {"outcome", "aborted"}}), 1);
  EXPECT_EQ(r.value("refit_refresh_seconds", {{"mode", "staged"}, {"outcome", "ok"}}), 1);
  EXPECT_EQ(r.value("refit_pause_seconds", {}), 1);
  // Six refreshes of 1000 network and 10 local bytes each; the commit moves none.
  EXPECT_EQ(r.value("refit_refresh_bytes_total", {{"kind", "network"}}), 6000);
  EXPECT_EQ(r.value("refit_refresh_bytes_total", {{"kind", "local"}}), 60);
  EXPECT_EQ(r.value("refit_refresh_failures_total", {{"reason", "peer_lost"}}), 1);
  EXPECT_EQ(r.value("refit_refresh_failures_total", {{"reason", "instance_aborted"}}), 1);
  EXPECT_EQ(r.value("refit_refresh_failures_total", {{"reason", "other"}}), 1);
  EXPECT_EQ(r.value("refit_aborts_total", {}), 1);
  EXPECT_EQ(r.value("refit_retries_total", {}), 3);
  // Direct instances serve a version once refreshed, staged ones once committed.
  EXPECT_EQ(r.value("refit_instance_version", {{"instance", "0"}}), 1);
  EXPECT_EQ(r.value("refit_instance_version", {{"instance", "3"}}), 2);

  const std::string text = m.render();
  EXPECT_TRUE(has_line(text, "# TYPE refit_refresh_seconds histogram")) << text;
  EXPECT_TRUE(has_line(text, "refit_refresh_seconds_bucket{mode=\"direct\",outcome=\"ok\",le=\"0.025\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "refit_refresh_seconds_bucket{mode=\"direct\",outcome=\"ok\",le=\"0.5\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "refit_refresh_seconds_count{mode=\"direct\",outcome=\"ok\"} 2")) << text;
  EXPECT_TRUE(has_line(text, "refit_refresh_seconds_sum{mode=\"direct\",outcome=\"ok\"} 0.32")) << text;
  EXPECT_TRUE(has_line(text, "refit_pause_seconds_bucket{le=\"0.001\"} 1")) << text;
  EXPECT_TRUE(has_line(text, "refit_instance_version{instance=\"0\"} 1")) << text;
  // No instance 1 or 2 version: their refreshes failed or aborted.
  EXPECT_EQ(text.find("instance=\"1\""), std::string::npos) << text;
  EXPECT_EQ(text.find("instance=\"2\""), std::string::npos) << text;
}

TEST(FleetMetrics, ForgetsInstancesThatLeftAndMirrorsTheCoordinatorsCounts) {
  FleetMetrics m;
  m.record(summary(0, 4, false, RefreshSummary::Outcome::kOk, Reason::kNone, 0.1), 0);
  m.record(summary(8, 4, false, RefreshSummary::Outcome::kOk, Reason::kNone, 0.1), 1);
  CoordinatorStats st;
  st.sources = 2;
  st.receivers = 8;
  st.version = 4;
  st.refused = 5;
  st.plans = 2;
  st.instances = {1};
  m.update(st);
  st.refused = 7;
  m.update(st);
  const std::string text = m.render();
  EXPECT_TRUE(has_line(text, "refit_instance_version{instance=\"1\"} 4")) << text;
  EXPECT_EQ(text.find("instance=\"0\""), std::string::npos) << text;
  EXPECT_TRUE(has_line(text, "refit_members{role=\"receiver\"} 8")) << text;
  EXPECT_TRUE(has_line(text, "refit_published_version 4")) << text;
  EXPECT_TRUE(has_line(text, "refit_connections_refused_total 7")) << text;
  EXPECT_TRUE(has_line(text, "refit_plans_total 2")) << text;
}

Json receiver_body(int rank, int instance) {
  RegisterReceiver m;
  m.rank = rank;
  m.instance = instance;
  m.domain = rank;
  m.worker_address = {1, 2, 3, 4};
  m.buffers.push_back(MemberBuffer{"model", "BF16", 2048, 0, {}, {Segment{"w", {0}, {1024}, 0, {1}}}});
  return to_json(m);
}

// A coordinator counts the summaries of the receivers registered on the
// connection that sends them, labelled with the instance they registered
// in, and refuses the others without counting them.
TEST(FleetMetrics, CoordinatorCountsOnlyItsReceiversSummaries) {
  auto metrics = std::make_shared<FleetMetrics>();
  CoordinatorConfig cfg;
  cfg.token = kToken;
  cfg.metrics = metrics;
  cfg.log = [](const std::string&) {};
  auto co = Coordinator::start(std::move(cfg));
  ASSERT_TRUE(co.is_ok()) << co.status().message();
  auto a = Client::connect("127.0.0.1", (*co)->port(), kToken);
  auto b = Client::connect("127.0.0.1", (*co)->port(), kToken);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_TRUE((*a)->request(MsgType::kRegisterReceiver, receiver_body(0, 5)).is_ok());
  ASSERT_TRUE((*b)->request(MsgType::kRegisterReceiver, receiver_body(1, 6)).is_ok());

  const Json ok = to_json(summary(0, 3, false, RefreshSummary::Outcome::kOk, Reason::kNone, 0.05));
  ASSERT_TRUE((*a)->request(MsgType::kRefreshSummary, ok).is_ok());
  // Rank 0 is a's: b may not speak for it.
  Result<Json> other = (*b)->request(MsgType::kRefreshSummary, ok);
  ASSERT_FALSE(other.is_ok());
  EXPECT_NE(other.status().message().find("registered by another connection"), std::string::npos)
      << other.status().message();
  // An unknown rank and a malformed summary are refused; the connection stays.
  Json unknown = ok;
  unknown["rank"] = 9;
  EXPECT_FALSE((*a)->request(MsgType::kRefreshSummary, unknown).is_ok());
  Json bad = ok;
  bad["reason"] = "x\ny";
  EXPECT_FALSE((*a)->request(MsgType::kRefreshSummary, bad).is_ok());
  ASSERT_TRUE((*a)->request(MsgType::kRefreshSummary, ok).is_ok());

  const MetricsRegistry& r = metrics->registry();
  EXPECT_EQ(r.value("refit_refresh_seconds", {{"mode", "direct"}, {"outcome", "ok"}}), 2);
  EXPECT_EQ(r.value("refit_instance_version", {{"instance", "5"}}), 3);
  Result<CoordinatorStats> st = (*co)->stats();
  ASSERT_TRUE(st.is_ok());
  metrics->update(*st);
  EXPECT_EQ(r.value("refit_members", {{"role", "receiver"}}), 2);
  EXPECT_EQ(r.value("refit_instance_version", {{"instance", "5"}}), 3);
  (*co)->stop();
}

}  // namespace
}  // namespace refit::control
