"""Builds graphstep's optional C++ guard helper (src/graphstep/guards/_fastcheck.cpp) at install time.

It is built only when torch is importable while building, which pip allows with
`pip install --no-build-isolation` (the Makefile does so), and a C++ compiler works. Without either,
graphstep installs without it and its guards read tensors from Python (same checks, slower with many
parameters; see src/graphstep/guards/fastcheck.py). GRAPHSTEP_NO_EXTENSION=1 skips the build.
"""

import os
import sys

from setuptools import setup


def extension_build() -> dict:
    if os.environ.get("GRAPHSTEP_NO_EXTENSION") == "1":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("graphstep: torch is not importable while building: no C++ guard helper", file=sys.stderr)
        return {}

    class OptionalBuild(BuildExtension.with_options(use_ninja=False)):
        def build_extension(self, ext):  # a failed build leaves the pure-Python path
            try:
                super().build_extension(ext)
            except Exception as exc:
                print(f"graphstep: building the C++ guard helper failed ({exc}); skipped", file=sys.stderr)

    version = torch.__version__
    extension = CppExtension(
        "graphstep.guards._fastcheck_ext",
        ["src/graphstep/guards/_fastcheck.cpp"],
        extra_compile_args=["-O2", f'-DGRAPHSTEP_TORCH_VERSION="{version}"'],
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuild}}


setup(**extension_build())
