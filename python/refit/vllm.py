"""refit as vLLM's weight-transfer backend "refit".

Supported vLLM: 0.33.x (the WeightTransferEngine interface with
start_weight_update / update_weights / finish_weight_update, the factory's
register_engine, TrainerWeightTransferEngine and WeightSource). This module
imports without vLLM; the engine classes (RefitWeightTransferEngine,
RefitTrainerWeightTransferEngine, RefitInitInfo, RefitUpdateInfo,
RefitTrainerInitInfo) import it when first used, and a vLLM outside the
supported range is refused then, naming its version.

Registration: the ``vllm.general_plugins`` entry point ``refit`` (in the
package's metadata) calls :func:`register`, which vLLM runs in every process
it starts, so ``--weight-transfer-config '{"backend": "refit"}'`` works with
nothing else installed. ``register`` is safe to call more than once.

Inference side (:class:`RefitWeightTransferEngine`, one per worker):

- ``init_transfer_engine`` creates a staged refit receiver for this worker's
  rank (tp_rank + tp * (pp_rank + pp * instance)) and registers the storage
  of every live parameter vLLM allocated (its TP shard, fused qkv_proj /
  gate_up_proj / w13 / w2, padded vocabulary) as a receiver buffer, laid out
  by refit's vLLM recipe for the trainer's manifest and the model's Hugging
  Face config. A parameter the recipe does not know, a dtype that differs
  from the trainer's, or a parameter whose size is not the recipe's for
  this rank (another tp, head_dim or vocabulary padding than the recipe's;
  the message names the parameter, its shape and both sizes) is refused
  before any transfer.
- A model vLLM serves in block FP8 (``quantization_config`` with
  ``"quant_method": "fp8"`` and ``"weight_block_size": [128, 128]``: each
  linear layer's ``weight`` and FusedMoE's ``w13_weight`` and ``w2_weight``
  in float8_e4m3fn, each beside its ``weight_scale_inv`` in float32) is
  refreshed from a BF16 or F32 trainer: refit quantizes on the way
  (docs/conversion.md, "The vLLM engine"). The trainer's weights that an
  FP8 parameter fuses (from the model's ``packed_modules_mapping``; for
  FusedMoE, every expert's gate_proj and up_proj, or down_proj) get their
  scale tensors in the recipe's manifest, so that ``weight_scale_inv`` is
  laid out beside its weight. An FP8 parameter without its
  ``weight_scale_inv``, with scales in another dtype than F32, in another
  block than 128x128, experts whose blocks vLLM refined for their shard, or
  shards that cut the blocks is refused at init, naming it, with nothing
  registered.
- ``start_weight_update`` opens a round; ``update_weights({"version": N})``
  stages version N (the server keeps serving the old weights meanwhile);
  ``finish_weight_update`` commits: the staged bytes are copied into the
  parameters. A refresh that failed on any rank of the instance raises from
  ``update_weights`` and leaves every parameter at the old version. The
  commit is the only moment the weights change; the trainer engine pauses
  the server around it (below).

Trainer side (:class:`RefitTrainerWeightTransferEngine`): every trainer rank
registers its shards (DTensors as they are) with a refit source; each
``send_weights`` publishes the next version, and the sender (rank 0) drives
the workers' start / update / finish through vLLM's client. vLLM 0.33 offers
pause and resume on its engine client only (not to the workers), so the
sender brackets ``finish_weight_update`` with them: ``/pause?mode=M`` and
``/resume`` through ``HTTPVLLMWeightSyncClient``, ``pause_generation`` and
``resume_generation`` of the actors through ``RayVLLMWeightSyncClient``, or
of any client that has them. ``RefitTrainerInitInfo.pause_mode`` is vLLM's
mode ("keep", the default: requests wait in the queue; "wait"; "abort"), or
None for no pause. Resume follows a failed commit too.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import errors

SUPPORTED_VLLM = ((0, 33), (0, 34))  # [min, max): 0.33.x
BACKEND = "refit"

# vLLM renames parameters between versions; the recipe uses one spelling.
# Each (vLLM's, refit's) pair rewrites a name before it is looked up.
_NAME_ALIASES = (
    (".mlp.experts.routed_experts.", ".mlp.experts."),
)


def check_vllm_version(version: str) -> None:
    """Raises UnsupportedError for a vLLM outside SUPPORTED_VLLM."""
    parts = version.split("+")[0].split(".")
    try:
        key = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        raise errors.unsupported(f"vLLM version {version!r} cannot be read") from None
    lo, hi = SUPPORTED_VLLM
    if not lo <= key < hi:
        raise errors.unsupported(f"vLLM {version} is not supported by refit.vllm "
                                 f"(supported: {lo[0]}.{lo[1]}.x); its weight-transfer interface differs")


def recipe_name(vllm_name: str) -> str:
    """The recipe's name for a vLLM parameter name."""
    for theirs, ours in _NAME_ALIASES:
        vllm_name = vllm_name.replace(theirs, ours)
    return vllm_name


def write_model_files(directory: str, manifest: dict[str, Any], hf_config: dict[str, Any]) -> str:
    """Writes `manifest` as model.json and `hf_config` as model.config.json
    (docs/planner: a manifest and its Hugging Face config side by side);
    returns the manifest's path."""
    path = os.path.join(directory, "model.json")
    with open(path, "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(directory, "model.config.json"), "w") as f:
        json.dump(hf_config, f)
    return path


_ENGINE_NAMES = ("RefitWeightTransferEngine", "RefitTrainerWeightTransferEngine", "RefitInitInfo",
                 "RefitUpdateInfo", "RefitTrainerInitInfo")


def import_vllm() -> Any:
    """vLLM, checked against SUPPORTED_VLLM; UnsupportedError when missing or outside it."""
    try:
        import vllm
    except ImportError as e:
        lo = SUPPORTED_VLLM[0]
        raise errors.unsupported(f"refit.vllm needs vLLM {lo[0]}.{lo[1]}.x: {e}") from e
    check_vllm_version(vllm.__version__)
    return vllm


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from . import _vllm_engine
        return getattr(_vllm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Registers backend "refit" with vLLM's factories (idempotent): what the
    ``vllm.general_plugins`` entry point runs in each vLLM process."""
    import_vllm()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "refit._vllm_engine", "RefitWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "refit._vllm_engine",
                                                     "RefitTrainerWeightTransferEngine")
