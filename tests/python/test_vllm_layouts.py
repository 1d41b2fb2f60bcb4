"""Llama-3.2-1B and Qwen2.5-0.5B as refit's vLLM recipe lays them out (from
the manifest and Hugging Face config, no weights), held against vLLM 0.33's
own layers at tp 8 and tp 2: equal parameter sizes at every rank, and every
element where vLLM's weight_loader puts it. vllm_layers.py says how one
process builds vLLM's layers for each TP rank. Qwen2.5-0.5B's 14 query heads
do not split over tp 8: vLLM refuses it, and so does refit, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from conftest import BUILD, ROOT  # noqa: E402
from hf_models import MODELS, manifest  # noqa: E402

HERE = Path(__file__).resolve().parent
PLAN = BUILD / "tools" / "refit-plan"


def scenario(model, tp):
    one = {"gpus": 1, "tp": 1, "cp": 1, "dp": 1, "pp": 1, "ep": 1, "fsdp": False, "gpus_per_domain": 1}
    return {"model": model, "train": one,
            "infer": {"gpus": tp, "tp": tp, "dp": 1, "pp": 1, "expert_parallel": False, "gpus_per_domain": tp}}


def refit_layout(tmp, name, tp):
    """Runs refit-plan --layout-out for the model at vLLM tp `tp`; returns
    (the layout's path or None, refit-plan's output)."""
    if not PLAN.exists():
        pytest.skip(f"no refit-plan at {PLAN} (build the project first)")
    config = MODELS[name]
    (tmp / f"{name}.json").write_text(json.dumps(manifest(config)))
    (tmp / f"{name}.config.json").write_text(json.dumps(config))
    (tmp / "scenario.json").write_text(json.dumps(scenario(name, tp)))
    out = tmp / "layout.json"
    r = subprocess.run([str(PLAN), "--scenario", str(tmp / "scenario.json"), "--model", str(tmp / f"{name}.json"),
                        "--layout-out", str(out)], capture_output=True, text=True, timeout=120)
    return (out if r.returncode == 0 else None), r.stdout + r.stderr


def run_layers(*args):
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HUMMING_DISABLE_PARALLEL_BUILD="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(HERE / "vllm_layers.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)


@pytest.mark.parametrize("name,tp", [("llama-3.2-1b", 8), ("llama-3.2-1b", 2), ("qwen2.5-0.5b", 2)])
def test_recipe_layout_equals_vllm_layers(tmp_path, name, tp):
    layout, log = refit_layout(tmp_path, name, tp)
    assert layout is not None, log
    r = run_layers(tmp_path / f"{name}.config.json", layout, tp)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    for rank in range(tp):
        assert f"rank {rank}/{tp}: " in r.stdout


def test_qwen2_5_at_tp8_is_refused_by_both(tmp_path):
    layout, log = refit_layout(tmp_path, "qwen2.5-0.5b", 8)
    assert layout is None, "refit-plan laid out Qwen2.5-0.5B at tp 8"
    assert "14 query heads" in log and "tp=8" in log, log
    r = run_layers("--refuses", tmp_path / "qwen2.5-0.5b.config.json", 8)
    print(log, r.stdout)
    assert r.returncode == 0 and "vLLM refuses tp 8" in r.stdout, r.stdout + r.stderr[-4000:]
