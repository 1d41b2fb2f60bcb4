#include "planner/layout_json.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "planner/conversion.h"
#include "planner/json_util.h"
#include "planner/placement.h"

namespace refit {
namespace {

using nlohmann::json;
using json_util::show;

constexpr std::string_view kLayoutFormat = "refit-layout/1";
constexpr std::string_view kRunsFormat = "refit-runs/1";

// ---------------------------------------------------------------- reading


std::string show_box(const Box& b) { return b.to_string(); }

std::string show_shape(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}


// An integer in [lo, hi]; JSON reads positive literals as unsigned.
bool get_int(const json& v, int64_t lo, int64_t hi, int64_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return false;
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) return false;
  *out = x;
  return true;
}

// A parsed explicit segment, before buffers are grouped.
struct Segment {
  uint32_t tensor = 0;
  Box box;
  int64_t offset = 0;
  Index strides{};
  bool converted = false;  // a source's copy in the receivers' dtype (Tensor::converted_sources)
};

// Explicit buffers with the same side, name, dtype, size and segments on
// several ranks become one Buffer held by all of them.
struct Group {
  Side side = Side::kSource;
  std::string name;
  DType dtype = DType::kBF16;
  int64_t bytes = 0;
  std::vector<Segment> segments;
  std::vector<int32_t> ranks;
};

class Parser {
 public:
  explicit Parser(const std::string& origin) : origin_(origin) {}

  // The document but its buffers: format, ranks and tensors (its
  // "buffers", if it holds them, are not read here). Once.
  Status head(const json& doc) {
    if (!doc.is_object())
      return Status::invalid(origin_ + ": a layout must be a JSON object, got " + show(doc));
    REFIT_RETURN_IF_ERROR(check_keys(doc, "", {"format", "sources", "receivers", "tensors", "buffers", "weight_block_size"}));
    auto fmt = doc.find("format");
    if (fmt == doc.end()) return fail("", "missing key \"format\"");
    if (!fmt->is_string() || fmt->get_ref<const std::string&>() != kLayoutFormat)
      return fail("format", "must be \"" + std::string(kLayoutFormat) + "\", got " + show(*fmt));
    REFIT_RETURN_IF_ERROR(parse_ranks(doc, Side::kSource));
    REFIT_RETURN_IF_ERROR(parse_ranks(doc, Side::kReceiver));
    auto tensors = list(doc, "tensors", true);
    if (!tensors) return tensors.status();
    L_.tensors.reserve((*tensors)->size());
    for (size_t i = 0; i < (*tensors)->size(); ++i) REFIT_RETURN_IF_ERROR(parse_tensor((**tensors)[i], i));
    return Status::ok();
  }

  // The document's next explicit buffer, after head().
  Status buffer(const json& b) { return parse_buffer(b, buffers_read_++); }
  Status view(const LayoutBuilder::BufferView& b) { return view_buffer(b, buffers_read_++); }
  Status view(const LayoutBuilder::HeadView& h) { return head_view(h); }

  // After head() and every buffer: `doc` again, whole but for what was
  // handed to buffer() (keys that came after the buffers are checked here),
  // then the layout's checks.
  Result<Layout> finish(const json& doc) {
    REFIT_RETURN_IF_ERROR(check_keys(doc, "", {"format", "sources", "receivers", "tensors", "buffers", "weight_block_size"}));
    // A "buffers" that is a list was handed to buffer() element by element.
    if (auto buffers = list(doc, "buffers", false); !buffers) return buffers.status();
    // The F8_E4M3 block (rows, cols), as quantization_config.weight_block_size.
    if (auto wb = doc.find("weight_block_size"); wb != doc.end()) {
      const bool ok = wb->is_array() && wb->size() == 2 && (*wb)[0].is_number_integer() &&
                      (*wb)[1].is_number_integer() && (*wb)[0].get<int64_t>() > 0 && (*wb)[1].get<int64_t>() > 0;
      if (!ok) return fail("weight_block_size", "must be two positive integers (rows, cols), got " + show(*wb));
      L_.weight_block_size = {(*wb)[0].get<int64_t>(), (*wb)[1].get<int64_t>()};
    }
    return finish_layout();
  }

  // The head as values (LayoutBuilder::HeadView): parse_ranks' and
  // parse_tensor's checks of what a value may hold, with their messages,
  // and the block size finish() reads from the document.
  Status head_view(const LayoutBuilder::HeadView& h) {
    REFIT_RETURN_IF_ERROR(view_ranks(h.sources, Side::kSource));
    REFIT_RETURN_IF_ERROR(view_ranks(h.receivers, Side::kReceiver));
    L_.tensors.reserve(h.tensors.size());
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      const LayoutBuilder::TensorView& t = h.tensors[i];
      const std::string path = "tensors[" + std::to_string(i) + "]";
      if (t.name.empty()) return fail(path + ".name", "must be a non-empty string, got \"\"");
      std::string name(t.name);
      Context ctx(this, " (tensor \"" + name + "\")");
      const std::optional<DType> dtype = parse_dtype(t.dtype);
      if (!dtype) return fail(path + ".dtype", kDtypeChoices + show(json(t.dtype)));
      const json shown(std::vector<int64_t>(t.shape.begin(), t.shape.end()));
      if (t.shape.size() > static_cast<size_t>(kMaxDims))
        return fail(path + ".shape", "has " + std::to_string(t.shape.size()) + " dims; at most " +
                                         std::to_string(kMaxDims) + " are supported");
      for (int64_t d : t.shape)
        if (d < 0) return fail(path + ".shape", "must be a list of non-negative integers, got " + show(shown));
      REFIT_RETURN_IF_ERROR(add_tensor(std::move(name), *dtype, std::vector<int64_t>(t.shape.begin(), t.shape.end()),
                                       path));
    }
    view_block_ = h.weight_block_size;  // checked where finish(doc) checks it
    return Status::ok();
  }

  // finish() after head_view(): the block size, then the layout's checks.
  Result<Layout> finish_view() {
    const auto& wb = view_block_;
    if (wb[0] <= 0 || wb[1] <= 0)
      return fail("weight_block_size", "must be two positive integers (rows, cols), got " + show(json(wb)));
    L_.weight_block_size = wb;
    return finish_layout();
  }

  // After every buffer: the layout's own checks.
  Result<Layout> finish_layout() {
    build_groups();
    Status s = has_conversions(L_) ? resolve_conversions(L_) : validate(L_);
    if (!s) return s.with_context(origin_);
    return std::move(L_);
  }

 private:
  // "origin: path (context): msg"; the context names the tensor or buffer
  // being read, when there is one.
  Status fail(const std::string& path, const std::string& msg) const {
    if (path.empty()) return Status::invalid(origin_ + ": " + msg);
    if (segment_tensor_ && !context_.empty()) {
      // Within a segment: the buffer's context, and its tensor.
      return Status::invalid(origin_ + ": " + path + context_.substr(0, context_.size() - 1) + ", tensor \"" +
                             *segment_tensor_ + "\"): " + msg);
    }
    return Status::invalid(origin_ + ": " + path + context_ + ": " + msg);
  }

  Status check_keys(const json& obj, const std::string& path, std::initializer_list<const char*> known) const {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      bool ok = false;
      for (const char* k : known) ok |= it.key() == k;
      if (ok) continue;
      std::string names;
      for (const char* k : known) names += std::string(names.empty() ? "" : ", ") + k;
      return fail(path, "unknown key \"" + it.key() + "\" (known: " + names + ")");
    }
    return Status::ok();
  }

  static std::string join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }

  // obj[key] as a list; nullptr when absent and optional.
  Result<const json*> list(const json& obj, const char* key, bool required, const std::string& path = "") const {
    auto it = obj.find(key);
    if (it == obj.end()) {
      if (required) return fail(path, "missing key \"" + std::string(key) + "\"");
      return static_cast<const json*>(nullptr);
    }
    if (!it->is_array()) return fail(join(path, key), "must be a list, got " + show(*it));
    return &*it;
  }

  Result<const json*> field(const json& obj, const char* key, const std::string& path) const {
    auto it = obj.find(key);
    if (it == obj.end()) return fail(path, "missing key \"" + std::string(key) + "\"");
    return &*it;
  }

  Status int_field(const json& obj, const char* key, const std::string& path, int64_t lo, int64_t hi,
                   const char* what, int64_t* out) const {
    auto v = field(obj, key, path);
    if (!v) return v.status();
    if (!get_int(**v, lo, hi, out)) return fail(join(path, key), std::string("must be ") + what + ", got " + show(**v));
    return Status::ok();
  }

  Status dtype_field(const json& obj, const std::string& path, DType* out) const {
    auto v = field(obj, "dtype", path);
    if (!v) return v.status();
    std::optional<DType> d;
    if ((*v)->is_string()) d = parse_dtype((*v)->get_ref<const std::string&>());
    if (!d)
      return fail(join(path, "dtype"),
                  "must be one of BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8 U8 I16 I32 I64 BOOL, got " + show(**v));
    *out = *d;
    return Status::ok();
  }

  Status name_field(const json& obj, const std::string& path, std::string* out) const {
    auto v = field(obj, "name", path);
    if (!v) return v.status();
    if (!(*v)->is_string() || (*v)->get_ref<const std::string&>().empty())
      return fail(join(path, "name"), "must be a non-empty string, got " + show(**v));
    *out = (*v)->get<std::string>();
    return Status::ok();
  }

  // A list of `n` integers in [lo, hi] (n < 0: any length up to kMaxDims).
  Status int_list(const json& obj, const char* key, const std::string& path, int n, int64_t lo, const char* what,
                  std::vector<int64_t>* out) const {
    auto v = field(obj, key, path);
    if (!v) return v.status();
    const json& a = **v;
    const std::string p = join(path, key);
    if (!a.is_array()) return fail(p, std::string("must be a list of ") + what + ", got " + show(a));
    if (n >= 0 && a.size() != static_cast<size_t>(n))
      return fail(p, "must list " + std::to_string(n) + " " + what + " (one per tensor dim), got " + show(a));
    if (n < 0 && a.size() > static_cast<size_t>(kMaxDims))
      return fail(p, "has " + std::to_string(a.size()) + " dims; at most " + std::to_string(kMaxDims) +
                         " are supported");
    out->clear();
    for (const json& x : a) {
      int64_t i;
      if (!get_int(x, lo, INT64_MAX, &i)) return fail(p, std::string("must be a list of ") + what + ", got " + show(a));
      out->push_back(i);
    }
    return Status::ok();
  }

  Status parse_ranks(const json& doc, Side side) {
    const char* key = side == Side::kSource ? "sources" : "receivers";
    auto l = list(doc, key, true);
    if (!l) return l.status();
    const json& a = **l;
    if (a.empty()) return fail(key, "must list at least one rank");
    if (a.size() > static_cast<size_t>(INT32_MAX)) return fail(key, "lists too many ranks");
    for (size_t i = 0; i < a.size(); ++i) {
      const std::string path = std::string(key) + "[" + std::to_string(i) + "]";
      const json& r = a[i];
      if (!r.is_object()) return fail(path, "must be an object, got " + show(r));
      if (side == Side::kSource) {
        REFIT_RETURN_IF_ERROR(check_keys(r, path, {"rank", "domain"}));
      } else {
        REFIT_RETURN_IF_ERROR(check_keys(r, path, {"rank", "domain", "instance"}));
      }
      int64_t rank, domain, instance = 0;
      REFIT_RETURN_IF_ERROR(int_field(r, "rank", path, 0, INT64_MAX, "a non-negative integer", &rank));
      if (rank != static_cast<int64_t>(i))
        return fail(path + ".rank", "must be " + std::to_string(i) + ": ranks are listed in order from 0, got " +
                                        std::to_string(rank));
      REFIT_RETURN_IF_ERROR(int_field(r, "domain", path, 0, INT32_MAX, "a non-negative integer", &domain));
      if (side == Side::kSource) {
        L_.sources.push_back(SourceRank{static_cast<int32_t>(domain)});
      } else {
        REFIT_RETURN_IF_ERROR(int_field(r, "instance", path, 0, INT32_MAX, "a non-negative integer", &instance));
        L_.receivers.push_back(ReceiverRank{static_cast<int32_t>(domain), static_cast<int32_t>(instance)});
      }
    }
    return Status::ok();
  }

  Status parse_tensor(const json& t, size_t i) {
    const std::string path = "tensors[" + std::to_string(i) + "]";
    if (!t.is_object()) return fail(path, "must be an object, got " + show(t));
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    REFIT_RETURN_IF_ERROR(name_field(t, path, &name));
    Context ctx(this, " (tensor \"" + name + "\")");
    REFIT_RETURN_IF_ERROR(check_keys(t, path, {"name", "dtype", "shape", "source", "receiver"}));
    REFIT_RETURN_IF_ERROR(dtype_field(t, path, &dtype));
    REFIT_RETURN_IF_ERROR(int_list(t, "shape", path, -1, 0, "non-negative integers", &shape));
    REFIT_RETURN_IF_ERROR(add_tensor(name, dtype, std::move(shape), path));
    const uint32_t ti = static_cast<uint32_t>(L_.tensors.size() - 1);
    for (Side side : {Side::kSource, Side::kReceiver}) {
      const char* key = side == Side::kSource ? "source" : "receiver";
      auto spec = t.find(key);
      if (spec == t.end()) continue;
      REFIT_RETURN_IF_ERROR(parse_spec(*spec, ti, side, path + "." + key));
    }
    return Status::ok();
  }

  // A tensor whose name, dtype and shape are each of their kind: its size
  // fits, and its name is new.
  Status add_tensor(std::string name, DType dtype, std::vector<int64_t> shape, const std::string& path) {
    uint64_t bytes = static_cast<uint64_t>(dtype_bytes(dtype));
    for (int64_t s : shape) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(s), &bytes) || bytes > static_cast<uint64_t>(INT64_MAX))
        return fail(path + ".shape", show_shape(shape) + " is too large: its size overflows 63 bits");
    }
    auto [it, inserted] = tensor_index_.emplace(name, static_cast<uint32_t>(L_.tensors.size()));
    if (!inserted)
      return fail(path, "tensor \"" + name + "\" is listed twice (first at tensors[" + std::to_string(it->second) +
                            "])");
    L_.add_tensor(std::move(name), dtype, std::move(shape));
    return Status::ok();
  }

  Status view_ranks(std::span<const LayoutBuilder::RankView> ranks, Side side) {
    const char* key = side == Side::kSource ? "sources" : "receivers";
    if (ranks.empty()) return fail(key, "must list at least one rank");
    if (ranks.size() > static_cast<size_t>(INT32_MAX)) return fail(key, "lists too many ranks");
    for (size_t i = 0; i < ranks.size(); ++i) {
      const std::string path = std::string(key) + "[" + std::to_string(i) + "]";
      if (ranks[i].domain < 0)
        return fail(path + ".domain", "must be a non-negative integer, got " + std::to_string(ranks[i].domain));
      if (side == Side::kSource) {
        L_.sources.push_back(SourceRank{ranks[i].domain});
        continue;
      }
      if (ranks[i].instance < 0)
        return fail(path + ".instance", "must be a non-negative integer, got " + std::to_string(ranks[i].instance));
      L_.receivers.push_back(ReceiverRank{ranks[i].domain, ranks[i].instance});
    }
    return Status::ok();
  }

  // A DTensor spec. The checks that can point at one entry are made here, so
  // the message names it; the pairing of strided shards is left to
  // dtensor_boxes, which names the mesh dim.
  Status parse_spec(const json& s, uint32_t ti, Side side, const std::string& path) {
    if (!s.is_object()) return fail(path, "must be a DTensor spec object, got " + show(s));
    REFIT_RETURN_IF_ERROR(check_keys(s, path, {"mesh", "ranks", "placements"}));
    DTensorSpec spec;
    auto mesh = field(s, "mesh", path);
    if (!mesh) return mesh.status();
    if (!(*mesh)->is_array() || (*mesh)->empty())
      return fail(path + ".mesh", "must be a non-empty list of positive integers, got " + show(**mesh));
    int64_t mesh_size = 1;
    for (size_t m = 0; m < (*mesh)->size(); ++m) {
      int64_t n;
      if (!get_int((**mesh)[m], 1, INT32_MAX, &n))
        return fail(path + ".mesh[" + std::to_string(m) + "]",
                    "must be a positive integer, got " + show((**mesh)[m]));
      spec.mesh.push_back(n);
      mesh_size *= n;
      if (mesh_size > (int64_t{1} << 24)) return fail(path + ".mesh", "the mesh has more than 2^24 ranks");
    }
    auto ranks = field(s, "ranks", path);
    if (!ranks) return ranks.status();
    if (!(*ranks)->is_array())
      return fail(path + ".ranks", "must be a list of " + std::string(side_name(side)) + " ranks, got " +
                                                show(**ranks));
    if (static_cast<int64_t>((*ranks)->size()) != mesh_size)
      return fail(path + ".ranks", "lists " + std::to_string((*ranks)->size()) + " ranks for a mesh of " +
                                                std::to_string(mesh_size));
    const int32_t nranks = L_.num_ranks(side);
    std::unordered_map<int32_t, size_t> seen;
    for (size_t j = 0; j < (*ranks)->size(); ++j) {
      const json& r = (**ranks)[j];
      const std::string p = path + ".ranks[" + std::to_string(j) + "]";
      int64_t rank;
      if (!get_int(r, INT64_MIN, INT64_MAX, &rank)) return fail(p, "must be an integer, got " + show(r));
      if (rank < 0 || rank >= nranks)
        return fail(p, std::string(side_name(side)) + " rank " + std::to_string(rank) +
                           " is out of range: the layout has " + std::to_string(nranks) + " " + side_name(side) +
                           " ranks");
      auto [it, fresh] = seen.emplace(static_cast<int32_t>(rank), j);
      if (!fresh)
        return fail(p, std::string(side_name(side)) + " rank " + std::to_string(rank) + " is repeated (also at ranks[" +
                           std::to_string(it->second) + "])");
      spec.ranks.push_back(static_cast<int32_t>(rank));
    }
    auto pl = field(s, "placements", path);
    if (!pl) return pl.status();
    if (!(*pl)->is_array())
      return fail(path + ".placements", "must be a list of placements, got " + show(**pl));
    if ((*pl)->size() != spec.mesh.size())
      return fail(path + ".placements", "has " + std::to_string((*pl)->size()) +
                                                     " entries; it needs one per mesh dim (" +
                                                     std::to_string(spec.mesh.size()) + ")");
    const int ndim = static_cast<int>(L_.tensors[ti].shape.size());
    for (size_t m = 0; m < (*pl)->size(); ++m) {
      const json& v = (**pl)[m];
      const std::string p = path + ".placements[" + std::to_string(m) + "]";
      if (!v.is_string()) return fail(p, "must be a string such as \"R\", \"S(0)\" or \"SS(0,2)\", got " + show(v));
      auto placement = parse_placement(v.get_ref<const std::string&>());
      if (!placement) return fail(p, placement.status().message());
      if (placement->kind != Placement::Kind::kReplicate && placement->dim >= ndim)
        return fail(p, "placement " + placement->to_string() + " shards dim " + std::to_string(placement->dim) +
                           " of a " + std::to_string(ndim) + "-dim tensor");
      spec.placements.push_back(*placement);
    }
    Status st = add_dtensor(L_, ti, side, spec, L_.tensors[ti].name);
    if (!st) return fail(path, st.message());
    return Status::ok();
  }

  Status parse_buffer(const json& b, size_t i) {
    const std::string path = "buffers[" + std::to_string(i) + "]";
    if (!b.is_object()) return fail(path, "must be an object, got " + show(b));
    REFIT_RETURN_IF_ERROR(check_keys(b, path, {"side", "rank", "name", "dtype", "bytes", "segments"}));
    Group g;
    auto side = field(b, "side", path);
    if (!side) return side.status();
    if (**side == "source") {
      g.side = Side::kSource;
    } else if (**side == "receiver") {
      g.side = Side::kReceiver;
    } else {
      return fail(path + ".side", "must be \"source\" or \"receiver\", got " + show(**side));
    }
    int64_t rank;
    REFIT_RETURN_IF_ERROR(int_field(b, "rank", path, INT64_MIN, INT64_MAX, "an integer", &rank));
    REFIT_RETURN_IF_ERROR(buffer_rank(g.side, rank, path));
    REFIT_RETURN_IF_ERROR(name_field(b, path, &g.name));
    Context ctx(this, buffer_context(g.side, rank, g.name));
    REFIT_RETURN_IF_ERROR(dtype_field(b, path, &g.dtype));
    REFIT_RETURN_IF_ERROR(int_field(b, "bytes", path, 0, INT64_MAX, "a non-negative integer", &g.bytes));
    REFIT_RETURN_IF_ERROR(buffer_head(g, rank, i, path));
    auto segs = list(b, "segments", true, path);
    if (!segs) return segs.status();
    g.segments.reserve((*segs)->size());
    for (size_t j = 0; j < (*segs)->size(); ++j) {
      Segment seg;
      REFIT_RETURN_IF_ERROR(
          parse_segment((**segs)[j], path + ".segments[" + std::to_string(j) + "]", g.side, g.dtype, g.bytes, &seg));
      g.segments.push_back(seg);
    }
    add_to_group(std::move(g), static_cast<int32_t>(rank));
    return Status::ok();
  }

 public:
  // The same as parse_buffer, from values instead of a JSON object: the
  // same checks of what a value may hold, with the same messages (a value
  // in a message is shown as JSON), without making or reading a DOM.
  Status view_buffer(const LayoutBuilder::BufferView& b, size_t i) {
    std::string path = "buffers[" + std::to_string(i) + "]";
    Group g;
    g.side = b.side;
    REFIT_RETURN_IF_ERROR(buffer_rank(g.side, b.rank, path));
    if (b.name.empty()) return fail(path + ".name", "must be a non-empty string, got \"\"");
    g.name = std::string(b.name);
    Context ctx(this, buffer_context(g.side, b.rank, g.name));
    const std::optional<DType> dtype = parse_dtype(b.dtype);
    if (!dtype) return fail(path + ".dtype", kDtypeChoices + show(json(b.dtype)));
    g.dtype = *dtype;
    if (b.bytes < 0) return fail(path + ".bytes", "must be a non-negative integer, got " + std::to_string(b.bytes));
    g.bytes = b.bytes;
    REFIT_RETURN_IF_ERROR(buffer_head(g, b.rank, i, path));
    g.segments.reserve(b.segments.size());
    const size_t base = path.size();
    for (size_t j = 0; j < b.segments.size(); ++j) {
      const LayoutBuilder::SegmentView& v = b.segments[j];
      path.resize(base);
      path += ".segments[";
      path += std::to_string(j);
      path += ']';
      auto it = tensor_index_.find(v.tensor);
      if (it == tensor_index_.end()) return fail(path + ".tensor", "unknown tensor " + show(json(v.tensor)));
      SegmentTensor in_tensor(this, &L_.tensors[it->second].name);
      DType seg_dtype = g.dtype;
      const bool own_dtype = !v.dtype.empty();
      if (own_dtype) {
        const std::optional<DType> d = parse_dtype(v.dtype);
        if (!d) return fail(path + ".dtype", kDtypeChoices + show(json(v.dtype)));
        seg_dtype = *d;
      }
      Segment seg;
      REFIT_RETURN_IF_ERROR(segment_dtype(it->second, g.side, seg_dtype, own_dtype, path, &seg));
      const int nd = static_cast<int>(L_.tensors[it->second].shape.size());
      REFIT_RETURN_IF_ERROR(view_list(v.start, path, "start", nd, 0, "non-negative integers"));
      REFIT_RETURN_IF_ERROR(view_list(v.size, path, "size", nd, 1, "positive integers"));
      REFIT_RETURN_IF_ERROR(view_list(v.strides, path, "strides", nd, 0, "non-negative integers"));
      if (v.offset < 0) return fail(path + ".offset", "must be a non-negative integer, got " + std::to_string(v.offset));
      REFIT_RETURN_IF_ERROR(segment(it->second, seg_dtype, v.start, v.size, v.strides, v.offset, g.bytes, path, &seg));
      g.segments.push_back(seg);
    }
    add_to_group(std::move(g), static_cast<int32_t>(b.rank));
    return Status::ok();
  }

 private:
  static constexpr const char* kDtypeChoices = "must be one of BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8 U8 I16 I32 I64 BOOL, got ";

  // int_list's checks of a list given as values.
  Status view_list(std::span<const int64_t> v, const std::string& path, const char* key, int n, int64_t lo,
                   const char* what) const {
    bool ok = v.size() == static_cast<size_t>(n);
    for (int64_t x : v) ok = ok && x >= lo;
    if (ok) return Status::ok();
    const json shown(std::vector<int64_t>(v.begin(), v.end()));
    if (v.size() != static_cast<size_t>(n))
      return fail(join(path, key), "must list " + std::to_string(n) + " " + what + " (one per tensor dim), got " +
                                       show(shown));
    return fail(join(path, key), std::string("must be a list of ") + what + ", got " + show(shown));
  }

  Status buffer_rank(Side side, int64_t rank, const std::string& path) const {
    const int32_t nranks = L_.num_ranks(side);
    if (rank < 0 || rank >= nranks)
      return fail(path + ".rank", std::string(side_name(side)) + " rank " + std::to_string(rank) +
                                      " is out of range: the layout has " + std::to_string(nranks) + " " +
                                      side_name(side) + " ranks");
    return Status::ok();
  }

  static std::string buffer_context(Side side, int64_t rank, const std::string& name) {
    return " (" + std::string(side_name(side)) + " rank " + std::to_string(rank) + " buffer \"" + name + "\")";
  }

  // A buffer's checks before its segments: whole elements, and one name
  // per rank and side.
  Status buffer_head(const Group& g, int64_t rank, size_t i, const std::string& path) {
    const int elem = dtype_bytes(g.dtype);
    if (g.bytes % elem != 0)
      return fail(path + ".bytes", std::to_string(g.bytes) + " is not a whole number of " +
                                       std::string(dtype_name(g.dtype)) + " elements");

    // One name per rank and side: against other explicit buffers, and
    // against the buffers DTensor specs named after their tensors (all
    // regions present so far came from specs).
    std::string key;
    key.reserve(g.name.size() + 8);
    key += static_cast<char>(g.side);
    key.append(reinterpret_cast<const char*>(&rank), sizeof(rank));
    key += g.name;
    if (auto [it, fresh] = names_.emplace(std::move(key), i); !fresh)
      return fail(path, std::string(side_name(g.side)) + " rank " + std::to_string(rank) + " already has a buffer \"" +
                            g.name + "\" (buffers[" + std::to_string(it->second) + "])");
    if (auto t = tensor_index_.find(g.name); t != tensor_index_.end()) {
      for (const Region& r : L_.regions(t->second, g.side)) {
        const auto& rs = L_.sets(g.side).get(r.ranks);
        if (L_.buffers[L_.tensors[t->second].buffer_of(g.side, r)].name == g.name && std::binary_search(rs.begin(), rs.end(), rank))
          return fail(path, std::string(side_name(g.side)) + " rank " + std::to_string(rank) +
                                " already has a buffer \"" + g.name + "\" from the " + side_name(g.side) +
                                " spec of tensor \"" + g.name + "\"");
      }
    }
    return Status::ok();
  }

  // What a segment of `dtype` on `side` says of tensor `t`. A receiver
  // segment may hold the tensor in another dtype than its sources: the
  // tensor is converted on the way (planner/conversion.h), and all its
  // receivers hold that dtype. A source segment in another dtype than the
  // tensor's is a copy its source converted ("quantize": "source",
  // docs/conversion.md): kept apart from the sources (out->converted),
  // resolve_conversions decides its use.
  // The receivers' dtype is their first segment's: a later one in another
  // dtype is refused whichever comes first, the sources' dtype or not (a
  // buffer in the sources' dtype beside one converted would otherwise be
  // handed the converted bytes).
  Status segment_dtype(uint32_t tensor, Side side, DType dtype, bool own_dtype, const std::string& path,
                       Segment* out) {
    Tensor& t = L_.tensors[tensor];
    if (side == Side::kReceiver) {
      const auto [seen, first] = receiver_dtypes_.try_emplace(tensor, dtype);
      if (!first && seen->second != dtype)
        return fail(path, "the tensor is " + std::string(dtype_name(seen->second)) + " in another receiver " +
                              (own_dtype ? "segment" : "buffer") + " but this " + (own_dtype ? "segment" : "buffer") +
                              " is " + std::string(dtype_name(dtype)) + "; all of a tensor's " +
                              (own_dtype ? "segments" : "buffers") + " on one side hold one dtype");
      if (first && t.dtype != dtype && !t.receiver_dtype && t.receivers.empty()) t.receiver_dtype = dtype;
    }
    out->converted = side == Side::kSource && dtype != t.dtype && conversion_for(t.name, t.dtype, dtype).is_ok();
    if (out->converted && t.converted_dtype && *t.converted_dtype != dtype)
      return fail(path, "the sources' converted copies of the tensor are " +
                            std::string(dtype_name(*t.converted_dtype)) + " and " + std::string(dtype_name(dtype)) +
                            "; all of them hold one dtype");
    if (out->converted) t.converted_dtype = dtype;
    if (!out->converted && t.dtype_on(side) != dtype)
      return fail(path, "the tensor is " + std::string(dtype_name(t.dtype_on(side))) + " on the " + side_name(side) +
                             " side but the " + (own_dtype ? "segment" : "buffer") + " is " +
                             std::string(dtype_name(dtype)) + "; all of a tensor's " + (own_dtype ? "segments" : "buffers") +
                             " on one side hold one dtype");
    return Status::ok();
  }

  // A buffer is bytes: a segment's "dtype" (the buffer's when left out) is
  // its tensor's, and its offset and strides count elements of it.
  Status parse_segment(const json& s, const std::string& path, Side side, DType buffer_dtype, int64_t bytes,
                       Segment* out) {
    if (!s.is_object()) return fail(path, "must be an object, got " + show(s));
    auto name = field(s, "tensor", path);
    if (!name) return name.status();
    if (!(*name)->is_string()) return fail(path + ".tensor", "must be a tensor name, got " + show(**name));
    auto it = tensor_index_.find((*name)->get_ref<const std::string&>());
    if (it == tensor_index_.end()) return fail(path + ".tensor", "unknown tensor " + show(**name));
    const Tensor& t = L_.tensors[it->second];
    SegmentTensor in_tensor(this, &t.name);
    REFIT_RETURN_IF_ERROR(check_keys(s, path, {"tensor", "dtype", "start", "size", "offset", "strides"}));
    DType dtype = buffer_dtype;
    const bool own_dtype = s.contains("dtype");
    if (own_dtype) REFIT_RETURN_IF_ERROR(dtype_field(s, path, &dtype));
    REFIT_RETURN_IF_ERROR(segment_dtype(it->second, side, dtype, own_dtype, path, out));
    const int nd = static_cast<int>(t.shape.size());
    std::vector<int64_t> start, size, strides;
    REFIT_RETURN_IF_ERROR(int_list(s, "start", path, nd, 0, "non-negative integers", &start));
    REFIT_RETURN_IF_ERROR(int_list(s, "size", path, nd, 1, "positive integers", &size));
    REFIT_RETURN_IF_ERROR(int_list(s, "strides", path, nd, 0, "non-negative integers", &strides));
    int64_t offset;
    REFIT_RETURN_IF_ERROR(int_field(s, "offset", path, 0, INT64_MAX, "a non-negative integer", &offset));
    return segment(it->second, dtype, start, size, strides, offset, bytes, path, out);
  }

  // What a segment's values say, once each is known to be of its kind and
  // its dtype was checked (segment_dtype): `start`, `size` and `strides`
  // have one entry per dim of the tensor.
  Status segment(uint32_t tensor, DType dtype, std::span<const int64_t> start, std::span<const int64_t> size,
                 std::span<const int64_t> strides, int64_t offset, int64_t bytes, const std::string& path,
                 Segment* out) {
    const Tensor& t = L_.tensors[tensor];
    const int64_t elems = bytes / dtype_bytes(dtype);
    const int nd = static_cast<int>(t.shape.size());
    out->tensor = tensor;
    out->box.ndim = nd;
    out->offset = offset;
    for (int d = 0; d < nd; ++d) {
      out->box.start[d] = start[d];
      out->box.size[d] = size[d];
      out->strides[d] = strides[d];
      if (start[d] > t.shape[d] || size[d] > t.shape[d] - start[d]) {
        Box shown = out->box;
        for (int e = d + 1; e < nd; ++e) shown.start[e] = start[e], shown.size[e] = size[e];
        return fail(path, "box " + show_box(shown) + " is outside the shape " + show_shape(t.shape));
      }
    }
    // The last element: offset + sum((size-1)*stride) must fit the buffer.
    // Every term is bounded by the shape and the stride, so compute with
    // overflow checks rather than trust them.
    int64_t last = offset;
    bool overflow = false;
    for (int d = 0; d < nd; ++d) {
      int64_t span;
      overflow |= __builtin_mul_overflow(size[d] - 1, strides[d], &span);
      overflow |= __builtin_add_overflow(last, span, &last);
    }
    if (overflow || last >= elems)
      return fail(path, "box " + show_box(out->box) + " at element offset " + std::to_string(offset) +
                             " with strides " + show_shape(strides) + " reaches past the end of the buffer (" +
                             std::to_string(elems) + " elements)");
    // Strides must not map two elements of the box to one place: ordered by
    // stride, each must step over everything the smaller ones span. This is
    // sufficient and holds for every row-major or transposed layout.
    std::array<int, kMaxDims> dims{};
    int n = 0;
    for (int d = 0; d < nd; ++d)
      if (size[d] > 1) dims[n++] = d;
    for (int k = 1; k < n; ++k)  // by stride (at most kMaxDims of them)
      for (int m = k; m > 0 && strides[dims[m]] < strides[dims[m - 1]]; --m) std::swap(dims[m], dims[m - 1]);
    int64_t reach = 0;  // elements spanned by the dims so far, minus one
    for (int k = 0; k < n; ++k) {
      const int d = dims[k];
      if (strides[d] <= reach)
        return fail(path, "strides " + show_shape(strides) + " map two elements of box " + show_box(out->box) +
                               " to the same place");
      reach += (size[d] - 1) * strides[d];
    }
    return Status::ok();
  }

  void add_to_group(Group g, int32_t rank) {
    std::string key;
    auto put = [&key](const void* p, size_t n) { key.append(static_cast<const char*>(p), n); };
    key += static_cast<char>(g.side);
    key += static_cast<char>(g.dtype);
    put(&g.bytes, sizeof g.bytes);
    const uint64_t name_len = g.name.size();
    put(&name_len, sizeof name_len);
    key += g.name;
    for (const Segment& s : g.segments) {
      put(&s.tensor, sizeof s.tensor);
      put(&s.offset, sizeof s.offset);
      key += static_cast<char>(s.converted);
      const int nd = s.box.ndim;
      put(s.box.start.data(), nd * sizeof(int64_t));
      put(s.box.size.data(), nd * sizeof(int64_t));
      put(s.strides.data(), nd * sizeof(int64_t));
    }
    auto [it, fresh] = group_index_.emplace(std::move(key), groups_.size());
    if (fresh) groups_.push_back(std::move(g));
    groups_[it->second].ranks.push_back(rank);
  }

  void build_groups() {
    for (Group& g : groups_) {
      std::sort(g.ranks.begin(), g.ranks.end());  // no repeats: names_ refused them
      const RankSetId set = L_.sets(g.side).intern(g.ranks);
      const uint32_t bi = L_.add_buffer(Buffer{g.side, g.name, g.dtype, g.bytes, set});
      for (const Segment& s : g.segments) {
        Region r;
        r.box = s.box;
        r.ranks = set;
        r.buffer = bi;
        r.offset = s.offset;
        r.strides = s.strides;
        if (s.converted) {
          L_.tensors[s.tensor].converted_sources.push_back(r);  // buffer index absolute: the list has no base
          continue;
        }
        L_.regions(s.tensor, g.side).push_back(r);
      }
    }
  }

  // Sets the context of messages for the life of one tensor or buffer.
  class Context {
   public:
    Context(Parser* p, std::string c) : p_(p), saved_(std::move(p->context_)) { p->context_ = std::move(c); }
    ~Context() { p_->context_ = std::move(saved_); }
    Context(const Context&) = delete;
    Context& operator=(const Context&) = delete;

   private:
    Parser* p_;
    std::string saved_;
  };

  // Names segment_tensor_ while a segment of it is read (messages name it
  // after the buffer; made only for a message).
  class SegmentTensor {
   public:
    SegmentTensor(Parser* p, const std::string* name) : p_(p) { p->segment_tensor_ = name; }
    ~SegmentTensor() { p_->segment_tensor_ = nullptr; }
    SegmentTensor(const SegmentTensor&) = delete;
    SegmentTensor& operator=(const SegmentTensor&) = delete;

   private:
    Parser* p_;
  };

  const std::string& origin_;
  std::string context_;
  const std::string* segment_tensor_ = nullptr;
  std::array<int64_t, 2> view_block_{};  // HeadView::weight_block_size, until finish_view()
  size_t buffers_read_ = 0;
  Layout L_;
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, uint32_t, NameHash, std::equal_to<>> tensor_index_;
  std::unordered_map<uint32_t, DType> receiver_dtypes_;  // tensor -> its first receiver segment's dtype
  std::unordered_map<std::string, size_t> names_;  // (side, rank, name) -> buffers[i]
  std::unordered_map<std::string, size_t> group_index_;
  std::vector<Group> groups_;
};

// Reads a document as it is parsed: its top-level "buffers" are handed to
// the parser one element at a time and dropped, so that only the rest of
// the document (ranks and tensors) is ever held as a DOM. A layout of a
// thousand ranks lists millions of buffers: as one DOM they took seven
// times the text's size (13.3 GB for a document of 1.8 GB).
class StreamingReader : public nlohmann::json_sax<json> {
 public:
  StreamingReader(Parser& parser, const std::string& origin) : parser_(parser), origin_(origin) {}

  Result<Layout> read(std::string_view text) {
    const bool parsed = json::sax_parse(text, this);
    if (!status_.is_ok()) return status_;
    if (!parsed) return Status::invalid(origin_ + ": not valid JSON: " + syntax_);
    REFIT_RETURN_IF_ERROR(head_now());
    return parser_.finish(head_);
  }

  bool null() override { return add(json(nullptr), false); }
  bool boolean(bool v) override { return add(json(v), false); }
  bool number_integer(number_integer_t v) override { return add(json(v), false); }
  bool number_unsigned(number_unsigned_t v) override { return add(json(v), false); }
  bool number_float(number_float_t v, const string_t&) override { return add(json(v), false); }
  bool string(string_t& v) override { return add(json(std::move(v)), false); }
  bool binary(binary_t& v) override { return add(json::binary(std::move(v)), false); }
  bool start_object(std::size_t) override { return add(json::object(), true); }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_array(std::size_t) override {
    // The top-level "buffers": its elements go to the parser one by one.
    if (stack_.size() == 1 && !in_buffers_ && head_.is_object() && key_ == "buffers") {
      if (buffers_seen_) return refuse(origin_ + ": key \"buffers\" is given twice");
      in_buffers_ = buffers_seen_ = true;
      return true;
    }
    return add(json::array(), true);
  }
  bool end_object() override { return close(); }
  bool end_array() override {
    if (in_buffers_ && stack_.size() == 1) {
      in_buffers_ = false;
      return true;
    }
    return close();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    syntax_ = json_util::describe(ex);
    return false;
  }

 private:
  // A value at the current place: the document itself, a member or element
  // of the open container, or an element of "buffers" (its own DOM).
  bool add(json&& v, bool container) {
    if (in_buffers_ && stack_.size() == 1) {
      if (!container) return element(std::move(v));
      element_ = std::move(v);
      stack_.push_back(&element_);
      return true;
    }
    json* slot = nullptr;
    if (stack_.empty()) {
      head_ = std::move(v);
      slot = &head_;
    } else if (json& parent = *stack_.back(); parent.is_object()) {
      slot = &(parent[key_] = std::move(v));
    } else {
      parent.push_back(std::move(v));
      slot = &parent.back();
    }
    if (container) stack_.push_back(slot);
    return true;
  }

  bool close() {
    stack_.pop_back();
    if (in_buffers_ && stack_.size() == 1) return element(std::move(element_));
    return true;
  }

  // One element of "buffers": parsed once the ranks and tensors are read,
  // kept until then (a document may list its buffers first).
  bool element(json&& b) {
    if (!head_read_ && !(head_.contains("format") && head_.contains("sources") && head_.contains("receivers") &&
                         head_.contains("tensors"))) {
      waiting_.push_back(std::move(b));
      return true;
    }
    if (Status st = head_now(); !st.is_ok()) return refuse(std::move(st));
    if (Status st = parser_.buffer(b); !st.is_ok()) return refuse(std::move(st));
    return true;
  }

  // The head, once, then the buffers that came before it.
  Status head_now() {
    if (head_read_) return Status::ok();
    head_read_ = true;
    REFIT_RETURN_IF_ERROR(parser_.head(head_));
    for (const json& b : waiting_) REFIT_RETURN_IF_ERROR(parser_.buffer(b));
    waiting_.clear();
    return Status::ok();
  }

  bool refuse(Status st) {
    status_ = std::move(st);
    return false;
  }
  bool refuse(std::string message) { return refuse(Status::invalid(std::move(message))); }

  Parser& parser_;
  const std::string& origin_;
  json head_;                  // the document without its buffers
  std::vector<json*> stack_;   // the containers open, in head_ or element_
  std::string key_;            // the key of the next member
  bool in_buffers_ = false;    // inside the top-level "buffers" list
  bool buffers_seen_ = false;
  json element_;               // the element of "buffers" being read
  std::vector<json> waiting_;  // elements read before the head could be
  bool head_read_ = false;
  Status status_;              // why the parser stopped reading
  std::string syntax_;         // why the text is not JSON
};

// ---------------------------------------------------------------- writing

// Appends JSON text to a string; numbers through std::to_chars. With a sink,
// hands the text on in pieces of about kFlushBytes, so that a plan of
// hundreds of millions of runs never sits in memory as one string.
class Writer {
 public:
  static constexpr size_t kFlushBytes = size_t{1} << 20;

  explicit Writer(const TextSink* sink = nullptr) : sink_(sink) {
    if (sink_) out.reserve(kFlushBytes + 4096);
  }

  std::string out;

  // Called between entries: passes the text on when enough has gathered.
  void entry_done() {
    if (sink_ && out.size() >= kFlushBytes) flush();
  }
  // Passes the rest on; false once the sink has refused any piece.
  bool finish() {
    if (sink_) flush();
    return ok_;
  }

  Writer& raw(std::string_view s) {
    out.append(s);
    return *this;
  }
  Writer& num(int64_t v) {
    char buf[24];
    auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
    out.append(buf, p);
    return *this;
  }
  Writer& str(std::string_view s) {
    out.push_back('"');
    out.append(escaped(s));
    out.push_back('"');
    return *this;
  }
  Writer& list(const int64_t* v, int n) {
    out.push_back('[');
    for (int i = 0; i < n; ++i) {
      if (i) out.append(", ");
      num(v[i]);
    }
    out.push_back(']');
    return *this;
  }

  static std::string escaped(std::string_view s);

 private:
  void flush() {
    if (ok_ && !out.empty()) ok_ = (*sink_)(out);
    out.clear();
  }
  const TextSink* sink_;
  bool ok_ = true;
};

std::string Writer::escaped(std::string_view s) {
    std::string e;
    e.reserve(s.size());
    for (char c : s) {
      switch (c) {
        case '"': e += "\\\""; break;
        case '\\': e += "\\\\"; break;
        case '\n': e += "\\n"; break;
        case '\t': e += "\\t"; break;
        case '\r': e += "\\r"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            static const char kHex[] = "0123456789abcdef";
            e += "\\u00";
            e += kHex[(c >> 4) & 0xf];
            e += kHex[c & 0xf];
          } else {
            e += c;
          }
      }
    }
    return e;
}

void write_layout(const Layout& L, Writer& w) {
  w.raw("{\"format\": ").str(kLayoutFormat);
  if (has_conversions(L))
    w.raw(",\n \"weight_block_size\": ").list(L.weight_block_size.data(), 2);
  w.raw(",\n \"sources\": [");
  for (size_t i = 0; i < L.sources.size(); ++i) {
    w.raw(i ? ",\n  " : "\n  ").raw("{\"rank\": ").num(static_cast<int64_t>(i));
    w.raw(", \"domain\": ").num(L.sources[i].domain).raw("}");
  }
  w.raw("],\n \"receivers\": [");
  for (size_t i = 0; i < L.receivers.size(); ++i) {
    w.raw(i ? ",\n  " : "\n  ").raw("{\"rank\": ").num(static_cast<int64_t>(i));
    w.raw(", \"domain\": ").num(L.receivers[i].domain);
    w.raw(", \"instance\": ").num(L.receivers[i].instance).raw("}");
  }
  w.raw("],\n \"tensors\": [");
  for (size_t i = 0; i < L.tensors.size(); ++i) {
    const Tensor& t = L.tensors[i];
    w.raw(i ? ",\n  " : "\n  ").raw("{\"name\": ").str(t.name);
    w.raw(", \"dtype\": ").str(dtype_name(t.dtype));
    w.raw(", \"shape\": ").list(t.shape.data(), static_cast<int>(t.shape.size())).raw("}");
    w.entry_done();
  }
  w.raw("],\n \"buffers\": [");

  // The regions of each buffer, in tensor order, sources then receivers.
  struct Use {
    uint32_t tensor;
    const Region* region;
  };
  std::vector<std::vector<Use>> uses(L.buffers.size());
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    for (Side side : {Side::kSource, Side::kReceiver}) {
      for (const Region& r : L.regions(ti, side))
        if (L.tensors[ti].buffer_of(side, r) < uses.size()) uses[L.tensors[ti].buffer_of(side, r)].push_back({ti, &r});
    }
  }
  bool first = true;
  for (size_t bi = 0; bi < L.buffers.size(); ++bi) {
    const Buffer& b = L.buffers[bi];
    const RankSets& sets = L.sets(b.side);
    if (b.ranks >= sets.size()) continue;
    const std::string name = Writer::escaped(b.name);
    for (int32_t rank : sets.get(b.ranks)) {
      w.raw(first ? "\n  " : ",\n  ");
      first = false;
      w.raw("{\"side\": \"").raw(side_name(b.side)).raw("\", \"rank\": ").num(rank);
      w.raw(", \"name\": \"").raw(name).raw("\", \"dtype\": ").str(dtype_name(b.dtype));
      w.raw(", \"bytes\": ").num(b.bytes).raw(", \"segments\": [");
      bool first_seg = true;
      for (const Use& u : uses[bi]) {
        if (u.region->ranks != b.ranks) {
          const auto& rs = sets.get(u.region->ranks);
          if (!std::binary_search(rs.begin(), rs.end(), rank)) continue;
        }
        const Region& r = *u.region;
        w.raw(first_seg ? "\n    " : ",\n    ");
        first_seg = false;
        w.raw("{\"tensor\": ").str(L.tensors[u.tensor].name);
        w.raw(", \"start\": ").list(r.box.start.data(), r.box.ndim);
        w.raw(", \"size\": ").list(r.box.size.data(), r.box.ndim);
        w.raw(", \"offset\": ").num(r.offset);
        const DType dt = L.tensors[u.tensor].dtype_on(b.side);
        if (dt != b.dtype) w.raw(", \"dtype\": ").str(dtype_name(dt));
        w.raw(", \"strides\": ").list(r.strides.data(), r.box.ndim).raw("}");
      }
      w.raw("]}");
      w.entry_done();
    }
  }
  w.raw("]}\n");
}

void write_runs(const Plan& plan, Writer& w) {
  const Layout& L = plan.layout();
  std::vector<std::string> names(L.buffers.size());
  for (size_t i = 0; i < names.size(); ++i) names[i] = Writer::escaped(L.buffers[i].name);
  w.raw("{\"format\": ").str(kRunsFormat).raw(",\n \"runs\": [");
  bool first = true;
  for_each_run(plan, [&](const Run& run) {
    w.raw(first ? "\n  " : ",\n  ");
    first = false;
    w.raw(run.local ? "{\"kind\": \"local\"" : "{\"kind\": \"net\"");
    w.raw(", \"from\": {\"side\": \"").raw(side_name(run.from.side)).raw("\", \"rank\": ").num(run.from.rank);
    w.raw(", \"buffer\": \"").raw(names[run.from.buffer]).raw("\", \"offset\": ").num(run.from.offset);
    w.raw("}, \"to\": {\"rank\": ").num(run.to.rank);
    w.raw(", \"buffer\": \"").raw(names[run.to.buffer]).raw("\", \"offset\": ").num(run.to.offset);
    w.raw("}, \"bytes\": ").num(run.bytes).raw("}");
    w.entry_done();
  });
  w.raw("]}\n");
}

}  // namespace

Result<Layout> parse_layout_json(std::string_view text, const std::string& origin) {
  Parser parser(origin);
  return StreamingReader(parser, origin).read(text);
}

struct LayoutBuilder::Impl {
  explicit Impl(std::string o) : origin(std::move(o)), parser(origin) {}
  // `st`, remembered when it failed.
  Status keep(Status st) {
    if (!st.is_ok()) failed = st;
    return st;
  }
  std::string origin;
  Parser parser;
  Status failed;  // the first failure; every later call returns it
  bool head_read = false, finished = false;
  bool head_view = false;  // the head came as values: finish() without a document
};

LayoutBuilder::LayoutBuilder(std::string origin) : impl_(std::make_unique<Impl>(std::move(origin))) {}
LayoutBuilder::~LayoutBuilder() = default;

Status LayoutBuilder::head(const nlohmann::json& doc) {
  if (!impl_->failed.is_ok()) return impl_->failed;
  if (impl_->head_read) return impl_->keep(Status::internal(impl_->origin + ": the layout's head was given twice"));
  if (doc.is_object() && doc.contains("buffers"))
    return impl_->keep(Status::internal(impl_->origin + ": the layout's head holds \"buffers\"; hand each to buffer()"));
  impl_->head_read = true;
  return impl_->keep(impl_->parser.head(doc));
}

Status LayoutBuilder::buffer(const nlohmann::json& b) {
  if (!impl_->failed.is_ok()) return impl_->failed;
  if (!impl_->head_read || impl_->finished)
    return impl_->keep(Status::internal(impl_->origin + ": a buffer was given outside head() and finish()"));
  return impl_->keep(impl_->parser.buffer(b));
}

Status LayoutBuilder::head(const HeadView& h) {
  if (!impl_->failed.is_ok()) return impl_->failed;
  if (impl_->head_read) return impl_->keep(Status::internal(impl_->origin + ": the layout's head was given twice"));
  impl_->head_read = true;
  impl_->head_view = true;
  return impl_->keep(impl_->parser.view(h));
}

Result<Layout> LayoutBuilder::finish() {
  if (!impl_->failed.is_ok()) return impl_->failed;
  if (!impl_->head_read || impl_->finished || !impl_->head_view)
    return impl_->keep(Status::internal(impl_->origin + ": finish() without head(HeadView), or twice"));
  impl_->finished = true;
  Result<Layout> layout = impl_->parser.finish_view();
  if (!layout.is_ok()) impl_->keep(layout.status());
  return layout;
}

Status LayoutBuilder::buffer(const BufferView& b) {
  if (!impl_->failed.is_ok()) return impl_->failed;
  if (!impl_->head_read || impl_->finished)
    return impl_->keep(Status::internal(impl_->origin + ": a buffer was given outside head() and finish()"));
  return impl_->keep(impl_->parser.view(b));
}

Result<Layout> LayoutBuilder::finish(const nlohmann::json& doc) {
  if (!impl_->failed.is_ok()) return impl_->failed;
  if (!impl_->head_read || impl_->finished || impl_->head_view)
    return impl_->keep(Status::internal(impl_->origin + ": finish(doc) without head(doc), or twice"));
  impl_->finished = true;
  Result<Layout> layout = impl_->parser.finish(doc);
  if (!layout.is_ok()) impl_->keep(layout.status());
  return layout;
}

std::string write_layout_json(const Layout& layout) {
  Writer w;
  write_layout(layout, w);
  return std::move(w.out);
}

bool write_layout_json(const Layout& layout, const TextSink& sink) {
  Writer w(&sink);
  write_layout(layout, w);
  return w.finish();
}

std::string write_runs_json(const Plan& plan) {
  Writer w;
  write_runs(plan, w);
  return std::move(w.out);
}

bool write_runs_json(const Plan& plan, const TextSink& sink) {
  Writer w(&sink);
  write_runs(plan, w);
  return w.finish();
}

}  // namespace refit
