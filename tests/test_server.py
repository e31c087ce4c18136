"""A real uvicorn process on a free port: contract, overload, SIGTERM drain (the OpenAPI
conformance run is tests/test_openapi_conformance.py)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from PIL import Image

from tests.conftest import random_image
from tests.helpers import b64, png_bytes, random_heads

Q = "what color is the shape?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, actor_dir: str, heads_dir: str, **flags) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "app.cli", "serve", "--actor", actor_dir, "--heads",
                heads_dir, "--port", str(self.port)]
        for k, v in flags.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Logs go to a file: an unread pipe fills after ~64 KB of access log and then
        # blocks the server on its next log line.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=self.log, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(self.log.read()[-4000:])
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def heads_dir(actors, tmp_path_factory):
    return random_heads(tmp_path_factory.mktemp("srv-heads"), actors["qwen3_vl"])


@pytest.fixture(scope="module")
def server(actor_dirs, heads_dir):
    s = Server(actor_dirs["qwen3_vl"], heads_dir, max_new_tokens=8, queue_limit=4,
               max_batch_size=4, batch_wait_ms=20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def roomy(actor_dirs, heads_dir):
    """A queue that holds a burst of 8: for tests that must not see 429s."""
    s = Server(actor_dirs["qwen3_vl"], heads_dir, max_new_tokens=8, queue_limit=32,
               max_batch_size=8, batch_wait_ms=50)
    yield s
    s.stop()


def body(seed: int = 0) -> dict:
    return {"image": b64(png_bytes(random_image(seed))), "question": Q}


def test_answer_over_http(server):
    r = httpx.post(server.url + "/answer", json=body(), timeout=30)
    assert r.status_code == 200, r.text
    assert 0 <= r.json()["confidence"]["dualread"] <= 1


def test_overload_gives_429_and_loses_nothing(server):
    """More concurrent requests than queue + batch: some 429s, the rest answered right."""
    reference = {s: httpx.post(server.url + "/answer", json=body(s), timeout=30).json()
                 for s in range(4)}
    with cf.ThreadPoolExecutor(48) as pool:
        futs = [pool.submit(httpx.post, server.url + "/answer", json=body(i % 4), timeout=60)
                for i in range(48)]
        results = [(i % 4, f.result()) for i, f in enumerate(futs)]
    codes = [r.status_code for _, r in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) > 0
    assert all(r.headers.get("retry-after") for _, r in results if r.status_code == 429)
    for seed, r in results:
        if r.status_code == 200:   # same response as alone, confidences within 1e-6
            assert r.json()["response"] == reference[seed]["response"]
            assert abs(r.json()["confidence"]["dualread"]
                       - reference[seed]["confidence"]["dualread"]) < 1e-6


def _batch_totals(url: str) -> tuple[float, float]:
    """(items, batches) the server has run so far, from its batch-size histogram."""
    text = httpx.get(url + "/metrics", timeout=30).text
    got = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
           if line.startswith("dualread_batch_size_")}
    return got["dualread_batch_size_sum"], got["dualread_batch_size_count"]


def test_different_limits_share_a_batch(roomy):
    """Four concurrent requests, four different `max_new_tokens` in one power-of-two
    bucket: they are batched together (each row stops at its own limit) and each gets
    what it gets alone."""
    limits = [5, 6, 7, 8]
    alone = [httpx.post(roomy.url + "/answer", json={**body(n), "max_new_tokens": n},
                        timeout=30).json() for n in limits]
    items, batches = _batch_totals(roomy.url)
    with cf.ThreadPoolExecutor(len(limits)) as pool:
        futs = [pool.submit(httpx.post, roomy.url + "/answer",
                            json={**body(n), "max_new_tokens": n}, timeout=60) for n in limits]
        together = [f.result().json() for f in futs]
    items2, batches2 = _batch_totals(roomy.url)
    assert items2 - items == len(limits) and batches2 - batches < len(limits)
    for a, t in zip(alone, together):
        assert t["response"] == a["response"]
        assert abs(t["confidence"]["dualread"] - a["confidence"]["dualread"]) < 1e-6


def test_one_bad_request_does_not_fail_its_batch(roomy):
    """7 good requests sent together with an unusable one: 7 answers and one 422."""
    server = roomy
    wide = {"image": b64(png_bytes(Image.new("RGB", (300, 1)))), "question": Q}
    reserved = {**body(1), "question": "what color is <|image_pad|>?"}
    for bad in (wide, reserved):
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(httpx.post, server.url + "/answer",
                                json=bad if i == 4 else body(i % 4), timeout=60)
                    for i in range(8)]
            codes = [f.result().status_code for f in futs]
        assert codes[4] == 422 and [c for i, c in enumerate(codes) if i != 4] == [200] * 7, codes


def test_oversized_body_refused_before_it_is_read(server):
    """Headers announce 200 MB and no body follows: the 413 comes anyway, so the server did
    not wait to read the body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200000000\r\n\r\n")
        data = b""
        while not data.rstrip().endswith(b"}"):   # headers, then the JSON body
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    reply = data.decode("latin-1")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert '"request_id"' in reply and "x-request-id" in reply.lower()


def _sample(text: str, prefix: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith(prefix)), 0.0)


def test_sigterm_drains_in_flight(actor_dirs, heads_dir):
    s = Server(actor_dirs["qwen3_vl"], heads_dir, max_new_tokens=32, max_batch_size=1,
               queue_limit=16)
    try:
        with cf.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(httpx.post, s.url + "/answer", json=body(i), timeout=60)
                    for i in range(6)]
            # wait until every request has reached the server: done + queued + running
            deadline = time.time() + 30
            while time.time() < deadline:
                text = httpx.get(s.url + "/metrics", timeout=5).text
                depth = _sample(text, "dualread_queue_depth ")
                done = _sample(text, 'dualread_requests_total{route="/answer",status="200"}')
                if done + depth + 1 >= 6:
                    break
                time.sleep(0.01)
            s.proc.send_signal(signal.SIGTERM)
            codes = [f.result().status_code for f in futs]
        assert codes == [200] * 6, codes
        # uvicorn re-raises the signal once shutdown is complete: graceful, then -SIGTERM
        assert s.proc.wait(30) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health/live", timeout=2)
    finally:
        s.stop()


def test_typed_client(server, tmp_path):
    from clients.http import DualReadClient

    img = tmp_path / "x.png"
    random_image(3).save(img)
    with DualReadClient(server.url) as c:
        assert c.ready()
        a = c.answer(img, Q)
        assert 0 <= a.confidence.dualread <= 1
        cf = c.counterfactual(img, Q)
        assert cf.real.response == a.response
        assert c.feedback(a.request_id, True).accepted
        with pytest.raises(httpx.HTTPStatusError, match="422"):
            c.answer(b"garbage", Q)


def test_oversized_header_is_refused_before_the_app_while_live_answers(server):
    """The HTTP parser bounds a request's headers (h11, `max_header_bytes`, 16 KiB by
    default): a header sent in 1 KiB pieces is answered with a 4xx once it passes the
    bound, long before its end, and /health/live answers all the while. (httptools had no
    bound: 96 MB in 16 KB pieces got a 200 after 17.8 s, stalling /health/live.)"""
    import select

    assert httpx.get(server.url + "/health/live", headers={"x-ok": "a" * 8000},
                     timeout=10).status_code == 200          # under the bound: served
    sent, reply = 0, b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        try:
            while sent < 1024 and not select.select([sock], [], [], 0.01)[0]:
                sock.sendall(b"a" * 1024)
                sent += 1
                if sent % 8 == 0:
                    assert httpx.get(server.url + "/health/live", timeout=5).status_code == 200
            sock.sendall(b"\r\n\r\n")     # an unbounded parser answers the whole header
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), reply[:200]
    assert sent < 64, sent          # cut off near 16 KiB, not after the whole megabyte
    assert httpx.get(server.url + "/health/live", timeout=5).status_code == 200


def test_a_request_target_in_absolute_form_is_routed_by_its_path(server):
    """RFC 9112 3.2.2: a server must accept `GET http://host/path`; uvicorn's parser kept
    the whole URL as the path, so it was a 404."""
    def send(raw: bytes) -> str:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(raw)
            data = b""
            while not data.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        return data.decode("latin-1")

    reply = send(b"GET http://example.org/health/live HTTP/1.1\r\nHost: example.org\r\n\r\n")
    assert reply.startswith("HTTP/1.1 200"), reply[:300]
    body = b'{"request_id": "' + b"0" * 32 + b'", "correct": true}'
    reply = send(b"POST HTTPS://example.org:8443/feedback?x=1 HTTP/1.1\r\nHost: example.org\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert reply.startswith("HTTP/1.1 200") and '"accepted":false' in reply, reply[:300]
    assert send(b"GET http://example.org/nope HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
        "HTTP/1.1 404")
    # a host no URL parser reads: routed all the same (it was a plain-text 500)
    reply = send(b"GET http://[PATIENT/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.startswith("HTTP/1.1 200") and "x-request-id" in reply.lower(), reply[:300]


def test_a_body_framed_two_ways_closes_the_connection(server):
    """Content-Length beside Transfer-Encoding (RFC 9112 6.1): the 400 closes the
    connection, so the bytes after the chunked body are never read as a second request."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /feedback HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                     b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_all(sock)                 # the server closes: recv ends
    reply = data.decode("latin-1")
    assert reply.startswith("HTTP/1.1 400") and "not both" in reply, reply[:300]
    assert reply.count("HTTP/1.1") == 1, reply     # the pipelined GET was not answered


def test_a_response_before_the_body_is_read_closes_the_connection(server):
    """Answered before its declared body was read (the router's 404, a 413 on the declared
    size), the connection stayed open and the server read and discarded a trickled body for
    as long as it came: a worker held by one slow client. Now it closes after answering."""
    heads = (b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n",
             b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 999999999\r\n\r\n")
    for head in heads:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            t0 = time.monotonic()
            sock.sendall(head + b"{")
            data = b""
            try:
                while chunk := sock.recv(65536):    # ends when the server half-closes
                    data += chunk
            except TimeoutError:
                pytest.fail(f"still open 10 s after {data[:40]!r}")
            # the half-close comes with the answer, not at the end of the lingering
            assert time.monotonic() - t0 < 1.5
            # and the server stops reading soon after: a trickle is reset within seconds
            t0 = time.monotonic()
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                while time.monotonic() - t0 < 8:
                    sock.sendall(b" ")
                    time.sleep(0.25)
            assert time.monotonic() - t0 < 5
        reply = data.decode("latin-1")
        assert reply.startswith(("HTTP/1.1 404", "HTTP/1.1 413")), reply[:300]
        assert "connection: close" in reply.lower(), reply[:300]


def test_the_parsers_own_400_is_the_json_error_shape(server):
    """A request the HTTP parser refuses before the app (no Host, two Content-Lengths, a
    NUL in the target) got uvicorn's plain-text `Invalid HTTP request received.`: now the
    service's JSON shape with a request id, and the connection still closes."""
    raws = (b"GET /health/live HTTP/1.1\r\n\r\n",
            b"POST /feedback HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2"
            b"\r\n\r\n{}",
            b"GET /health/\x00live HTTP/1.1\r\nHost: x\r\n\r\n")
    for raw in raws:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(raw)
            data = _read_all(sock)              # ends when the server closes
        head, _, payload = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").lower().split("\r\n")
        assert lines[0].startswith("http/1.1 400"), data[:300]
        assert "content-type: application/json" in lines and "connection: close" in lines
        doc = json.loads(payload)
        assert doc["detail"] == ("invalid HTTP request: a request line, header or framing "
                                 "the HTTP parser refuses, or a request line and headers "
                                 "over 16384 bytes")
        assert f"x-request-id: {doc['request_id']}" in lines and len(doc["request_id"]) == 32


def test_a_refused_upload_reads_its_answer_not_a_reset(server):
    """Closing at once with the client's body bytes unread makes the kernel reset the
    connection, which can destroy the refusal before the client reads it (RFC 9112 9.6):
    the server half-closes and goes on reading for a short while instead."""
    head = (b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b" " * 200_000)     # in the server's buffers, unread
        time.sleep(0.5)                          # the 413 is sent, then the close
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 413") and b"over the limit" in data, data[:300]


def _log_text(server) -> str:
    return os.pread(server.log.fileno(), 10_000_000, 0).decode("utf-8", "replace")


def test_a_body_that_breaks_the_framing_is_one_json_400_and_no_error(server):
    """A chunked body whose framing breaks after the app took the request: the parser's
    400 answered it, then the app's own answer raised inside h11 (two ERROR lines a
    request, on demand, and the request counted twice under two ids)."""
    raw = (b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(raw)
        data = _read_all(sock)
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data[:300]
    rid = json.loads(payload)["request_id"]
    time.sleep(0.5)
    lines = [json.loads(x) for x in _log_text(server).splitlines() if rid in x]
    assert [(x.get("route"), x.get("status")) for x in lines] == [("precheck", 400)], lines
    assert '"level": "ERROR"' not in _log_text(server)


def test_an_upgrade_is_not_served(server):
    """No route takes a WebSocket: an upgrade request with a body was never answered and
    held its connection until the client left."""
    raw = (b"GET /answer HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Content-Length: 3\r\n\r\nabc")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(raw)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            pytest.fail("no answer in 10 s")
    assert data.startswith(b"HTTP/1.1 "), data[:200]


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pytest.fail(f"reset after {data[:60]!r}")
    return data


def test_the_parsers_400_lingers_and_parses_nothing_more(server):
    """The parser's own 400 with the client's bytes unread: closed at once it reset the
    connection (the answer then at the mercy of the network); and while it lingers, what
    comes is discarded, not parsed again (each piece logged another warning)."""
    before = _unparsed_lines(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\n\r\n" + b"junk " * 40_000)
        time.sleep(0.5)
        for _ in range(3):
            sock.sendall(b"GET /health/live HTTP/1.1\r\n\r\n")
            time.sleep(0.1)
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 400") and data.count(b"HTTP/1.1") == 1, data[:300]
    time.sleep(0.3)
    assert _unparsed_lines(server) == before + 1
    # one line a refused request: uvicorn's WARNING for it (no request id) is not written
    assert "Invalid HTTP request received" not in _log_text(server)


def _unparsed_lines(server) -> int:
    return sum('"route": "unparsed"' in line for line in _log_text(server).splitlines())


def test_a_broken_body_on_the_openai_route_is_refused_in_openai_s_shape(server):
    """The parser's 400 for a body whose framing broke after the app took the request was
    the service's `{"detail", "request_id"}` on /v1/chat/completions too, where every
    error is OpenAI's shape."""
    for target in (b"/v1/chat/completions", b"http://x/v1/chat/completions"):
        raw = (b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nZZ\r\n\r\n")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(raw)
            data = _read_all(sock)
        head, _, payload = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").lower().split("\r\n")
        assert lines[0].startswith("http/1.1 400") and "connection: close" in lines, data
        assert json.loads(payload) == {"error": {
            "message": "invalid HTTP request: a request line, header or framing the HTTP "
                       "parser refuses, or a request line and headers over 16384 bytes",
            "type": "invalid_request_error", "param": None, "code": "bad_request"}}, target
        assert any(x.startswith("x-request-id: ") and len(x) == 46 for x in lines)


def test_an_upload_to_a_refused_request_is_read_to_its_end(server):
    """A client that writes its whole body before reading (most do): the server had paused
    reading the unread body, so the upload stalled and broke off before the refusal was
    read; the lingering close reads it to its end."""
    body = b" " * 20_000_000
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        # head and body in one write: the body's first bytes reach the parser before the
        # app answers, and past 64 KiB unread the server pauses reading
        sock.sendall(b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 999999999\r\n\r\n" + body)  # raises if it stalls
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 413"), data[:300]


def test_a_broken_body_after_a_wait_and_after_a_kept_request_is_logged_once(server):
    """The bad chunk arriving after the app began reading the body: the log line and the
    answer share one id. And a malformed request after an answered one on the same
    connection: the first keeps its own line and status."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
        time.sleep(0.5)
        sock.sendall(b"zz\r\n")
        data = _read_all(sock)
    rid = json.loads(data.partition(b"\r\n\r\n")[2])["request_id"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b"}"):                  # the whole first answer
            first += sock.recv(65536)
        sock.sendall(b"GET /health/live HTTP/1.1\r\n\r\n")       # no Host
        second = _read_all(sock)
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 400")
    live_id = re.search(rb"x-request-id: (\w+)", first).group(1).decode()
    bad_id = json.loads(second.partition(b"\r\n\r\n")[2])["request_id"]
    time.sleep(0.5)
    lines = [json.loads(x) for x in _log_text(server).splitlines() if x.startswith("{")]
    mine = {i: [(x.get("route"), x.get("status")) for x in lines if x.get("request_id") == i]
            for i in (rid, live_id, bad_id)}
    assert mine == {rid: [("precheck", 400)], live_id: [("/health/live", 200)],
                    bad_id: [("unparsed", 400)]}, mine


def test_a_broken_body_refused_by_the_key_is_one_400_and_no_error(actor_dirs, heads_dir):
    """With an API key, a keyless request whose chunked body breaks the framing in the same
    read: the parser's 400 went out, then the key's pre-check answered too and raised
    inside h11 (an ERROR line and an `unhandled` one for each such request, from any
    client). The app is told the client left; its answer is dropped."""
    s = Server(actor_dirs["qwen3_vl"], heads_dir, max_new_tokens=8, api_key="k1")
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"POST /answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
            data = _read_all(sock)
        assert data.startswith(b"HTTP/1.1 400") and data.count(b"HTTP/1.1") == 1, data[:300]
        rid = json.loads(data.partition(b"\r\n\r\n")[2])["request_id"]
        time.sleep(0.5)
        text = _log_text(s)
        lines = [json.loads(x) for x in text.splitlines() if rid in x]
        assert [(x.get("route"), x.get("status")) for x in lines] == [("precheck", 400)], lines
        assert '"level": "ERROR"' not in text
    finally:
        s.stop()
