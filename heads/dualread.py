"""The fitted heads artefact: every registered method's readers and maps, and the defer policy.

What a method owns here is keyed by its canonical name (`heads.registry`): temperatures and
Platt maps by method, readers by reader name (a reader can serve several methods: P-State's
reader also feeds PER and DualRead). Older artefacts (keys `T_pre`, `sc2`, `semantic`, ...)
still load.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import heads.layout_novelty  # noqa: F401  (registers the layout part's class for loading)
import heads.methods  # noqa: F401  (registers the shipped methods)
import heads.pixel_novelty  # noqa: F401  (registers the pixel part's class for loading)
from heads import registry
from heads.defer import DEFER_ALL_TAU, DeferPolicy
from heads.features import FEATURE_SCHEMA, KAPPA, extract_many, image_stats
from heads.methods import dualread as dualread_method
from heads.methods import state_baselines
from heads.methods.dualread import branch_log_odds
from heads.modules import Reader
from heads.novelty import (
    ALPHA,
    IMAGE_FEATURES,
    CompositeNovelty,
    Novelty,
    NoveltyReading,
    load_detector,
)
from heads.registry import Method, Scored
from heads.threads import one_blas_thread
from models.loading import FINGERPRINT_SCHEME, LEGACY_FINGERPRINTS

EMBEDDED_HEADS = Path(__file__).parent / "embedded"
# 3: the card carries the novelty detector and the defer rule. 4: the image check (retired
# since: `Heads.load` refuses a card that carries one). 5: the novelty detector may be
# composite (heads.novelty.CompositeNovelty, its parts' files). A server that predates a
# card's version could load it and silently drop a term of its rule, so `Heads.load`
# refuses any version newer than this one.
CARD_VERSION = 5
# the method whose confidence the defer policy thresholds
DEFER_METHOD = "dualread"
DUALREAD_READERS = ("psr", "state", "visual")
# card keys written before the registry -> canonical method names
LEGACY_TEMPERATURES = {"T_pre": "psr", "T_post": "per", "T_state": "p_state",
                       "T_saplma": "saplma", "T_bicr": "blind_image_contrast",
                       "T_msp": "max_sequence_probability"}
LEGACY_PLATT = {"sc2": "sc_2", "sc4": "sc_4", "sc8": "sc_8", "semantic": "semantic_uncertainty"}

@dataclass(frozen=True)
class Assessment:
    """One readout's served confidences and novelty reading (None without a detector)."""

    confidence: dict[str, float]
    novelty: NoveltyReading | None
    # DualRead's branch log-odds (`heads.methods.dualread.branch_log_odds`): what re-certification
    # rescores at other temperatures; None for heads without DualRead's readers
    logits: tuple[float, float, float] | None = None


def rule_of(novelty: Novelty | CompositeNovelty | None) -> str:
    """The defer rule in words, as the card states it (docs/method.md §8), for heads with or
    without a novelty detector; `Heads.decide` implements it. (A plain function: the
    `defer_rule` property only forwards here.)"""
    terms = ["DualRead < tau"] + (["novelty p-value < alpha"] if novelty is not None else []) \
        + ["the response does not parse"]
    return "defer if " + " or ".join(terms)


def novelty_reason(alpha: float) -> str:
    """`defer_reason` when the novelty detector flags the input."""
    return f"image unlike the fitting data (novelty p < {alpha:g})"


class FingerprintMismatch(RuntimeError):
    pass


class CardTooNew(RuntimeError):
    """A heads card written by a newer version of this code than the one loading it."""


class RetiredImageCheck(RuntimeError):
    """Heads whose defer rule was certified with the pixel image check, which this code no
    longer has: served without it, the rule would not be the one that was certified."""


def refuse_image_check(card: dict, folder: Path) -> None:
    """Raise `RetiredImageCheck` for a card whose rule includes the retired image check
    (its `image_check` entry, or the term in its stated `defer_rule`)."""
    if card.get("image_check") or "image-check" in str(card.get("defer_rule", "")):
        raise RetiredImageCheck(
            f"heads in {folder} were certified with the pixel image check, which this "
            "version no longer runs; serving them without it would apply a defer rule other "
            "than the certified one. Refit the detectors with `dualread fit-detectors` (or "
            "the heads with `dualread fit-heads`), or serve them with an earlier dualread")


def _below(pvals: Sequence[float | None] | np.ndarray | None, detector: Novelty | None,
           alpha: float, n: int) -> np.ndarray:
    """p-value < α per item, only with a detector; a None p-value never flags."""
    if pvals is None or detector is None:
        return np.zeros(n, bool)
    pv = np.array([np.nan if v is None else v for v in pvals], float)
    return pv < alpha                                  # NaN (no p-value) compares False


def _detector_card(det: Novelty | None, alpha: float, fit_log: dict | None, prefix: str
                   ) -> dict | None:
    """A detector's card fields, after what fitting logged about it (`fit_log`)."""
    if det is None:
        return None
    d = det.to_dict()
    return {**(fit_log or {}), "kind": d["kind"], "feature": d["feature"], "alpha": alpha,
            "n_fit": d["n_fit"], "n_calibration": d["n_calibration"], "C": d["C"],
            "p_value": d["p_value"], "files": [f"{prefix}.safetensors", f"{prefix}.json"]}


def _legacy_match(card: dict, actor_fingerprint: str, folder: Path) -> bool:
    """A card written before the fingerprint covered tokenizer, chat template, processor
    and system prompt still loads for the same weights and config, with a warning: its
    SAPLMA, mean-log-prob and P(True) maps were fitted on older features; refit it."""
    if "fingerprint_scheme" in card:
        return False
    if LEGACY_FINGERPRINTS.get(actor_fingerprint) != card["actor_fingerprint"]:
        return False
    warnings.warn(f"heads in {folder} predate fingerprint scheme {FINGERPRINT_SCHEME} and "
                  "today's feature definitions; refit them with `dualread fit-heads`",
                  stacklevel=3)
    return True


# The logic of `Heads`' properties, as plain functions: mutation testing skips decorated
# functions, so the properties only forward here.
def with_legacy_platt_keys(maps: dict[str, tuple[float, float]]
                           ) -> dict[str, tuple[float, float]]:
    """A copy of the Platt maps by method, plus the older key names as aliases."""
    out = dict(maps)
    out.update({old: out[new] for old, new in LEGACY_PLATT.items() if new in out})
    return out


def canonical_platt_keys(maps: dict[str, tuple[float, float]]
                         ) -> dict[str, tuple[float, float]]:
    """Platt maps keyed by canonical method name (older key names renamed)."""
    return {LEGACY_PLATT.get(k, k): tuple(v) for k, v in maps.items()}


def threshold_of(policy: DeferPolicy | None) -> float:
    """τ of a policy; above any probability without one (everything is deferred)."""
    return policy.tau if policy else DEFER_ALL_TAU


class _Temperature:
    """`heads.t_pre` and friends: attribute views of `heads.temperatures[method]`."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.temperatures.get(self.method, 1.0)

    def __set__(self, obj, value: float) -> None:
        obj.temperatures[self.method] = float(value)


@dataclass
class Heads:
    dim: int
    readers: dict[str, Reader] = field(default_factory=dict)
    temperatures: dict[str, float] = field(default_factory=dict)           # by method
    platt_maps: dict[str, tuple[float, float]] = field(default_factory=dict)  # by method
    # -log(pos_weight) of each class-weighted MLP, by reader name
    offsets: dict[str, float] = field(default_factory=dict)
    policy: DeferPolicy | None = None
    kappa: float = KAPPA
    actor_fingerprint: str = ""
    card: dict = field(default_factory=dict)
    # conformal novelty detector on the actor's states (None: the older rule, τ alone);
    # since card version 5 a composite one (image tokens + prompt state)
    novelty: Novelty | CompositeNovelty | None = None
    novelty_alpha: float = ALPHA

    t_pre = _Temperature("psr")
    t_post = _Temperature("per")
    t_state = _Temperature("p_state")
    t_saplma = _Temperature("saplma")
    t_bicr = _Temperature("blind_image_contrast")
    t_msp = _Temperature("max_sequence_probability")

    @property
    def heads_id(self) -> str:
        """What `/health`, every answer and the reports call these heads: the card's
        `heads_id`, else the actor fingerprint and the fitting commit's first 8 digits."""
        return self.card.get("heads_id") or \
            f"{self.actor_fingerprint}-{self.card.get('git_commit', '')[:8]}"

    @classmethod
    def new(cls, dim: int, methods: Sequence[Method] | None = None) -> Heads:
        """Fresh readers for every registered method (created in registration order), or
        for `methods` only: a study that fits some methods must not score with readers it
        never fitted (PER adds the answer-consistency reader when it is there)."""
        specs = registry.readers_for(list(methods) if methods is not None
                                     else registry.registered())
        return cls(dim=dim, readers={name: Reader(s.width * dim, s.hidden)
                                     for name, s in specs.items()})

    def __getattr__(self, name: str):
        # `heads.psr`, `heads.state`, ...: the readers by name
        readers = self.__dict__.get("readers", {})
        if name in readers:
            return readers[name]
        raise AttributeError(name)

    # ------------------------------------------------------------- per-method state
    def temperature(self, method: str) -> float:
        return self.temperatures.get(method, 1.0)

    def platt_map(self, method: str, default: tuple[float, float] | None = None
                  ) -> tuple[float, float]:
        if method in self.platt_maps:
            return self.platt_maps[method]
        if default is None:
            raise KeyError(f"these heads have no Platt map for {method!r}; refit them with "
                           "`dualread fit-heads`")
        return default

    @property
    def platt(self) -> dict[str, tuple[float, float]]:
        """Platt maps by method, plus the older key names (`sc2`, `semantic`) as aliases.

        A read-only copy for older callers; fitting writes `platt_maps`.
        """
        return with_legacy_platt_keys(self.platt_maps)

    @platt.setter
    def platt(self, maps: dict[str, tuple[float, float]]) -> None:
        self.platt_maps = canonical_platt_keys(maps)

    def has(self, method: Method) -> bool:
        """Whether this artefact holds every reader the method needs."""
        return all(r in self.readers for r in method.readers)

    # ------------------------------------------------------------- scoring
    def logits(self, f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DualRead's branch logits: pre (PSR), state (P-State) and post (P-State + P-Visual)."""
        return dualread_method.logits(self, f)

    def score(self, f: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Confidence of every method that reads only the natural pass, for a feature batch."""
        return {m.name: m.score(self, f) for m in registry.registered()
                if not m.passes and self.has(m)}

    def confidence(self, readout) -> dict[str, float]:
        """The online view for one readout: the methods marked `served` (`/answer`)."""
        return self.confidence_batch([readout])[0]

    def confidence_batch(self, readouts: list) -> list[dict[str, float]]:
        """`confidence` of several readouts, each reader run once over all of them: per
        item, the readers' calls and not their arithmetic were most of the cost."""
        return [a.confidence for a in self.assess(readouts, novelty=False)]

    def assess(self, readouts: list, images: Sequence | None = None, novelty: bool = True
               ) -> list[Assessment]:
        """Served confidences and the novelty reading of several readouts, from one
        feature pass: what `/answer` needs before the defer rule. `images`: the decoded
        image of each readout, which a detector with a pixel part reads. `novelty=False`:
        the confidences alone (no reading)."""
        if not readouts:
            return []
        # inference mode: no autograd bookkeeping on any of the small ops (~10% of them);
        # one BLAS thread: faster here, and no spinning thread left behind (heads.threads)
        with torch.inference_mode(), one_blas_thread():
            feats = extract_many(readouts, self.kappa)
            # the confidences alone read no image (probe routes, `confidence`)
            f = Scored(self.with_images(feats, images) if novelty else feats)
            scores = {m.name: m.score(self, f) for m in registry.registered()
                      if m.served and self.has(m)}
            nov = self.novelty.read(f, self.novelty_alpha) \
                if self.novelty is not None and novelty else [None] * len(readouts)
            lg = branch_log_odds(self, f) if all(r in self.readers for r in DUALREAD_READERS) \
                else None
        return [Assessment({name: float(s[i]) for name, s in scores.items()}, nov[i],
                           None if lg is None else tuple(float(v) for v in lg[i]))
                for i in range(len(readouts))]

    def saplma_logits(self, h_mid: torch.Tensor) -> torch.Tensor:
        return state_baselines.saplma_logits(self, h_mid)

    def bicr_logits(self, h_real: torch.Tensor, h_black: torch.Tensor) -> torch.Tensor:
        return state_baselines.bicr_logits(self, h_real, h_black)

    def score_bicr(self, h_real: torch.Tensor, h_black: torch.Tensor) -> np.ndarray:
        return state_baselines.score_bicr(self, h_real, h_black)

    @property
    def defer_threshold(self) -> float:
        """τ; above any probability when there is no policy (everything is deferred)."""
        return threshold_of(self.policy)

    def defer(self, p: float) -> bool:
        return True if self.policy is None else self.policy.defer(p)

    # ------------------------------------------------------------- the defer rule
    def with_images(self, feats: dict, images: Sequence | None) -> dict:
        """`feats` with what the detector's parts read from `images` (the pixel part's
        descriptors, the layout part's vectors) when it has such parts."""
        need = getattr(self.novelty, "image_features", ())
        if not need:
            return feats
        if images is None:
            raise ValueError("these heads' novelty detector reads the image (a pixel or "
                             "layout part): pass each readout's decoded image")
        out = heads.pixel_novelty.with_pixels(feats, images) \
            if heads.pixel_novelty.PIXEL_FEATURE in need else dict(feats)
        for name in need:
            if name in IMAGE_FEATURES:
                out[name] = IMAGE_FEATURES[name](images)
        return out

    def novelty_of(self, readout, image=None) -> NoveltyReading | None:
        """Score, conformal p-value and flag of one readout (and its decoded image, which
        a detector with a pixel part reads); None without a detector."""
        if self.novelty is None:
            return None
        if getattr(self.novelty, "reads_pixels", False):
            return self.novelty.read(self.with_images(
                extract_many([readout], self.kappa), None if image is None else [image]),
                self.novelty_alpha)[0]
        mean, std = image_stats(readout.h_image)
        light = {"h_pre": readout.h_pre.float()[None], "img_mean": mean[None],
                 "img_std": std[None]}
        try:      # most detectors read only these: no need for every feature
            return self.novelty.read(light, self.novelty_alpha)[0]
        except KeyError:          # one that reads more (the image tokens): all of them
            return self.novelty.read(extract_many([readout], self.kappa),
                                     self.novelty_alpha)[0]

    @property
    def defer_rule(self) -> str:
        return rule_of(self.novelty)

    def decide(self, p_dualread: float, novelty_p: float | None = None,
               problem: str | None = None) -> tuple[bool, str | None]:
        """The whole defer rule for one item: (defer, reason). Defer when DualRead < τ,
        when the novelty p-value is below α, or when the response has a `problem`; the
        reason names the problem and/or the flag (None when only τ decides). The flags
        come from `defer_reasons`, the one rule that `evaluate` applies too."""
        why = {k: bool(v[0]) for k, v in self.defer_reasons(
            [p_dualread], [novelty_p], [problem]).items()}
        reasons = [problem, novelty_reason(self.novelty_alpha) if why["novelty"] else None]
        return any(why.values()), "; ".join(r for r in reasons if r is not None) or None

    def calibrated(self, novelty_p: float | None = None) -> bool:
        """Whether DualRead's confidence for an input is inside its calibrated range: no
        detector of the defer rule flags it. Its calibration was measured on inputs like
        the fitting data; on a flagged one the number is kept but not vouched for."""
        return not bool(self.defer_reasons([1.0], [novelty_p])["novelty"][0])

    def defer_reasons(self, p_dualread: Sequence[float] | np.ndarray,
                      novelty_p: Sequence[float | None] | np.ndarray | None = None,
                      problems: Sequence[str | None] | None = None
                      ) -> dict[str, np.ndarray]:
        """The defer rule over a batch, one boolean array per reason: "tau" (DualRead < τ;
        every item without a policy), "novelty" (p-value < α, only with a detector; a None
        p-value never flags) and "problem" (the response does not parse). An item is
        deferred when any of them holds (`defer_mask`)."""
        p = np.asarray(p_dualread, float)
        tau = p < self.policy.tau if self.policy is not None else np.ones(len(p), bool)
        bad = np.zeros(len(p), bool) if problems is None else \
            np.array([q is not None for q in problems], bool)
        return {"tau": tau,
                "novelty": _below(novelty_p, self.novelty, self.novelty_alpha, len(p)),
                "problem": bad}

    def defer_mask(self, p_dualread: Sequence[float] | np.ndarray,
                   novelty_p: Sequence[float | None] | np.ndarray | None = None,
                   problems: Sequence[str | None] | None = None) -> np.ndarray:
        """`decide` vectorised: True where an item is deferred, for any reason."""
        why = self.defer_reasons(p_dualread, novelty_p, problems)
        return why["tau"] | why["novelty"] | why["problem"]

    # ------------------------------------------------------------- artefacts
    def save(self, folder: str | Path, card: dict) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, reader in self.readers.items():
            for k, v in reader.state_dict().items():
                tensors[f"{name}.{k}"] = v.contiguous()
        save_file(tensors, str(folder / "heads.safetensors"))
        card = {**card, "card_version": CARD_VERSION,
                "actor_fingerprint": self.actor_fingerprint,
                "fingerprint_scheme": FINGERPRINT_SCHEME, "feature_dim": self.dim,
                "feature_schema": FEATURE_SCHEMA, "kappa": self.kappa,
                "methods": [m.name for m in registry.registered() if self.has(m)],
                "temperatures": dict(self.temperatures),
                "platt": {k: list(v) for k, v in self.platt_maps.items()},
                "prior_offsets": self.offsets,
                "defer": self.policy.to_dict() if self.policy else None,
                "defer_rule": self.defer_rule,
                "novelty": self._novelty_card(card.get("novelty"))}
        card.pop("image_check", None)       # the retired check's entry of an older card
        if self.novelty is not None:
            self.novelty.save(folder)       # novelty.safetensors + novelty.json
        self.card = card
        (folder / "heads_card.json").write_text(json.dumps(card, indent=2))

    def _novelty_card(self, fit_log: dict | None) -> dict | None:
        """The detector's card fields, after what fitting logged about it (`fit_log`)."""
        return _detector_card(self.novelty, self.novelty_alpha, fit_log, "novelty")

    @classmethod
    def load(cls, folder: str | Path | None = None, actor_fingerprint: str | None = None,
             drop_image_check: bool = False, prepare: bool = True) -> Heads:
        """The heads in `folder` (default: the embedded ones). Heads whose rule includes the
        retired image check are refused (`RetiredImageCheck`) unless `drop_image_check`:
        only for a caller that replaces their detectors (`dualread fit-detectors`).
        `prepare=False`: the detector's scoring caches are left to its first score (for a
        caller that only checks the heads or replaces the detector)."""
        folder = Path(folder) if folder else EMBEDDED_HEADS
        card_path = folder / "heads_card.json"
        if not card_path.exists():
            raise FileNotFoundError(f"no heads at {folder} (expected heads_card.json)")
        card = json.loads(card_path.read_text())
        version = int(card.get("card_version", 1))
        if version > CARD_VERSION:
            raise CardTooNew(
                f"heads in {folder} have card version {version}, newer than this code reads "
                f"(up to {CARD_VERSION}): it could drop parts of their defer rule; upgrade "
                "dualread or load heads fitted by this version")
        if actor_fingerprint is not None and card["actor_fingerprint"] != actor_fingerprint \
                and not _legacy_match(card, actor_fingerprint, folder):
            raise FingerprintMismatch(
                f"heads in {folder} were fitted for actor {card['actor_fingerprint']}, "
                f"not for the loaded actor {actor_fingerprint}; refit with `dualread fit-heads`")
        if not drop_image_check:
            refuse_image_check(card, folder)
        heads = cls.new(int(card["feature_dim"]))
        state = load_file(str(folder / "heads.safetensors"))
        stored = {k.split(".", 1)[0] for k in state}
        # a registered method whose reader this artefact lacks is simply not available
        heads.readers = {n: r for n, r in heads.readers.items() if n in stored}
        for name, reader in heads.readers.items():
            reader.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()
                                    if k.startswith(name + ".")})
            reader.eval()
        heads.temperatures = {LEGACY_TEMPERATURES.get(k, k): float(v)
                              for k, v in card.get("temperatures", {}).items()}
        heads.platt = card.get("platt", {})
        heads.offsets = dict(card.get("prior_offsets", {}))
        heads.policy = DeferPolicy(**card["defer"]) if card.get("defer") else None
        heads.kappa = card.get("kappa", KAPPA)
        # older artefacts have no detector: novelty stays None, the rule is τ alone
        if card.get("novelty"):
            heads.novelty = load_detector(folder)
            if prepare:       # its scoring caches now, not on the first request
                heads.novelty = heads.novelty.prepare()
            heads.novelty_alpha = float(card["novelty"].get("alpha", ALPHA))
        heads.actor_fingerprint = card["actor_fingerprint"]
        heads.card = card
        return heads
