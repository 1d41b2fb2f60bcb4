#!/usr/bin/env python3
"""Write the small model manifests that refit ships as examples.

A manifest is a safetensors header without byte offsets, in Hugging Face
parameter names: {"<name>": {"shape": [..], "dtype": "BF16"}, ...}. These two
models are small enough to plan, move and check on a laptop, and shaped like
the real ones (Llama/Qwen3 dense, Qwen3 MoE) so every recipe rule is used:

  small-dense  4 layers, hidden 512, 8 query heads, 2 KV heads of 64, with
               q_norm/k_norm, MLP 1536, vocabulary 32001 (odd on purpose: vLLM
               pads it to a multiple of 64, Megatron's shards end unevenly)
  small-moe    4 layers, hidden 256, 4 query heads, 2 KV heads of 64, with
               q_norm/k_norm, a router and 8 experts of width 128, vocab 4096
  small-moe-fp8  small-moe as an FP8 server holds it: projection weights in
               F8_E4M3 with 128x128 F32 block scales ("<name>_scale_inv"),
               and small-moe-fp8.config.json with its quantization_config

Beside each manifest NAME.json lies its Hugging Face config NAME.config.json:
head counts, head_dim, vocabulary, tied embeddings and experts, which the
recipes read instead of guessing them from shapes.

Run: python3 make_examples.py [outdir]   (default: this folder)
"""
import json
import sys
from pathlib import Path

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def tensor(*shape, dtype="BF16"):
    return {"shape": list(shape), "dtype": dtype}


def attention(m, prefix, hidden, heads, kv_heads, head_dim):
    m[f"{prefix}.input_layernorm.weight"] = tensor(hidden)
    a = f"{prefix}.self_attn"
    m[f"{a}.q_proj.weight"] = tensor(heads * head_dim, hidden)
    m[f"{a}.k_proj.weight"] = tensor(kv_heads * head_dim, hidden)
    m[f"{a}.v_proj.weight"] = tensor(kv_heads * head_dim, hidden)
    m[f"{a}.o_proj.weight"] = tensor(hidden, heads * head_dim)
    m[f"{a}.q_norm.weight"] = tensor(head_dim)
    m[f"{a}.k_norm.weight"] = tensor(head_dim)
    m[f"{prefix}.post_attention_layernorm.weight"] = tensor(hidden)


def mlp(m, prefix, hidden, inter):
    m[f"{prefix}.gate_proj.weight"] = tensor(inter, hidden)
    m[f"{prefix}.up_proj.weight"] = tensor(inter, hidden)
    m[f"{prefix}.down_proj.weight"] = tensor(hidden, inter)


def small_dense(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=64, inter=1536, vocab=32001):
    m = {"model.embed_tokens.weight": tensor(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        attention(m, p, hidden, heads, kv_heads, head_dim)
        mlp(m, f"{p}.mlp", hidden, inter)
    m["model.norm.weight"] = tensor(hidden)
    m["lm_head.weight"] = tensor(vocab, hidden)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": layers,
              "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "intermediate_size": inter, "vocab_size": vocab,
              "tie_word_embeddings": False}
    return m, config


def small_moe(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, moe_inter=128, vocab=4096):
    m = {"model.embed_tokens.weight": tensor(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        attention(m, p, hidden, heads, kv_heads, head_dim)
        m[f"{p}.mlp.gate.weight"] = tensor(experts, hidden)
        for e in range(experts):
            mlp(m, f"{p}.mlp.experts.{e}", hidden, moe_inter)
    m["model.norm.weight"] = tensor(hidden)
    m["lm_head.weight"] = tensor(vocab, hidden)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": layers,
              "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_experts": experts, "moe_intermediate_size": moe_inter,
              "vocab_size": vocab, "tie_word_embeddings": False}
    return m, config


def fp8(m, block=(128, 128)):
    """The model as an FP8 server holds it (DeepSeek-V3's checkpoint
    convention): every projection weight of attention and MLP/experts in
    F8_E4M3 with its F32 block scales beside it as "<name>_scale_inv", one
    per block, rounded up; embeddings, norms, router and lm_head in BF16."""
    out = {}
    for k, v in m.items():
        linear = k.endswith("_proj.weight") and len(v["shape"]) == 2
        if not linear:
            out[k] = v
            continue
        rows, cols = v["shape"]
        out[k] = tensor(rows, cols, dtype="F8_E4M3")
        out[k + "_scale_inv"] = tensor(-(-rows // block[0]), -(-cols // block[1]), dtype="F32")
    return out


MODELS = {
    "small-dense": small_dense,
    "small-moe": small_moe,
    # small-moe for a server that runs it in FP8; a BF16 trainer of
    # small-moe feeds it (examples/scenarios/moe-bf16-to-fp8.json).
    "small-moe-fp8": lambda: fp8_model(*small_moe()),
}


def fp8_model(m, config, block=(128, 128)):
    """fp8() of a model, with its config's quantization_config as an FP8
    checkpoint's config.json has it."""
    config = dict(config)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    return fp8(m, block), config


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    for name, build in MODELS.items():
        m, config = build()
        nbytes = 0
        for v in m.values():
            n = DTYPE_BYTES[v["dtype"]]
            for d in v["shape"]:
                n *= d
            nbytes += n
        # One tensor a line: small diffs when a shape changes.
        lines = [f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in m.items()]
        (out / f"{name}.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
        (out / f"{name}.config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"{name}: {len(m)} tensors, {nbytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
