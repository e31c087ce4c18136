"""Novelty score on the actor's states, turned into a conformal p-value (docs/method.md §8).

Fitted on clean reader-split features, calibrated on a disjoint clean split of n items:
    p(x) = (1 + #{i : s_i ≥ s(x)}) / (n + 1)
For a clean input exchangeable with the calibration split, P[p ≤ α] ≤ α, whatever the score.
The defer rule it feeds is `defer = p_DR < τ or p(x) < α`.

Scores (larger = more unusual), on features standardised with fitting-split statistics:
- `mahalanobis`: distance under a Ledoit–Wolf shrunk covariance;
- `knn`: distance to the k-th nearest fitting item;
- `token_knn`: for token sets [M, D] (image-token states), the largest distance of any token
  to its nearest fitting token (a patch-level score: one odd region is enough);
- `logistic`: the decision function of a logistic regression fitted to tell the clean
  fitting features from corrupted ones (e.g. generic corruptions, models.shift). Only the
  score is learned from shifted data; the p-value is still calibrated on clean data alone,
  so its validity for clean inputs does not depend on which corruptions were used.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from heads.conformal import kth_distance, p_values

KINDS = ("mahalanobis", "knn", "token_knn", "logistic")
LOGISTIC_C = 0.1           # inverse L2 strength on standardised features
ALPHA = 0.01
MAX_BANK = 50_000          # fitting tokens kept for token_knn (a deterministic subsample)
SAME_SCORE = 1e-5          # relative: a calibration item's score read again (clean_sample)

SHIPPED_KIND, SHIPPED_FEATURE = "logistic", "pre_img_mean_std"   # docs/shift-study


def _img_mean(f: dict[str, torch.Tensor]) -> torch.Tensor:
    # heads.features.extract stores the pooled states; the study's sets keep `h_image`
    return f["img_mean"] if "img_mean" in f else f["h_image"].mean(1)


def _img_std(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["img_std"] if "img_std" in f else f["h_image"].std(1)


# Named feature maps from a feature dict: heads.features.extract (`img_mean`, `img_std`),
# or the study's sets with `h_image` [N, M, D] (the token-level maps need it).
FEATURES: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "h_pre": lambda f: f["h_pre"],
    "h_close": lambda f: f["h_close"],
    "h_mid": lambda f: f["h_mid"],
    "img_mean": _img_mean,
    "img_std": _img_std,
    "img_mean_std": lambda f: torch.cat([_img_mean(f), _img_std(f)], -1),
    "pre_img_mean": lambda f: torch.cat([f["h_pre"], _img_mean(f)], -1),
    "pre_img_mean_std": lambda f: torch.cat([f["h_pre"], _img_mean(f), _img_std(f)], -1),
    "img_tokens": lambda f: f["h_image"].flatten(1),
    # [N, TOKEN_SLOTS, D] image-token states, NaN rows where an image has fewer tokens
    # (heads.features.extract_many), for `token_knn`
    "img_token_slots": lambda f: f["img_tokens"],
    # not the actor's states: a vector computed from the image's pixels, stored as "pixels"
    "pixels": lambda f: f["pixels"],
    "img_token_set": lambda f: f["h_image"],
    # patch descriptors of the decoded image (heads.pixel_novelty), [N, P, D]
    "pixel_patches": lambda f: f["pixel_patches"],
}

# Features read from the decoded image rather than the actor's states, by name: the function
# that computes them from a list of images. A module defining a part that reads the image
# registers its feature (heads.layout_novelty); the pixel part's is `pixel_patches`.
IMAGE_FEATURES: dict[str, Callable[[Sequence], torch.Tensor]] = {}


def features(name: str, feats: dict[str, torch.Tensor]) -> torch.Tensor:
    if name not in FEATURES:
        raise ValueError(f"unknown novelty feature {name!r}; known: {', '.join(FEATURES)}")
    return FEATURES[name](feats).double()


@dataclass(frozen=True)
class NoveltyReading:
    """One input's novelty: its score, conformal p-value and whether p < α."""

    score: float
    p_value: float
    novel: bool


class Novelty:
    def __init__(self, kind: str = "mahalanobis", feature: str = "img_mean", k: int = 5,
                 max_bank: int = MAX_BANK) -> None:
        if kind not in KINDS:
            raise ValueError(f"novelty kind must be one of {KINDS}")
        self.kind, self.feature, self.k, self.max_bank = kind, feature, k, max_bank
        self.t: dict[str, torch.Tensor] = {}      # mean, scale, precision | bank, calibration
        self.n_fit = 0

    # ------------------------------------------------------------------ fitting
    def fit(self, x: torch.Tensor, x_shifted: torch.Tensor | None = None,
            min_scale: torch.Tensor | None = None) -> Novelty:
        """Fit on clean features: [N, D], or [N, M, D] token sets for `token_knn`;
        `logistic` also needs corrupted features `x_shifted` [N', D]. `min_scale` [D]:
        the smallest standardisation scale of each feature (default 1e-6)."""
        x = torch.as_tensor(x).double()
        if (x_shifted is None) == (self.kind == "logistic"):
            raise ValueError("logistic needs x_shifted; the other kinds take clean data only")
        if (x.dim() == 3) != (self.kind == "token_knn"):
            raise ValueError(f"{self.kind} takes {'[N, M, D]' if x.dim() == 2 else '[N, D]'}"
                             " features")
        self.n_fit = len(x)
        flat = x.reshape(-1, x.shape[-1])
        flat = flat[~flat.isnan().any(-1)]          # empty token slots
        self.t["mean"] = flat.mean(0)
        self.t["scale"] = flat.std(0).clamp_min(1e-6)
        if min_scale is not None:
            self.t["scale"] = torch.maximum(self.t["scale"], torch.as_tensor(min_scale).double())
        z = self._std(flat)
        if self.kind == "mahalanobis":
            from sklearn.covariance import LedoitWolf

            lw = LedoitWolf().fit(z.numpy())
            self.t["location"] = torch.from_numpy(lw.location_)
            self.t["precision"] = torch.from_numpy(lw.precision_)
        elif self.kind == "logistic":
            from sklearn.linear_model import LogisticRegression

            zs = self._std(torch.as_tensor(x_shifted).double())
            y = np.r_[np.zeros(len(z)), np.ones(len(zs))]
            lr = LogisticRegression(C=LOGISTIC_C, max_iter=5000).fit(
                torch.cat([z, zs]).numpy(), y)
            self.t["coef"] = torch.from_numpy(lr.coef_[0].copy())
            self.t["intercept"] = torch.from_numpy(lr.intercept_.copy())
        else:
            self.t["bank"] = self._capped(z)
        return self

    def _capped(self, z: torch.Tensor) -> torch.Tensor:
        """A `token_knn` bank of at most `max_bank` rows (a deterministic subsample)."""
        if self.kind != "token_knn" or len(z) <= self.max_bank:
            return z
        keep = np.random.default_rng(0).choice(len(z), self.max_bank, replace=False)
        return z[np.sort(keep)]

    def extend_bank(self, x: torch.Tensor) -> Novelty:
        """Add in-distribution examples (features as `fit` takes them) to the reference
        bank of a `knn` / `token_knn` detector, in place; the standardisation and the
        conformal reference stay as they are. A larger bank can only lower a score, so
        for inputs like the calibration split the p-value stays valid (conservative):
        P[p ≤ α] ≤ α still holds. The bank stays within `max_bank` rows."""
        if self.kind not in ("knn", "token_knn"):
            raise ValueError(f"{self.kind} has no reference bank to extend")
        x = torch.as_tensor(x).double()
        flat = x.reshape(-1, x.shape[-1])
        flat = flat[~flat.isnan().any(-1)]
        self.t["bank"] = self._capped(torch.cat([self.t["bank"], self._std(flat)]))
        return self.prepare()

    def prepare(self) -> Novelty:
        """Build now what scoring reads from the bank (kept until the bank changes), so
        that the first score costs what later ones do: `Heads.load` calls it, and
        `extend_bank` after replacing the bank."""
        if "bank" in self.t:
            if self.kind == "knn":
                self._bank_norms()
            elif self.kind == "token_knn":
                self._bank32()
        return self

    def calibrate(self, x_cal: torch.Tensor) -> Novelty:
        """Scores of a clean split disjoint from the fitting one (the conformal reference)."""
        self.t["calibration"] = torch.from_numpy(np.sort(self.score(x_cal)))
        return self

    def recalibrated(self, x_cal: torch.Tensor) -> Novelty:
        """A copy with the same fit and another conformal reference (this one unchanged)."""
        other = Novelty(self.kind, self.feature, self.k, self.max_bank)
        other.n_fit, other.t = self.n_fit, dict(self.t)
        return other.calibrate(x_cal)

    def extend_reference(self, scores: np.ndarray) -> ExtendedReference:
        """This detector with a second conformal reference: the scores of a stream that
        labelled feedback re-certified (`heads.recert`). This one is unchanged."""
        return ExtendedReference(self, scores)

    def clean_scores(self) -> np.ndarray | None:
        """The clean calibration split's scores (drift's reference for this detector)."""
        cal = self.t.get("calibration")
        return None if cal is None else cal.numpy()

    def p_values_of(self, scores: np.ndarray) -> np.ndarray:
        """Conformal p-values of scores already computed (by another process, say)."""
        return p_values(self.t["calibration"].numpy(), scores, presorted=True)

    # ------------------------------------------------------------------ scoring
    def _std(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.t["mean"]) / self.t["scale"]

    def score(self, x: torch.Tensor) -> np.ndarray:
        x = torch.as_tensor(x).double()
        z = self._std(x)
        if self.kind == "mahalanobis":
            d = z - self.t["location"]
            return torch.einsum("nd,de,ne->n", d, self.t["precision"], d).clamp_min(0).sqrt(
            ).numpy()
        if self.kind == "knn":
            return kth_distance(z.numpy(), self.t["bank"].numpy(), self.k, self._bank_norms())
        if self.kind == "logistic":
            return (z @ self.t["coef"] + self.t["intercept"]).numpy()
        n, m, dim = z.shape
        flat = z.reshape(-1, dim)
        real = ~flat.isnan().any(-1)               # NaN rows: empty token slots
        d = torch.full((len(flat),), -np.inf, dtype=flat.dtype)
        d[real] = self._nearest(flat[real], 1)
        # the most unusual token; an item without any token gets -inf (never flags)
        return d.reshape(n, m).max(1).values.numpy()

    def _bank32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bank in float32 and its squared norms, kept until the bank changes (a
        conversion per call cost more than the distances of one item)."""
        bank = self.t["bank"]
        cached = getattr(self, "_b32", None)
        if cached is None or cached[0] is not bank:
            b = bank.float().contiguous()
            cached = self._b32 = (bank, b, (b * b).sum(1))
        return cached[1], cached[2]

    def _bank_norms(self) -> np.ndarray:
        """The float64 bank's squared row norms (`knn`), kept until the bank changes
        (computing them cost several times one row's distances)."""
        bank = self.t["bank"]
        cached = getattr(self, "_b2", None)
        if cached is None or cached[0] is not bank:
            b = bank.numpy()
            cached = self._b2 = (bank, (b * b).sum(1))
        return cached[1]

    def _nearest(self, z: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
        """Distance of each row to its k-th nearest bank row (|a|² + |b|² − 2a·b, one
        matrix product per chunk; in float32, which halves the cost on CPUs)."""
        bank, b2 = self._bank32()
        out = []
        for s in range(0, len(z), chunk):
            a = z[s: s + chunk].float()
            # (|a|² + |b|²) − 2a·b in place: the same roundings as the expression written
            # out (2a·b is exact), without its two temporaries of [rows, bank]
            d2 = ((a * a).sum(1, keepdim=True) + b2).sub_((a @ bank.T).mul_(2.0))
            best = d2.amin(1) if k == 1 else d2.topk(k, 1, largest=False).values[:, -1]
            out.append(best.clamp_min(0).sqrt().double())
        return torch.cat(out) if out else torch.zeros(0, dtype=z.dtype)

    def p_value(self, x: torch.Tensor) -> np.ndarray:
        if "calibration" not in self.t:
            raise RuntimeError("calibrate on a clean split before asking for p-values")
        return p_values(self.t["calibration"].numpy(), self.score(x), presorted=True)

    def novel(self, x: torch.Tensor, alpha: float = ALPHA) -> np.ndarray:
        return self.p_value(x) < alpha

    def read(self, feats: dict[str, torch.Tensor], alpha: float = ALPHA
             ) -> list[NoveltyReading]:
        """Score, p-value and flag of each row of a feature dict (`extract`'s keys)."""
        if "calibration" not in self.t:
            raise RuntimeError("calibrate on a clean split before asking for p-values")
        s = self.score(features(self.feature, feats))
        p = p_values(self.t["calibration"].numpy(), s, presorted=True)
        return [NoveltyReading(float(a), float(b), bool(b < alpha)) for a, b in zip(s, p)]

    # ------------------------------------------------------------------ artefacts
    def to_dict(self) -> dict:
        return {"kind": self.kind, "feature": self.feature, "k": self.k, "n_fit": self.n_fit,
                "n_calibration": len(self.t.get("calibration", ())),
                "C": LOGISTIC_C if self.kind == "logistic" else None,
                "p_value": "(1 + #{i : s_i >= s(x)}) / (n + 1)"}

    def save(self, folder: str | Path, prefix: str = "novelty") -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.t.items()},
                  str(folder / f"{prefix}.safetensors"))
        (folder / f"{prefix}.json").write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, folder: str | Path, prefix: str = "novelty") -> Novelty:
        folder = Path(folder)
        d = json.loads((folder / f"{prefix}.json").read_text())
        nov = cls(d["kind"], d["feature"], d["k"])
        nov.n_fit = d["n_fit"]
        nov.t = dict(load_file(str(folder / f"{prefix}.safetensors")))
        if "calibration" in nov.t:      # p-values search it as sorted: make sure it is
            nov.t["calibration"] = nov.t["calibration"].sort().values
        return nov


def _in_calibration(cal: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(whether each score is one of the sorted calibration scores `cal`, the index of the
    first calibration score ≥ it). A score read again may differ in the last float32 bits
    (the bank's distances are float32 products, chunked by batch): equal within SAME_SCORE."""
    tol = np.where(np.isfinite(s), SAME_SCORE * (1.0 + np.abs(s)), 0.0)
    lo = np.searchsorted(cal, s - tol, side="left")
    return np.searchsorted(cal, s + tol, side="right") > lo, lo


class ExtendedReference:
    """A detector whose input is in-distribution when it looks like the fitting data *or*
    like a re-certified stream: p = max(p against the clean calibration split, p against
    the stream's scores). Each p-value is valid for its own population, so the flag rate
    stays ≤ α for clean inputs and for inputs exchangeable with the stream's window (a
    pooled reference would instead flag a stream's upper tail at the rate of its share of
    the pool). Reads as the detector it wraps otherwise."""

    def __init__(self, base: Novelty, scores: np.ndarray) -> None:
        self.base = base
        self.extra = np.sort(np.asarray(scores, float))

    def __getattr__(self, name: str):
        return getattr(self.__dict__["base"], name)

    def extend_reference(self, scores: np.ndarray) -> ExtendedReference:
        return ExtendedReference(self.base, np.r_[self.extra, np.asarray(scores, float)])

    def prepare(self) -> ExtendedReference:
        """The base's scoring caches built (`Novelty.prepare`); this detector, not the base
        alone, is returned (forwarded, the stream's reference would be dropped)."""
        self.base.prepare()
        return self

    def p_values_of(self, scores: np.ndarray) -> np.ndarray:
        s = np.asarray(scores, float)
        return np.maximum(self.base.p_values_of(s), p_values(self.extra, s, presorted=True))

    def p_value(self, x: torch.Tensor) -> np.ndarray:
        return self.p_values_of(self.base.score(x))

    def novel(self, x: torch.Tensor, alpha: float = ALPHA) -> np.ndarray:
        return self.p_value(x) < alpha

    def read(self, feats: dict[str, torch.Tensor], alpha: float = ALPHA
             ) -> list[NoveltyReading]:
        s = np.array([r.score for r in self.base.read(feats, alpha)])
        return [NoveltyReading(float(a), float(b), bool(b < alpha))
                for a, b in zip(s, self.p_values_of(s))]


# ------------------------------------------------------------------ several detectors
class CompositeNovelty:
    """Several conformal detectors read as one (docs/method.md §8): each part has its own score and
    clean calibration split; the combined p-value is the Bonferroni one,
        p(x) = min(1, m · min_j p_j(x))     (m parts),
    so for a clean input P[p ≤ α] ≤ Σ_j P[p_j ≤ α/m] ≤ α: the parts together add at most
    α of clean deferral. The shipped parts (heads.fit) are `image` (patch-level: the
    largest distance of any image token to its nearest token of the fitting images) and
    `question` (the prompt state's distance to its nearest fitting prompt state)."""

    kind = "composite"

    def __init__(self, parts: dict[str, Novelty], clean: np.ndarray | None = None) -> None:
        if not parts:
            raise ValueError("a composite detector needs at least one part")
        self.parts = dict(parts)
        # a clean sample of the combined score (`keep_clean_sample`): drift's reference
        self.clean = None if clean is None else np.sort(np.asarray(clean, float))

    @property
    def feature(self) -> str:
        return "+".join(p.feature for p in self.parts.values())

    @property
    def n_fit(self) -> int:
        return max(p.n_fit for p in self.parts.values())

    @property
    def t(self) -> dict[str, torch.Tensor]:
        # the calibration size callers read (`len(t["calibration"])`): the smallest part's
        small = min(self.parts.values(), key=lambda p: len(p.t.get("calibration", ())))
        return small.t

    def part_p_values(self, feats: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Each part's own p-value of every row of a feature dict."""
        out = {}
        for name, part in self.parts.items():
            if "calibration" not in part.t:
                raise RuntimeError("calibrate on a clean split before asking for p-values")
            out[name] = part.p_value(features(part.feature, feats))
        return out

    def p_values(self, feats: dict[str, torch.Tensor]) -> np.ndarray:
        each = self.part_p_values(feats)
        return np.minimum(1.0, len(self.parts) * np.min(np.stack(list(each.values())), 0))

    def read(self, feats: dict[str, torch.Tensor], alpha: float = ALPHA
             ) -> list[NoveltyReading]:
        """The combined reading of each row; its score is −log10 of the combined p-value
        (larger = more unusual)."""
        p = self.p_values(feats)
        return [NoveltyReading(float(-np.log10(v)), float(v), bool(v < alpha)) for v in p]

    def prepare(self) -> CompositeNovelty:
        """Build each part's scoring caches now (`Novelty.prepare`)."""
        for part in self.parts.values():
            part.prepare()
        return self

    def extend_bank(self, feats: dict[str, torch.Tensor],
                    parts: tuple[str, ...] | None = None) -> CompositeNovelty:
        """Add in-distribution rows (a feature dict, `extract`'s keys) to the reference
        bank of the named parts (default: every part), in place (`Novelty.extend_bank`).
        Re-certification adds a window's accepted images this way; `save` persists it."""
        for name in parts if parts is not None else tuple(self.parts):
            part = self.parts[name]
            part.extend_bank(features(part.feature, feats))
        return self

    def p_values_of(self, scores: np.ndarray) -> np.ndarray:
        """The combined p-values of scores already read (a reading's score is −log10 p)."""
        return np.minimum(1.0, 10.0 ** -np.asarray(scores, float))

    def extend_reference(self, scores: np.ndarray) -> ExtendedReference:
        """This detector with a second conformal reference, the combined scores of a stream
        that labelled feedback re-certified (`heads.recert`); this one is unchanged."""
        return ExtendedReference(self, scores)

    def clean_sample(self, feats: dict[str, torch.Tensor]) -> np.ndarray:
        """The combined score of each row of a feature dict whose rows are clean
        calibration items, each part's p-value taken leave-one-out: a row whose part score
        is in that part's calibration split (within SAME_SCORE) is judged against the split
        without it, #{i : s_i ≥ s} / n (its own copy counted once), any other row as a fresh
        input, (1 + #{i : s_i ≥ s}) / (n + 1). Either way the p-value is distributed as a fresh
        clean input's is, so the sample is distributed as a clean input's combined score
        (−log10 p), with the parts' dependence kept (each row's parts are read together)."""
        each = []
        for part, s in zip(self.parts.values(), self._part_scores(feats).values()):
            cal = part.t["calibration"].numpy()
            n = len(cal)
            own, lo = _in_calibration(cal, s)
            fresh = n - np.searchsorted(cal, s, side="left")
            each.append(np.where(own, (n - lo) / n, (1 + fresh) / (n + 1)))
        p = np.minimum(1.0, len(self.parts) * np.min(np.stack(each), 0))
        return -np.log10(p)

    def _part_scores(self, feats: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        out = {}
        for name, part in self.parts.items():
            if "calibration" not in part.t:
                raise RuntimeError("calibrate on a clean split before a clean sample")
            out[name] = part.score(features(part.feature, feats))
        return out

    def calibration_share(self, feats: dict[str, torch.Tensor]) -> dict[str, float]:
        """For each part, the share of rows whose score is one of its calibration scores
        (1.0 for each part when `feats` are the rows it was calibrated on, read as then)."""
        return {name: float(_in_calibration(self.parts[name].t["calibration"].numpy(), s)[0]
                            .mean()) for name, s in self._part_scores(feats).items()}

    def keep_clean_sample(self, feats: dict[str, torch.Tensor]) -> CompositeNovelty:
        """Store `clean_sample(feats)` with the detector (`save` writes it)."""
        self.clean = np.sort(self.clean_sample(feats))
        return self

    def clean_scores(self) -> np.ndarray | None:
        """The stored clean sample of the combined score (drift's reference for this
        detector); None when the artefact has none (fitted before it was kept, or its
        parts changed since)."""
        return self.clean

    def _parts_digest(self) -> str:
        """What the clean sample depends on: each part's name and calibration scores."""
        h = hashlib.sha256()
        for name, part in sorted(self.parts.items()):
            h.update(name.encode())
            h.update(part.t["calibration"].numpy().astype("<f8").tobytes()
                     if "calibration" in part.t else b"-")
        return h.hexdigest()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "feature": self.feature, "k": None, "n_fit": self.n_fit,
                "n_calibration": min(len(p.t.get("calibration", ()))
                                     for p in self.parts.values()),
                "C": None, "p_value": "min(1, m * min_j p_j), p_j = (1 + #{i : s_i >= s(x)})"
                                      " / (n_j + 1)",
                "parts": {name: p.to_dict() for name, p in self.parts.items()},
                "n_clean_sample": None if self.clean is None else len(self.clean)}

    def save(self, folder: str | Path, prefix: str = "novelty") -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, part in self.parts.items():
            part.save(folder, f"{prefix}.{name}")
        self.save_clean_sample(folder, prefix)
        (folder / f"{prefix}.json").write_text(json.dumps(self.to_dict(), indent=2))

    @property
    def reads_pixels(self) -> bool:
        """Whether a part reads the decoded image (`heads.pixel_novelty`,
        `heads.layout_novelty`): its callers then add what it reads to the feature dict
        (`image_features`)."""
        return bool(self.image_features)

    @property
    def image_features(self) -> tuple[str, ...]:
        """The features its parts read from the decoded image, in part order."""
        return tuple(p.feature for p in self.parts.values()
                     if p.feature == "pixel_patches" or p.feature in IMAGE_FEATURES)

    def save_clean_sample(self, folder: str | Path, prefix: str = "novelty") -> None:
        """`{prefix}.safetensors`: the clean sample, with a digest of the parts' calibration
        it was read against (`load_parts` drops a sample whose parts changed since)."""
        path = Path(folder) / f"{prefix}.safetensors"
        if self.clean is None:
            path.unlink(missing_ok=True)
            return
        save_file({"clean_scores": torch.from_numpy(np.ascontiguousarray(self.clean))},
                  str(path), metadata={"parts_digest": self._parts_digest()})

    @classmethod
    def load_parts(cls, folder: Path, prefix: str, names: list[str]) -> CompositeNovelty:
        det = cls({n: load_part(folder, f"{prefix}.{n}") for n in names})
        path = Path(folder) / f"{prefix}.safetensors"
        if path.exists():
            with safe_open(str(path), "pt") as f:
                digest = (f.metadata() or {}).get("parts_digest")
                if digest == det._parts_digest():
                    det.clean = f.get_tensor("clean_scores").numpy()
                else:
                    warnings.warn(f"{path.name}: the clean sample of the combined novelty "
                                  "score was read against other parts; ignored (drift has "
                                  "no reference for it until `dualread fit-detectors`)",
                                  stacklevel=2)
        return det


# Part classes other than `Novelty`, by the kind their card names; a module defining one
# registers it here (heads.pixel_novelty: "pixel_knn"), so this module imports none of them.
PART_CLASSES: dict[str, type[Novelty]] = {}


def check_descriptors(part: Novelty, folder: str | Path, prefix: str, described: dict,
                      dim: int, what: str) -> Novelty:
    """`part` if its card records the descriptors `described` (this code's side, stride,
    descriptor text) and its bank rows are `dim` wide; otherwise ValueError naming each
    mismatch: its bank and calibration scores would be compared, silently, with
    descriptors of another kind. `what`: "pixel" or "layout"."""
    card = json.loads((Path(folder) / f"{prefix}.json").read_text())
    wrong = [f"{k}: the part records {card.get(k, 'nothing')!r}, this code computes {v!r}"
             for k, v in described.items() if card.get(k) != v]
    bank = part.t.get("bank")
    if bank is not None and (bank.dim() != 2 or bank.shape[1] != dim):
        wrong.append(f"bank: rows of {list(bank.shape[1:])} values, this code describes "
                     f"by {dim}")
    if wrong:
        raise ValueError(f"{what} novelty part {prefix} in {folder} was fitted with other "
                         "descriptors; refit it (`dualread fit-detectors`). " + "; ".join(wrong))
    return part


class ImagePart(Novelty):
    """A part that reads the decoded image (`heads.pixel_novelty`, `heads.layout_novelty`):
    its inputs' units are fixed by design (colours in [0, 1], counts, shares), so they are
    not standardised (mean 0, scale 1), and its card records the descriptors it was fitted
    with, checked at load. A subclass sets the class constants below and `_bank_rows`
    (the bank rows fitting inputs give) and `_capped` (the bank kept within `max_bank`)."""

    KIND = FEATURE = WHAT = INPUT = ""      # kind, feature, "pixel", "[N, D] vectors"
    NDIM = 2                                # dims of a batch of inputs
    DIM = 0                                 # width of a bank row
    MAX_BANK = 0
    DESCRIBED: dict = {}

    def __init__(self, kind: str | None = None, feature: str | None = None, k: int = 1,
                 max_bank: int | None = None) -> None:
        if (kind or self.KIND) != self.KIND:
            raise ValueError(f"a {self.WHAT} novelty part is of kind {self.KIND!r}")
        self.kind, self.feature, self.k = self.KIND, feature or self.FEATURE, k
        self.max_bank = self.MAX_BANK if max_bank is None else max_bank
        self.t: dict[str, torch.Tensor] = {}
        self.n_fit = 0

    def _bank_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _capped(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fit(self, x: torch.Tensor, x_shifted: torch.Tensor | None = None,
            min_scale: torch.Tensor | None = None) -> ImagePart:
        x = torch.as_tensor(x).double()
        if x.dim() != self.NDIM or x_shifted is not None:
            raise ValueError(f"a {self.WHAT} novelty part takes clean {self.INPUT} only")
        self.n_fit = len(x)
        dim = x.shape[-1]
        self.t["mean"] = torch.zeros(dim, dtype=torch.float64)
        self.t["scale"] = torch.ones(dim, dtype=torch.float64)
        self.t["bank"] = self._capped(self._bank_rows(x))
        return self

    def recalibrated(self, x_cal: torch.Tensor) -> ImagePart:
        other = type(self)(self.kind, self.feature, self.k, self.max_bank)
        other.n_fit, other.t = self.n_fit, dict(self.t)
        return other.calibrate(x_cal)

    def to_dict(self) -> dict:
        return {**super().to_dict(), **self.DESCRIBED,
                "bank": int(self.t["bank"].shape[0]) if "bank" in self.t else 0}

    @classmethod
    def load(cls, folder: str | Path, prefix: str = "novelty") -> ImagePart:
        """A saved part; refused when its card records descriptors other than this code
        computes (`check_descriptors`)."""
        return check_descriptors(super().load(folder, prefix), folder, prefix,
                                 cls.DESCRIBED, cls.DIM, cls.WHAT)


def load_part(folder: Path, prefix: str) -> Novelty:
    """One saved part, of the class its kind names (the pixel part is `PixelNovelty`)."""
    kind = json.loads((Path(folder) / f"{prefix}.json").read_text())["kind"]
    return PART_CLASSES.get(kind, Novelty).load(folder, prefix)


def load_detector(folder: str | Path, prefix: str = "novelty") -> Novelty | CompositeNovelty:
    """A detector saved by `Novelty.save` or `CompositeNovelty.save`."""
    folder = Path(folder)
    d = json.loads((folder / f"{prefix}.json").read_text())
    if d["kind"] == CompositeNovelty.kind:
        return CompositeNovelty.load_parts(folder, prefix, list(d["parts"]))
    return Novelty.load(folder, prefix)
