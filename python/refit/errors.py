"""One exception class per refit status (include/refit/refit.h).

Every class derives from :class:`refit.Error` (itself the raw binding's
``RefitError``), carries ``call``, ``status``, ``status_name`` and
``message`` (the library's text, which names the key, tensor, rank or peer),
and also derives from the closest built-in exception, so ``except
ValueError`` or ``except TimeoutError`` catch what they should.

Mistakes caught in Python before the library is called (a non-contiguous
tensor, a dtype refit does not carry, a Partial placement) raise
:class:`InvalidArgumentError` or :class:`UnsupportedError` with
``call="refit"``: nothing was registered or written.
"""

from __future__ import annotations

import builtins

from . import _abi

Error = _abi.RefitError


class InvalidArgumentError(Error, ValueError):
    """REFIT_INVALID_ARGUMENT: bad config, description, buffer or call order."""


class NotFoundError(Error, LookupError):
    """REFIT_NOT_FOUND: a named thing (file, tensor, version) does not exist."""


class PeerError(Error, builtins.IOError):
    """REFIT_IO_ERROR: the network or a file failed; the base of the three below."""


class PeerLostError(PeerError):
    """REFIT_PEER_LOST: a source or a receiver of the domain died, left or failed its part."""


class AbortedError(PeerError):
    """REFIT_ABORTED: staged mode; the instance aborted the version (a rank of it failed)."""


class VerifyFailedError(PeerError):
    """REFIT_VERIFY_FAILED: the bytes that arrived are not the ones published."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - refit.TimeoutError by design
    """REFIT_TIMEOUT: a deadline passed."""


class UnsupportedError(Error, NotImplementedError):
    """REFIT_UNSUPPORTED: valid, but not possible with this build."""


class InternalError(Error, RuntimeError):
    """REFIT_INTERNAL: a bug in refit (or the library could not be loaded)."""


_abi.ERROR_CLASSES.update({
    _abi.INVALID_ARGUMENT: InvalidArgumentError,
    _abi.NOT_FOUND: NotFoundError,
    _abi.IO_ERROR: PeerError,
    _abi.PEER_LOST: PeerLostError,
    _abi.ABORTED: AbortedError,
    _abi.VERIFY_FAILED: VerifyFailedError,
    _abi.TIMEOUT: TimeoutError,
    _abi.UNSUPPORTED: UnsupportedError,
    _abi.INTERNAL: InternalError,
})


def invalid(message: str) -> InvalidArgumentError:
    """An InvalidArgumentError raised by the Python layer itself."""
    return InvalidArgumentError("refit", _abi.INVALID_ARGUMENT, "REFIT_INVALID_ARGUMENT", message)


def unsupported(message: str) -> UnsupportedError:
    return UnsupportedError("refit", _abi.UNSUPPORTED, "REFIT_UNSUPPORTED", message)
