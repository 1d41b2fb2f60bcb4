// The training side as FSDP2 (torchtitan style, as the verl and OpenRLHF
// FSDP backends run it) lays out Hugging Face modules: no fused parameters,
// every tensor a DTensor named after itself.
//
// A stage's ranks form the mesh [dp*cp, tp], row-major, so that
// rank = tp_rank + tp*(cp_rank + cp*dp_rank) + stage*tp*cp*dp, which is the
// training rank formula with fsdp index = cp_rank + cp*dp_rank. FSDP shards
// dim 0 over dp*cp. With tp > 1, TP cuts first and FSDP cuts each TP piece:
// column-parallel tensors are [SS(0,tp), S(0)], row-parallel [S(0), S(1)],
// the rest [S(0), R]. Pipeline stages split layers as the megatron recipe does.

#include <algorithm>
#include <map>
#include <string>

#include "planner/placement.h"
#include "planner/recipes/model.h"
#include "planner/recipes/recipe.h"

namespace refit {
namespace {

using recipes::Role;

enum class TpStyle { kColumn, kRow, kReplicate };

TpStyle tp_style(Role r) {
  switch (r) {
    case Role::kQ: case Role::kK: case Role::kV: case Role::kQB: case Role::kKVB:
    case Role::kGate: case Role::kUp: case Role::kExpertGate: case Role::kExpertUp:
    case Role::kSharedGate: case Role::kSharedUp:
    // torchtitan: the embedding is RowwiseParallel, which for nn.Embedding
    // shards the weight on dim 0 (vocab); the output layer is ColwiseParallel.
    case Role::kEmbed: case Role::kLmHead:
      return TpStyle::kColumn;
    case Role::kO: case Role::kDown: case Role::kExpertDown: case Role::kSharedDown:
      return TpStyle::kRow;
    default:
      return TpStyle::kReplicate;
  }
}

Placement shard(int dim) { return Placement{Placement::Kind::kShard, dim, 1}; }

// add_dtensor's expansion (dtensor_boxes, so the same torch.chunk and
// strided-shard semantics), except that ranks whose shards have the same
// size share one Buffer instead of one Buffer per distinct shard. FSDP gives
// every rank its own box, so add_dtensor would make one Buffer (and one heap
// name) per rank per tensor: 18 million for Kimi-K2 over 256 ranks, ~2 GiB
// and most of the time. The Regions, one per distinct box, are the same.
class FsdpExpander {
 public:
  explicit FsdpExpander(Layout& layout) : layout_(layout), singles_(layout.num_ranks(Side::kSource), kNone) {}

  // REQUIRES: `spec` outlives the expander (expansions are cached by its
  // address and the tensor's shape), and the tensor has no source regions yet.
  Status add(uint32_t tensor, const DTensorSpec& spec, const std::string& name) {
    Tensor& t = layout_.tensors[tensor];
    const int bytes = dtype_bytes(t.dtype);
    // Tensors of one shape on one stage are laid out alike: they share one
    // region list, each with buffers of its own at the same relative places.
    auto key = std::make_pair(&spec, t.shape);
    if (auto hit = cache_.find(key); hit != cache_.end() && t.sources.empty()) {
      const Expansion& x = hit->second;
      t.source_base = static_cast<uint32_t>(layout_.buffers.size());
      for (const auto& [n, set] : x.buffers)
        layout_.add_buffer(Buffer{Side::kSource, name, t.dtype, n * bytes, set});
      t.sources = x.regions;
      return Status::ok();
    }
    auto boxes = dtensor_boxes(t.shape, spec);
    if (!boxes) return boxes.status();
    // Group mesh positions by box (the ranks of a TP-replicated shard share
    // one), in order of first appearance.
    order_.resize(boxes->size());
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<uint32_t>(i);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](uint32_t a, uint32_t b) { return (*boxes)[a] < (*boxes)[b]; });
    groups_.clear();
    for (size_t k = 0; k < order_.size(); ++k) {
      const Box& b = (*boxes)[order_[k]];
      if (b.empty()) continue;
      if (groups_.empty() || groups_.back().box != b) groups_.push_back({b, {}});
      groups_.back().ranks.push_back(spec.ranks[order_[k]]);
    }
    // One Buffer per shard size, over every rank with a shard of that size.
    sizes_.clear();
    for (Group& g : groups_) {
      std::sort(g.ranks.begin(), g.ranks.end());
      const int64_t n = g.box.numel();
      auto it = std::find_if(sizes_.begin(), sizes_.end(), [&](const auto& s) { return s.first == n; });
      if (it == sizes_.end()) sizes_.push_back({n, {}}), it = sizes_.end() - 1;
      it->second.insert(it->second.end(), g.ranks.begin(), g.ranks.end());
    }
    const bool shareable = t.sources.empty();
    Expansion x;
    const uint32_t base = static_cast<uint32_t>(layout_.buffers.size());
    for (auto& [n, ranks] : sizes_) {
      std::sort(ranks.begin(), ranks.end());
      x.buffers.push_back({n, set(ranks)});
      layout_.add_buffer(Buffer{Side::kSource, name, t.dtype, n * bytes, x.buffers.back().second});
    }
    // Buffer indices relative to the tensor's source_base when the list may
    // be shared; absolute when the tensor already had regions of its own.
    if (shareable) t.source_base = base;
    for (const Group& g : groups_) {
      const int64_t n = g.box.numel();
      const size_t si = std::find_if(sizes_.begin(), sizes_.end(), [&](const auto& s) { return s.first == n; }) -
                        sizes_.begin();
      Region r;
      r.box = g.box;
      r.ranks = set(g.ranks);
      r.buffer = static_cast<uint32_t>(si) + (shareable ? 0 : base - t.source_base);
      r.strides = row_major_strides(std::vector<int64_t>(g.box.size.begin(), g.box.size.begin() + g.box.ndim));
      x.regions.push_back(r);
    }
    for (const Region& r : x.regions) t.sources.push_back(r);
    if (shareable) {
      x.regions = t.sources;  // shares the tensor's list
      cache_.emplace(std::move(key), std::move(x));
    }
    return Status::ok();
  }

 private:
  static constexpr RankSetId kNone = ~RankSetId{0};
  struct Group {
    Box box;
    std::vector<int32_t> ranks;
  };
  struct Expansion {
    RegionList regions;                                // buffers relative to source_base
    std::vector<std::pair<int64_t, RankSetId>> buffers;  // elements and ranks of each
  };
  // Interned set; single ranks cached, as they are most of FSDP's sets.
  RankSetId set(const std::vector<int32_t>& ranks) {
    if (ranks.size() == 1) {
      RankSetId& id = singles_[ranks[0]];
      if (id == kNone) id = layout_.source_sets.intern(ranks);
      return id;
    }
    return layout_.source_sets.intern(ranks);
  }

  Layout& layout_;
  std::vector<RankSetId> singles_;
  std::vector<uint32_t> order_;
  std::vector<Group> groups_;
  std::vector<std::pair<int64_t, std::vector<int32_t>>> sizes_;
  std::map<std::pair<const DTensorSpec*, std::vector<int64_t>>, Expansion> cache_;
};

}  // namespace

Status add_fsdp_sources(Layout& layout, const TrainSide& train, const Manifest& model) {
  if (train.ep > 1)
    return Status::unsupported("fsdp: train.ep=" + std::to_string(train.ep) +
                               " is not supported with fsdp (expert parallelism over FSDP-wrapped HF modules has "
                               "no standard layout); use ep=1, or the megatron recipe (fsdp: false)");
  REFIT_RETURN_IF_ERROR(recipes::add_source_ranks(layout, train));
  REFIT_RETURN_IF_ERROR(recipes::check_tensors_match(layout, model));
  auto info = recipes::analyze_model(model);
  if (!info) return info.status();

  const int64_t tp = train.tp, fsdp = train.dp * train.cp, block = tp * fsdp;
  const int64_t last = train.pp - 1;
  std::vector<DTensorSpec> specs[3];  // per stage, by TpStyle
  for (auto& v : specs) v.resize(static_cast<size_t>(train.pp));
  for (int64_t s = 0; s < train.pp; ++s) {
    std::vector<int32_t> ranks;
    for (int64_t i = 0; i < block; ++i) ranks.push_back(static_cast<int32_t>(s * block + i));
    for (int k = 0; k < 3; ++k) {
      DTensorSpec& spec = specs[k][s];
      spec.ranks = ranks;
      if (tp == 1) {
        spec.mesh = {fsdp};
        spec.placements = {shard(0)};
        continue;
      }
      spec.mesh = {fsdp, tp};
      switch (static_cast<TpStyle>(k)) {
        case TpStyle::kColumn:
          spec.placements = {Placement{Placement::Kind::kStridedShard, 0, static_cast<int>(tp)}, shard(0)};
          break;
        case TpStyle::kRow: spec.placements = {shard(0), shard(1)}; break;
        case TpStyle::kReplicate: spec.placements = {shard(0), Placement{}}; break;
      }
    }
  }

  std::vector<int64_t> stage_of(static_cast<size_t>(info->num_layers()), 0);
  for (int64_t s = 0; s < train.pp; ++s) {
    const recipes::LayerRange range = recipes::balanced_stage_layers(info->num_layers(), train.pp, s);
    for (int64_t l = range.begin; l < range.end; ++l) stage_of[l] = s;
  }
  FsdpExpander expander(layout);
  for (size_t i = 0; i < model.size(); ++i) {
    const recipes::TensorRole& r = info->roles[i];
    int64_t stage = 0;
    if (r.layer >= 0) {
      stage = stage_of[r.layer];
    } else if (r.role != Role::kEmbed) {
      // Final norm and lm_head. The embedding stays on stage 0, tied or
      // not: a source needs to hold it once, and a tied output layer is the
      // same parameter.
      stage = last;
    }
    const TpStyle style = tp_style(r.role);
    // Whole heads per TP shard, as torchtitan's attention needs (it views
    // the local q/k/v by head_dim).
    if (tp > 1 && r.layer >= 0 && (r.role == Role::kQ || r.role == Role::kK) && !r.scale) {
      const recipes::LayerInfo& L = info->layers[r.layer];
      const int64_t heads = r.role == Role::kQ ? L.q_heads : L.kv_heads;
      if (L.gqa && heads % tp != 0)
        return Status::invalid("fsdp: " + recipes::quoted(model, static_cast<int32_t>(i)) + ": " +
                               std::to_string(heads) + " heads do not split evenly over tp=" + std::to_string(tp));
    }
    // A block scale follows its weight's placement; under DTensor semantics
    // it is a tensor of its own, so no block alignment is implied.
    REFIT_RETURN_IF_ERROR(expander.add(static_cast<uint32_t>(i), specs[static_cast<int>(style)][stage], model[i].name)
                              .with_context("fsdp: " + recipes::quoted(model, static_cast<int32_t>(i))));
  }
  return Status::ok();
}

}  // namespace refit
