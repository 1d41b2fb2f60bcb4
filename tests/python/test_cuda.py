"""refit.Source and refit.Receiver on CUDA tensors, in one process against a
real refit-coordinator: the source serves its GPU tensors (from a pinned
mirror where UCX cannot read device memory), the receiver's GPU buffers take
the "nccl" local fabric, direct and staged, with a cast on the way; and the
mistakes a GPU user can make are refused by name. Skipped where torch sees no
CUDA device (scripts/gpu-check runs it on a GPU machine)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import refit  # noqa: E402

from conftest import network  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

WHOLE = {"dtensor": {"mesh": [1], "ranks": [0], "placements": ["R"]}}


def source_config(coordinator):
    return {"rank": 0, "coordinator": coordinator.config(), "network": network()}


def receiver_config(coordinator, mode, fabric="nccl"):
    local = {"fabric": fabric, "device": 0} if fabric == "nccl" else {"fabric": fabric}
    return {"rank": 0, "instance": 0, "mode": mode, "coordinator": coordinator.config(), "network": network(),
            "local": local}


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_gpu_tensors_round_trip(coordinator, mode):
    gpu = torch.device("cuda", 0)
    gen = torch.Generator(device=gpu).manual_seed(5)
    w = torch.empty(64, 48, device=gpu)                        # F32
    b = torch.empty(1000, dtype=torch.bfloat16, device=gpu)
    x = torch.empty(32, 40, device=gpu)                        # F32, held as BF16
    with refit.Source(source_config(coordinator)) as src:
        src.add("model.w", w)
        src.add("model.b", b)
        src.add("model.x", x)
        with refit.Receiver(receiver_config(coordinator, mode)) as rx:
            rows = torch.full((32, 48), float("nan"), device=gpu)  # rows 32..64 of w
            whole = torch.zeros(1000, dtype=torch.bfloat16, device=gpu)
            x16 = torch.zeros(32, 40, dtype=torch.bfloat16, device=gpu)  # x cast to BF16 on the way
            rx.add("w_rows", rows, {"segments": [{"tensor": "model.w", "start": [32, 0], "size": [32, 48],
                                                  "offset": 0, "strides": [48, 1]}]})
            rx.add("model.b", whole, {**WHOLE, "shape": [1000]})
            rx.add("model.x", x16, {**WHOLE, "shape": [32, 40]})
            before = (rows.clone(), whole.clone(), x16.clone())
            for v in (1, 2, 3):
                w.normal_(generator=gen)
                x.normal_(generator=gen)
                b.copy_(torch.randn(1000, device=gpu, generator=gen).to(torch.bfloat16))
                torch.cuda.synchronize()
                src.publish(v)
                rx.refresh(v, timeout=60)
                if mode == "staged":
                    # Nothing lands in the live buffers before commit.
                    assert torch.equal(rows.isnan(), before[0].isnan())
                    assert torch.equal(rows.nan_to_num(), before[0].nan_to_num())
                    assert torch.equal(whole, before[1]) and torch.equal(x16, before[2])
                    assert rx.commit() == v
                torch.cuda.synchronize()
                assert torch.equal(rows, w[32:]), f"version {v}: rows of model.w differ"
                assert torch.equal(whole, b), f"version {v}: model.b differs"
                assert torch.equal(x16, x.to(torch.bfloat16)), f"version {v}: the BF16 cast differs from torch's"
                report = rx.report()
                assert report["ok"] is True and report["version"] == v and report["mode"] == mode
                before = (rows.clone(), whole.clone(), x16.clone())
                src.wait_drained(v, timeout=30)


def test_gpu_mistakes_are_refused_by_name(coordinator):
    gpu = torch.device("cuda", 0)
    spec = {**WHOLE, "shape": [8]}
    with refit.Receiver(receiver_config(coordinator, "direct", fabric="cma")) as rx:
        with pytest.raises(refit.InvalidArgumentError,
                           match=r'buffer "x" is GPU memory \(device 0\); GPU buffers need "local": '
                                 r'\{"fabric": "nccl"\}'):
            rx.add("x", torch.zeros(8, device=gpu), spec)
            rx.join()
    with refit.Receiver(receiver_config(coordinator, "direct")) as rx:
        with pytest.raises(refit.InvalidArgumentError,
                           match=r'buffer "x" is host memory; the "nccl" local fabric passes GPU memory only'):
            rx.add("x", torch.zeros(8), spec)
            rx.join()
    with pytest.raises(refit.InvalidArgumentError, match=r'verify.*hashes host memory'):
        refit.Receiver({**receiver_config(coordinator, "direct"), "verify": True})
