"""The raw ctypes binding over librefit.so (include/refit/refit.h).

Internal to the ``refit`` package: the public API (``refit.Source``,
``refit.Receiver``) is built on it and keeps references to the tensors it
hands the library. ``integration/python/refit.py`` re-exports this module for
the plain examples that work with raw buffers.

Only the C ABI's function table is used: ``refit_get_api(REFIT_ABI_VERSION)``,
whose ``abi_version`` and ``size`` are checked before any entry is read. Every
call that fails raises :class:`RefitError` carrying the status and the
library's message (``refit_last_error()``, read on the calling thread).

Buffers are any writable object with the buffer protocol (``bytearray``,
``numpy`` arrays, ``memoryview``, ctypes arrays), or a raw address with its
size (``(ptr, nbytes)``, e.g. ``tensor.data_ptr()`` of a contiguous host
tensor). The library keeps pointers to them until the agent is closed, so
the agent object keeps a reference to each buffer it was given.

Usage::

    lib = Library()                             # see Library for the search order
    with lib.receiver({"rank": 0, "coordinator": {...}}) as rx:
        rx.add_buffer({"name": "w", "dtype": "F32", "segments": [...]}, buf)
        rx.refresh(refit.LATEST, timeout_ms=30000)
        print(rx.report())
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Any

ABI_VERSION = 1
LATEST = -1

OK = 0
INVALID_ARGUMENT = 1
NOT_FOUND = 2
IO_ERROR = 3
TIMEOUT = 4
UNSUPPORTED = 5
INTERNAL = 6
IN_PROGRESS = 7
PEER_LOST = 8
ABORTED = 9
VERIFY_FAILED = 10

_status_t = ctypes.c_int
_source_p = ctypes.c_void_p
_receiver_p = ctypes.c_void_p

# refit_log_level_t and refit_log_fn (refit.h).
LOG_ERROR = 0
LOG_WARN = 1
LOG_INFO = 2
LOG_DEBUG = 3
LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)



class _Progress(ctypes.Structure):
    """refit_progress_t (refit.h)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("attempt", ctypes.c_uint32),
        ("version", ctypes.c_int64),
        ("state", ctypes.c_char_p),
        ("network_bytes_planned", ctypes.c_uint64),
        ("network_bytes_landed", ctypes.c_uint64),
    ]


# The fields of refit_api_t, in order (refit.h).
_API_FIELDS = [
    ("abi_version", ctypes.c_uint32),
    ("size", ctypes.c_uint32),
    ("version", ctypes.CFUNCTYPE(ctypes.c_char_p)),
    ("last_error", ctypes.CFUNCTYPE(ctypes.c_char_p)),
    ("status_name", ctypes.CFUNCTYPE(ctypes.c_char_p, _status_t)),
    ("source_create", ctypes.CFUNCTYPE(_status_t, ctypes.c_char_p, ctypes.POINTER(_source_p))),
    ("source_add_tensor", ctypes.CFUNCTYPE(_status_t, _source_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint64)),
    ("source_join", ctypes.CFUNCTYPE(_status_t, _source_p)),
    ("source_publish", ctypes.CFUNCTYPE(_status_t, _source_p, ctypes.c_int64)),
    ("source_wait_drained", ctypes.CFUNCTYPE(_status_t, _source_p, ctypes.c_int64, ctypes.c_int64)),
    ("source_destroy", ctypes.CFUNCTYPE(None, _source_p)),
    ("receiver_create", ctypes.CFUNCTYPE(_status_t, ctypes.c_char_p, ctypes.POINTER(_receiver_p))),
    ("receiver_add_buffer", ctypes.CFUNCTYPE(_status_t, _receiver_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint64)),
    ("receiver_join", ctypes.CFUNCTYPE(_status_t, _receiver_p)),
    ("receiver_refresh", ctypes.CFUNCTYPE(_status_t, _receiver_p, ctypes.c_int64, ctypes.c_int64)),
    ("receiver_refresh_start", ctypes.CFUNCTYPE(_status_t, _receiver_p, ctypes.c_int64, ctypes.c_int64)),
    ("receiver_refresh_poll", ctypes.CFUNCTYPE(_status_t, _receiver_p)),
    ("receiver_refresh_wait", ctypes.CFUNCTYPE(_status_t, _receiver_p, ctypes.c_int64)),
    ("receiver_report", ctypes.CFUNCTYPE(ctypes.c_char_p, _receiver_p)),
    ("receiver_version", ctypes.CFUNCTYPE(ctypes.c_int64, _receiver_p)),
    ("receiver_destroy", ctypes.CFUNCTYPE(None, _receiver_p)),
    ("receiver_commit", ctypes.CFUNCTYPE(_status_t, _receiver_p)),
    ("set_log_callback", ctypes.CFUNCTYPE(None, LOG_FN, ctypes.c_void_p)),
    ("receiver_progress", ctypes.CFUNCTYPE(_status_t, _receiver_p, ctypes.POINTER(_Progress))),
]


class _Api(ctypes.Structure):
    _fields_ = _API_FIELDS


class RefitError(Exception):
    """A refit call failed: `status` (an int), `status_name` and `message`."""

    def __init__(self, call, status, status_name, message):
        super().__init__(f"{call}: {status_name}: {message}")
        self.call = call
        self.status = status
        self.status_name = status_name
        self.message = message


# Status -> the exception class raised for it; the package's errors module
# fills it with one subclass of RefitError per status.
ERROR_CLASSES: dict[int, type] = {}


def _error(call, status, status_name, message):
    return ERROR_CLASSES.get(status, RefitError)(call, status, status_name, message)


def _text(doc):
    if isinstance(doc, (dict, list)):
        return json.dumps(doc).encode()
    if isinstance(doc, str):
        return doc.encode()
    if isinstance(doc, bytes):
        return doc
    raise TypeError(f"expected a dict or a JSON string, got {type(doc).__name__}")


def _address(buffer, nbytes):
    """(address, size, keep-alive object) of a writable buffer or (ptr, nbytes)."""
    if isinstance(buffer, tuple) and len(buffer) == 2:
        ptr, size = buffer
        return int(ptr), int(size if nbytes is None else nbytes), None
    if isinstance(buffer, int):
        if nbytes is None:
            raise ValueError("a raw address needs nbytes")
        return buffer, int(nbytes), None
    view = memoryview(buffer)
    if view.readonly:
        raise ValueError("the buffer must be writable (bytearray, numpy array, ...)")
    if not view.contiguous:
        raise ValueError("the buffer must be contiguous")
    size = view.nbytes
    if size == 0:
        return 0, 0, view
    anchor = (ctypes.c_char * size).from_buffer(view.cast("B"))
    return ctypes.addressof(anchor), int(size if nbytes is None else nbytes), (view, anchor)


def default_library_path() -> str:
    """$REFIT_LIBRARY, else the librefit.so installed inside the package (a
    wheel built by ``pip install .``), else "librefit.so" through the dynamic
    loader's search path."""
    env = os.environ.get("REFIT_LIBRARY")
    if env:
        return env
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", "librefit.so")
    if os.path.exists(bundled):
        return bundled
    return "librefit.so"


class Library:
    """librefit.so, loaded from `path`, else default_library_path()."""

    def __init__(self, path=None):
        path = path or default_library_path()
        try:
            self._dll = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise _error("load", INTERNAL, "REFIT_INTERNAL",
                         f"cannot load {path}: {e} (set REFIT_LIBRARY or pass the path)") from e
        get_api = self._dll.refit_get_api
        get_api.restype = ctypes.POINTER(_Api)
        get_api.argtypes = [ctypes.c_uint32]
        api = get_api(ABI_VERSION)
        if not api:
            last = self._dll.refit_last_error
            last.restype = ctypes.c_char_p
            raise _error("refit_get_api", UNSUPPORTED, "REFIT_UNSUPPORTED", (last() or b"").decode(errors="replace"))
        # Check the table's own header before reading any entry.
        head = ctypes.cast(api, ctypes.POINTER(ctypes.c_uint32 * 2)).contents
        if head[0] != ABI_VERSION or head[1] < ctypes.sizeof(_Api):
            raise _error("refit_get_api", UNSUPPORTED, "REFIT_UNSUPPORTED",
                         f"{path} serves ABI {head[0]} with a table of {head[1]} bytes; "
                         f"this binding needs ABI {ABI_VERSION} and {ctypes.sizeof(_Api)} bytes")
        self.api = api.contents
        self.path = path

    def version(self):
        return self.api.version().decode()

    def set_log_callback(self, fn):
        """Routes the library's log lines to ``fn(level, line)`` (level: LOG_ERROR
        .. LOG_DEBUG, line: str), called on the library's threads one at a time;
        None restores stderr. ``fn`` must not call the library."""
        if fn is None:
            self.api.set_log_callback(LOG_FN(), None)
            self._log_callback = None  # the library no longer calls it: it may go
            return

        def deliver(level, line, _user):
            fn(int(level), (line or b"").decode(errors="replace"))

        callback = LOG_FN(deliver)
        self.api.set_log_callback(callback, None)
        self._log_callback = callback  # kept alive while the library may call it

    def check(self, call, status):
        if status != OK:
            name = (self.api.status_name(status) or b"unknown").decode()
            message = (self.api.last_error() or b"").decode(errors="replace")
            raise _error(call, status, name, message)
        return status

    def source(self, config):
        return Source(self, config)

    def receiver(self, config):
        return Receiver(self, config)


class _Agent:
    def __init__(self, lib):
        self._lib = lib
        self._handle = None
        self._keep = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


class Source(_Agent):
    """A trainer-side agent (refit_source_*)."""

    def __init__(self, lib, config):
        super().__init__(lib)
        handle = _source_p()
        lib.check("refit_source_create", lib.api.source_create(_text(config), ctypes.byref(handle)))
        self._handle = handle

    def add_tensor(self, description, buffer, nbytes=None):
        address, size, keep = _address(buffer, nbytes)
        self._lib.check("refit_source_add_tensor",
                        self._lib.api.source_add_tensor(self._handle, _text(description), address, size))
        self._keep.append(keep)

    def join(self):
        self._lib.check("refit_source_join", self._lib.api.source_join(self._handle))

    def publish(self, version):
        self._lib.check("refit_source_publish", self._lib.api.source_publish(self._handle, version))

    def wait_drained(self, version, timeout_ms=10000):
        self._lib.check("refit_source_wait_drained",
                        self._lib.api.source_wait_drained(self._handle, version, timeout_ms))

    def close(self):
        if self._handle is not None and self._handle.value:
            self._lib.api.source_destroy(self._handle)
        self._handle = None
        self._keep = []


class Receiver(_Agent):
    """An inference-side agent (refit_receiver_*)."""

    def __init__(self, lib, config):
        super().__init__(lib)
        handle = _receiver_p()
        lib.check("refit_receiver_create", lib.api.receiver_create(_text(config), ctypes.byref(handle)))
        self._handle = handle

    def add_buffer(self, description, buffer, nbytes=None):
        address, size, keep = _address(buffer, nbytes)
        self._lib.check("refit_receiver_add_buffer",
                        self._lib.api.receiver_add_buffer(self._handle, _text(description), address, size))
        self._keep.append(keep)

    def join(self):
        self._lib.check("refit_receiver_join", self._lib.api.receiver_join(self._handle))

    def refresh(self, version=LATEST, timeout_ms=30000):
        self._lib.check("refit_receiver_refresh",
                        self._lib.api.receiver_refresh(self._handle, version, timeout_ms))
        return self.version()

    def refresh_start(self, version=LATEST, timeout_ms=30000):
        self._lib.check("refit_receiver_refresh_start",
                        self._lib.api.receiver_refresh_start(self._handle, version, timeout_ms))

    def refresh_poll(self):
        """True when the started refresh is done; raises if it failed."""
        status = self._lib.api.receiver_refresh_poll(self._handle)
        if status == IN_PROGRESS:
            return False
        self._lib.check("refit_receiver_refresh_poll", status)
        return True

    def refresh_wait(self, timeout_ms):
        """True when the started refresh is done within timeout_ms; raises if it failed."""
        status = self._lib.api.receiver_refresh_wait(self._handle, timeout_ms)
        if status == IN_PROGRESS:
            return False
        self._lib.check("refit_receiver_refresh_wait", status)
        return True

    def commit(self):
        """Staged mode: makes the staged version live (pause reading around it)."""
        self._lib.check("refit_receiver_commit", self._lib.api.receiver_commit(self._handle))
        return self.version()

    def report(self):
        return json.loads(self._lib.api.receiver_report(self._handle).decode())

    def version(self):
        return self._lib.api.receiver_version(self._handle)

    def progress(self):
        p = _Progress()
        p.size = ctypes.sizeof(_Progress)
        self._lib.check("refit_receiver_progress", self._lib.api.receiver_progress(self._handle, ctypes.byref(p)))
        return {"attempt": p.attempt, "version": p.version, "state": (p.state or b"").decode(),
                "network_bytes_planned": p.network_bytes_planned, "network_bytes_landed": p.network_bytes_landed}

    def close(self):
        if self._handle is not None and self._handle.value:
            self._lib.api.receiver_destroy(self._handle)
        self._handle = None
        self._keep = []
