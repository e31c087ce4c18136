"""The probes' summaries on constructed records (mutation gaps of clients/probes/reliance.py
and clients/probes/tgs.py). Reliance: each array reads its own condition, skipped items are
counted apart, every interval is the image-cluster bootstrap of its own statistic, the
p-values compare real with shuffled and with blank, and the mean confidence is per
condition."""

from __future__ import annotations

import numpy as np
import pytest

from clients.probes import reliance as rp
from clients.probes.runner import Config
from clients.probes.stats import cluster_bootstrap, reliance, sign_flip_p

CFG = Config(data="test", bootstrap=200, seed=7)


def _rec(k: int, zr: bool, zb: bool, zs: bool, ar: str, as_: str, nvc: bool,
         cr: float, cb: float, cs: float) -> dict:
    return {"image_id": f"img{k // 2}", "shuffle_image": "x", "nvc": nvc,
            "real": {"z": zr, "a": ar, "c": {"dualread": cr, "psr": cr / 2}},
            "blank": {"z": zb, "a": "no", "c": {"dualread": cb, "psr": cb / 2}},
            "shuffle": {"z": zs, "a": as_, "c": {"dualread": cs, "psr": cs / 2}}}


RECS = [_rec(0, True, False, True, "red", "red", True, .9, .2, .6),
        _rec(1, True, True, False, "red", "blue", False, .8, .3, .5),
        _rec(2, False, False, False, "blue", "blue", True, .4, .1, .3),
        _rec(3, True, False, True, "two", "three", False, .7, .4, .2),
        _rec(4, True, False, False, "yes", "no", True, .6, .5, .1),
        _rec(5, False, True, True, "no", "no", False, .5, .6, .4),
        {"skipped": "one image only", "image_id": "img9"}]


def test_params_name_the_probe_and_its_seed():
    p = rp.params(CFG)
    assert p["probe"] == "reliance" and p["seed"] == 7 and p["data"] == "test"


def test_arrays_read_each_condition():
    zr, zb, zs, same, nvc = rp._arrays(RECS[:6])
    assert zr.tolist() == [True, True, False, True, True, False]
    assert zb.tolist() == [False, True, False, False, False, True]
    assert zs.tolist() == [True, False, False, True, False, True]
    assert same.tolist() == [True, False, True, False, False, True]
    assert nvc.tolist() == [True, False, True, False, True, False]
    assert all(a.dtype == bool for a in (zr, zb, zs, same, nvc))


def test_summary_by_hand():
    s = rp.summarise(RECS, CFG)
    assert s["n_items"] == 7 and s["n"] == 6 and s["bootstrap"] == 200
    zr, zb, zs, same, nvc = rp._arrays(RECS[:6])
    assert s["vrs"] == pytest.approx(4 / 6 - 3 / 6) and s["bd"] == pytest.approx(4 / 6 - 2 / 6)
    assert s == {**s, **reliance(zr, zb, zs, same, nvc)}
    images = [r["image_id"] for r in RECS[:6]]
    for m in rp.METRICS + ("p_invariant_given_nvc",):
        want = cluster_bootstrap(images, lambda i, m=m: reliance(zr[i], zb[i], zs[i], same[i],
                                                                 nvc[i])[m], 200, 42)
        assert s[f"{m}_ci"] == want, m
    assert s["vrs_p"] == sign_flip_p(zr.astype(float) - zs)
    assert s["bd_p"] == sign_flip_p(zr.astype(float) - zb)
    assert s["vrs_p"] != s["bd_p"]
    assert s["confidence"] == {
        "dualread": {"real": pytest.approx(np.mean([.9, .8, .4, .7, .6, .5])),
                     "blank": pytest.approx(np.mean([.2, .3, .1, .4, .5, .6])),
                     "shuffle": pytest.approx(np.mean([.6, .5, .3, .2, .1, .4]))},
        "psr": {"real": pytest.approx(np.mean([.9, .8, .4, .7, .6, .5]) / 2),
                "blank": pytest.approx(np.mean([.2, .3, .1, .4, .5, .6]) / 2),
                "shuffle": pytest.approx(np.mean([.6, .5, .3, .2, .1, .4]) / 2)}}
    assert list(s["confidence"]) == ["dualread", "psr"]


def test_summary_of_skipped_items_only():
    s = rp.summarise([RECS[-1]], CFG)
    assert s["n_items"] == 1 and s["n"] == 0 and s["confidence"] == {}
