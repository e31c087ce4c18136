"""The request target counts toward `--max-header-bytes` with the headers: h11 bounds the
request line only while it arrives in pieces, so a URL sent whole in one read (60 KB, live)
reached the routes past the documented bound."""

from __future__ import annotations

from tests.helpers import assert_error, small_limits_client


def test_a_long_query_in_one_read_is_414(service):
    with small_limits_client(service, max_header_bytes=2048) as c:
        assert c.get("/health/live", params={"pad": "a" * 1500}).status_code == 200
        assert_error(c.get("/health/live", params={"pad": "a" * 2100}), 414,
                     "request line and headers over 2048 bytes")
        # a long path is the target's too (a 404 otherwise)
        assert_error(c.get("/" + "a" * 2100), 414, "request line and headers over 2048")
        # the headers over the bound on their own keep their status
        assert_error(c.get("/health/live", headers={"x-pad": "a" * 2100}), 431,
                     "request headers over 2048 bytes")


def test_a_short_target_beside_long_headers_is_431(service):
    """The larger part names the status: a 12-byte URL is not "URI too long"."""
    with small_limits_client(service, max_header_bytes=2048) as c:
        def status(n: int) -> int:
            return c.get("/health/live", headers={"x-pad": "a" * n}).status_code

        lo, hi = 1000, 2048            # the longest pad that passes, by bisection
        assert status(lo) == 200 and status(hi) == 431
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if status(mid) == 200 else (lo, mid)
        # one byte past it, the line (27 bytes) pushes the headers over: still theirs
        assert_error(c.get("/health/live", headers={"x-pad": "a" * hi}), 431,
                     "request line and headers over 2048 bytes")


def test_the_target_and_the_headers_share_the_bound(service):
    with small_limits_client(service, max_header_bytes=2048) as c:
        r = c.get("/health/live", params={"pad": "a" * 1100}, headers={"x-pad": "a" * 1000})
        assert_error(r, 414, "request line and headers over 2048 bytes")


def test_many_empty_headers_count_their_separators(service):
    """Each header counts as it travels ("name: value" and CRLF): 600 empty headers are
    600 bytes by name alone, within 2 KiB, and 3,000 on the wire."""
    with small_limits_client(service, max_header_bytes=2048) as c:
        few = [(f"a{k}".encode(), b"") for k in range(100)]
        assert c.get("/health/live", headers=few).status_code == 200
        many = [(b"a", b"")] * 600
        assert_error(c.get("/health/live", headers=many), 431, "request headers over 2048 bytes")
