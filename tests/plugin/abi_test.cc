// The C ABI's contract where no peer is needed: the function table, NULL
// handles and arguments, configs with unknown, missing or mistyped keys, a
// coordinator that is not there. Every call returns a status and a message
// that names the problem; none aborts.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "refit/refit.h"

namespace {

class Abi : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(token_) << "0123456789abcdef0123456789abcdef";
    ::chmod(token_.c_str(), 0600);  // a token others may read is refused
  }
  void TearDown() override { std::remove(token_.c_str()); }
  std::string config(const std::string& extra, int port = 1) {
    return "{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:" + std::to_string(port) +
           "\", \"token_file\": \"" + token_ + "\", \"timeout_ms\": 2000}" + extra + "}";
  }
  std::string token_ = "/tmp/refit-abi-test-token-" + std::to_string(::getpid());
};

TEST_F(Abi, TableServesItsVersionOnly) {
  const refit_api_t* api = refit_get_api(REFIT_ABI_VERSION);
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->abi_version, REFIT_ABI_VERSION);
  EXPECT_EQ(api->size, sizeof(refit_api_t));
  EXPECT_EQ(api->version, &refit_version);
  EXPECT_EQ(api->receiver_refresh_wait, &refit_receiver_refresh_wait);
  EXPECT_EQ(api->receiver_destroy, &refit_receiver_destroy);
  EXPECT_EQ(refit_get_api(REFIT_ABI_VERSION + 1), nullptr);
  EXPECT_NE(std::string(refit_last_error()).find("serves ABI version 1, not 2"), std::string::npos)
      << refit_last_error();
  EXPECT_STREQ(refit_status_name(REFIT_TIMEOUT), "REFIT_TIMEOUT");
  EXPECT_STREQ(refit_status_name(static_cast<refit_status_t>(99)), "unknown");
}

TEST_F(Abi, NullHandlesAndArgumentsAreRefused) {
  refit_source_t* s = nullptr;
  refit_receiver_t* r = nullptr;
  EXPECT_EQ(refit_source_create(nullptr, &s), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("config_json is NULL"), std::string::npos);
  EXPECT_EQ(refit_receiver_create("{}", nullptr), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_source_add_tensor(nullptr, "{}", nullptr, 0), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_source_join(nullptr), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_source_publish(nullptr, 1), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_source_wait_drained(nullptr, 1, 0), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_add_buffer(nullptr, "{}", nullptr, 0), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_join(nullptr), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_refresh(nullptr, 1, 0), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_refresh_start(nullptr, 1, 0), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_refresh_poll(nullptr), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_refresh_wait(nullptr, 0), REFIT_INVALID_ARGUMENT);
  EXPECT_STREQ(refit_receiver_report(nullptr), "{}");
  EXPECT_EQ(refit_receiver_version(nullptr), 0);
  refit_source_destroy(nullptr);
  refit_receiver_destroy(nullptr);
  EXPECT_EQ(r, nullptr);
}

TEST_F(Abi, ConfigErrorsNameTheKey) {
  struct Case {
    std::string json;
    bool receiver;
    std::string expect;
  } cases[] = {
      {"not json", false, "config: not JSON"},
      {"[1]", true, "must be a JSON object"},
      {config(", \"rnak\": 1"), true, "\"rnak\" is not a known key"},
      {config(", \"instance\": 1"), false, "\"instance\" is not a known key"},
      {"{\"rank\": \"0\", \"coordinator\": {}}", true, "\"rank\" must be an integer >= 0 and <= 1048575, got \"0\""},
      {"{\"coordinator\": {}}", true, "\"rank\" is required"},
      {"{\"rank\": 0}", true, "\"coordinator\" is required"},
      {config(", \"window_bytes\": 1"), true, "\"window_bytes\" must be an integer >= 4096, got 1"},
      {config(", \"landing_bytes\": 12288, \"chunk_bytes\": 8192"), true,
       "\"landing_bytes\" must hold at least two landing slots (2 x 8192: \"chunk_bytes\", at most 4 MiB), got 12288"},
      {config(", \"landing_bytes\": 8388607, \"chunk_bytes\": 8388608"), true,
       "\"landing_bytes\" must hold at least two landing slots (2 x 4194304: \"chunk_bytes\", at most 4 MiB), got 8388607"},
      {config(", \"landing_bytes\": 12288"), false, "\"landing_bytes\" is not a known key"},
      {config(", \"gather_reply_bytes\": 1000"), false,
       "\"gather_reply_bytes\" must be an integer >= 1048576 and <= 1099511627776, got 1000"},
      {config(", \"gather_reply_bytes\": 1048576"), true, "\"gather_reply_bytes\" is not a known key"},
      {config(", \"quantize\": \"gpu\""), false, "\"quantize\" must be \"receiver\" or \"source\", got \"gpu\""},
      {config(", \"quantize\": \"source\""), true, "\"quantize\" is not a known key"},
      {config(", \"quantize_source_bytes\": -1"), false,
       "\"quantize_source_bytes\" must be an integer >= 0 and <= 1099511627776, got -1"},
      {config(", \"window_bytes\": 8388608, \"gather_bytes\": 16777216"), true,
       "\"gather_bytes\" must not exceed \"window_bytes\" (8388608), got 16777216"},
      {config(", \"gather_entries\": 0"), true,
       "\"gather_entries\" must be an integer >= 2 and <= 65536, got 0"},
      {config(", \"gather_entries\": 65537"), true,
       "\"gather_entries\" must be an integer >= 2 and <= 65536, got 65537"},
      {config(", \"max_plan_runs\": 0"), true, "\"max_plan_runs\" must be an integer >= 1 and <= 67108864, got 0"},
      {config(", \"max_plan_runs\": 67108865"), true,
       "\"max_plan_runs\" must be an integer >= 1 and <= 67108864, got 67108865"},
      {config(", \"max_plan_runs\": 100"), false, "\"max_plan_runs\" is not a known key"},
      {config(", \"network\": {\"transports\": \"tcp\"}"), true, "\"network.transports\" must be a list of strings"},
      {config(", \"network\": {\"transports\": [\"tcpp\"]}"), true, "tcpp"},
      {config(", \"log_level\": \"loud\""), false, "\"log_level\" must be one of"},
      {config(", \"verify\": 1"), false, "\"verify\" must be"},
      {config(", \"verify\": true, \"local\": {\"fabric\": \"nccl\"}"), true,
       "\"verify\" hashes host memory; the \"nccl\" local fabric's buffers are GPU memory"},
      {config(", \"local\": {\"pack_bytes\": 1000}"), true,
       "\"local.pack_bytes\" must be 0 (packing off) or at least 65536, got 1000"},
      {config(", \"local\": {\"pack_threshold\": 0}"), true, "\"local.pack_threshold\" must be an integer >= 1"},
      {config(", \"recipe\": {\"model\": \"/nonexistent/model.json\"}"), true, "cannot open \"/nonexistent/model.json\""},
      {"{\"rank\": 0, \"coordinator\": {\"address\": \"nohost\", \"token_file\": \"t\"}}", true,
       "\"coordinator.address\" must be \"HOST:PORT\""},
      {"{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:1\", \"token_file\": \"/nonexistent/token\"}}",
       true, "token_file"},
  };
  for (const Case& c : cases) {
    refit_status_t st;
    if (c.receiver) {
      refit_receiver_t* r = nullptr;
      st = refit_receiver_create(c.json.c_str(), &r);
      EXPECT_EQ(r, nullptr);
    } else {
      refit_source_t* s = nullptr;
      st = refit_source_create(c.json.c_str(), &s);
      EXPECT_EQ(s, nullptr);
    }
    EXPECT_NE(st, REFIT_OK) << c.json;
    EXPECT_NE(std::string(refit_last_error()).find(c.expect), std::string::npos)
        << c.json << "\n  got: " << refit_last_error();
  }
}

TEST_F(Abi, ACoordinatorThatIsNotThereFailsPromptly) {
  const auto t0 = std::chrono::steady_clock::now();
  refit_receiver_t* r = nullptr;
  EXPECT_EQ(refit_receiver_create(config("", 1).c_str(), &r), REFIT_IO_ERROR);
  EXPECT_EQ(r, nullptr);
  EXPECT_NE(std::string(refit_last_error()).find("127.0.0.1:1"), std::string::npos) << refit_last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST_F(Abi, DescriptionsAreCheckedBeforeAnythingIsRegistered) {
  // An embedded coordinator, so that the agents can be created.
  refit_source_t* s = nullptr;
  const std::string cfg = "{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:0\", \"embedded\": true,"
                          " \"token_file\": \"" + token_ + "\"}}";
  ASSERT_EQ(refit_source_create(cfg.c_str(), &s), REFIT_OK) << refit_last_error();
  float w[8] = {};
  struct Case {
    std::string json;
    uint64_t bytes;
    std::string expect;
  } cases[] = {
      {R"J({"name": "w", "dtype": "F32", "shape": [4, 4], "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}})J",
       16, "this rank's shard is 32 bytes, the buffer given is 16"},
      {R"J({"name": "w", "dtype": "F33", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J", 32,
       "\"dtype\" must be one of"},
      {R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [2], "size": [4], "offset": 0}]})J", 32,
       "ends at 6 in dim 0, past the shape's 4"},
      {R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 6}]})J", 32,
       "reaches byte 40"},
      {R"J({"name": "w", "dtype": "F32", "shape": [4], "dtensor": {"mesh": [2], "ranks": [1, 2], "placements": ["R"]}})J",
       32, "this rank (0) is not in \"dtensor.ranks\""},
      {R"J({"name": "w", "dtype": "F32", "shape": [4], "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["P"]}})J",
       32, "placements[0]"},
      {R"J({"name": "w", "dtype": "F32", "shape": [4], "extra": 1, "segments": []})J", 32, "\"extra\" is not a known key"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(refit_source_add_tensor(s, c.json.c_str(), w, c.bytes), REFIT_INVALID_ARGUMENT) << c.json;
    EXPECT_NE(std::string(refit_last_error()).find(c.expect), std::string::npos)
        << c.json << "\n  got: " << refit_last_error();
  }
  EXPECT_EQ(refit_source_publish(s, 1), REFIT_INVALID_ARGUMENT);  // nothing added
  EXPECT_NE(std::string(refit_last_error()).find("add at least one tensor"), std::string::npos);
  refit_source_destroy(s);
}

// A buffer added by recipe name is the parameter the server allocated: a
// size other than the recipe's for this rank (another tp, head_dim or vocab
// padding on the server) is refused before anything is registered, whether
// larger or smaller; the recipe's own size is taken.
TEST_F(Abi, ARecipeParameterMustHaveTheRecipesSize) {
  const std::string dir = "/tmp/refit-abi-test-recipe-" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  // One Llama layer: hidden 128, 4 heads and 2 KV heads of 32, vocab 100.
  std::ofstream(dir + "/m.config.json")
      << R"J({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
             "vocab_size": 100, "tie_word_embeddings": true})J";
  std::ofstream(dir + "/m.json") << R"J({
      "model.embed_tokens.weight": {"dtype": "BF16", "shape": [100, 128]},
      "model.layers.0.input_layernorm.weight": {"dtype": "BF16", "shape": [128]},
      "model.layers.0.self_attn.q_proj.weight": {"dtype": "BF16", "shape": [128, 128]},
      "model.layers.0.self_attn.k_proj.weight": {"dtype": "BF16", "shape": [64, 128]},
      "model.layers.0.self_attn.v_proj.weight": {"dtype": "BF16", "shape": [64, 128]},
      "model.layers.0.self_attn.o_proj.weight": {"dtype": "BF16", "shape": [128, 128]},
      "model.layers.0.post_attention_layernorm.weight": {"dtype": "BF16", "shape": [128]},
      "model.layers.0.mlp.gate_proj.weight": {"dtype": "BF16", "shape": [256, 128]},
      "model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [256, 128]},
      "model.layers.0.mlp.down_proj.weight": {"dtype": "BF16", "shape": [128, 256]},
      "model.norm.weight": {"dtype": "BF16", "shape": [128]}})J";
  const std::string cfg = "{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:0\", \"embedded\": true,"
                          " \"token_file\": \"" + token_ + "\"}, \"recipe\": {\"model\": \"" + dir +
                          "/m.json\", \"tp\": 2}}";
  refit_receiver_t* r = nullptr;
  ASSERT_EQ(refit_receiver_create(cfg.c_str(), &r), REFIT_OK) << refit_last_error();
  // vLLM at tp 2, rank 0: qkv_proj [2*32 + 32 + 32, 128]; the vocabulary
  // padded to 128 rows, 64 per rank.
  const char* qkv = R"J({"recipe": "model.layers.0.self_attn.qkv_proj.weight"})J";
  const char* embed = R"J({"recipe": "model.embed_tokens.weight"})J";
  const uint64_t qkv_bytes = 128 * 128 * 2, embed_bytes = 64 * 128 * 2;
  std::vector<uint8_t> memory(2 * qkv_bytes);
  for (uint64_t bytes : {qkv_bytes - 2, qkv_bytes + 2, 2 * qkv_bytes}) {
    EXPECT_EQ(refit_receiver_add_buffer(r, qkv, memory.data(), bytes), REFIT_INVALID_ARGUMENT) << bytes;
    EXPECT_NE(std::string(refit_last_error())
                  .find("lays out this parameter for receiver rank 0 in 32768 bytes, the buffer given has " +
                        std::to_string(bytes)),
              std::string::npos)
        << refit_last_error();
  }
  // 100 rows unpadded is not the parameter vLLM allocates either.
  EXPECT_EQ(refit_receiver_add_buffer(r, embed, memory.data(), 50 * 128 * 2), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("in 16384 bytes"), std::string::npos) << refit_last_error();
  EXPECT_EQ(refit_receiver_add_buffer(r, qkv, memory.data(), qkv_bytes), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_add_buffer(r, embed, memory.data() + qkv_bytes, embed_bytes), REFIT_OK)
      << refit_last_error();
  // The same parameter held in another dtype ("dtype"): its size is the
  // recipe's elements in that dtype, F8_E4M3's half of BF16's.
  const char* o_f8 = R"J({"recipe": "model.layers.0.self_attn.o_proj.weight", "dtype": "F8_E4M3"})J";
  EXPECT_EQ(refit_receiver_add_buffer(r, o_f8, memory.data(), 128 * 64 * 2), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("in 8192 bytes"), std::string::npos) << refit_last_error();
  EXPECT_EQ(refit_receiver_add_buffer(r, o_f8, memory.data() + qkv_bytes + embed_bytes, 128 * 64), REFIT_OK)
      << refit_last_error();
  for (const char* bad : {R"J({"recipe": "model.norm.weight", "dtype": "F9"})J",
                          R"J({"recipe": "model.norm.weight", "shape": [128]})J"}) {
    EXPECT_EQ(refit_receiver_add_buffer(r, bad, memory.data(), 256), REFIT_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(refit_last_error()).find(std::string(bad).find("F9") != std::string::npos ? "F9" : "\"shape\""),
              std::string::npos)
        << refit_last_error();
  }
  refit_receiver_destroy(r);
  for (const char* f : {"/m.json", "/m.config.json"}) std::remove((dir + f).c_str());
  ::rmdir(dir.c_str());
}

// The host's log callback gets refit's lines, with their level and the
// agent's name and no newline; NULL sends them to stderr again, and the
// callback is not called after that.
struct Logged {
  std::mutex mutex;
  std::vector<std::pair<refit_log_level_t, std::string>> lines;
};

void keep_line(refit_log_level_t level, const char* line, void* user) {
  Logged* logged = static_cast<Logged*>(user);
  std::lock_guard<std::mutex> lock(logged->mutex);
  logged->lines.emplace_back(level, line);
}

TEST_F(Abi, LogLinesGoToTheHostsCallback) {
  Logged logged;
  refit_set_log_callback(keep_line, &logged);
  refit_source_t* s = nullptr;
  const std::string cfg = "{\"rank\": 0, \"log_level\": \"info\", \"coordinator\": {\"address\": \"127.0.0.1:0\","
                          " \"embedded\": true, \"token_file\": \"" + token_ + "\"}}";
  ASSERT_EQ(refit_source_create(cfg.c_str(), &s), REFIT_OK) << refit_last_error();
  float w[4] = {};
  const char* desc = R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";
  ASSERT_EQ(refit_source_add_tensor(s, desc, w, sizeof w), REFIT_OK) << refit_last_error();
  size_t seen = 0;
  {
    std::lock_guard<std::mutex> lock(logged.mutex);
    seen = logged.lines.size();
    bool mapped = false;
    for (const auto& [level, line] : logged.lines) {
      EXPECT_EQ(line.rfind("refit[source 0] ", 0), 0u) << line;
      EXPECT_EQ(line.find('\n'), std::string::npos) << line;
      if (line.find("buffer \"w\" (16 bytes) mapped for peers") != std::string::npos) {
        mapped = true;
        EXPECT_EQ(level, REFIT_LOG_INFO) << line;
      }
    }
    EXPECT_TRUE(mapped) << seen << " lines, none says that buffer \"w\" was mapped";
  }
  refit_set_log_callback(nullptr, nullptr);
  float w2[4] = {};
  const char* desc2 = R"J({"name": "w2", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";
  ASSERT_EQ(refit_source_add_tensor(s, desc2, w2, sizeof w2), REFIT_OK) << refit_last_error();
  refit_source_destroy(s);
  std::lock_guard<std::mutex> lock(logged.mutex);
  EXPECT_EQ(logged.lines.size(), seen) << "a line reached the callback after it was removed: "
                                       << logged.lines.back().second;
}

// "log_format": "json": every line the callback gets is one JSON object
// naming the role, the rank and the version the agent's work concerns
// (null before its first publish), and the message.
TEST_F(Abi, JsonLogLinesNameRoleRankAndVersion) {
  Logged logged;
  refit_set_log_callback(keep_line, &logged);
  refit_source_t* s = nullptr;
  const std::string cfg = "{\"rank\": 2, \"log_level\": \"info\", \"log_format\": \"json\", \"coordinator\": "
                          "{\"address\": \"127.0.0.1:0\", \"embedded\": true, \"token_file\": \"" + token_ + "\"}}";
  ASSERT_EQ(refit_source_create(cfg.c_str(), &s), REFIT_OK) << refit_last_error();
  float w[4] = {};
  const char* desc = R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";
  ASSERT_EQ(refit_source_add_tensor(s, desc, w, sizeof w), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(s, 3), REFIT_OK) << refit_last_error();
  refit_source_destroy(s);
  refit_set_log_callback(nullptr, nullptr);
  std::lock_guard<std::mutex> lock(logged.mutex);
  ASSERT_FALSE(logged.lines.empty());
  bool before = false, published = false;
  for (const auto& [level, line] : logged.lines) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_TRUE(j.is_object()) << line;
    EXPECT_EQ(j.value("role", ""), "source") << line;
    EXPECT_EQ(j.value("rank", -1), 2) << line;
    EXPECT_EQ(j.value("level", ""), level == REFIT_LOG_INFO ? "info" : level == REFIT_LOG_WARN ? "warn" : "other")
        << line;
    EXPECT_EQ(j.value("time", "").size(), 27u) << line;  // 2026-12-01T22:04:05.123456Z
    ASSERT_TRUE(j.contains("version") && j.contains("message")) << line;
    if (j["version"].is_null()) before = true;
    // The embedded coordinator's line about the publish is the source's, at version 3.
    if (j["message"].get<std::string>().find("version 3 published") != std::string::npos) {
      EXPECT_EQ(j["version"], 3) << line;
      published = true;
    }
  }
  EXPECT_TRUE(before) << "no line before the first publish";
  EXPECT_TRUE(published) << logged.lines.size() << " lines, none about version 3's publish";
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// GET /metrics from 127.0.0.1:port: the whole answer, "" when it cannot connect.
std::string scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};  // bounded: the server answers at once or not at all
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n";
    if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

// "coordinator.metrics": the embedded coordinator serves the metrics; an
// address that is malformed or taken, or metrics without an embedded
// coordinator, fail create naming the key.
TEST_F(Abi, EmbeddedCoordinatorServesMetrics) {
  const int port = free_port();
  auto config = [&](const std::string& metrics, bool embedded = true) {
    return "{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:" + std::to_string(embedded ? 0 : 1) +
           "\", \"embedded\": " + (embedded ? "true" : "false") + ", \"token_file\": \"" + token_ +
           "\", \"timeout_ms\": 2000, \"metrics\": " + metrics + "}}";
  };
  refit_source_t* s = nullptr;
  ASSERT_EQ(refit_source_create(config("{\"address\": \"127.0.0.1:" + std::to_string(port) + "\"}").c_str(), &s),
            REFIT_OK)
      << refit_last_error();
  float w[4] = {};
  const char* desc = R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";
  ASSERT_EQ(refit_source_add_tensor(s, desc, w, sizeof w), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(s, 4), REFIT_OK) << refit_last_error();
  const std::string page = scrape(port);
  EXPECT_NE(page.find(" 200 "), std::string::npos) << page;
  EXPECT_NE(page.find("\nrefit_published_version 4\n"), std::string::npos) << page;
  EXPECT_NE(page.find("\nrefit_members{role=\"source\"} 1\n"), std::string::npos) << page;
  EXPECT_NE(page.find("# TYPE refit_refresh_seconds histogram\n"), std::string::npos) << page;

  // The port is taken now: a second agent's embedded coordinator cannot serve there.
  refit_source_t* s2 = nullptr;
  EXPECT_NE(refit_source_create(config("{\"address\": \"127.0.0.1:" + std::to_string(port) + "\"}").c_str(), &s2),
            REFIT_OK);
  EXPECT_NE(std::string(refit_last_error()).find("coordinator.metrics.address"), std::string::npos)
      << refit_last_error();
  refit_source_destroy(s);
  EXPECT_NE(refit_source_create(config("{\"address\": \"no-port-here\"}").c_str(), &s2), REFIT_OK);
  EXPECT_NE(std::string(refit_last_error()).find("coordinator.metrics.address"), std::string::npos)
      << refit_last_error();
  EXPECT_NE(refit_source_create(config("{\"address\": \"127.0.0.1:0\"}", /*embedded=*/false).c_str(), &s2),
            REFIT_OK);
  EXPECT_NE(std::string(refit_last_error()).find("needs \"coordinator.embedded\": true"), std::string::npos)
      << refit_last_error();
  EXPECT_NE(refit_source_create(config("{\"address\": \"127.0.0.1:0\", \"token\": 1}").c_str(), &s2), REFIT_OK);
  EXPECT_NE(std::string(refit_last_error()).find("token"), std::string::npos) << refit_last_error();
}

// A trace file that cannot be written fails create, naming the path and
// the key, before the receiver connects anywhere.
TEST_F(Abi, ATraceThatCannotBeWrittenFailsCreate) {
  refit_receiver_t* r = nullptr;
  const std::string cfg = "{\"rank\": 0, \"trace\": \"/nonexistent-dir/refit.trace.json\", \"coordinator\": "
                          "{\"address\": \"127.0.0.1:1\", \"token_file\": \"" + token_ + "\", \"timeout_ms\": 500}}";
  EXPECT_NE(refit_receiver_create(cfg.c_str(), &r), REFIT_OK);
  EXPECT_EQ(r, nullptr);
  const std::string err = refit_last_error();
  EXPECT_NE(err.find("\"trace\""), std::string::npos) << err;
  EXPECT_NE(err.find("/nonexistent-dir/refit.trace.json"), std::string::npos) << err;
}

// Misuse around versions and registration, in one process (a source, and
// receivers that connect to its embedded coordinator): each call is refused
// with a message that names the problem, and the buffers and version stay.
TEST_F(Abi, MisuseOfVersionsAndRegistrationIsRefusedAndChangesNothing) {
  // A free port for the embedded coordinator, so the receivers can find it.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  close(fd);
  auto cfg = [&](int rank, bool embedded, const std::string& extra = "") {
    return "{\"rank\": " + std::to_string(rank) + ", \"coordinator\": {\"address\": \"127.0.0.1:" +
           std::to_string(port) + "\", \"token_file\": \"" + token_ + "\"" + (embedded ? ", \"embedded\": true" : "") +
           ", \"timeout_ms\": 3000}" + extra + "}";
  };
  const char* desc = R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";
  float src[4] = {1, 2, 3, 4};
  refit_source_t* s = nullptr;
  ASSERT_EQ(refit_source_create(cfg(0, true).c_str(), &s), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_add_tensor(s, desc, src, sizeof src), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(s, 1), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(s, 2), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_source_publish(s, 2), REFIT_INVALID_ARGUMENT) << "the same version again";
  EXPECT_NE(std::string(refit_last_error()).find("not newer than 2"), std::string::npos) << refit_last_error();

  const char* buf = R"J({"name": "w", "dtype": "F32", "segments": [{"tensor": "w", "start": [0], "size": [4], "offset": 0}]})J";
  float dst[4] = {};
  refit_receiver_t* r = nullptr;
  ASSERT_EQ(refit_receiver_create(cfg(0, false).c_str(), &r), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_add_buffer(r, buf, dst, sizeof dst), REFIT_OK) << refit_last_error();
  refit_progress_t p{};
  p.size = sizeof p;
  ASSERT_EQ(refit_receiver_progress(r, &p), REFIT_OK) << refit_last_error();
  EXPECT_EQ(p.attempt, 0u);
  EXPECT_STREQ(p.state, "idle");
  EXPECT_EQ(p.network_bytes_planned, 0u);
  ASSERT_EQ(refit_receiver_refresh(r, REFIT_LATEST, 10000), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_version(r), 2);
  ASSERT_EQ(dst[3], 4.0f);
  // A finished refresh keeps its attempt's figures: all 16 bytes landed.
  ASSERT_EQ(refit_receiver_progress(r, &p), REFIT_OK) << refit_last_error();
  EXPECT_EQ(p.attempt, 1u);
  EXPECT_EQ(p.version, 2);
  EXPECT_STREQ(p.state, "committed");
  EXPECT_EQ(p.network_bytes_planned, sizeof dst);
  EXPECT_EQ(p.network_bytes_landed, sizeof dst);
  // Misuse: each refused, naming it, and `out` untouched.
  refit_progress_t small{};
  small.size = 4;
  EXPECT_EQ(refit_receiver_progress(r, &small), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("out->size is 4"), std::string::npos) << refit_last_error();
  EXPECT_EQ(small.state, nullptr);
  EXPECT_EQ(refit_receiver_progress(r, nullptr), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("out"), std::string::npos) << refit_last_error();
  EXPECT_EQ(refit_receiver_progress(nullptr, &p), REFIT_INVALID_ARGUMENT);
  // A caller whose header has only the first fields gets only those.
  struct {
    refit_progress_t head;
    uint64_t guard;
  } old{};
  old.head.size = offsetof(refit_progress_t, state) + sizeof(const char*);
  old.head.network_bytes_planned = 7;
  ASSERT_EQ(refit_receiver_progress(r, &old.head), REFIT_OK) << refit_last_error();
  EXPECT_STREQ(old.head.state, "committed");
  EXPECT_EQ(old.head.network_bytes_planned, 7u) << "written past the caller's size";
  dst[3] = 40;  // the server's own write: no refused call may touch it

  EXPECT_EQ(refit_receiver_refresh(r, 1, 2000), REFIT_NOT_FOUND) << "older than the latest";
  EXPECT_NE(std::string(refit_last_error()).find("version 1 is older than 2"), std::string::npos) << refit_last_error();
  EXPECT_EQ(refit_receiver_commit(r), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("\"direct\" mode"), std::string::npos) << refit_last_error();
  // Two refreshes at once on one receiver.
  ASSERT_EQ(refit_receiver_refresh_start(r, 3, 3000), REFIT_OK) << refit_last_error();  // 3 is not published
  // Read while it runs: once its attempt has begun, a new attempt with no
  // transfer yet (version 3 never comes).
  const auto patience = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  do {
    ASSERT_EQ(refit_receiver_progress(r, &p), REFIT_OK) << refit_last_error();
  } while (p.network_bytes_planned != 0 && std::chrono::steady_clock::now() < patience);
  EXPECT_EQ(p.attempt, 1u);
  EXPECT_EQ(p.version, 0);
  EXPECT_EQ(p.network_bytes_planned, 0u);
  EXPECT_EQ(p.network_bytes_landed, 0u);
  EXPECT_EQ(refit_receiver_refresh(r, REFIT_LATEST, 1000), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("still running"), std::string::npos) << refit_last_error();
  EXPECT_EQ(refit_receiver_refresh_start(r, REFIT_LATEST, 1000), REFIT_INVALID_ARGUMENT);
  EXPECT_EQ(refit_receiver_refresh_wait(r, 10000), REFIT_TIMEOUT) << "version 3 never came";
  EXPECT_EQ(dst[3], 40.0f);
  EXPECT_EQ(refit_receiver_version(r), 2) << "a refresh that never started writing leaves the version";

  // A second receiver with the same rank.
  float dst2[4] = {};
  refit_receiver_t* twin = nullptr;
  ASSERT_EQ(refit_receiver_create(cfg(0, false).c_str(), &twin), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_add_buffer(twin, buf, dst2, sizeof dst2), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_join(twin), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("receiver rank 0 is already registered"), std::string::npos)
      << refit_last_error();
  refit_receiver_destroy(twin);

  // Staged: commit with nothing staged. (A domain of its own: the ranks of a
  // domain refresh together, and rank 0 does not refresh now.)
  float dst3[4] = {};
  refit_receiver_t* staged = nullptr;
  ASSERT_EQ(refit_receiver_create(cfg(1, false, ", \"mode\": \"staged\", \"instance\": 1, \"domain\": 1").c_str(), &staged), REFIT_OK)
      << refit_last_error();
  ASSERT_EQ(refit_receiver_add_buffer(staged, buf, dst3, sizeof dst3), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_commit(staged), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("no version is staged"), std::string::npos) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(staged, REFIT_LATEST, 10000), REFIT_OK) << refit_last_error();
  EXPECT_EQ(dst3[0], 0.0f) << "staged: nothing live before commit";
  ASSERT_EQ(refit_receiver_commit(staged), REFIT_OK) << refit_last_error();
  EXPECT_EQ(dst3[0], 1.0f);
  EXPECT_EQ(refit_receiver_commit(staged), REFIT_INVALID_ARGUMENT) << "committed already";
  refit_receiver_destroy(staged);

  // The first receiver still works.
  EXPECT_EQ(refit_receiver_refresh(r, REFIT_LATEST, 10000), REFIT_OK) << refit_last_error();
  EXPECT_EQ(dst[3], 4.0f);
  refit_receiver_destroy(r);
  refit_source_destroy(s);
}

// ---- Threads the system refuses (the test-only "refuse_threads_after") ----

// The thread a "cannot start the NAME thread" error names, or "" for any
// other error.
std::string refused_thread(const std::string& error) {
  const std::string head = "cannot start the ";
  const size_t at = error.rfind(head);  // the innermost: contexts may say "cannot start the coordinator"
  if (at == std::string::npos) return "";
  const size_t end = error.find(" thread", at + head.size());
  return end == std::string::npos ? "" : error.substr(at + head.size(), end - at - head.size());
}

const char* const kTensor =
    R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";

// A source whose threads are refused from the Nth on, for every N up to
// the one where it publishes: each call fails with a status naming the
// thread (the embedded coordinator's, its metrics server's, the link's
// reader and heartbeat, the progress thread), never aborting the process.
TEST_F(Abi, ASourceWhoseThreadsAreRefusedFailsItsCallsNotTheProcess) {
  std::set<std::string> refused;
  bool published = false;
  for (int n = 0; n < 16 && !published; ++n) {
    const std::string cfg = "{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:0\", \"embedded\": true, "
                            "\"token_file\": \"" + token_ + "\", \"timeout_ms\": 2000, \"metrics\": {\"address\": "
                            "\"127.0.0.1:0\"}}, \"test\": {\"refuse_threads_after\": " + std::to_string(n) + "}}";
    refit_source_t* s = nullptr;
    float w[4] = {};
    refit_status_t st = refit_source_create(cfg.c_str(), &s);
    if (st == REFIT_OK) st = refit_source_add_tensor(s, kTensor, w, sizeof(w));
    if (st == REFIT_OK) st = refit_source_publish(s, 1);
    if (st == REFIT_OK) {
      published = true;
    } else {
      const std::string error = refit_last_error();
      EXPECT_EQ(st, REFIT_IO_ERROR) << "refused after " << n << ": " << error;
      const std::string thread = refused_thread(error);
      EXPECT_NE(thread, "") << "refused after " << n << ": " << error;
      std::printf("refused after %d threads: %s\n", n, error.c_str());
      refused.insert(thread);
    }
    refit_source_destroy(s);
  }
  EXPECT_TRUE(published);
  for (const char* t : {"coordinator I/O", "metrics server", "coordinator link reader", "progress", "heartbeat"}) {
    EXPECT_EQ(refused.count(t), 1u) << "no call failed for want of the " << t << " thread";
  }
}

// A receiver whose threads are refused from the Nth on, against a source's
// embedded coordinator: create fails without its link's reader, join
// without its heartbeat, each with a status naming the thread; with enough
// threads it joins.
TEST_F(Abi, AReceiverWhoseLinkThreadsAreRefusedFailsItsCallsNotTheProcess) {
  const int port = free_port();
  const std::string coordinator = "{\"address\": \"127.0.0.1:" + std::to_string(port) + "\", \"token_file\": \"" +
                                  token_ + "\", \"timeout_ms\": 2000";
  refit_source_t* s = nullptr;
  ASSERT_EQ(refit_source_create(("{\"rank\": 0, \"coordinator\": " + coordinator + ", \"embedded\": true}}").c_str(), &s),
            REFIT_OK)
      << refit_last_error();
  float w[4] = {1, 2, 3, 4};
  ASSERT_EQ(refit_source_add_tensor(s, kTensor, w, sizeof(w)), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(s, 1), REFIT_OK) << refit_last_error();
  std::set<std::string> refused;
  bool joined = false;
  for (int n = 0; n < 16 && !joined; ++n) {
    const std::string cfg = "{\"rank\": 0, \"coordinator\": " + coordinator + "}, \"test\": "
                            "{\"refuse_threads_after\": " + std::to_string(n) + "}}";
    refit_receiver_t* r = nullptr;
    float b[4] = {};
    const char* desc = R"J({"name": "w", "dtype": "F32", "segments": [{"tensor": "w", "start": [0], "size": [4], "offset": 0}]})J";
    refit_status_t st = refit_receiver_create(cfg.c_str(), &r);
    if (st == REFIT_OK) st = refit_receiver_add_buffer(r, desc, b, sizeof(b));
    if (st == REFIT_OK) st = refit_receiver_join(r);
    if (st == REFIT_OK) {
      joined = true;
    } else {
      const std::string error = refit_last_error();
      EXPECT_EQ(st, REFIT_IO_ERROR) << "refused after " << n << ": " << error;
      const std::string thread = refused_thread(error);
      EXPECT_NE(thread, "") << "refused after " << n << ": " << error;
      std::printf("refused after %d threads: %s\n", n, error.c_str());
      refused.insert(thread);
    }
    refit_receiver_destroy(r);
  }
  EXPECT_TRUE(joined);
  for (const char* t : {"coordinator link reader", "heartbeat"}) {
    EXPECT_EQ(refused.count(t), 1u) << "no call failed for want of the " << t << " thread";
  }
  refit_source_destroy(s);
}

}  // namespace
