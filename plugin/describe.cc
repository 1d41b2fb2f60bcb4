#include "plugin/describe.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "planner/dtype.h"
#include "planner/manifest.h"
#include "planner/placement.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "plugin/json_reader.h"

namespace refit::plugin {
namespace {

constexpr size_t kMaxDims = 8;

std::vector<int64_t> row_major(const std::vector<int64_t>& size) {
  std::vector<int64_t> strides(size.size(), 1);
  for (size_t d = size.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(size[d], 1);
  return strides;
}

std::string read_dtype(JsonReader& r, const Json& obj, const std::string& path) {
  const std::string name = r.string(obj, path, "dtype", std::nullopt);
  if (r.ok() && !parse_dtype(name)) {
    r.fail(JsonReader::join(path, "dtype"),
           "must be one of BF16 F16 F32 F64 F8_E4M3 F8_E5M2 I8 U8 I16 I32 I64 BOOL, got \"" + name + "\"");
  }
  return name;
}

// Reads one segment; `tensor` is set from the description when the key is
// allowed (receivers), else from `fixed_tensor`.
control::Segment read_segment(JsonReader& r, const Json& s, const std::string& path, bool with_tensor,
                              const std::string& fixed_tensor) {
  control::Segment seg;
  if (with_tensor) {
    r.object(s, path, {"tensor", "dtype", "start", "size", "offset", "strides"});
    seg.tensor = r.string(s, path, "tensor", std::nullopt);
    if (r.ok() && s.contains("dtype")) seg.dtype = read_dtype(r, s, path);
  } else {
    r.object(s, path, {"start", "size", "offset", "strides"});
    seg.tensor = fixed_tensor;
  }
  seg.start = r.integers(s, path, "start", true, 0, kMaxDims);
  seg.size = r.integers(s, path, "size", true, 1, kMaxDims);
  seg.offset = r.integer(s, path, "offset", std::nullopt, 0);
  seg.strides = r.integers(s, path, "strides", false, 0, kMaxDims);
  if (!r.ok()) return seg;
  if (seg.start.size() != seg.size.size() || seg.start.empty()) {
    r.fail(path, "needs \"start\" and \"size\" of the same, non-zero length");
  } else if (seg.strides.empty()) {
    seg.strides = row_major(seg.size);
  } else if (seg.strides.size() != seg.size.size()) {
    r.fail(JsonReader::join(path, "strides"), "must have one entry per dim (" + std::to_string(seg.size.size()) + ")");
  }
  return seg;
}

Result<DTensorSpec> read_dtensor(JsonReader& r, const Json& d) {
  DTensorSpec spec;
  r.object(d, "dtensor", {"mesh", "ranks", "placements"});
  spec.mesh = r.integers(d, "dtensor", "mesh", true, 1, kMaxDims);
  for (int64_t rank : r.integers(d, "dtensor", "ranks", true, 0, size_t{1} << 20)) {
    spec.ranks.push_back(static_cast<int32_t>(std::min<int64_t>(rank, INT32_MAX)));
  }
  const std::vector<std::string> placements = r.strings(d, "dtensor", "placements", {});
  if (!r.ok()) return r.status();
  for (size_t i = 0; i < placements.size(); ++i) {
    Result<Placement> p = parse_placement(placements[i]);
    if (!p.is_ok()) {
      return p.status().with_context("\"dtensor.placements[" + std::to_string(i) + "]\"");
    }
    spec.placements.push_back(*p);
  }
  return spec;
}

// Expands a DTensor spec for one tensor on `side` and returns `rank`'s buffer.
Result<BufferPart> dtensor_part(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                                const DTensorSpec& spec, Side side, int32_t rank, const std::string& what) {
  if (std::find(spec.ranks.begin(), spec.ranks.end(), rank) == spec.ranks.end()) {
    return Status::invalid(what + ": this rank (" + std::to_string(rank) + ") is not in \"dtensor.ranks\"");
  }
  Layout scratch;
  const int32_t nranks = *std::max_element(spec.ranks.begin(), spec.ranks.end()) + 1;
  if (side == Side::kSource) scratch.sources.resize(nranks);
  else scratch.receivers.resize(nranks);
  const uint32_t t = scratch.add_tensor(name, dtype, shape);
  REFIT_RETURN_IF_ERROR(add_dtensor(scratch, t, side, spec, name).with_context(what));
  std::vector<BufferPart> parts = rank_buffers(scratch, side, rank);
  if (parts.empty()) {  // an empty shard: nothing to register
    return BufferPart{name, std::string(dtype_name(dtype)), 0, {}};
  }
  return parts.front();
}

}  // namespace

std::vector<BufferPart> rank_buffers(const Layout& layout, Side side, int32_t rank) {
  std::map<uint32_t, BufferPart> by_buffer;
  const RankSets& sets = layout.sets(side);
  for (const Tensor& t : layout.tensors) {
    for (const Region& region : layout.regions(static_cast<uint32_t>(&t - layout.tensors.data()), side)) {
      const std::vector<int32_t>& ranks = sets.get(region.ranks);
      if (!std::binary_search(ranks.begin(), ranks.end(), rank)) continue;
      const uint32_t bi = t.buffer_of(side, region);
      const Buffer& b = layout.buffers[bi];
      BufferPart& part = by_buffer[bi];
      if (part.name.empty()) {
        part.name = b.name;
        part.dtype = std::string(dtype_name(b.dtype));
        part.bytes = b.bytes;
      }
      control::Segment s;
      s.tensor = t.name;
      s.start.assign(region.box.start.begin(), region.box.start.begin() + region.box.ndim);
      s.size.assign(region.box.size.begin(), region.box.size.begin() + region.box.ndim);
      s.offset = region.offset;
      s.strides.assign(region.strides.begin(), region.strides.begin() + region.box.ndim);
      part.segments.push_back(std::move(s));
    }
  }
  std::vector<BufferPart> out;
  for (auto& [bi, part] : by_buffer) out.push_back(std::move(part));
  return out;
}

namespace {

// The bytes of one element of segment `s` of `part`; 0 for an unknown dtype.
int elem_bytes(const BufferPart& part, const control::Segment& s) {
  const std::optional<DType> dtype = parse_dtype(s.dtype.empty() ? part.dtype : s.dtype);
  return dtype ? dtype_bytes(*dtype) : 0;
}

Region region_of(const control::Segment& s) {
  Region r;
  r.box.ndim = static_cast<int>(std::min(s.size.size(), static_cast<size_t>(kMaxDims)));
  for (int d = 0; d < r.box.ndim; ++d) {
    r.box.start[d] = s.start[d];
    r.box.size[d] = s.size[d];
    r.strides[d] = d < static_cast<int>(s.strides.size()) ? s.strides[d] : 0;
  }
  r.offset = s.offset;
  return r;
}

std::string segment_name(const BufferPart& part, size_t i) {
  const control::Segment& s = part.segments[i];
  return "segment " + std::to_string(i) + " (tensor \"" + s.tensor + "\", " +
         (s.dtype.empty() ? part.dtype : s.dtype) + ")";
}

}  // namespace

Status check_segments_apart(const BufferPart& part) {
  struct Extent {
    int64_t lo, hi;  // bytes [lo, hi)
    size_t segment;
    Region region;
    int elem;
  };
  std::vector<Extent> extents;
  extents.reserve(part.segments.size());
  for (size_t i = 0; i < part.segments.size(); ++i) {
    Extent e{0, 0, i, region_of(part.segments[i]), elem_bytes(part, part.segments[i])};
    if (e.elem == 0) continue;  // check_segments_fit names it
    byte_extent(e.region, e.elem, &e.lo, &e.hi);
    extents.push_back(e);
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.lo < b.lo; });
  // Sweep: each segment against the earlier ones whose bytes reach it.
  std::vector<const Extent*> active;
  for (const Extent& e : extents) {
    active.erase(std::remove_if(active.begin(), active.end(), [&](const Extent* a) { return a->hi <= e.lo; }),
                 active.end());
    for (const Extent* a : active) {
      if (regions_meet(a->region, a->elem, e.region, e.elem)) {
        const size_t first = std::min(a->segment, e.segment), second = std::max(a->segment, e.segment);
        return Status::invalid("buffer \"" + part.name + "\": " + segment_name(part, first) + " and " +
                               segment_name(part, second) + " overlap: a byte of the buffer cannot hold both");
      }
    }
    active.push_back(&e);
  }
  return Status::ok();
}

Status check_segments_fit(const BufferPart& part, uint64_t bytes) {
  for (size_t i = 0; i < part.segments.size(); ++i) {
    const control::Segment& s = part.segments[i];
    const std::string& dtype_name = s.dtype.empty() ? part.dtype : s.dtype;
    const int64_t elem = elem_bytes(part, s);
    if (elem == 0) {
      return Status::invalid("buffer \"" + part.name + "\": unknown dtype \"" + dtype_name + "\"");
    }
    __int128 last = s.offset;
    for (size_t d = 0; d < s.size.size(); ++d) last += static_cast<__int128>(s.size[d] - 1) * s.strides[d];
    const __int128 end = (last + 1) * elem;
    if (end > static_cast<__int128>(bytes)) {
      return Status::invalid("buffer \"" + part.name + "\" of " + std::to_string(bytes) + " bytes is too small: segment " +
                             std::to_string(i) + " (tensor \"" + s.tensor + "\") reaches byte " +
                             std::to_string(static_cast<int64_t>(end)));
    }
  }
  return check_segments_apart(part);
}

Result<SourceTensor> parse_source_tensor(std::string_view json_text, int32_t rank) {
  Result<Json> parsed = parse_object(json_text, "tensor description");
  if (!parsed.is_ok()) return parsed.status();
  const Json& d = *parsed;
  JsonReader r("tensor description");
  r.object(d, "", {"name", "dtype", "shape", "buffer", "dtensor", "segments"});
  SourceTensor out;
  out.decl.name = r.string(d, "", "name", std::nullopt);
  out.decl.dtype = read_dtype(r, d, "");
  out.decl.shape = r.integers(d, "", "shape", true, 0, kMaxDims);
  const Json* dt = r.member(d, "", "dtensor", false);
  const Json* segs = r.member(d, "", "segments", false);
  if (r.ok() && (dt == nullptr) == (segs == nullptr)) r.fail("", "needs exactly one of \"dtensor\" and \"segments\"");
  if (r.ok() && dt && d.contains("buffer")) r.fail("buffer", "is for \"segments\"; a DTensor shard has a buffer of its own");
  if (!r.ok()) return r.status();
  const std::string what = "tensor \"" + out.decl.name + "\"";
  const DType dtype = *parse_dtype(out.decl.dtype);
  if (dt) {
    Result<DTensorSpec> spec = read_dtensor(r, *dt);
    if (!spec.is_ok()) return spec.status().with_context("tensor description: " + what);
    Result<BufferPart> part = dtensor_part(out.decl.name, dtype, out.decl.shape, *spec, Side::kSource, rank, what);
    if (!part.is_ok()) return part.status();
    out.buffer = std::move(part).value();
    return out;
  }
  out.buffer.name = r.string(d, "", "buffer", out.decl.name);
  out.buffer.dtype = out.decl.dtype;
  if (!segs->is_array() || segs->empty()) {
    return Status::invalid("tensor description: \"segments\" must be a non-empty list of segments");
  }
  for (size_t i = 0; i < segs->size(); ++i) {
    const std::string path = "segments[" + std::to_string(i) + "]";
    control::Segment s = read_segment(r, (*segs)[i], path, false, out.decl.name);
    if (!r.ok()) return r.status();
    if (s.start.size() != out.decl.shape.size()) {
      return Status::invalid("tensor description: " + what + " \"" + path + "\" has " +
                             std::to_string(s.start.size()) + " dims, the tensor " +
                             std::to_string(out.decl.shape.size()));
    }
    for (size_t k = 0; k < s.start.size(); ++k) {
      if (s.start[k] + s.size[k] > out.decl.shape[k]) {
        return Status::invalid("tensor description: " + what + " \"" + path + "\" ends at " +
                               std::to_string(s.start[k] + s.size[k]) + " in dim " + std::to_string(k) +
                               ", past the shape's " + std::to_string(out.decl.shape[k]));
      }
    }
    out.buffer.segments.push_back(std::move(s));
  }
  return out;
}

Result<std::shared_ptr<const RecipeLayout>> load_recipe(const RecipeConfig& recipe) {
  std::ifstream in(recipe.model, std::ios::binary);
  if (!in) return Status::not_found("config: \"recipe.model\": cannot open \"" + recipe.model + "\"");
  std::stringstream text;
  text << in.rdbuf();
  Result<Manifest> model = parse_manifest_json(text.str(), recipe.model);
  if (!model.is_ok()) return model.status();
  // The Hugging Face config beside the manifest (NAME.config.json): head
  // counts and head_dim come from it, never from a guess.
  const std::string config_path = model_config_path(recipe.model, false);
  std::ifstream config_in(config_path, std::ios::binary);
  if (!config_in)
    return Status::not_found("config: \"recipe.model\": cannot open the model's Hugging Face config \"" + config_path +
                             "\" beside the manifest");
  std::stringstream config_text;
  config_text << config_in.rdbuf();
  Result<ModelConfig> config = parse_model_config(config_text.str(), config_path);
  if (!config.is_ok()) return config.status();
  model->config = std::move(config).value();
  auto out = std::make_shared<RecipeLayout>();
  for (const ManifestTensor& t : *model) out->layout.add_tensor(t.name, t.dtype, t.shape);
  InferSide infer;
  infer.tp = recipe.tp;
  infer.pp = recipe.pp;
  infer.dp = recipe.dp;
  infer.gpus = recipe.tp * recipe.pp * recipe.dp;
  infer.expert_parallel = recipe.expert_parallel;
  infer.gpus_per_domain = recipe.gpus_per_domain > 0 ? recipe.gpus_per_domain : infer.gpus;
  REFIT_RETURN_IF_ERROR(add_vllm_receivers(out->layout, infer, *model).with_context("config: \"recipe\""));
  return std::shared_ptr<const RecipeLayout>(std::move(out));
}

namespace {

// {"recipe": NAME} or {"recipe": NAME, "dtype": D}: the recipe's parameter
// NAME at `rank`, held in the sources' dtype or in D, one refit converts to
// on the way (docs/conversion.md; the coordinator refuses any other at join).
Result<BufferPart> recipe_buffer(JsonReader& r, const Json& d, int32_t rank, const RecipeLayout* recipe) {
  for (const auto& [key, value] : d.items()) {
    if (key != "recipe" && key != "dtype") {
      return Status::invalid("buffer description: \"recipe\" takes no other key than \"dtype\", got \"" + key + "\"");
    }
  }
  const std::string param = r.string(d, "", "recipe", std::nullopt);
  const std::optional<std::string> dtype =
      d.contains("dtype") ? std::optional<std::string>(read_dtype(r, d, "")) : std::nullopt;
  if (!r.ok()) return r.status();
  if (!recipe) {
    return Status::invalid("buffer description: \"recipe\": the receiver's config has no \"recipe\" to lay out \"" +
                           param + "\"");
  }
  for (BufferPart& part : rank_buffers(recipe->layout, Side::kReceiver, rank)) {
    if (part.name != param) continue;
    part.exact_bytes = true;
    if (dtype && *dtype != part.dtype) {
      // A recipe's buffer is dense in the recipe's dtype, and its segments
      // name none: the same elements in `dtype`.
      const int64_t from = dtype_bytes(*parse_dtype(part.dtype)), to = dtype_bytes(*parse_dtype(*dtype));
      part.bytes = part.bytes / from * to;
      part.dtype = *dtype;
    }
    return std::move(part);
  }
  return Status::not_found("buffer description: the recipe gives receiver rank " + std::to_string(rank) +
                           " no buffer \"" + param + "\"");
}

}  // namespace

Result<BufferPart> parse_receiver_buffer(std::string_view json_text, int32_t rank, const RecipeLayout* recipe) {
  Result<Json> parsed = parse_object(json_text, "buffer description");
  if (!parsed.is_ok()) return parsed.status();
  const Json& d = *parsed;
  JsonReader r("buffer description");
  r.object(d, "", {"name", "dtype", "shape", "dtensor", "segments", "recipe"});
  if (r.member(d, "", "recipe", false)) return recipe_buffer(r, d, rank, recipe);
  BufferPart part;
  part.name = r.string(d, "", "name", std::nullopt);
  // A buffer is bytes: with "segments", "dtype" is only the default of
  // segments that name none.
  if (r.ok() && (d.contains("dtype") || !d.contains("segments"))) part.dtype = read_dtype(r, d, "");
  const Json* dt = r.member(d, "", "dtensor", false);
  const Json* segs = r.member(d, "", "segments", false);
  if (r.ok() && (dt == nullptr) == (segs == nullptr)) {
    r.fail("", "needs exactly one of \"dtensor\", \"segments\" and \"recipe\"");
  }
  if (!r.ok()) return r.status();
  if (dt) {
    const std::vector<int64_t> shape = r.integers(d, "", "shape", true, 0, kMaxDims);
    Result<DTensorSpec> spec = read_dtensor(r, *dt);
    if (!r.ok()) return r.status();
    if (!spec.is_ok()) return spec.status().with_context("buffer description: \"" + part.name + "\"");
    return dtensor_part(part.name, *parse_dtype(part.dtype), shape, *spec, Side::kReceiver, rank,
                        "buffer \"" + part.name + "\"");
  }
  if (d.contains("shape")) return Status::invalid("buffer description: \"shape\" is for \"dtensor\"");
  if (!segs->is_array() || segs->empty()) {
    return Status::invalid("buffer description: \"segments\" must be a non-empty list of segments");
  }
  for (size_t i = 0; i < segs->size(); ++i) {
    const std::string path = "segments[" + std::to_string(i) + "]";
    control::Segment s = read_segment(r, (*segs)[i], path, true, "");
    if (!r.ok()) return r.status();
    if (s.dtype.empty() && part.dtype.empty()) {
      return Status::invalid("buffer description: \"" + path + "\" (tensor \"" + s.tensor +
                             "\") needs a \"dtype\": the buffer names none");
    }
    if (s.dtype == part.dtype) s.dtype.clear();
    part.segments.push_back(std::move(s));
  }
  // One dtype for every segment: the buffer's (as a description with a
  // top-level "dtype" always said). Several: the buffer is bytes (U8), and
  // each segment keeps its own.
  if (part.dtype.empty()) {
    const std::string first = part.segments.front().dtype;
    const bool one = std::all_of(part.segments.begin(), part.segments.end(),
                                 [&](const control::Segment& s) { return s.dtype == first; });
    part.dtype = one ? first : "U8";
    for (control::Segment& s : part.segments) {
      if (one || s.dtype == part.dtype) s.dtype.clear();
    }
  }
  return part;
}

}  // namespace refit::plugin
