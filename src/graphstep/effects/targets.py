"""Where a store in Python bytecode writes: the object an instruction is about to change.

An opcode tracer sees `STORE_ATTR seen` about to run but not the value stack, so it cannot see
*whose* `seen` is written. `stores(code)` answers from the bytecode alone: a small abstract
interpretation of the value stack gives, for each store instruction, the expression that pushed its
target (`self`, `self.history`, `CFG`, `cfg["loss"]`), which `evaluate` then reads in the running
frame. Expressions are tuples: `("fast", name)`, `("deref", name)`, `("global", name)`,
`("const", value)`, `("attr", base, name)`, `("item", base, key)`, `("method", base, name)` (a method
loaded for a call); None is a value the analysis does
not follow (a call's result, anything after an instruction it does not model). Only names, constants,
attribute loads and subscripts are followed: evaluating those again runs no user code (properties
and tensors are not followed, see `evaluate`).
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

Expr = tuple | None
UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "(unknown)"})()
"""What `evaluate` returns for an expression it will not or cannot read."""


@dataclasses.dataclass(frozen=True)
class Store:
    """A write an instruction makes. `kind`: "attr" (set or delete an attribute of `target`),
    "item" (set or delete an item of the container `target`, or an in-place operator on it),
    "call" (a call of `target`'s method `name`, which changes it if it is a container), "global",
    "cell" (a closure variable of an enclosing function), "name" (a name written by module-level
    code); and "print", a call of `print` (not a write, but run only while the step's Python runs)."""

    kind: str
    target: Expr = None
    name: str | None = None
    key: Expr = None


_NO_FALLTHROUGH = frozenset(
    {
        "RETURN_VALUE",
        "RETURN_CONST",
        "RAISE_VARARGS",
        "RERAISE",
        "JUMP_FORWARD",
        "JUMP_BACKWARD",
        "JUMP_ABSOLUTE",
        "JUMP_BACKWARD_NO_INTERRUPT",
        "JUMP",
        "JUMP_NO_INTERRUPT",
    }
)
_LOAD_LOCAL = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_BORROW"})
_PUSH_ONE = (
    "CALL",
    "PRECALL",
    "BUILD_",
    "COMPARE_OP",
    "IS_OP",
    "CONTAINS_OP",
    "UNARY_",
    "FORMAT_",
    "BINARY_SLICE",
    "GET_ITER",
    "MAKE_FUNCTION",
    "TO_BOOL",
    "LIST_TO_TUPLE",
)
"""Instructions that pop their operands and push one result."""
_POP_ONLY = frozenset(
    {
        "POP_TOP",
        "STORE_FAST",
        "STORE_FAST_STORE_FAST",
        "STORE_NAME",
        "STORE_GLOBAL",
        "STORE_DEREF",
        "LIST_APPEND",
        "SET_ADD",
        "MAP_ADD",
        "LIST_EXTEND",
        "SET_UPDATE",
        "DICT_UPDATE",
        "DICT_MERGE",
    }
)
_PRINT = ("global", "print")
CONTAINER_METHODS = frozenset(
    {
        *("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"),
        *("popitem", "setdefault", "update", "move_to_end"),
        *("add", "discard", "difference_update", "intersection_update", "symmetric_difference_update"),
        *("appendleft", "extendleft", "popleft", "rotate"),
    }
)
"""Methods that change a list, dict, set, deque or bytearray in place: a call of one is a write."""
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _effect(ins: dis.Instruction, jump: bool) -> int:
    if ins.opcode < dis.HAVE_ARGUMENT:
        return dis.stack_effect(ins.opcode)
    return dis.stack_effect(ins.opcode, ins.arg, jump=jump)


def _generic(stack: list, effect: int, pushes_one: bool = False) -> list:
    """An instruction the analysis does not model: its results are unknown, and so are the few
    entries below what it consumes (it may pop more than its net effect says)."""
    depth = len(stack)
    new_depth = max(0, depth + effect)
    keep = new_depth - 1 if pushes_one else max(0, depth - (max(0, -effect) + 3))
    keep = max(0, min(keep, new_depth))
    return stack[:keep] + [None] * (new_depth - keep)


def _transfer(ins: dis.Instruction, code: types.CodeType, stack: list, found: dict[int, Store]) -> list:
    """The stack after `ins` falls through; records the store `ins` makes in `found`."""
    op, name, S = ins.opname, ins.argval, list(stack)
    if op in _LOAD_LOCAL:
        return [*S, ("fast", name)]
    if op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
        return [*S, ("deref", name)]
    if op == "LOAD_CONST":
        return [*S, ("const", name)]
    if op in ("LOAD_GLOBAL", "LOAD_NAME"):
        return [*S, *[None] * (_effect(ins, False) - 1), ("global", name)]
    if op == "LOAD_FAST_LOAD_FAST":
        return [*S, ("fast", name[0]), ("fast", name[1])]
    if op == "LOAD_ATTR" and S:
        base = S.pop()
        return [*S, ("method", base, name), base] if _effect(ins, False) == 1 else [*S, ("attr", base, name)]
    if op == "LOAD_METHOD" and S:
        return [*S[:-1], ("method", S[-1], name), S[-1]]
    if op == "PRECALL":  # 3.11: the CALL after it consumes the operands
        return S
    if op in ("CALL", "CALL_KW"):
        used = ins.arg + (3 if op == "CALL_KW" else 2)
        if len(S) >= used:
            callee, second = S[-used], S[-used + 1]
            if callee is not None and callee[0] == "method" and callee[2] in CONTAINER_METHODS:
                found[ins.offset] = Store("call", callee[1], callee[2])
            elif _PRINT in (callee, second):
                found[ins.offset] = Store("print")
        return [*S[: max(0, len(S) - used)], None]
    if op == "BINARY_SUBSCR" and len(S) >= 2:
        return [*S[:-2], ("item", S[-2], S[-1])]
    if op == "BINARY_OP" and len(S) >= 2:
        if ins.argrepr.endswith("="):  # `+=` and its kind: an in-place change of a mutable left side
            found[ins.offset] = Store("item", S[-2])
        return [*S[:-2], None]
    if op == "COPY" and len(S) >= ins.arg:
        return [*S, S[-ins.arg]]
    if op == "SWAP" and len(S) >= ins.arg:
        S[-1], S[-ins.arg] = S[-ins.arg], S[-1]
        return S
    if op in ("STORE_ATTR", "DELETE_ATTR") and S:
        found[ins.offset] = Store("attr", S[-1], name)
        return S[: -2 if op == "STORE_ATTR" else -1]
    if op in ("STORE_SUBSCR", "DELETE_SUBSCR") and len(S) >= 2:
        found[ins.offset] = Store("item", S[-2], key=S[-1])
        return S[: -3 if op == "STORE_SUBSCR" else -2]
    if op == "STORE_SLICE" and len(S) >= 3:
        found[ins.offset] = Store("item", S[-3])
        return S[:-4]
    if op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
        found[ins.offset] = Store("global", name=name)
    elif op in ("STORE_DEREF", "DELETE_DEREF") and name in code.co_freevars:
        found[ins.offset] = Store("cell", name=name)
    elif op in ("STORE_NAME", "DELETE_NAME"):
        found[ins.offset] = Store("name", name=name)
    if op == "STORE_FAST_LOAD_FAST":
        return [*S[:-1], ("fast", name[1])]
    if op.startswith(_PUSH_ONE):
        return _generic(S, _effect(ins, False), pushes_one=True)
    if op in _POP_ONLY:
        return S[: max(0, len(S) + _effect(ins, False))]
    if op in ("NOP", "RESUME", "EXTENDED_ARG", "KW_NAMES", "CACHE"):
        return S
    return _generic(S, _effect(ins, False))


def _jump_stack(ins: dis.Instruction, stack: list) -> list:
    effect = _effect(ins, True)
    if "JUMP" in ins.opname and effect <= 0:  # conditional jumps pop their test only
        return stack[: len(stack) + effect] if effect else list(stack)
    return _generic(list(stack), effect)


def _merge(a: list, b: list) -> list:
    if len(a) != len(b):
        return [None] * min(len(a), len(b))
    return [x if x == y else None for x, y in zip(a, b)]


_STORE_OPCODES = frozenset(
    dis.opmap[name]
    for name in (
        *("STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE"),
        *("STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF", "STORE_NAME", "DELETE_NAME"),
    )
    if name in dis.opmap
)
"""The instructions `_transfer` records as a write by their opcode alone."""
_BINARY_OP = dis.opmap.get("BINARY_OP")
_IN_PLACE = frozenset(i for i, (_, symbol) in enumerate(getattr(dis, "_nb_ops", ())) if symbol.endswith("="))
"""BINARY_OP's arguments for `+=` and its kind (empty where this Python does not list them: then every
BINARY_OP may be one)."""
_CALLED = CONTAINER_METHODS | {"print"}


def _may_store(code: types.CodeType) -> bool:
    """False only when `stores(code)` is empty: no instruction that `_transfer` records is in the
    bytecode (a call it records names a container method or `print` in `co_names`). A pass over the raw
    bytes, where the analysis disassembles: most frames a capture judges write nothing (104 of a tiny
    GPT's 120), and a fresh process reads each once."""
    if not _CALLED.isdisjoint(code.co_names):
        return True
    raw = code.co_code  # (2-byte units, opcode first; the unspecialised, uninstrumented bytecode)
    opcodes = raw[0::2]
    if not _STORE_OPCODES.isdisjoint(opcodes):
        return True
    if _BINARY_OP is None or _BINARY_OP not in opcodes:
        return False
    return not _IN_PLACE or any(op == _BINARY_OP and arg in _IN_PLACE for op, arg in zip(opcodes, raw[1::2]))


@functools.lru_cache(maxsize=4096)
def stores(code: types.CodeType) -> dict[int, Store]:
    """Offset -> the write the instruction at that offset makes, for every write in `code`."""
    if not _may_store(code):
        return {}
    instructions = list(dis.get_instructions(code))
    index = {ins.offset: i for i, ins in enumerate(instructions)}
    entry: dict[int, list] = {}
    found: dict[int, Store] = {}
    work: list[tuple[int, list]] = [(0, [])]
    for handler in getattr(dis.Bytecode(code), "exception_entries", ()):
        work.append((handler.target, [None] * (handler.depth + int(handler.lasti) + 1)))
    while work:
        offset, stack = work.pop()
        i = index.get(offset)
        while i is not None and i < len(instructions):
            ins = instructions[i]
            known = entry.get(ins.offset)
            if known is not None:
                merged = _merge(known, stack)
                if merged == known:
                    break
                stack = merged
            entry[ins.offset] = stack
            if ins.opcode in _JUMPS and isinstance(ins.argval, int):
                work.append((ins.argval, _jump_stack(ins, stack)))
            if ins.opname in _NO_FALLTHROUGH:
                break
            stack = _transfer(ins, code, stack, found)
            i += 1
    return found


def has_stores(code: types.CodeType) -> bool:
    return bool(stores(code))


# -- reading an expression in a running frame ----------------------------------------------------


def evaluate(expr: Expr, frame: types.FrameType, local: dict) -> Any:
    """The value of `expr` in `frame` (`local`: its `f_locals`), or UNKNOWN. Reads names, constants,
    instance attributes and items of builtin containers only: no property, no `__getitem__` of a
    user type, nothing on a tensor (which would be an operation the capture records)."""
    if expr is None:
        return UNKNOWN
    kind = expr[0]
    if kind in ("fast", "deref"):
        return local.get(expr[1], UNKNOWN)
    if kind == "global":
        value = frame.f_globals.get(expr[1], UNKNOWN)
        return getattr(builtins, expr[1], UNKNOWN) if value is UNKNOWN else value
    if kind == "const":
        return expr[1]
    base = evaluate(expr[1], frame, local)
    if base is UNKNOWN or isinstance(base, torch.Tensor):
        return UNKNOWN
    if kind == "attr":
        return plain_attribute(base, expr[2])
    key = evaluate(expr[2], frame, local)
    if key is UNKNOWN:
        return UNKNOWN
    try:
        if isinstance(base, dict):
            return dict.get(base, key, UNKNOWN)  # never a defaultdict's __missing__
        if isinstance(base, (list, tuple)):
            return base[key] if isinstance(key, int) and -len(base) <= key < len(base) else UNKNOWN
    except TypeError:  # an unhashable key
        return UNKNOWN
    return UNKNOWN


def plain_attribute(obj: Any, name: str) -> Any:
    """`obj.name` where reading it runs no Python (an instance or class attribute, a slot, a
    submodule, parameter or buffer); UNKNOWN for properties and other computed attributes."""
    try:
        found = inspect.getattr_static(obj, name)
    except AttributeError:
        if isinstance(obj, nn.Module):
            for table in ("_parameters", "_buffers", "_modules"):
                entries = obj.__dict__.get(table, {})
                if name in entries:
                    return entries[name]
        return UNKNOWN
    if isinstance(found, types.MemberDescriptorType):
        return getattr(obj, name, UNKNOWN)
    if isinstance(found, (property, functools.cached_property, staticmethod, classmethod)):
        return UNKNOWN
    if hasattr(type(found), "__get__") and not isinstance(found, types.FunctionType):
        return UNKNOWN  # some other descriptor: reading it may run code
    return found


def render(expr: Expr) -> str:
    """`expr` as source: `self.history`, `cfg['loss']`."""
    if expr is None:
        return "..."
    kind = expr[0]
    if kind in ("fast", "deref", "global"):
        return expr[1]
    if kind == "const":
        return repr(expr[1])
    if kind == "attr":
        return f"{render(expr[1])}.{expr[2]}"
    return f"{render(expr[1])}[{render(expr[2])}]"
