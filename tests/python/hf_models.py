"""Two real models as their Hugging Face configs state them, and the tensor
manifest (a safetensors header without offsets) each config implies: what
refit's recipes read, with no weights involved.

The configs are the layout facts of the public config.json files of
meta-llama/Llama-3.2-1B and Qwen/Qwen2.5-0.5B.
"""

from __future__ import annotations

from typing import Any

LLAMA_3_2_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 16,
                "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16"}

QWEN2_5_0_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24,
                "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
                "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16"}

MODELS = {"llama-3.2-1b": LLAMA_3_2_1B, "qwen2.5-0.5b": QWEN2_5_0_5B}


def qkv_bias(config: dict[str, Any]) -> bool:
    """Qwen2 has q/k/v biases; Llama has none."""
    return config["model_type"] == "qwen2"


def manifest(config: dict[str, Any], dtype: str = "BF16") -> dict[str, Any]:
    """The tensors of a dense decoder (Llama, Qwen2) with this config."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter, vocab = config["head_dim"], config["intermediate_size"], config["vocab_size"]

    def t(*shape: int) -> dict[str, Any]:
        return {"dtype": dtype, "shape": list(shape)}

    m = {"model.embed_tokens.weight": t(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        m[p + "input_layernorm.weight"] = t(hidden)
        m[p + "self_attn.q_proj.weight"] = t(heads * hd, hidden)
        m[p + "self_attn.k_proj.weight"] = t(kv * hd, hidden)
        m[p + "self_attn.v_proj.weight"] = t(kv * hd, hidden)
        if qkv_bias(config):
            m[p + "self_attn.q_proj.bias"] = t(heads * hd)
            m[p + "self_attn.k_proj.bias"] = t(kv * hd)
            m[p + "self_attn.v_proj.bias"] = t(kv * hd)
        m[p + "self_attn.o_proj.weight"] = t(hidden, heads * hd)
        m[p + "post_attention_layernorm.weight"] = t(hidden)
        m[p + "mlp.gate_proj.weight"] = t(inter, hidden)
        m[p + "mlp.up_proj.weight"] = t(inter, hidden)
        m[p + "mlp.down_proj.weight"] = t(hidden, inter)
    m["model.norm.weight"] = t(hidden)
    if not config["tie_word_embeddings"]:
        m["lm_head.weight"] = t(vocab, hidden)
    return m
