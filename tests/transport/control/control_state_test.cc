#include "transport/control/control_state.h"

#include <gtest/gtest.h>

namespace refit::control {
namespace {

using namespace std::chrono_literals;

RegisterSource source(int32_t rank) {
  RegisterSource m;
  m.rank = rank;
  m.worker_address = {1};
  return m;
}

TEST(ControlState, RefusesDuplicateRegistration) {
  ControlState s(StateLimits{}, 1s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  Status dup = s.register_source(2, source(0), now);
  ASSERT_FALSE(dup.is_ok());
  EXPECT_EQ(dup.message(), "register_source: source rank 0 is already registered; unregister it first");
}

TEST(ControlState, OnlyTheOwnerMayHeartbeatOrUnregister) {
  ControlState s(StateLimits{}, 1s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(3), now).is_ok());
  Status hb = s.heartbeat(2, MemberRef{Role::kSource, 3}, now);
  ASSERT_FALSE(hb.is_ok());
  EXPECT_EQ(hb.message(), "heartbeat: source rank 3 was registered by another connection");
  EXPECT_FALSE(s.unregister(1, MemberRef{Role::kReceiver, 3}).is_ok());
  EXPECT_TRUE(s.unregister(1, MemberRef{Role::kSource, 3}).is_ok());
  EXPECT_EQ(s.num_sources(), 0u);
}

TEST(ControlState, BoundsMembership) {
  StateLimits lim;
  lim.max_sources = 2;
  ControlState s(lim, 1s);
  auto now = Clock::now();
  EXPECT_TRUE(s.register_source(1, source(0), now).is_ok());
  EXPECT_TRUE(s.register_source(1, source(1), now).is_ok());
  EXPECT_FALSE(s.register_source(1, source(2), now).is_ok());
}

TEST(ControlState, SweepRemovesSilentMembersOnly) {
  ControlState s(StateLimits{}, 100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.register_source(2, source(1), t0).is_ok());
  ASSERT_TRUE(s.heartbeat(2, MemberRef{Role::kSource, 1}, t0 + 80ms).is_ok());
  auto dead = s.sweep(t0 + 150ms);
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_NE(dead[0].find("source rank 0 declared dead after 150 ms"), std::string::npos) << dead[0];
  EXPECT_FALSE(s.has_source(0));
  EXPECT_TRUE(s.has_source(1));
}

TEST(ControlState, PublishNeedsASourceAndANewerVersion) {
  ControlState s(StateLimits{}, 1s);
  ASSERT_TRUE(s.subscribe(7).is_ok());
  EXPECT_FALSE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.register_source(1, source(0), Clock::now()).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].session, 7u);
  EXPECT_EQ(n[0].type, MsgType::kVersionNotify);
  Status old = s.publish(1, 1);
  ASSERT_FALSE(old.is_ok());
  EXPECT_EQ(old.message(), "publish_version: version 1 is not newer than the published version 1");
  s.session_closed(7);
  ASSERT_TRUE(s.publish(1, 2).is_ok());
  EXPECT_TRUE(s.take_notices().empty());
}

TEST(ControlState, RefusesConflictingTensorDeclarations) {
  ControlState s(StateLimits{}, 1s);
  RegisterSource a = source(0), b = source(1);
  a.tensors.push_back(TensorDecl{"w", "BF16", {4, 4}});
  b.tensors.push_back(TensorDecl{"w", "BF16", {4, 8}});
  ASSERT_TRUE(s.register_source(1, a, Clock::now()).is_ok());
  Status st = s.register_source(2, b, Clock::now());
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(),
            "register_source: tensor \"w\" declared as BF16[4,8] but other sources declared it as BF16[4,4]");
}

RegisterReceiver receiver(int32_t rank, int32_t instance) {
  RegisterReceiver m;
  m.rank = rank;
  m.instance = instance;
  m.worker_address = {1};
  return m;
}

TEST(ControlState, CommitsAnInstanceOnlyWhenEveryRankStaged) {
  ControlState s(StateLimits{}, 1s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(12, receiver(2, 1), now).is_ok());
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  EXPECT_TRUE(s.take_notices().empty());
  EXPECT_FALSE(s.report_staged(11, StageReport{1, 4, ""}).is_ok()) << "another version is being staged";
  EXPECT_FALSE(s.report_staged(10, StageReport{1, 3, ""}).is_ok()) << "not its rank";
  ASSERT_TRUE(s.report_staged(11, StageReport{1, 3, ""}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kCommit);
  EXPECT_EQ(n[0].body["version"], 3);
  EXPECT_EQ(n[1].session, 11u);
}

TEST(ControlState, AbortsAnInstanceOnFailureOrDeath) {
  ControlState s(StateLimits{}, 100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  ASSERT_TRUE(s.report_failed(11, StageReport{1, 3, "GET timed out"}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kAbort);
  EXPECT_EQ(n[0].body["reason"], "receiver rank 1 failed: GET timed out");
  // Staged again, then rank 1 dies: rank 0 is told to abort.
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 4, ""}).is_ok());
  ASSERT_TRUE(s.heartbeat(10, MemberRef{Role::kReceiver, 0}, t0 + 90ms).is_ok());
  s.sweep(t0 + 150ms);
  n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].session, 10u);
  EXPECT_EQ(n[0].body["reason"], "receiver rank 1 was declared dead");
}

TEST(ControlState, DrainsAVersionWhenItsLeasesEnd) {
  ControlState s(StateLimits{}, 10s);
  s.set_lease_timeout(100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  EXPECT_FALSE(s.lease(10, StageReport{0, 1, ""}, t0).is_ok()) << "not published yet";
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, t0).is_ok());
  ASSERT_TRUE(s.lease(11, StageReport{1, 1, ""}, t0).is_ok());
  EXPECT_FALSE(s.wait_drained(10, 1).is_ok()) << "only a source waits";
  auto d = s.wait_drained(1, 1);
  ASSERT_TRUE(d.is_ok());
  EXPECT_FALSE(*d);
  ASSERT_TRUE(s.release(10, StageReport{0, 1, ""}).is_ok());
  EXPECT_TRUE(s.take_notices().empty()) << "rank 1 still holds version 1";
  EXPECT_FALSE(s.release(10, StageReport{0, 1, ""}).is_ok()) << "released twice";
  auto lines = s.sweep(t0 + 150ms);  // rank 1's lease expires
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "lease of version 1 by receiver rank 1 expired");
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].type, MsgType::kDrained);
  EXPECT_EQ(n[0].session, 1u);
  EXPECT_TRUE(*s.wait_drained(1, 1));
}

}  // namespace
}  // namespace refit::control
