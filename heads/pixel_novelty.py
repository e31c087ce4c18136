"""Patch-level novelty on the pixels (PatchCore-style), a part of the defer rule's detector.

The actor's image-token states place an unseen colour or shape where a known one is
(docs/defer/design.md), so this part reads the image itself. Each image is brought to the
fitting side (`SIDE`) and described at every `STRIDE`-th pixel by a small vector:
- the mean colour over a 3×3 and over an 11×11 window (what is there, and what is next to
  it: two objects side by side give a mixture no single object does);
- a histogram of gradient orientations (angle mod π, magnitude-weighted, every colour
  channel voting) over a 5×5 and an 11×11 window (the local outline: corners and edge
  directions of the shapes seen in fitting).
The score of an image is the largest distance of any of its descriptors to the nearest
descriptor of a bank built from the fitting images and benign re-encodings of them
(coreset-subsampled: greedy k-centre keeps the rare edge patches a random subsample would
drop). A conformal p-value on clean calibration images makes it a part like the others
(`heads.novelty.CompositeNovelty`). Nothing here knows a palette or a shape list: what is
far is whatever the fitting images never showed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from heads.novelty import FEATURES, PART_CLASSES, ImagePart

PIXEL_FEATURE = "pixel_patches"
KIND = "pixel_knn"
SIDE = 64             # descriptors are read at this side (easy-VQA's; the card records it)
STRIDE = 2
BINS = 8              # orientation bins over [0, π)
COLOUR_WINDOWS = (3, 11)
GRADIENT_WINDOWS = (5, 11)
GRADIENT_WEIGHT = 2.0  # gradient votes (a step edge ≈ 0.5 a pixel) against colours in [0, 1]
PIXEL_BANK = 8_000     # descriptors kept in the bank (coreset)
CHUNK = 128           # images described at once
CORESET_POOL = 80_000  # descriptors the coreset is chosen from (a deterministic subsample)
DIM = 3 * len(COLOUR_WINDOWS) + BINS * len(GRADIENT_WINDOWS)

# what a saved part records of its descriptors; `PixelNovelty.load` refuses any other
DESCRIBED = {"side": SIDE, "stride": STRIDE,
             "descriptor": f"mean colour over {COLOUR_WINDOWS} px windows, orientation "
                           f"histograms ({BINS} bins) over {GRADIENT_WINDOWS} px windows"}

# the composite detector reads this part's input from a feature dict like the others
FEATURES.setdefault(PIXEL_FEATURE, lambda f: f[PIXEL_FEATURE])


def _as_tensor(image: Image.Image, side: int) -> torch.Tensor:
    im = image.convert("RGB")
    if im.size != (side, side):
        im = im.resize((side, side), Image.BILINEAR)
    return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)


def _box(x: torch.Tensor, k: int, stride: int = 1) -> torch.Tensor:
    """Mean over a k×k window at every `stride`-th pixel (edges replicated): sums along
    the columns then the rows, each only where it is kept. Each window is summed in one
    fixed order, so equal windows give equal means wherever they are (`distinct_rows`
    and the score rely on that); a k×k `avg_pool2d` at every pixel, then subsampled, was
    nine tenths of the descriptors' cost (its CPU kernel does not vectorise small
    windows). The same means up to float rounding."""
    p = k // 2
    x = F.pad(x, (p, p, p, p), mode="replicate")
    h, w = x.shape[-2] - 2 * p, x.shape[-1] - 2 * p
    return _window_sum(_window_sum(x, k, stride, h, -2), k, stride, w, -1) / (k * k)


def _window_sum(x: torch.Tensor, k: int, stride: int, n: int, dim: int) -> torch.Tensor:
    """Sums of k consecutive entries along `dim` (-2 or -1) of a padded x, at every
    `stride`-th of its first n positions: k views added one after the other. x is first
    split by phase along `dim` (entries stride·j + s, each phase contiguous), so each view
    is a contiguous block of one phase rather than a strided view of x, which halved the
    adds' cost; the same adds in the same order, so the same sums bit for bit."""
    m = -(-n // stride)                                  # positions kept
    phases = [(x[..., s::stride, :] if dim == -2 else x[..., s::stride]).contiguous()
              for s in range(min(stride, k))]
    out = None
    for i in range(k):
        v = phases[i % stride].narrow(dim, i // stride, m)     # entries i + stride·r
        out = v.clone() if out is None else out.add_(v)
    return out


def _sobel(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sobel gradients (x, y; kernel [[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]] / 8) of maps
    padded by one pixel, from shifted views: elementwise, so equal neighbourhoods give
    equal gradients, and cheaper than a convolution call on a small image."""
    h, w = p.shape[-2] - 2, p.shape[-1] - 2

    def at(dy: int, dx: int) -> torch.Tensor:
        return p[..., dy:dy + h, dx:dx + w]

    gx = ((at(0, 2) - at(0, 0)) + 2.0 * (at(1, 2) - at(1, 0)) + (at(2, 2) - at(2, 0))) / 8.0
    gy = ((at(2, 0) - at(0, 0)) + 2.0 * (at(2, 1) - at(0, 1)) + (at(2, 2) - at(0, 2))) / 8.0
    return gx, gy


def descriptor_maps(x: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """Descriptors [N, DIM, H', W'] at every `stride`-th pixel of images [N, 3, H, W] in
    [0, 1] (H' = ⌈H / stride⌉)."""
    n, c, h, w = x.shape
    gx, gy = _sobel(F.pad(x, (1, 1, 1, 1), mode="replicate"))
    mag = (gx * gx + gy * gy).sqrt()
    ang = torch.atan2(gy, gx) % np.pi                       # an edge's direction, sign-free
    pos = ang / np.pi * BINS - 0.5                          # soft binning between neighbours
    lo = pos.floor()
    frac = pos - lo
    lo = lo.long()
    votes = torch.zeros(n, BINS, h, w)            # every colour channel votes in one map
    votes.scatter_add_(1, lo % BINS, mag * (1 - frac))
    votes.scatter_add_(1, (lo + 1) % BINS, mag * frac)
    votes = votes * GRADIENT_WEIGHT
    # colours and votes that share a window are boxed in one pass
    boxed = {}
    for k in sorted(set(COLOUR_WINDOWS) | set(GRADIENT_WINDOWS)):
        parts = [v for v, ks in ((x, COLOUR_WINDOWS), (votes, GRADIENT_WINDOWS)) if k in ks]
        boxed[k] = _box(torch.cat(parts, 1), k, stride).split([v.shape[1] for v in parts], 1)
    return torch.cat([boxed[k][0] for k in COLOUR_WINDOWS]
                     + [boxed[k][-1] for k in GRADIENT_WINDOWS], 1)


def pixel_descriptors(images: Sequence[Image.Image], side: int = SIDE,
                      stride: int = STRIDE) -> torch.Tensor:
    """Patch descriptors [N, P, DIM] of decoded images, P = (side / stride)²."""
    if not images:
        return torch.zeros(0, (side // stride) ** 2, DIM)
    out = []
    # in chunks: the full-resolution maps are stride² times the kept descriptors, so a
    # fit or evaluation over thousands of images would hold gigabytes of them at once
    for i in range(0, len(images), CHUNK):
        x = torch.stack([_as_tensor(im, side) for im in images[i:i + CHUNK]])
        # several questions on one image (an evaluation's items): each described once
        first: dict[bytes, int] = {}
        rows = torch.tensor([first.setdefault(im.numpy().tobytes(), k)
                             for k, im in enumerate(x)])
        keep = torch.tensor(sorted(set(rows.tolist())))
        d = descriptor_maps(x[keep], stride)
        d = d.flatten(2).transpose(1, 2).contiguous()
        out.append(d[torch.searchsorted(keep, rows)] if len(keep) < len(x) else d)
    return torch.cat(out)


def with_pixels(feats: dict[str, torch.Tensor], images: Sequence[Image.Image],
                side: int = SIDE) -> dict[str, torch.Tensor]:
    """`feats` with the pixel descriptors of `images` (row k: image k) added."""
    return {**feats, PIXEL_FEATURE: pixel_descriptors(images, side)}


def distinct_rows(x: torch.Tensor) -> torch.Tensor:
    """The distinct descriptors of each image [N, P, D], stacked: flat regions repeat one
    descriptor hundreds of times, and a pool drawn from the repeats would miss the rare
    patches (edges, corners) the bank must cover."""
    return torch.cat([torch.unique(img, dim=0) for img in x]) if len(x) else \
        x.reshape(-1, x.shape[-1])


def coreset(z: torch.Tensor, size: int, pool: int = CORESET_POOL, seed: int = 0
            ) -> torch.Tensor:
    """At most `size` rows of `z` chosen by greedy k-centre (each new row the one farthest
    from those already chosen), from a deterministic subsample of `pool` rows: the bank
    then covers every kind of patch seen, not mostly the background."""
    if len(z) <= size:
        return z
    if len(z) > pool:
        keep = np.random.default_rng(seed).choice(len(z), pool, replace=False)
        z = z[torch.from_numpy(np.sort(keep))]
    zf = z.float().contiguous()
    norms = (zf * zf).sum(1)
    chosen = [0]
    # squared distance to the nearest chosen row, |z|² + |c|² − 2 z·c: one matrix-vector
    # product an iteration, in place (the cost of the fit, not of serving)
    dist = norms + norms[0] - 2.0 * (zf @ zf[0])
    step = torch.empty_like(dist)
    for _ in range(size - 1):
        i = int(dist.argmax())
        chosen.append(i)
        torch.mv(zf, zf[i], out=step)
        step.mul_(-2.0).add_(norms).add_(norms[i])
        torch.minimum(dist, step, out=dist)
    return z[torch.tensor(sorted(chosen))]


# bounds the float32 error of a squared distance |a|² + |b|² − 2a·b of DIM-vectors (and of
# the bank's rounding to float32) as a multiple of u·(|a|² + |b|²), u = 2⁻²⁴: DIM + 4
# roundings at most, each within u of a term no larger than 2(|a|² + |b|²); doubled
F32_SLACK = 4 * (DIM + 4) * 2.0 ** -24
ROWS = 512            # descriptors matched against the whole bank at once (bounded memory)
# bank rows (k-centre) that route a descriptor to a part of the bank: with 64, half an
# image's distinct descriptors were routed to rows far from their nearest and matched
# against the whole bank again (most of the score's cost); with 256, a few per cent
CENTRES = 256
NEAR_CENTRE = 256     # bank rows kept with each centre: those nearest to it
PIECE = 16            # descriptors per block of the routed products (padding is wasted work)
TOP = 8               # descriptors of each image whose nearest distance bounds its score


def distinct(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct rows of flat [M, D], the index of each row among them). Grouped by a
    fixed linear key, then checked: a row unequal to its group's first row (two rows
    with one key) stands alone, so the grouping is exact. Much cheaper than
    `torch.unique(dim=0)`, which sorts whole rows."""
    m = len(flat)
    key = flat.double() @ torch.linspace(1.0, 2.0, flat.shape[1], dtype=torch.float64
                                         ).sqrt()
    _, inv = torch.unique(key, return_inverse=True)
    n = int(inv.max()) + 1 if m else 0
    first = torch.full((n,), m, dtype=torch.long).scatter_reduce_(
        0, inv, torch.arange(m), "amin")
    rows = flat[first]
    alone = (~(flat == rows[inv]).all(1)).nonzero()[:, 0]
    if len(alone):
        inv = inv.clone()
        inv[alone] = n + torch.arange(len(alone))
        rows = torch.cat([rows, flat[alone]])
    return rows, inv


def _d2(a: torch.Tensor, bank: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """float32 squared distances [A, B] of rows a to bank rows, |b|² − 2a·b + |a|²."""
    return torch.addmm(b2, a, bank.T, alpha=-2.0).add_((a * a).sum(1, keepdim=True))


def _nearest_d2(a: torch.Tensor, bank: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """float32 squared distance of each row of a to its nearest bank row: the smallest
    |b|² − 2a·b, then |a|² added once (not to every entry)."""
    return torch.addmm(b2, a, bank.T, alpha=-2.0).amin(1) + (a * a).sum(1)


class BankIndex:
    """A pixel bank ready for `largest_nearest`, built once per bank: float32 rows and
    squared norms, and a routing table: `CENTRES` bank rows chosen by greedy k-centre,
    each with the `NEAR_CENTRE` bank rows nearest to it. The table only bounds distances
    from above (its rows are bank rows); the score itself is exact."""

    def __init__(self, bank: torch.Tensor) -> None:
        self.bank64 = bank.double().contiguous()
        self.bank = bank.float().contiguous()
        self.b2 = (self.bank * self.bank).sum(1)
        self.b2max = float(self.b2.max()) if len(bank) else 0.0
        c = coreset_order(self.bank, min(CENTRES, len(bank)))
        self.centres, self.c2 = self.bank[c], self.b2[c]
        near = _d2(self.centres, self.bank, self.b2).topk(
            min(NEAR_CENTRE, len(bank)), dim=1, largest=False).indices   # [C, M]
        self.groups, self.g2 = self.bank[near], self.b2[near]            # [C, M, D], [C, M]

    def upper(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 squared distance of each row to the nearest bank row kept with its
        nearest centre: at least its nearest distance (up to the float32 bound). In
        blocks of rows (a calibration split's descriptors are hundreds of thousands)."""
        block = 16 * ROWS
        if len(rows) > block:
            return torch.cat([self.upper(rows[s:s + block])
                              for s in range(0, len(rows), block)])
        route = _d2(rows, self.centres, self.c2).argmin(1)
        # rows of one centre in pieces of at most PIECE, padded: one batched product
        order = torch.argsort(route, stable=True)
        ids, group, counts = torch.unique_consecutive(route[order], return_inverse=True,
                                                      return_counts=True)
        rank = torch.arange(len(rows)) - (torch.cumsum(counts, 0) - counts)[group]
        pieces = torch.div(counts + PIECE - 1, PIECE, rounding_mode="floor")
        piece = (torch.cumsum(pieces, 0) - pieces)[group] + torch.div(
            rank, PIECE, rounding_mode="floor")
        slot = rank % PIECE
        q = rows.new_zeros(int(piece[-1]) + 1, PIECE, rows.shape[1])
        q[piece, slot] = rows[order]
        c = torch.zeros(len(q), dtype=torch.long)
        c[piece] = route[order]
        d2 = torch.baddbmm(self.g2[c][:, None, :], q, self.groups[c].transpose(1, 2),
                           alpha=-2.0).amin(2)
        out = torch.empty(len(rows))
        out[order] = d2[piece, slot] + (rows[order] ** 2).sum(1)
        return out

    def nearest(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 squared distance of each row to its nearest bank row, in blocks."""
        if not len(rows):
            return torch.zeros(0)
        return torch.cat([_nearest_d2(rows[s:s + ROWS], self.bank, self.b2)
                          for s in range(0, len(rows), ROWS)])


def coreset_order(z: torch.Tensor, size: int) -> torch.Tensor:
    """The first `size` rows greedy k-centre picks from z (starting at row 0), in order."""
    if size <= 0:
        return torch.zeros(0, dtype=torch.long)
    norms = (z * z).sum(1)
    chosen = [0]
    dist = norms + norms[0] - 2.0 * (z @ z[0])
    for _ in range(size - 1):
        i = int(dist.argmax())
        chosen.append(i)
        dist = torch.minimum(dist, norms + norms[i] - 2.0 * (z @ z[i]))
    return torch.tensor(chosen)


def largest_nearest(x: torch.Tensor, index: BankIndex) -> torch.Tensor:
    """For each image of x [N, P, D] (float32), the largest over its descriptors of the
    distance to the nearest bank row, in float64: the value a brute-force float64
    `cdist(x[i], bank).min(1).max()` gives, up to float64 rounding.

    Cost, in steps that each keep that value exact:
    - descriptors repeat within and across images (flat regions): each distinct one is
      matched once;
    - float32 matrix products stand in for distances, their error on a squared distance
      bounded by `tol` (F32_SLACK);
    - a descriptor's distance to the rows kept with its nearest centre bounds its nearest
      distance from above; the `TOP` descriptors of an image with the largest such bounds
      are matched against the whole bank, and the largest of those (less `tol`) bounds the
      image's score from below: a descriptor whose upper bound is under it cannot hold
      the score and is dropped (on easy-VQA scenes, all but a few per cent);
    - of those left, only the ones whose float32 nearest distance plus its tol reaches
      their image's largest float32 distance less that one's tol are read again in
      float64, against the bank rows within 2·tol of their float32 nearest: no other
      descriptor can hold the largest distance, and no other bank row the nearest."""
    n, p, dim = x.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    rows, inv = distinct(x.reshape(-1, dim))
    inv = inv.reshape(n, p)
    tol = F32_SLACK * ((rows * rows).sum(1).double() + index.b2max)
    ub = index.upper(rows).double() + tol                   # ≥ each exact nearest d²
    top = inv.gather(1, ub[inv].topk(min(TOP, p), dim=1).indices)
    near = torch.full((len(rows),), -np.inf, dtype=torch.float64)
    t = torch.unique(top)
    near[t] = index.nearest(rows[t]).double()
    low = (near[top] - tol[top]).max(1, keepdim=True).values   # ≤ each image's score
    keep = torch.unique(inv[ub[inv] > low])
    keep = keep[near[keep] == -np.inf]
    near[keep] = index.nearest(rows[keep]).double()
    # a dropped descriptor keeps −inf: its image's score is held by another
    per, err = near[inv], tol[inv]
    # each row's own bound on both sides: the row holding the score is within its tol of
    # it, and the largest float32 value within its (maybe larger) tol; 2·(own tol) would
    # drop a small-norm row whose image's largest value is a large-norm row's overestimate
    cand = per + err >= (per - err).max(1, keepdim=True).values
    ids = torch.unique(inv[cand])
    exact = torch.full((len(rows),), -np.inf, dtype=torch.float64)
    for s in range(0, len(ids), ROWS):
        i = ids[s:s + ROWS]
        d2 = _d2(rows[i], index.bank, index.b2).double()
        r, j = (d2 <= d2.amin(1, keepdim=True) + 2.0 * tol[i, None]).nonzero(as_tuple=True)
        e = (rows[i][r].double() - index.bank64[j]).square().sum(1)
        exact[i] = torch.full((len(i),), np.inf, dtype=torch.float64).scatter_reduce_(
            0, r, e, "amin")
    return exact[inv].max(1).values.sqrt()


class PixelNovelty(ImagePart):
    """The largest distance of any pixel-patch descriptor of an image to its nearest bank
    descriptor; the bank a coreset of the fitting images' descriptors (and of benign
    re-encodings'). Descriptors are not standardised: their units are fixed by design
    (colours in [0, 1], gradient votes scaled to match). Reads feature dicts with
    `PIXEL_FEATURE` ([N, P, DIM], `pixel_descriptors`)."""

    KIND, FEATURE, WHAT, INPUT, NDIM = KIND, PIXEL_FEATURE, "pixel", "[N, P, D] descriptors", 3
    DIM, MAX_BANK, DESCRIBED = DIM, PIXEL_BANK, DESCRIBED

    def _bank_rows(self, x: torch.Tensor) -> torch.Tensor:
        return distinct_rows(x)

    def _capped(self, z: torch.Tensor) -> torch.Tensor:
        return coreset(z, self.max_bank)

    def extend_bank(self, x: torch.Tensor) -> PixelNovelty:
        """Add in-distribution descriptors to the bank (the coreset re-chosen over the
        union, so it stays within `max_bank`); the conformal reference stays."""
        x = torch.as_tensor(x).double()
        x = x if x.dim() == 3 else x[None]
        self.t["bank"] = self._capped(torch.cat([self.t["bank"], distinct_rows(x)]))
        return self.prepare()

    def prepare(self) -> PixelNovelty:
        """The bank's index built now (tens of ms: a first score would pay it;
        `Novelty.prepare`)."""
        if "bank" in self.t:
            self.index()
        return self

    def score(self, x: torch.Tensor) -> np.ndarray:
        """The largest nearest-bank distance of any descriptor of each image [N, P, D],
        exact (float64 from the float32 descriptors), read in one pass over the batch
        (`largest_nearest`)."""
        x = torch.as_tensor(x)
        if x.dim() != 3:
            raise ValueError("a pixel novelty part scores [N, P, D] descriptors")
        return largest_nearest(x.float(), self.index()).numpy()

    def index(self) -> BankIndex:
        """The bank ready for scoring, built once per bank (`prepare`; a bank replaced by
        `extend_bank` gets a new one)."""
        bank = self.t["bank"]
        cached = getattr(self, "_index", None)
        if cached is None or cached[0] is not bank:
            cached = self._index = (bank, BankIndex(bank))
        return cached[1]


PART_CLASSES[KIND] = PixelNovelty
