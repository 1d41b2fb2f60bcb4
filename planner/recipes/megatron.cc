// The training side as Megatron-Core lays out its parameters (TE layer
// spec, docs/formats.md, "How the recipes place the weights"): fused, TP-sharded parameters under Megatron's
// own names, one buffer per parameter, HF tensors mapped into them.
//
// Rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)). A stage's ranks
// are the tp*cp*dp block starting at stage*tp*cp*dp; cp and dp replicate, so
// everything a TP rank holds is held by the cp*dp ranks of that TP rank
// alike and is one Region with that rank set.

#include <string>

#include "planner/recipes/model.h"
#include "planner/recipes/recipe.h"

namespace refit {
namespace {

using recipes::BufferRef;
using recipes::LayerInfo;
using recipes::ModelInfo;
using recipes::Role;

constexpr std::string_view kColumn = "Megatron's ColumnParallelLinear";
constexpr std::string_view kRow = "Megatron's RowParallelLinear";

class MegatronBuilder {
 public:
  MegatronBuilder(Layout& layout, const TrainSide& train, const Manifest& model, const ModelInfo& info)
      : train_(train),
        model_(model),
        info_(info),
        writer_(layout, Side::kSource, model, info),
        sets_(layout.sets(Side::kSource)),
        block_(train.tp * train.cp * train.dp) {}

  Status build() {
    const int64_t L = info_.num_layers();
    for (int64_t s = 0; s < train_.pp; ++s) {
      // Megatron needs explicit first/last stage sizes for an uneven split
      // (decoder_first/last_pipeline_num_layers); we assume the balanced
      // floor split, which is also what it does when the split is even.
      const recipes::LayerRange range = recipes::balanced_stage_layers(L, train_.pp, s);
      for (int64_t i = range.begin; i < range.end; ++i) {
        // named_parameters() numbers a stage's layers from 0: the buffer
        // names use the local index, as a Megatron state dict on that rank does.
        REFIT_RETURN_IF_ERROR(layer(s, i - range.begin, info_.layers[i]));
      }
    }
    REFIT_RETURN_IF_ERROR(embeddings());
    return writer_.check_all_placed();
  }

 private:
  RankSetId stage_set(int64_t s) {
    return sets_.get(0, s, 0, [&](std::vector<int32_t>& r) {
      for (int64_t i = 0; i < block_; ++i) r.push_back(static_cast<int32_t>(s * block_ + i));
    });
  }
  // The ranks of TP rank t in stage s: one per (cp, dp) pair.
  RankSetId tp_set(int64_t s, int64_t t) {
    return sets_.get(1, s, t, [&](std::vector<int32_t>& r) {
      for (int64_t k = 0; k < train_.cp * train_.dp; ++k)
        r.push_back(static_cast<int32_t>(s * block_ + t + train_.tp * k));
    });
  }
  // EP rank e of every EP group (ep consecutive ranks) of stage s.
  RankSetId ep_set(int64_t s, int64_t e) {
    return sets_.get(2, s, e, [&](std::vector<int32_t>& r) {
      for (int64_t g = 0; g < block_ / train_.ep; ++g)
        r.push_back(static_cast<int32_t>(s * block_ + g * train_.ep + e));
    });
  }
  recipes::TpSetFn tp_fn(int64_t s) {
    return [this, s](int64_t t) { return tp_set(s, t); };
  }

  Status layer(int64_t s, int64_t li, const LayerInfo& L) {
    const std::string p = "decoder.layers." + std::to_string(li) + ".";
    const RankSetId all = stage_set(s);
    const int64_t tp = train_.tp;
    auto fn = tp_fn(s);
    const auto w = [&](Role r) { return L.w(r); };

    if (L.gqa) {
      // linear_qkv interleaves by query group: for each KV group g a rank
      // holds, [q rows of g's heads, k rows of g, v rows of g]. TP splits
      // groups, so KV heads must divide by tp (Megatron asserts it).
      if (L.kv_heads % tp != 0)
        return Status::invalid(recipes::quoted(model_, w(Role::kK)) + ": " + std::to_string(L.kv_heads) +
                               " KV heads (head_dim " + std::to_string(L.head_dim) +
                               ") do not split evenly over tp=" + std::to_string(tp) +
                               " (Megatron requires num_query_groups % tp == 0)");
      const int64_t hd = L.head_dim, per_group = L.q_heads / L.kv_heads, groups = L.kv_heads / tp;
      const int64_t group_rows = (per_group + 2) * hd;
      const int32_t q = w(Role::kQ), k = w(Role::kK), v = w(Role::kV);
      const auto qkv = [&](const std::string& name, int32_t qt, int32_t kt, int32_t vt) -> Status {
        const int32_t any = qt >= 0 ? qt : kt >= 0 ? kt : vt;
        std::vector<int64_t> shape = model_[any].shape;
        shape[0] = groups * group_rows;
        auto buf = writer_.buffer(name, shape, all, {qt, kt, vt});
        if (!buf) return buf.status();
        for (int64_t t = 0; t < tp; ++t) {
          const RankSetId ranks = tp_set(s, t);
          for (int64_t gl = 0; gl < groups; ++gl) {
            const int64_t g = t * groups + gl, at = gl * group_rows;
            if (qt >= 0)
              REFIT_RETURN_IF_ERROR(writer_.place_rows(qt, g * per_group * hd, per_group * hd, *buf, at, ranks));
            if (kt >= 0) REFIT_RETURN_IF_ERROR(writer_.place_rows(kt, g * hd, hd, *buf, at + per_group * hd, ranks));
            if (vt >= 0)
              REFIT_RETURN_IF_ERROR(writer_.place_rows(vt, g * hd, hd, *buf, at + (per_group + 1) * hd, ranks));
          }
        }
        return Status::ok();
      };
      REFIT_RETURN_IF_ERROR(qkv(p + "self_attention.linear_qkv.weight", q, k, v));
      if (L.b(Role::kQ) >= 0 || L.b(Role::kK) >= 0 || L.b(Role::kV) >= 0) {
        // Column-parallel biases shard with their weights (not replicated).
        REFIT_RETURN_IF_ERROR(
            qkv(p + "self_attention.linear_qkv.bias", L.b(Role::kQ), L.b(Role::kK), L.b(Role::kV)));
      }
      if (w(Role::kInputNorm) >= 0)
        REFIT_RETURN_IF_ERROR(
            writer_.replicate(w(Role::kInputNorm), p + "self_attention.linear_qkv.layer_norm_weight", all));
      if (w(Role::kQNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kQNorm), p + "self_attention.q_layernorm.weight", all));
      if (w(Role::kKNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kKNorm), p + "self_attention.k_layernorm.weight", all));
      REFIT_RETURN_IF_ERROR(writer_.row_parallel(p + "self_attention.linear_proj.weight", w(Role::kO), tp, all, fn, kRow));
    } else if (L.mla) {
      // Megatron's MLA spec keeps input_layernorm a module of its own (the
      // down projections are plain linears) and fuses q_a/kv_a layernorms
      // into the up projections.
      if (w(Role::kInputNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kInputNorm), p + "input_layernorm.weight", all));
      if (w(Role::kQA) >= 0) {
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kQA), p + "self_attention.linear_q_down_proj.weight", all));
        if (w(Role::kQANorm) >= 0)
          REFIT_RETURN_IF_ERROR(
              writer_.replicate(w(Role::kQANorm), p + "self_attention.linear_q_up_proj.layer_norm_weight", all));
        REFIT_RETURN_IF_ERROR(
            writer_.column_parallel(p + "self_attention.linear_q_up_proj.weight", {w(Role::kQB)}, tp, all, fn, kColumn));
      } else {
        REFIT_RETURN_IF_ERROR(
            writer_.column_parallel(p + "self_attention.linear_q_proj.weight", {w(Role::kQ)}, tp, all, fn, kColumn));
      }
      REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kKVA), p + "self_attention.linear_kv_down_proj.weight", all));
      if (w(Role::kKVANorm) >= 0)
        REFIT_RETURN_IF_ERROR(
            writer_.replicate(w(Role::kKVANorm), p + "self_attention.linear_kv_up_proj.layer_norm_weight", all));
      REFIT_RETURN_IF_ERROR(
          writer_.column_parallel(p + "self_attention.linear_kv_up_proj.weight", {w(Role::kKVB)}, tp, all, fn, kColumn));
      REFIT_RETURN_IF_ERROR(writer_.row_parallel(p + "self_attention.linear_proj.weight", w(Role::kO), tp, all, fn, kRow));
    }

    if (L.dense_mlp) {
      if (w(Role::kPostAttnNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kPostAttnNorm), p + "mlp.linear_fc1.layer_norm_weight", all));
      // linear_fc1 is gate and up fused: this rank's gate rows, then its up rows.
      REFIT_RETURN_IF_ERROR(
          writer_.column_parallel(p + "mlp.linear_fc1.weight", {w(Role::kGate), w(Role::kUp)}, tp, all, fn, kColumn));
      REFIT_RETURN_IF_ERROR(writer_.row_parallel(p + "mlp.linear_fc2.weight", w(Role::kDown), tp, all, fn, kRow));
    } else if (L.moe) {
      if (w(Role::kPostAttnNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kPostAttnNorm), p + "pre_mlp_layernorm.weight", all));
      REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kRouter), p + "mlp.router.weight", all));
      if (w(Role::kRouterBias) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kRouterBias), p + "mlp.router.expert_bias", all));
      REFIT_RETURN_IF_ERROR(experts(s, p, L));
      if (w(Role::kSharedGate) >= 0) {
        REFIT_RETURN_IF_ERROR(writer_.column_parallel(p + "mlp.shared_experts.linear_fc1.weight",
                                                      {w(Role::kSharedGate), w(Role::kSharedUp)}, tp, all, fn,
                                                      kColumn));
        REFIT_RETURN_IF_ERROR(
            writer_.row_parallel(p + "mlp.shared_experts.linear_fc2.weight", w(Role::kSharedDown), tp, all, fn, kRow));
      }
    }
    return Status::ok();
  }

  // Routed experts, expert TP = 1: expert e lives whole on EP rank e / (E/ep)
  // of every EP group as local expert e % (E/ep) (SequentialMLP names).
  Status experts(int64_t s, const std::string& p, const LayerInfo& L) {
    const int64_t E = L.num_experts(), ep = train_.ep;
    if (E % ep != 0)
      return Status::invalid(recipes::quoted(model_, L.w(Role::kRouter)) + ": " + std::to_string(E) +
                             " experts do not split evenly over ep=" + std::to_string(ep) +
                             " (Megatron requires num_experts % ep == 0)");
    const int64_t per = E / ep, I = L.expert_inter;
    const RankSetId all = stage_set(s);
    for (int64_t j = 0; j < per; ++j) {
      const std::string base = p + "mlp.experts.local_experts." + std::to_string(j) + ".";
      const auto& e0 = L.experts[j];  // for shape and dtype: every expert has the same
      auto fc1 = writer_.buffer(base + "linear_fc1.weight", {2 * I, model_[e0.gate].shape[1]}, all,
                                {e0.gate, e0.up});
      if (!fc1) return fc1.status();
      auto fc2 = writer_.buffer(base + "linear_fc2.weight", model_[e0.down].shape, all, {e0.down});
      if (!fc2) return fc2.status();
      for (int64_t k = 0; k < ep; ++k) {
        const auto& x = L.experts[k * per + j];
        const RankSetId ranks = ep_set(s, k);
        // Every expert's dtypes and scales must match the buffer's.
        for (int32_t t : {x.gate, x.up, x.down}) {
          if (model_[t].dtype != model_[e0.gate].dtype ||
              (info_.scale_of[t] >= 0) != (info_.scale_of[e0.gate] >= 0))
            return Status::invalid(recipes::quoted(model_, t) + ": dtype or block scales differ from " +
                                   recipes::quoted(model_, e0.gate));
        }
        REFIT_RETURN_IF_ERROR(writer_.place_rows(x.gate, 0, I, *fc1, 0, ranks));
        REFIT_RETURN_IF_ERROR(writer_.place_rows(x.up, 0, I, *fc1, I, ranks));
        REFIT_RETURN_IF_ERROR(writer_.place_rows(x.down, 0, model_[x.down].shape[0], *fc2, 0, ranks));
      }
    }
    return Status::ok();
  }

  // Vocab-parallel embedding and output layer, padded as Megatron pads:
  // to a multiple of make_vocab_size_divisible_by (128) * tp.
  Status embeddings() {
    const int64_t tp = train_.tp, first = 0, last = train_.pp - 1;
    const auto padded = [&](int32_t t) {
      const int64_t v = model_[t].shape[0], m = 128 * tp;
      return (v + m - 1) / m * m;
    };
    if (info_.embed >= 0)
      REFIT_RETURN_IF_ERROR(writer_.vocab_parallel("embedding.word_embeddings.weight", info_.embed,
                                                   padded(info_.embed), tp, stage_set(first), tp_fn(first),
                                                   "Megatron's VocabParallelEmbedding"));
    if (info_.final_norm >= 0)
      REFIT_RETURN_IF_ERROR(writer_.replicate(info_.final_norm, "decoder.final_layernorm.weight", stage_set(last)));
    // Tied embeddings: with pp > 1 the last stage keeps its own copy of the
    // embedding as output_layer.weight (kept equal by Megatron's
    // embedding-group all-reduce); with pp == 1 the two are one parameter.
    const int32_t out = info_.lm_head >= 0 ? info_.lm_head : (train_.pp > 1 ? info_.embed : -1);
    if (out >= 0)
      REFIT_RETURN_IF_ERROR(writer_.vocab_parallel("output_layer.weight", out, padded(out), tp, stage_set(last),
                                                   tp_fn(last), "Megatron's ColumnParallelLinear output layer"));
    return Status::ok();
  }

  const TrainSide& train_;
  const Manifest& model_;
  const ModelInfo& info_;
  recipes::LayoutWriter writer_;
  recipes::RankSetCache sets_;
  int64_t block_;
};

}  // namespace

Status add_megatron_sources(Layout& layout, const TrainSide& train, const Manifest& model) {
  if (train.fsdp) return Status::invalid("train.fsdp is true: use the fsdp recipe, not megatron");
  REFIT_RETURN_IF_ERROR(recipes::add_source_ranks(layout, train));
  REFIT_RETURN_IF_ERROR(recipes::check_tensors_match(layout, model));
  auto info = recipes::analyze_model(model);
  if (!info) return info.status();
  return MegatronBuilder(layout, train, model, *info).build().with_context("megatron");
}

}  // namespace refit
