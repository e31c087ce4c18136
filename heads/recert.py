"""Re-certification of the defer rule on labelled feedback from a new input stream
(docs/method.md §8).

A *rule* is what decides `defer` beyond the fitted readers: DualRead's two branch
temperatures, τ, and the conformal reference of each novelty detector. The shipped rule
comes from the heads card; a re-certified rule is fitted on one window of operator verdicts
only, with the offline protocol: the window is split by a hash of the request id into a
temperature part and a τ part (disjoint, as the offline temperature and defer splits), the
temperatures are refitted with `heads.calibration.fit_temperature`, and τ is chosen on the τ
part (Clopper–Pearson bound of the risk among released ≤ r with probability ≥ 1 − δ over
the window's draw): by fixed-sequence testing over thresholds read off the temperature
part (`heads.defer.choose_threshold_sequence`, each test at level δ), or, when the
temperature part is too small to read thresholds off, by the offline binary search
(`heads.defer.choose_threshold`, each of its ⌈log2 m⌉ tests at δ / ⌈log2 m⌉). The
window's detector scores become a second conformal reference of each detector that can
take one (`extend_reference`: an input then passes when it looks like the fitting data or
like the window); the τ-part items are judged with leave-one-out p-values against the
window, so the certificate is on the rule that would be served. The guarantee is for items
exchangeable with the window's. A store tests every `Settings.window` new verdicts, so it
spends its δ across its tests (`spent_delta`: the t-th test at δ/(t(t+1)), all of them
together at most δ), and counts one verdict per input (`Served.key`): repeats of one input
are not independent evidence. With `Settings.max_window` above `window` (default: equal, so
off) a test reads the last `max_window` verdicts, not only those since the previous test.
The union bound does not need the
tests' samples to be disjoint, only each sample's start fixed before its own verdicts
arrive. An operator's reset (`reset_window`) can come at a time chosen after seeing the
labels, so it spends a test's share of δ like a refused test, and each test runs at
δ_t / ⌈max_window / window⌉: its verdicts start after one of that many earlier slots
(tests or resets, the history's start included), whichever the operator's resets made
it, and the union bound covers each of those starts.

Nothing here keeps an image, a question or an answer: a served answer leaves its three
branch log-odds, its detector scores and p-values, whether its response parsed, and the
version of the rule that decided it (`Served`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from heads.calibration import fit_temperature, fuse
from heads.defer import (
    DeferPolicy,
    choose_threshold,
    choose_threshold_sequence,
    sequence_grid,
)
from heads.methods.dualread import branch_log_odds as branch_logits  # noqa: F401  (older name)

if TYPE_CHECKING:
    from heads.dualread import Heads

log = logging.getLogger("dualread.audit")

SHIPPED = "shipped"
# The temperatures a rule refits: DualRead's two branches (docs/method.md §1), by method name
BRANCHES = ("psr", "per")
# The detectors a rule can carry a reference for: `Heads` attributes, each with `<name>_alpha`
DETECTORS = ("novelty",)
MIN_TEMPERATURE_ROWS = 20      # fewer rows: the temperatures are kept, not refitted
# fewer temperature-part rows: τ by the binary search (no thresholds to read off them)
MIN_GRID_ROWS = 50
# released shares between the fixed-sequence thresholds (docs/recert/search.md)
SEQUENCE_STEP = 0.01
KEEP_RULES = 20                # rules kept for rollback (the active chain first)
KEEP_EVENTS = 200              # audit events kept in the state file (all go to the log)


class RecertError(RuntimeError):
    """An operator request that cannot be carried out (unknown version, nothing to roll
    back to); the message says why."""


# ------------------------------------------------------------------ what an answer leaves
@dataclass(frozen=True)
class Served:
    """What a served answer keeps for re-certification: no request content."""

    version: str                               # the rule that decided `defer`
    logits: tuple[float, float, float]         # PSR, PER (pre-temperature), consistency term
    scores: dict[str, float] = field(default_factory=dict)   # detector score, by detector
    p_values: dict[str, float] = field(default_factory=dict)  # as served, by detector
    problem: bool = False                      # the response did not parse
    # digest of the decoded image and the question (`input_key`): the same input sent
    # under several request ids counts once; "" when unknown (older records)
    key: str = ""

    def to_dict(self) -> dict:
        return {"version": self.version, "logits": list(self.logits), "scores": self.scores,
                "p_values": self.p_values, "problem": self.problem, "key": self.key}

    @classmethod
    def from_dict(cls, d: dict) -> Served:
        return cls(d["version"], tuple(float(x) for x in d["logits"]),
                   {k: float(v) for k, v in d.get("scores", {}).items()},
                   {k: float(v) for k, v in d.get("p_values", {}).items()},
                   bool(d.get("problem", False)), str(d.get("key", "")))


KEY_SIDE = 256


def input_key(image: Any, question: str) -> str:
    """A digest of what was asked: the decoded pixels (mode, size, bytes: the same picture
    re-encoded losslessly or re-sent has one key) and the question with case and spacing folded. Not
    the content: nothing can be read back from it."""
    h = hashlib.sha256()
    if image is not None:
        h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
        # a large picture is hashed from a box-reduced copy (at most ~256 px a side): its
        # full bytes (48 MB at the pixel limit) took a quarter of a second on every answer
        factor = max(1, max(image.size) // KEY_SIDE)
        try:
            image = image.reduce(factor) if factor > 1 else image
        except ValueError:         # a mode PIL cannot reduce (1, P, I;16): every byte
            pass
        h.update(image.tobytes())
    h.update(b"\0" + " ".join(question.casefold().split()).encode())
    return h.hexdigest()[:32]


def distinct_inputs(verdicts: Sequence[Verdict]) -> list[Verdict]:
    """One verdict per input (`Served.key`), the first counted: repeats (one image
    and question under several request ids) are not independent evidence. Verdicts
    without a key are kept."""
    seen: set[str] = set()
    out = []
    for v in verdicts:
        k = v.served.key
        if k and k in seen:
            continue
        seen.add(k)
        out.append(v)
    return out


def spent_delta(delta: float, attempt: int) -> float:
    """α-spending over a rule history's certificate attempts: the t-th (from 1) is tested
    at δ_t = δ / (t (t + 1)). Σ_t δ_t = δ, so the chance that any certificate of the
    history holds while its rule's risk on its stream is above r is at most δ, however
    many windows are tried (a union bound over attempts)."""
    if attempt < 1:
        raise ValueError("attempts count from 1")
    return delta / (attempt * (attempt + 1))


def spending_view(delta: float, attempts: int) -> dict:
    """Where a history stands: δ spent by its `attempts` tests (δ (1 − 1/(t+1))) and the
    level of the next one."""
    return {"scheme": "delta_t = delta / (t (t + 1)), t = 1, 2, ... (tests and resets); "
                      "sum <= delta; a carried test runs at delta_t / carried_union",
            "delta_total": delta, "tests": attempts,
            "delta_spent": round(delta * (1 - 1 / (attempts + 1)), 8),
            "next_delta": round(spent_delta(delta, attempts + 1), 8)}


def dualread_at(logits: np.ndarray, t_pre: float, t_post: float) -> np.ndarray:
    """DualRead's confidence from `branch_logits` at other temperatures (docs/method.md §1,
    fusion)."""
    x = torch.as_tensor(np.asarray(logits, float).reshape(-1, 3), dtype=torch.float64)
    p_pre = torch.sigmoid(x[:, 0] / t_pre)
    p_post = torch.sigmoid(x[:, 1] / t_post + x[:, 2])
    return fuse(p_pre, p_post).double().numpy()


# ------------------------------------------------------------------ the rule
@dataclass
class DeferRule:
    version: str
    temperatures: dict[str, float]             # BRANCHES' temperatures
    policy: dict | None                        # DeferPolicy.to_dict(); None: defer everything
    # scores added to each detector's conformal reference (only detectors that extend)
    references: dict[str, list[float]] = field(default_factory=dict)
    # the window's distribution of served scores ("dualread" and each detector), against
    # which drift is measured while this rule is active; empty for the shipped rule
    drift_reference: dict[str, list[float]] = field(default_factory=dict)
    certificate: dict | None = None
    created_at: str = ""
    created_by: str = ""

    @property
    def tau(self) -> float | None:
        return None if self.policy is None else float(self.policy["tau"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DeferRule:
        return cls(**d)

    def summary(self) -> dict:
        """The rule without its long score lists (what `/calibration` shows)."""
        return {"version": self.version, "temperatures": self.temperatures,
                "policy": self.policy, "certificate": self.certificate,
                "references_extended": {k: len(v) for k, v in self.references.items()},
                "created_at": self.created_at, "created_by": self.created_by}

    def apply(self, base: Heads) -> Heads:
        """A copy of `base` serving this rule (`base` unchanged): its temperatures, τ and
        extended detector references."""
        heads = copy.copy(base)
        heads.temperatures = {**base.temperatures, **self.temperatures}
        heads.policy = DeferPolicy(**self.policy) if self.policy is not None else None
        for name, extra in self.references.items():
            det = getattr(base, name, None)
            if det is not None and hasattr(det, "extend_reference"):
                setattr(heads, name, det.extend_reference(np.asarray(extra, float)))
        heads.rule_version = self.version
        return heads


def shipped_rule(heads: Heads) -> DeferRule:
    """The rule the heads artefact ships with."""
    return DeferRule(SHIPPED, {b: heads.temperature(b) for b in BRANCHES},
                     heads.policy.to_dict() if heads.policy is not None else None,
                     created_by="heads artefact")


def detectors_of(heads: Heads) -> dict[str, tuple[Any, float]]:
    """The heads' detectors with their α, by name."""
    return {n: (getattr(heads, n), float(getattr(heads, f"{n}_alpha")))
            for n in DETECTORS if getattr(heads, n, None) is not None}


# ------------------------------------------------------------------ the certificate
@dataclass(frozen=True)
class Verdict:
    request_id: str
    served: Served
    correct: bool
    at: float                                  # unix time it was counted
    who: str

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "served": self.served.to_dict(),
                "correct": self.correct, "at": self.at, "who": self.who}

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        return cls(d["request_id"], Served.from_dict(d["served"]), bool(d["correct"]),
                   float(d["at"]), d.get("who", ""))


def in_temperature_part(request_id: str, share: float) -> bool:
    """The window's split: a hash of the server-generated request id (no client choice)."""
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h / 2 ** 64 < share


def _loo_p_values(window: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """p-value of window[i] (i in idx) against the window without itself."""
    win = np.sort(window)
    s = window[idx]
    at_least = len(win) - np.searchsorted(win, s, side="left") - 1
    return (1 + at_least) / len(win)


def certify(verdicts: Sequence[Verdict], base: Heads, version: str, *, target_risk: float,
            delta: float, min_per_class: int, temperature_share: float = 0.3,
            who: str = "", search: str = "sequence", step: float = SEQUENCE_STEP
            ) -> tuple[DeferRule | None, dict]:
    """Refit the temperatures and τ on `verdicts` alone. Returns (rule, certificate); the
    rule is None when the certificate does not hold (its `reason` says why). `search`:
    "sequence" (fixed-sequence testing when the temperature part is large enough, over a
    grid of released shares `step` apart) or "binary" (the offline binary search always).

    Both keep the guarantee (risk among released ≤ r with probability ≥ 1 − δ over the τ
    part's draw). Fixed sequence, at any `step`: the grid is read off the temperature part
    and sized by how many τ-part items the detectors release, neither of which reads a
    τ-part label, so each test may spend all of δ (`choose_threshold_sequence`). Binary:
    which thresholds it tests depends on the τ-part labels, so each of its ⌈log2 m⌉ tests
    is at δ / ⌈log2 m⌉ (a union bound; `choose_threshold`). `studies.recert_search`
    compares them."""
    if search not in ("sequence", "binary"):
        raise ValueError("search is 'sequence' or 'binary'")
    if not 0 < step <= 1:
        raise ValueError("step is a released share in (0, 1]")
    given = len(verdicts)
    verdicts = distinct_inputs(verdicts)
    n = len(verdicts)
    z = np.array([v.correct for v in verdicts], int)
    cert: dict[str, Any] = {
        "n": n, "n_correct": int(z.sum()), "n_wrong": int(n - z.sum()),
        "target_risk": target_risk, "delta": delta, "min_per_class": min_per_class,
        "temperature_share": temperature_share, "duplicates_dropped": given - n,
        "bound": "one-sided Clopper-Pearson upper bound of the risk among released",
        "holds": False, "reason": None}
    if n == 0 or min(cert["n_correct"], cert["n_wrong"]) < min_per_class:
        cert["reason"] = (f"label balance: {cert['n_correct']} correct and {cert['n_wrong']} "
                          f"wrong verdicts; each needs at least {min_per_class}")
        return None, cert
    temp = np.array([in_temperature_part(v.request_id, temperature_share) for v in verdicts])
    cal = ~temp
    cert.update(n_temperature=int(temp.sum()), n_tau=int(cal.sum()))
    x = np.array([v.served.logits for v in verdicts], float)
    if temp.sum() < MIN_TEMPERATURE_ROWS or len(set(z[temp])) < 2:
        # too little to fit a temperature on: the base's stay. The certificate below does
        # not depend on how the temperatures were chosen, only that the τ part did not
        # choose them.
        temps = {b: base.temperature(b) for b in BRANCHES}
        cert["temperatures_kept"] = (f"temperature part has {int(temp.sum())} verdicts, "
                                     f"{int(z[temp].sum())} correct: needs "
                                     f"{MIN_TEMPERATURE_ROWS} with both labels to refit")
    else:
        zt = torch.as_tensor(z[temp], dtype=torch.float64)
        temps = {"psr": fit_temperature(torch.as_tensor(x[temp, 0]), zt),
                 "per": fit_temperature(torch.as_tensor(x[temp, 1]), zt)}
    p = dualread_at(x, temps["psr"], temps["per"])

    # the rule's other terms on the τ part: parse problems and each detector's flag
    flagged = np.array([v.served.problem for v in verdicts])
    references, refs_note, drift_ref = {}, {}, {"dualread": p.tolist()}
    idx = np.flatnonzero(cal)
    for name, (det, alpha) in detectors_of(base).items():
        scores = np.array([v.served.scores.get(name, np.nan) for v in verdicts], float)
        have = np.isfinite(scores)
        if have.any():
            drift_ref[name] = scores[have].tolist()
        if hasattr(det, "extend_reference") and hasattr(det, "p_values_of") and have.all():
            references[name] = scores.tolist()
            # as the extended detector will read a fresh item of the stream: the larger
            # of its p-values against the shipped reference and against the window
            pv = np.maximum(det.p_values_of(scores[idx]), _loo_p_values(scores, idx))
            flagged[idx] |= pv < alpha
            refs_note[name] = f"extended by {n} window scores"
        else:
            # not extended: the rule serves this detector with the base's reference, so
            # the τ part is judged against it, whatever rule served the verdicts (an
            # earlier re-certified rule may have extended it: its served p-values would
            # release what this rule defers)
            flagged[idx] |= _base_flags(det, alpha, [verdicts[i] for i in idx], name)
            refs_note[name] = "skipped: the detector cannot extend its reference" \
                if not hasattr(det, "extend_reference") else \
                "skipped: some verdicts carry no score of this detector"
    cert["detector_references"] = refs_note or "no detector"
    cand = idx[~flagged[idx]]
    cert["n_tau_other_terms_defer"] = int(len(idx) - len(cand))
    if search == "sequence" and temp.sum() >= MIN_GRID_ROWS:
        # thresholds read off the temperature part (disjoint from the τ part): fixed
        # before the τ part is looked at, so each test may spend all of δ
        grid = sequence_grid(p[temp], len(cand), target_risk, delta, step)
        policy = choose_threshold_sequence(p[cand], z[cand], grid, target_risk, delta)
        cert["threshold_search"] = (
            f"fixed-sequence testing over {len(grid)} thresholds read off the temperature "
            f"part (released shares {step:g} apart), highest first, each at level delta "
            "(heads.defer.choose_threshold_sequence)")
    else:
        policy = choose_threshold(p[cand], z[cand], target_risk, delta)
        cert["threshold_search"] = (
            "binary search, each test at delta / ceil(log2 m) (heads.defer.choose_threshold)"
            + ("" if search == "binary" else
               f": the temperature part has {int(temp.sum())} verdicts, fewer than "
               f"{MIN_GRID_ROWS} to read thresholds off"))
    released = cand[p[cand] >= policy.tau]
    cert.update(
        temperatures={k: round(v, 6) for k, v in temps.items()},
        tau=policy.tau, feasible=policy.feasible,
        released_share=round(len(released) / max(1, len(idx)), 6),
        risk_among_released=round(float(1 - z[released].mean()), 6) if len(released) else None,
        risk_upper_bound=round(policy.risk_upper_bound, 6))
    if not policy.feasible:
        cert["reason"] = (f"no threshold keeps the {1 - delta:.0%} Clopper-Pearson bound of "
                          f"the risk among released at or below {target_risk} on the "
                          f"{len(cand)} τ-part verdicts the other terms release")
        return None, cert
    cert["holds"] = True
    rule = DeferRule(version, temps, policy.to_dict(), references, drift_ref, cert,
                     _now(), who)
    return rule, cert


def _base_flags(det: Any, alpha: float, verdicts: Sequence[Verdict], name: str
                ) -> np.ndarray:
    """The flags `det` (the base's reference, as a rule that does not extend it serves
    it) gives `verdicts`. From the stored scores when the detector can reread them; a
    detector that cannot was never extended by any rule (`certify` extends only
    detectors with `p_values_of`), so its served p-values are already against the base's
    reference. A verdict without a reading of the detector is not flagged by it: the
    service serves a missing reading that way."""
    if hasattr(det, "p_values_of"):
        s = np.array([v.served.scores.get(name, np.nan) for v in verdicts], float)
        p = np.full(len(s), np.nan)
        have = np.isfinite(s)
        if have.any():
            p[have] = det.p_values_of(s[have])
    else:
        p = np.array([v.served.p_values.get(name, np.nan) for v in verdicts], float)
    return p < alpha                                   # NaN compares False


# ------------------------------------------------------------------ the store
def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so a crash leaves the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@dataclass
class Settings:
    window: int = 1000                 # new verdicts between two certificate tests
    # verdicts a test reads at most: the last ones (None: `window`, so each test reads only
    # the verdicts since the one before)
    max_window: int | None = None
    min_per_class: int = 10            # each label at least this often in a window
    temperature_share: float = 0.3
    target_risk: float | None = None   # None: the shipped policy's r
    delta: float | None = None         # None: the shipped policy's δ


def detectors_digest(heads: Heads) -> str:
    """What a rule's detector references were scored by: each detector's kind, feature and
    calibration scores (a `dualread fit-detectors` run changes it, `fit-heads`' commit
    does not), so a state file's rules are only reused with the detectors they extended."""
    h = hashlib.sha256()
    for name in DETECTORS:
        det = getattr(heads, name, None)
        h.update(name.encode())
        if det is None:
            h.update(b"-")
            continue
        parts = getattr(det, "parts", {"": det})
        for key, part in sorted(parts.items()):
            h.update(f"{key}:{part.kind}:{part.feature}".encode())
            cal = part.t.get("calibration")
            h.update(b"-" if cal is None else cal.numpy().astype("<f8").tobytes())
    return h.hexdigest()


class RuleStore:
    """The active rule, the rules kept for rollback, the open window of counted verdicts
    and the audit history, persisted atomically in one JSON file (never the heads' own
    files). Every change happens under one lock and is on disk before it returns."""

    def __init__(self, path: str | Path, base: Heads, heads_id: str,
                 settings: Settings | None = None,
                 on_switch: Callable[[DeferRule], None] | None = None) -> None:
        self.path = Path(path)
        self.base = base
        self.heads_id = heads_id
        self.settings = settings or Settings()
        self.on_switch = on_switch or (lambda rule: None)
        self.lock = threading.RLock()
        shipped = shipped_rule(base)
        self.rules: dict[str, DeferRule] = {SHIPPED: shipped}
        self.chain: list[str] = [SHIPPED]           # activation order; last is active
        self.pinned = False
        self.window: list[Verdict] = []
        self.counted: set[str] = set()
        self.events: list[dict] = []
        self.keys: set[str] = set()                # inputs (Served.key) in the window
        self.since_test = 0                        # verdicts counted since the last test
        self.resets = 0                            # windows dropped by a reset (not a test)
        self._rules_json: tuple[tuple, str] | None = None   # the rules, as last written
        self.attempts = 0
        # certificate tests run in this history: the α-spending index (`spent_delta`)
        self.tests = 0
        self.last_attempt: dict | None = None
        self._load(shipped)

    # ---------------------------------------------------------------- persistence
    def _load(self, shipped: DeferRule) -> None:
        if not self.path.exists():
            return
        state = json.loads(self.path.read_text())
        present = {name for name in DETECTORS if getattr(self.base, name, None) is not None}
        same = state.get("heads_id") == self.heads_id and \
            state.get("detectors") == detectors_digest(self.base) and \
            state.get("rules", {}).get(SHIPPED, {}).get("policy") == shipped.policy and \
            state.get("rules", {}).get(SHIPPED, {}).get("temperatures") == shipped.temperatures \
            and all(set(r.get("references", {})) <= present
                    for r in state.get("rules", {}).values())
        if not same:
            # a rule certified against other detectors (a `fit-detectors` since, or a
            # retired check) must not wrap these ones: its references are their scores
            # another artefact's state: keep it aside, start from the shipped rule
            stale = self.path.with_name(self.path.name + f".stale-{int(time.time())}")
            os.replace(self.path, stale)
            log.warning(json.dumps({"event": "recert_state_set_aside", "to": stale.name,
                                    "why": "written for other heads"}))
            return
        self.rules = {k: DeferRule.from_dict(v) for k, v in state["rules"].items()}
        self.chain = list(state["chain"])
        self.pinned = bool(state.get("pinned", False))
        self.window = [Verdict.from_dict(v) for v in state.get("window", [])]
        self.counted = {v.request_id for v in self.window}
        self.keys = {v.served.key for v in self.window if v.served.key}
        # a file from before carried-over windows held only verdicts since the last test
        self.since_test = int(state.get("since_test", len(self.window)))
        self.events = list(state.get("events", []))
        self.attempts = int(state.get("attempts", 0))
        # an older file spent δ on every attempt: count them all as spent
        self.tests = int(state.get("tests", self.attempts))
        self.resets = int(state.get("resets", 0))
        self.last_attempt = state.get("last_attempt")
        counted_under = state.get("window_settings")
        # a file from before window settings were kept: under which it was counted is
        # unknown, so its window is dropped too
        if self.window and counted_under != self._window_settings():
            # a test reads only verdicts counted under its own window settings: a lower
            # max_window kept after the labels are known would choose which of them it reads
            self._drop("service", f"window settings changed from {counted_under or 'unknown'}")

    def _save(self) -> None:
        state = {"heads_id": self.heads_id, "detectors": detectors_digest(self.base),
                 "chain": self.chain, "pinned": self.pinned,
                 "window": [v.to_dict() for v in self.window], "since_test": self.since_test,
                 "window_settings": self._window_settings(),
                 "events": self.events[-KEEP_EVENTS:], "attempts": self.attempts,
                 "tests": self.tests, "resets": self.resets,
                 "alpha_spending": self.spending(), "last_attempt": self.last_attempt}
        # the kept rules (each with its references: most of the file once 20 are kept)
        # change only at a switch, a pin or a trim: serialised again only then, not at
        # every verdict (a kept rule is never changed in place: the key is its identity)
        key = tuple((k, id(r)) for k, r in self.rules.items())
        if self._rules_json is None or self._rules_json[0] != key:
            self._rules_json = (key, json.dumps({k: r.to_dict() for k, r in self.rules.items()}))
        atomic_write(self.path, json.dumps(state)[:-1] + ', "rules": ' + self._rules_json[1] + "}")

    # ---------------------------------------------------------------- reading
    @property
    def active(self) -> DeferRule:
        return self.rules[self.chain[-1]]

    def levels(self) -> tuple[float, float]:
        """(r, δ): the settings', else the shipped policy's; δ is the whole history's."""
        s, shipped = self.settings, self.rules[SHIPPED]
        r = s.target_risk if s.target_risk is not None else \
            (shipped.policy or {}).get("target_risk", 0.05)
        d = s.delta if s.delta is not None else (shipped.policy or {}).get("delta", 0.1)
        return float(r), float(d)

    def spending(self) -> dict:
        out = spending_view(self.levels()[1], self.tests)
        if self.carried_union > 1:
            out["next_delta"] = round(out["next_delta"] / self.carried_union, 8)
            out["carried_union"] = self.carried_union
        return out

    @property
    def carried_union(self) -> int:
        """What each test's δ_t is divided by: the starts its verdicts may have (after one
        of the last ⌈max_window / window⌉ tests or resets). From the first test on: whether
        a reset comes, and when, may be decided on the labels seen so far, so "no reset
        yet" is one of the starts, not a case apart."""
        return -(-self.max_window // self.settings.window)

    def _window_settings(self) -> dict:
        return {"window": self.settings.window, "max_window": self.max_window}

    @property
    def max_window(self) -> int:
        """Verdicts a test reads at most (never fewer than a test's new ones)."""
        s = self.settings
        return max(s.window, s.max_window or s.window)

    def view(self) -> dict:
        """What `/calibration` shows (no request content: ids stay out of it)."""
        with self.lock:
            w = self.window
            return {"active": self.active.summary(), "pinned": self.pinned,
                    "window": {"counted": len(w), "needed": self.settings.window,
                               "max": self.max_window, "since_test": self.since_test,
                               "correct": sum(v.correct for v in w),
                               "wrong": sum(not v.correct for v in w),
                               "opened_at": _iso(w[0].at) if w else None},
                    "last_attempt": self.last_attempt, "alpha_spending": self.spending(),
                    "rules": [self.rules[k].summary() for k in self.rules],
                    "chain": list(self.chain), "history": self.events[-50:]}

    # ---------------------------------------------------------------- verdicts
    def add(self, request_id: str, served: Served, correct: bool, who: str) -> dict:
        """Count one operator verdict (once per request id); tries a certificate on the
        window when `Settings.window` verdicts have come since the last try. Returns what
        happened."""
        with self.lock:
            if request_id in self.counted:
                return {"counted": False, "reason": "already_counted"}
            if served.key and served.key in self.keys:
                # the same image and question under another request id: not new evidence
                return {"counted": False, "reason": "duplicate_input"}
            self.window.append(Verdict(request_id, served, bool(correct), time.time(), who))
            self.counted.add(request_id)
            if served.key:
                self.keys.add(served.key)
            self.since_test += 1
            if self.since_test < self.settings.window:
                self._save()
                return {"counted": True, "window": len(self.window)}
            return {"counted": True, "window": len(self.window), **self._close(who)}

    def _keep_last(self, n: int) -> None:
        """Keep the window's last `n` verdicts (and forget the others' ids and inputs)."""
        self.window = self.window[max(0, len(self.window) - n):] if n > 0 else []
        self.counted = {v.request_id for v in self.window}
        self.keys = {v.served.key for v in self.window if v.served.key}

    def reset_window(self, who: str) -> dict:
        """A new input stream: drop the window's verdicts (the next test reads the new
        stream's only) and serve the shipped rule again unless one is pinned (a rule
        certified on the old stream says nothing of the new). Spends a test's share of δ."""
        with self.lock:
            if not self.window and (self.active.version == SHIPPED or self.pinned):
                return {"dropped": 0, "active": self.active.version}   # nothing to do
            kept = (self.window, self.counted, self.keys, self.since_test, self.tests,
                    self.resets, list(self.chain), len(self.events))
            old = self.active
            event = self._drop(who, "window reset", save=False,
                               new=None if self.pinned else self.rules[SHIPPED])
            if not self.pinned:
                self.chain = [SHIPPED]   # the other rules stay known, to pin again
            try:
                self._save()
            except BaseException:
                # not on disk: not done (the window stays, and no audit line says otherwise)
                (self.window, self.counted, self.keys, self.since_test, self.tests,
                 self.resets, self.chain, n) = kept
                del self.events[n:]
                raise
            self._emit(event)
            if self.active is not old:
                self.on_switch(self.active)
            return {"dropped": event["dropped"], "active": self.active.version}

    def _drop(self, who: str, reason: str, new: DeferRule | None = None, save: bool = True
              ) -> dict:
        """Empty the window as a test would not: at a time someone chose, perhaps after
        seeing the labels, so dropping verdicts spends a test's share of δ (`spent_delta`);
        every test divides its share by `carried_union`, from the first on. `new`: the rule served
        after it, for the audit record."""
        dropped = len(self.window)
        self._keep_last(0)
        self.since_test = 0
        extra: dict[str, Any] = {}
        if dropped:
            self.tests += 1
            self.resets += 1
            extra["alpha_spending"] = {
                "test": self.tests, "delta_this_test": spent_delta(self.levels()[1], self.tests),
                "note": "dropping verdicts spends a test's share of delta"}
        event = self._event("window_reset", who, old=self.active, new=new, emit=False,
                            dropped=dropped, reason=reason, **extra)
        if save:
            self._save()
            self._emit(event)          # the audit line once the file holds it
        return event

    def _close(self, who: str) -> dict:
        """Certify the window (its last `max_window` verdicts), switch when the
        certificate holds and no rule is pinned, keep the last `max_window − window`
        verdicts for the next test; one save for all of it."""
        # never more than max_window by construction (each test keeps max_window − window;
        # verdicts counted under other window settings are dropped at load): kept as a guard
        rows = self.window[-self.max_window:]
        s = self.settings
        r, d = self.levels()
        t = self.tests + 1
        version = f"r{self.attempts + 1}-" \
                  f"{hashlib.sha256(str(time.time()).encode()).hexdigest()[:6]}"
        union = self.carried_union
        # the test first: should it fail, the window and the counts are as they were, and
        # the next verdict tries again
        rule, cert = certify(rows, self.base, version, target_risk=r,
                             delta=spent_delta(d, t) / union, min_per_class=s.min_per_class,
                             temperature_share=s.temperature_share, who=who)
        # the next test reads at most max_window: the kept ones and `window` new ones
        self._keep_last(self.max_window - self.settings.window)
        self.since_test = 0
        self.attempts += 1
        # every closed window spends its δ_t, a test run or not: the balance check reads
        # the window's labels, and spending on its refusals too keeps the union bound from
        # resting on the test being valid given that check passed
        self.tests = t
        spend = {"test": t, "delta_total": d, "delta_this_test": spent_delta(d, t) / union,
                 "delta_spent": round(d * (1 - 1 / (t + 1)), 8)}
        if union > 1:
            spend["carried_union"] = union
        if "tau" not in cert:
            spend["note"] = "no test ran (label balance); its share is spent all the same"
        cert = {**cert, "alpha_spending": spend}
        if rule is not None:
            rule.certificate = cert
        window = {"n": len(rows), "first_at": _iso(rows[0].at), "last_at": _iso(rows[-1].at),
                  "correct": cert["n_correct"], "wrong": cert["n_wrong"],
                  "decided_by": sorted({v.served.version for v in rows})}
        old = self.active
        if rule is None:
            event = "refused"
        elif self.pinned:
            event, cert = "held_pinned", {**cert, "note": "a rule is pinned: not switched"}
        else:
            event = "switch"
        self.last_attempt = {"at": _now(), "event": event, "version": version,
                             "window": window, "certificate": cert}
        if event == "switch":
            self.rules[version] = rule
            self.chain.append(version)
            self._trim()
        self._event(event, who, window=window, old=old,
                    new=rule if event == "switch" else None, certificate=cert,
                    candidate=version)
        self._save()
        if event == "switch":
            self.on_switch(rule)
        return {"attempt": event, "version": version, "certificate": cert}

    # ---------------------------------------------------------------- operator
    def rollback(self, who: str) -> DeferRule:
        """Back to the rule active before the current one; pins it (a rolled-back stream
        would otherwise switch again at its next window)."""
        with self.lock:
            if len(self.chain) < 2:
                raise RecertError(f"nothing to roll back to: {self.active.version} is the "
                                  "only rule in the chain")
            old = self.active
            self.chain.pop()
            self.pinned = True
            self._event("rollback", who, old=old, new=self.active)
            self._save()
            self.on_switch(self.active)
            return self.active

    def pin(self, version: str | None, who: str) -> DeferRule:
        """Make `version` (default: the active one) active and keep it until unpinned."""
        with self.lock:
            version = version or self.active.version
            if version not in self.rules:
                # the client's text is not echoed (docs/errors.md)
                raise RecertError(f"no such rule; known: {', '.join(self.rules)}")
            old = self.active
            if version != old.version:
                # the shipped rule stays first, so a rollback can always reach it; pinning
                # it empties the chain above it (those rules stay known, to pin again)
                rest = [v for v in self.chain if v not in (version, SHIPPED)]
                self.chain = [SHIPPED] if version == SHIPPED else [SHIPPED, *rest, version]
            self.pinned = True
            self._event("pin", who, old=old, new=self.active)
            self._save()
            if version != old.version:
                self.on_switch(self.active)
            return self.active

    def unpin(self, who: str) -> None:
        with self.lock:
            self.pinned = False
            self._event("unpin", who, old=self.active, new=self.active)
            self._save()

    # ---------------------------------------------------------------- internals
    def _trim(self) -> None:
        keep = set(self.chain[-KEEP_RULES:]) | {SHIPPED}
        self.chain = [v for v in self.chain if v in keep]
        self.rules = {k: r for k, r in self.rules.items() if k in keep}

    def _event(self, event: str, who: str, old: DeferRule, new: DeferRule | None = None,
               emit: bool = True, **extra: Any) -> dict:
        """Audit record: who, when, what, old/new τ; never a request's content. `emit`:
        also the audit log line now (else the caller's `_emit`, once it is saved)."""
        e = {"event": event, "who": who, "at": _now(),
             "old": {"version": old.version, "tau": old.tau},
             "new": None if new is None else {"version": new.version, "tau": new.tau},
             **extra}
        self.events.append(e)
        if emit:
            self._emit(e)
        return e

    @staticmethod
    def _emit(e: dict) -> None:
        log.info(json.dumps({"audit": "defer_rule", **e}, default=str))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
