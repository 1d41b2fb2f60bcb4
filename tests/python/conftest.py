"""Shared fixtures: the refit package (installed, or the repository's
python/), the built librefit.so and a real refit-coordinator on 127.0.0.1.

The build tree is $REFIT_BUILD_DIR, else build/ at the repository root (what
`make` builds). Tests that need a piece that is missing skip and say which.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("REFIT_BUILD_DIR") or ROOT / "build")
LIBRARY = BUILD / "plugin" / "librefit.so"
COORDINATOR = BUILD / "tools" / "refit-coordinator"

# The built library, unless one is named already; a wheel's own copy is used
# only when $REFIT_LIBRARY is unset and no build tree exists.
if "REFIT_LIBRARY" not in os.environ and LIBRARY.exists():
    os.environ["REFIT_LIBRARY"] = str(LIBRARY)
try:
    import refit  # noqa: F401  (installed with pip install .)
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))
    os.environ["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes of CPU on a 2-core machine (deselect with -m 'not slow')")


class Coordinator:
    def __init__(self, tmp: Path, heartbeat_timeout_ms: int = 3000) -> None:
        if not COORDINATOR.exists():
            pytest.skip(f"no refit-coordinator at {COORDINATOR} (build the project first)")
        self.token_file = tmp / "token"
        self.token_file.write_bytes(os.urandom(32))
        self.token_file.chmod(0o600)  # the coordinator refuses a token file others may read
        self.log = tmp / "coordinator.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen([str(COORDINATOR), "--listen", "127.0.0.1:0", "--token-file",
                                      str(self.token_file), "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        self.address = None
        while time.monotonic() < deadline and self.address is None:
            m = re.search(r"listening on (\S+:\d+)", self.log.read_text())
            if m:
                self.address = m.group(1)
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.05)
        if self.address is None:
            self.stop()
            raise RuntimeError(f"refit-coordinator did not start: {self.log.read_text()}")

    def config(self) -> dict:
        return {"address": self.address, "token_file": str(self.token_file), "timeout_ms": 20000}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def coordinator(tmp_path):
    if not LIBRARY.exists() and "REFIT_LIBRARY" not in os.environ:
        pytest.skip(f"no librefit.so at {LIBRARY} (build the project first)")
    c = Coordinator(tmp_path)
    yield c
    c.stop()


def network() -> dict:
    return {"transports": ["tcp"], "devices": ["lo"]}
