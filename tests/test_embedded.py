"""The shipped actor and heads load by default, belong together, and behave."""

import contextlib
import json

import numpy as np
import pytest

import heads.pixel_novelty as pn
from heads.dualread import EMBEDDED_HEADS, Heads
from heads.features import extract_many
from heads.novelty import features, load_detector
from models.canon import is_correct
from models.data import load, sample
from models.loading import EMBEDDED_ACTOR, load_actor


@pytest.fixture(scope="module")
def embedded():
    return load_actor()


def test_embedded_actor_answers_and_looks(embedded):
    items = sample(load("easyvqa:test"), 48, seed=5)
    res = embedded.answer([it.image() for it in items], [it.question for it in items],
                          readout="none")
    acc = sum(is_correct(r.answer, it.answer) for r, it in zip(res, items)) / len(items)
    assert acc >= 0.75
    assert sum(r.parsed.well_formed for r in res) >= 47


def test_embedded_heads_match_the_actor(embedded):
    heads = Heads.load(None, embedded.fingerprint)
    card = json.loads((EMBEDDED_HEADS / "heads_card.json").read_text())
    if "fingerprint_scheme" in card:
        assert card["actor_fingerprint"] == embedded.fingerprint
    else:   # a card from before fingerprint scheme 2: same weights and config (refit due)
        from models.loading import legacy_fingerprint
        assert card["actor_fingerprint"] == legacy_fingerprint(EMBEDDED_ACTOR)
    assert card["defer"]["feasible"] and 0 < card["defer"]["coverage"] <= 1
    it = load("easyvqa:test")[0]
    r = embedded.answer([it.image()], [it.question])[0]
    conf = heads.confidence(r.readout)
    assert set(conf) == {"dualread", "psr", "per", "verbalized"}
    assert all(0 <= v <= 1 for v in conf.values())


def test_actor_card_fields():
    card = json.loads((EMBEDDED_ACTOR / "actor_card.json").read_text())
    for key in ("data", "splits", "recipe", "command", "git_commit", "metrics"):
        assert key in card
    assert card["metrics"]["real"]["n"] == 9673


def test_loaded_heads_build_their_scoring_caches_before_any_score(monkeypatch):
    # the first request would otherwise pay them (the pixel part's index: tens of ms)
    heads = Heads.load(None)
    parts = heads.novelty.parts
    caches = {"image": ["_b32"], "question": ["_b2"], "pixels": ["_index"],
              "layout": ["_b32", "_outlines"]}
    assert set(caches) == set(parts)
    for name, attrs in caches.items():
        for attr in attrs:
            assert getattr(parts[name], attr)[0] is parts[name].t["bank"], (name, attr)
    index = parts["pixels"].index()
    monkeypatch.setattr(pn, "BankIndex", None)    # a score now builds nothing
    it = load("easyvqa:test")[0]
    parts["pixels"].score(pn.pixel_descriptors([it.image()]))
    assert parts["pixels"].index() is index


def test_heads_loaded_only_to_be_checked_build_no_cache():
    """`serve`'s start-up check and `fit-detectors` load the heads without serving them:
    the caches are left to a first score (building them twice cost start-up ~0.1 s)."""
    parts = Heads.load(None, prepare=False).novelty.parts
    assert not any(hasattr(p, a) for p in parts.values()
                   for a in ("_b32", "_b2", "_index", "_outlines"))


def test_prepared_heads_score_as_lazily_built_ones_bit_for_bit(embedded):
    heads = Heads.load(None, embedded.fingerprint)
    lazy = load_detector(EMBEDDED_HEADS)          # its caches built by its first score
    items = sample(load("easyvqa:test"), 4, seed=3)
    ims = [it.image() for it in items]
    ros = [r.readout for r in embedded.answer(ims, [it.question for it in items])]
    feats = heads.with_images(extract_many(ros, heads.kappa), ims)
    for name, part in heads.novelty.parts.items():
        x = features(part.feature, feats)
        assert np.array_equal(part.score(x), lazy.parts[name].score(x)), name
    got = [a.novelty for a in heads.assess(ros, ims)]
    assert got == lazy.read(feats, heads.novelty_alpha)


def test_heads_score_on_one_blas_thread_with_the_same_outputs(embedded, monkeypatch):
    """`Heads.assess` limits numpy's BLAS to one thread (heads.threads) while it scores,
    restores it after, and scores bit for bit as with two threads (the shipped detector's
    bank products are large enough that OpenBLAS splits them when allowed to)."""
    from threadpoolctl import threadpool_limits

    import heads.dualread as hd
    from heads.threads import blas_threads

    heads = Heads.load(None, embedded.fingerprint)
    items = sample(load("easyvqa:test"), 8, seed=4)
    ims = [it.image() for it in items]
    ros = [r.readout for r in embedded.answer(ims, [it.question for it in items])]
    seen = []
    real = hd.extract_many
    monkeypatch.setattr(hd, "extract_many",
                        lambda *a, **k: seen.append(blas_threads()) or real(*a, **k))
    with threadpool_limits(limits=2, user_api="blas"):
        if blas_threads() < 2:
            pytest.skip("numpy's BLAS runs on one thread at most on this machine")
        limited = heads.assess(ros, ims)
        assert blas_threads() == 2            # restored on the way out
        monkeypatch.setattr(hd, "one_blas_thread", contextlib.nullcontext)
        free = heads.assess(ros, ims)
    assert seen == [1, 2]
    assert [(a.confidence, a.novelty, a.logits) for a in limited] == \
        [(a.confidence, a.novelty, a.logits) for a in free]
