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

// A SAX consumer that accepts every event and keeps the first syntax error
// in `error`; derive from it to watch only the events one needs.
class AcceptAllSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::string error;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    error = describe(ex);
    return false;
  }
};

// Where and why `text` is not JSON: "parse error at line 1, column 2: ...".
std::string syntax_error(std::string_view text);

}  // namespace refit::json_util
