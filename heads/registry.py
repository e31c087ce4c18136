"""The registry of confidence methods: one small unit per method, everything else iterates.

A `Method` declares its canonical name (the key of the evaluation table, the heads card
and `/answer`'s confidence fields), the extra passes it reads (`heads.passes`), how it is
fitted on the image-disjoint splits, how it scores a batch of features, and its cost.
`fit-heads`, `evaluate`, the heads artefact and `Heads.confidence` all loop over the
registry, and the Collector runs the union of the passes the chosen methods need.

To add a method: write a subclass in a new module under `heads/methods/` and add one
`register(...)` line to `heads/methods/__init__.py`. A method `served` on `/answer` also
needs its field in `clients.schemas.SERVED_CONFIDENCES` (the response schema and the serving
dataclass are built from that list); registration refuses it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from clients.schemas import SERVED_CONFIDENCES

Features = dict[str, torch.Tensor]


class HeadsState(Protocol):
    """What a method reads and fits on the heads artefact (`heads.dualread.Heads` is one).
    Declared here so that methods never import the artefact that imports them."""

    readers: dict[str, torch.nn.Module]
    offsets: dict[str, float]
    temperatures: dict[str, float]
    platt_maps: dict[str, tuple[float, float]]

    def temperature(self, method: str) -> float: ...

    def platt_map(self, method: str, default: tuple[float, float] | None = None
                  ) -> tuple[float, float]: ...



class Scored(dict):
    """The features of one scoring call, keeping what the served methods share: DualRead
    fuses PSR's and PER's probabilities, so computing them once per call halves the
    readers' cost on the /answer path. Fitting passes plain dicts, which keep nothing
    (readers change between the calls there)."""

    def __init__(self, feats: Features) -> None:
        super().__init__(feats)
        self.memo: dict[str, torch.Tensor] = {}


def once(f: Features, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`compute()`, kept in `f` for the rest of its scoring call when `f` is `Scored`."""
    memo = getattr(f, "memo", None)
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


@dataclass(frozen=True)
class ReaderSpec:
    """A small reader a method trains: input width in units of the hidden size D, MLP sizes."""

    width: int = 1
    hidden: tuple[int, ...] = ()


@dataclass
class FitData:
    """What fitting sees: features of every item, labels, and the image-disjoint splits.

    `scoped[split]` holds features collected separately on that split only, for methods
    whose passes are too costly to run on every item (K samples on the temperature split).
    """

    feats: Features
    z: torch.Tensor
    splits: dict[str, torch.Tensor]     # reader, reader_train, reader_val, temperature, defer
    scoped: dict[str, Features] = field(default_factory=dict)
    seed: int = 0

    def x(self, key: str, split: str) -> torch.Tensor:
        return self.feats[key][self.splits[split]]

    def y(self, split: str) -> torch.Tensor:
        return self.z[self.splits[split]]

    def on(self, split: str) -> Features:
        return {k: v[self.splits[split]] for k, v in self.feats.items()}


class Method:
    """Base class. Subclasses set these attributes (on the class, or per instance for a
    parametrised family such as SC@K) and override `score` (and `fit`)."""

    name: str = ""
    cost: str = "0"            # forward passes beyond the natural generation
    passes: tuple[str, ...] = ()
    # Where fitting needs the passes: None (fitting reads none), "all" (every item) or a
    # split name (collected on that split only).
    fit_passes_on: str | None = None
    # Passes only fitting reads (e.g. answer-flip negatives): collected where
    # `fit_passes_on` says, never by `evaluate` or the server.
    fit_passes: tuple[str, ...] = ()
    pass_share: float = 1.0    # share of its passes' measured time it uses
    served: bool = False       # a field of `/answer`'s confidence
    ours: bool = False         # DualRead and its branches: listed after baselines
    # False for a reader that predicts something else than correctness (a part of another
    # method): `fit-heads`' prior check does not hold it to the correctness base rate
    predicts_correctness: bool = True
    readers: dict[str, ReaderSpec] = {}

    def fit(self, heads: HeadsState, data: FitData) -> dict | None:
        """Fit whatever the method owns in `heads`; return a log entry (or None)."""
        return None

    def score(self, heads: HeadsState, feats: Features) -> np.ndarray:
        """Confidence in [0, 1] for each item of a batch of features (float64)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<method {self.name}>"


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if not method.name:
        raise ValueError("a method needs a name")
    # `/answer`'s fields are one list the client can import; a served method must be on it.
    if method.served and method.name not in SERVED_CONFIDENCES:
        raise ValueError(f"method {method.name!r} is marked served but `/answer` has no such "
                         "field: add it to clients.schemas.SERVED_CONFIDENCES")
    if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is already registered")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered() -> list[Method]:
    """Every method, in registration order (the order they are fitted in)."""
    return list(_REGISTRY.values())


def names() -> tuple[str, ...]:
    """Every method in table order: baselines first, DualRead's rows last."""
    ms = registered()
    return tuple(m.name for m in ms if not m.ours) + tuple(m.name for m in ms if m.ours)


def check_served() -> None:
    """The registered `served` methods are exactly `/answer`'s confidence fields. Called once
    the shipped methods are registered (heads/methods), so a field without a method fails at
    import, not on the first request."""
    served = {m.name for m in registered() if m.served}
    if served != set(SERVED_CONFIDENCES):
        raise ValueError("served methods and /answer's confidence fields differ: methods "
                         f"only {sorted(served - set(SERVED_CONFIDENCES))}, fields only "
                         f"{sorted(set(SERVED_CONFIDENCES) - served)}")


def get(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(names())}")
    return _REGISTRY[name]


def select(chosen: tuple[str, ...] | list[str] | None = None) -> list[Method]:
    """The chosen methods (all by default), in the order given; unknown names fail."""
    return [get(n) for n in (names() if chosen is None else chosen)]


def passes_for(methods: list[Method]) -> tuple[str, ...]:
    """The union of the passes the methods read, in first-seen order."""
    return tuple(dict.fromkeys(p for m in methods for p in m.passes))


def fit_passes_for(methods: list[Method], where: str) -> tuple[str, ...]:
    """The passes fitting needs on `where` ("all" or a split name): what the methods
    fitted there read at scoring time plus what they read only while fitting."""
    ms = [m for m in methods if m.fit_passes_on == where]
    return tuple(dict.fromkeys(p for m in ms for p in (*m.passes, *m.fit_passes)))


def readers_for(methods: list[Method]) -> dict[str, ReaderSpec]:
    out: dict[str, ReaderSpec] = {}
    for m in methods:
        for name, spec in m.readers.items():
            if name in out and out[name] != spec:
                raise ValueError(f"reader {name!r} declared twice with different shapes")
            out[name] = spec
    return out
