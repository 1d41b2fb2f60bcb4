"""One trainer rank of test_vllm_kill.py: a small Llama built by transformers
from a config (no download), a plain torch model on every rank. Version v's
weights are drawn from seed v, the same on every rank, so a rank started
again later holds what the others hold; rank r serves every WORLD-th tensor
(from the r-th). Sources hash what they serve ("verify").

    kill_trainer.py RANK WORLD DIR FIRST LAST STOP

Publishes versions FIRST..LAST; after publishing version STOP this rank
stops itself (SIGSTOP) and leaves the test to kill it. It writes
published<v>.<rank> after each publish and waits for the receivers'
ack<v>.<r> files before the next version; rank 0 writes v<v>.pt (the full
state dict) before publishing.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import refit
from fsdp_trainer import wait_for

RECEIVERS = 2


def main(rank, world, out, first, last, stop):
    config = AutoConfig.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    params = list(model.named_parameters())
    if rank == 0:
        manifest = {n: {"dtype": "F32", "shape": list(p.shape)} for n, p in params}
        (out / "manifest.json").write_text(json.dumps(manifest))
    coordinator = json.loads((out / "coordinator.json").read_text())
    src = refit.Source({"rank": rank, "coordinator": coordinator, "verify": True,
                        "network": {"transports": ["tcp"], "devices": ["lo"]}})
    for name, p in params[rank::world]:
        src.add(name, p.data)
    src.join()
    for version in range(first, last + 1):
        torch.manual_seed(version)
        with torch.no_grad():
            for _, p in params:
                p.normal_(0, 0.02)
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in params}, out / f"v{version}.tmp")
            os.replace(out / f"v{version}.tmp", out / f"v{version}.pt")
        src.publish(version)
        (out / f"published{version}.{rank}").write_text("ok")
        print(f"trainer {rank}: published version {version}", flush=True)
        if version == stop:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test kills this process now
        wait_for([out / f"ack{version}.{r}" for r in range(RECEIVERS)])
        src.wait_drained(version, timeout=60)
    src.close()
    print(f"trainer {rank}: done", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), Path(a[2]), int(a[3]), int(a[4]), int(a[5]))
