"""The serving layer's limits with a stand-in backend (no model, milliseconds).

`Serving` talks to a `Backend`; `FakeBackend` (tests/test_app.py) answers without a model,
so admission, the limits, deadlines, decoding and job assembly are pinned here fast enough
for mutation testing. Waits are bounded by GUARD_S; the few upper bounds on elapsed time
are far above what a correct run needs.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
from PIL import Image

import app.serving as serving_module
from app.engine import Batcher, BatcherHooks
from app.errors import (
    ClientGone,
    DeadlineExceeded,
    InvalidInput,
    NotReady,
    QueueFull,
    ShuttingDown,
    TooManyItems,
    TrajectoryInvalid,
)
from app.serving import (
    AnswerItem,
    Confidences,
    RequestClock,
    ScoreItem,
    Served,
    Serving,
    ServingHooks,
    b64_limit,
    limit_bucket,
)
from app.settings import Settings
from models.images import ImageInvalid, ImageTooLarge
from models.masking import MaskSpec
from tests.helpers import png_bytes
from tests.test_app import FakeBackend

GUARD_S = 5.0
RED = Image.new("RGB", (8, 8), (255, 0, 0))


class Recording(FakeBackend):
    """FakeBackend that records what the checks were asked, with an optional response
    check that strips (the scored text then differs from the sent one) or refuses."""

    def __init__(self, hold: threading.Event | None = None, refuse: str | None = None
                 ) -> None:
        super().__init__(hold)
        self.questions: list[tuple[str, int, int]] = []
        self.responses: list[tuple[str, int]] = []
        self.refuse = refuse

    def check_question(self, question: str, max_chars: int, max_tokens: int) -> str:
        self.questions.append((question, max_chars, max_tokens))
        return f"checked:{question}"

    def check_response(self, response: str, max_tokens: int) -> str:
        self.responses.append((response, max_tokens))
        if self.refuse is not None and self.refuse in response:
            raise TrajectoryInvalid("12 tokens, over the limit of 3")
        return response.strip()


class KeyedBatcher(Batcher):
    """A Batcher that records each submission's handler, size, deadline and key."""

    submitted: list[tuple[str, int, float, object]]

    def submit_many(self, handler, payloads, deadline, key=None):
        self.submitted = [*getattr(self, "submitted", []), (handler, len(payloads), deadline,
                                                            key)]
        return super().submit_many(handler, payloads, deadline, key)


class Request:
    """What `Serving.admit` reads of a request."""

    def __init__(self, state: dict | None = None, gone: bool = False) -> None:
        self.scope = {"state": {} if state is None else state}
        self.gone = gone

    async def is_disconnected(self) -> bool:
        return self.gone


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, GUARD_S))


async def attached(settings: Settings, backend=None, **kw) -> Serving:
    srv = Serving(settings, **kw)
    srv.new_batcher = KeyedBatcher
    srv.attach(backend or Recording())
    return srv


def item(n: int = 8, img: Image.Image = RED) -> AnswerItem:
    return AnswerItem(img, "q", n)


# ------------------------------------------------------------------ small functions
def test_b64_limit_is_the_padded_length_of_that_many_bytes():
    assert [b64_limit(n) for n in (0, 1, 2, 3, 4, 6, 7)] == [0, 4, 4, 4, 8, 8, 12]
    for n in range(40):
        assert b64_limit(n) == len(base64.b64encode(b"x" * n))


def test_limit_bucket_is_the_next_power_of_two_and_at_least_one():
    assert [limit_bucket(n) for n in (0, 1, 2, 3, 4, 5, 9, 16, 17)] == \
        [1, 1, 2, 4, 4, 8, 16, 16, 32]
    assert limit_bucket(-3) == 1


def test_confidences_minus_and_from_scores():
    d = Confidences(0.9, 0.5, 0.25, 0.125).minus(Confidences(0.4, 0.5, 0.75, 0.0))
    assert dataclasses.astuple(d) == pytest.approx((0.5, 0.0, -0.5, 0.125))
    assert type(d) is Confidences
    scores = {"verbalized": 0.4, "per": 0.2, "psr": 0.1, "dualread": 0.7, "extra": 1.0}
    assert Confidences.from_scores(scores) == Confidences(0.7, 0.1, 0.2, 0.4)
    del scores["per"]
    with pytest.raises(KeyError, match="per"):
        Confidences.from_scores(scores)


def test_the_default_hooks_do_nothing():
    assert ServingHooks().answered("r", None, 0.0) is None


def test_request_clock_marks_the_first_image_only():
    clock = RequestClock(time.monotonic() - 5.0)
    assert (clock.read, clock.decode_wait, clock.decode) == (None, 0.0, 0.0)
    clock.image_started()
    assert 5.0 <= clock.read < 5.0 + GUARD_S
    first = clock.read
    clock.arrived -= 100.0
    clock.image_started()
    assert clock.read == first


def test_clock_and_decode_wait_outside_a_request_are_fresh():
    before = time.monotonic()
    clock = Serving.clock()
    assert before <= clock.arrived <= time.monotonic()
    assert clock.read == 0.0 and clock.decode == 0.0 and clock.decode_wait == 0.0
    assert Serving.clock() is not clock          # nothing is kept outside a request
    assert Serving.decode_wait_s() == 0.0


# ------------------------------------------------------------------ lifecycle
def test_not_ready_until_attached_then_the_load_error_or_loading():
    srv = Serving(Settings())
    assert not srv.ready
    with pytest.raises(NotReady, match="^loading model$") as e:
        srv.require_backend()
    assert e.value.status == 503
    srv.load_error = "heads fitted for another actor"
    with pytest.raises(NotReady, match="^heads fitted for another actor$"):
        srv.require_backend()
    srv.backend = Recording()                     # a backend without a batcher: not ready
    assert not srv.ready
    with pytest.raises(NotReady):
        srv.require_backend()
    srv.backend, srv.batcher = None, object()
    assert not srv.ready
    with pytest.raises(NotReady):
        srv.require_backend()
    fresh = Serving(Settings())
    fresh.batcher = object()                      # a batcher before any backend: not ready
    assert not fresh.ready and fresh.draining is False
    with pytest.raises(NotReady):
        fresh.require_backend()


def test_attach_builds_the_batcher_from_the_settings_and_drain_unreadies():
    s = Settings(max_batch_size=3, batch_wait_ms=7.0, queue_limit=5)
    hooks = BatcherHooks()
    backend = Recording()

    async def main():
        srv = await attached(s, backend, batcher_hooks=hooks)
        b = srv.batcher
        assert isinstance(b, KeyedBatcher) and srv.backend is backend
        assert (b.max_batch, b.wait, b.queue_limit, b.hooks) == (3, 0.007, 5, hooks)
        assert b.handlers == {"answer": backend.answer_batch, "score": backend.score_batch}
        assert b.task is not None and not b.task.done()       # started
        assert srv.ready and srv.require_backend() is backend
        srv.drain()
        assert srv.draining and not srv.ready
        await srv.stop()
        assert b.closed and b.task.done()

    run(main())


def test_stop_without_a_batcher_drains():
    srv = Serving(Settings())
    run(srv.stop())
    assert srv.draining


def test_decode_slots_follow_the_setting():
    srv = Serving(Settings(max_decodes=3))
    assert srv.decode_slots._value == 3
    assert Serving(Settings()).hooks.__class__ is ServingHooks


# ------------------------------------------------------------------ admission
def test_admit_refuses_a_late_request_and_one_before_the_model():
    srv = Serving(Settings())
    with pytest.raises(ShuttingDown):
        srv.admit(Request({"late": True}))
    with pytest.raises(NotReady, match="loading model"):
        srv.admit(Request())


def test_admit_sets_the_deadline_the_gone_check_and_the_clock():
    srv = Serving(Settings(request_timeout_s=7.0))
    srv.backend, srv.batcher = Recording(), object()
    req = Request({"arrived": 123.5})

    async def main():
        t0 = time.monotonic()
        srv.admit(req)
        t1 = time.monotonic()
        deadline, gone = serving_module._REQUEST.get()
        assert t0 + 7.0 <= deadline <= t1 + 7.0
        assert srv._deadline() == deadline
        assert gone == req.is_disconnected
        assert Serving.clock().arrived == 123.5 and Serving.clock() is Serving.clock()
        Serving.clock().decode_wait = 0.25
        assert Serving.decode_wait_s() == 0.25

        srv.admit(Request({"late": False}))              # no mark: from now
        t2 = time.monotonic()
        assert t1 <= Serving.clock().arrived <= t2
        assert Serving.clock().read is None

    run(main())
    assert serving_module._REQUEST.get() == (None, None)


def test_admit_takes_a_request_that_cannot_tell_it_has_gone():
    """A request object without `is_disconnected` (a plain ASGI scope) is admitted with no
    gone check."""
    srv = Serving(Settings())
    srv.backend, srv.batcher = Recording(), object()

    async def main():
        srv.admit(SimpleNamespace(scope={"state": {}}))
        return serving_module._REQUEST.get()[1]

    assert run(main()) is None


def test_outside_a_request_the_deadline_is_one_timeout_from_now():
    srv = Serving(Settings(request_timeout_s=9.0))
    t0 = time.monotonic()
    d = srv._deadline()
    assert t0 + 9.0 <= d <= time.monotonic() + 9.0


# ------------------------------------------------------------------ limits
def test_max_new_tokens_defaults_clamps_and_refuses_below_one():
    srv = Serving(Settings(max_new_tokens=16))
    assert srv.max_new_tokens(None) == 16
    assert srv.max_new_tokens(1) == 1
    assert srv.max_new_tokens(15) == 15
    assert srv.max_new_tokens(16) == 16
    assert srv.max_new_tokens(17) == 16
    for bad in (0, -1):
        with pytest.raises(InvalidInput, match="^max_new_tokens must be at least 1$") as e:
            srv.max_new_tokens(bad)
        assert e.value.status == 422


def test_question_is_checked_by_the_backend_with_both_limits():
    backend = Recording()
    srv = Serving(Settings(max_question_chars=40, max_question_tokens=9))
    srv.backend, srv.batcher = backend, object()
    assert srv.question("what colour?") == "checked:what colour?"
    assert backend.questions == [("what colour?", 40, 9)]
    srv.backend = None
    with pytest.raises(NotReady):
        srv.question("q")


def test_chat_question_joins_parts_and_limits_each_part():
    backend = Recording()
    srv = Serving(Settings(max_question_chars=5, max_question_tokens=9))
    srv.backend, srv.batcher = backend, object()
    parts = [("messages.0.content.0.text", "abcde"), ("messages.1.content", "fg")]
    assert srv.chat_question(parts) == "checked:abcde\nfg"
    # the joined text is longer than one part may be: its own length is the limit then
    assert backend.questions == [("abcde\nfg", 8, 9)]
    srv.chat_question([("m", "ab")])
    assert backend.questions[-1] == ("ab", 5, 9)              # a short one: the setting
    with pytest.raises(InvalidInput) as e:
        srv.chat_question([("messages.0.content", "ok"), ("messages.1.content", "abcdef")])
    assert e.value.detail == "messages.1.content: longer than 5 characters"
    assert e.value.status == 422
    assert len(backend.questions) == 2                        # refused before the backend


def test_score_items_check_each_response_and_mask():
    backend = Recording(refuse="LONG")
    srv = Serving(Settings(max_response_tokens=3))
    srv.backend, srv.batcher = backend, object()
    mask = MaskSpec((0, 5))
    out = run(srv.score_items(RED, "q", [(" hello ", mask), ("x", None)], batch=True))
    # the item keeps the response as sent; the span is checked against the checked text
    assert out == [ScoreItem(RED, "q", " hello ", mask), ScoreItem(RED, "q", "x", None)]
    assert backend.responses == [(" hello ", 3), ("x", 3)]

    with pytest.raises(TrajectoryInvalid) as e:
        run(srv.score_items(RED, "q", [("a", None), ("LONG", None)], batch=True))
    assert e.value.detail == "trajectories.1.response: 12 tokens, over the limit of 3"
    with pytest.raises(TrajectoryInvalid) as e:
        run(srv.score_items(RED, "q", [("LONG", None)]))
    assert e.value.detail == "response: 12 tokens, over the limit of 3"

    # (0, 6) fits " hello " but not the checked "hello"
    with pytest.raises(TrajectoryInvalid) as e:
        run(srv.score_items(RED, "q", [("ok", None), (" hello ", MaskSpec((0, 6)))],
                            batch=True))
    assert e.value.detail == \
        "trajectories.1.mask.target: span (0, 6) outside the response (length 5)"
    assert e.value.status == 422
    with pytest.raises(TrajectoryInvalid, match=r"^mask\.target: span"):
        srv._score_items(RED, "q", [("abc", MaskSpec((2, 9)))], False)
    # a tag target absent from the text is an empty span, not an error
    assert srv._score_items(RED, "q", [("abc", MaskSpec("think"))], False)[0].mask.target \
        == "think"
    srv.backend = None
    with pytest.raises(NotReady):
        srv._score_items(RED, "q", [], False)


# ------------------------------------------------------------------ decoding
def test_image_bytes_at_the_limit_decode_and_one_over_is_refused():
    raw = png_bytes(RED)
    srv = Serving(Settings(max_image_bytes=len(raw)))
    img = run(srv.image(raw))
    assert img.size == (8, 8) and img.getpixel((0, 0)) == (255, 0, 0)
    assert srv.decode_slots._value == 4                       # the slot came back once
    srv = Serving(Settings(max_image_bytes=len(raw) - 1))
    with pytest.raises(ImageTooLarge) as e:
        run(srv.image(raw, "logo"))
    assert str(e.value) == f"logo: {len(raw)} bytes, over the limit of {len(raw) - 1}"


def test_the_pixel_limit_reaches_the_decoder_and_errors_name_the_field():
    raw = png_bytes(RED)
    assert run(Serving(Settings(max_image_pixels=64)).image(raw)).size == (8, 8)
    srv = Serving(Settings(max_image_pixels=63))
    with pytest.raises(ImageTooLarge, match=r"^counterfactual: image has 8x8 pixels, over "
                                            r"the limit of 63$"):
        run(srv.image(raw, "counterfactual"))
    with pytest.raises(ImageInvalid, match=r"^image: cannot decode image"):
        run(srv.image(b"garbage"))
    assert srv.decode_slots._value == 4


def test_b64_at_the_encoded_limit_passes_and_one_char_over_is_refused():
    srv = Serving(Settings(max_image_bytes=3))
    # 4 characters: within the limit of 3 bytes, then refused by the byte check or decode
    with pytest.raises(ImageInvalid, match="^image: cannot decode"):
        run(srv.image_b64("YWJj"))
    with pytest.raises(ImageTooLarge) as e:
        run(srv.image_b64("YWJjZA", "logo"))
    assert str(e.value) == "logo: over the limit of 3 bytes"
    raw = png_bytes(RED)
    srv = Serving(Settings(max_image_bytes=len(raw)))
    text = base64.b64encode(raw).decode()
    assert len(text) == b64_limit(len(raw))
    assert run(srv.image_b64(text)).size == (8, 8)


@pytest.mark.parametrize("text", ["YW Jj", "YWJj\n", "YW!j", "YWJ"])
def test_b64_that_is_not_strict_base64_is_refused(text):
    srv = Serving(Settings())
    with pytest.raises(InvalidInput) as e:
        run(srv.image_b64(text, "logo"))
    assert e.value.detail == \
        "logo: not valid base64 (one line, no wrapping; use `base64 < file | tr -d '\\n'`)"
    assert e.value.status == 422


def test_b64_passes_the_field_name_on_to_the_decode():
    srv = Serving(Settings())
    with pytest.raises(ImageInvalid, match="^logo: cannot decode"):
        run(srv.image_b64(base64.b64encode(b"garbage").decode(), "logo"))


def _slow_open(monkeypatch, seconds: float) -> list:
    opened = []

    def slow(raw, max_pixels):
        opened.append(raw)
        time.sleep(seconds)
        return Image.new("RGB", (4, 4))

    monkeypatch.setattr(serving_module, "open_image", slow)
    return opened


def test_decode_time_adds_up_over_a_requests_images(monkeypatch):
    # each decode takes 0.25 s: wide margins on a loaded machine, and a clock mark
    # moved past a decode still shows
    _slow_open(monkeypatch, 0.25)
    srv = Serving(Settings())
    srv.backend, srv.batcher = Recording(), object()

    async def main():
        srv.admit(Request())
        await srv.image(b"a")
        await srv.image_b64(base64.b64encode(b"b").decode())
        return Serving.clock()

    clock = run(main())
    assert 0.5 <= clock.decode < GUARD_S
    assert 0.0 <= clock.read < 0.25                 # marked before the first decode
    assert clock.decode_wait < 0.25                 # free slots: no wait


def test_b64_decoding_counts_as_decode_time(monkeypatch):
    monkeypatch.setattr(serving_module.base64, "b64decode",
                        lambda s, validate: time.sleep(0.1) or b"x")
    monkeypatch.setattr(serving_module, "open_image", lambda raw, px: RED)
    srv = Serving(Settings())
    srv.backend, srv.batcher = Recording(), object()

    async def main():
        srv.admit(Request({"arrived": time.monotonic() - 3.0}))
        await srv.image_b64("eA==")
        return Serving.clock()

    clock = run(main())
    assert 0.1 <= clock.decode < GUARD_S
    assert 3.0 <= clock.read < 3.0 + GUARD_S        # marked by the base64 path too


def test_waiting_for_a_slot_adds_up_and_counts_against_the_deadline(monkeypatch):
    _slow_open(monkeypatch, 0.2)
    srv = Serving(Settings(max_decodes=1))
    srv.backend, srv.batcher = Recording(), object()

    async def other():
        await srv.image(b"other")

    async def request():
        srv.admit(Request())
        await srv.image(b"a")                       # waits ~0.2 s for the other's slot
        waited = Serving.decode_wait_s()
        await srv.image(b"b")                       # no wait: the wait is not reset
        return waited, Serving.decode_wait_s()

    async def main():
        first = asyncio.create_task(other())
        await asyncio.sleep(0.02)
        return (await asyncio.gather(request(), first))[0]

    waited, total = run(main())
    assert 0.1 <= waited < GUARD_S
    assert total >= waited
    assert srv.decode_slots._value == 1


def test_a_wait_for_a_slot_ends_at_the_deadline(monkeypatch):
    opened = _slow_open(monkeypatch, 0.4)
    srv = Serving(Settings(max_decodes=1, request_timeout_s=0.05))

    async def main():
        t0 = time.monotonic()
        out = await asyncio.gather(srv.image(b"a"), srv.image(b"b", "logo"),
                                   return_exceptions=True)
        return out, time.monotonic() - t0

    (first, second), _ = run(main())
    assert isinstance(first, Image.Image)
    assert isinstance(second, DeadlineExceeded)
    assert str(second) == "logo: deadline passed waiting to be decoded"
    assert second.status == 504
    assert opened == [b"a"]                          # the late one never decoded
    assert srv.decode_slots._value == 1


def test_a_request_past_its_deadline_is_not_decoded(monkeypatch):
    opened = _slow_open(monkeypatch, 0.0)
    srv = Serving(Settings(max_decodes=2))

    async def late():
        serving_module._REQUEST.set((time.monotonic() - 0.01, None))
        return await srv.image(b"x")

    with pytest.raises(DeadlineExceeded, match="^image: deadline passed"):
        run(late())
    assert opened == [] and srv.decode_slots._value == 2


def test_a_request_at_exactly_its_deadline_is_not_decoded(monkeypatch):
    """No time left is no time: the module's clock is frozen so that the time left is 0."""
    opened = _slow_open(monkeypatch, 0.0)
    monkeypatch.setattr(serving_module, "time", SimpleNamespace(monotonic=lambda: 100.0))
    srv = Serving(Settings(max_decodes=2))

    async def due():
        serving_module._REQUEST.set((100.0, None))
        return await srv.image(b"x")

    with pytest.raises(DeadlineExceeded):
        run(due())
    assert opened == [] and srv.decode_slots._value == 2


def test_a_gone_client_is_not_decoded_for_and_frees_its_slot(monkeypatch):
    opened = _slow_open(monkeypatch, 0.0)
    srv = Serving(Settings(max_decodes=2))
    srv.backend, srv.batcher = Recording(), object()

    async def request(gone: bool):
        srv.admit(Request(gone=gone))
        return await srv.image(b"x")

    with pytest.raises(ClientGone):
        run(request(True))
    assert opened == [] and srv.decode_slots._value == 2
    run(request(False))
    assert opened == [b"x"] and srv.decode_slots._value == 2


# ------------------------------------------------------------------ running jobs
def test_answer_queues_in_the_limits_bucket_and_reports_to_the_hooks():
    seen = []

    class Hooks(ServingHooks):
        def answered(self, request_id, result, queued_s):
            seen.append((request_id, result.answer, queued_s))

    async def main():
        srv = await attached(Settings(request_timeout_s=20.0), hooks=Hooks())
        t0 = time.monotonic()
        served = await srv.answer([item(5), item(8, Image.new("RGB", (8, 8), (0, 0, 255)))],
                                  "req-1")
        quiet = await srv.answer([item(9)])
        scored = await srv.score([ScoreItem(RED, "q", "r", None)])
        await srv.stop()
        return srv.batcher.submitted, served, quiet, scored, t0

    submitted, served, quiet, scored, t0 = run(main())
    (h1, n1, d1, k1), (h2, n2, _, k2), (h3, n3, _, k3) = submitted
    assert (h1, n1, k1) == ("answer", 2, 8)          # the first item's limit, bucketed
    assert (h2, n2, k2) == ("answer", 1, 16)
    assert (h3, n3, k3) == ("score", 1, None)
    assert t0 + 20.0 <= d1 < t0 + 20.0 + GUARD_S     # one timeout from now
    assert [s.result.answer for s in served] == ["red", "blue"]
    assert all(isinstance(s, Served) and s.batch == 2 and 0.0 <= s.queued_s < GUARD_S
               for s in served)
    assert seen == [("req-1", "red", served[0].queued_s), ("req-1", "blue", served[1].queued_s)]
    assert quiet[0].batch == 1 and scored[0].result.answer == "x"


async def _busy(settings: Settings, backend: Recording) -> tuple[Serving, asyncio.Task]:
    """A service on `backend` whose batcher is running one answer (held by the backend)."""
    srv = await attached(settings, backend)
    task = asyncio.create_task(srv.answer([item()]))
    while srv.batcher.inflight == 0:
        await asyncio.sleep(0.005)
    return srv, task


def test_a_full_queue_is_429_and_too_many_items_413():
    hold = threading.Event()
    backend = Recording(hold)

    async def main():
        srv, running = await _busy(Settings(queue_limit=2, batch_wait_ms=0.0), backend)
        queued = asyncio.create_task(srv.answer([item(), item()]))     # at the limit
        await asyncio.sleep(0.02)
        with pytest.raises(QueueFull) as full:
            await srv.answer([item()])
        with pytest.raises(TooManyItems) as many:
            await srv.score([ScoreItem(RED, "q", "r", None)] * 3)
        hold.set()
        out = await running, await queued
        await srv.stop()
        return full.value, many.value, out

    try:
        full, many, (one, two) = run(main())
    finally:
        hold.set()
    assert (full.status, full.headers) == (429, {"Retry-After": "1"})
    assert many.status == 413 and "--queue-limit 2" in many.detail
    assert len(one) == 1 and len(two) == 2


def test_no_answer_within_the_deadline_is_504_and_the_job_is_dropped():
    hold = threading.Event()
    backend = Recording(hold)

    async def main():
        srv, busy = await _busy(Settings(request_timeout_s=0.1, batch_wait_ms=0.0), backend)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as e:
            await srv.answer([item(16)])
        elapsed = time.monotonic() - t0
        hold.set()
        with pytest.raises(DeadlineExceeded):
            await busy
        await srv.stop()
        return e.value, elapsed

    try:
        err, elapsed = run(main())
    finally:
        hold.set()
    assert str(err) == "no answer within 0.1 s" and err.status == 504
    assert elapsed < 0.9                             # the deadline, not a second later
    assert len(backend.seen) == 1                    # the late job never ran


def test_a_passed_deadline_times_out_at_once():
    async def main():
        srv = await attached(Settings(request_timeout_s=30.0))
        serving_module._REQUEST.set((time.monotonic() - 1.0, None))
        with pytest.raises(DeadlineExceeded):
            await srv.answer([item()])
        await srv.stop()

    run(main())


def test_a_failed_job_fails_the_request_and_cancels_the_rest():
    class Failing(Recording):
        def answer_batch(self, items, deadlines):
            return [ValueError("bad item"), *super().answer_batch(items[1:], deadlines[1:])]

    async def main():
        srv = await attached(Settings(batch_wait_ms=50.0), Failing())
        with pytest.raises(ValueError, match="bad item"):
            await srv.answer([item(), item()])
        await srv.stop()

    run(main())


def _gone_while_busy(call) -> tuple[list, float]:
    """`call(srv, gone)` while the batcher holds another request: it must raise ClientGone
    after asking `gone` once. The polls and the seconds it took."""
    hold = threading.Event()
    polls = []

    async def gone() -> bool:
        polls.append(1)
        return True

    async def main():
        srv, busy = await _busy(Settings(batch_wait_ms=0.0), Recording(hold))
        t0 = time.monotonic()
        with pytest.raises(ClientGone):
            await call(srv, gone)
        elapsed = time.monotonic() - t0
        hold.set()
        await busy
        await srv.stop()
        return elapsed

    try:
        return polls, run(main())
    finally:
        hold.set()


def test_a_client_gone_while_waiting_is_499_and_its_jobs_cancelled():
    polls, elapsed = _gone_while_busy(
        lambda srv, gone: srv.score([ScoreItem(RED, "q", "r", None)], gone))
    # not held until the other request ends (never, without `hold.set()`)
    assert polls == [1] and elapsed < GUARD_S


def test_answer_passes_the_gone_check_on():
    polls, _ = _gone_while_busy(lambda srv, gone: srv.answer([item()], "req", gone))
    assert polls == [1]


def test_answer_and_score_need_the_model():
    srv = Serving(Settings())
    with pytest.raises(NotReady):
        run(srv.answer([item()]))
    with pytest.raises(NotReady):
        run(srv.score([ScoreItem(RED, "q", "r", None)]))


def test_settled_returns_on_the_first_failure_and_polls_only_with_a_gone_check():
    async def main():
        loop = asyncio.get_running_loop()
        ok, bad, never = loop.create_future(), loop.create_future(), loop.create_future()
        ok.set_result(1)
        bad.set_exception(ValueError("x"))
        await serving_module._settled([ok, bad, never], None)     # returns: one failed
        cancelled = loop.create_future()
        cancelled.cancel()
        later = loop.create_future()
        loop.call_later(0.05, later.set_result, 2)
        await serving_module._settled([cancelled, later], None)   # a cancel is no failure
        assert later.done()

        polls = []

        async def stays() -> bool:
            polls.append(1)
            return False

        slow = loop.create_future()
        loop.call_later(0.25, slow.set_result, 3)
        # a poll finds one done and one pending: a success alone ends nothing
        await serving_module._settled([ok, slow], stays)
        assert slow.done()
        bad.exception()
        never.cancel()
        return polls

    polls = run(main())
    assert 1 <= len(polls) <= 4                      # polled every GONE_POLL_S (0.1 s)
    assert serving_module.GONE_POLL_S == 0.1
