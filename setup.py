"""The C++ CPU kernels, compiled at `pip install` where torch is importable (pyproject.toml says why).

Everything else about the package is in pyproject.toml. The build itself is
src/torchgemma/kernels/build.py (loaded here by its path: the package is not installed yet), the same
function that builds the kernels at first use where no built library came with the install.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BUILD = Path(__file__).parent / "src" / "torchgemma" / "kernels" / "build.py"


def _kernel_build():
    spec = importlib.util.spec_from_file_location("torchgemma_kernel_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """Builds the one kernel library (every source once per instruction set) with build.py's direct
    compiler calls, two at a time; an editable install writes it into the source folder."""

    def get_ext_filename(self, fullname: str) -> str:
        # torchgemma/kernels/_C.so: loaded with ctypes after torch, not imported as a Python module,
        # so its name carries no Python version.
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        build = _kernel_build()
        target = Path(self.get_ext_fullpath(ext.name))
        print("torchgemma: compiling the C++ CPU kernels (portable, AVX2, AVX-512)...", file=sys.stderr)
        try:
            seconds = build.build(target, jobs=2)
        except RuntimeError as err:  # no compiler, or it failed: install anyway, the references run
            print(
                f"torchgemma: the C++ kernels were not built ({err}); the package will try again at first "
                "use, and otherwise run the pure-PyTorch references",
                file=sys.stderr,
            )
            return
        print(f"torchgemma: built {target} in {seconds:.0f} s", file=sys.stderr)


def _extensions() -> list[Extension]:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(
            "torchgemma: torch is not importable in this build environment (an isolated build?): the C++ "
            "kernels will be built at first use instead (install torch first, then "
            "`pip install --no-build-isolation .`, to build them now)",
            file=sys.stderr,
        )
        return []
    return [Extension("torchgemma.kernels._C", sources=[])]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildKernels})
