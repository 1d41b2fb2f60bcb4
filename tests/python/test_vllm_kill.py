"""A trainer rank SIGKILLed while vLLM's workers pull a version from it:
every vLLM parameter stays at the old version, and the next version (from
the surviving rank and a new process in the killed one's place) lands bit
for bit and verifies.

The kill is timed by events, not delays: trainer rank 1 stops itself
(SIGSTOP) right after publishing version 2, so nothing of its part of
version 2 can be served; each worker writes pulling2.<rank> when refit logs
that its refresh holds the lease and the plan and starts the transfer, and
landed2.<rank> when refit's progress (refit.Receiver.progress) says bytes of
version 2 have landed there; the test then waits until the kernel's TCP
table shows both workers connected to a port rank 1 listens on (the kernel
completes a connection to a stopped process's listener). Then it kills rank
1: both refreshes are in their transfer with bytes landed (from rank 0),
waiting on rank 1, and cannot have completed. The new rank 1 starts when the coordinator has
declared the old one dead (its log). kill_trainer.py and kill_receiver.py
say what each process does.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from conftest import Coordinator  # noqa: E402
from processes import explain, free_port, start, wait_all  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": False,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "torch_dtype": "float32"}


def wait_files(paths, procs, seconds):
    """Waits for every path to exist; fails early if a process exits meanwhile."""
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        dead = [name for name, _, p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            return dead or ["deadline"]
        time.sleep(0.05)
    return []


def _sockets(pid):
    """The socket inodes process `pid` holds."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _tcp():
    """(local port, remote port, state, inode) of every TCP socket (IPv4 and IPv6)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            rows.append((int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), f[3], f[9]))
    return rows


def connected_to(victim, clients):
    """The pids of `clients` with a TCP connection established to a port
    that process `victim` listens on: the kernel completes a connection to a
    stopped process's listener, so this is a worker's transfer reaching
    trainer rank 1 while it cannot answer."""
    rows = _tcp()
    mine = _sockets(victim)
    ports = {local for local, _, state, inode in rows if state == "0A" and inode in mine}
    remote = {rem for local, rem, state, _ in rows if state == "01" and local in ports}
    inodes = {inode for local, _, state, inode in rows if state == "01" and local in remote}
    return {pid for pid in clients if _sockets(pid) & inodes}


def wait_connected(victim, clients, procs, seconds):
    deadline = time.monotonic() + seconds
    while connected_to(victim, clients) != set(clients):
        dead = [name for name, _, p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            return dead or [f"the workers {sorted(set(clients) - connected_to(victim, clients))} did not connect "
                            f"to trainer rank 1 in {seconds} s"]
        time.sleep(0.05)
    return []


def wait_log(path, text, seconds):
    deadline = time.monotonic() + seconds
    while text not in path.read_text():
        if time.monotonic() > deadline:
            return [f"{path.name}: no \"{text}\" after {seconds} s"]
        time.sleep(0.05)
    return []


def test_a_trainer_killed_mid_pull_leaves_the_old_version(tmp_path):
    # The coordinator declares a source dead when its heartbeats stop (not
    # when its connection closes): 10 s, more than the workers need to plan
    # version 2 while rank 1 is stopped, and what the new rank 1 waits.
    coordinator = Coordinator(tmp_path, heartbeat_timeout_ms=10000)
    victim = None
    try:
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text(json.dumps(LLAMA))
        (tmp_path / "coordinator.json").write_text(json.dumps(coordinator.config()))
        port = free_port()
        victim = start(tmp_path, "trainer1", "kill_trainer.py", 1, 2, tmp_path, 1, 2, 2)
        procs = [start(tmp_path, "trainer0", "kill_trainer.py", 0, 2, tmp_path, 1, 3, 0), victim]
        procs += [start(tmp_path, f"receiver{r}", "kill_receiver.py", r, port, tmp_path) for r in range(2)]
        problem = wait_files([tmp_path / f"pulling2.{r}" for r in range(2)], procs, 600)
        if not problem:
            problem = wait_files([tmp_path / f"landed2.{r}" for r in range(2)], procs, 120)
        if not problem:
            workers = [p.pid for name, _, p in procs if name.startswith("receiver")]
            problem = wait_connected(victim[2].pid, workers, procs, 60)
        if not problem:
            assert victim[2].poll() is None, "trainer rank 1 exited before it was killed"
            victim[2].send_signal(signal.SIGKILL)
            victim[2].wait(30)
            problem = wait_files([tmp_path / f"ack2.{r}" for r in range(2)],
                                 [p for p in procs if p is not victim], 120)
        if not problem:
            # Rank 1's place is free once the coordinator has dropped it.
            problem = wait_log(coordinator.log, "source rank 1 declared dead", 60)
        if not problem:
            procs.append(start(tmp_path, "trainer1b", "kill_trainer.py", 1, 2, tmp_path, 3, 3, 0))
        logs, failed = wait_all(tmp_path, [p for p in procs if p is not victim])
        victim[1].close()
        logs["trainer1"] = (tmp_path / "trainer1.log").read_text()
        assert not problem and not failed, f"waiting: {problem}\n" + explain(logs, failed)
    finally:
        if victim is not None and victim[2].poll() is None:
            victim[2].kill()
            victim[2].wait()
        coordinator.stop()
    assert "trainer 1: published version 2" in logs["trainer1"]
    # The kill landed mid-pull: bytes of version 2 had landed on each worker
    # before it, and not all of them.
    for r in range(2):
        landed = json.loads((tmp_path / f"landed2.{r}").read_text())
        assert landed["state"] == "transferring", landed
        assert 0 < landed["network_bytes_landed"] < landed["network_bytes_planned"], landed
    for r in range(2):
        log = logs[f"receiver{r}"]
        assert "version 1 bit-exact" in log, log[-4000:]
        assert "version 2 failed" in log, log[-4000:]
        assert "every parameter still at version 1 after the kill" in log, log[-4000:]
        assert "version 3 bit-exact, verified" in log, log[-4000:]
