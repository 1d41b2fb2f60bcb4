#pragma once
// A strict reader of JSON objects from the outside world (agent configs,
// tensor and buffer descriptions): every key must be known, every value of
// the right type and range. The first problem is kept as a message that
// names the document, the key path and what was found:
//   config: "coordinator.timeout_ms" must be an integer >= 1, got "5s"
// Usage: read the keys, then check ok(); later calls after a failure are
// no-ops that return defaults.

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/status.h"

namespace refit::plugin {

using Json = nlohmann::json;

// Parses `text` as one JSON object; the error names `what`.
Result<Json> parse_object(std::string_view text, const std::string& what);

class JsonReader {
 public:
  // `doc` names the document in messages ("config", "tensor description").
  explicit JsonReader(std::string doc) : doc_(std::move(doc)) {}

  // Fails unless `obj` (at `path`, "" for the root) is an object whose keys
  // are all in `known`.
  bool object(const Json& obj, const std::string& path, std::initializer_list<const char*> known);

  // Each reads obj[key]; `path` is obj's path. A missing optional key returns
  // `fallback`; a missing required key fails.
  int64_t integer(const Json& obj, const std::string& path, const char* key, std::optional<int64_t> fallback,
                  int64_t min, int64_t max = INT64_MAX);
  bool boolean(const Json& obj, const std::string& path, const char* key, bool fallback);
  std::string string(const Json& obj, const std::string& path, const char* key,
                     std::optional<std::string> fallback);
  std::vector<std::string> strings(const Json& obj, const std::string& path, const char* key,
                                   std::vector<std::string> fallback);
  std::vector<int64_t> integers(const Json& obj, const std::string& path, const char* key, bool required,
                                int64_t min, size_t max_items);
  // obj[key] if present (any type), else nullptr; absent required keys fail.
  const Json* member(const Json& obj, const std::string& path, const char* key, bool required);

  void fail(const std::string& path, const std::string& problem);
  bool ok() const { return error_.empty(); }
  Status status() const { return ok() ? Status::ok() : Status::invalid(error_); }

  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }

 private:
  std::string doc_;
  std::string error_;
};

}  // namespace refit::plugin
