"""torch tensors and DTensors as refit descriptions: dtype names, the DTensor
spec of docs (FORMATS: "S(d)", "R", "SS(d,k)"), and the checks that come
before anything is registered. torch is imported lazily: the package imports
without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from .errors import invalid, unsupported

if TYPE_CHECKING:
    import torch

# torch dtype name -> the safetensors name refit carries.
_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
}


def dtype_name(dtype: "torch.dtype", what: str) -> str:
    """refit's name for a torch dtype; UnsupportedError naming `what` otherwise."""
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise unsupported(f"{what}: dtype {dtype} is not one refit carries "
                          f"(torch.{', torch.'.join(_DTYPES)})")
    return _DTYPES[key]


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return False
    return isinstance(t, DTensor)


def placement_name(p: Any, what: str) -> str:
    """One DTensor placement as refit writes it."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # older torch: no strided shards
        _StridedShard = ()  # type: ignore[assignment]
    # _StridedShard first: in some torch versions it is a Shard.
    if _StridedShard and isinstance(p, _StridedShard):
        return f"SS({p.dim},{int(p.split_factor)})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        raise invalid(f"{what}: placement {p} is Partial (a pending reduction): refit moves values, "
                      "not partial sums; redistribute it to Replicate or Shard first")
    raise invalid(f"{what}: placement {p!r} is not one refit knows (Shard, Replicate, _StridedShard)")


def dtensor_spec(dt: Any, what: str, rank_of: Callable[[int], int] | None = None) -> dict[str, Any]:
    """{"mesh", "ranks", "placements"} of a DTensor: its device mesh's shape,
    the mesh's ranks in row-major order (mapped through `rank_of`, default:
    the torch.distributed rank is the refit rank), one placement per mesh dim."""
    mesh = dt.device_mesh
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if rank_of is not None:
        ranks = [int(rank_of(r)) for r in ranks]
    return {"mesh": [int(d) for d in mesh.mesh.shape], "ranks": ranks,
            "placements": [placement_name(p, what) for p in dt.placements]}


def check_contiguous(t: "torch.Tensor", what: str) -> None:
    if not t.is_contiguous():
        raise invalid(f"{what}: the tensor is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
                      "refit reads and writes the memory in place, so pass a contiguous tensor "
                      "(a .contiguous() copy would not be the live one)")


def check_device(t: "torch.Tensor", what: str) -> None:
    if t.device.type not in ("cpu", "cuda"):
        raise unsupported(f"{what}: tensors on {t.device} are not supported (host memory or CUDA)")


def shape_list(shape: Sequence[int]) -> list[int]:
    return [int(d) for d in shape]
