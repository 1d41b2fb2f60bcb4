"""An FSDP2 trainer refreshing vLLM's own model classes through refit's vLLM
engine, on the CPU, every process real: trainer ranks (torch.distributed
gloo, fully_shard on a mesh of 2, or FSDP2 with TP on 2x2, which gives
_StridedShard), two vLLM workers at tp 2 (gloo), and refit-coordinator, all
on 127.0.0.1. Three versions land bit for bit as vLLM's own load_weights
puts them; a version one trainer rank never published is refused and leaves
every parameter at the old one. The scripts say what each process does.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from conftest import ROOT  # noqa: E402

HERE = Path(__file__).resolve().parent
VERSIONS = 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_config(tied: bool) -> dict:
    # head_dim 64, 8 heads, 2 KV heads: the shape whose layout the recipes
    # once guessed wrong; vocabulary 1000, which vLLM pads to 1024.
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
            "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": tied,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "torch_dtype": "float32"}


@pytest.mark.parametrize("trainers,tp,tied", [(2, 1, True), (4, 2, False)], ids=["fsdp2-tied", "fsdp2-tp2-untied"])
def test_fsdp2_trainer_refreshes_vllm_bit_exact(coordinator, tmp_path, trainers, tp, tied):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(llama_config(tied)))
    (tmp_path / "coordinator.json").write_text(json.dumps(coordinator.config()))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HUMMING_DISABLE_PARALLEL_BUILD="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    train_port, serve_port = free_port(), free_port()
    procs = []
    for r in range(trainers):
        log = open(tmp_path / f"trainer{r}.log", "w")
        procs.append((f"trainer{r}", log, subprocess.Popen(
            [sys.executable, str(HERE / "fsdp_trainer.py"), str(r), str(trainers), str(tp), str(train_port),
             str(tmp_path), str(VERSIONS)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)))
    for r in range(2):
        log = open(tmp_path / f"receiver{r}.log", "w")
        procs.append((f"receiver{r}", log, subprocess.Popen(
            [sys.executable, str(HERE / "vllm_receiver.py"), str(r), str(serve_port), str(tmp_path),
             str(VERSIONS)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)))
    failed = []
    try:
        for name, log, p in procs:
            try:
                rc = p.wait(timeout=900)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                failed.append(f"{name}: exit {rc}")
    finally:
        for name, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name, _, _ in procs}
    for name, text in logs.items():
        lines = [ln for ln in text.splitlines() if ln.startswith(("trainer", "receiver"))]
        print(f"--- {name}\n" + "\n".join(lines))
    assert not failed, "\n".join(failed) + "\n" + "\n".join(f"--- {n}\n{t[-4000:]}" for n, t in logs.items())
    if tp == 2:
        placements = json.loads((tmp_path / "placements.json").read_text())
        assert any("_StridedShard" in p for ps in placements.values() for p in ps), placements
    for r in range(2):
        assert f"version {VERSIONS} bit-exact" in logs[f"receiver{r}"]
        assert f"every parameter still at version {VERSIONS}" in logs[f"receiver{r}"]
