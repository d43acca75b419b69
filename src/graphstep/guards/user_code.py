"""Which code and classes are the user's: not torch's, an installed package's, the standard
library's or graphstep's own (graphstep's demo counts as user code, like a training script)."""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # graphstep/, above guards/
_DEMO_DIR = os.path.join(_PACKAGE_DIR, "demo")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {os.path.dirname(os.path.abspath(torch.__file__)), _PACKAGE_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    try:
        dirs.update(os.path.abspath(p) for p in site.getsitepackages())
        dirs.add(os.path.abspath(site.getusersitepackages()))
    except AttributeError:  # a virtualenv's old site module
        pass
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs))


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """User code: not torch, an installed package, the standard library or graphstep (its demo
    is user code, like a training script)."""
    if filename.startswith(("<frozen", "<string>", "<attrs generated")):
        # Code generated with exec (a dataclass's __init__, attrs' methods) reads only its own
        # sentinels; the user's reads are in the code that calls it. Interactive code (<stdin>) is the user's.
        return False
    path = os.path.abspath(filename)
    if path.startswith(_DEMO_DIR + os.sep):
        return True
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return False
    return not path.startswith(_library_dirs())


@functools.lru_cache(maxsize=1024)
def is_user_class(cls: type) -> bool:
    """A class defined in user code (or in `__main__`, a script or a notebook)."""
    if cls.__module__ == "__main__":
        return True
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return isinstance(file, str) and is_user_file(file)
