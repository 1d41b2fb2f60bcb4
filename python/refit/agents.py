"""refit.Source and refit.Receiver: the trainer's and the server's side, for
torch tensors and DTensors, over the C ABI (include/refit/refit.h).

Each agent keeps a reference to every tensor it registered until it is
closed: the library reads (source) or writes (receiver) that memory, and a
tensor freed under it would be memory reused for something else.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from . import _abi
from ._tensors import check_contiguous, check_device, dtensor_spec, dtype_name, is_dtensor, shape_list
from .errors import invalid

if TYPE_CHECKING:
    import torch

LATEST = _abi.LATEST

Config = Mapping[str, Any]

_libraries: dict[str, _abi.Library] = {}


def library(path: str | None = None) -> _abi.Library:
    """The loaded librefit.so (once per path): `path`, else $REFIT_LIBRARY, else
    the one installed in the package, else the loader's search path."""
    key = path or _abi.default_library_path()
    if key not in _libraries:
        _libraries[key] = _abi.Library(key)
    return _libraries[key]


_LOGGING_LEVELS = {_abi.LOG_ERROR: logging.ERROR, _abi.LOG_WARN: logging.WARNING, _abi.LOG_INFO: logging.INFO,
                   _abi.LOG_DEBUG: logging.DEBUG}


def set_log_handler(handler: logging.Logger | Callable[[int, str], None] | None = None, *,
                    library_path: str | None = None) -> None:
    """Routes refit's log lines (every agent of the process) into Python.

    `handler` is a ``logging.Logger`` (each line is logged there at its level),
    or a callable ``handler(level, line)`` given a ``logging`` level and the
    line; None sends the lines to stderr again. The lines are those at or above
    each agent's "log_level". The handler runs on refit's threads, one line at
    a time, and must not call refit. Restored to stderr at interpreter exit.
    """
    lib = library(library_path)
    if handler is None:
        lib.set_log_callback(None)
        return
    emit = handler.log if isinstance(handler, logging.Logger) else handler
    if not callable(emit):
        raise TypeError(f"set_log_handler: expected a logging.Logger, a callable or None, got {type(handler).__name__}")

    def deliver(level: int, line: str) -> None:
        emit(_LOGGING_LEVELS.get(level, logging.ERROR), line)

    lib.set_log_callback(deliver)
    if not getattr(lib, "_log_atexit", False):
        # refit's threads may log after the interpreter is gone: stop first.
        atexit.register(lib.set_log_callback, None)
        lib._log_atexit = True


def _strip_compile_prefix(name: str) -> str:
    # torch.compile wraps a module as `_orig_mod`; the weights keep their names.
    return name.replace("_orig_mod.", "")


class Source:
    """A trainer rank's agent: registers this rank's shards and publishes
    versions of them.

    ``config`` is the JSON config of refit.h as a dict ("rank", "coordinator",
    ...). The trainer may overwrite its shards once ``wait_drained(version)``
    returned (or at once with ``"snapshot": true``).

    Usable as a context manager; ``close()`` leaves the membership.
    """

    def __init__(self, config: Config, *, library_path: str | None = None,
                 rank_of: Callable[[int], int] | None = None) -> None:
        """`rank_of` maps a torch.distributed rank (as DTensor meshes name
        them) to this side's refit rank; by default they are the same."""
        self._lib = library(library_path)
        self._raw = _abi.Source(self._lib, dict(config))
        self._rank = int(config["rank"]) if "rank" in config else None
        self._rank_of = rank_of
        self._tensors: dict[str, Any] = {}  # name -> the tensor (and its local shard): kept alive

    # -- registration -------------------------------------------------------

    def add(self, name: str, tensor: "torch.Tensor", *, ranks: Iterable[int] | None = None,
            spec: Mapping[str, Any] | None = None, shape: Iterable[int] | None = None) -> None:
        """Registers `tensor` under the Hugging Face name `name`.

        A DTensor: its device mesh and placements (Shard, Replicate, and the
        _StridedShard of FSDP2 with TP) become the spec; this rank serves its
        local shard. A plain tensor: this rank holds it whole; `ranks` lists
        every source rank holding the same replica (default: this rank). A
        plain tensor that is a shard: `spec` ({"mesh", "ranks", "placements"})
        and the full `shape`.

        Raises InvalidArgumentError for a non-contiguous tensor, a Partial
        placement or a name given twice, UnsupportedError for a dtype refit
        does not carry; nothing is registered then.
        """
        what = f"tensor \"{name}\""
        if name in self._tensors:
            raise invalid(f"{what} is added twice")
        dtype = dtype_name(tensor.dtype, what)
        if is_dtensor(tensor):
            spec = dtensor_spec(tensor, what, self._rank_of)
            local = tensor.to_local()
            keep = (tensor, local)
        elif spec is not None:
            if shape is None:
                raise invalid(f"{what}: a spec needs the tensor's full shape")
            local = tensor
            spec = dict(spec)
            keep = (tensor,)
        else:
            local = tensor
            holders = [self._rank] if ranks is None else [int(r) for r in ranks]
            if None in holders:
                raise invalid(f"{what}: the config has no \"rank\"; pass ranks=")
            spec = {"mesh": [len(holders)], "ranks": holders, "placements": ["R"]}
            keep = (tensor,)
            shape = tensor.shape
        check_device(local, what)
        check_contiguous(local, what)
        self._tensors[name] = keep
        if local.numel() == 0:
            return  # an empty shard (torch.chunk gave this rank nothing): no buffer
        full = tensor.shape if shape is None else shape
        description = {"name": name, "dtype": dtype, "shape": shape_list(full), "dtensor": spec}
        try:
            self._raw.add_tensor(description, (local.data_ptr(), local.numel() * local.element_size()))
        except BaseException:
            del self._tensors[name]
            raise

    def add_module(self, module: "torch.nn.Module", *, prefix: str = "",
                   rename: Callable[[str], str | None] | None = None) -> list[str]:
        """Adds every parameter of `module` (named_parameters: a tied weight
        once, under its first name). The ranks of a pipeline stage or an
        expert-parallel group pass their own module and so add only their
        part. `rename` maps a parameter name to the Hugging Face one, or to
        None to leave it out. Returns the names added.

        Every parameter is checked (dtype, contiguity, placements) before the
        first is registered: on an error nothing of the module is added.
        """
        items = []
        for pname, param in module.named_parameters():
            name = prefix + _strip_compile_prefix(pname)
            if rename is not None:
                renamed = rename(name)
                if renamed is None:
                    continue
                name = renamed
            what = f"tensor \"{name}\""
            dtype_name(param.dtype, what)
            local = param.to_local() if is_dtensor(param) else param
            check_contiguous(local, what)
            if is_dtensor(param):
                dtensor_spec(param, what, self._rank_of)
            if name in self._tensors or any(n == name for n, _ in items):
                raise invalid(f"{what} is added twice")
            items.append((name, param))
        for name, param in items:
            self.add(name, param.data if not is_dtensor(param) else param)
        return [name for name, _ in items]

    # -- versions -----------------------------------------------------------

    def join(self) -> None:
        """Registers the tensors with the coordinator (the first publish does it too)."""
        self._raw.join()

    def publish(self, version: int) -> None:
        """Says that this rank's shards now hold `version` (greater than every
        version published before)."""
        self._raw.publish(int(version))

    def wait_drained(self, version: int, timeout: float = 10.0) -> None:
        """Blocks until no receiver reads `version` or older; TimeoutError after `timeout` s."""
        self._raw.wait_drained(int(version), int(timeout * 1000))

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def close(self) -> None:
        self._raw.close()
        self._tensors.clear()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Receiver:
    """An inference rank's agent: registers the server's buffers and refreshes
    them.

    With ``"mode": "staged"`` in the config, ``refresh`` stages the version
    while the server goes on, and ``commit`` makes it live (the only pause);
    a failed refresh on any rank of the instance leaves every buffer at the
    old version.
    """

    def __init__(self, config: Config, *, library_path: str | None = None) -> None:
        self._lib = library(library_path)
        self._raw = _abi.Receiver(self._lib, dict(config))
        self._tensors: dict[str, Any] = {}

    def add(self, name: str, tensor: "torch.Tensor", layout: Mapping[str, Any] | str | None = None) -> None:
        """Registers `tensor` as the buffer `name`.

        `layout` says what lands where:
          - "recipe": the buffer is the parameter `name` of the config's
            "recipe" (vLLM's layout of the model), in `tensor`'s dtype:
            the trainer's, or one refit converts it to (F32 to BF16 or F16,
            BF16 to F16, BF16 or F32 to F8_E4M3 where the recipe's manifest
            has the weight's "<name>_scale_inv", whose parameter is then
            registered too; any other pair is refused at join);
          - {"dtensor": {"mesh", "ranks", "placements"}, "shape": [...]}: the
            buffer is this rank's shard of the tensor `name` of that shape;
          - {"segments": [...]}: explicit boxes of named tensors (refit.h);
          - None with a DTensor: its mesh and placements.
        The tensor must be contiguous, and stay allocated: the receiver keeps a
        reference to it until closed.
        """
        what = f"buffer \"{name}\""
        if name in self._tensors:
            raise invalid(f"{what} is added twice")
        if is_dtensor(tensor):
            if layout is None:
                layout = {"dtensor": dtensor_spec(tensor, what), "shape": shape_list(tensor.shape)}
            local = tensor.to_local()
        else:
            local = tensor
        dtype = dtype_name(local.dtype, what)
        check_device(local, what)
        check_contiguous(local, what)
        if layout == "recipe":
            # The tensor's dtype may differ from the trainer's where refit
            # converts on the way (docs/conversion.md).
            description: dict[str, Any] = {"recipe": name, "dtype": dtype}
        elif isinstance(layout, Mapping):
            description = {"name": name, "dtype": dtype, **dict(layout)}
            if "dtensor" in layout and "shape" not in layout:
                raise invalid(f"{what}: a \"dtensor\" layout needs the full \"shape\"")
        else:
            raise invalid(f"{what}: layout must be \"recipe\", a dict with \"dtensor\" or \"segments\", "
                          f"or None for a DTensor; got {layout!r}")
        self._raw.add_buffer(description, (local.data_ptr(), local.numel() * local.element_size()))
        self._tensors[name] = (tensor, local)

    def join(self) -> None:
        self._raw.join()

    def refresh(self, version: int = LATEST, timeout: float = 30.0) -> int:
        """Fills (direct) or stages (staged) `version`, blocking. Returns the
        version now live (direct) or, staged, the version before commit."""
        return self._raw.refresh(int(version), int(timeout * 1000))

    def refresh_start(self, version: int = LATEST, timeout: float = 30.0) -> None:
        """Starts the refresh on a thread of the library and returns at once."""
        self._raw.refresh_start(int(version), int(timeout * 1000))

    def refresh_poll(self) -> bool:
        """True once the started refresh is done; raises if it failed."""
        return self._raw.refresh_poll()

    async def refresh_async(self, version: int = LATEST, timeout: float = 30.0, poll: float = 0.002) -> int:
        """The same refresh, awaitable: the event loop runs while it lands."""
        self.refresh_start(version, timeout)
        while not self.refresh_poll():
            await asyncio.sleep(poll)
        return self.version

    def commit(self) -> int:
        """Staged mode: makes the staged version live; returns it."""
        return self._raw.commit()

    @property
    def version(self) -> int:
        """The version the buffers hold (0 before any, or after a failed direct refresh)."""
        return self._raw.version()

    def progress(self) -> dict[str, Any]:
        """Where the refresh stands; any thread, also while a started refresh
        runs: ``attempt`` (from 1), ``version`` (0 until the attempt's
        transfer begins), ``state`` ("idle", "joined", "leased",
        "transferring", "committed", ...), ``network_bytes_planned`` and
        ``network_bytes_landed`` (this rank's GETs in the attempt). A finished
        refresh keeps its last attempt's figures (refit.h,
        refit_receiver_progress)."""
        return self._raw.progress()

    def report(self) -> dict[str, Any]:
        """The last finished refresh's report (refit.h lists the keys)."""
        report = self._raw.report()
        return report if isinstance(report, dict) else json.loads(report)

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def close(self) -> None:
        self._raw.close()
        self._tensors.clear()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
