// The agents' coordinator link on its own: a member the coordinator declares
// dead while its process lives (its heartbeats come later than the
// coordinator's timeout) shows as dropped(), and registering it again clears
// that.

#include "plugin/coordinator_link.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "plugin/config.h"
#include "plugin/log.h"

namespace refit::plugin {
namespace {

using Clock = std::chrono::steady_clock;

TEST(CoordinatorLink, AMemberDeclaredDeadWhileAliveIsDroppedUntilItRegistersAgain) {
  char dir[] = "/tmp/refit-link-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string token_file = std::string(dir) + "/token";
  const std::string token = "0123456789abcdef0123456789abcdef";
  std::ofstream(token_file) << token;
  control::CoordinatorConfig cc;
  cc.token = token;
  cc.log = [](const std::string&) {};
  cc.heartbeat_timeout = std::chrono::milliseconds(300);  // shorter than the member's heartbeat
  auto coordinator = control::Coordinator::start(cc);
  ASSERT_TRUE(coordinator.is_ok()) << coordinator.status().message();
  const std::string config_json = R"({"rank": 0, "heartbeat_ms": 1000, "log_level": "error",
      "coordinator": {"address": "127.0.0.1:)" + std::to_string((*coordinator)->port()) +
                                  R"(", "token_file": ")" + token_file + R"("}})";
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  const Log log("receiver 0", config->log_level);
  Result<std::unique_ptr<CoordinatorLink>> link = CoordinatorLink::connect(*config, log);
  ASSERT_TRUE(link.is_ok()) << link.status().message();

  control::RegisterReceiver m;
  m.rank = 0;
  m.worker_address = {1, 2, 3};
  auto register_member = [&] {
    Result<control::Json> r = (*link)->request(control::MsgType::kRegisterReceiver, control::to_json(m));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    (*link)->start_heartbeat(control::MemberRef{control::Role::kReceiver, 0});
  };
  register_member();
  EXPECT_FALSE((*link)->dropped());
  // Declared dead after 300 ms without a heartbeat; the first heartbeat, at
  // 1 s, hears that it is not registered.
  const Clock::time_point until = Clock::now() + std::chrono::seconds(5);
  while (!(*link)->dropped() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE((*link)->dropped());
  // The coordinator holds nothing of it: registering again is accepted, and
  // the link no longer says dropped.
  register_member();
  EXPECT_FALSE((*link)->dropped());
  (*link)->stop_heartbeat();
  link->reset();
  std::remove(token_file.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace refit::plugin
