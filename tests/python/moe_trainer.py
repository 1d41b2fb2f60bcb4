"""One trainer rank of test_vllm_models.py for Qwen3-MoE: a Qwen3MoeForCausalLM
built by transformers from a config (no download), a plain torch model (no
FSDP: transformers keeps a layer's experts fused in two 3-D parameters,
gate_up_proj [E, 2I, H] and down_proj [E, H, I], while checkpoints, vLLM and
refit's recipe name each expert's gate_proj, up_proj and down_proj; the
trainer serves those as views of the fused parameters). Expert-parallel
style: rank r serves the experts r*E/W .. (r+1)*E/W - 1 of every layer,
rank 0 also everything that is not an expert. Every rank trains the same
replica (rank 0's parameters are broadcast after each step), so what each
serves is what rank 0 saves.

    moe_trainer.py RANK WORLD PORT DIR VERSIONS [RECEIVERS]

The files and the closing fault are those of fsdp_trainer.py: manifest.json,
v<N>.pt (the full state dict in checkpoint names), ack<N>.<rank>; after
VERSIONS versions only rank 0 publishes one more.
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import refit
from fsdp_trainer import wait_for

FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(model):
    """(name, tensor) in checkpoint names; experts as views of the fused parameters."""
    out = []
    for name, p in model.named_parameters():
        m = FUSED.match(name)
        if not m:
            out.append((name, p.data))
            continue
        prefix, kind = m.groups()
        for e in range(p.shape[0]):
            if kind == "gate_up_proj":
                inter = p.shape[1] // 2
                out.append((f"{prefix}.{e}.gate_proj.weight", p.data[e, :inter]))
                out.append((f"{prefix}.{e}.up_proj.weight", p.data[e, inter:]))
            else:
                out.append((f"{prefix}.{e}.down_proj.weight", p.data[e]))
    return out


def owner(name, experts, world):
    m = re.search(r"\.experts\.(\d+)\.", name)
    return 0 if m is None else int(m.group(1)) * world // experts


def main(rank, world, port, out, versions, receivers=2):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tensors = checkpoint_tensors(model)
    if rank == 0:
        manifest = {n: {"dtype": "F32", "shape": list(t.shape)} for n, t in tensors}
        (out / "manifest.json").write_text(json.dumps(manifest))

    coordinator = json.loads((out / "coordinator.json").read_text())
    src = refit.Source({"rank": rank, "coordinator": coordinator, "network": {"transports": ["tcp"],
                                                                            "devices": ["lo"]}})
    mine = [(n, t) for n, t in tensors if owner(n, config.num_experts, world) == rank]
    for name, t in mine:
        src.add(name, t)  # a view: the optimizer's in-place steps land in it
    src.join()
    print(f"trainer {rank}: serves {len(mine)} of {len(tensors)} tensors", flush=True)

    gen = torch.Generator().manual_seed(1)
    for version in range(1, versions + 2):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, 0)
        if version == versions + 1:
            break
        if rank == 0:
            full = {n: t.clone() for n, t in checkpoint_tensors(model)}
            torch.save(full, out / f"v{version}.tmp")
            os.replace(out / f"v{version}.tmp", out / f"v{version}.pt")
        src.publish(version)
        wait_for([out / f"ack{version}.{r}" for r in range(receivers)])
        src.wait_drained(version, timeout=60)
        dist.barrier()
    dist.barrier()
    if rank == 0:
        src.publish(versions + 1)
        wait_for([out / f"ack{versions + 1}.{r}" for r in range(receivers)])
    src.close()
    print(f"trainer {rank}: published {versions} versions, then a partial one", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), Path(a[3]), int(a[4]), *map(int, a[5:6]))
