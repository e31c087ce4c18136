"""`dualread bench`: its statistics by hand, the in-process run's keys, the 2B-sized actor
builder, and the fast token-span path that the capture path's speed rests on.

No timing thresholds here: performance claims live in bench.json, not in tests.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from bench import Plan, ratio_ci, run_bench
from bench.gpu import (
    build_random_actor,
    build_random_heads,
    count_parameters_meta,
    embedded_tokenizer,
    qwen3vl_2b_config,
)
from clients.bench import Load
from models.readout import token_spans
from tests.helpers import random_heads


def test_ratio_of_medians_and_paired_bootstrap_by_hand():
    # capture = 2 × plain on every unit: every paired resample gives exactly 2
    assert ratio_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == (2.0, 2.0, 2.0)
    # one slow outlier does not move a ratio of medians: median([1, 1, 10]) / 1 = 1
    point, lo, hi = ratio_ci([1.0, 1.0, 10.0], [1.0, 1.0, 1.0])
    assert point == 1.0 and lo == 1.0 and hi == 10.0


def test_paired_median_ratio_by_hand():
    """Per-unit ratios, then their median: a slow item slows every mode of its unit alike
    (unlike a ratio of medians over different items)."""
    from bench.inprocess import Timed, summarise

    t = Timed(batch=1)
    for plain, capture in ((1.0, 1.1), (2.0, 2.0), (10.0, 13.0)):
        t.seconds["plain"].append(plain)
        t.seconds["capture"].append(capture)
        t.seconds["replay"].append(2 * plain)
        t.seconds["answer"].append(0.9 * plain)
        t.seconds["sc8"].append(3 * plain)
    for m in t.seconds:
        t.cpu_seconds[m] = list(t.seconds[m])
        t.tokens[m] = [1.0] * 3
    out = summarise(t, n_boot=10)
    assert out["capture_ratio_paired_median"] == pytest.approx(1.1)      # of 1.1, 1.0, 1.3
    assert out["replay_ratio_paired_median"] == pytest.approx(2.0)
    assert out["capture_ratio"] == pytest.approx(2.0 / 2.0)              # ratio of medians
    # what DualRead costs over the answer alone: 1.1/0.9, 2.0/1.8, 13/9
    assert out["capture_over_answer_paired_median"] == pytest.approx(1.1 / 0.9)
    assert out["answer_ratio_paired_median"] == pytest.approx(0.9)
    # the DualRead-itself target: a ratio of medians, 2.0 / 1.8 (not the paired median)
    assert out["capture_over_answer"] == pytest.approx(2.0 / 1.8)
    assert "decode_ratio" not in out          # no decoding stages were recorded
    t.decode_seconds, t.answer_decode_seconds = [1.0, 2.0, 9.0], [0.5, 1.6, 1.5]
    # capture's decoding stage over the answer alone's, ratio of medians: 2.0 / 1.5 (the
    # median of the per-unit ratios 2, 1.25, 6 would be 2)
    assert summarise(t, n_boot=10)["decode_ratio"] == pytest.approx(2.0 / 1.5)


def test_rounds_of_one_unit_are_averaged_before_the_bootstrap():
    """Two rounds of the same two items are two units, not four: the ratio is taken over
    per-unit means, and a bootstrap over four measurements would narrow the CI."""
    from bench.inprocess import Timed, per_unit, summarise

    assert per_unit([1.0, 3.0, 2.0, 6.0], [0, 1, 0, 1]) == [1.5, 4.5]
    assert per_unit([1.0, 2.0], []) == [1.0, 2.0]
    t = Timed(batch=1)
    for rnd in range(2):
        for unit, plain in enumerate((1.0, 10.0)):
            t.unit_ids.append(unit)
            for m, f in (("plain", 1.0), ("capture", 1.5 if unit == 0 else 1.0),
                         ("replay", 2.0), ("sc8", 3.0)):
                t.seconds[m].append(plain * f * (1 + rnd))
                t.cpu_seconds[m].append(plain * f)
                t.tokens[m].append(1.0)
    out = summarise(t, n_boot=50)
    assert out["units"] == 2 and out["measurements"] == 4
    # per-unit means: plain 1.5 and 15, capture 2.25 and 15 (the median of two: their mean)
    assert out["capture_ratio"] == pytest.approx(((2.25 + 15) / 2) / ((1.5 + 15) / 2))
    assert out["capture_ratio_paired_median"] == pytest.approx((1.5 + 1.0) / 2)


def test_load_summary_by_hand():
    s = Load(4, [k / 10 for k in range(1, 11)], wall_s=2.0, errors=1).summary()
    # 10 answered in 2 s; latencies 100..1000 ms, linear-interpolated percentiles
    assert s["rps"] == 5.0 and s["requests"] == 11 and s["errors"] == 1
    assert s["p50_ms"] == pytest.approx(550.0)
    assert s["p95_ms"] == pytest.approx(955.0)
    assert s["p99_ms"] == pytest.approx(991.0)


def test_in_process_bench_writes_the_keys(actor_dirs, actors, tmp_path):
    actor_dir = actor_dirs["qwen3_vl"]
    heads_dir = random_heads(tmp_path / "heads", actors["qwen3_vl"])
    threads = torch.get_num_threads()
    plan = Plan(items=8, b1_repeats=2, b8_repeats=1, max_new_tokens=6, http=False, threads=1)
    res = run_bench(tmp_path / "out", plan, actor_dir, heads_dir, command="test")
    assert torch.get_num_threads() == threads      # the rest of the session is unaffected
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (tmp_path / "out" / "bench.md").read_text().startswith("Command: `test`")
    assert saved["in_process"].keys() == {"b1", "b8"}
    for b, units, measured in (("b1", 8, 16), ("b8", 1, 1)):
        blk = saved["in_process"][b]
        assert blk["units"] == units and blk["measurements"] == measured
        for key in ("capture_ratio", "replay_ratio", "sc8_ratio", "capture_ratio_paired_median",
                    "answer_ratio", "capture_over_answer"):
            assert math.isfinite(blk[key]) and blk[key] > 0, (b, key)
        # greedy decoding from the same inputs must give the same tokens in every mode
        assert blk["greedy_tokens_identical"] is True
    assert math.isfinite(saved["heads_us"]) and saved["heads_us"] > 0
    assert saved["heads"]["batch8_median_us"] > 0     # 8 readouts: one batch of 8
    assert saved["in_process"]["b1"]["readout_seconds_per_item"] > 0
    assert saved["in_process"]["b8"]["post_seconds_per_item"] > 0
    for blk in saved["in_process"].values():
        assert set(blk["seconds_per_item"]) == {"plain", "answer", "capture", "replay", "sc8"}
        # decoding with the capture against the answer alone's decoding (same loop)
        assert blk["decode_ratio"] > 0
        assert blk["decode_ratio_ci"][0] <= blk["decode_ratio"] <= blk["decode_ratio_ci"][1]
    report = (tmp_path / "out" / "bench.md").read_text()
    assert "Decoding inside capture" in report and "control" not in report
    assert "what DualRead itself costs" in report
    assert "http" not in saved
    names = [t["target"] for t in res["targets"]]
    assert "capture / plain generate, b1" in names and "heads alone (µs per item)" in names
    assert "capture / answer alone (DualRead itself), b8" in names


def test_2b_config_has_the_published_size():
    tok = embedded_tokenizer()
    config = qwen3vl_2b_config(tok)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (2048, 28, 151_936)
    assert (vision.depth, vision.hidden_size, vision.patch_size) == (24, 1024, 16)
    # the embedded tokenizer's ids are valid and its image markers are the config's
    assert len(tok) <= text.vocab_size
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    # Parameters counted by hand from the architecture's sizes:
    d, inter, layers, vocab, kv = 2048, 6144, 28, 151_936, 8 * 128
    per_layer = 2 * d * d + 2 * d * kv + 2 * 128 + 3 * d * inter + 2 * d
    text_n = vocab * d + layers * per_layer + d                       # tied LM head
    v, vi, merged = 1024, 4096, 4 * 1024
    block = 4 * v + (3 * v * v + 3 * v) + (v * v + v) + (v * vi + vi) + (vi * v + v)
    vision_n = (3 * 2 * 16 * 16 * v + v) + 2304 * v + 24 * block \
        + (2 * v + merged * merged + merged + merged * d + d) \
        + 3 * (2 * merged + merged * merged + merged + merged * d + d)
    assert count_parameters_meta(config) == text_n + vision_n == 2_127_532_032


def test_random_actor_builder_forces_length_and_448_images(tmp_path):
    """The builder end to end on the CPU with the sizes shrunk (the real ones need a GPU)."""
    from heads.dualread import Heads
    from models.loading import load_actor

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, deepstack_visual_indexes=[0])
    folder = build_random_actor(tmp_path / "a", device="cpu", dtype="float32", new_tokens=5,
                                text=text, vision=vision)
    actor = load_actor(folder)
    heads = Heads.load(build_random_heads(tmp_path / "h", folder, actor.hidden_size),
                       actor.fingerprint)
    img = Image.new("RGB", (448, 448), (200, 30, 30))
    res = actor.answer([img, img], ["what colour is it?", "what shape is it?"], 5)
    for r in res:
        assert len(r.token_ids) == 5
        # (448 / 16)^2 patches, merged 2 × 2
        assert len(r.readout.positions["V"]) == (448 // 16) ** 2 // 4 == 196
        assert 0.0 <= heads.confidence(r.readout)["dualread"] <= 1.0
    assert [len(s.token_ids) for s in actor.sample([img], ["q"], 3, max_new_tokens=5,
                                                   seed=0)[0]] == [5, 5, 5]


def _prefix_spans(tok, ids):
    out, prev = [], 0
    for k in range(len(ids)):
        cur = len(tok.decode(ids[: k + 1], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False))
        out.append((prev, cur))
        prev = cur
    return out


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_token_spans_equal_prefix_decoding(actors, family):
    tok = actors[family].tokenizer
    rng = random.Random(0)
    cases = [tok.encode("<think>héllo wörld € 10</think><answer>red</answer>",
                        add_special_tokens=False), []]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 25))]
              for _ in range(300)]
    for ids in cases:
        assert token_spans(tok, ids) == _prefix_spans(tok, ids), ids


def test_token_spans_embedded_tokenizer_on_random_ids():
    tok = embedded_tokenizer()
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert token_spans(tok, ids) == _prefix_spans(tok, ids), ids


def test_http_bench_against_real_servers(actor_dirs, actors, tmp_path):
    """Both `dualread serve` processes start, answer every request, and are stopped."""
    from bench.run import request_bodies
    from clients.bench import http_bench
    from tests.conftest import QUESTIONS, random_image

    heads_dir = random_heads(tmp_path / "heads", actors["qwen3_vl"])
    bodies = request_bodies([(random_image(i), QUESTIONS[i]) for i in range(4)], 4)
    calls = {"b1": 0, "b8": 0}

    def b1(i: int) -> float:
        calls["b1"] += 1
        return 0.01

    def b8() -> tuple[int, float]:
        calls["b8"] += 1
        return 16, 0.5

    flags = {"actor": actor_dirs["qwen3_vl"], "heads": heads_dir, "max_new_tokens": 4}
    res = http_bench(bodies, flags, {1: 3, 4: 4, 16: 16}, threads=1, in_process_b1=b1,
                     in_process_b8=b8)
    assert res.keys() == {"c1", "c4", "c16"}
    for c, n in (("c1", 3), ("c4", 4), ("c16", 16)):
        for label in ("batching", "no_batching"):
            s = res[c][label]
            assert s["requests"] == n and s["errors"] == 0, (c, label, s)
            assert s["rps"] > 0 and s["p50_ms"] <= s["p99_ms"]
    # one in-process call per one-client step, one batch-8 pass per 16-client round
    assert calls == {"b1": 3, "b8": 2}
    assert res["c1"]["in_process_b1_ms"] == pytest.approx(10.0)
    assert res["c16"]["in_process_b8_rps"] == pytest.approx(32.0)
    one = res["c1"]["batching"]
    # three requests and a constant in-process time: the paired median is p50 − 10 ms;
    # the part outside the model stages the server reports is some of each request
    assert one["paired_overhead_ms"] == pytest.approx(one["p50_ms"] - 10.0)
    assert 0 < one["outside_model_ms"] < one["p50_ms"]


def test_one_client_overhead_pairs_request_i_with_item_i(monkeypatch):
    """The paired overhead is the median of (request i − item i in process), which the
    difference of the two medians is not when items differ in length; the part outside
    the model stages is the client's time less the server's reported stages."""
    from types import SimpleNamespace

    import clients.bench as cb

    latency = {"http://on": [0.105, 0.310, 0.200], "http://off": [0.1, 0.3, 0.2]}
    inproc = [0.100, 0.300, 0.200]

    def post(client, body):
        t = latency[str(client.base_url).rstrip("/")][int(body)]
        return t, t - 0.002                       # the server reports all but 2 ms

    monkeypatch.setattr(cb, "_post_timed", post)
    servers = {"batching": SimpleNamespace(url="http://on"),
               "no_batching": SimpleNamespace(url="http://off")}
    out = cb._paired_single(servers, [b"0", b"1", b"2"], 3, lambda i: inproc[i], None)
    assert out["batching"]["paired_overhead_ms"] == pytest.approx(5.0)      # 5, 10, 0
    assert out["batching"]["p50_ms"] - out["in_process_b1_ms"] == pytest.approx(0.0)
    assert out["no_batching"]["paired_overhead_ms"] == pytest.approx(0.0)
    assert out["batching"]["outside_model_ms"] == pytest.approx(2.0)
    # a failed request leaves its item out of the pairs, the others stay paired
    latency["http://on"][1] = None
    post_ok = post

    def post(client, body):
        return None if latency[str(client.base_url).rstrip("/")][int(body)] is None \
            else post_ok(client, body)

    monkeypatch.setattr(cb, "_post_timed", post)
    out = cb._paired_single(servers, [b"0", b"1", b"2"], 3, lambda i: inproc[i], None)
    assert out["batching"]["errors"] == 1
    assert out["batching"]["paired_overhead_ms"] == pytest.approx(2.5)      # 5, 0
    assert out["batching"]["paired_requests"] == 2


def test_the_http_block_reads_the_batching_server_and_reports_its_pairs():
    """bench.json's `http` block and the target rows take the paired overhead and the
    time outside the model stages from the batching server, not the other one."""
    from bench.report import markdown, targets
    from bench.run import http_block

    def load(p50, paired, outside, errors=0):
        return {"requests": 32, "errors": errors, "rps": 10.0, "p50_ms": p50, "p95_ms": p50,
                "p99_ms": p50, "mean_ms": p50, "paired_overhead_ms": paired,
                "paired_requests": 32 - errors, "outside_model_ms": outside}

    raw = {"c1": {"batching": load(91.0, 0.6, 4.7, errors=1),
                  "no_batching": load(90.0, -9.0, -9.0), "in_process_b1_ms": 90.5},
           "c4": {"batching": load(100.0, 0, 0), "no_batching": load(300.0, 0, 0)},
           "c16": {"batching": load(300.0, 0, 0), "no_batching": load(900.0, 0, 0),
                   "in_process_b8_rps": 20.0}}
    http = http_block(raw, {"device": "cpu"}, 16)
    assert (http["overhead_ms"], http["overhead_ms_paired"], http["outside_model_ms"],
            http["paired_requests"]) == (pytest.approx(0.5), 0.6, 4.7, 31)
    rows = {t["target"]: t for t in targets({"http": http})}
    assert rows["HTTP overhead at 1 client, paired by item (ms)"]["value"] == 0.6
    assert rows["HTTP overhead at 1 client (ms)"]["value"] == pytest.approx(0.5)
    # the shipped run's in-process part, this HTTP block
    r = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench" / "bench.json")
                   .read_text())
    r["http"] = http
    r["targets"] = targets(r)
    text = markdown(r)
    assert "over the 31 requests answered" in text and "4.7 ms at the median" in text
    del http["paired_requests"]                  # a bench.json from before the key
    assert "over the 31 requests answered" in markdown(r)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_state_tap_equals_output_hidden_states(actors, images, family):
    """The capture path reads states through two hooks instead of `output_hidden_states`;
    they must be the very states the model reports itself (final layer and mid layer)."""
    from tests.conftest import QUESTIONS

    actor = actors[family]
    batch = actor.encode(images[:3], QUESTIONS[:3])
    last, mid = actor.forward_states(batch)
    out = actor.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      output_hidden_states=True, use_cache=False, **actor._vision_kwargs(batch))
    torch.testing.assert_close(last, out.hidden_states[-1].float(), rtol=0, atol=0)
    torch.testing.assert_close(mid, out.hidden_states[actor.mid_layer].float(), rtol=0, atol=0)


@pytest.mark.parametrize("readout", ["capture", "replay"])
def test_batched_token_statistics_equal_each_item_alone(readout):
    """The capture path computes log-probs and entropies for the whole batch in one pass;
    every item must get the rows its own pass over its states gives (a wrong offset or a
    padded target would shift them). The embedded actor, because the tiny random ones
    repeat one token, which hides a shift."""
    from models.data import load, sample
    from models.loading import load_actor

    actor = load_actor()
    items = sample(load("easyvqa:test"), 4, seed=3)
    imgs, qs = [it.image() for it in items], [it.question for it in items]
    # 12 new tokens: items differ in length and some stop on the limit, so padded rows
    # and the extra cached step both occur in the batch
    res = actor.answer(imgs, qs, max_new_tokens=12, readout=readout)
    assert len({len(r.token_ids) for r in res}) > 1 or not all(r.finished for r in res)
    full = actor.encode(imgs, qs, [r.token_ids for r in res])
    last, _ = actor.forward_states(full)
    lp = full.prompt_len
    for b, r in enumerate(res):
        n = len(r.token_ids)
        logp = torch.log_softmax(actor._logits(last[b, lp - 1: lp - 1 + n]), -1)
        want_lp = logp[torch.arange(n), torch.tensor(r.token_ids)]
        want_ent = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(r.readout.token_logprobs, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(r.readout.token_entropy, want_ent, atol=1e-5, rtol=0)


def test_confidence_batch_equals_each_readout_scored_alone(actors, images, tmp_path):
    """One call of the readers for a batch gives each item what scoring it alone gives
    (the reference below is the per-method scoring of one readout, written out)."""
    from heads import registry
    from heads.dualread import Heads
    from heads.features import extract
    from tests.conftest import QUESTIONS

    actor = actors["qwen3_vl"]
    heads = Heads.load(random_heads(tmp_path / "heads", actor), actor.fingerprint)
    res = actor.answer(images[:5], QUESTIONS[:5], max_new_tokens=6)
    got = heads.confidence_batch([r.readout for r in res])
    assert len(got) == 5 and heads.confidence_batch([]) == []
    served = [m for m in registry.registered() if m.served and heads.has(m)]
    assert {m.name for m in served} >= {"dualread", "psr", "per", "verbalized"}
    for r, conf in zip(res, got):
        f = {k: v[None] for k, v in extract(r.readout, heads.kappa).items()}
        want = {m.name: float(m.score(heads, f)[0]) for m in served}
        assert conf.keys() == want.keys()
        for name in want:
            assert conf[name] == pytest.approx(want[name], abs=1e-6), name


def test_threads_setting_from_the_environment_sets_torch_threads(monkeypatch):
    """`--threads` / DUALREAD_THREADS reaches torch; unset, torch keeps its own count."""
    from app.settings import Settings, apply_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        apply_threads(Settings())                    # not given: left alone
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("DUALREAD_THREADS", "1")
        s = Settings()
        assert s.threads == 1
        apply_threads(s)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
