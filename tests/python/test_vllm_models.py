"""Qwen2ForCausalLM and Qwen3MoeForCausalLM refreshed through refit's vLLM
engine, like test_vllm_fsdp.py's Llama: vLLM's own model classes on the CPU
at tp 2 and tp 4 (four vLLM workers over gloo) take three
versions bit for bit as vLLM's own load_weights puts them, and a version one
trainer rank never published leaves every parameter at the old one.

Qwen2 is trained by two FSDP2 ranks (fsdp_trainer.py). Qwen3-MoE is a plain
torch model on two ranks that split the experts between them
(moe_trainer.py says why it is not FSDP2); vLLM 0.33 names its experts
mlp.experts.routed_experts.w13_weight / w2_weight, which the engine takes
from the live model.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from processes import explain, free_port, start, wait_all  # noqa: E402

VERSIONS = 3

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512,
         "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": True, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "use_sliding_window": False,
         "torch_dtype": "float32"}

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
             "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 2,
             "vocab_size": 1000, "tie_word_embeddings": False, "max_position_embeddings": 128,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32"}


def refresh(coordinator, tmp_path, config, trainer, tp):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "coordinator.json").write_text(json.dumps(coordinator.config()))
    train_port, serve_port = free_port(), free_port()
    if trainer == "fsdp":
        procs = [start(tmp_path, f"trainer{r}", "fsdp_trainer.py", r, 2, 1, train_port, tmp_path, VERSIONS, tp)
                 for r in range(2)]
    else:
        procs = [start(tmp_path, f"trainer{r}", "moe_trainer.py", r, 2, train_port, tmp_path, VERSIONS, tp)
                 for r in range(2)]
    procs += [start(tmp_path, f"receiver{r}", "vllm_receiver.py", r, serve_port, tmp_path, VERSIONS, tp)
              for r in range(tp)]
    logs, failed = wait_all(tmp_path, procs)
    assert not failed, explain(logs, failed)
    for r in range(tp):
        assert f"version {VERSIONS} bit-exact" in logs[f"receiver{r}"]
        assert f"every parameter still at version {VERSIONS}" in logs[f"receiver{r}"]
    return logs


# tp 4 splits 2 KV heads over 4 workers: vLLM gives each KV head to two
# workers, so two ranks hold the same k and v rows.
@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_fsdp2_refreshes_vllm_bit_exact(coordinator, tmp_path, tp):
    refresh(coordinator, tmp_path, QWEN2, "fsdp", tp)


# tp 4 runs four vLLM workers and two trainers on the CPU: the slowest case
# of the suite (docs/testing.md, "The Python suite").
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_qwen3_moe_refreshes_vllm_bit_exact(coordinator, tmp_path, tp):
    logs = refresh(coordinator, tmp_path, QWEN3_MOE, "moe", tp)
    # The live model's names, not the recipe's spelling, were registered.
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in logs["receiver0"], logs["receiver0"][-4000:]
