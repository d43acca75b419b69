"""A code object's qualified name, the key of the trusted list (`trusted.py`): `co_qualname` from
Python 3.11 on; on Python 3.10, found among the functions and classes of its module."""

from __future__ import annotations

import functools
import sys
import types


def qualname(code: types.CodeType, module: str) -> str:
    """The qualified name of `code`: `co_qualname` from Python 3.11 on; before, looked up among the
    functions and classes of `module` (the code of a function nested in one gets its name under it;
    code found nowhere there, its bare name)."""
    name = getattr(code, "co_qualname", None)
    if name is not None:
        return name
    return qualnames_in(module).get(code, code.co_name)


@functools.cache
def qualnames_in(module: str) -> dict[types.CodeType, str]:
    """Code object -> qualified name, for the functions and methods of `module` (and the code nested
    in them). Asked only for modules with trusted entries, on Python 3.10."""
    found: dict[types.CodeType, str] = {}
    namespace = sys.modules.get(module)
    if namespace is not None:
        for value in list(vars(namespace).values()):
            _add(value, module, found, set())
    return found


def _add(value: object, module: str, found: dict, seen: set) -> None:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for part in (value.fget, value.fset, value.fdel):
            _add(part, module, found, seen)
        return
    if isinstance(value, type):
        if value.__module__ == module:
            for member in list(vars(value).values()):
                _add(member, module, found, seen)
        return
    for _ in range(8):  # functools.wraps chains: the wrapped function is the one defined here
        if isinstance(value, types.FunctionType) and value.__module__ == module:
            _add_code(value.__code__, value.__qualname__, found)
        inner = getattr(value, "__wrapped__", None) if isinstance(value, types.FunctionType) else None
        if inner is None:
            return
        value = inner


def _add_code(code: types.CodeType, name: str, found: dict) -> None:
    if code in found:
        return
    found[code] = name
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _add_code(const, f"{name}.<locals>.{const.co_name}", found)
