"""An absolute-form target (`POST http://host/feedback`) meets every check that
RequestContext makes by the path before routing: OriginForm must sit outside it. With
OriginForm inside, the router still found the route (every routing test passed) while
the key's pre-check, /feedback's small body bound and the JSON pre-check were skipped."""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

from prometheus_client import generate_latest

from app.main import create_app
from app.settings import Settings


def _absolute(app, method: str, target: bytes, headers: list | None = None, body: bytes = b""
              ) -> tuple[int, bytes]:
    """`app` called as uvicorn's h11 server calls it for `method target`: the target up to
    its query is both `path` (unquoted) and `raw_path`. The status and the body."""
    raw_path, _, query = target.partition(b"?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": unquote(raw_path.decode("ascii")),
             "raw_path": raw_path, "query_string": query, "root_path": "",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1234),
             "headers": [(b"host", b"example.org"), *(headers or [])]}
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _counted(app, route: str, status: int) -> bool:
    return (f'dualread_requests_total{{route="{route}",status="{status}"}} 1.0'
            in generate_latest(app.state.metrics.registry).decode())


def test_an_absolute_target_meets_the_checks_made_before_routing(tmp_path):
    app = create_app(Settings(api_key="api-secret", recert_state=str(tmp_path / "state.json")))
    key = [(b"authorization", b"Bearer api-secret")]
    kind = [(b"content-type", b"application/json")]
    # no key: refused by the pre-check, before a byte of the body is read
    status, body = _absolute(app, "POST", b"http://example.org/answer",
                             kind + [(b"content-length", b"1000000000")])
    assert status == 401 and b"credentials" in body
    assert _counted(app, "precheck", 401)
    # /feedback's own small bound, judged from the length
    status, body = _absolute(app, "POST", b"https://example.org:8443/feedback?x=1",
                             key + kind + [(b"content-length", b"20000")])
    assert status == 413 and b"16384 bytes" in body
    # the JSON pre-check (the parser would keep the last of two equal keys)
    twice = b'{"request_id": "' + b"0" * 32 + b'", "request_id": "1", "correct": true}'
    status, body = _absolute(app, "POST", b"HTTP://example.org/feedback",
                             key + kind + [(b"content-length", str(len(twice)).encode())],
                             twice)
    assert status == 422 and b"duplicate key" in body
    # routed: labelled by its route in the metrics (and the access log)
    status, _ = _absolute(app, "GET", b"http://example.org/health/live")
    assert status == 200 and _counted(app, "/health/live", 200)
    # the whole target, authority included, counts toward the request line's bound
    status, body = _absolute(app, "GET", b"http://" + b"a" * 16384 + b"/health/live")
    assert status == 414 and b"request line" in body
