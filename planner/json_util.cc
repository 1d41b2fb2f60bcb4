#include "planner/json_util.h"

namespace refit::json_util {

using nlohmann::json;

std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string describe(const nlohmann::detail::exception& ex) {
  std::string what = ex.what();
  if (auto p = what.find("] "); what.rfind("[json.exception.", 0) == 0 && p != std::string::npos)
    what = what.substr(p + 2);
  return what.empty() ? "parse error" : what;
}

namespace {

// A SAX consumer that accepts everything and keeps the first syntax error.
class ErrorFinder : public nlohmann::json_sax<json> {
 public:
  std::string what;
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
    what = describe(ex);
    return false;
  }
};

}  // namespace

std::string syntax_error(std::string_view text) {
  ErrorFinder finder;
  json::sax_parse(text, &finder);
  return finder.what.empty() ? "parse error" : finder.what;
}

}  // namespace refit::json_util
