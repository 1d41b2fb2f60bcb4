#include "plugin/json_reader.h"

#include "planner/json_util.h"

namespace refit::plugin {

Result<Json> parse_object(std::string_view text, const std::string& what) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::invalid(what + ": not JSON: " + json_util::syntax_error(text));
  if (!j.is_object()) return Status::invalid(what + ": must be a JSON object, got " + json_util::show(j));
  return j;
}

void JsonReader::fail(const std::string& path, const std::string& problem) {
  if (!ok()) return;
  error_ = doc_ + ": " + (path.empty() ? problem : "\"" + path + "\" " + problem);
}

bool JsonReader::object(const Json& obj, const std::string& path, std::initializer_list<const char*> known) {
  if (!ok()) return false;
  if (!obj.is_object()) {
    fail(path, "must be an object, got " + json_util::show(obj));
    return false;
  }
  for (const auto& [key, value] : obj.items()) {
    bool found = false;
    for (const char* k : known) found = found || key == k;
    if (!found) {
      std::string names;
      for (const char* k : known) names += std::string(names.empty() ? "" : ", ") + k;
      fail(join(path, key), "is not a known key (known here: " + names + ")");
      return false;
    }
  }
  return true;
}

const Json* JsonReader::member(const Json& obj, const std::string& path, const char* key, bool required) {
  if (!ok() || !obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) fail(join(path, key), "is required");
    return nullptr;
  }
  return &*it;
}

int64_t JsonReader::integer(const Json& obj, const std::string& path, const char* key,
                            std::optional<int64_t> fallback, int64_t min, int64_t max) {
  const Json* v = member(obj, path, key, !fallback.has_value());
  if (!v) return fallback.value_or(min);
  const bool in_range = (v->is_number_unsigned() && v->get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX) &&
                         v->get<int64_t>() >= min && v->get<int64_t>() <= max) ||
                        (v->is_number_integer() && !v->is_number_unsigned() && v->get<int64_t>() >= min &&
                         v->get<int64_t>() <= max);
  if (!in_range) {
    std::string range = "an integer >= " + std::to_string(min);
    if (max != INT64_MAX) range += " and <= " + std::to_string(max);
    fail(join(path, key), "must be " + range + ", got " + json_util::show(*v));
    return fallback.value_or(min);
  }
  return v->get<int64_t>();
}

bool JsonReader::boolean(const Json& obj, const std::string& path, const char* key, bool fallback) {
  const Json* v = member(obj, path, key, false);
  if (!v) return fallback;
  if (!v->is_boolean()) {
    fail(join(path, key), "must be true or false, got " + json_util::show(*v));
    return fallback;
  }
  return v->get<bool>();
}

std::string JsonReader::string(const Json& obj, const std::string& path, const char* key,
                               std::optional<std::string> fallback) {
  const Json* v = member(obj, path, key, !fallback.has_value());
  if (!v) return fallback.value_or("");
  if (!v->is_string() || v->get_ref<const std::string&>().empty()) {
    fail(join(path, key), "must be a non-empty string, got " + json_util::show(*v));
    return fallback.value_or("");
  }
  return v->get<std::string>();
}

std::vector<std::string> JsonReader::strings(const Json& obj, const std::string& path, const char* key,
                                             std::vector<std::string> fallback) {
  const Json* v = member(obj, path, key, false);
  if (!v) return fallback;
  std::vector<std::string> out;
  if (!v->is_array()) {
    fail(join(path, key), "must be a list of strings, got " + json_util::show(*v));
    return fallback;
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& e = (*v)[i];
    if (!e.is_string() || e.get_ref<const std::string&>().empty()) {
      fail(join(path, key) + "[" + std::to_string(i) + "]", "must be a non-empty string, got " + json_util::show(e));
      return fallback;
    }
    out.push_back(e.get<std::string>());
  }
  return out;
}

std::vector<int64_t> JsonReader::integers(const Json& obj, const std::string& path, const char* key,
                                          bool required, int64_t min, size_t max_items) {
  const Json* v = member(obj, path, key, required);
  std::vector<int64_t> out;
  if (!v) return out;
  if (!v->is_array() || v->size() > max_items) {
    fail(join(path, key), "must be a list of at most " + std::to_string(max_items) + " integers, " +
                              json_util::show(*v));
    return out;
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& e = (*v)[i];
    if (!e.is_number_integer() || (!e.is_number_unsigned() && e.get<int64_t>() < min) ||
        (e.is_number_unsigned() && e.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      fail(join(path, key) + "[" + std::to_string(i) + "]",
           "must be an integer >= " + std::to_string(min) + ", got " + json_util::show(e));
      return {};
    }
    out.push_back(e.get<int64_t>());
  }
  return out;
}

}  // namespace refit::plugin
