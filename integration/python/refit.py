"""The raw ctypes binding over librefit.so, for the examples that work with
plain buffers (bytearray, addresses): ``Library``, ``Source``, ``Receiver``,
``RefitError`` and the status constants.

The code lives in the ``refit`` package (python/refit/_abi.py), which builds
its typed, torch-aware API on it; this file loads that module by path so the
examples run with nothing installed.
"""

import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "refit", "_abi.py")
_spec = importlib.util.spec_from_file_location("_refit_abi", _PATH)
_abi = importlib.util.module_from_spec(_spec)
sys.modules["_refit_abi"] = _abi
_spec.loader.exec_module(_abi)

globals().update({k: v for k, v in vars(_abi).items() if not k.startswith("__")})
