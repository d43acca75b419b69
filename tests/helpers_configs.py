"""A stand-in for a user's config module: numbers a loss reads inside config objects of libraries
(OmegaConf, ml_collections, pydantic, attrs) and of the standard library (argparse, MappingProxyType,
named tuples), which tests/test_guards_configs.py changes in place between calls. A library that is
not installed leaves its objects None (its tests skip)."""

from __future__ import annotations

import argparse
import collections
import os
import types

try:
    from omegaconf import OmegaConf
except ImportError:  # the `configs` extra is not installed
    OmegaConf = None
try:
    import ml_collections
except ImportError:
    ml_collections = None
try:
    import pydantic
except ImportError:
    pydantic = None
try:
    import attrs
except ImportError:
    attrs = None

Weights = collections.namedtuple("Weights", "main aux")


class Opaque:
    """A library-like object graphstep cannot see into: its number lives behind `__getattr__`, in a
    store the read watch never sees the step's code load (as in a C extension's object)."""

    __slots__ = ("_store",)

    def __init__(self) -> None:
        object.__setattr__(self, "_store", {"scale": 1.0})

    def __getattr__(self, name: str) -> float:
        try:
            return object.__getattribute__(self, "_store")[name]
        except KeyError:
            raise AttributeError(name) from None


Opaque.__module__ = "somelibrary.settings"  # a library's class, not the user's


if pydantic is not None:

    class LossModel(pydantic.BaseModel):
        weight: float = 1.0
        terms: list[str] = pydantic.Field(default_factory=lambda: ["mse"])


if attrs is not None:

    @attrs.define  # slotted
    class LossAttrs:
        weight: float = 1.0

    @attrs.define(slots=False)
    class LossAttrsDict:
        weight: float = 1.0


CFG = OC_LIST = LOSS = CD = CD_FROZEN = PYD = ATT = ATT_DICT = None
NS = PROXY = PROXY_BACKING = WEIGHTS = OPAQUE = None


def reset() -> None:
    """Every object made afresh (each test starts from the same values)."""
    global CFG, OC_LIST, LOSS, CD, CD_FROZEN, PYD, ATT, ATT_DICT, NS, PROXY, PROXY_BACKING, WEIGHTS, OPAQUE
    os.environ.pop("GRAPHSTEP_TEST_SCALE", None)
    if OmegaConf is not None:
        CFG = OmegaConf.create(
            {
                "train": {"scale": 1.0},
                # `weight` follows `train.scale`; `tag` is a string built from it on every read; `env`
                # comes from a resolver (the environment), which no write to the config changes
                "loss": {
                    "smoothing": 0.1,
                    "weight": "${train.scale}",
                    "tag": "w=${train.scale}",
                    "env": "${oc.env:GRAPHSTEP_TEST_SCALE,1.0}",
                },
                "stages": [1.0, {"w": 0.5}],
            }
        )
        OC_LIST = OmegaConf.create([1.0, 0.5])
        LOSS = CFG.loss  # a nested config held on its own: its interpolation reads outside it
    if ml_collections is not None:
        CD = ml_collections.ConfigDict({"loss": {"smoothing": 0.1}, "base": 1.0})
        CD.scale = CD.get_ref("base") * 2  # a FieldReference: computed when read
        CD_FROZEN = ml_collections.FrozenConfigDict({"loss": {"smoothing": 0.1}})
    if pydantic is not None:
        PYD = LossModel()
    if attrs is not None:
        ATT, ATT_DICT = LossAttrs(), LossAttrsDict()
    NS = argparse.Namespace(smoothing=0.1, loss=argparse.Namespace(weight=1.0))
    PROXY_BACKING = {"weight": 1.0}
    PROXY = types.MappingProxyType(PROXY_BACKING)
    WEIGHTS = Weights(1.0, [0.5])
    OPAQUE = Opaque()


reset()


# One factor per kind of read; the step multiplies its loss by it.
def dictconfig_factor() -> float:
    return (1.0 - CFG.loss.smoothing) * CFG["stages"][1].w


def interpolation_factor() -> float:
    return LOSS.weight  # `${train.scale}`, resolved by OmegaConf from outside LOSS


def string_interpolation_factor() -> float:
    return 2.0 if LOSS.tag == "w=2.0" else 1.0


def resolver_factor() -> float:
    return float(LOSS.env)


def listconfig_factor() -> float:
    return OC_LIST[0] + OC_LIST[1]


def configdict_factor() -> float:
    return 1.0 - CD.loss.smoothing


def field_reference_factor() -> float:
    return CD.scale


def frozen_configdict_factor() -> float:
    return 1.0 - CD_FROZEN.loss.smoothing


def pydantic_factor() -> float:
    return PYD.weight * len(PYD.terms)


def attrs_factor() -> float:
    return ATT.weight + ATT_DICT.weight


def namespace_factor() -> float:
    return (1.0 - NS.smoothing) * NS.loss.weight


def proxy_factor() -> float:
    return PROXY["weight"]


def namedtuple_factor() -> float:
    return WEIGHTS.main + WEIGHTS.aux[0]


def opaque_factor() -> float:
    return OPAQUE.scale
