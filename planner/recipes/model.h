#pragma once
// What the recipes share: the model read from its Hugging Face names (which
// layer, which role, which expert each tensor is), the pipeline layer splits
// of each framework, and a writer that builds explicit buffers and regions,
// FP8 block-scale companions included.
//
// A manifest carries names and shapes; its Hugging Face config (model_config.h)
// carries what shapes do not tell. What a recipe needs is derived here, once,
// and checked against both: query heads, KV heads and head_dim from the config
// (head_dim else hidden_size / heads), which must match q_proj/k_proj rows and
// q_norm/k_norm; the vocabulary, tied embeddings, expert count and width, MLA
// ranks and the FP8 block size from the config, checked against the shapes;
// layer and expert counts from the largest index named. A key a layout needs
// and the config lacks is an error naming it: nothing is guessed.

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "planner/layout.h"
#include "planner/manifest.h"
#include "planner/scenario.h"
#include "planner/status.h"

namespace refit::recipes {

// DeepSeek-style 128x128 weight_scale_inv blocks, the only size laid out; a
// config with another quantization_config.weight_block_size is refused.
inline constexpr int64_t kFp8Block = 128;

// The role of a tensor in the model, by its Hugging Face name.
enum class Role : uint8_t {
  kEmbed,          // model.embed_tokens.weight
  kFinalNorm,      // model.norm.weight
  kLmHead,         // lm_head.weight
  kInputNorm,      // model.layers.i.input_layernorm.weight
  kPostAttnNorm,   // model.layers.i.post_attention_layernorm.weight
  kQ, kK, kV, kO,  // self_attn.{q,k,v,o}_proj (q/k/v also .bias)
  kQNorm, kKNorm,  // self_attn.{q,k}_norm
  kQA, kQANorm, kQB, kKVA, kKVANorm, kKVB,  // MLA: q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, ...
  kGate, kUp, kDown,                        // mlp.{gate,up,down}_proj of a dense layer
  kRouter, kRouterBias,                     // mlp.gate.weight, mlp.gate.e_score_correction_bias
  kExpertGate, kExpertUp, kExpertDown,      // mlp.experts.E.{gate,up,down}_proj
  kSharedGate, kSharedUp, kSharedDown,      // mlp.shared_experts.{gate,up,down}_proj
  kCount,
};
inline constexpr int kRoleCount = static_cast<int>(Role::kCount);

struct TensorRole {
  Role role = Role::kEmbed;
  int32_t layer = -1;   // -1 for embed, final norm, lm_head
  int32_t expert = -1;  // routed experts only
  bool bias = false;    // ".bias" of q/k/v
  bool scale = false;   // ".weight_scale_inv": the FP8 block scales of the weight of `role`
};

// Parses one Hugging Face name. Fails naming it when it matches no rule.
Result<TensorRole> parse_tensor_name(std::string_view name);

struct ExpertTensors {
  int32_t gate = -1, up = -1, down = -1;  // manifest indices
};

// One decoder layer. Indices are manifest indices, -1 when absent.
struct LayerInfo {
  std::array<int32_t, kRoleCount> weight;  // the ".weight" of each role (kExpert* unused)
  std::array<int32_t, kRoleCount> bias;    // the ".bias" of kQ/kK/kV
  std::vector<ExpertTensors> experts;      // routed experts, index == expert id
  bool gqa = false;        // q_proj/k_proj/v_proj/o_proj attention
  bool mla = false;        // DeepSeek multi-head latent attention
  bool dense_mlp = false;  // gate_proj/up_proj/down_proj
  bool moe = false;        // router and routed experts
  int64_t head_dim = 0, q_heads = 0, kv_heads = 0;  // gqa only
  int64_t inter = 0;          // dense MLP width
  int64_t expert_inter = 0;   // routed expert width
  int64_t shared_inter = 0;   // shared experts' width (0: none)

  LayerInfo() {
    weight.fill(-1);
    bias.fill(-1);
  }
  int32_t w(Role r) const { return weight[static_cast<int>(r)]; }
  int32_t b(Role r) const { return bias[static_cast<int>(r)]; }
  int64_t num_experts() const { return static_cast<int64_t>(experts.size()); }
};

struct ModelInfo {
  std::vector<LayerInfo> layers;
  int32_t embed = -1, final_norm = -1, lm_head = -1;
  int64_t vocab = 0, hidden = 0;       // from the embedding
  std::vector<TensorRole> roles;       // per manifest tensor
  std::vector<int32_t> scale_of;       // per manifest tensor: its weight_scale_inv, or -1
  // Tied embeddings: no lm_head.weight, the output layer reads the embedding.
  bool tied() const { return lm_head < 0 && embed >= 0; }
  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
};

// Reads every name and shape of `model`, and its config, and checks what the
// recipes rely on: each tensor's role, the dims of each role, q/k/v and gate/up present
// together, equal shapes across a layer's experts, scale shapes of 128x128
// blocks. Fails naming the tensor.
Result<ModelInfo> analyze_model(const Manifest& model);

// Checks that `layout` holds exactly the manifest's tensors in manifest
// order (the recipes address tensors by manifest index).
Status check_tensors_match(const Layout& layout, const Manifest& model);

// Checks a side's parallelism (every degree >= 1, gpus == the product,
// ep divides tp*cp*dp, gpus_per_domain >= 1) and gives the layout its ranks:
// domain = rank / gpus_per_domain, receiver instance = rank / (tp*pp). A
// layout that already has ranks of that side must have as many.
Status add_source_ranks(Layout& layout, const TrainSide& train);
Status add_receiver_ranks(Layout& layout, const InferSide& infer);

// Layers [begin, end) of one pipeline stage.
struct LayerRange {
  int64_t begin = 0, end = 0;
  bool contains(int64_t i) const { return i >= begin && i < end; }
};
// Megatron/torchtitan here: stage s holds [floor(s*L/pp), floor((s+1)*L/pp)).
LayerRange balanced_stage_layers(int64_t layers, int64_t pp, int64_t stage);
// vLLM's get_pp_indices (no VLLM_PP_LAYER_PARTITION): L/pp each, the L%pp
// extra layers one each to the stages just before the last.
LayerRange vllm_stage_layers(int64_t layers, int64_t pp, int64_t stage);

// Chunk i of k equal chunks of n (REQUIRES n % k == 0).
inline int64_t chunk_begin(int64_t n, int64_t k, int64_t i) { return i * (n / k); }

// "tensor \"name\"" for messages.
std::string quoted(const Manifest& model, int32_t tensor);

// A buffer under construction: the weight buffer and, when its tensors are
// FP8 with block scales, the "<name>_scale_inv" buffer beside it.
struct BufferRef {
  uint32_t weight = 0;
  int64_t scale = -1;  // buffer index, or -1
  std::vector<int64_t> shape;
  std::string name;
};

using TpSetFn = std::function<RankSetId(int64_t tp_rank)>;

// Builds explicit buffers and regions on one side of a layout. Every tensor
// placed with a weight_scale_inv companion gets the matching scale region in
// the companion buffer: a weight box covering rows [r0, r1) and cols [c0, c1)
// at a 128-aligned place maps to scale blocks [r0/128, ceil(r1/128)) x
// [c0/128, ceil(c1/128)). A shard boundary inside a block is an error naming
// the tensor: vLLM refuses such a split, and so would any block-scaled
// trainer, since one scale would then belong to two shards.
class LayoutWriter {
 public:
  LayoutWriter(Layout& layout, Side side, const Manifest& model, const ModelInfo& info)
      : layout_(layout), side_(side), model_(model), info_(info) {}

  // A buffer `name` of shape `shape` on every rank of `ranks`, for the
  // tensors `members` (manifest indices, -1 entries ignored): they must share
  // a dtype, and either all have weight_scale_inv companions or none.
  Result<BufferRef> buffer(std::string name, std::vector<int64_t> shape, RankSetId ranks,
                           std::initializer_list<int32_t> members);
  Result<BufferRef> buffer(std::string name, std::vector<int64_t> shape, RankSetId ranks,
                           const std::vector<int32_t>& members);

  // Places `box` of `tensor` at `local` (one coordinate per buffer dim; the
  // tensor's dims are the buffer's trailing dims) for the ranks `ranks`, and
  // its scale blocks in the companion buffer. An empty box places nothing.
  Status place(int32_t tensor, const Box& box, const BufferRef& buf, const Index& local, RankSetId ranks);

  // The whole tensor alone in a buffer named `name`, replicated on `ranks`.
  Status replicate(int32_t tensor, std::string name, RankSetId ranks);

  // Rows [row0, row0 + rows) of `tensor` (whole rows) at row `local_row` of
  // a buffer whose trailing dims are the tensor's.
  Status place_rows(int32_t tensor, int64_t row0, int64_t rows, const BufferRef& buf, int64_t local_row,
                    RankSetId ranks, const Index& lead = {});
  // Columns [col0, col0 + cols) of a 2-D tensor at column 0 of `buf`.
  Status place_cols(int32_t tensor, int64_t col0, int64_t cols, const BufferRef& buf, RankSetId ranks,
                    const Index& lead = {});

  // The framework patterns, shared by both sides. `tp_set(t)` is the rank
  // set of TP rank t (every rank that holds what TP rank t holds); `all` is
  // the set of every rank that has the buffer. `who` names the framework's
  // rule in messages ("vLLM's ColumnParallelLinear").
  //
  // Column-parallel: TP rank t's buffer is cat(chunk t of each member along
  // dim 0), e.g. gate_up_proj = cat(gate_t, up_t). Each member's dim 0 must
  // divide by tp.
  Status column_parallel(std::string name, const std::vector<int32_t>& members, int64_t tp, RankSetId all,
                         const TpSetFn& tp_set, std::string_view who);
  // Row-parallel: TP rank t holds column chunk t of a 2-D tensor.
  Status row_parallel(std::string name, int32_t tensor, int64_t tp, RankSetId all, const TpSetFn& tp_set,
                      std::string_view who);
  // The members whole, concatenated along dim 0, on every rank of `ranks`
  // (e.g. vLLM's replicated fused_qkv_a_proj).
  Status replicate_fused(std::string name, const std::vector<int32_t>& members, RankSetId ranks);
  // A vocab-parallel embedding padded to `padded` rows: TP rank t's buffer
  // has padded/tp rows; rows past the real vocabulary are padding, never
  // written. `padded` must divide by tp.
  Status vocab_parallel(std::string name, int32_t tensor, int64_t padded, int64_t tp, RankSetId all,
                        const TpSetFn& tp_set, std::string_view who);

  // Fails with a message naming `tensor` unless every tensor of the layout
  // has at least one region on this side: a role that a recipe forgot.
  Status check_all_placed() const;

 private:
  Status place_scale(int32_t tensor, const Box& box, const BufferRef& buf, const Index& local, RankSetId ranks);

  Layout& layout_;
  Side side_;
  const Manifest& model_;
  const ModelInfo& info_;
};

// The full shape of `tensor` as a Box, with dim 0 cut to [row0, row0 + rows).
Box row_box(const ManifestTensor& t, int64_t row0, int64_t rows);

// Interned rank sets of one side, cached by a small key: recipes ask for the
// same few sets (a stage, a TP rank of a stage, an EP rank) thousands of times.
class RankSetCache {
 public:
  explicit RankSetCache(RankSets& sets) : sets_(sets) {}
  template <typename Fill>
  RankSetId get(int64_t a, int64_t b, int64_t c, Fill&& fill) {
    auto key = std::make_tuple(a, b, c);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    std::vector<int32_t> ranks;
    fill(ranks);
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    RankSetId id = sets_.intern(ranks);
    cache_.emplace(key, id);
    return id;
  }

 private:
  RankSets& sets_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, RankSetId> cache_;
};

}  // namespace refit::recipes
