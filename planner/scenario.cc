#include "planner/scenario.h"

#include <cmath>
#include <initializer_list>

#include <nlohmann/json.hpp>

#include "planner/json_util.h"

namespace refit {
namespace {

using nlohmann::json;
using json_util::show;

// Parallel degrees and GPU counts far beyond any cluster are typos; the cap
// also keeps the products below from overflowing.
constexpr int64_t kMaxCount = int64_t{1} << 24;



// One JSON object of the scenario, addressed by its dotted path ("train").
// Each getter checks presence and type and names the key on failure.
class Object {
 public:
  Object(const std::string& origin, const json& obj, std::string path)
      : origin_(origin), obj_(obj), path_(std::move(path)) {}

  Status check_keys(std::initializer_list<const char*> known) const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      bool ok = false;
      for (const char* k : known) ok |= it.key() == k;
      if (ok) continue;
      std::string list;
      for (const char* k : known) list += std::string(list.empty() ? "" : ", ") + k;
      return Status::invalid(origin_ + ": unknown key \"" + key(it.key()) + "\" (known: " + list + ")");
    }
    return Status::ok();
  }

  std::string key(const std::string& k) const { return path_.empty() ? k : path_ + "." + k; }

  // nullptr when absent and optional; an error when absent and required.
  Result<const json*> find(const char* k, bool required) const {
    auto it = obj_.find(k);
    if (it != obj_.end()) return &*it;
    if (required) return Status::invalid(origin_ + ": missing key \"" + key(k) + "\"");
    return static_cast<const json*>(nullptr);
  }

  Status positive_int(const char* k, bool required, int64_t* out) const {
    auto v = find(k, required);
    if (!v) return v.status();
    if (!*v) return Status::ok();
    const json& j = **v;
    // JSON reads a positive literal as unsigned and a negative one as signed.
    const bool is_int = j.is_number_integer();  // true for both
    const bool too_big = j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(kMaxCount);
    if (!is_int || too_big || j.get<int64_t>() < 1)
      return Status::invalid(origin_ + ": \"" + key(k) + "\" must be a positive integer" +
                             (too_big ? " of at most " + std::to_string(kMaxCount) : std::string()) + ", got " +
                             show(j));
    *out = j.get<int64_t>();
    return Status::ok();
  }

  Status boolean(const char* k, bool required, bool* out) const {
    auto v = find(k, required);
    if (!v) return v.status();
    if (!*v) return Status::ok();
    if (!(*v)->is_boolean())
      return Status::invalid(origin_ + ": \"" + key(k) + "\" must be true or false, got " + show(**v));
    *out = (*v)->get<bool>();
    return Status::ok();
  }

  Status string(const char* k, bool required, bool non_empty, std::string* out) const {
    auto v = find(k, required);
    if (!v) return v.status();
    if (!*v) return Status::ok();
    if (!(*v)->is_string() || (non_empty && (*v)->get_ref<const std::string&>().empty()))
      return Status::invalid(origin_ + ": \"" + key(k) + "\" must be a " + (non_empty ? "non-empty " : "") +
                             "string, got " + show(**v));
    *out = (*v)->get<std::string>();
    return Status::ok();
  }

  Status positive_number(const char* k, bool required, double* out) const {
    auto v = find(k, required);
    if (!v) return v.status();
    if (!*v) return Status::ok();
    const json& j = **v;
    if (!j.is_number() || !(j.get<double>() > 0) || !std::isfinite(j.get<double>()))
      return Status::invalid(origin_ + ": \"" + key(k) + "\" must be a positive number, got " + show(j));
    *out = j.get<double>();
    return Status::ok();
  }

  Result<Object> object(const char* k, bool required) const {
    auto v = find(k, required);
    if (!v) return v.status();
    if (!*v) return Object(origin_, empty_object(), key(k));
    if (!(*v)->is_object())
      return Status::invalid(origin_ + ": \"" + key(k) + "\" must be an object, got " + show(**v));
    return Object(origin_, **v, key(k));
  }

  const json& value() const { return obj_; }
  const std::string& path() const { return path_; }

 private:
  static const json& empty_object() {
    static const json kEmpty = json::object();
    return kEmpty;
  }
  const std::string& origin_;
  const json& obj_;
  std::string path_;
};

Status parse_train(const Object& o, TrainSide* t) {
  REFIT_RETURN_IF_ERROR(o.check_keys({"gpus", "tp", "cp", "dp", "pp", "ep", "fsdp", "gpus_per_domain", "model"}));
  REFIT_RETURN_IF_ERROR(o.string("model", false, true, &t->model));
  REFIT_RETURN_IF_ERROR(o.positive_int("gpus", true, &t->gpus));
  REFIT_RETURN_IF_ERROR(o.positive_int("tp", true, &t->tp));
  REFIT_RETURN_IF_ERROR(o.positive_int("cp", false, &t->cp));
  REFIT_RETURN_IF_ERROR(o.positive_int("dp", true, &t->dp));
  REFIT_RETURN_IF_ERROR(o.positive_int("pp", true, &t->pp));
  REFIT_RETURN_IF_ERROR(o.positive_int("ep", false, &t->ep));
  REFIT_RETURN_IF_ERROR(o.boolean("fsdp", false, &t->fsdp));
  REFIT_RETURN_IF_ERROR(o.positive_int("gpus_per_domain", true, &t->gpus_per_domain));
  return Status::ok();
}

Status parse_infer(const Object& o, InferSide* t) {
  REFIT_RETURN_IF_ERROR(o.check_keys({"gpus", "tp", "dp", "pp", "expert_parallel", "gpus_per_domain", "model"}));
  REFIT_RETURN_IF_ERROR(o.string("model", false, true, &t->model));
  REFIT_RETURN_IF_ERROR(o.positive_int("gpus", true, &t->gpus));
  REFIT_RETURN_IF_ERROR(o.positive_int("tp", true, &t->tp));
  REFIT_RETURN_IF_ERROR(o.positive_int("dp", true, &t->dp));
  REFIT_RETURN_IF_ERROR(o.positive_int("pp", false, &t->pp));
  REFIT_RETURN_IF_ERROR(o.boolean("expert_parallel", false, &t->expert_parallel));
  REFIT_RETURN_IF_ERROR(o.positive_int("gpus_per_domain", true, &t->gpus_per_domain));
  return Status::ok();
}

Status parse_reported(const std::string& origin, const json& list, std::vector<Reported>* out) {
  if (!list.is_array()) return Status::invalid(origin + ": \"reported\" must be a list, got " + show(list));
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = "reported[" + std::to_string(i) + "]";
    if (!list[i].is_object())
      return Status::invalid(origin + ": \"" + path + "\" must be an object, got " + show(list[i]));
    Object o(origin, list[i], path);
    Reported r;
    REFIT_RETURN_IF_ERROR(o.check_keys({"system", "seconds", "seconds_max", "source"}));
    REFIT_RETURN_IF_ERROR(o.string("system", true, true, &r.system));
    REFIT_RETURN_IF_ERROR(o.positive_number("seconds", true, &r.seconds));
    REFIT_RETURN_IF_ERROR(o.positive_number("seconds_max", false, &r.seconds_max));
    REFIT_RETURN_IF_ERROR(o.string("source", true, false, &r.source));
    if (r.seconds_max != 0 && r.seconds_max < r.seconds)
      return Status::invalid(origin + ": \"" + path + ".seconds_max\" (" + show(list[i]["seconds_max"]) +
                             ") must not be below \"" + path + ".seconds\" (" + show(list[i]["seconds"]) + ")");
    out->push_back(std::move(r));
  }
  return Status::ok();
}

std::string product(std::initializer_list<int64_t> xs, int64_t* out) {
  std::string s;
  *out = 1;
  for (int64_t x : xs) {
    *out *= x;  // each <= 2^24 and at most four of them: no overflow
    s += (s.empty() ? "" : "*") + std::to_string(x);
  }
  return s;
}

}  // namespace

Result<Scenario> parse_scenario(std::string_view json_text, const std::string& origin) {
  json doc = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return Status::invalid(origin + ": not valid JSON: " + json_util::syntax_error(json_text));
  }
  if (!doc.is_object()) return Status::invalid(origin + ": a scenario must be a JSON object, got " + show(doc));

  Scenario s;
  Object top(origin, doc, "");
  REFIT_RETURN_IF_ERROR(top.check_keys({"about", "model", "train", "infer", "hardware", "reported"}));
  REFIT_RETURN_IF_ERROR(top.string("about", false, false, &s.about));
  REFIT_RETURN_IF_ERROR(top.string("model", true, true, &s.model));
  auto train = top.object("train", true);
  if (!train) return train.status();
  REFIT_RETURN_IF_ERROR(parse_train(*train, &s.train));
  auto infer = top.object("infer", true);
  if (!infer) return infer.status();
  REFIT_RETURN_IF_ERROR(parse_infer(*infer, &s.infer));
  if (s.train.model.empty()) s.train.model = s.model;
  if (s.infer.model.empty()) s.infer.model = s.model;
  if (doc.contains("hardware")) {
    auto hw = top.object("hardware", true);
    if (!hw) return hw.status();
    // Every key of the simulator's hardware model is accepted (hardware.h).
    REFIT_RETURN_IF_ERROR(apply_hardware(hw->value(), origin, "hardware", /*require_link_rates=*/true,
                                         &s.hardware_model, &s.hardware_given));
    s.hardware.nic_gbit_per_gpu = s.hardware_model.nic_gbit_per_gpu;
    s.hardware.nvlink_gbyte_per_gpu = s.hardware_model.nvlink_gbyte_per_gpu;
  }
  if (auto it = doc.find("reported"); it != doc.end())
    REFIT_RETURN_IF_ERROR(parse_reported(origin, *it, &s.reported));

  const TrainSide& t = s.train;
  int64_t n;
  std::string f = product({t.tp, t.cp, t.dp, t.pp}, &n);
  if (t.gpus != n)
    return Status::invalid(origin + ": \"train.gpus\" is " + std::to_string(t.gpus) + " but tp*cp*dp*pp = " + f +
                           " = " + std::to_string(n));
  f = product({t.tp, t.cp, t.dp}, &n);
  if (n % t.ep != 0)
    return Status::invalid(origin + ": \"train.ep\" (" + std::to_string(t.ep) + ") must divide tp*cp*dp = " + f +
                           " = " + std::to_string(n));
  const InferSide& i = s.infer;
  f = product({i.tp, i.dp, i.pp}, &n);
  if (i.gpus != n)
    return Status::invalid(origin + ": \"infer.gpus\" is " + std::to_string(i.gpus) + " but tp*dp*pp = " + f +
                           " = " + std::to_string(n));
  return s;
}

}  // namespace refit
