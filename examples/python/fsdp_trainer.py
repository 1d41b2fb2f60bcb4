#!/usr/bin/env python3
"""An FSDP2 trainer that refreshes vLLM servers through refit after every
step (README.md beside this file has the commands).

    torchrun --nproc-per-node N fsdp_trainer.py --model DIR --coordinator HOST:PORT \\
        --token-file F --server http://HOST:8000 [--steps S]
    python fsdp_trainer.py --smoke

The trainer engine is vLLM's interface (TrainerWeightTransferEngine with a
ModuleSource over the sharded model) with refit's backend: every rank
registers its shards, DTensors as they are; each send_weights publishes the
next version, and rank 0 drives the servers' start / update / finish.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist


def tiny_llama(directory: str) -> str:
    """A small Llama config.json (head_dim 64, 8 heads, 2 KV heads)."""
    import json
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
                   "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
                   "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": True,
                   "max_position_embeddings": 128, "torch_dtype": "float32"}, f)
    return directory


def build(model_dir: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).to(torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model, opt, vocab: int) -> float:
    ids = torch.randint(0, vocab, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def serve(args) -> None:
    import refit.vllm  # noqa: F401  (checks the vLLM version)
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
    from refit.vllm import RefitTrainerInitInfo, RefitTrainerWeightTransferEngine

    dist.init_process_group("gloo")
    model = build(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coordinator = {"address": args.coordinator, "token_file": args.token_file}
    info = RefitTrainerInitInfo(rank=dist.get_rank(), source_config={"coordinator": coordinator},
                                worker_init={"coordinator": coordinator})
    engine = RefitTrainerWeightTransferEngine.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(args.server), source=ModuleSource(model))
    for step in range(1, args.steps + 1):
        loss = train_step(model, opt, model.config.vocab_size)
        engine.send_weights()  # version `step`, committed on every server when it returns
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}, servers at version {engine.version}", flush=True)
    engine.shutdown()
    dist.destroy_process_group()


def smoke() -> None:
    """One rank, a coordinator inside the process, a receiver beside the
    source: publish, refresh, commit, compare."""
    import socket

    import refit
    from torch.distributed.tensor import DTensor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    with tempfile.TemporaryDirectory() as tmp:
        model = build(tiny_llama(os.path.join(tmp, "llama")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        token = os.path.join(tmp, "token")
        # Mode 600: refit refuses a token file that group or others may read.
        with os.fdopen(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(32))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            cport = s.getsockname()[1]
        coordinator = {"address": f"127.0.0.1:{cport}", "token_file": token}
        net = {"transports": ["tcp"], "devices": ["lo"]}
        with refit.Source({"rank": 0, "coordinator": {**coordinator, "embedded": True}, "network": net}) as src:
            names = src.add_module(model)
            params = dict(model.named_parameters())
            with refit.Receiver({"rank": 0, "mode": "staged", "coordinator": coordinator, "network": net}) as rx:
                copies = {n: torch.zeros(params[n].shape, dtype=params[n].dtype) for n in names}
                for n, t in copies.items():
                    rx.add(n, t, {"dtensor": {"mesh": [1], "ranks": [0], "placements": ["R"]},
                                  "shape": list(t.shape)})
                for version in (1, 2):
                    loss = train_step(model, opt, model.config.vocab_size)
                    src.publish(version)
                    rx.refresh(version, timeout=60)
                    rx.commit()
                    for n, t in copies.items():
                        p = params[n]
                        full = p.full_tensor() if isinstance(p, DTensor) else p
                        assert torch.equal(full.detach(), t), n
                    report = rx.report()
                    print(f"smoke: version {version} (loss {loss:.4f}): {len(names)} tensors equal, "
                          f"{report['network_bytes']} bytes, pause {report['pause_seconds']:.4f} s", flush=True)
                    src.wait_drained(version, timeout=60)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="folder with the Hugging Face config.json")
    p.add_argument("--coordinator", help="HOST:PORT of refit-coordinator")
    p.add_argument("--token-file", help="the coordinator's shared token")
    p.add_argument("--server", help="the vLLM server's base URL")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="one process, no server: publish, refresh, compare")
    args = p.parse_args()
    if args.smoke:
        smoke()
        return
    missing = [k for k in ("model", "coordinator", "token_file", "server") if getattr(args, k) is None]
    if missing:
        p.error("missing " + ", ".join("--" + k.replace("_", "-") for k in missing) + " (or --smoke)")
    serve(args)


if __name__ == "__main__":
    main()
