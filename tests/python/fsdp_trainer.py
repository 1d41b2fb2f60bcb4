"""One trainer rank of test_vllm_fsdp.py and test_vllm_models.py: a Llama or
Qwen2 built by transformers from a config (no download), sharded with FSDP2 (fully_shard on a CPU mesh; with
--tp 2, tensor parallel first, which gives _StridedShard), trained with
AdamW, and published through refit.Source.add_module after each step.

    fsdp_trainer.py RANK WORLD TP PORT DIR VERSIONS [RECEIVERS [DTYPE]]

DIR holds hf/config.json and coordinator.json; this script writes
manifest.json and v<N>.pt (the full state dict of version N, from rank 0)
and waits for the receivers' ack<N>.<rank> files before training on. After
VERSIONS versions, rank 0 publishes one more while the other ranks leave
without publishing it: the receivers must refuse to commit that one. DTYPE
is the trainer's parameters' (default float32; bfloat16 for a BF16 trainer).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM

import refit


def wait_for(paths, seconds=600):
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"trainer: waited {seconds} s for {[str(p) for p in paths]}")
        time.sleep(0.05)


DTYPES = {"float32": (torch.float32, "F32"), "bfloat16": (torch.bfloat16, "BF16")}


def main(rank, world, tp, port, out, versions, receivers=2, dtype="float32"):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_config(config).to(DTYPES[dtype][0])
    if tp == 1:
        mesh = init_device_mesh("cpu", (world,))
        dp_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    placements = {n: [type(p).__name__ for p in t.placements] for n, t in model.named_parameters()
                  if isinstance(t, DTensor)}
    if rank == 0:
        manifest = {n: {"dtype": DTYPES[dtype][1], "shape": list(p.shape)} for n, p in model.named_parameters()}
        (out / "manifest.json").write_text(json.dumps(manifest))
        (out / "placements.json").write_text(json.dumps(placements))

    coordinator = json.loads((out / "coordinator.json").read_text())
    src = refit.Source({"rank": rank, "coordinator": coordinator, "network": {"transports": ["tcp"],
                                                                            "devices": ["lo"]}})
    names = src.add_module(model)
    assert names == [n for n, _ in model.named_parameters()], names
    src.join()

    gen = torch.Generator().manual_seed(1 + rank // tp)
    for version in range(1, versions + 2):
        # One step of training: every parameter changes.
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()}
        if version == versions + 1:
            break
        if rank == 0:
            torch.save(full, out / f"v{version}.tmp")
            os.replace(out / f"v{version}.tmp", out / f"v{version}.pt")
        src.publish(version)
        wait_for([out / f"ack{version}.{r}" for r in range(receivers)])
        src.wait_drained(version, timeout=60)
        dist.barrier()
    # The fault: only rank 0 publishes the last version; the others leave.
    dist.barrier()
    if rank == 0:
        src.publish(versions + 1)
        wait_for([out / f"ack{versions + 1}.{r}" for r in range(receivers)])
    src.close()
    print(f"trainer {rank}: published {versions} versions, then a partial one", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), Path(a[4]), int(a[5]), *map(int, a[6:7]), *a[7:8])
