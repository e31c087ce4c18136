"""The pixel part of the defer rule's detector (heads.pixel_novelty): patch descriptors,
coreset bank, conformal p-values, the composite's third part, save and load."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from heads.novelty import CompositeNovelty, Novelty, load_detector, load_part
from heads.pixel_novelty import (
    DIM,
    PIXEL_FEATURE,
    PixelNovelty,
    _box,
    coreset,
    distinct,
    pixel_descriptors,
    with_pixels,
)
from models.data import load

# colours of the constructed "training" scenes; ORANGE is never drawn in them
SEEN = ((200, 30, 30), (30, 60, 200), (40, 160, 60))
ORANGE = (255, 150, 0)


def scene(rng: np.random.Generator, colour=None, side: int = 64) -> Image.Image:
    """A flat pale background and one filled ellipse or rectangle, drawn at 2× and brought
    down bilinearly (edges blend with the background, as in easy-VQA)."""
    bg = tuple(int(v) for v in rng.integers(230, 256, 3))
    big = Image.new("RGB", (2 * side, 2 * side), bg)
    d = ImageDraw.Draw(big)
    w = int(rng.integers(2 * side // 6, 2 * side // 2))
    x, y = (int(v) for v in rng.integers(0, 2 * side - w, 2))
    fill = colour if colour is not None else SEEN[int(rng.integers(len(SEEN)))]
    (d.ellipse if rng.random() < 0.5 else d.rectangle)([x, y, x + w, y + w], fill=fill)
    return big.resize((side, side), Image.BILINEAR)


def jpeg(im: Image.Image, quality: int = 90) -> Image.Image:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    train = [scene(rng) for _ in range(40)]
    bank = pixel_descriptors(train + [jpeg(im) for im in train[:20]])   # benign in the bank
    det = PixelNovelty(max_bank=3000).fit(bank)
    det.calibrate(pixel_descriptors([scene(rng) for _ in range(99)]))
    return det


def test_descriptors_have_the_stated_shape_and_read_any_size():
    ims = [scene(np.random.default_rng(1)), scene(np.random.default_rng(2), side=128)]
    d = pixel_descriptors(ims)
    assert d.shape == (2, 32 * 32, DIM) and torch.isfinite(d).all()
    flat = Image.new("RGB", (64, 64), (240, 240, 240))
    f = pixel_descriptors([flat])[0]
    # a flat image: its colour everywhere, no gradient votes
    assert torch.allclose(f[:, :3], torch.full((1024, 3), 240 / 255), atol=1e-5)
    assert f[:, 6:].abs().max() < 1e-6


def test_an_unseen_colour_is_flagged_and_a_jpeg_of_a_training_like_image_is_not(fitted):
    rng = np.random.default_rng(5)
    novel = [scene(rng, ORANGE) for _ in range(20)]
    benign = [jpeg(scene(rng), 90) for _ in range(20)]
    p_novel = fitted.p_value(pixel_descriptors(novel))
    p_benign = fitted.p_value(pixel_descriptors(benign))
    assert (p_novel < 0.02).mean() >= 0.9
    assert (p_benign < 0.02).mean() <= 0.1


def test_the_odd_patch_is_where_the_unseen_colour_is(fitted):
    rng = np.random.default_rng(7)
    im = scene(rng)
    draw = ImageDraw.Draw(im)
    draw.rectangle([44, 4, 56, 16], fill=ORANGE)        # a small orange patch, top right
    z = pixel_descriptors([im])[0].double()
    d = fitted._nearest(z, 1).reshape(32, 32)
    r, c = divmod(int(d.argmax()), 32)
    assert 2 <= r <= 8 and 22 <= c <= 28                # the stride-2 grid around it
    assert fitted.score(z[None])[0] == pytest.approx(float(d.max()), rel=1e-6)


def test_coreset_keeps_rare_rows_a_random_subsample_would_drop():
    g = torch.Generator().manual_seed(0)
    z = torch.cat([torch.randn(5000, 4, generator=g) * 0.01, torch.full((3, 4), 5.0)])
    kept = coreset(z, 50)
    assert len(kept) == 50
    assert (kept == 5.0).all(1).any()                   # the rare far rows are covered
    assert torch.equal(coreset(z[:10], 50), z[:10])      # small sets are kept whole


def test_extend_bank_lowers_the_score_of_what_it_adds_and_keeps_the_cap(fitted):
    det = PixelNovelty(max_bank=fitted.max_bank)          # a copy (its own bank entry)
    det.t = dict(fitted.t)
    odd = pixel_descriptors([scene(np.random.default_rng(9), ORANGE)])
    before = det.score(odd)[0]
    det.extend_bank(odd[0])
    assert det.score(odd)[0] < before
    assert det.t["bank"].shape[0] <= det.max_bank
    assert fitted.score(odd)[0] == pytest.approx(before)   # the original is unchanged


def test_fit_refuses_what_it_cannot_read():
    with pytest.raises(ValueError):
        PixelNovelty().fit(torch.zeros(4, DIM))
    with pytest.raises(ValueError):
        PixelNovelty(kind="token_knn")


def test_a_composite_with_a_pixel_part_saves_loads_and_combines_bonferroni(fitted, tmp_path):
    g = torch.Generator().manual_seed(0)
    q = Novelty("knn", "h_pre", k=1).fit(torch.randn(50, 4, generator=g))
    q.calibrate(torch.randn(49, 4, generator=g))
    det = CompositeNovelty({"question": q, "pixels": fitted})
    assert det.reads_pixels and not CompositeNovelty({"question": q}).reads_pixels
    rng = np.random.default_rng(11)
    ims = [scene(rng), scene(rng, ORANGE)]
    feats = with_pixels({"h_pre": torch.randn(2, 4, generator=g)}, ims)
    assert feats[PIXEL_FEATURE].shape == (2, 1024, DIM)
    each = det.part_p_values(feats)
    p = det.p_values(feats)
    assert np.allclose(p, np.minimum(1, 2 * np.minimum(each["question"], each["pixels"])))
    det.save(tmp_path)
    back = load_detector(tmp_path)
    assert isinstance(back.parts["pixels"], PixelNovelty)
    assert np.array_equal(back.p_values(feats), p)
    assert back.to_dict()["parts"]["pixels"]["kind"] == "pixel_knn"
    # a re-certified reference wraps it and still reads the pixels
    ext = back.extend_reference(np.array([0.1, 0.2]))
    assert ext.reads_pixels and len(ext.read(feats)) == 2


def test_descriptors_in_chunks_are_the_descriptors_at_once(monkeypatch):
    """Described in chunks (bounded memory on a large fit or evaluation), every image gets
    the same descriptors as in one batch."""
    import heads.pixel_novelty as pn

    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)) for _ in range(7)]
    whole = pn.pixel_descriptors(ims)
    monkeypatch.setattr(pn, "CHUNK", 3)
    assert torch.equal(pn.pixel_descriptors(ims), whole)


def test_the_shipped_part_scores_the_brute_force_distance_bit_for_bit():
    # the bank index only prunes: whichever rows it routes to, the score is the float64
    # distance of the farthest descriptor to its nearest bank row, bit for bit
    part = load_part(Path(__file__).resolve().parents[1] / "heads" / "embedded",
                     "novelty.pixels")
    ims = list({it.image_id: it.image() for it in load("render:plain:4")}.values())
    odd = ims[0].copy()
    ImageDraw.Draw(odd).rectangle([(2, 2), (9, 9)], fill=ORANGE)
    x = pixel_descriptors(ims + [odd])
    bank = part.t["bank"].double()

    def brute(img: torch.Tensor) -> torch.Tensor:
        rows = distinct(img)[0].double()
        # every bank row within 1e-9 of the nearest by a float64 product (its error is
        # ~1e-15 here), then the difference of each pair summed, as the score sums it
        d2 = torch.cdist(rows, bank, compute_mode="use_mm_for_euclid_dist").square()
        r, j = (d2 <= d2.amin(1, keepdim=True) + 1e-9).nonzero(as_tuple=True)
        e = (rows[r] - bank[j]).square().sum(1)
        return torch.full((len(rows),), np.inf, dtype=torch.float64).scatter_reduce(
            0, r, e, "amin").max().sqrt()

    want = torch.stack([brute(img) for img in x]).numpy()
    assert np.array_equal(part.score(x), want)
    assert want[-1] > 2 * want[0]                       # the orange square is far


def _box_as_written(x: torch.Tensor, k: int, stride: int) -> torch.Tensor:
    """The box mean as first written: k strided views of the padded maps added in order,
    along the rows then the columns (the reference the phase-split sums must equal)."""
    p = k // 2
    x = F.pad(x, (p, p, p, p), mode="replicate")
    h, w = x.shape[-2] - 2 * p, x.shape[-1] - 2 * p
    out = x.narrow(-2, 0, h)[..., ::stride, :].clone()
    for i in range(1, k):
        out.add_(x.narrow(-2, i, h)[..., ::stride, :])
    res = out.narrow(-1, 0, w)[..., ::stride].clone()
    for i in range(1, k):
        res.add_(out.narrow(-1, i, w)[..., ::stride])
    return res / (k * k)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_box_means_are_the_strided_sums_bit_for_bit(stride):
    rng = np.random.default_rng(8)
    for shape in ((2, 3, 64, 64), (1, 5, 37, 50), (1, 1, 5, 3)):
        x = torch.from_numpy(rng.random(shape, dtype=np.float32))
        for k in (1, 3, 5, 11):
            assert torch.equal(_box(x, k, stride), _box_as_written(x, k, stride))
