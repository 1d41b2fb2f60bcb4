"""refit: fresh RL-trainer weights into running inference servers.

    import refit

    with refit.Source({"rank": rank, "coordinator": {...}}) as src:
        src.add_module(model)            # DTensors (FSDP2, TP) as they are
        src.publish(step)
        src.wait_drained(step)

    rx = refit.Receiver({"rank": r, "mode": "staged", "coordinator": {...}})
    rx.add("w", tensor, {"dtensor": {...}, "shape": [...]})
    rx.refresh()                          # or: await rx.refresh_async()
    rx.commit()
    rx.report()                           # a dict

    refit.set_log_handler(logging.getLogger("refit"))  # refit's log into Python's

Errors are one class per status (refit.InvalidArgumentError,
refit.NotFoundError, refit.PeerError with its refit.PeerLostError,
refit.AbortedError and refit.VerifyFailedError, refit.TimeoutError,
refit.UnsupportedError, refit.InternalError), all refit.Error, each carrying
the library's message. ``refit.vllm`` is the vLLM weight-transfer engine
(imported on use; vLLM is not needed to import refit).
"""

from __future__ import annotations

from .agents import LATEST, Receiver, Source, library, set_log_handler
from .errors import (AbortedError, Error, InternalError, InvalidArgumentError, NotFoundError, PeerError,
                     PeerLostError, TimeoutError, UnsupportedError, VerifyFailedError)

__version__ = "0.1.0"

__all__ = [
    "LATEST", "Source", "Receiver", "library", "set_log_handler",
    "Error", "InvalidArgumentError", "NotFoundError", "PeerError", "PeerLostError", "AbortedError",
    "VerifyFailedError", "TimeoutError", "UnsupportedError",
    "InternalError", "__version__",
]
