"""An FSDP2 trainer refreshing vLLM's own model classes through refit's vLLM
engine, on the CPU, every process real: trainer ranks (torch.distributed
gloo, fully_shard on a mesh of 2, or FSDP2 with TP on 2x2, which gives
_StridedShard), vLLM workers at tp 2 or 4 (gloo), and refit-coordinator, all
on 127.0.0.1. Three versions land bit for bit as vLLM's own load_weights
puts them, also where vLLM serves BF16 from the trainer's F32 (refit casts); a version one trainer rank never published is refused and leaves
every parameter at the old one. The scripts say what each process does.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from processes import explain, free_port, start, wait_all  # noqa: E402

VERSIONS = 3


def llama_config(tied: bool) -> dict:
    # head_dim 64, 8 heads, 2 KV heads: the shape whose layout the recipes
    # once guessed wrong; vocabulary 1000, which vLLM pads to 1024.
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
            "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": tied,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "torch_dtype": "float32"}


# vLLM at tp 4 splits the 2 KV heads over 4 workers: each KV head goes to
# two of them, which hold the same k and v rows.
# A trainer's F32 masters to a vLLM serving BF16: refit casts on the way
# (round to nearest even), and the reference is vLLM's loader copying the
# F32 state dict into its BF16 parameters.
@pytest.mark.parametrize("trainers,tp,tied,vllm_tp,dtype",
                         [(2, 1, True, 2, "float32"), (4, 2, False, 2, "float32"), (2, 1, True, 4, "float32"),
                          (2, 1, False, 2, "bfloat16")],
                         ids=["fsdp2-tied", "fsdp2-tp2-untied", "fsdp2-tied-vllm-tp4", "fsdp2-f32-to-vllm-bf16"])
def test_fsdp2_trainer_refreshes_vllm_bit_exact(coordinator, tmp_path, trainers, tp, tied, vllm_tp, dtype):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(llama_config(tied)))
    (tmp_path / "coordinator.json").write_text(json.dumps(coordinator.config()))
    train_port, serve_port = free_port(), free_port()
    procs = [start(tmp_path, f"trainer{r}", "fsdp_trainer.py", r, trainers, tp, train_port, tmp_path, VERSIONS,
                   vllm_tp)
             for r in range(trainers)]
    procs += [start(tmp_path, f"receiver{r}", "vllm_receiver.py", r, serve_port, tmp_path, VERSIONS, vllm_tp,
                    dtype)
              for r in range(vllm_tp)]
    logs, failed = wait_all(tmp_path, procs)
    assert not failed, explain(logs, failed)
    if tp == 2:
        placements = json.loads((tmp_path / "placements.json").read_text())
        assert any("_StridedShard" in p for ps in placements.values() for p in ps), placements
    for r in range(vllm_tp):
        assert f"parameters (torch.{dtype})" in logs[f"receiver{r}"]
        assert f"version {VERSIONS} bit-exact" in logs[f"receiver{r}"]
        assert f"every parameter still at version {VERSIONS}" in logs[f"receiver{r}"]
