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

std::string syntax_error(std::string_view text) {
  AcceptAllSax finder;
  json::sax_parse(text, &finder);
  return finder.error.empty() ? "parse error" : finder.error;
}

}  // namespace refit::json_util
