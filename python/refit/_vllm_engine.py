"""The vLLM engine classes of refit.vllm (which documents them). Importing
this module imports vLLM and checks its version."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from . import errors
from ._tensors import dtype_name
from .agents import Receiver, Source
from .vllm import BACKEND, import_vllm, recipe_name, write_model_files

import_vllm()

from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """What each worker needs: where the coordinator is and what the trainer serves.

    coordinator: refit's "coordinator" config ({"address", "token_file", ...}).
    manifest: the trainer's tensors, {"name": {"dtype": "BF16", "shape": [...]}}
        in Hugging Face names (a safetensors header without offsets).
    hf_config: the model's Hugging Face config; default: vLLM's hf_config.
    instance: this server's index among the servers refreshed together
        (default: vLLM's data-parallel index); instances: how many (default:
        vLLM's data-parallel size).
    domain: ranks of one domain share a local fabric (default 0: one host).
    config: more receiver config keys (network, local, verify, log_level, ...).
    timeout_s: deadline of one refresh.
    """

    coordinator: dict[str, Any]
    manifest: dict[str, Any]
    hf_config: dict[str, Any] | None = None
    instance: int | None = None
    instances: int | None = None
    domain: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """The version to stage (what the trainer published)."""

    version: int


def _config_json(hf_config: Any) -> dict[str, Any]:
    """A transformers config as its config.json spells it. transformers 5
    writes some keys under their attribute names (Qwen3-MoE's "num_experts"
    as "num_local_experts"); the recipes read the config.json names, which
    the config's attribute_map gives back."""
    out = hf_config.to_dict()
    for spelled, stored in getattr(hf_config, "attribute_map", {}).items():
        if spelled not in out and stored in out:
            out[spelled] = out[stored]
    return out


# refit's vLLM recipe lays out FP8 block scales of 128x128 blocks only
# (planner/recipes/model.h); vLLM names a block-FP8 weight's scales so.
FP8_BLOCK = (128, 128)
_SCALE = "_scale_inv"


# FusedMoE's FP8 parameters (Fp8MoEMethod.create_weights): each stacks one
# weight of every expert, [E, 2I, H] for gate and up, [E, H, I] for down,
# with "<name>_scale_inv" [E, rows/128, cols/128] beside it.
_EXPERT_PARTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def _expert_weights(module: Any, name: str, param: Any, what: str) -> list[str]:
    """The trainer's expert weights that `name`, a FusedMoE FP8 parameter of
    `module`, stacks: every expert of the layer (with expert parallelism the
    recipe picks this worker's), in Hugging Face names:
    "<layer>.mlp.experts.<e>.gate_proj.weight"."""
    module_name, _, leaf = name.rpartition(".")
    method = getattr(module, "quant_method", None)
    refine = getattr(method, "weight_scale_refine", None)
    if refine is not None:
        block = [int(b) for b in getattr(method, "moe_block_shape", None) or ()]
        raise errors.unsupported(f"{what}: vLLM scales this worker's experts in blocks of {block} (the "
                                 f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks divided by {tuple(refine)}), since its "
                                 "shard cuts them; refit lays out whole 128x128 blocks only (choose a tp that "
                                 "divides each expert's width into multiples of 128, or expert parallelism)")
    experts = int(getattr(module, "global_num_experts", 0) or param.shape[0])
    prefix = recipe_name(module_name + ".weight")[: -len(".weight")]
    return [f"{prefix}.{e}.{part}.weight" for e in range(experts) for part in _EXPERT_PARTS[leaf]]


def _fp8_weights(model: Any, params: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """The vLLM parameters held in F8_E4M3 with 128x128 block scales, each
    with the trainer's (Hugging Face) names of the weights it fuses, from the
    model's packed_modules_mapping (qkv_proj: q_proj, k_proj, v_proj, ...),
    or for FusedMoE's w13_weight and w2_weight every expert's gate_proj and
    up_proj, or down_proj. Raises, naming the parameter, for an FP8
    parameter without its "<name>_scale_inv" beside it (F32), another block,
    experts whose blocks vLLM refined, or one that is neither a linear
    layer's weight nor FusedMoE's."""
    by_name = dict(params)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    out: dict[str, list[str]] = {}
    for name, param in params:
        if str(param.dtype) != "torch.float8_e4m3fn":
            continue
        what = f"vLLM parameter \"{name}\" (F8_E4M3)"
        leaf = name.rpartition(".")[2]
        experts = leaf in _EXPERT_PARTS and len(param.shape) == 3
        if not name.endswith(".weight") and not experts:
            raise errors.unsupported(f"{what}: refit's vLLM engine lands FP8 weights of linear layers and "
                                     "FusedMoE experts only")
        scale = by_name.get(name + _SCALE)
        if scale is None:
            raise errors.invalid(f"{what} has no \"{name}{_SCALE}\" beside it: refit lands an FP8 weight with "
                                 "its block scales (docs/conversion.md), and the model has none for it")
        if str(scale.dtype) != "torch.float32":
            raise errors.unsupported(f"{what}: its scales \"{name}{_SCALE}\" are {scale.dtype}; refit computes "
                                     "F32 block scales (docs/conversion.md)")
        module = model.get_submodule(name.rpartition(".")[0])
        block = getattr(module, "weight_block_size", None)
        if block is None or tuple(int(b) for b in block) != FP8_BLOCK:
            raise errors.unsupported(f"{what} is quantized in blocks of {block}; refit's vLLM recipe lays out "
                                     f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks only")
        if experts:
            out[name] = _expert_weights(module, name, param, what)
            continue
        prefix, _, leaf = recipe_name(name)[: -len(".weight")].rpartition(".")
        out[name] = [f"{prefix}.{part}.weight" for part in packed.get(leaf, [leaf])]
    return out


def _with_scales(manifest: dict[str, Any], fp8: dict[str, list[str]]) -> dict[str, Any]:
    """The trainer's manifest with "<W>_scale_inv" (F32, one per 128x128
    block of W) for each weight W that vLLM holds in FP8: the recipe then
    lays out the scale parameters beside the weights, and the library
    computes them on the way (docs/conversion.md, "At the receiver")."""
    out = dict(manifest)
    for param, weights in fp8.items():
        for w in weights:
            if w not in manifest:
                raise errors.invalid(
                    f"vLLM parameter \"{param}\" (F8_E4M3) holds \"{w}\", which the trainer's manifest does not have")
            shape = [int(d) for d in manifest[w]["shape"]]
            if len(shape) != 2:
                raise errors.invalid(f"vLLM parameter \"{param}\" (F8_E4M3): \"{w}\" has shape {shape}; "
                                     "block scales need 2 dims")
            out.setdefault(w + _SCALE, {"dtype": "F32", "shape": [-(-shape[0] // FP8_BLOCK[0]),
                                                                   -(-shape[1] // FP8_BLOCK[1])]})
    return out


def _expert_parallel(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.parallel_config, "enable_expert_parallel", False))


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """The worker side: a staged refit receiver over the live parameters."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: Receiver | None = None
        self._files: tempfile.TemporaryDirectory[str] | None = None
        self._staged: int | None = None
        self._active = False
        self._timeout_s = 60.0
        self.rank = -1

    # -- set-up -------------------------------------------------------------

    def _rank(self, instance: int) -> tuple[int, int, int]:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
        pc = self.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        tp_rank = get_tensor_model_parallel_rank()
        pp_rank = get_pp_group().rank_in_group
        return tp_rank + tp * (pp_rank + pp * instance), tp, pp

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        if self._receiver is not None:
            raise errors.invalid("refit: init_transfer_engine called twice; shutdown() first")
        pc = self.parallel_config
        instance = pc.data_parallel_index if init_info.instance is None else int(init_info.instance)
        instances = pc.data_parallel_size if init_info.instances is None else int(init_info.instances)
        self.rank, tp, pp = self._rank(instance)
        hf_config = init_info.hf_config
        if hf_config is None:
            hf_config = _config_json(self.model_config.hf_config)
        params = list(self.model.named_parameters())

        self._files = tempfile.TemporaryDirectory(prefix="refit-vllm-")
        receiver: Receiver | None = None
        error: BaseException | None = None
        try:
            # The FP8 parameters are checked before the receiver exists: a
            # bad FP8 model registers nothing.
            manifest = _with_scales(init_info.manifest, _fp8_weights(self.model, params))
            model_path = write_model_files(self._files.name, manifest, hf_config)
            config = {**init_info.config, "rank": self.rank, "domain": int(init_info.domain), "instance": instance,
                      "mode": "staged", "coordinator": dict(init_info.coordinator),
                      "recipe": {"model": model_path, "framework": "vllm", "tp": tp, "pp": pp, "dp": instances,
                                 "expert_parallel": _expert_parallel(self.vllm_config)}}
            receiver = Receiver(config)
            for name, param in params:
                self._add(receiver, name, param)
            receiver.join()
        except Exception as e:  # reported to the other workers before it is raised
            error = e
        # Every worker of the instance must have joined before any refreshes
        # (refit.h, refit_receiver_join), and a worker that failed must not
        # leave the others waiting for it.
        failed = self._workers_failed(error is not None)
        if error is not None or failed:
            if receiver is not None:
                receiver.close()
            self._files.cleanup()
            self._files = None
            if error is not None:
                raise error
            raise errors.invalid(f"refit: {failed} other worker(s) of this vLLM instance failed to register "
                                 "their parameters (their logs say why); nothing was registered")
        self._receiver = receiver
        self._timeout_s = float(init_info.timeout_s)

    @staticmethod
    def _workers_failed(failed_here: bool) -> int:
        """How many workers of this instance failed (a sum over vLLM's world group)."""
        import torch
        import torch.distributed as dist
        from vllm.distributed import get_world_group
        flag = torch.tensor([1 if failed_here else 0], dtype=torch.int64)
        dist.all_reduce(flag, group=get_world_group().cpu_group)
        return int(flag.item()) - (1 if failed_here else 0)

    @staticmethod
    def _add(receiver: Receiver, name: str, param: Any) -> None:
        target = recipe_name(name)
        try:
            receiver.add(target, param.data, "recipe")
        except errors.NotFoundError as e:
            raise errors.NotFoundError(
                e.call, e.status, e.status_name,
                f"vLLM parameter \"{name}\" has no counterpart in refit's vLLM recipe for this model "
                f"(the names the trainer serves do not match the server's): {e.message}") from None
        except errors.InvalidArgumentError as e:
            # The library compares the parameter's bytes with the recipe's
            # (refit.h, refit_receiver_add_buffer); say which vLLM shape it was.
            raise errors.InvalidArgumentError(
                e.call, e.status, e.status_name,
                f"vLLM parameter \"{name}\" {list(param.shape)} {param.dtype}: {e.message}") from None

    # -- one round ----------------------------------------------------------

    def _need(self) -> Receiver:
        if self._receiver is None:
            raise errors.invalid("refit: init_transfer_engine has not been called")
        return self._receiver

    def start_weight_update(self) -> None:
        self._need()
        self._active = True
        self._staged = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receive_weights;
        # refit's refresh is complete when it returns, on the CPU too.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        receiver = self._need()
        if not self._active:
            raise errors.invalid("refit: update_weights before start_weight_update")
        self._staged = None
        receiver.refresh(int(update_info.version), self._timeout_s)  # raises; buffers keep the old version
        self._staged = int(update_info.version)

    def finish_weight_update(self) -> None:
        receiver = self._need()
        if not self._active:
            raise errors.invalid("refit: finish_weight_update without start_weight_update")
        self._active = False
        if self._staged is None:
            return  # nothing staged (no update, or it failed): the weights stay as they were
        self._staged = None
        receiver.commit()

    def report(self) -> dict[str, Any]:
        return self._need().report()

    def progress(self) -> dict[str, Any]:
        """Where the worker's refresh stands (refit.Receiver.progress); any
        thread, also while update_weights runs."""
        return self._need().progress()

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._files is not None:
            self._files.cleanup()
            self._files = None


@dataclass
class RefitTrainerInitInfo(TrainerInitInfo):
    """The trainer side: refit's source config (coordinator, network, ...;
    "rank" is `rank`) and what the workers' init needs beyond the manifest
    (RefitInitInfo's other fields, as a dict)."""

    backend: ClassVar[str] = BACKEND

    source_config: dict[str, Any] = field(default_factory=dict)
    worker_init: dict[str, Any] = field(default_factory=dict)
    drain_timeout_s: float = 60.0
    # vLLM's pause mode around the commit ("keep", "wait" or "abort"; see
    # vLLM's pause_generation), or None for no pause.
    pause_mode: str | None = "keep"


PAUSE_MODES = ("keep", "wait", "abort")


def _check_pause_mode(mode: str | None) -> None:
    if mode is not None and mode not in PAUSE_MODES:
        raise errors.invalid(f"refit: pause_mode must be one of {', '.join(PAUSE_MODES)} or None, got {mode!r}")


def _pause(client: Any, mode: str | None) -> Callable[[], None] | None:
    """Pauses the server's generation through `client`; returns the call that
    resumes it, or None when there is no pause.

    vLLM 0.33 offers pause and resume on its engine client (AsyncLLM's
    pause_generation / resume_generation, the HTTP routes /pause and /resume,
    Ray actors of AsyncLLM), not to the workers: so the trainer's sender,
    which drives finish_weight_update, brackets it. A client that is none of
    these and has no pause_generation is not paused (the commit still runs
    between two of vLLM's steps, as every collective RPC does).
    """
    if mode is None:
        return None
    _check_pause_mode(mode)
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient
    if isinstance(client, HTTPVLLMWeightSyncClient):
        client._post(f"pause?mode={mode}")
        return lambda: client._post("resume")
    if isinstance(client, RayVLLMWeightSyncClient):
        import ray
        ray.get([h.pause_generation.remote(mode=mode) for h in client.handles])
        return lambda: ray.get([h.resume_generation.remote() for h in client.handles])
    pause, resume = getattr(client, "pause_generation", None), getattr(client, "resume_generation", None)
    if callable(pause) and callable(resume):
        pause(mode=mode)
        return resume
    return None


def _manifest(source: WeightSource) -> dict[str, Any]:
    return {m.name: {"dtype": dtype_name(m.dtype, f"tensor \"{m.name}\""), "shape": [int(d) for d in m.shape]}
            for m in source.metadata}


def _placement(p: Any) -> str:
    from vllm.distributed.weight_transfer.base import Shard
    return f"S({p.dim})" if isinstance(p, Shard) else "R"


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    init_info_cls = RefitTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource, rank: int, refit_source: Source,
                 init_info: RefitTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=rank == 0, rank=rank)
        self._src = refit_source
        self._info = init_info
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> "RefitTrainerWeightTransferEngine":
        if source is None:
            raise errors.invalid("refit: the trainer engine needs a WeightSource")
        _check_pause_mode(init_info.pause_mode)
        src = Source({**init_info.source_config, "rank": init_info.rank})
        try:
            if isinstance(source, ModuleSource):
                # The module itself: DTensors with every placement, strided shards included.
                src.add_module(source._module)
            else:
                by_name = {m.name: m for m in source.metadata}
                for name, local in source.iter_local():
                    m = by_name[name]
                    if m.owners is None or m.placements is None:
                        src.add(name, local)  # this rank holds it whole
                    else:
                        src.add(name, local, shape=m.shape,
                                spec={"mesh": list(m.mesh_shape), "ranks": list(m.owners),
                                      "placements": [_placement(p) for p in m.placements]})
            src.join()
            engine = cls(client=client, source=source, rank=init_info.rank, refit_source=src, init_info=init_info)
            if engine.is_sender:
                client.init_weight_transfer_engine({**init_info.worker_init, "manifest": _manifest(source)})
        except BaseException:
            src.close()
            raise
        return engine

    def send_weights(self) -> None:
        """Publishes the next version; the sender has the workers stage it
        (the server serves on meanwhile), then pauses the server, commits
        (finish_weight_update) and resumes it, also when the commit fails."""
        self.version += 1
        self._src.publish(self.version)
        if self.is_sender:
            self.client.start_weight_update()
            try:
                self.client.update_weights({"version": self.version})
            except BaseException:
                # vLLM's workers close the round themselves when update
                # fails, and a staged refresh that failed on one worker
                # failed on every worker of the instance: nothing is staged
                # anywhere, and this finish only closes a round left open.
                try:
                    self.client.finish_weight_update()
                except Exception:
                    pass
                raise
            resume = _pause(self.client, self._info.pause_mode)
            try:
                self.client.finish_weight_update()
            finally:
                if resume is not None:
                    resume()
        self._src.wait_drained(self.version, self._info.drain_timeout_s)

    def shutdown(self) -> None:
        self._src.close()
