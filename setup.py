"""Builds librefit.so with meson and places it in the package (refit/_lib/),
so that the wheel carries the library its ctypes layer loads.

The build tree is $REFIT_BUILD_DIR, else build/ at the repository root (the
one `make` uses): an existing tree is reused and only the library is rebuilt;
a missing one is configured with `meson setup` (tests off). $REFIT_LIBRARY
names a prebuilt librefit.so to package instead.
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_library() -> str:
    prebuilt = os.environ.get("REFIT_LIBRARY")
    if prebuilt:
        return prebuilt
    build = os.environ.get("REFIT_BUILD_DIR") or os.path.join(ROOT, "build")
    if not os.path.exists(os.path.join(build, "build.ninja")):
        subprocess.run(["meson", "setup", build, "-Dtests=false"], cwd=ROOT, check=True)
    subprocess.run(["ninja", "-C", build, "plugin/librefit.so"], cwd=ROOT, check=True)
    return os.path.join(build, "plugin", "librefit.so")


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "refit", "_lib")
        os.makedirs(target, exist_ok=True)
        shutil.copy2(build_library(), os.path.join(target, "librefit.so"))


class BinaryDistribution(Distribution):
    """The wheel holds a native library: platform-specific, not pure."""

    def has_ext_modules(self):
        return True


os.makedirs(os.path.join(ROOT, "build-python"), exist_ok=True)
setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution,
      options={"build": {"build_base": "build-python"}, "egg_info": {"egg_base": "build-python"}})
