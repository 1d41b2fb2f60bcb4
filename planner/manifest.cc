#include "planner/manifest.h"

#include <algorithm>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "planner/json_util.h"

#include "planner/box.h"

namespace refit {
namespace {

using nlohmann::json;
using json_util::show;

// The safetensors crate refuses headers above 100 MB (MAX_HEADER_SIZE); a
// larger length is a corrupt or hostile file, and refusing it early keeps a
// lying length from making a caller read gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// A SAX pass over the text that records the top-level keys in file order,
// and where and why the text is not JSON. nlohmann's default object is a
// std::map (sorted); ordered_json finds keys linearly and the callback
// parser rescans the parent object at every nested object's end, both
// quadratic for a 100k-tensor manifest. Lexing twice is cheap.
class KeyScanner : public json_util::AcceptAllSax {
 public:
  explicit KeyScanner(std::vector<std::string>* keys) : keys_(keys) {}
  bool start_object(std::size_t) override { return ++depth_, true; }
  bool key(string_t& k) override {
    if (depth_ == 1) keys_->push_back(k);
    return true;
  }
  bool end_object() override { return --depth_, true; }
  bool start_array(std::size_t) override { return ++depth_, true; }
  bool end_array() override { return --depth_, true; }

 private:
  std::vector<std::string>* keys_;
  int depth_ = 0;
};

// Parses a JSON object and records its top-level keys in file order.
Result<json> parse_object(std::string_view text, const std::string& origin, std::vector<std::string>* keys) {
  keys->clear();
  KeyScanner scanner(keys);
  if (!json::sax_parse(text, &scanner))
    return Status::invalid(origin + ": not valid JSON: " + (scanner.error.empty() ? "parse error" : scanner.error));
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::invalid(origin + ": not valid JSON");
  if (!doc.is_object())
    return Status::invalid(origin + ": a manifest must be a JSON object of tensors, got " + show(doc));
  if (keys->size() != doc.size()) {
    std::unordered_set<std::string_view> seen;
    for (const std::string& k : *keys)
      if (!seen.insert(k).second) return Status::invalid(origin + ": tensor \"" + k + "\" is listed twice");
  }
  return doc;
}

bool as_uint(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

struct Entry {
  ManifestTensor tensor;
  bool has_offsets = false;
  uint64_t begin = 0, end = 0;
  uint64_t bytes = 0;
};

// Checks one tensor entry: {"dtype": .., "shape": [..]} and, where allowed,
// "data_offsets": [begin, end].
Status parse_entry(const std::string& origin, const std::string& name, const json& v, bool offsets_required,
                   Entry* e) {
  auto fail = [&](const std::string& msg) {
    return Status::invalid(origin + ": tensor \"" + name + "\": " + msg);
  };
  if (name.empty()) return Status::invalid(origin + ": a tensor has an empty name");
  if (!v.is_object()) return fail("must be an object with \"dtype\" and \"shape\", got " + show(v));
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets")
      return fail("unknown key \"" + it.key() + "\" (known: dtype, shape, data_offsets)");
  }
  e->tensor.name = name;

  auto dt = v.find("dtype");
  if (dt == v.end()) return fail("missing key \"dtype\"");
  if (!dt->is_string()) return fail("\"dtype\" must be a string, got " + show(*dt));
  auto dtype = parse_dtype(dt->get_ref<const std::string&>());
  if (!dtype)
    return fail("\"dtype\" must be one of BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8 U8 I16 I32 I64 BOOL, got " +
                show(*dt));
  e->tensor.dtype = *dtype;

  auto sh = v.find("shape");
  if (sh == v.end()) return fail("missing key \"shape\"");
  if (!sh->is_array()) return fail("\"shape\" must be a list of non-negative integers, got " + show(*sh));
  if (sh->size() > static_cast<size_t>(kMaxDims))
    return fail("\"shape\" has " + std::to_string(sh->size()) + " dims; at most " + std::to_string(kMaxDims) +
                " are supported");
  uint64_t bytes = static_cast<uint64_t>(dtype_bytes(*dtype));
  bool overflow = false;
  for (const json& d : *sh) {
    uint64_t n;
    if (!as_uint(d, &n) || n > static_cast<uint64_t>(INT64_MAX))
      return fail("\"shape\" must be a list of non-negative integers, got " + show(*sh));
    e->tensor.shape.push_back(static_cast<int64_t>(n));
    overflow |= __builtin_mul_overflow(bytes, n, &bytes);
  }
  if (overflow || bytes > static_cast<uint64_t>(INT64_MAX))
    return fail("\"shape\" " + show(*sh) + " is too large: its size overflows 63 bits");
  e->bytes = bytes;

  auto off = v.find("data_offsets");
  if (off == v.end()) {
    if (offsets_required) return fail("missing key \"data_offsets\"");
    return Status::ok();
  }
  uint64_t b, en;
  if (!off->is_array() || off->size() != 2 || !as_uint((*off)[0], &b) || !as_uint((*off)[1], &en) || b > en)
    return fail("\"data_offsets\" must be [begin, end] with 0 <= begin <= end, got " + show(*off));
  if (en - b != bytes)
    return fail("\"data_offsets\" " + show(*off) + " span " + std::to_string(en - b) + " bytes, but shape " +
                show(*sh) + " of " + std::string(dtype_name(*dtype)) + " needs " + std::to_string(bytes));
  e->has_offsets = true;
  e->begin = b;
  e->end = en;
  return Status::ok();
}

Status check_metadata(const std::string& origin, const json& v) {
  if (!v.is_object()) return Status::invalid(origin + ": \"__metadata__\" must be an object, got " + show(v));
  for (auto it = v.begin(); it != v.end(); ++it) {
    // The safetensors format allows only string values here.
    if (!it->is_string())
      return Status::invalid(origin + ": \"__metadata__\": \"" + it.key() + "\" must be a string, got " +
                             show(*it));
  }
  return Status::ok();
}

// Both formats: a JSON object of tensors in file order, with an optional
// "__metadata__". Fills `entries` in file order.
Status parse_entries(std::string_view text, const std::string& origin, bool offsets_required,
                     std::vector<Entry>* entries) {
  std::vector<std::string> keys;
  auto doc = parse_object(text, origin, &keys);
  if (!doc) return doc.status();
  entries->reserve(keys.size());
  for (const std::string& k : keys) {
    const json& v = *doc->find(k);
    if (k == "__metadata__") {
      REFIT_RETURN_IF_ERROR(check_metadata(origin, v));
      continue;
    }
    Entry e;
    REFIT_RETURN_IF_ERROR(parse_entry(origin, k, v, offsets_required, &e));
    entries->push_back(std::move(e));
  }
  return Status::ok();
}

}  // namespace

Result<Manifest> parse_manifest_json(std::string_view json_text, const std::string& origin) {
  std::vector<Entry> entries;
  REFIT_RETURN_IF_ERROR(parse_entries(json_text, origin, /*offsets_required=*/false, &entries));
  if (entries.empty()) return Status::invalid(origin + ": the manifest lists no tensors");
  Manifest m;
  m.reserve(entries.size());
  for (Entry& e : entries) m.push_back(std::move(e.tensor));
  return m;
}

Result<Manifest> parse_safetensors_header(std::string_view bytes, uint64_t file_size, const std::string& origin) {
  if (file_size < 8 || bytes.size() < 8)
    return Status::invalid(origin + ": " + std::to_string(std::min<uint64_t>(file_size, bytes.size())) +
                           " bytes is too short for a safetensors file (an 8-byte header length comes first)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  if (n > kMaxHeaderBytes)
    return Status::invalid(origin + ": the header length " + std::to_string(n) + " is above the safetensors limit of " +
                           std::to_string(kMaxHeaderBytes) + " bytes: not a safetensors file, or a corrupt one");
  if (n > file_size - 8)
    return Status::invalid(origin + ": the header length " + std::to_string(n) + " runs past the end of the file (" +
                           std::to_string(file_size) + " bytes)");
  if (n > bytes.size() - 8)
    return Status::invalid(origin + ": truncated header: it announces " + std::to_string(n) + " bytes, only " +
                           std::to_string(bytes.size() - 8) + " were given");
  std::string_view header = bytes.substr(8, n);
  if (header.empty() || header.front() != '{')
    return Status::invalid(origin + ": the header must be a JSON object starting with '{'");

  std::vector<Entry> entries;
  REFIT_RETURN_IF_ERROR(parse_entries(header, origin, /*offsets_required=*/true, &entries));
  const uint64_t data_bytes = file_size - 8 - n;
  for (const Entry& e : entries) {
    if (e.end > data_bytes)
      return Status::invalid(origin + ": tensor \"" + e.tensor.name + "\": \"data_offsets\" [" +
                             std::to_string(e.begin) + ", " + std::to_string(e.end) + "] run past the data (" +
                             std::to_string(data_bytes) + " bytes after the header): the file is truncated");
  }
  // Two tensors sharing bytes is a lying header: sort by offset, compare neighbours.
  std::vector<const Entry*> by_offset;
  by_offset.reserve(entries.size());
  for (const Entry& e : entries)
    if (e.end > e.begin) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      return Status::invalid(origin + ": tensors \"" + by_offset[i - 1]->tensor.name + "\" and \"" +
                             by_offset[i]->tensor.name + "\" overlap in the data section");
  }
  Manifest m;
  m.reserve(entries.size());
  for (const Entry& e : entries) m.push_back(e.tensor);
  return m;
}

Status merge_manifest(Manifest& into, Manifest&& more, const std::string& origin) {
  std::unordered_set<std::string_view> names;
  names.reserve(more.size());
  for (const ManifestTensor& t : more) names.insert(t.name);
  for (const ManifestTensor& t : into) {
    if (names.count(t.name))
      return Status::invalid(origin + ": tensor \"" + t.name + "\" is also in an earlier file of the checkpoint");
  }
  into.reserve(into.size() + more.size());
  for (ManifestTensor& t : more) into.push_back(std::move(t));
  more.clear();
  return Status::ok();
}

}  // namespace refit
