#include "planner/status.h"

#include <gtest/gtest.h>

namespace refit {
namespace {

TEST(Status, WithContextPrefixesTheMessageAndKeepsCodeAndReason) {
  const Status s = Status::timeout("no reply").with_reason(Reason::kPeerLost).with_context("fetch_plan");
  EXPECT_EQ(s.message(), "fetch_plan: no reply");
  EXPECT_EQ(s.code(), Code::kTimeout);
  EXPECT_EQ(s.reason(), Reason::kPeerLost);
  EXPECT_TRUE(Status::ok().with_context("fetch_plan").is_ok());
}

TEST(Status, WithContextDoesNotNameTheSameContextTwice) {
  // The coordinator's refusal names its request; the link that sent the
  // request adds the same name (the message once read
  // "register_receiver: register_receiver: ...").
  const Status refused = Status::invalid("register_receiver: receiver rank 1 holds \"w\" as F16");
  EXPECT_EQ(refused.with_context("register_receiver").message(), refused.message());
  EXPECT_EQ(refused.with_context("register_receiver").with_context("join").message(),
            "join: register_receiver: receiver rank 1 holds \"w\" as F16");
  // Only a whole "context: " prefix counts.
  EXPECT_EQ(Status::invalid("register_receivers: x").with_context("register_receiver").message(),
            "register_receiver: register_receivers: x");
  EXPECT_EQ(Status::invalid("register_receiver:x").with_context("register_receiver").message(),
            "register_receiver: register_receiver:x");
  EXPECT_EQ(Status::invalid("register_receiver").with_context("register_receiver").message(),
            "register_receiver: register_receiver");
}

}  // namespace
}  // namespace refit
