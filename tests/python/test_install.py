"""`pip install .` into a fresh virtual environment (as the README says),
then `import refit` there loads the librefit.so the wheel carries; and the
examples' smoke run (examples/python/fsdp_trainer.py --smoke) with the
package as installed. Prints the wheel's size."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import BUILD, ROOT


def run(argv, **kw):
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture
def built():
    if not (BUILD / "plugin" / "librefit.so").exists():
        pytest.skip(f"no build tree at {BUILD} (make first)")


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("REFIT_LIBRARY", "PYTHONPATH")}
    env["REFIT_BUILD_DIR"] = str(BUILD)
    return env


def test_pip_install_in_a_fresh_venv(built, tmp_path):
    env = clean_env()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "dist"), str(ROOT)],
        env=env, timeout=900)
    wheels = list((tmp_path / "dist").glob("refit-*.whl"))
    assert len(wheels) == 1, wheels
    print(f"wheel {wheels[0].name}: {wheels[0].stat().st_size} bytes")
    venv.create(tmp_path / "venv", with_pip=True)
    py = str(tmp_path / "venv" / "bin" / "python")
    run([py, "-m", "pip", "install", "--quiet", "--no-deps", str(ROOT)], env=env, timeout=900)
    out = run([py, "-c", "import refit, refit.vllm, os; lib = refit.library(); "
                          "print(lib.version(), os.path.relpath(lib.path, os.path.dirname(refit.__file__)))"],
              env=env, cwd=tmp_path, timeout=120)
    version, where = out.split()
    assert where == os.path.join("_lib", "librefit.so"), out
    typed = run([py, "-c", "import refit, os; print(os.path.exists(os.path.join(os.path.dirname(refit.__file__), "
                           "'py.typed')))"], env=env, cwd=tmp_path, timeout=60)
    assert typed.strip() == "True"


def test_examples_smoke_run(built):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT / "python")  # this checkout's package, whether installed or not
    env["REFIT_LIBRARY"] = str(BUILD / "plugin" / "librefit.so")
    out = run([sys.executable, str(ROOT / "examples" / "python" / "fsdp_trainer.py"), "--smoke"], env=env,
              timeout=600)
    print(out)
    assert "smoke: version 2" in out and "tensors equal" in out
