// Bad input through the C ABI: each mistake gets a prompt error status and a
// message that names the problem (the key, the buffer, the tensor, the
// version, the address), never a hang or an abort. Sources and receivers run
// in this one process against a coordinator embedded in it.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tools/bench/local_coordinator.h"
#include "refit/refit.h"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr unsigned kTestSeconds = 55;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A TCP port on 127.0.0.1 that nothing listens on (bound, then closed).
int closed_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t n = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) {
    ::close(fd);
    return 1;  // nothing listens on port 1 either
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override { ::alarm(kTestSeconds); }
  void TearDown() override {
    refit_receiver_destroy(receiver_);
    refit_source_destroy(source_);
    coordinator_.reset();
    ::alarm(0);
  }

  void start_coordinator() {
    auto c = refit::bench::LocalCoordinator::start();
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    coordinator_ = std::move(*c);
  }

  json config(int rank, bool receiver, const std::string& address, const std::string& token_file) const {
    json c = {{"rank", rank},
              {"coordinator", {{"address", address}, {"token_file", token_file}, {"timeout_ms", 2000}}},
              {"network", {{"transports", {"tcp"}}, {"devices", {"lo"}}}}};
    if (receiver) c["local"] = {{"transports", {"shm"}}};
    return c;
  }
  json config(int rank, bool receiver) const {
    return config(rank, receiver, coordinator_->address(), coordinator_->token_file());
  }

  // A source that serves "w", F32 [8, 4], whole, holding 1.0f everywhere.
  void start_source() {
    ASSERT_EQ(refit_source_create(config(0, false).dump().c_str(), &source_), REFIT_OK) << refit_last_error();
    source_data_.assign(32, 1.0f);
    const json w = {{"name", "w"}, {"dtype", "F32"}, {"shape", {8, 4}},
                    {"segments", {{{"start", {0, 0}}, {"size", {8, 4}}, {"offset", 0}, {"strides", {4, 1}}}}}};
    ASSERT_EQ(refit_source_add_tensor(source_, w.dump().c_str(), source_data_.data(), 128), REFIT_OK)
        << refit_last_error();
    ASSERT_EQ(refit_source_join(source_), REFIT_OK) << refit_last_error();
    ASSERT_EQ(refit_source_publish(source_, 1), REFIT_OK) << refit_last_error();
  }

  // Expects a refresh of `version` to fail within a few seconds, with a
  // message containing `needle`.
  void expect_refresh_fails(int64_t version, const std::string& needle) {
    const auto t0 = Clock::now();
    refit_status_t s = refit_receiver_join(receiver_);
    if (s == REFIT_OK) s = refit_receiver_refresh(receiver_, version, 1500);
    const std::string error = refit_last_error();
    EXPECT_NE(s, REFIT_OK);
    EXPECT_LT(seconds_since(t0), 8.0) << "the failure took too long";
    EXPECT_NE(error.find(needle), std::string::npos) << "status " << refit_status_name(s) << ": " << error;
    EXPECT_EQ(refit_receiver_version(receiver_), 0);
  }

  std::unique_ptr<refit::bench::LocalCoordinator> coordinator_;
  refit_source_t* source_ = nullptr;
  refit_receiver_t* receiver_ = nullptr;
  std::vector<float> source_data_;
};

TEST_F(BadInput, UnknownAbiVersionIsRefused) {
  EXPECT_EQ(refit_get_api(REFIT_ABI_VERSION + 1000), nullptr);
  EXPECT_NE(std::string(refit_last_error()), "");
  const refit_api_t* api = refit_get_api(REFIT_ABI_VERSION);
  ASSERT_NE(api, nullptr) << refit_last_error();
  EXPECT_EQ(api->abi_version, REFIT_ABI_VERSION);
  EXPECT_GE(api->size, sizeof(refit_api_t));
}

TEST_F(BadInput, UnknownConfigKeyIsNamed) {
  json c = config(0, false, "127.0.0.1:" + std::to_string(closed_port()), "/nonexistent-token");
  c["netwrok"] = {{"transports", {"tcp"}}};
  const auto t0 = Clock::now();
  EXPECT_EQ(refit_source_create(c.dump().c_str(), &source_), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(source_, nullptr);
  EXPECT_NE(std::string(refit_last_error()).find("netwrok"), std::string::npos) << refit_last_error();
  EXPECT_LT(seconds_since(t0), 2.0);

  json r = config(0, true, "127.0.0.1:" + std::to_string(closed_port()), "/nonexistent-token");
  r["network"]["transport"] = {"tcp"};  // nested, and singular
  EXPECT_EQ(refit_receiver_create(r.dump().c_str(), &receiver_), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("transport"), std::string::npos) << refit_last_error();
}

TEST_F(BadInput, MistypedConfigKeyIsNamed) {
  json c = config(0, true, "127.0.0.1:" + std::to_string(closed_port()), "/nonexistent-token");
  c["coordinator"]["timeout_ms"] = "5s";
  EXPECT_EQ(refit_receiver_create(c.dump().c_str(), &receiver_), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("timeout_ms"), std::string::npos) << refit_last_error();

  json d = config(0, false, "127.0.0.1:" + std::to_string(closed_port()), "/nonexistent-token");
  d["rank"] = "0";
  EXPECT_EQ(refit_source_create(d.dump().c_str(), &source_), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("rank"), std::string::npos) << refit_last_error();

  EXPECT_EQ(refit_source_create("{not json", &source_), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()), "");
}

TEST_F(BadInput, MissingCoordinatorFailsPromptly) {
  auto token = refit::bench::write_token_file();
  ASSERT_TRUE(token.is_ok()) << token.status().message();
  const std::string address = "127.0.0.1:" + std::to_string(closed_port());
  json c = config(0, true, address, *token);
  c["coordinator"]["timeout_ms"] = 1000;
  const auto t0 = Clock::now();
  refit_status_t s = refit_receiver_create(c.dump().c_str(), &receiver_);
  if (s == REFIT_OK) s = refit_receiver_join(receiver_);
  const std::string error = refit_last_error();
  ::unlink(token->c_str());
  EXPECT_TRUE(s == REFIT_IO_ERROR || s == REFIT_TIMEOUT) << refit_status_name(s) << ": " << error;
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(error.find(address), std::string::npos) << error;
}

TEST_F(BadInput, ReceiverBufferSmallerThanItsLayout) {
  start_coordinator();
  ASSERT_EQ(refit_receiver_create(config(0, true).dump().c_str(), &receiver_), REFIT_OK) << refit_last_error();
  std::vector<uint8_t> data(128);
  const json b = {{"name", "wbuf"}, {"dtype", "F32"},
                  {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {8, 4}}, {"offset", 0}, {"strides", {4, 1}}}}}};
  EXPECT_EQ(refit_receiver_add_buffer(receiver_, b.dump().c_str(), data.data(), 100), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("wbuf"), std::string::npos) << refit_last_error();
  // The same buffer with its real size is fine.
  EXPECT_EQ(refit_receiver_add_buffer(receiver_, b.dump().c_str(), data.data(), 128), REFIT_OK) << refit_last_error();
}

TEST_F(BadInput, SourceBufferSmallerThanItsLayout) {
  start_coordinator();
  ASSERT_EQ(refit_source_create(config(0, false).dump().c_str(), &source_), REFIT_OK) << refit_last_error();
  std::vector<uint8_t> data(128);
  const json w = {{"name", "w"}, {"dtype", "F32"}, {"shape", {8, 4}},
                  {"segments", {{{"start", {0, 0}}, {"size", {8, 4}}, {"offset", 0}, {"strides", {4, 1}}}}}};
  EXPECT_EQ(refit_source_add_tensor(source_, w.dump().c_str(), data.data(), 64), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("w"), std::string::npos) << refit_last_error();
}

TEST_F(BadInput, ReceiverShapeDiffersFromSources) {
  start_coordinator();
  start_source();
  ASSERT_EQ(refit_receiver_create(config(0, true).dump().c_str(), &receiver_), REFIT_OK) << refit_last_error();
  std::vector<uint8_t> data(8 * 8 * 4);
  // Rows 0..7 of 8 columns: the sources' "w" has 4.
  const json b = {{"name", "wbuf"}, {"dtype", "F32"},
                  {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {8, 8}}, {"offset", 0}, {"strides", {8, 1}}}}}};
  ASSERT_EQ(refit_receiver_add_buffer(receiver_, b.dump().c_str(), data.data(), data.size()), REFIT_OK)
      << refit_last_error();
  expect_refresh_fails(1, "\"w\"");
}

TEST_F(BadInput, ReceiverDtypeDiffersFromSources) {
  start_coordinator();
  start_source();
  ASSERT_EQ(refit_receiver_create(config(0, true).dump().c_str(), &receiver_), REFIT_OK) << refit_last_error();
  // F32 to I32 is no conversion refit does (docs/conversion.md).
  std::vector<uint8_t> data(8 * 4 * 4);
  const json b = {{"name", "wbuf"}, {"dtype", "I32"},
                  {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {8, 4}}, {"offset", 0}, {"strides", {4, 1}}}}}};
  refit_status_t s = refit_receiver_add_buffer(receiver_, b.dump().c_str(), data.data(), data.size());
  if (s != REFIT_OK) {  // refused at once: as good, if it names the problem
    EXPECT_NE(std::string(refit_last_error()).find("dtype"), std::string::npos) << refit_last_error();
    return;
  }
  expect_refresh_fails(1, "\"w\"");
}

TEST_F(BadInput, RefreshOfUnpublishedVersionFailsPromptly) {
  start_coordinator();
  start_source();
  ASSERT_EQ(refit_receiver_create(config(0, true).dump().c_str(), &receiver_), REFIT_OK) << refit_last_error();
  std::vector<uint8_t> data(128, 0);
  const json b = {{"name", "wbuf"}, {"dtype", "F32"},
                  {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {8, 4}}, {"offset", 0}, {"strides", {4, 1}}}}}};
  ASSERT_EQ(refit_receiver_add_buffer(receiver_, b.dump().c_str(), data.data(), data.size()), REFIT_OK)
      << refit_last_error();
  expect_refresh_fails(7, "7");
  // The published version still refreshes afterwards.
  ASSERT_EQ(refit_receiver_refresh(receiver_, 1, 10000), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_version(receiver_), 1);
  float first;
  std::memcpy(&first, data.data(), 4);
  EXPECT_EQ(first, 1.0f);
}

}  // namespace
