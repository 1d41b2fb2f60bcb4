"""One vLLM worker of test_vllm_fp8.py: vLLM's own model class for
DIR/hf/config.json served in block FP8 (quantization_config
{"quant_method": "fp8", "weight_block_size": [128, 128]}: every linear
layer's `weight` in float8_e4m3fn and its `weight_scale_inv` in float32, as
vLLM's Fp8LinearMethod.create_weights makes them), at tp TP over gloo.

    vllm_fp8_receiver.py RANK PORT DIR VERSIONS TP refresh
    vllm_fp8_receiver.py RANK PORT DIR 0 TP refused
    vllm_fp8_receiver.py RANK PORT DIR 0 TP refused-as-built

Both first run vLLM's own post-load step of the attention layers (it drops
their KV-cache scales, as in a served model; loaded_like_vllm).

refresh: refreshed by refit's engine from the BF16 trainer of
fsdp_trainer.py, each version compared bit for bit with a second instance
loaded by vLLM's own load_weights from the trainer's state dict quantized by
the torch reference of docs/conversion.md (reference_quantize of
tests/transport/convert/torch_reference_test.py): FP8 weights, block scales
and the BF16 parameters alike (vllm_receiver.main).

refused-as-built: the engine's init on the model as vLLM built it, refused
with the error printed.

refused: the engine's init on a model with one scale parameter removed, with
one layer's weight_block_size set to [64, 64], then on the model as it is,
whose shards cut the 128x128 blocks: each is refused with the error
printed, and nothing is registered.

This vLLM has no FP8 kernel on the CPU (its CPU kernels need the compiled
vllm._C ops), and Fp8LinearMethod.create_weights picks one after it has
registered the parameters: where vLLM finds none, a stand-in that refuses to
run takes the kernel's place. The parameters are vLLM's own; nothing here
runs the model forward, nor process_weights_after_loading.
"""

import re
import sys
from pathlib import Path

import torch

import vllm_receiver as base
from vllm.config import set_current_vllm_config

import refit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport" / "convert"))
from torch_reference_test import reference_quantize  # noqa: E402

BLOCK = (128, 128)
# The Hugging Face weights vLLM quantizes (its linear layers).
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight")


class NoKernel:
    """Takes the place of the FP8 kernel vLLM cannot find on this machine."""

    def __init__(self, reason):
        self.reason = reason

    def process_weights_after_loading(self, layer):
        raise RuntimeError(self.reason)

    def apply_weights(self, *args, **kwargs):
        raise RuntimeError(self.reason)


def without_fp8_kernel():
    from vllm.model_executor.layers.quantization import fp8
    choose = fp8.init_fp8_linear_kernel

    def init(*args, **kwargs):
        try:
            return choose(*args, **kwargs)
        except ValueError as e:
            return NoKernel(f"vLLM has no FP8 kernel on this machine: {e}")

    fp8.init_fp8_linear_kernel = init


def loaded_like_vllm(*models):
    """vLLM consumes an FP8 model's KV-cache scales once it is loaded: the
    kv-cache method's process_weights_after_loading (vLLM's own code, run
    here) deletes each attention layer's q_scale, k_scale, v_scale and
    prob_scale, which no trainer holds."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    for model in models:
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, BaseKVCacheMethod):
                method.process_weights_after_loading(module)


def quantized(state):
    """The trainer's BF16 state dict as a block-FP8 checkpoint: each linear
    weight W as F8_E4M3 and W_scale_inv, by the torch reference."""
    out = {}
    for name, t in state.items():
        if QUANTIZED.fullmatch(name):
            out[name], out[name + "_scale_inv"] = reference_quantize(t, BLOCK)
        else:
            out[name] = t
    assert any(v.dtype == torch.float8_e4m3fn for v in out.values())
    return out


def built(rank, port, out, tp):
    """vLLM's model for this rank, loaded as vLLM leaves it, and refit's
    engine for it (not initialized)."""
    vc, model, _ = base.build(rank, port, out, tp, "bfloat16")
    with set_current_vllm_config(vc):
        loaded_like_vllm(model)
        return vc, model, base.create_engine(vc, model)


def init_refused(engine, out, rank, case):
    """The engine's init, which must be refused: the error printed."""
    try:
        engine.init_transfer_engine(base.init_info(engine, out))
    except refit.Error as e:
        print(f"receiver {rank}: {case}refused: {type(e).__name__}: {e}", flush=True)
    else:
        raise SystemExit(f"receiver {rank}: {case}the engine registered the model")


def refused(rank, port, out, tp):
    vc, model, engine = built(rank, port, out, tp)
    qkv = model.model.layers[0].self_attn.qkv_proj
    with set_current_vllm_config(vc):
        scale = qkv._parameters.pop("weight_scale_inv")
        for case in ("without a scale", "in 64x64 blocks", "as vLLM built it"):
            init_refused(engine, out, rank, case + ": ")
            if case == "without a scale":  # the scale back, the block other than the recipe's
                qkv._parameters["weight_scale_inv"] = scale
                qkv.weight_block_size = [64, 64]
            else:
                qkv.weight_block_size = list(BLOCK)
        # Nothing was left registered: the engine holds no receiver.
        try:
            engine.update_weights({"version": 1})
        except refit.InvalidArgumentError as e:
            print(f"receiver {rank}: no receiver left: {e}", flush=True)


def refused_as_built(rank, port, out, tp):
    """The engine's init on the model as vLLM built it, refused."""
    vc, _, engine = built(rank, port, out, tp)
    with set_current_vllm_config(vc):
        init_refused(engine, out, rank, "")


if __name__ == "__main__":
    a = sys.argv[1:]
    without_fp8_kernel()
    if a[5] == "refused":
        refused(int(a[0]), int(a[1]), Path(a[2]), int(a[4]))
    elif a[5] == "refused-as-built":
        refused_as_built(int(a[0]), int(a[1]), Path(a[2]), int(a[4]))
    else:
        base.main(int(a[0]), int(a[1]), Path(a[2]), int(a[3]), int(a[4]), "bfloat16", prepare=quantized,
                  loaded=loaded_like_vllm)
