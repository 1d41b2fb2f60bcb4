"""Runs the trainer and receiver scripts of the vLLM tests as processes on
127.0.0.1 and collects their logs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", HUMMING_DISABLE_PARALLEL_BUILD="1", OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def start(tmp: Path, name: str, script: str, *args: object) -> tuple[str, object, subprocess.Popen]:
    log = open(tmp / f"{name}.log", "w")
    p = subprocess.Popen([sys.executable, str(HERE / script), *map(str, args)], stdout=log,
                         stderr=subprocess.STDOUT, env=environment(), cwd=ROOT)
    return name, log, p


def wait_all(tmp: Path, procs: list, timeout: float = 900) -> tuple[dict[str, str], list[str]]:
    """Waits for every process (killing what outlives `timeout`); returns
    each one's log and the list of those that failed."""
    failed = []
    try:
        for name, log, p in procs:
            try:
                rc = p.wait(timeout=timeout)
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
    logs = {name: (tmp / f"{name}.log").read_text() for name, _, _ in procs}
    for name, text in logs.items():
        lines = [ln for ln in text.splitlines() if ln.startswith(("trainer", "receiver"))]
        print(f"--- {name}\n" + "\n".join(lines))
    return logs, failed


def explain(logs: dict[str, str], failed: list[str]) -> str:
    return "\n".join(failed) + "\n" + "\n".join(f"--- {n}\n{t[-4000:]}" for n, t in logs.items())
