"""Llama-3.2-1B and Qwen2.5-0.5B as refit's vLLM recipe lays them out (from
the manifest and Hugging Face config, no weights), held against vLLM 0.33's
own layers at tp 8 and tp 2: equal parameter sizes at every rank, and every
element where vLLM's weight_loader puts it. vllm_layers.py says how one
process builds vLLM's layers for each TP rank (one process, one vLLM import,
for every case). Qwen2.5-0.5B's 14 query heads do not split over tp 8: vLLM
refuses it, and so does refit, saying why.
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
CASES = [("llama-3.2-1b", 8), ("llama-3.2-1b", 2), ("qwen2.5-0.5b", 2)]


def refit_layout(tmp, name, tp):
    """refit-plan --layout-out for the model at vLLM tp `tp`: (the layout's
    path, or None where refit-plan refused; what refit-plan said)."""
    config = MODELS[name]
    (tmp / f"{name}.json").write_text(json.dumps(manifest(config)))
    (tmp / f"{name}.config.json").write_text(json.dumps(config))
    one = {"gpus": 1, "tp": 1, "cp": 1, "dp": 1, "pp": 1, "ep": 1, "fsdp": False, "gpus_per_domain": 1}
    scenario = {"model": name, "train": one,
                "infer": {"gpus": tp, "tp": tp, "dp": 1, "pp": 1, "expert_parallel": False, "gpus_per_domain": tp}}
    (tmp / f"{name}-tp{tp}.scenario.json").write_text(json.dumps(scenario))
    out = tmp / f"{name}-tp{tp}.layout.json"
    r = subprocess.run([str(PLAN), "--scenario", str(tmp / f"{name}-tp{tp}.scenario.json"), "--model",
                        str(tmp / f"{name}.json"), "--layout-out", str(out)], capture_output=True, text=True,
                       timeout=120)
    return (out if r.returncode == 0 else None), r.stdout + r.stderr


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """Every case planned by refit-plan and held against vLLM's layers in one
    process: {"plans": {(name, tp): (layout, log)}, "vllm": its output, "rc"}."""
    if not PLAN.exists():
        pytest.skip(f"no refit-plan at {PLAN} (build the project first)")
    tmp = tmp_path_factory.mktemp("layouts")
    plans = {case: refit_layout(tmp, *case) for case in CASES + [("qwen2.5-0.5b", 8)]}
    jobs = []
    for name, tp in CASES:
        layout = plans[(name, tp)][0]
        if layout is not None:
            jobs += [tmp / f"{name}.config.json", layout, tp]
    jobs += ["--refuses", tmp / "qwen2.5-0.5b.config.json", 8]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HUMMING_DISABLE_PARALLEL_BUILD="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(HERE / "vllm_layers.py"), *map(str, jobs)], capture_output=True,
                       text=True, timeout=900, env=env, cwd=ROOT)
    print(r.stdout)
    return {"plans": plans, "vllm": r.stdout, "rc": r.returncode, "stderr": r.stderr}


@pytest.mark.parametrize("name,tp", CASES)
def test_recipe_layout_equals_vllm_layers(held, name, tp):
    layout, log = held["plans"][(name, tp)]
    assert layout is not None, log
    out = held["vllm"]
    section = out.split(f"{name}.config.json tp {tp}:", 1)
    assert len(section) == 2, f"vllm_layers.py did not reach {name} tp {tp}:\n{out}\n{held['stderr'][-4000:]}"
    own = section[1].split(".config.json tp ", 1)[0]  # up to the next case
    for rank in range(tp):
        assert f"rank {rank}/{tp}: " in own, f"{own}\n{held['stderr'][-4000:]}"


def test_qwen2_5_at_tp8_is_refused_by_both(held):
    layout, log = held["plans"][("qwen2.5-0.5b", 8)]
    assert layout is None, "refit-plan laid out Qwen2.5-0.5B at tp 8"
    assert "14 query heads (head_dim 64) do not split evenly over tp=8" in log, log
    assert "qwen2.5-0.5b.config.json tp 8: vLLM refuses" in held["vllm"], held["vllm"] + held["stderr"][-4000:]
    assert held["rc"] == 0, held["stderr"][-4000:]
