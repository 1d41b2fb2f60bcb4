"""refit.Source and refit.Receiver on plain tensors and DTensors, in one
process against a real refit-coordinator: the round trip (blocking and
awaitable, staged with commit), the report, and every mistake refused before
anything is registered or written."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import refit  # noqa: E402
from refit._tensors import placement_name  # noqa: E402

from conftest import ROOT, network  # noqa: E402


def source_config(coordinator, rank=0):
    return {"rank": rank, "coordinator": coordinator.config(), "network": network()}


def receiver_config(coordinator, rank=0, mode="staged"):
    return {"rank": rank, "instance": 0, "mode": mode, "coordinator": coordinator.config(), "network": network()}


def test_round_trip_staged_then_awaitable(coordinator):
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    b = torch.arange(8, dtype=torch.bfloat16)
    with refit.Source(source_config(coordinator)) as src:
        src.add("model.w", w)
        src.add("model.b", b)
        assert src.names == ["model.w", "model.b"]
        with refit.Receiver(receiver_config(coordinator)) as rx:
            rows = torch.zeros(4, 6)      # rows 4..8 of w, as a 2-way row shard
            whole = torch.zeros(8, dtype=torch.bfloat16)
            rx.add("w_rows", rows, {"segments": [{"tensor": "model.w", "start": [4, 0], "size": [4, 6],
                                                  "offset": 0, "strides": [6, 1]}]})
            rx.add("model.b", whole, {"dtensor": {"mesh": [1], "ranks": [0], "placements": ["R"]}, "shape": [8]})
            src.publish(1)
            rx.refresh(1, timeout=30)
            assert torch.count_nonzero(rows) == 0, "staged: nothing lands before commit"
            assert rx.commit() == 1
            assert torch.equal(rows, w[4:]) and torch.equal(whole, b)
            report = rx.report()
            assert isinstance(report, dict) and report["version"] == 1 and report["ok"] is True
            src.wait_drained(1, timeout=30)

            w.add_(1000)
            b.add_(1)
            src.publish(2)
            assert asyncio.run(rx.refresh_async(2, timeout=30)) == 1  # staged: still 1 until commit
            assert rx.commit() == 2
            assert torch.equal(rows, w[4:]) and torch.equal(whole, b)


def test_mistakes_are_refused_before_anything_is_registered(coordinator):
    with refit.Source(source_config(coordinator)) as src:
        with pytest.raises(refit.InvalidArgumentError, match=r'tensor "t": the tensor is not contiguous'):
            src.add("t", torch.zeros(4, 3).t())
        with pytest.raises(refit.UnsupportedError, match=r'tensor "c": dtype torch.complex64 is not one refit'):
            src.add("c", torch.zeros(2, dtype=torch.complex64))
        src.add("ok", torch.zeros(2))
        with pytest.raises(refit.InvalidArgumentError, match=r'tensor "ok" is added twice'):
            src.add("ok", torch.zeros(2))

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a = torch.nn.Parameter(torch.zeros(3))
                self.b = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
        with pytest.raises(refit.UnsupportedError, match=r'tensor "m.b"'):
            src.add_module(Module(), prefix="m.")
        assert src.names == ["ok"], "a module with one bad parameter adds nothing"

    with refit.Receiver(receiver_config(coordinator)) as rx:
        with pytest.raises(refit.InvalidArgumentError, match=r'buffer "x": the tensor is not contiguous'):
            rx.add("x", torch.zeros(4, 3).t(), {"segments": []})
        with pytest.raises(refit.InvalidArgumentError, match="layout must be"):
            rx.add("x", torch.zeros(3), None)
        assert rx.names == []


def test_a_buffer_in_another_dtype_is_cast_or_refused_at_join(coordinator):
    w = torch.randn(8, 6, dtype=torch.float32)
    b = torch.arange(8, dtype=torch.bfloat16)
    whole = {"dtensor": {"mesh": [1], "ranks": [0], "placements": ["R"]}}
    with refit.Source(source_config(coordinator)) as src:
        src.add("model.w", w)
        src.add("model.b", b)
        src.publish(1)
        with refit.Receiver(receiver_config(coordinator)) as rx:
            w16 = torch.zeros(8, 6, dtype=torch.bfloat16)  # the trainer's F32, served as BF16
            rx.add("model.w", w16, {**whole, "shape": [8, 6]})
            rx.refresh(1, timeout=30)
            assert rx.commit() == 1
            assert torch.equal(w16, w.to(torch.bfloat16)), "round to nearest even, as torch casts"
        with refit.Receiver(receiver_config(coordinator)) as rx:
            rx.add("model.b", torch.zeros(8, dtype=torch.float32), {**whole, "shape": [8]})
            with pytest.raises(refit.InvalidArgumentError, match=r'"model.b".*BF16.*F32|"model.b".*F32.*BF16'):
                rx.join()
        # One tensor in two dtypes on the receivers (rows as the trainer's
        # F32, all of it cast to BF16): refused by name, never filled with
        # the other buffer's bytes.
        with refit.Receiver(receiver_config(coordinator)) as rx:
            rx.add("w_rows", torch.zeros(4, 6), {"segments": [{"tensor": "model.w", "start": [4, 0], "size": [4, 6],
                                                               "offset": 0, "strides": [6, 1]}]})
            rx.add("model.w", torch.zeros(8, 6, dtype=torch.bfloat16), {**whole, "shape": [8, 6]})
            with pytest.raises(refit.InvalidArgumentError,
                               match=r'buffer "model.w", tensor "model.w"\): the tensor is F32 in another receiver '
                                     r'buffer but this buffer is BF16'):
                rx.join()


def test_library_errors_are_typed_and_carry_the_message(coordinator):
    with pytest.raises(refit.InvalidArgumentError, match="netwrok") as e:
        refit.Receiver({"rank": 0, "netwrok": {}, "coordinator": coordinator.config()})
    assert isinstance(e.value, ValueError) and e.value.status_name == "REFIT_INVALID_ARGUMENT"
    with refit.Receiver(receiver_config(coordinator, mode="direct")) as rx:
        with pytest.raises(refit.InvalidArgumentError, match="recipe"):
            rx.add("model.w", torch.zeros(4), "recipe")  # the config has no recipe
    # Every status has its class, and all are refit.Error.
    for cls in (refit.InvalidArgumentError, refit.NotFoundError, refit.PeerError, refit.TimeoutError,
                refit.UnsupportedError, refit.InternalError):
        assert issubclass(cls, refit.Error)
    assert issubclass(refit.TimeoutError, TimeoutError) and issubclass(refit.PeerError, OSError)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dtensor_placements_become_the_spec(coordinator):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert placement_name(Shard(1), "x") == "S(1)"
    assert placement_name(Replicate(), "x") == "R"
    assert placement_name(_StridedShard(0, split_factor=2), "x") == "SS(0,2)"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        with refit.Source(source_config(coordinator)) as src:
            partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
            with pytest.raises(refit.InvalidArgumentError, match=r'tensor "p": placement .*Partial'):
                src.add("p", partial)
            sharded = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])
            src.add("s", sharded)
            assert src.names == ["s"]
    finally:
        dist.destroy_process_group()


def test_refit_vllm_imports_without_vllm():
    # A child process where `import vllm` fails: refit.vllm still imports,
    # and asking for the engine says what is missing.
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "import refit, refit.vllm as rv\n"
        "assert rv.recipe_name('model.layers.0.mlp.experts.routed_experts.w13_weight') == "
        "'model.layers.0.mlp.experts.w13_weight'\n"
        "try:\n"
        "    rv.check_vllm_version('0.32.1')\n"
        "    raise SystemExit('0.32.1 accepted')\n"
        "except refit.UnsupportedError as e:\n"
        "    assert 'vLLM 0.32.1 is not supported' in str(e), e\n"
        "rv.check_vllm_version('0.33.0')\n"
        "try:\n"
        "    rv.RefitWeightTransferEngine\n"
        "    raise SystemExit('no error without vllm')\n"
        "except refit.UnsupportedError as e:\n"
        "    assert 'needs vLLM 0.33.x' in str(e), e\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_log_lines_go_to_python_logging(coordinator):
    """refit.set_log_handler(logger): the library's lines arrive in Python's
    logging at their level, naming the agent; None sends them to stderr again."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("refit.test_api")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    keep = Keep()
    logger.addHandler(keep)
    try:
        refit.set_log_handler(logger)
        with refit.Source({**source_config(coordinator), "log_level": "info"}) as src:
            src.add("model.w", torch.zeros(4))
            mapped = [r for r in records if 'buffer "model.w" (16 bytes) mapped for peers' in r.getMessage()]
            assert mapped, [r.getMessage() for r in records]
            assert mapped[0].levelno == logging.INFO
            assert mapped[0].getMessage().startswith("refit[source 0] ")
            refit.set_log_handler(None)
            seen = len(records)
            src.add("model.b", torch.zeros(4))
            assert len(records) == seen, "a line reached the handler after it was removed"
        with pytest.raises(TypeError, match="expected a logging.Logger, a callable or None"):
            refit.set_log_handler(42)
    finally:
        refit.set_log_handler(None)
        logger.removeHandler(keep)
