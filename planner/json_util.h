#pragma once
// Small helpers shared by the planner's JSON formats (manifest, scenario,
// layout): short renderings of values for messages and the reason a text is
// not JSON.

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace refit::json_util {

// A short rendering of a value for messages: `got "2"`, `got [1,-2]`.
std::string show(const nlohmann::json& v);

// nlohmann's exception text without its "[json.exception...] " prefix.
std::string describe(const nlohmann::detail::exception& ex);

// Where and why `text` is not JSON: "parse error at line 1, column 2: ...".
std::string syntax_error(std::string_view text);

}  // namespace refit::json_util
