"""429 is backpressure for an offline run: the async client narrows its window of requests
in flight (AIMD) and retries until the run's deadline, so a probe run finishes against a
server whose queue is small."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from clients.http import AdaptiveLimit, AsyncDualReadClient
from tests.helpers import live_servers, probe_items, random_heads

ANSWER = {"answer": "red", "response": "r", "defer": False, "defer_threshold": 0.5,
          "model": "m", "heads": "h", "request_id": "x",
          "confidence": {k: 0.5 for k in ("dualread", "psr", "per", "verbalized")},
          "timings_ms": {"queue": 0, "generate": 0, "readout": 0, "heads": 0}}


def test_window_halves_once_per_burst_and_grows_back_after_a_streak():
    lim = AdaptiveLimit(8)

    async def fill(n: int) -> list[int]:
        return [await lim.acquire() for _ in range(n)]

    epochs = asyncio.run(fill(8))
    assert lim.in_flight == 8 and set(epochs) == {0}
    for e in epochs[:6]:                 # six refused in one burst: one halving, not six
        lim.release(e, overloaded=True)
    assert lim.window == 4 and lim.throttled == 6
    lim.release(epochs[6], overloaded=False)
    lim.release(epochs[7], overloaded=False)
    epochs = asyncio.run(fill(4))        # admitted under the new window: may halve again
    lim.release(epochs[0], overloaded=True)
    assert lim.window == 2 and lim.smallest == 2
    for e in epochs[1:]:
        lim.release(e, overloaded=False)
    assert lim.window == 3               # a window's worth (2) of successes in a row: +1
    for _ in range(3):
        lim.release(asyncio.run(fill(1))[0], overloaded=False)
    assert lim.window == 4
    for _ in range(100):
        lim.release(asyncio.run(fill(1))[0], overloaded=False)
    assert lim.window == 8 == lim.ceiling and lim.in_flight == 0
    for _ in range(10):
        lim.release(asyncio.run(fill(1))[0], overloaded=True)
    assert lim.window == 1               # never below one


def _bounded_server(capacity: int, seen: dict, status: int = 429):
    """A mock service that runs `capacity` requests at once and refuses whatever finds them
    all running: 429 with Retry-After 0 (queue full), or 504 after a short wait (admitted,
    but its request deadline passed in the queue, as a server with a default queue and a
    short deadline does under more load than it can finish in time). `seen` counts the
    refusals and successes, the most requests at once, and the paths asked for."""
    running = [0]

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.setdefault("paths", []).append(request.url.path)
        seen["max"] = max(seen.get("max", 0), running[0] + 1)
        if running[0] >= capacity:
            seen[str(status)] = seen.get(str(status), 0) + 1
            if status == 504:
                await asyncio.sleep(0.002)
                return httpx.Response(504, json={"detail": "no answer within 30.0 s"})
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"detail": "full"})
        running[0] += 1
        try:
            await asyncio.sleep(0.005)
        finally:
            running[0] -= 1
        seen["ok"] = seen.get("ok", 0) + 1
        body = {"accepted": True, "window": 1} if request.url.path == "/feedback" \
            else ANSWER
        return httpx.Response(200, json=body)
    return handler


def _small_queue_server(capacity: int, seen: dict):
    return _bounded_server(capacity, seen, 429)


def test_client_rides_out_429s_until_the_deadline_and_narrows_its_window():
    seen: dict = {}

    async def go(deadline: float | None) -> list:
        async with AsyncDualReadClient(
                "http://t", concurrency=8, retries=1, deadline=deadline,
                transport=httpx.MockTransport(_small_queue_server(2, seen))) as c:
            got = await asyncio.gather(*(c.answer(b"img", "q") for _ in range(60)),
                                       return_exceptions=True)
            return got, c.limit

    got, lim = asyncio.run(go(time.monotonic() + 60))
    assert all(not isinstance(g, Exception) and g.answer == "red" for g in got)
    assert seen["ok"] == 60 and seen["429"] == lim.throttled > 0
    assert lim.smallest <= 2             # the window came down to what the server holds
    # AIMD keeps refusals rare: a fixed window of 8 against room for 2 gets ~3 per success
    assert lim.throttled < 60

    # without a deadline a 429 counts against the retries, as for any other caller
    seen.clear()
    got, _ = asyncio.run(go(None))
    assert any(isinstance(g, httpx.HTTPStatusError) and "429" in str(g) for g in got)


def _one_answer(server, **client) -> object:
    """One answer through an async client on the mock `server`: the answer, or the HTTP
    error it ended in."""
    async def go() -> object:
        async with AsyncDualReadClient("http://t", transport=httpx.MockTransport(server),
                                       **client) as c:
            try:
                return await c.answer(b"img", "q")
            except httpx.HTTPStatusError as e:
                return e
    return asyncio.run(go())


def test_a_429_after_the_deadline_is_raised():
    seen: dict = {}

    t0 = time.monotonic()
    got = _one_answer(_small_queue_server(0, seen), retries=0,
                      deadline=time.monotonic() + 0.2)
    assert isinstance(got, httpx.HTTPStatusError) and seen["429"] >= 2
    assert time.monotonic() - t0 < 5


def _slow_queue_server(capacity: int, seen: dict):
    return _bounded_server(capacity, seen, 504)


def test_with_a_deadline_a_504_is_backpressure_without_one_it_is_raised():
    seen: dict = {}

    async def go(deadline: float | None, calls) -> tuple[list, AsyncDualReadClient]:
        async with AsyncDualReadClient(
                "http://t", concurrency=8, retries=1, backoff_base=0.01, deadline=deadline,
                transport=httpx.MockTransport(_slow_queue_server(2, seen))) as c:
            got = await asyncio.gather(*(calls(c) for _ in range(40)),
                                       return_exceptions=True)
            return got, c

    got, c = asyncio.run(go(time.monotonic() + 60, lambda c: c.answer(b"img", "q")))
    assert all(not isinstance(g, Exception) and g.answer == "red" for g in got)
    assert seen["ok"] == 40 and seen["504"] == c.timed_out == c.limit.throttled > 0
    assert c.limit.smallest <= 2         # the window came down, as on 429s

    # no deadline: the first 504 is the answer (no retry, the window untouched)
    seen.clear()
    got, c = asyncio.run(go(None, lambda c: c.answer(b"img", "q")))
    failed = [g for g in got if isinstance(g, httpx.HTTPStatusError)]
    assert failed and all("504" in str(g) for g in failed)
    assert len(seen["paths"]) == 40 and c.timed_out == 0 and c.limit.window == 8

    # feedback changes state: a 504 on it is not repeated even with a deadline
    seen.clear()
    got, c = asyncio.run(go(time.monotonic() + 60, lambda c: c.feedback("x", True)))
    assert any(isinstance(g, httpx.HTTPStatusError) and "504" in str(g) for g in got)
    assert len(seen["paths"]) == 40 and c.timed_out == 0


def test_a_request_too_slow_on_its_own_fails_after_its_retries():
    """A 504 to a request that was alone in flight is not backpressure: waiting cannot
    help it, so after `retries` such answers it fails (a re-run resumes the item) instead
    of being repeated until the run deadline."""
    seen: dict = {}

    t0 = time.monotonic()
    got = _one_answer(_slow_queue_server(0, seen), retries=2, backoff_base=0.001,
                      deadline=time.monotonic() + 60)
    assert isinstance(got, httpx.HTTPStatusError) and "504" in str(got)
    assert seen["504"] == len(seen["paths"]) == 3        # the first try and two retries
    assert time.monotonic() - t0 < 10


def test_a_request_that_always_times_out_among_others_fails_after_four_times_its_retries():
    """Other requests keep succeeding, so the 504s of the one that never finishes are not
    counted as 'alone'; it still fails after 4 × `retries` of them, not at the deadline."""
    seen = {"doomed": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/probe/score":
            seen["doomed"] += 1
            return httpx.Response(504, json={"detail": "no answer within 30.0 s"})
        await asyncio.sleep(0.003)
        return httpx.Response(200, json=ANSWER)

    async def go() -> object:
        async with AsyncDualReadClient(
                "http://t", concurrency=8, retries=2, backoff_base=0.001,
                deadline=time.monotonic() + 60, transport=httpx.MockTransport(handler)) as c:
            stop = asyncio.Event()

            async def busy() -> None:
                while not stop.is_set():
                    await c.answer(b"img", "q")
            others = [asyncio.ensure_future(busy()) for _ in range(4)]
            try:
                return await c._post("/probe/score", {"x": 1})
            except httpx.HTTPStatusError as e:
                return e
            finally:
                stop.set()
                await asyncio.gather(*others)
    t0 = time.monotonic()
    got = asyncio.run(go())
    assert isinstance(got, httpx.HTTPStatusError) and "504" in str(got)
    assert seen["doomed"] <= 4 * 2 + 1      # fewer only if some of its tries ran alone
    assert time.monotonic() - t0 < 30


def test_a_504_after_the_deadline_is_raised_at_once():
    """Past the run deadline (`--deadline-s 0`) a 504 is the answer, not another try."""
    seen: dict = {}

    got = _one_answer(_slow_queue_server(0, seen), retries=3, backoff_base=0.01,
                      deadline=time.monotonic() - 1)
    assert isinstance(got, httpx.HTTPStatusError) and "504" in str(got)
    assert seen["504"] == len(seen["paths"]) == 1


@pytest.fixture(scope="module")
def small_queue_service(actor_dirs, actors, tmp_path_factory):
    """A live `dualread serve` that queues at most 2 jobs and batches one at a time."""
    heads = random_heads(tmp_path_factory.mktemp("bp-heads"), actors["qwen3_vl"])
    with live_servers(actor_dirs["qwen3_vl"], heads, max_new_tokens=8, queue_limit=2,
                      max_batch_size=1) as urls:
        yield urls[0]


def test_probe_run_finishes_against_a_live_server_with_a_tiny_queue(small_queue_service,
                                                                    tmp_path):
    from clients.probes.runner import run

    data, ids = probe_items(tmp_path, 8, 3, box=[4, 4, 24, 20])
    out = tmp_path / "out"
    report = run(["ccg", "reliance"], small_queue_service, data, out, concurrency=8,
                 bootstrap=20, progress=False, deadline_s=600)
    info = json.loads((out / "run.json").read_text())
    assert info["throttled_requests"] > 0           # the server did push back
    assert info["failures"] == [] and "failures" not in report
    assert info["items_run"] == len(ids)
    for probe in ("ccg", "reliance"):
        stored = [json.loads(x)["id"] for x in (out / f"{probe}.jsonl").read_text().splitlines()]
        assert sorted(stored) == sorted(ids)


def _probe_run(url: str, names: list[str], tmp_path, n: int = 8, concurrency: int = 8
               ) -> tuple[dict, list[str]]:
    """One probe run against `url` with the default client settings but for a small
    bootstrap and a run deadline that ends a stuck test; returns run.json and the item
    ids, after checking every item was stored."""
    from clients.probes.runner import run

    data, ids = probe_items(tmp_path, n, 5, box=[4, 4, 24, 20])
    out = tmp_path / "out"
    report = run(names, url, data, out, concurrency=concurrency, bootstrap=20, progress=False,
                 deadline_s=300)
    info = json.loads((out / "run.json").read_text())
    assert info["failures"] == [] and "failures" not in report
    assert info["items_run"] == len(ids)
    for probe in names:
        stored = [json.loads(x)["id"] for x in (out / f"{probe}.jsonl").read_text().splitlines()]
        assert sorted(stored) == sorted(ids)
    return info, ids


@pytest.fixture(scope="module")
def one_batch_queue_service(actor_dirs, actors, tmp_path_factory):
    """A live `dualread serve` whose queue holds one TGS score batch (64 jobs, the default)
    and whose model runs one job at a time: concurrent items' batches are refused (429)."""
    heads = random_heads(tmp_path_factory.mktemp("bp-heads-64"), actors["qwen3_vl"])
    with live_servers(actor_dirs["qwen3_vl"], heads, max_new_tokens=8, queue_limit=64,
                      max_batch_size=1) as urls:
        yield urls[0], heads


def test_tgs_score_batches_finish_against_a_live_server_with_a_small_queue(
        one_batch_queue_service, tmp_path):
    info, _ = _probe_run(one_batch_queue_service[0], ["tgs"], tmp_path)
    assert info["batch_scoring"] is True            # /probe/score_batch, not one by one
    assert info["throttled_requests"] > 0 and info["smallest_window"] < 8


@pytest.fixture(scope="module")
def short_deadline_service(actor_dirs, one_batch_queue_service, tmp_path_factory):
    """A live `dualread serve` that queues everything (no 429) but whose request deadline
    is 2× what one TGS item takes alone on this machine (measured first, on the same
    settings): no single request of a lone item takes that long, while sixteen items'
    requests queued at once, one job at a time, take ~16 / r times a lone item to drain
    (r: its sequential requests, 2–3), well past it (at 5× the margin was too thin and the
    test could pass or fail by load)."""
    url, heads = one_batch_queue_service
    lone, _ = _probe_run(url, ["tgs"], tmp_path_factory.mktemp("bp-lone"), n=1)
    deadline = round(max(1.0, 2 * lone["wall_s"]), 2)
    with live_servers(actor_dirs["qwen3_vl"], heads, max_new_tokens=8, queue_limit=4096,
                      max_batch_size=1, request_timeout_s=deadline) as urls:
        yield urls[0]


def test_tgs_finishes_against_a_live_server_whose_deadline_its_queue_outlasts(
        short_deadline_service, tmp_path):
    info, _ = _probe_run(short_deadline_service, ["tgs"], tmp_path, n=16, concurrency=16)
    assert info["timed_out_requests"] > 0           # the server did answer 504
    assert info["throttled_requests"] == info["timed_out_requests"]   # and never 429
    assert info["smallest_window"] < 16
