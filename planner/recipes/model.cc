#include "planner/recipes/model.h"

#include <charconv>
#include <utility>

namespace refit::recipes {
namespace {

constexpr int32_t kMaxLayers = 1 << 16;   // names beyond this are typos, not models
constexpr int32_t kMaxExperts = 1 << 16;

// Reads a decimal index at the front of `s` up to the next '.', and drops it
// and the dot. Refuses signs, leading zeros and absurd values.
bool take_index(std::string_view& s, int32_t limit, int32_t* out) {
  size_t dot = s.find('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  std::string_view digits = s.substr(0, dot);
  if (digits.size() > 1 && digits[0] == '0') return false;
  for (char c : digits)
    if (c < '0' || c > '9') return false;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), *out);
  if (ec != std::errc() || p != digits.data() + digits.size() || *out >= limit) return false;
  s.remove_prefix(dot + 1);
  return true;
}

bool consume(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

struct Rule {
  std::string_view suffix;
  Role role;
  bool bias;
};

// Names inside "model.layers.{i}.".
constexpr Rule kLayerRules[] = {
    {"input_layernorm.weight", Role::kInputNorm, false},
    {"post_attention_layernorm.weight", Role::kPostAttnNorm, false},
    {"self_attn.q_proj.weight", Role::kQ, false},
    {"self_attn.q_proj.bias", Role::kQ, true},
    {"self_attn.k_proj.weight", Role::kK, false},
    {"self_attn.k_proj.bias", Role::kK, true},
    {"self_attn.v_proj.weight", Role::kV, false},
    {"self_attn.v_proj.bias", Role::kV, true},
    {"self_attn.o_proj.weight", Role::kO, false},
    {"self_attn.q_norm.weight", Role::kQNorm, false},
    {"self_attn.k_norm.weight", Role::kKNorm, false},
    {"self_attn.q_a_proj.weight", Role::kQA, false},
    {"self_attn.q_a_layernorm.weight", Role::kQANorm, false},
    {"self_attn.q_b_proj.weight", Role::kQB, false},
    {"self_attn.kv_a_proj_with_mqa.weight", Role::kKVA, false},
    {"self_attn.kv_a_layernorm.weight", Role::kKVANorm, false},
    {"self_attn.kv_b_proj.weight", Role::kKVB, false},
    {"mlp.gate_proj.weight", Role::kGate, false},
    {"mlp.up_proj.weight", Role::kUp, false},
    {"mlp.down_proj.weight", Role::kDown, false},
    {"mlp.gate.weight", Role::kRouter, false},
    {"mlp.gate.e_score_correction_bias", Role::kRouterBias, false},
    {"mlp.shared_experts.gate_proj.weight", Role::kSharedGate, false},
    {"mlp.shared_experts.up_proj.weight", Role::kSharedUp, false},
    {"mlp.shared_experts.down_proj.weight", Role::kSharedDown, false},
};

bool is_projection(Role r) {
  switch (r) {
    case Role::kQ: case Role::kK: case Role::kV: case Role::kO:
    case Role::kQA: case Role::kQB: case Role::kKVA: case Role::kKVB:
    case Role::kGate: case Role::kUp: case Role::kDown:
    case Role::kExpertGate: case Role::kExpertUp: case Role::kExpertDown:
    case Role::kSharedGate: case Role::kSharedUp: case Role::kSharedDown:
      return true;
    default:
      return false;
  }
}

// Dims a role's tensor must have.
int expected_dims(const TensorRole& r) {
  if (r.scale) return 2;
  if (r.bias) return 1;
  return is_projection(r.role) || r.role == Role::kEmbed || r.role == Role::kLmHead || r.role == Role::kRouter ? 2
                                                                                                             : 1;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

Result<TensorRole> parse_tensor_name(std::string_view name) {
  TensorRole r;
  const auto no_rule = [&] {
    return Status::invalid("tensor \"" + std::string(name) +
                           "\" matches no rule of the recipes (expected Llama/Qwen3/Qwen3-MoE/DeepSeek-V3 "
                           "Hugging Face names)");
  };
  std::string_view s = name;
  constexpr std::string_view kScale = "_scale_inv";
  if (s.size() > kScale.size() && s.substr(s.size() - kScale.size()) == kScale) {
    s.remove_suffix(kScale.size());
    if (s.size() < 7 || s.substr(s.size() - 7) != ".weight") return no_rule();
    r.scale = true;
  }
  if (s == "model.embed_tokens.weight") r.role = Role::kEmbed;
  else if (s == "model.norm.weight") r.role = Role::kFinalNorm;
  else if (s == "lm_head.weight") r.role = Role::kLmHead;
  else {
    if (!consume(s, "model.layers.") || !take_index(s, kMaxLayers, &r.layer)) return no_rule();
    bool found = false;
    for (const Rule& rule : kLayerRules) {
      if (s == rule.suffix) {
        r.role = rule.role;
        r.bias = rule.bias;
        found = true;
        break;
      }
    }
    if (!found) {
      if (!consume(s, "mlp.experts.") || !take_index(s, kMaxExperts, &r.expert)) return no_rule();
      if (s == "gate_proj.weight") r.role = Role::kExpertGate;
      else if (s == "up_proj.weight") r.role = Role::kExpertUp;
      else if (s == "down_proj.weight") r.role = Role::kExpertDown;
      else return no_rule();
    }
  }
  if (r.scale && !is_projection(r.role))
    return Status::invalid("tensor \"" + std::string(name) +
                           "\": block scales are supported for linear projections only");
  return r;
}

std::string quoted(const Manifest& model, int32_t tensor) { return "tensor \"" + model[tensor].name + "\""; }

namespace {

// Heads and head_dim of a GQA layer from the config, checked against the
// shapes: q_proj rows = heads * head_dim, k_proj rows = KV heads * head_dim,
// q_norm/k_norm = head_dim.
Status attention_heads(const Manifest& model, LayerInfo& L, const std::string& where) {
  const ModelConfig& c = model.config;
  const std::string why = "attention (" + where + ")";
  auto heads = c.require(c.num_attention_heads, "num_attention_heads", why);
  if (!heads) return heads.status();
  auto kv = c.require(c.num_key_value_heads, "num_key_value_heads", why);
  if (!kv) return kv.status();
  auto hd = c.attention_head_dim(why);
  if (!hd) return hd.status();
  L.head_dim = *hd;
  L.q_heads = *heads;
  L.kv_heads = *kv;
  const auto rows = [&](Role r) { return model[L.w(r)].shape[0]; };
  const std::string said = " (" + c.origin + ": " + std::to_string(L.q_heads) + " heads, " +
                           std::to_string(L.kv_heads) + " KV heads, head_dim " + std::to_string(L.head_dim) + ")";
  if (rows(Role::kQ) != L.q_heads * L.head_dim)
    return Status::invalid(quoted(model, L.w(Role::kQ)) + " has " + std::to_string(rows(Role::kQ)) +
                           " rows, the config says " + std::to_string(L.q_heads * L.head_dim) + said);
  if (rows(Role::kK) != L.kv_heads * L.head_dim)
    return Status::invalid(quoted(model, L.w(Role::kK)) + " has " + std::to_string(rows(Role::kK)) +
                           " rows, the config says " + std::to_string(L.kv_heads * L.head_dim) + said);
  for (Role r : {Role::kQNorm, Role::kKNorm})
    if (L.w(r) >= 0 && rows(r) != L.head_dim)
      return Status::invalid(quoted(model, L.w(r)) + " has " + std::to_string(rows(r)) + " entries, head_dim is " +
                             std::to_string(L.head_dim) + said);
  if (L.q_heads % L.kv_heads != 0)
    return Status::invalid(quoted(model, L.w(Role::kK)) + ": " + std::to_string(L.q_heads) + " query heads over " +
                           std::to_string(L.kv_heads) + " KV heads do not form equal groups" + said);
  return Status::ok();
}

// MLA shapes against the config's ranks (DeepSeek-V2/V3): kv_a rows =
// kv_lora_rank + qk_rope_head_dim, kv_b rows = heads * (qk_nope + v_head_dim),
// the query path's rows = heads * (qk_nope + qk_rope), q_a rows = q_lora_rank.
Status mla_ranks(const Manifest& model, const LayerInfo& L, const std::string& where) {
  const ModelConfig& c = model.config;
  const std::string why = "multi-head latent attention (" + where + ")";
  auto heads = c.require(c.num_attention_heads, "num_attention_heads", why);
  if (!heads) return heads.status();
  auto kv_rank = c.require(c.kv_lora_rank, "kv_lora_rank", why);
  if (!kv_rank) return kv_rank.status();
  auto nope = c.require(c.qk_nope_head_dim, "qk_nope_head_dim", why);
  if (!nope) return nope.status();
  auto rope = c.require(c.qk_rope_head_dim, "qk_rope_head_dim", why);
  if (!rope) return rope.status();
  auto v = c.require(c.v_head_dim, "v_head_dim", why);
  if (!v) return v.status();
  const auto check = [&](Role r, int64_t want, const std::string& rule) -> Status {
    if (L.w(r) < 0 || model[L.w(r)].shape[0] == want) return Status::ok();
    return Status::invalid(quoted(model, L.w(r)) + " has " + std::to_string(model[L.w(r)].shape[0]) +
                           " rows; " + c.origin + " says " + rule + " = " + std::to_string(want));
  };
  REFIT_RETURN_IF_ERROR(check(Role::kKVA, *kv_rank + *rope, "kv_lora_rank + qk_rope_head_dim"));
  REFIT_RETURN_IF_ERROR(check(Role::kKVB, *heads * (*nope + *v), "num_attention_heads * (qk_nope_head_dim + v_head_dim)"));
  REFIT_RETURN_IF_ERROR(
      check(L.w(Role::kQB) >= 0 ? Role::kQB : Role::kQ, *heads * (*nope + *rope),
            "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"));
  if (L.w(Role::kQA) >= 0) {
    if (!c.has_q_lora_rank || !c.q_lora_rank)
      return Status::invalid(c.require(std::nullopt, "q_lora_rank", why).status().message() +
                             " (the model has q_a_proj)");
    REFIT_RETURN_IF_ERROR(check(Role::kQA, *c.q_lora_rank, "q_lora_rank"));
  }
  return Status::ok();
}

// The model-wide facts against the config: vocabulary, tied embeddings,
// experts, the FP8 block size.
Status check_model_config(const Manifest& model, const ModelInfo& info) {
  const ModelConfig& c = model.config;
  if (info.embed >= 0) {
    auto vocab = c.require(c.vocab_size, "vocab_size", "the embedding");
    if (!vocab) return vocab.status();
    for (int32_t t : {info.embed, info.lm_head})
      if (t >= 0 && model[t].shape[0] != *vocab)
        return Status::invalid(quoted(model, t) + " has " + std::to_string(model[t].shape[0]) + " rows; " + c.origin +
                               " says \"vocab_size\": " + std::to_string(*vocab));
    if (!c.tie_word_embeddings)
      return Status::invalid(c.require(std::nullopt, "tie_word_embeddings", "the output layer").status().message());
    if (*c.tie_word_embeddings && info.lm_head >= 0)
      return Status::invalid(quoted(model, info.lm_head) + ": " + c.origin +
                             " says \"tie_word_embeddings\": true, so the model has no lm_head of its own");
    if (!*c.tie_word_embeddings && info.lm_head < 0 && info.final_norm >= 0)
      return Status::invalid(c.origin + " says \"tie_word_embeddings\": false, but the manifest has no "
                             "lm_head.weight");
  }
  int64_t first_moe = -1;
  for (size_t li = 0; li < info.layers.size(); ++li) {
    const LayerInfo& L = info.layers[li];
    if (!L.moe) continue;
    if (first_moe < 0) first_moe = static_cast<int64_t>(li);
    const std::string why = "the routed experts (layer " + std::to_string(li) + ")";
    auto experts = c.require(c.num_experts, "num_experts\" or \"n_routed_experts", why);
    if (!experts) return experts.status();
    if (L.num_experts() != *experts)
      return Status::invalid("layer " + std::to_string(li) + " has " + std::to_string(L.num_experts()) +
                             " routed experts in the manifest; " + c.origin + " says " + std::to_string(*experts));
    auto width = c.require(c.moe_intermediate_size, "moe_intermediate_size", why);
    if (!width) return width.status();
    if (L.expert_inter != *width)
      return Status::invalid(quoted(model, L.experts[0].gate) + " has " + std::to_string(L.expert_inter) + " rows; " +
                             c.origin + " says \"moe_intermediate_size\": " + std::to_string(*width));
  }
  if (c.first_k_dense_replace && first_moe >= 0 && first_moe != *c.first_k_dense_replace)
    return Status::invalid("the first layer with routed experts is " + std::to_string(first_moe) + "; " + c.origin +
                           " says \"first_k_dense_replace\": " + std::to_string(*c.first_k_dense_replace));
  for (int32_t s : info.scale_of) {
    if (s < 0) continue;
    if (!c.weight_block_size)
      return Status::invalid(c.require(std::nullopt, "quantization_config.weight_block_size",
                                       "the FP8 block scales (" + quoted(model, s) + ")")
                                 .status()
                                 .message());
    if ((*c.weight_block_size)[0] != kFp8Block || (*c.weight_block_size)[1] != kFp8Block)
      return Status::unsupported(c.origin + ": \"quantization_config.weight_block_size\" is [" +
                                 std::to_string((*c.weight_block_size)[0]) + ", " +
                                 std::to_string((*c.weight_block_size)[1]) + "]; refit lays out 128x128 blocks only");
    break;
  }
  return Status::ok();
}

}  // namespace

Result<ModelInfo> analyze_model(const Manifest& model) {
  ModelInfo info;
  if (model.size() >= (size_t{1} << 31)) return Status::invalid("manifest has too many tensors");
  const int32_t n = static_cast<int32_t>(model.size());
  info.roles.resize(n);
  info.scale_of.assign(n, -1);
  std::vector<int32_t> scales;  // tensors that are block scales, resolved after all weights are known
  int32_t max_layer = -1;
  for (int32_t i = 0; i < n; ++i) {
    auto role = parse_tensor_name(model[i].name);
    if (!role) return role.status();
    const int dims = expected_dims(*role);
    if (static_cast<int>(model[i].shape.size()) != dims)
      return Status::invalid(quoted(model, i) + " has shape " + shape_string(model[i].shape) + "; its role needs " +
                             std::to_string(dims) + " dims");
    for (int64_t d : model[i].shape)
      if (d <= 0) return Status::invalid(quoted(model, i) + " has an empty dim: " + shape_string(model[i].shape));
    info.roles[i] = *role;
    max_layer = std::max(max_layer, role->layer);
  }
  info.layers.resize(static_cast<size_t>(max_layer + 1));

  const auto twice = [&](int32_t i) { return Status::invalid(quoted(model, i) + " is named twice in the manifest"); };
  for (int32_t i = 0; i < n; ++i) {
    const TensorRole& r = info.roles[i];
    if (r.scale) {
      scales.push_back(i);
      continue;
    }
    int32_t* slot = nullptr;
    if (r.layer < 0) {
      slot = r.role == Role::kEmbed ? &info.embed : r.role == Role::kFinalNorm ? &info.final_norm : &info.lm_head;
    } else {
      LayerInfo& L = info.layers[r.layer];
      if (r.expert >= 0) {
        if (static_cast<size_t>(r.expert) >= L.experts.size()) L.experts.resize(r.expert + 1);
        ExpertTensors& e = L.experts[r.expert];
        slot = r.role == Role::kExpertGate ? &e.gate : r.role == Role::kExpertUp ? &e.up : &e.down;
      } else {
        slot = r.bias ? &L.bias[static_cast<int>(r.role)] : &L.weight[static_cast<int>(r.role)];
      }
    }
    if (*slot >= 0) return twice(i);
    *slot = i;
  }

  // Block scales: find the weight each belongs to and check its block grid.
  for (int32_t s : scales) {
    const TensorRole& r = info.roles[s];
    int32_t w = -1;
    if (r.layer >= 0) {
      const LayerInfo& L = info.layers[r.layer];
      if (r.expert >= 0) {
        if (static_cast<size_t>(r.expert) < L.experts.size()) {
          const ExpertTensors& e = L.experts[r.expert];
          w = r.role == Role::kExpertGate ? e.gate : r.role == Role::kExpertUp ? e.up : e.down;
        }
      } else {
        w = L.w(r.role);
      }
    }
    if (w < 0)
      return Status::invalid(quoted(model, s) + " is a block scale of a weight the manifest does not have");
    if (info.scale_of[w] >= 0) return twice(s);
    const auto& ws = model[w].shape;
    std::vector<int64_t> want = {ceil_div(ws[0], kFp8Block), ceil_div(ws[1], kFp8Block)};
    if (model[s].shape != want)
      return Status::invalid(quoted(model, s) + " has shape " + shape_string(model[s].shape) + "; 128x128 blocks of " +
                             quoted(model, w) + " " + shape_string(ws) + " need " + shape_string(want));
    info.scale_of[w] = s;
  }

  if (info.embed >= 0) {
    info.vocab = model[info.embed].shape[0];
    info.hidden = model[info.embed].shape[1];
  }

  for (size_t li = 0; li < info.layers.size(); ++li) {
    LayerInfo& L = info.layers[li];
    const std::string where = "layer " + std::to_string(li);
    const auto has = [&](Role r) { return L.w(r) >= 0; };
    const auto shape = [&](Role r) -> const std::vector<int64_t>& { return model[L.w(r)].shape; };
    const auto missing = [&](Role have, const char* need) {
      return Status::invalid(quoted(model, L.w(have)) + ": " + where + " has no " + need + " to go with it");
    };

    // Attention.
    L.mla = has(Role::kKVA) || has(Role::kKVB) || has(Role::kQA) || has(Role::kQB);
    L.gqa = !L.mla && (has(Role::kQ) || has(Role::kK) || has(Role::kV));
    if (L.mla) {
      for (Role r : {Role::kKVA, Role::kKVB, Role::kQA, Role::kQB, Role::kQ}) {
        if (!has(r)) continue;
        if (!has(Role::kKVA)) return missing(r, "kv_a_proj_with_mqa");
        if (!has(Role::kKVB)) return missing(r, "kv_b_proj");
        if (!has(Role::kO)) return missing(r, "o_proj");
        if (has(Role::kQA) != has(Role::kQB)) return missing(r, "q_a_proj and q_b_proj together");
        if (!has(Role::kQA) && !has(Role::kQ)) return missing(r, "q_a_proj/q_b_proj or q_proj");
        if (has(Role::kQA) && has(Role::kQ)) return missing(r, "single query path (both q_proj and q_a_proj)");
        break;
      }
      for (Role r : {Role::kK, Role::kV, Role::kQNorm, Role::kKNorm})
        if (has(r)) return Status::invalid(quoted(model, L.w(r)) + ": " + where + " mixes MLA and GQA attention");
      if (has(Role::kQANorm) && !has(Role::kQA)) return missing(Role::kQANorm, "q_a_proj");
      if (has(Role::kKVANorm) && !has(Role::kKVA)) return missing(Role::kKVANorm, "kv_a_proj_with_mqa");
      REFIT_RETURN_IF_ERROR(mla_ranks(model, L, where));
      if (has(Role::kQA) && has(Role::kKVA) && shape(Role::kQA)[1] != shape(Role::kKVA)[1])
        return Status::invalid(quoted(model, L.w(Role::kKVA)) + ": input width " +
                               std::to_string(shape(Role::kKVA)[1]) + " differs from q_a_proj's " +
                               std::to_string(shape(Role::kQA)[1]) + ", they cannot be fused");
    } else if (L.gqa) {
      for (Role r : {Role::kQ, Role::kK, Role::kV}) {
        if (has(r)) {
          if (!has(Role::kQ)) return missing(r, "q_proj");
          if (!has(Role::kK)) return missing(r, "k_proj");
          if (!has(Role::kV)) return missing(r, "v_proj");
          if (!has(Role::kO)) return missing(r, "o_proj");
          break;
        }
      }
      if (shape(Role::kK) != shape(Role::kV))
        return Status::invalid(quoted(model, L.w(Role::kV)) + " has shape " + shape_string(shape(Role::kV)) +
                               ", k_proj " + shape_string(shape(Role::kK)) + ": K and V must match");
      if (shape(Role::kQ)[1] != shape(Role::kK)[1])
        return Status::invalid(quoted(model, L.w(Role::kK)) + ": input width " + std::to_string(shape(Role::kK)[1]) +
                               " differs from q_proj's " + std::to_string(shape(Role::kQ)[1]));
      for (Role r : {Role::kQ, Role::kK, Role::kV}) {
        int32_t b = L.b(r);
        if (b >= 0 && model[b].shape[0] != shape(r)[0])
          return Status::invalid(quoted(model, b) + " has " + std::to_string(model[b].shape[0]) +
                                 " entries for a weight of " + std::to_string(shape(r)[0]) + " rows");
      }
      REFIT_RETURN_IF_ERROR(attention_heads(model, L, where));
    } else {
      for (Role r : {Role::kO, Role::kQNorm, Role::kKNorm, Role::kQANorm, Role::kKVANorm, Role::kInputNorm})
        if (has(r)) return Status::invalid(quoted(model, L.w(r)) + ": " + where + " has no q/k/v projections");
    }

    // MLP: dense or mixture of experts, not both.
    const auto check_mlp = [&](Role g, Role u, Role d, const char* what, int64_t* width) -> Status {
      if (!has(g) && !has(u) && !has(d)) return Status::ok();
      for (Role r : {g, u, d}) {
        if (has(r)) {
          if (!has(g) || !has(u) || !has(d))
            return missing(r, (std::string(what) + " gate_proj, up_proj and down_proj together").c_str());
          break;
        }
      }
      const auto& gs = shape(g);
      if (shape(u) != gs || shape(d) != std::vector<int64_t>{gs[1], gs[0]})
        return Status::invalid(quoted(model, L.w(d)) + ": " + what + " gate/up/down shapes " + shape_string(gs) +
                               ", " + shape_string(shape(u)) + ", " + shape_string(shape(d)) + " do not match");
      *width = gs[0];
      return Status::ok();
    };
    REFIT_RETURN_IF_ERROR(check_mlp(Role::kGate, Role::kUp, Role::kDown, "dense MLP", &L.inter));
    REFIT_RETURN_IF_ERROR(
        check_mlp(Role::kSharedGate, Role::kSharedUp, Role::kSharedDown, "shared experts", &L.shared_inter));
    L.dense_mlp = has(Role::kGate);
    L.moe = has(Role::kRouter) || !L.experts.empty();
    if (L.moe) {
      if (L.experts.empty()) return missing(Role::kRouter, "routed experts");
      if (!has(Role::kRouter))
        return Status::invalid(where + " has routed experts but no router (mlp.gate.weight)");
      if (L.dense_mlp) return Status::invalid(quoted(model, L.w(Role::kGate)) + ": " + where +
                                              " has both a dense MLP and routed experts");
      std::vector<int64_t> gs;
      for (size_t e = 0; e < L.experts.size(); ++e) {
        const ExpertTensors& x = L.experts[e];
        if (x.gate < 0 || x.up < 0 || x.down < 0)
          return Status::invalid(where + ": expert " + std::to_string(e) + " of " +
                                 std::to_string(L.experts.size()) +
                                 " lacks its gate_proj, up_proj or down_proj (experts are numbered from 0 "
                                 "without gaps)");
        if (e == 0) gs = model[x.gate].shape;
        if (model[x.gate].shape != gs || model[x.up].shape != gs ||
            model[x.down].shape != std::vector<int64_t>{gs[1], gs[0]})
          return Status::invalid(quoted(model, x.down) + ": expert shapes differ within " + where +
                                 "; fused expert buffers need equal shapes");
      }
      L.expert_inter = gs[0];
      if (model[L.w(Role::kRouter)].shape[0] != L.num_experts())
        return Status::invalid(quoted(model, L.w(Role::kRouter)) + " routes to " +
                               std::to_string(model[L.w(Role::kRouter)].shape[0]) + " experts, the manifest names " +
                               std::to_string(L.num_experts()));
    } else {
      if (has(Role::kRouterBias)) return missing(Role::kRouterBias, "router");
      if (has(Role::kSharedGate)) return missing(Role::kSharedGate, "routed experts");
    }
    if (has(Role::kPostAttnNorm) && !L.dense_mlp && !L.moe) return missing(Role::kPostAttnNorm, "MLP");
  }
  REFIT_RETURN_IF_ERROR(check_model_config(model, info));
  return info;
}

Status check_tensors_match(const Layout& layout, const Manifest& model) {
  if (layout.tensors.size() != model.size())
    return Status::invalid("the layout has " + std::to_string(layout.tensors.size()) + " tensors, the manifest " +
                           std::to_string(model.size()) + ": add every manifest tensor, in order, first");
  for (size_t i = 0; i < model.size(); ++i) {
    if (layout.tensors[i].name != model[i].name || layout.tensors[i].shape != model[i].shape ||
        layout.tensors[i].dtype != model[i].dtype)
      return Status::invalid("layout tensor " + std::to_string(i) + " \"" + layout.tensors[i].name +
                             "\" differs from manifest tensor \"" + model[i].name +
                             "\" (name, shape or dtype): add the manifest's tensors in manifest order");
  }
  return Status::ok();
}

namespace {

Status check_degrees(const char* side, std::initializer_list<std::pair<const char*, int64_t>> degrees) {
  for (const auto& [key, v] : degrees)
    if (v < 1 || v > (int64_t{1} << 20))
      return Status::invalid(std::string(side) + "." + key + " must be between 1 and 2^20, got " + std::to_string(v));
  return Status::ok();
}

}  // namespace

Status add_source_ranks(Layout& layout, const TrainSide& train) {
  REFIT_RETURN_IF_ERROR(check_degrees("train", {{"gpus", train.gpus}, {"tp", train.tp}, {"cp", train.cp},
                                                {"dp", train.dp}, {"pp", train.pp}, {"ep", train.ep},
                                                {"gpus_per_domain", train.gpus_per_domain}}));
  if (train.gpus != train.tp * train.cp * train.dp * train.pp)
    return Status::invalid("train.gpus is " + std::to_string(train.gpus) + " but tp*cp*dp*pp is " +
                           std::to_string(train.tp * train.cp * train.dp * train.pp));
  if ((train.tp * train.cp * train.dp) % train.ep != 0)
    return Status::invalid("train.ep=" + std::to_string(train.ep) + " does not divide tp*cp*dp=" +
                           std::to_string(train.tp * train.cp * train.dp));
  if (!layout.sources.empty()) {
    if (layout.num_ranks(Side::kSource) != train.gpus)
      return Status::invalid("the layout already has " + std::to_string(layout.sources.size()) +
                             " source ranks, the training side " + std::to_string(train.gpus));
    return Status::ok();
  }
  layout.sources.resize(static_cast<size_t>(train.gpus));
  for (int64_t r = 0; r < train.gpus; ++r) layout.sources[r].domain = static_cast<int32_t>(r / train.gpus_per_domain);
  return Status::ok();
}

Status add_receiver_ranks(Layout& layout, const InferSide& infer) {
  REFIT_RETURN_IF_ERROR(check_degrees("infer", {{"gpus", infer.gpus}, {"tp", infer.tp}, {"dp", infer.dp},
                                                {"pp", infer.pp}, {"gpus_per_domain", infer.gpus_per_domain}}));
  if (infer.gpus != infer.tp * infer.dp * infer.pp)
    return Status::invalid("infer.gpus is " + std::to_string(infer.gpus) + " but tp*dp*pp is " +
                           std::to_string(infer.tp * infer.dp * infer.pp));
  if (!layout.receivers.empty()) {
    if (layout.num_ranks(Side::kReceiver) != infer.gpus)
      return Status::invalid("the layout already has " + std::to_string(layout.receivers.size()) +
                             " receiver ranks, the inference side " + std::to_string(infer.gpus));
    return Status::ok();
  }
  layout.receivers.resize(static_cast<size_t>(infer.gpus));
  for (int64_t r = 0; r < infer.gpus; ++r) {
    layout.receivers[r].domain = static_cast<int32_t>(r / infer.gpus_per_domain);
    layout.receivers[r].instance = static_cast<int32_t>(r / (infer.tp * infer.pp));
  }
  return Status::ok();
}

LayerRange balanced_stage_layers(int64_t layers, int64_t pp, int64_t stage) {
  return {stage * layers / pp, (stage + 1) * layers / pp};
}

LayerRange vllm_stage_layers(int64_t layers, int64_t pp, int64_t stage) {
  // partitions = [L // pp] * pp; partitions[-i] += 1 for i in 2 .. L % pp + 1.
  const int64_t base = layers / pp, extra = layers % pp;
  const auto size = [&](int64_t s) { return base + (s >= pp - 1 - extra && s < pp - 1 ? 1 : 0); };
  int64_t begin = 0;
  for (int64_t s = 0; s < stage; ++s) begin += size(s);
  return {begin, begin + size(stage)};
}

Box row_box(const ManifestTensor& t, int64_t row0, int64_t rows) {
  Box b = Box::whole(t.shape);
  b.start[0] = row0;
  b.size[0] = rows;
  return b;
}

Result<BufferRef> LayoutWriter::buffer(std::string name, std::vector<int64_t> shape, RankSetId ranks,
                                       std::initializer_list<int32_t> members) {
  return buffer(std::move(name), std::move(shape), ranks, std::vector<int32_t>(members));
}

Result<BufferRef> LayoutWriter::buffer(std::string name, std::vector<int64_t> shape, RankSetId ranks,
                                       const std::vector<int32_t>& members) {
  int32_t first = -1;
  for (int32_t m : members) {
    if (m < 0) continue;
    if (first < 0) {
      first = m;
      continue;
    }
    if (model_[m].dtype != model_[first].dtype)
      return Status::invalid("buffer \"" + name + "\" would hold " + quoted(model_, first) + " (" +
                             std::string(dtype_name(model_[first].dtype)) + ") and " + quoted(model_, m) + " (" +
                             std::string(dtype_name(model_[m].dtype)) + "): a fused parameter has one dtype");
    const int32_t sf = info_.scale_of[first], sm = info_.scale_of[m];
    if ((sf >= 0) != (sm >= 0))
      return Status::invalid("buffer \"" + name + "\" would hold " + quoted(model_, sf >= 0 ? m : first) +
                             " without a weight_scale_inv beside " + quoted(model_, sf >= 0 ? first : m) +
                             " with one: a fused FP8 parameter needs block scales for all its parts");
    if (sf >= 0 && model_[sf].dtype != model_[sm].dtype)
      return Status::invalid("buffer \"" + name + "_scale_inv\" would hold scales of two dtypes (" +
                             quoted(model_, sf) + ", " + quoted(model_, sm) + ")");
  }
  if (first < 0) return Status::internal("buffer \"" + name + "\" has no tensors");
  BufferRef ref;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const DType dtype = model_[first].dtype;
  ref.weight = layout_.add_buffer(Buffer{side_, name, dtype, numel * dtype_bytes(dtype), ranks});
  const int32_t s = info_.scale_of[first];
  if (s >= 0) {
    if (shape.size() < 2) return Status::internal("buffer \"" + name + "\": block scales need 2 dims");
    std::vector<int64_t> ss = shape;
    ss[ss.size() - 2] = ceil_div(ss[ss.size() - 2], kFp8Block);
    ss[ss.size() - 1] = ceil_div(ss[ss.size() - 1], kFp8Block);
    int64_t sn = 1;
    for (int64_t d : ss) sn *= d;
    const DType sd = model_[s].dtype;
    ref.scale = layout_.add_buffer(Buffer{side_, name + "_scale_inv", sd, sn * dtype_bytes(sd), ranks});
  }
  ref.shape = std::move(shape);
  ref.name = std::move(name);
  return ref;
}

Status LayoutWriter::place(int32_t tensor, const Box& box, const BufferRef& buf, const Index& local,
                           RankSetId ranks) {
  if (box.empty()) return Status::ok();
  const int nt = box.ndim;
  const int nb = static_cast<int>(buf.shape.size());
  if (nb < nt) return Status::internal(quoted(model_, tensor) + ": buffer \"" + buf.name + "\" has fewer dims");
  const Index bstr = row_major_strides(buf.shape);
  Region r;
  r.box = box;
  r.ranks = ranks;
  r.buffer = buf.weight;
  for (int d = 0; d < nb; ++d) {
    const int64_t size = d >= nb - nt ? box.size[d - (nb - nt)] : 1;
    if (local[d] < 0 || local[d] + size > buf.shape[d])
      return Status::internal(quoted(model_, tensor) + ": box " + box.to_string() + " does not fit buffer \"" +
                              buf.name + "\"");
    r.offset += local[d] * bstr[d];
  }
  for (int k = 0; k < nt; ++k) r.strides[k] = bstr[nb - nt + k];
  layout_.regions(static_cast<uint32_t>(tensor), side_).push_back(r);
  if (info_.scale_of[tensor] >= 0) return place_scale(tensor, box, buf, local, ranks);
  return Status::ok();
}

Status LayoutWriter::place_scale(int32_t tensor, const Box& box, const BufferRef& buf, const Index& local,
                                 RankSetId ranks) {
  const int32_t s = info_.scale_of[tensor];
  const int nb = static_cast<int>(buf.shape.size());
  if (buf.scale < 0 || box.ndim != 2)
    return Status::internal(quoted(model_, tensor) + ": buffer \"" + buf.name + "\" has no scale companion");
  const auto& full = model_[tensor].shape;
  static constexpr const char* kDimName[2] = {"rows", "columns"};
  Box sb;
  sb.ndim = 2;
  Index slocal = local;
  for (int k = 0; k < 2; ++k) {
    const int64_t lo = box.start[k], hi = box.end(k), at = local[nb - 2 + k];
    if (lo % kFp8Block != 0 || at % kFp8Block != 0 || (hi % kFp8Block != 0 && hi != full[k]))
      return Status::invalid(quoted(model_, tensor) + ": its shard " + kDimName[k] + " [" + std::to_string(lo) +
                             ", " + std::to_string(hi) + ") at " + std::to_string(at) + " of buffer \"" + buf.name +
                             "\" cut its 128x128 FP8 scale blocks (\"" + model_[s].name +
                             "\"): one scale cannot belong to two shards; choose a parallelism whose shards are "
                             "multiples of 128");
    sb.start[k] = lo / kFp8Block;
    sb.size[k] = ceil_div(hi, kFp8Block) - sb.start[k];
    slocal[nb - 2 + k] = at / kFp8Block;
  }
  std::vector<int64_t> sshape = buf.shape;
  sshape[nb - 2] = ceil_div(sshape[nb - 2], kFp8Block);
  sshape[nb - 1] = ceil_div(sshape[nb - 1], kFp8Block);
  const Index bstr = row_major_strides(sshape);
  Region r;
  r.box = sb;
  r.ranks = ranks;
  r.buffer = static_cast<uint32_t>(buf.scale);
  for (int d = 0; d < nb; ++d) r.offset += slocal[d] * bstr[d];
  r.strides[0] = bstr[nb - 2];
  r.strides[1] = bstr[nb - 1];
  layout_.regions(static_cast<uint32_t>(s), side_).push_back(r);
  return Status::ok();
}

Status LayoutWriter::replicate(int32_t tensor, std::string name, RankSetId ranks) {
  auto buf = buffer(std::move(name), model_[tensor].shape, ranks, {tensor});
  if (!buf) return buf.status();
  return place(tensor, Box::whole(model_[tensor].shape), *buf, Index{}, ranks);
}

Status LayoutWriter::place_rows(int32_t tensor, int64_t row0, int64_t rows, const BufferRef& buf, int64_t local_row,
                                RankSetId ranks, const Index& lead) {
  const int nt = static_cast<int>(model_[tensor].shape.size());
  const int nb = static_cast<int>(buf.shape.size());
  Index local = lead;
  for (int d = nb - nt; d < nb; ++d) local[d] = 0;
  local[nb - nt] = local_row;
  return place(tensor, row_box(model_[tensor], row0, rows), buf, local, ranks);
}

Status LayoutWriter::place_cols(int32_t tensor, int64_t col0, int64_t cols, const BufferRef& buf, RankSetId ranks,
                                const Index& lead) {
  const int nb = static_cast<int>(buf.shape.size());
  Box b = Box::whole(model_[tensor].shape);
  b.start[1] = col0;
  b.size[1] = cols;
  Index local = lead;
  local[nb - 2] = 0;
  local[nb - 1] = 0;
  return place(tensor, b, buf, local, ranks);
}

Status LayoutWriter::column_parallel(std::string name, const std::vector<int32_t>& members, int64_t tp,
                                     RankSetId all, const TpSetFn& tp_set, std::string_view who) {
  std::vector<int64_t> shape;
  for (int32_t m : members) {
    const auto& ms = model_[m].shape;
    if (ms[0] % tp != 0)
      return Status::invalid(quoted(model_, m) + ": " + std::to_string(ms[0]) + " rows do not split evenly over tp=" +
                             std::to_string(tp) + " (" + std::string(who) + " requires it)");
    if (shape.empty()) {
      shape = ms;
      shape[0] = 0;
    } else if (!std::equal(ms.begin() + 1, ms.end(), shape.begin() + 1, shape.end())) {
      return Status::invalid(quoted(model_, m) + ": its trailing dims differ from " + quoted(model_, members[0]) +
                             ", they cannot be fused into \"" + name + "\"");
    }
    shape[0] += ms[0] / tp;
  }
  auto buf = buffer(std::move(name), shape, all, members);
  if (!buf) return buf.status();
  for (int64_t t = 0; t < tp; ++t) {
    const RankSetId ranks = tp_set(t);
    int64_t at = 0;
    for (int32_t m : members) {
      const int64_t rows = model_[m].shape[0] / tp;
      REFIT_RETURN_IF_ERROR(place_rows(m, t * rows, rows, *buf, at, ranks));
      at += rows;
    }
  }
  return Status::ok();
}

Status LayoutWriter::row_parallel(std::string name, int32_t tensor, int64_t tp, RankSetId all, const TpSetFn& tp_set,
                                  std::string_view who) {
  const auto& ts = model_[tensor].shape;
  if (ts[1] % tp != 0)
    return Status::invalid(quoted(model_, tensor) + ": " + std::to_string(ts[1]) +
                           " columns do not split evenly over tp=" + std::to_string(tp) + " (" + std::string(who) +
                           " requires it)");
  const int64_t cols = ts[1] / tp;
  auto buf = buffer(std::move(name), {ts[0], cols}, all, {tensor});
  if (!buf) return buf.status();
  for (int64_t t = 0; t < tp; ++t) REFIT_RETURN_IF_ERROR(place_cols(tensor, t * cols, cols, *buf, tp_set(t)));
  return Status::ok();
}

Status LayoutWriter::replicate_fused(std::string name, const std::vector<int32_t>& members, RankSetId ranks) {
  std::vector<int64_t> shape;
  for (int32_t m : members) {
    const auto& ms = model_[m].shape;
    if (shape.empty()) {
      shape = ms;
      shape[0] = 0;
    } else if (!std::equal(ms.begin() + 1, ms.end(), shape.begin() + 1, shape.end())) {
      return Status::invalid(quoted(model_, m) + ": its trailing dims differ from " + quoted(model_, members[0]) +
                             ", they cannot be fused into \"" + name + "\"");
    }
    shape[0] += ms[0];
  }
  auto buf = buffer(std::move(name), shape, ranks, members);
  if (!buf) return buf.status();
  int64_t at = 0;
  for (int32_t m : members) {
    REFIT_RETURN_IF_ERROR(place_rows(m, 0, model_[m].shape[0], *buf, at, ranks));
    at += model_[m].shape[0];
  }
  return Status::ok();
}

Status LayoutWriter::vocab_parallel(std::string name, int32_t tensor, int64_t padded, int64_t tp, RankSetId all,
                                    const TpSetFn& tp_set, std::string_view who) {
  const auto& ts = model_[tensor].shape;
  if (padded % tp != 0)
    return Status::invalid(quoted(model_, tensor) + ": the padded vocabulary of " + std::to_string(padded) +
                           " rows (" + std::to_string(ts[0]) + " real) does not split evenly over tp=" +
                           std::to_string(tp) + " (" + std::string(who) + " requires it)");
  const int64_t per = padded / tp;
  auto buf = buffer(std::move(name), {per, ts[1]}, all, {tensor});
  if (!buf) return buf.status();
  for (int64_t t = 0; t < tp; ++t) {
    const int64_t lo = std::min(t * per, ts[0]), hi = std::min((t + 1) * per, ts[0]);
    REFIT_RETURN_IF_ERROR(place_rows(tensor, lo, hi - lo, *buf, 0, tp_set(t)));
  }
  return Status::ok();
}

Status LayoutWriter::check_all_placed() const {
  for (size_t i = 0; i < model_.size(); ++i)
    if (layout_.regions(static_cast<uint32_t>(i), side_).empty())
      return Status::internal(quoted(model_, static_cast<int32_t>(i)) + " got no " + side_name(side_) +
                              " region: a recipe rule is missing");
  return Status::ok();
}

}  // namespace refit::recipes
