"""Probe maths on constructed cases, the client's retry policy, resumable storage, and
every probe against a live tiny service (a real uvicorn process)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from clients.probes import ccg as ccg_probe
from clients.probes import emvr as emvr_probe
from clients.probes import images, stats, text
from clients.probes import reliance as reliance_probe
from clients.probes import tgs as tgs_probe
from clients.probes.runner import Config, Store
from tests.helpers import assert_reports_close, live_servers, probe_items, random_heads

CFG = Config(data="test", bootstrap=200)
IFACES = ("dualread", "psr", "per", "verbalized")
TRAJ = ("<think>I see a red circle. The question asks for the colour, so the answer is "
        "red.</think><answer>red</answer><confidence>9</confidence>")
TRAJ_YN = ("<think>I see a blue triangle. The question asks if there is a red shape; the "
           "colour is blue, so the answer is no.</think><answer>no</answer>"
           "<confidence>8</confidence>")


def conf(x: float) -> dict:
    return {k: x for k in IFACES}


# ---------------------------------------------------------------- CCG (docs/method.md §2)
def ccg_record(image: str, c_real: float, c_hn: float, z_real=True, z_hn=False,
               a_real="red", a_hn="red") -> dict:
    return {"eligible": True, "image_id": image, "donor": "d" + image, "donor_image": "D" + image,
            "real": {"z": z_real, "a": a_real, "c": conf(c_real)},
            "hn": {"z": z_hn, "a": a_hn, "c": conf(c_hn)}}


@pytest.mark.parametrize("c_hn, expected", [(0.2, 1.0), (0.9, 0.0), (0.6, 0.5)])
def test_ccg_auc_drop_rise_tie(c_hn, expected):
    """A confidence that always drops on the donor scores 1, always rises 0, ties ½."""
    recs = [ccg_record(f"img{i}", 0.6, c_hn) for i in range(6)]
    recs.append(ccg_record("both-right", 0.1, 0.9, z_hn=True))      # not decisive: ignored
    recs.append({"eligible": False, "image_id": "lonely"})           # no donor: not in P
    s = ccg_probe.summarise(recs, CFG)
    for k in IFACES:
        assert s[k]["natural"] == pytest.approx(expected)
        assert s[k]["strict"] == pytest.approx(expected)
        assert (s[k]["n_eligible"], s[k]["n_decisive"], s[k]["n_strict"]) == (7, 6, 6)
        assert s[k]["source_images"] == 6 and s[k]["donor_images"] == 6
        assert s[k]["underpowered"] is True
    assert s["actor"]["vbr"] == pytest.approx(6 / 7)


def test_ccg_strict_needs_the_same_canonical_answer():
    recs = [ccg_record("a", 0.9, 0.1), ccg_record("b", 0.1, 0.9, a_hn="blue"),
            ccg_record("c", 0.5, 0.5, a_real="", a_hn="")]
    s = ccg_probe.summarise(recs, CFG)["dualread"]
    assert s["natural"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert s["n_strict"] == 1 and s["strict"] == pytest.approx(1.0)


# ---------------------------------------------------------------- EMVR (docs/method.md §4)
def test_emvr_tvr_by_hand():
    monotone = np.array([[0.9, 0.8, 0.8, 0.5, 0.1], [1, 1, 1, 1, 1]], float)
    assert stats.emvr(monotone) == 0.0 and stats.tvr(monotone) == 0.0
    r = np.array([[0.9, 0.95, 0.8, 0.85, 0.1],     # two rises of four
                  [0.5, 0.4, 0.3, 0.2, 0.1]])      # none
    assert stats.emvr(r) == pytest.approx(2 / 8)
    assert stats.tvr(r) == pytest.approx(1 / 2)


def emvr_record(image: str, rows: dict[str, list[float]], acc: list[bool]) -> dict:
    rec = {"image_id": image, "box": [0, 0, 4, 4], "control_box": [10, 10, 14, 14]}
    for v, cs in rows.items():
        rec[v] = [{"z": z, "a": "x", "c": conf(c)} for z, c in zip(acc, cs)]
    return rec


def test_emvr_summary_on_constructed_trajectories():
    down = [0.9, 0.7, 0.5, 0.3, 0.1]
    zigzag = [0.5, 0.6, 0.4, 0.7, 0.2]                      # 2 rises of 4
    recs = [emvr_record("a", {"mask": down, "blur": zigzag, "control": down},
                        [True, True, False, False, False]),
            emvr_record("b", {"mask": down, "blur": down, "control": zigzag},
                        [True, True, True, True, True])]
    s = emvr_probe.summarise(recs, CFG)
    for k in IFACES:
        assert s[k]["mask"] == 0.0 and s[k]["tvr_mask"] == 0.0
        assert s[k]["blur"] == pytest.approx(2 / 8) and s[k]["tvr_blur"] == 0.5
        assert s[k]["control"] == pytest.approx(2 / 8)
        assert s[k]["confidence_mask"]["0.5"] == pytest.approx(0.5)
    assert s["actor"]["accuracy_mask"]["0.5"] == pytest.approx(0.5)
    # drop clean → full: critical (1 + 0)/2, control identical here → difference 0
    assert s["actor"]["drop_critical"] == pytest.approx(0.5)
    assert s["actor"]["drop_difference"] == pytest.approx(0.0)


# ---------------------------------------------------------------- TGS (docs/method.md §3)
def tgs_record(image: str, good: float, masked: float, bad: float, z: bool = True) -> dict:
    scores = {"good": conf(good), "vision": conf(bad), "reasoning": conf(bad),
              "answer": conf(bad)}
    for ratio in (0.25, 0.5, 0.75):
        for seed in (0, 1, 2):
            scores[f"mask:{ratio:g}:{seed}"] = conf(good + (masked - good) * ratio)
    scores["mask:1:0"] = conf(masked)
    return {"image_id": image, "z": z, "masked_tokens": 10, "scores": scores,
            "variants": {}, "hesitations": 0}


def test_tgs_of_an_interface_that_ignores_the_trajectory_is_zero():
    recs = [tgs_record(f"i{k}", 0.7, 0.7, 0.7) for k in range(5)]
    s = tgs_probe.summarise(recs, CFG)
    for k in IFACES:
        assert s[k]["self"] == 0.0 and s[k]["pair"] == 0.0
        assert all(s[k][f"pair_{a}"] == 0.0 for a in tgs_probe.AXES)
        assert s[k]["p_jsd_le_0.1_vision"] == 1.0
        assert list(s[k]["curve"].values()) == pytest.approx([0.7] * 5)
    assert s["hesitation"] == "none"


def test_tgs_keys_exist_when_nothing_could_be_scored():
    empty = {"image_id": "a", "z": True, "interfaces": list(IFACES), "masked_tokens": 0,
             "scores": {}, "variants": {}, "hesitations": 0}
    s = tgs_probe.summarise([empty], CFG)
    assert s["n_self"] == 0 and s["n_pair_vision"] == 0
    for k in IFACES:
        assert math.isnan(s[k]["self"]) and math.isnan(s[k]["pair"])


def test_tgs_grounded_interface_by_hand():
    recs = [tgs_record("a", 0.9, 0.5, 0.2), tgs_record("b", 0.8, 0.6, 0.4),
            tgs_record("c", 0.8, 0.0, 0.0, z=False)]    # wrong answer: no pair
    s = tgs_probe.summarise(recs, CFG)["dualread"]
    assert s["self"] == pytest.approx(((0.9 - 0.5) + (0.8 - 0.6) + 0.8) / 3)
    assert s["pair_vision"] == pytest.approx(((0.9 - 0.2) + (0.8 - 0.4)) / 2)
    assert s["pair"] == pytest.approx(0.55)
    assert s["curve"]["0.5"] == pytest.approx(np.mean([0.7, 0.7, 0.4]))


def test_auroc_matches_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    c = rng.integers(0, 5, 200) / 4                      # many ties
    z = rng.uniform(size=200) < c * 0.8
    assert stats.auroc(c, z) == pytest.approx(roc_auc_score(z, c), abs=1e-12)
    assert math.isnan(stats.auroc(c, np.ones(200, bool)))


def test_jsd_matches_scipy():
    from scipy.spatial.distance import jensenshannon

    p, q = np.array([0.9, 0.5, 0.0, 0.3]), np.array([0.2, 0.5, 1.0, 0.31])
    want = [jensenshannon([a, 1 - a], [b, 1 - b], base=2) ** 2 for a, b in zip(p, q)]
    assert stats.jsd_bernoulli(p, q) == pytest.approx(want, abs=1e-12)
    assert stats.share_close(p, q, 0.1) == pytest.approx(np.mean(np.array(want) <= 0.1))


# ---------------------------------------------------------------- trajectory rules
def test_variants_change_one_axis_only():
    v = text.vision_variant(TRAJ, "what color is the shape?", "k")
    assert v is not None and v != TRAJ
    head, rest = v.split(".", 1)
    assert head.startswith("<think>I see a ") and "circle" in head and "red" not in head
    assert rest == TRAJ.split(".", 1)[1]                      # reasoning + answer byte-equal
    r = text.reasoning_variant(TRAJ)
    assert r == TRAJ.replace("asks for the colour", "asks for the shape")
    a = text.answer_variant(TRAJ, "k")
    assert a.split("<answer>")[0] == TRAJ.split("<answer>")[0]
    assert a.split("<answer>")[1].split("</answer>")[0] in set(text.COLOURS) - {"red"}
    assert text.answer_variant(TRAJ_YN, "k") == TRAJ_YN.replace(
        "<answer>no</answer>", "<answer>yes</answer>")
    assert text.reasoning_variant(TRAJ_YN) == TRAJ_YN.replace("there is a red",
                                                              "there is no red")
    # the yes/no question is about colour: the observed colour is what changes
    yn = text.vision_variant(TRAJ_YN, "is there a red shape?", "k")
    assert "triangle" in yn.split(".")[0] and "blue" not in yn.split(".")[0]
    assert text.vision_variant("plain text answer", "q?", "k") is None


def test_hesitation_cuts():
    t = ("<think>I see a red circle. Wait, the colour may be off. It is red. Actually it "
         "is red.</think><answer>red</answer>")
    cuts = text.hesitations(t)
    assert len(cuts) == 2
    assert cuts[0] == ("<think>I see a red circle.</think><answer>red</answer>",
                       "<think>I see a red circle. Wait, the colour may be off.</think>"
                       "<answer>red</answer>")
    assert cuts[1][1].endswith("Actually it is red.</think><answer>red</answer>")
    # a post cut stops where the next marker starts (TGS A.3)
    two = text.hesitations("<think>Hmm, let me recheck it.</think><answer>red</answer>")
    assert two[0][1] == "<think>Hmm,</think><answer>red</answer>"
    assert text.hesitations(TRAJ) == []


def test_novel_visual_claim():
    q = "is there a red circle?"
    assert text.novel_visual_claim("I see a blue circle.", q)          # "see", "blue"
    assert not text.novel_visual_claim("is there a red circle", q)     # copied
    assert not text.novel_visual_claim("The answer follows from the question.", q)


# ---------------------------------------------------------------- reliance (docs/method.md §5)
def test_reliance_metrics_by_hand():
    zr = [1, 1, 1, 0, 1]
    zb = [0, 1, 0, 0, 0]
    zs = [0, 1, 1, 1, 0]
    same = [False, True, True, False, False]
    nvc = [True, True, False, True, False]
    m = stats.reliance(zr, zb, zs, same, nvc)
    assert m["vrs"] == pytest.approx(4 / 5 - 3 / 5) and m["bd"] == pytest.approx(4 / 5 - 1 / 5)
    assert m["is"] == pytest.approx(3 / 5)
    assert m["vbr"] == pytest.approx(2 / 5) and m["vhr"] == pytest.approx(1 / 5)
    assert m["nvcr"] == pytest.approx(3 / 5) and m["hvrr"] == pytest.approx(1 / 5)
    assert m["p_invariant_given_nvc"] == pytest.approx(1 / 3)


def test_sign_flip_test_against_exact_enumeration():
    # ten items all +1: of the 2^10 sign patterns only the two constant ones reach |mean| 1
    assert stats.sign_flip_p(np.ones(10), 20000) == pytest.approx(2 / 1024, abs=1.5e-3)
    assert stats.sign_flip_p(np.array([1.0, -1.0] * 5), 2000) == 1.0


def test_reliance_summary_flags():
    recs = [{"image_id": f"i{k}", "shuffle_image": "x", "nvc": True,
             "real": {"z": True, "a": "red", "c": conf(0.9)},
             "blank": {"z": False, "a": "no", "c": conf(0.4)},
             "shuffle": {"z": False, "a": "blue", "c": conf(0.5)}} for k in range(8)]
    s = reliance_probe.summarise(recs, CFG)
    assert s["vrs"] == 1.0 and s["bd"] == 1.0 and s["is"] == 1.0 and s["hvrr"] == 0.0
    assert s["vrs_p"] < 0.02
    assert s["confidence"]["dualread"] == pytest.approx({"real": 0.9, "blank": 0.4,
                                                         "shuffle": 0.5})


# ---------------------------------------------------------------- image conditions
def test_mask_area_scales_with_severity():
    img = Image.new("RGB", (64, 64), (255, 0, 0))
    box = (8, 8, 48, 40)                                      # 40 × 32
    for lam in (0.25, 0.5, 1.0):
        a = np.asarray(images.mask_region(img, box, lam, "gray"))   # geometry: a visible fill
        gray = (a == 128).all(-1).sum()
        assert gray == pytest.approx(lam * 40 * 32, rel=0.08)
        ys, xs = np.nonzero((a == 128).all(-1))
        assert abs((xs.min() + xs.max() + 1) / 2 - 28) <= 1    # centred on the box
    assert (np.asarray(images.mask_region(img, box, 0.0)) == np.asarray(img)).all()


def test_blur_touches_only_the_box():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    box = (10, 10, 40, 30)
    assert images.blur_radius(box, 1.0) == pytest.approx(0.15 * 20)
    assert images.blur_radius((0, 0, 400, 400), 1.0) == 24
    a, b = np.asarray(img), np.asarray(images.blur_region(img, box, 1.0))
    outside = np.ones((64, 64), bool)
    outside[10:30, 10:40] = False
    assert (a[outside] == b[outside]).all() and (a[~outside] != b[~outside]).any()


def test_control_box_search():
    # 64×64 image, critical box in the top-left corner: the farthest same-size box
    # with no overlap is the bottom-right corner.
    assert images.control_box((0, 0, 20, 20), (64, 64)) == (44, 44, 64, 64)
    # another object annotated there: the search avoids it and takes the next-farthest
    got = images.control_box((0, 0, 20, 20), (64, 64), others=[(40, 40, 64, 64)])
    assert images.intersection(got, (40, 40, 64, 64)) == 0
    assert images.iou(got, (0, 0, 20, 20)) <= 0.05
    assert images.control_box((0, 0, 60, 60), (64, 64)) is None    # no room


# ---------------------------------------------------------------- storage and client
def test_run_parameters_of_every_probe():
    """The fields a stored run is matched on (written out by hand: a change here silently
    orphans every stored result, so it must be deliberate)."""
    cfg = Config(data="d.jsonl", seed=3, max_new_tokens=16, severities=(0.0, 1.0),
                 mask_ratios=(0.0, 0.5), mask_seeds=(0, 1), deployment={"actor": "a"})
    common = {"format": 1, "data": "d.jsonl", "max_new_tokens": 16,
              "deployment": {"actor": "a"}}
    assert ccg_probe.params(cfg) == {"probe": "ccg", "seed": 3, **common}
    assert reliance_probe.params(cfg) == {"probe": "reliance", "seed": 3, **common}
    assert emvr_probe.params(cfg) == {"probe": "emvr", "severities": [0.0, 1.0],
                                      "fill": "background", **common}
    assert tgs_probe.params(cfg) == {"probe": "tgs", "seed": 3, "ratios": [0.0, 0.5],
                                     "seeds": [0, 1], "alternatives": 5, "external": 1,
                                     **common}


def test_store_resumes_and_drops_a_half_written_line(tmp_path):
    path = tmp_path / "p.jsonl"
    s = Store(path, {"a": 1})
    s.add("x", {"v": 1})
    s.add("y", {"v": 2})
    s.close()
    with open(path, "a") as fh:                        # a kill in the middle of a write
        fh.write('{"id": "z", "tag": "')
    s2 = Store(path, {"a": 1})
    assert s2.done == {"x": {"v": 1}, "y": {"v": 2}}
    s2.add("z", {"v": 3})
    s2.close()
    assert Store(path, {"a": 1}).done["z"] == {"v": 3}
    assert Store(path, {"a": 2}).done == {}            # other parameters: nothing reused


def test_probes_send_computed_pixels_of_corrupted_items(tmp_path):
    from dataclasses import dataclass

    from clients.probes.runner import pixels
    from models.data import Item

    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "a.png")
    plain = Item("1", str(tmp_path / "a.png"), "q", "a", "img")
    assert pixels(plain)() == tmp_path / "a.png"           # the file's own bytes

    @dataclass(frozen=True)
    class Dark(Item):
        def image(self) -> Image.Image:
            return Image.new("RGB", (8, 8), (0, 0, 0))

    sent = pixels(Dark("1", str(tmp_path / "a.png"), "q", "a", "img"))()
    assert isinstance(sent, bytes)
    assert np.asarray(Image.open(io.BytesIO(sent))).max() == 0


def _score_body(x: float) -> dict:
    return {"confidence": conf(x), "mu_c": x, "answer": "red", "masked_tokens": 0}


def test_client_retries_and_honours_retry_after(monkeypatch):
    from clients import http as h

    slept: list[float] = []
    monkeypatch.setattr(h.time, "sleep", slept.append)
    calls = []
    answer = {"answer": "red", "response": "r", "confidence": conf(0.5), "defer": False,
              "defer_threshold": 0.5, "model": "m", "heads": "h", "request_id": "x",
              "timings_ms": {"queue": 0, "generate": 0, "readout": 0, "heads": 0}}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        n = len(calls)
        if n == 1:
            return httpx.Response(429, headers={"Retry-After": "2"}, json={"detail": "full"})
        if n == 2:
            raise httpx.ConnectError("refused", request=request)
        if n == 3:
            return httpx.Response(503, json={"detail": "loading"})
        if n == 4:     # the service's own 408: the body never came, nothing ran
            return httpx.Response(408, headers={"Retry-After": "1"},
                                  json={"detail": "request body not received"})
        return httpx.Response(200, json=answer)

    c = h.DualReadClient("http://t", transport=httpx.MockTransport(handler), backoff_base=0.1)
    assert c.answer(b"img", "q").answer == "red"
    assert len(calls) == 5
    assert slept[0] == 2.0                                   # the server's Retry-After
    assert 0.05 * 2 <= slept[1] <= 0.1 * 2 and 0.05 * 4 <= slept[2] <= 0.1 * 4   # backoff
    assert slept[3] == 1.0

    calls.clear()
    c422 = h.DualReadClient("http://t", transport=httpx.MockTransport(
        lambda r: (calls.append(1), httpx.Response(422, json={"detail": "bad"}))[1]))
    with pytest.raises(httpx.HTTPStatusError, match="422.*bad"):
        c422.answer(b"img", "q")
    assert len(calls) == 1                                   # never retried
    calls.clear()
    c408 = h.DualReadClient("http://t", transport=httpx.MockTransport(   # a proxy's timeout
        lambda r: (calls.append(1), httpx.Response(408, json={"detail": "timed out"}))[1]))
    with pytest.raises(httpx.HTTPStatusError, match="408"):
        c408.answer(b"img", "q")
    assert len(calls) == 1                                   # may have run: not repeated
    always = h.DualReadClient("http://t", retries=2, transport=httpx.MockTransport(
        lambda r: httpx.Response(429, json={"detail": "full"})))
    with pytest.raises(httpx.HTTPStatusError, match="429"):
        always.answer(b"img", "q")


def test_async_client_retries_only_a_408_that_says_retry_after(monkeypatch):
    from clients import http as h

    slept: list[float] = []

    async def no_wait(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(h.asyncio, "sleep", no_wait)
    answer = {"answer": "red", "response": "r", "confidence": conf(0.5), "defer": False,
              "defer_threshold": 0.5, "model": "m", "heads": "h", "request_id": "x",
              "timings_ms": {"queue": 0, "generate": 0, "readout": 0, "heads": 0}}

    def run(first: httpx.Response) -> tuple[list[int], object]:
        calls: list[int] = []

        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(1)
            return first if len(calls) == 1 else httpx.Response(200, json=answer)

        async def go():
            async with h.AsyncDualReadClient("http://t", transport=httpx.MockTransport(
                    handler)) as c:
                try:
                    return await c.answer(b"img", "q")
                except httpx.HTTPStatusError as e:
                    return e
        return calls, asyncio.run(go())

    calls, got = run(httpx.Response(408, headers={"Retry-After": "1"}, json={"detail": "x"}))
    assert len(calls) == 2 and got.answer == "red" and slept == [1.0]
    calls, got = run(httpx.Response(408, json={"detail": "proxy timeout"}))
    assert len(calls) == 1 and isinstance(got, httpx.HTTPStatusError)


def _score_batch_70(kind: str, handler) -> list:
    """70 trajectories through the blocking or the async client, against `handler`."""
    from clients.http import AsyncDualReadClient, DualReadClient

    trajs = [f"t{i}" for i in range(70)]
    transport = httpx.MockTransport(handler)
    if kind == "sync":
        with DualReadClient("http://t", transport=transport) as c:
            return c.score_batch(b"img", "q", trajs)

    async def go() -> list:
        async with AsyncDualReadClient("http://t", transport=transport, concurrency=2) as c:
            return await c.score_batch(b"img", "q", trajs)

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_score_batch_chunks_and_falls_back(kind):
    seen: list[tuple[str, int]] = []

    def batch_server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, len(body["trajectories"])))
        return httpx.Response(200, json={"results": [_score_body(len(seen) / 10)
                                                     for _ in body["trajectories"]],
                                         "request_id": "r"})

    res = _score_batch_70(kind, batch_server)
    assert seen == [("/probe/score_batch", 64), ("/probe/score_batch", 6)]
    assert len(res) == 70 and res[63].mu_c == 0.1 and res[64].mu_c == 0.2

    seen.clear()

    def old_server(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, 1))
        if request.url.path == "/probe/score_batch":
            return httpx.Response(404, json={"detail": "Not Found"})
        i = int(json.loads(request.content)["response"][1:])
        return httpx.Response(200, json={**_score_body(i / 100), "request_id": "r"})

    res = _score_batch_70(kind, old_server)
    assert [r.mu_c for r in res] == pytest.approx([i / 100 for i in range(70)])
    # one probe of the batch route, then one /probe/score per trajectory
    assert [p for p, _ in seen].count("/probe/score_batch") == 1
    assert [p for p, _ in seen].count("/probe/score") == 70

    seen.clear()

    def refusing_server(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, 1))
        return httpx.Response(422, json={"detail": "trajectories.3: bad"})

    with pytest.raises(httpx.HTTPStatusError, match="422"):
        _score_batch_70(kind, refusing_server)
    assert seen == [("/probe/score_batch", 1)]     # an error, not a reason to fall back


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_score_batch_halves_a_batch_the_server_cannot_queue(kind):
    """A server with `--queue-limit 12` answers 413 to a batch of more than 12 trajectories
    (a 429 would be retried forever): the client halves the batch until it fits, keeps
    that size, and still returns every result in order."""
    seen: list[int] = []

    def small_queue(request: httpx.Request) -> httpx.Response:
        trajs = json.loads(request.content)["trajectories"]
        seen.append(len(trajs))
        if len(trajs) > 12:
            return httpx.Response(413, json={"detail": "request needs more model jobs than "
                                                       "this server queues at once"})
        return httpx.Response(200, json={"results": [_score_body(int(t["response"][1:]) / 100)
                                                     for t in trajs], "request_id": "r"})

    res = _score_batch_70(kind, small_queue)
    assert [r.mu_c for r in res] == pytest.approx([i / 100 for i in range(70)])
    # 64, 32 and 16 refused; then batches of 8, the last one the 6 left over
    assert seen == [64, 32, 16] + [8] * 8 + [6]

    seen.clear()

    def too_big_alone(request: httpx.Request) -> httpx.Response:
        seen.append(len(json.loads(request.content)["trajectories"]))
        return httpx.Response(413, json={"detail": "image over its limit"})

    with pytest.raises(httpx.HTTPStatusError, match="413"):
        _score_batch_70(kind, too_big_alone)
    assert seen == [64, 32, 16, 8, 4, 2, 1]        # a lone trajectory's 413 is raised


# ---------------------------------------------------------------- a live tiny service
@pytest.fixture(scope="module")
def service(actor_dirs, actors, tmp_path_factory):
    """The tiny random Qwen3-VL actor with random heads behind `dualread serve`."""
    heads = random_heads(tmp_path_factory.mktemp("probe-heads"), actors["qwen3_vl"])
    with live_servers(actor_dirs["qwen3_vl"], heads, max_new_tokens=12, max_batch_size=16,
                      batch_wait_ms=20, queue_limit=64) as (url,):
        yield url


def _dataset(folder: Path, n_images: int) -> str:
    """JSONL items: a colour question on every image (answers differ → donors), a yes/no
    question on every image, and one shape question with no possible donor."""
    rng = np.random.default_rng(0)
    colours = ["red", "blue", "green"]
    rows = []
    for i in range(n_images):
        Image.fromarray(rng.integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(
            folder / f"{i}.png")
        box = [4 + i % 3, 4, 24, 20]
        rows.append({"id": f"c{i}", "image": f"{i}.png", "question": "what color is the shape?",
                     "answer": colours[i % 3], "box": box})
        rows.append({"id": f"y{i}", "image": f"{i}.png", "question": "is there a red shape?",
                     "answer": "yes" if i % 3 == 0 else "no", "box": box})
    rows.append({"id": "s0", "image": "0.png", "question": "what shape is it?",
                 "answer": "circle", "box": [4, 4, 24, 20]})
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def test_every_probe_against_a_live_service(service, tmp_path):
    from typer.testing import CliRunner

    from app.cli import app

    data = _dataset(tmp_path, 2)                       # 5 items
    out = tmp_path / "all"
    res = CliRunner().invoke(app, ["probe", "all", "--url", service, "--data", data, "--out",
                                   str(out), "--concurrency", "4", "--bootstrap", "50",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    for k in IFACES:
        c = rep["ccg"][k]
        assert c["n_eligible"] == 4                    # every item but the shape question
        assert 0 <= c["n_strict"] <= c["n_decisive"] <= c["n_eligible"]
        assert {"natural", "strict"} <= set(c)
        assert {"self", "pair", "pair_vision", "pair_reasoning", "pair_answer"} <= set(
            rep["tgs"][k])
        e = rep["emvr"][k]
        assert {"mask", "blur", "control", "tvr_mask"} <= set(e)
        assert all(v is None or 0 <= v <= 1 for v in (e["mask"], e["blur"], e["tvr_mask"]))
    assert rep["emvr"]["n_trajectories"] == 5
    # the paper's JSD reads the 11-way P(C) the service returns with each scored trajectory
    assert {f"n_jsd11_pairs_{a}" for a in ("vision", "reasoning", "answer")} <= set(
        rep["tgs"]["verbalized"])
    for line in (out / "tgs.jsonl").read_text().splitlines():
        rec = json.loads(line)["record"]
        for d in rec.get("digits", {}).values():
            assert len(d) == 11 and abs(sum(d) - 1) < 1e-3
        # the gold-conditioned trajectory and its variants are scored for every item
        assert {"gold", "gold:reasoning", "gold:answer"} <= set(rec["scores"])
        assert rec["tau"] is not None and set(rec["real_c"]) == set(IFACES)
    assert rep["tgs"]["n_gold"] == 5
    assert {"gold_pair", "heldout_pair_own", "heldout_pair_gold", "heldout"} <= set(
        rep["tgs"]["dualread"])
    assert 0 <= rep["tgs"]["deferral"]["own_wrong"]["n"] <= 5
    r = rep["reliance"]
    assert {"vrs", "bd", "is", "vbr", "vhr", "nvcr", "hvrr"} <= set(r) and r["n"] == 5
    assert -1 <= r["vrs"] <= 1 and 0 <= r["is"] <= 1
    # the report agrees with the stored per-item results
    rows = [json.loads(x)["record"] for x in (out / "reliance.jsonl").read_text().splitlines()]
    assert r["acc_blank"] == pytest.approx(np.mean([x["blank"]["z"] for x in rows]))
    assert len((out / "tgs.jsonl").read_text().splitlines()) == 5
    for f in ("report.md", "summary.md", "ccg_scatter.png", "tgs.png", "emvr_curves.png",
              "reliance.png"):
        assert (out / f).stat().st_size > 0
    assert "# Probe summary" in (out / "report.md").read_text()
    again = CliRunner().invoke(app, ["probe", "all", "--url", service, "--data", data,
                                     "--out", str(out), "--bootstrap", "50", "--no-progress"])
    assert again.exit_code == 0 and "0 items run, 5 resumed" in " ".join(again.output.split())
    assert json.loads((out / "report.json").read_text()) == rep


def test_resume_after_kill_gives_the_same_report(service, tmp_path):
    data = _dataset(tmp_path, 5)                        # 11 items

    def cmd(out: Path) -> list[str]:
        return [sys.executable, "-m", "app.cli", "probe", "reliance", "--url", service,
                "--data", data, "--out", str(out), "--concurrency", "1", "--bootstrap", "50",
                "--no-progress"]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = killed / "reliance.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if results.exists() and len(results.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(30)
    lines = len(results.read_text().splitlines())
    assert proc.returncode == -signal.SIGKILL and 3 <= lines < 11, (proc.returncode, lines)
    assert not (killed / "report.json").exists()

    subprocess.run(cmd(killed), check=True, stdout=subprocess.DEVNULL, timeout=300)
    run = json.loads((killed / "run.json").read_text())
    assert run["items_resumed"] == lines and run["items_run"] == 11 - lines
    whole = tmp_path / "whole"
    subprocess.run(cmd(whole), check=True, stdout=subprocess.DEVNULL, timeout=300)
    a = json.loads((killed / "report.json").read_text())
    b = json.loads((whole / "report.json").read_text())
    assert_reports_close(a, b)
    assert a["reliance"]["n"] == 11 and a["reliance"]["is"] is not None


# ---------------------------------------------------------------- evidence-order head
def _order_data(n: int = 120, seed: int = 0):
    """Five severities; f1 falls with severity, f2 is a zigzag that predicts the label as
    well: a BCE-only head leans on both and zigzags, the order hinge should not."""
    from clients.probes.order import Trajectories

    rng = np.random.default_rng(seed)
    lam = np.linspace(0, 1, 5)
    f1 = 1 - lam[None] + rng.normal(0, 0.05, (n, 5))
    f2 = np.tile([0.0, 1.0, -1.0, 1.0, -1.0], (n, 1)) + rng.normal(0, 0.1, (n, 5))
    z = ((f1 - 0.5 + 0.6 * f2 + rng.normal(0, 0.3, (n, 5))) > 0).astype(float)
    return Trajectories(np.stack([f1, f2], -1), z, [f"q{i}" for i in range(n)])


def test_order_hinge_lowers_emvr_where_bce_zigzags():
    from clients.probes.order import fit_head

    t = _order_data()
    bce = fit_head(t.x, t.z, 0.0, steps=600)
    order = fit_head(t.x, t.z, 5.0, steps=600)
    e_bce, e_order = stats.emvr(bce.logits(t.x)), stats.emvr(order.logits(t.x))
    assert e_bce >= 0.4                      # leans on the zigzag: rises at k = 1 and 3
    assert e_order < e_bce - 0.2
    assert bce.w[0] > 0                      # both still read the evidence feature


def test_order_compare_reports_out_of_fold_differences():
    from clients.probes.order import compare, group_folds

    folds = group_folds(["a", "a", "b", "c", "c", "d"], 2)
    assert folds[0] == folds[1] and folds[3] == folds[4]
    t = _order_data(60)
    res = compare(t, t, folds=3, order_weight=5.0, steps=300, resamples=100)
    for test in ("mask", "blur"):
        r = res[test]
        assert r["order_minus_bce"] == pytest.approx(r["emvr_order"] - r["emvr_bce"])
        lo, hi = r["order_minus_bce_ci"]
        assert lo <= r["order_minus_bce"] <= hi
    assert res["mask"]["order_minus_bce"] < 0


def test_a_run_where_many_items_fail_stops_with_their_reasons(tmp_path, monkeypatch):
    """At 10 failures (or a tenth of the items) the run stops: the runner raises
    TooManyFailures with every reason, and `dualread probe` prints them and exits 1,
    not a traceback."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from clients.probes import cli, runner
    from models.data import load

    spec, _ = probe_items(tmp_path, 12, seed=0)

    class Failing:
        NAME = "failing"

        @staticmethod
        def params(cfg):
            return {}

        @staticmethod
        async def run_item(ctx, item, memo):
            raise ValueError(f"no answer for {item.id}")

    client = SimpleNamespace(http=SimpleNamespace(base_url="http://t"))
    ctx = SimpleNamespace(client=client, cfg=None)
    monkeypatch.setattr(runner, "Context", SimpleNamespace)     # `ctx` is one endpoint's
    with pytest.raises(runner.TooManyFailures) as e:
        asyncio.run(runner._run([Failing], load(spec), ctx, tmp_path, 4, False))
    assert len(e.value.failures) >= 10
    assert all(f.startswith("c") and "ValueError: no answer for c" in f
               for f in e.value.failures)

    def stop(*a, **k):
        raise runner.TooManyFailures(["c1: ValueError: no answer for c1"] * 10)
    monkeypatch.setattr(runner, "run", stop)
    got = CliRunner().invoke(cli.probe_app(), ["probe", "ccg", "--data", spec, "--out",
                                               str(tmp_path / "out"), "--no-progress"])
    assert got.exit_code == 1 and isinstance(got.exception, SystemExit), got.output
    assert "10 items failed; the run stopped" in got.output
    assert "c1: ValueError: no answer for c1" in got.output
