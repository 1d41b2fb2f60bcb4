"""One vLLM worker of test_vllm_fsdp.py and test_vllm_models.py: vLLM's own
model class for DIR/hf/config.json (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3MoeForCausalLM) on its CPU platform at tp TP (default 2) over gloo, refreshed by refit's engine created through
vLLM's WeightTransferEngineFactory with backend "refit" (registered by the
package's vllm.general_plugins entry point), then compared bit for bit with
a second instance of the same model loaded by vLLM's own load_weights from
the trainer's full state dict.

    vllm_receiver.py RANK PORT DIR VERSIONS [TP [DTYPE]]

DTYPE is vLLM's (default float32, the trainer's); bfloat16 makes refit cast
the trainer's F32 on the way, and the reference is then vLLM's own loader
copying F32 into BF16 parameters.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig,  # noqa: E402
                         WeightTransferConfig, set_current_vllm_config)
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # noqa: E402
from vllm.model_executor.model_loader.utils import initialize_model  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

import refit  # noqa: E402


def wait_for(path, seconds=600):
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"receiver: waited {seconds} s for {path}")
        time.sleep(0.05)


def mismatches(model, reference):
    ours = dict(model.named_parameters())
    theirs = dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    return [n for n in ours if not torch.equal(ours[n].data.view(torch.uint8), theirs[n].data.view(torch.uint8))]


def vllm_config(out, tp, dtype="float32"):
    return VllmConfig(model_config=ModelConfig(model=str(out / "hf"), dtype=dtype, skip_tokenizer_init=True,
                                               enforce_eager=True),
                      load_config=LoadConfig(load_format="dummy"), device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      weight_transfer_config=WeightTransferConfig(backend="refit"))


def build(rank, port, out, tp, dtype="float32"):
    """vLLM's model for this rank and a reference instance of it (zeroed, equal)."""
    vc = vllm_config(out, tp, dtype)
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(tp, 1)
        # As vLLM's model loader does: parameters in the model config's dtype.
        with set_default_torch_dtype(vc.model_config.dtype):
            model = initialize_model(vllm_config=vc)
    # The reference: the same model class under a config of its own (vLLM
    # registers each attention layer's name once per config).
    ref_config = vllm_config(out, tp, dtype)
    with set_current_vllm_config(ref_config), set_default_torch_dtype(ref_config.model_config.dtype):
        reference = initialize_model(vllm_config=ref_config)
    with set_current_vllm_config(vc):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # padding rows (vocabulary) are written by neither loader
            reference.load_state_dict(model.state_dict())
    return vc, model, reference


def create_engine(vc, model):
    """refit's engine, created by vLLM's factory (backend "refit", registered
    by the package's entry point)."""
    load_general_plugins()
    engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)
    assert type(engine).__module__ == "refit._vllm_engine", type(engine)
    return engine


def init_info(engine, out, config=None):
    """The engine's init info: the coordinator and the trainer's manifest in `out`."""
    wait_for(out / "manifest.json")
    init = {"coordinator": json.loads((out / "coordinator.json").read_text()),
            "manifest": json.loads((out / "manifest.json").read_text()),
            "config": {"network": {"transports": ["tcp"], "devices": ["lo"]}, **(config or {})},
            "timeout_s": 20.0}
    return engine.parse_init_info(init)


def make_engine(vc, model, out, rank, config=None):
    """refit's engine, created by vLLM's factory and initialized for this worker."""
    engine = create_engine(vc, model)
    engine.init_transfer_engine(init_info(engine, out, config))
    assert engine.rank == rank
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if n.startswith("model.layers.0.")}
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    print(f"receiver {rank}: registered {len(list(model.parameters()))} parameters ({', '.join(dtypes)}); "
          f"layer 0: {shapes}", flush=True)
    return engine


def main(rank, port, out, versions, tp, dtype, prepare=None, loaded=None):
    """`prepare` turns the trainer's state dict into what the reference loads
    (default: as it is); `loaded(model, reference)` runs after they are built."""
    vc, model, reference = build(rank, port, out, tp, dtype)
    with set_current_vllm_config(vc):
        if loaded:
            loaded(model, reference)
        engine = make_engine(vc, model, out, rank)

        for version in range(1, versions + 1):
            engine.start_weight_update()
            engine.update_weights({"version": version})
            engine.finish_weight_update()
            wait_for(out / f"v{version}.pt")
            state = torch.load(out / f"v{version}.pt")
            reference_state = prepare(state) if prepare else state
            reference.load_weights(reference_state.items())  # vLLM's own loaders, from the full state dict
            bad = mismatches(model, reference)
            assert not bad, f"version {version}: {bad} differ from vLLM's load_weights"
            report = engine.report()
            print(f"receiver {rank}: version {version} bit-exact over {len(state)} tensors, "
                  f"network_bytes {report['network_bytes']}, pause_seconds {report['pause_seconds']:.4f}",
                  flush=True)
            (out / f"ack{version}.{rank}").write_text("ok")

        # A version that one trainer rank never published: the staged refresh
        # fails, and finish commits nothing.
        engine.start_weight_update()
        try:
            engine.update_weights({"version": versions + 1})
        except refit.Error as e:
            print(f"receiver {rank}: version {versions + 1} refused: {type(e).__name__}: {e}", flush=True)
        else:
            raise SystemExit(f"receiver {rank}: version {versions + 1} refreshed without all its sources")
        finally:
            (out / f"ack{versions + 1}.{rank}").write_text("failed")
        engine.finish_weight_update()
        bad = mismatches(model, reference)
        assert not bad, f"after the failed version: {bad} left the old version"
        print(f"receiver {rank}: every parameter still at version {versions}", flush=True)
        engine.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), Path(a[2]), int(a[3]), int(a[4]) if len(a) > 4 else 2,
         a[5] if len(a) > 5 else "float32")
