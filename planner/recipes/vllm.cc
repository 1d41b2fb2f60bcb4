// The inference side as vLLM lays out its parameters (docs/formats.md,
// "How the recipes place the weights"):
// fused parameters under vLLM's own names (qkv_proj, gate_up_proj,
// fused_qkv_a_proj, FusedMoE w13_weight/w2_weight), vocab padded to 64.
//
// Receiver rank = tp_rank + tp*(pp_rank + pp*instance). Instances are
// independent engines with identical layouts, so what TP rank t of stage p
// holds is one Region over that rank of every instance.

#include <string>

#include "planner/recipes/model.h"
#include "planner/recipes/recipe.h"

namespace refit {
namespace {

using recipes::LayerInfo;
using recipes::ModelInfo;
using recipes::Role;

constexpr std::string_view kColumn = "vLLM's ColumnParallelLinear";
constexpr std::string_view kRow = "vLLM's RowParallelLinear";
constexpr int64_t kVocabPadding = 64;  // vLLM's DEFAULT_VOCAB_PADDING_SIZE

class VllmBuilder {
 public:
  VllmBuilder(Layout& layout, const InferSide& infer, const Manifest& model, const ModelInfo& info)
      : infer_(infer),
        model_(model),
        info_(info),
        writer_(layout, Side::kReceiver, model, info),
        sets_(layout.sets(Side::kReceiver)) {}

  Status build() {
    const int64_t L = info_.num_layers();
    for (int64_t p = 0; p < infer_.pp; ++p) {
      const recipes::LayerRange range = recipes::vllm_stage_layers(L, infer_.pp, p);
      // vLLM keeps global layer numbers in its names (PPMissingLayer fills the rest).
      for (int64_t i = range.begin; i < range.end; ++i) REFIT_RETURN_IF_ERROR(layer(p, i, info_.layers[i]));
    }
    REFIT_RETURN_IF_ERROR(embeddings());
    return writer_.check_all_placed();
  }

 private:
  // TP ranks [lo, hi) of stage p, in every instance.
  RankSetId tp_set(int64_t p, int64_t lo, int64_t hi) {
    return sets_.get(p, lo, hi, [&](std::vector<int32_t>& r) {
      for (int64_t i = 0; i < infer_.dp; ++i)
        for (int64_t t = lo; t < hi; ++t) r.push_back(static_cast<int32_t>(t + infer_.tp * (p + infer_.pp * i)));
    });
  }
  RankSetId stage_set(int64_t p) { return tp_set(p, 0, infer_.tp); }
  recipes::TpSetFn tp_fn(int64_t p) {
    return [this, p](int64_t t) { return tp_set(p, t, t + 1); };
  }

  Status layer(int64_t p, int64_t i, const LayerInfo& L) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    const RankSetId all = stage_set(p);
    const int64_t tp = infer_.tp;
    auto fn = tp_fn(p);
    const auto w = [&](Role r) { return L.w(r); };

    if (w(Role::kInputNorm) >= 0)
      REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kInputNorm), pre + "input_layernorm.weight", all));
    if (w(Role::kPostAttnNorm) >= 0)
      REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kPostAttnNorm), pre + "post_attention_layernorm.weight", all));

    if (L.gqa) {
      REFIT_RETURN_IF_ERROR(qkv(p, pre, L));
      if (w(Role::kQNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kQNorm), pre + "self_attn.q_norm.weight", all));
      if (w(Role::kKNorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kKNorm), pre + "self_attn.k_norm.weight", all));
      REFIT_RETURN_IF_ERROR(writer_.row_parallel(pre + "self_attn.o_proj.weight", w(Role::kO), tp, all, fn, kRow));
    } else if (L.mla) {
      if (w(Role::kQA) >= 0) {
        // DeepSeek-V2/V3 in vLLM: q_a_proj and kv_a_proj_with_mqa are one
        // replicated linear, fused_qkv_a_proj = cat(q_a, kv_a) along dim 0.
        REFIT_RETURN_IF_ERROR(
            writer_.replicate_fused(pre + "self_attn.fused_qkv_a_proj.weight", {w(Role::kQA), w(Role::kKVA)}, all));
        if (w(Role::kQANorm) >= 0)
          REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kQANorm), pre + "self_attn.q_a_layernorm.weight", all));
        REFIT_RETURN_IF_ERROR(
            writer_.column_parallel(pre + "self_attn.q_b_proj.weight", {w(Role::kQB)}, tp, all, fn, kColumn));
      } else {
        // No q LoRA (DeepSeek-V2-Lite): q_proj column-parallel, kv_a alone.
        REFIT_RETURN_IF_ERROR(
            writer_.column_parallel(pre + "self_attn.q_proj.weight", {w(Role::kQ)}, tp, all, fn, kColumn));
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kKVA), pre + "self_attn.kv_a_proj_with_mqa.weight", all));
      }
      if (w(Role::kKVANorm) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kKVANorm), pre + "self_attn.kv_a_layernorm.weight", all));
      REFIT_RETURN_IF_ERROR(
          writer_.column_parallel(pre + "self_attn.kv_b_proj.weight", {w(Role::kKVB)}, tp, all, fn, kColumn));
      REFIT_RETURN_IF_ERROR(writer_.row_parallel(pre + "self_attn.o_proj.weight", w(Role::kO), tp, all, fn, kRow));
    }

    if (L.dense_mlp) {
      REFIT_RETURN_IF_ERROR(writer_.column_parallel(pre + "mlp.gate_up_proj.weight", {w(Role::kGate), w(Role::kUp)},
                                                    tp, all, fn, "vLLM's MergedColumnParallelLinear"));
      REFIT_RETURN_IF_ERROR(writer_.row_parallel(pre + "mlp.down_proj.weight", w(Role::kDown), tp, all, fn, kRow));
    } else if (L.moe) {
      REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kRouter), pre + "mlp.gate.weight", all));
      if (w(Role::kRouterBias) >= 0)
        REFIT_RETURN_IF_ERROR(writer_.replicate(w(Role::kRouterBias), pre + "mlp.gate.e_score_correction_bias", all));
      REFIT_RETURN_IF_ERROR(infer_.expert_parallel ? experts_ep(p, pre, L) : experts_tp(p, pre, L));
      if (w(Role::kSharedGate) >= 0) {
        // Shared experts are a TP-sharded dense MLP, with or without EP.
        REFIT_RETURN_IF_ERROR(writer_.column_parallel(pre + "mlp.shared_experts.gate_up_proj.weight",
                                                      {w(Role::kSharedGate), w(Role::kSharedUp)}, tp, all, fn,
                                                      "vLLM's MergedColumnParallelLinear"));
        REFIT_RETURN_IF_ERROR(
            writer_.row_parallel(pre + "mlp.shared_experts.down_proj.weight", w(Role::kSharedDown), tp, all, fn, kRow));
      }
    }
    return Status::ok();
  }

  // QKVParallelLinear: TP rank t holds cat(q_t, k_t, v_t). Query heads split
  // evenly; KV heads split evenly when tp <= kv heads, else each rank holds
  // one KV head, head t * kv / tp (tp / kv ranks share each head).
  Status qkv(int64_t p, const std::string& pre, const LayerInfo& L) {
    const int64_t tp = infer_.tp, hd = L.head_dim, kvh = L.kv_heads;
    const int32_t q = L.w(Role::kQ), k = L.w(Role::kK);
    if (L.q_heads % tp != 0)
      return Status::invalid(recipes::quoted(model_, q) + ": " + std::to_string(L.q_heads) + " query heads (head_dim " +
                             std::to_string(hd) + ") do not split evenly over tp=" + std::to_string(tp) +
                             " (vLLM requires num_heads % tp == 0)");
    const bool replicated = tp >= kvh;
    if (replicated ? tp % kvh != 0 : kvh % tp != 0)
      return Status::invalid(recipes::quoted(model_, k) + ": " + std::to_string(kvh) + " KV heads (head_dim " +
                             std::to_string(hd) + ") and tp=" + std::to_string(tp) +
                             ": vLLM requires one to divide the other");
    const int64_t q_rows = L.q_heads / tp * hd;
    const int64_t kv_rows = (replicated ? 1 : kvh / tp) * hd;
    const RankSetId all = stage_set(p);
    const auto emit = [&](const std::string& name, int32_t qt, int32_t kt, int32_t vt) -> Status {
      const int32_t any = qt >= 0 ? qt : kt >= 0 ? kt : vt;
      std::vector<int64_t> shape = model_[any].shape;
      shape[0] = q_rows + 2 * kv_rows;
      auto buf = writer_.buffer(name, shape, all, {qt, kt, vt});
      if (!buf) return buf.status();
      for (int64_t t = 0; t < tp; ++t)
        if (qt >= 0) REFIT_RETURN_IF_ERROR(writer_.place_rows(qt, t * q_rows, q_rows, *buf, 0, tp_set(p, t, t + 1)));
      // One region per distinct KV box: with replicated heads, the tp/kv
      // ranks sharing head h share the region.
      const int64_t boxes = replicated ? kvh : tp, ranks_per_box = replicated ? tp / kvh : 1;
      for (int64_t h = 0; h < boxes; ++h) {
        const RankSetId ranks = tp_set(p, h * ranks_per_box, (h + 1) * ranks_per_box);
        if (kt >= 0) REFIT_RETURN_IF_ERROR(writer_.place_rows(kt, h * kv_rows, kv_rows, *buf, q_rows, ranks));
        if (vt >= 0)
          REFIT_RETURN_IF_ERROR(writer_.place_rows(vt, h * kv_rows, kv_rows, *buf, q_rows + kv_rows, ranks));
      }
      return Status::ok();
    };
    REFIT_RETURN_IF_ERROR(emit(pre + "self_attn.qkv_proj.weight", q, k, L.w(Role::kV)));
    if (L.b(Role::kQ) >= 0 || L.b(Role::kK) >= 0 || L.b(Role::kV) >= 0)
      REFIT_RETURN_IF_ERROR(emit(pre + "self_attn.qkv_proj.bias", L.b(Role::kQ), L.b(Role::kK), L.b(Role::kV)));
    return Status::ok();
  }

  static std::vector<int32_t> expert_members(const LayerInfo& L, bool w13) {
    std::vector<int32_t> m;
    for (const auto& x : L.experts) {
      if (w13) {
        m.push_back(x.gate);
        m.push_back(x.up);
      } else {
        m.push_back(x.down);
      }
    }
    return m;
  }

  // FusedMoE without expert parallelism: every rank holds every expert,
  // TP-sharded: w13_weight [E, 2*I/tp, H] (gate chunk, then up chunk),
  // w2_weight [E, H, I/tp].
  Status experts_tp(int64_t p, const std::string& pre, const LayerInfo& L) {
    const int64_t tp = infer_.tp, E = L.num_experts(), I = L.expert_inter;
    const int64_t H = model_[L.experts[0].gate].shape[1];
    if (I % tp != 0)
      return Status::invalid(recipes::quoted(model_, L.experts[0].gate) + ": expert width " + std::to_string(I) +
                             " does not split evenly over tp=" + std::to_string(tp) +
                             " (vLLM's FusedMoE requires it; consider expert_parallel)");
    const int64_t Ir = I / tp;
    const RankSetId all = stage_set(p);
    auto w13 = writer_.buffer(pre + "mlp.experts.w13_weight", {E, 2 * Ir, H}, all, expert_members(L, true));
    if (!w13) return w13.status();
    auto w2 = writer_.buffer(pre + "mlp.experts.w2_weight", {E, H, Ir}, all, expert_members(L, false));
    if (!w2) return w2.status();
    for (int64_t t = 0; t < tp; ++t) {
      const RankSetId ranks = tp_set(p, t, t + 1);
      for (int64_t e = 0; e < E; ++e) {
        const auto& x = L.experts[e];
        Index lead{};
        lead[0] = e;
        REFIT_RETURN_IF_ERROR(writer_.place_rows(x.gate, t * Ir, Ir, *w13, 0, ranks, lead));
        REFIT_RETURN_IF_ERROR(writer_.place_rows(x.up, t * Ir, Ir, *w13, Ir, ranks, lead));
        REFIT_RETURN_IF_ERROR(writer_.place_cols(x.down, t * Ir, Ir, *w2, ranks, lead));
      }
    }
    return Status::ok();
  }

  // FusedMoE with expert parallelism (EP = TP inside an instance): experts
  // spread as vLLM's determine_expert_map does, contiguous, E/tp each and one
  // more on the first E%tp ranks; experts whole.
  Status experts_ep(int64_t p, const std::string& pre, const LayerInfo& L) {
    const int64_t tp = infer_.tp, E = L.num_experts(), I = L.expert_inter;
    const int64_t H = model_[L.experts[0].gate].shape[1];
    const int64_t base = E / tp, extra = E % tp;
    const std::vector<int32_t> m13 = expert_members(L, true), m2 = expert_members(L, false);
    // Ranks with base+1 experts and ranks with base experts have buffers of
    // different sizes: one Buffer each.
    struct Group {
      int64_t lo, hi, n;
    };
    for (const Group& g : {Group{0, extra, base + 1}, Group{extra, tp, base}}) {
      if (g.lo >= g.hi || g.n == 0) continue;
      const RankSetId all = tp_set(p, g.lo, g.hi);
      auto w13 = writer_.buffer(pre + "mlp.experts.w13_weight", {g.n, 2 * I, H}, all, m13);
      if (!w13) return w13.status();
      auto w2 = writer_.buffer(pre + "mlp.experts.w2_weight", {g.n, H, I}, all, m2);
      if (!w2) return w2.status();
      for (int64_t t = g.lo; t < g.hi; ++t) {
        const RankSetId ranks = tp_set(p, t, t + 1);
        const int64_t start = t * base + std::min(t, extra);
        for (int64_t j = 0; j < g.n; ++j) {
          const auto& x = L.experts[start + j];
          Index lead{};
          lead[0] = j;
          REFIT_RETURN_IF_ERROR(writer_.place_rows(x.gate, 0, I, *w13, 0, ranks, lead));
          REFIT_RETURN_IF_ERROR(writer_.place_rows(x.up, 0, I, *w13, I, ranks, lead));
          REFIT_RETURN_IF_ERROR(writer_.place_cols(x.down, 0, I, *w2, ranks, lead));
        }
      }
    }
    return Status::ok();
  }

  Status embeddings() {
    const int64_t tp = infer_.tp, first = 0, last = infer_.pp - 1;
    const auto padded = [&](int32_t t) {
      return (model_[t].shape[0] + kVocabPadding - 1) / kVocabPadding * kVocabPadding;
    };
    const auto vocab = [&](const char* name, int32_t t, int64_t p, const char* who) {
      return writer_.vocab_parallel(name, t, padded(t), tp, stage_set(p), tp_fn(p), who);
    };
    if (info_.embed >= 0) {
      REFIT_RETURN_IF_ERROR(vocab("model.embed_tokens.weight", info_.embed, first, "vLLM's VocabParallelEmbedding"));
      // Tied embeddings: the last stage builds embed_tokens too, and its
      // lm_head is that parameter.
      if (info_.tied() && last != first)
        REFIT_RETURN_IF_ERROR(vocab("model.embed_tokens.weight", info_.embed, last, "vLLM's VocabParallelEmbedding"));
    }
    if (info_.final_norm >= 0)
      REFIT_RETURN_IF_ERROR(writer_.replicate(info_.final_norm, "model.norm.weight", stage_set(last)));
    if (info_.lm_head >= 0)
      REFIT_RETURN_IF_ERROR(vocab("lm_head.weight", info_.lm_head, last, "vLLM's ParallelLMHead"));
    return Status::ok();
  }

  const InferSide& infer_;
  const Manifest& model_;
  const ModelInfo& info_;
  recipes::LayoutWriter writer_;
  recipes::RankSetCache sets_;
};

}  // namespace

Status add_vllm_receivers(Layout& layout, const InferSide& infer, const Manifest& model) {
  REFIT_RETURN_IF_ERROR(recipes::add_receiver_ranks(layout, infer));
  REFIT_RETURN_IF_ERROR(recipes::check_tensors_match(layout, model));
  auto info = recipes::analyze_model(model);
  if (!info) return info.status();
  return VllmBuilder(layout, infer, model, *info).build().with_context("vllm");
}

}  // namespace refit
