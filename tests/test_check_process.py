"""The image check run in a process of its own (`heads.check_process`) and the faster,
exact rewrites of its statistics: the same numbers as the in-thread check, and a dead or
failing process costs one batch, not the service."""

import gc
import math
import os
import shutil
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.ndimage import median_filter

from app.service import Service
from app.serving import AnswerItem
from heads.check_process import CheckProcess, CheckTables
from heads.conformal import kth_distance, p_values
from heads.dualread import Heads
from heads.fit import fit_image_check
from heads.image_check import (
    _gradient,
    _mean_std,
    _pad_edge,
    _row_median,
    _stack_features,
    bounded,
    median3x3,
    pixel_features_many,
)
from tests.conftest import random_image
from tests.helpers import random_heads

ALPHA = 0.01


def _blocks(rng: np.random.Generator, side: int = 64) -> Image.Image:
    tiles = rng.integers(0, 256, (8, 8, 3)).astype(np.uint8)
    return Image.fromarray(np.kron(tiles, np.ones((side // 8, side // 8, 1), np.uint8)))


@pytest.fixture(scope="module")
def check():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(pixel_features_many([_blocks(rng) for _ in range(120)]))
    cal = torch.from_numpy(pixel_features_many([_blocks(rng) for _ in range(199)]))
    return fit_image_check(x, cal)


@pytest.fixture()
def images():
    rng = np.random.default_rng(1)
    out = [_blocks(rng) for _ in range(3)]
    out += [random_image(seed=s) for s in range(2)]                    # unlike the blocks
    out += [_blocks(rng).resize((40, 24)), Image.new("RGB", (3, 500), (9, 9, 9))]
    return out


@pytest.fixture()
def proc(check):
    """A started check process, ended after the test."""
    started = CheckProcess(check, ALPHA)
    started.start()
    yield started
    started.close()


@pytest.fixture()
def served(actors, tmp_path, check):
    """A service over the tiny actor and random heads with `check` as image check, and
    those heads; closed after the test."""
    actor = actors["qwen3_vl"]
    heads = Heads.load(random_heads(tmp_path, actor), actor.fingerprint)
    heads.image_check = check
    svc = Service.of(actor, heads)
    yield svc, heads
    svc.close()


def _heads(check) -> Heads:
    heads = Heads(dim=2)
    heads.image_check = check
    return heads


def test_median3x3_is_scipys_median_filter_bit_for_bit():
    rng = np.random.default_rng(0)
    for shape in [(2, 9, 13), (1, 1, 1), (1, 2, 5), (3, 64, 64)]:
        y = rng.random(shape)
        y[0, 0, :] = 0.5                                   # ties
        assert np.array_equal(median3x3(y), median_filter(y, size=(1, 3, 3), mode="nearest"))
    for _ in range(300):          # three grey levels: ties in almost every window
        y = rng.integers(0, 3, (1, *rng.integers(1, 12, 2))).astype(float)
        assert np.array_equal(median3x3(y), median_filter(y, size=(1, 3, 3), mode="nearest"))


def test_the_check_s_own_numpy_helpers_give_numpys_numbers():
    """Edge padding, row medians, the gradient, mean and std, written out for speed, equal numpy's
    general functions bit for bit."""
    rng = np.random.default_rng(3)
    for h, w in [(2, 2), (3, 8), (8, 3), (64, 64), (31, 17)]:
        y = rng.random((2, h, w))
        assert np.array_equal(_pad_edge(y), np.pad(y, ((0, 0), (1, 1), (1, 1)), mode="edge"))
        gy, gx = _gradient(y)
        want_y, want_x = np.gradient(y, axis=(1, 2))
        assert np.array_equal(gy, want_y) and np.array_equal(gx, want_x)
        x = rng.random((3, h * w))
        x[0, : h * w // 2] = 0.25                          # ties across the middle
        assert np.array_equal(_row_median(x), np.median(x, axis=1))
        mean, std = _mean_std(y, (1, 2))
        assert np.array_equal(mean, y.mean(axis=(1, 2)))
        assert np.array_equal(std, y.std(axis=(1, 2)))


def test_half_spectrum_high_frequency_share_equals_the_full_spectrum():
    """log_high_freq_share from `rfft2` with mirrored columns counted twice, against the
    full `fft2` written out here, for odd and even widths."""
    rng = np.random.default_rng(2)
    for h, w in [(16, 16), (15, 21), (8, 9), (10, 4)]:
        rgb8 = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        y = (rgb8 / 255.0) @ np.array([0.299, 0.587, 0.114])
        ym = median3x3(y)
        power = np.abs(np.fft.fft2(ym - ym.mean(axis=(1, 2), keepdims=True), axes=(1, 2))) ** 2
        f = np.maximum(np.abs(np.fft.fftfreq(h))[:, None], np.abs(np.fft.fftfreq(w))[None, :])
        want = np.log((power[:, f > 0.25].sum(1) + 1e-6) / (power.sum((1, 2)) + 1e-6))
        got = _stack_features(rgb8)[:, 4]
        assert np.allclose(got, want, rtol=0, atol=1e-12)


def test_kth_distance_by_hand():
    bank = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0], [1.0, 0.0]])
    z = np.array([[0.0, 0.0], [6.0, 8.0]])
    # distances from (0,0): 0, 5, 10, 1 -> 2nd nearest 1; from (6,8): 10, 5, 0, sqrt(100-12+1)
    assert kth_distance(z, bank, 2) == pytest.approx([1.0, 5.0])
    assert kth_distance(z, bank, 1) == pytest.approx([0.0, 0.0])


def test_presorted_p_values_equal_the_sorting_ones():
    rng = np.random.default_rng(3)
    cal = rng.normal(size=50)
    s = np.r_[rng.normal(size=20), cal[:5]]              # ties with calibration scores
    assert np.array_equal(p_values(np.sort(cal), s, presorted=True), p_values(cal, s))


def test_the_process_reads_what_the_heads_read(proc, check, images):
    got = proc.submit(images).result(timeout=60)
    want = _heads(check).image_readings(images)
    assert got == want                                # score, p-value and flag, exactly
    assert any(r.novel for r in got) and not all(r.novel for r in got)
    assert proc.cpu_seconds > 0


def test_tables_equal_the_novelty_scoring(check, images):
    tables = CheckTables.of(check, ALPHA)
    arrays = [bounded(im) for im in images]
    s, p = tables.read(arrays)
    x = torch.from_numpy(pixel_features_many(images))
    assert np.array_equal(s, check.score(x))
    assert np.array_equal(p, check.p_value(x))


def test_a_killed_process_fails_its_batch_and_the_next_restarts_it(proc, check, images):
    first = proc.proc
    first.kill()
    first.wait()
    outcomes = []
    for _ in range(2):          # the first may still find the dead pipe; not both
        try:
            outcomes.append(proc.submit(images[:2]).result(timeout=60))
        except RuntimeError:
            outcomes.append(None)
    assert outcomes[-1] == _heads(check).image_readings(images[:2])
    assert proc.proc is not first


def test_a_batch_the_child_cannot_read_fails_alone(proc, check, images):
    bad = proc.send([np.zeros((4, 4), np.uint8)])  # no colour channel
    with pytest.raises(RuntimeError, match="image check failed"):
        bad.result(timeout=60)
    assert proc.submit(images[:1]).result(timeout=60) == \
        _heads(check).image_readings(images[:1])


def test_closing_ends_the_child(check):
    proc = CheckProcess(check, ALPHA)
    proc.start()
    child = proc.proc
    proc.close()
    assert child.poll() is not None and proc.proc is None      # ended and reaped


def test_a_forgotten_check_process_ends_its_child(check):
    proc = CheckProcess(check, ALPHA)
    proc.start()
    child = proc.proc
    del proc
    gc.collect()
    assert child.wait(timeout=10) is not None


def test_cpu_seconds_add_up_over_batches(proc, images):
    proc.submit(images).result(timeout=60)
    once = proc.cpu_seconds
    proc.submit(images).result(timeout=60)
    assert 0 < once < proc.cpu_seconds


def test_a_reading_does_not_depend_on_its_batch(check, images):
    """Same-size images measured together or alone give the same bits."""
    heads = _heads(check)
    together = heads.image_readings(images[:3] + images[:3])
    alone = [heads.image_reading(im) for im in images[:3]]
    assert together == alone + alone


def test_a_stopped_child_costs_one_batch_and_never_blocks_the_caller(proc, check):
    """A child that stops reading (SIGSTOP) with batches larger than the pipe's buffer:
    handing them over returns at once; closing kills and reaps it; the next batch gets a
    new child and its right readings."""
    big = [Image.fromarray(np.random.default_rng(k).integers(0, 256, (256, 256, 3),
                                                             dtype=np.uint8))
           for k in range(3)]                              # 590 KB > a 64 KB pipe
    stopped = proc.proc
    os.kill(stopped.pid, signal.SIGSTOP)
    t = time.monotonic()
    futs = [proc.submit(big) for _ in range(3)]
    assert time.monotonic() - t < 2.0
    with pytest.raises(TimeoutError):
        futs[0].result(timeout=0.5)
    proc.close(kill=True)
    assert stopped.poll() is not None                      # killed while stopped, reaped
    for f in futs:
        with pytest.raises(RuntimeError, match="ended"):
            f.result(timeout=10)
    assert proc.submit(big[:1]).result(timeout=60) == _heads(check).image_readings(big[:1])
    assert proc.proc is not stopped


def test_an_old_childs_end_fails_only_its_own_batches(proc, check, images):
    old = proc.box["child"]
    os.kill(old.proc.pid, signal.SIGSTOP)
    lost = proc.submit(images[:1])
    proc.close(kill=True)                                  # the old child's EOF follows
    kept = proc.submit(images[1:2])
    with pytest.raises(RuntimeError):
        lost.result(timeout=10)
    assert kept.result(timeout=60) == _heads(check).image_readings(images[1:2])


def test_children_that_keep_dying_are_given_up_and_the_service_checks_itself(
        served, images, monkeypatch):
    import heads.check_process as cp

    monkeypatch.setattr(cp.sys, "executable", shutil.which("false"))   # dies at once
    svc, heads = served
    items = [AnswerItem(im, "what shape is it?", 2) for im in images[:2]]
    want = [heads.image_reading(i.image) for i in items]
    for _ in range(cp.MAX_DEATHS + 1):
        out = svc.answer_batch(items, [math.inf] * len(items))
        assert [(r.image_check.score, r.image_check.p_value) for r in out] == \
            [(w.score, w.p_value) for w in want]
    deadline = time.monotonic() + 10
    while not svc.check_process.given_up and time.monotonic() < deadline:
        svc.answer_batch(items[:1], [math.inf])
    assert svc.check_process.given_up


def test_a_child_that_cannot_start_leaves_the_check_to_the_service(served, images,
                                                                   monkeypatch):
    import heads.check_process as cp

    def no_fds(*a, **k):
        raise OSError(24, "Too many open files")

    svc, heads = served
    monkeypatch.setattr(cp.subprocess, "Popen", no_fds)
    items = [AnswerItem(im, "what shape is it?", 2) for im in images[:2]]
    out = svc.answer_batch(items, [math.inf] * len(items))
    assert [r.image_check.score for r in out] == \
        [heads.image_reading(i.image).score for i in items]


def test_service_answers_carry_the_process_readings(served, images):
    """`/answer`'s batch path with the check in its process: each item's image check is the
    heads' own reading of its image, in order."""
    svc, heads = served
    assert svc.check_process is not None
    items = [AnswerItem(im, "what shape is it?", 4) for im in images[:4]]
    out = svc.answer_batch(items, [math.inf] * len(items))
    for res, want in zip(out, heads.image_readings([i.image for i in items])):
        assert (res.image_check.score, res.image_check.p_value, res.image_check.novel) \
            == (want.score, want.p_value, want.novel)


def test_a_check_that_never_answers_does_not_hold_the_model_worker(served, images,
                                                                   monkeypatch):
    """The batch waits CHECK_WAIT_S for its image check, then kills the silent process and
    checks its images itself; answers keep coming."""
    from concurrent.futures import Future

    import app.service as service_module

    svc, heads = served
    monkeypatch.setattr(service_module, "CHECK_WAIT_S", 0.2)
    killed = []
    monkeypatch.setattr(svc.check_process, "submit", lambda imgs: Future())   # never done
    monkeypatch.setattr(svc.check_process, "close", lambda kill=False: killed.append(kill))
    items = [AnswerItem(im, "what shape is it?", 3) for im in images[:2]]
    out = svc.answer_batch(items, [math.inf] * len(items))
    assert killed == [True]
    for item, res in zip(items, out):
        want = heads.image_reading(item.image)
        assert (res.image_check.score, res.image_check.p_value) == (want.score, want.p_value)


def test_a_child_that_never_answers_is_given_up_then_tried_again(served, images,
                                                                 monkeypatch):
    """Timing out counts as a death: after MAX_DEATHS batches that each waited
    CHECK_WAIT_S, batches stop waiting (images checked in the server); after
    RETRY_AFTER_S one more child is tried."""
    from concurrent.futures import Future

    import app.service as service_module
    import heads.check_process as cp

    svc, heads = served
    monkeypatch.setattr(service_module, "CHECK_WAIT_S", 0.2)
    submitted = []

    def silent(imgs):
        svc.check_process.start()                  # a child that exists, never answers
        submitted.append(len(imgs))
        return Future()

    monkeypatch.setattr(svc.check_process, "submit", silent)
    items = [AnswerItem(im, "what shape is it?", 2) for im in images[:2]]
    want = [heads.image_reading(i.image).score for i in items]
    for _ in range(cp.MAX_DEATHS):
        out = svc.answer_batch(items, [math.inf] * len(items))
        assert [r.image_check.score for r in out] == want
    assert svc.check_process.given_up and len(submitted) == cp.MAX_DEATHS
    t = time.monotonic()
    out = svc.answer_batch(items, [math.inf] * len(items))
    assert [r.image_check.score for r in out] == want
    assert len(submitted) == cp.MAX_DEATHS and time.monotonic() - t < 10
    monkeypatch.setattr(cp, "RETRY_AFTER_S", 0.0)
    assert not svc.check_process.given_up
    svc.answer_batch(items[:1], [math.inf])
    assert len(submitted) == cp.MAX_DEATHS + 1


def test_the_bench_control_leaves_out_the_image_check_and_nothing_else(served, images):
    """`no_check` (bench): the same actor and heads, the image check left out; the
    service it is measured against keeps its check and its process."""
    from dataclasses import fields

    from bench.inprocess import (
        answer_with_dualread,
        run_modes,
        summarise,
        without_image_check,
    )

    svc, heads = served
    bare = without_image_check(svc)
    assert bare.check_process is None and bare.heads.image_check is None
    assert svc.check_process is not None and heads.image_check is not None
    assert bare.actor is svc.actor
    for f in fields(heads):           # everything else is the served heads' own
        if f.name != "image_check":
            assert getattr(bare.heads, f.name) is getattr(heads, f.name), f.name
    items = [AnswerItem(im, "what shape?", 4) for im in images[:2]]
    _, checked = svc.answer_responses(items, [math.inf] * 2)
    _, unchecked = bare.answer_responses(items, [math.inf] * 2)
    assert all(r.image_check is not None for r in checked)
    assert all(r.image_check is None for r in unchecked)
    for a, b in zip(checked, unchecked):
        assert (a.answer, a.confidence, a.novelty) == (b.answer, b.confidence, b.novelty)
    assert len(answer_with_dualread(bare, images[:2], ["what shape?"] * 2, 4)) == 2
    # with an image check to leave out, the bench runs the control and reports it
    blk = summarise(run_modes(svc, [(im, "what shape?") for im in images[:2]], 1, 3), 10)
    assert blk["no_check_ratio"] > 0 and blk["capture_over_no_check"] > 0
