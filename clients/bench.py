"""HTTP load generator: a real `dualread serve` process, driven by N concurrent clients.

The server runs as a subprocess on a free loopback port with its own `--max-batch-size`;
the bench waits for `/health/ready`, sends a bounded number of `/answer` requests from
1, 4 and 16 concurrent clients (request bodies are serialised once, up front, so the
client spends its CPU on HTTP, not on base64), and stops the server.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`dualread serve` in a subprocess; use as a context manager."""

    def __init__(self, flags: dict[str, object], threads: int | None = None,
                 ready_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port)]
        for k, v in flags.items():
            if v is not None:
                args += [f"--{k.replace('_', '-')}", str(v)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if threads:
            # torch reads these at import: the server computes on as many threads as the
            # in-process measurement it is compared with.
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.args = args
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServeProcess:
        """Spawn the process; `wait_ready` blocks until it serves (start several, then wait)."""
        if self.proc is None:
            # The access log goes to stderr; it is discarded so the pipe never fills.
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        return self

    def __enter__(self) -> ServeProcess:
        return self.start().wait_ready()

    def wait_ready(self) -> ServeProcess:
        self.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"dualread serve exited with {self.proc.returncode}: "
                                   + " ".join(self.args))
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"dualread serve was not ready within {self.ready_timeout_s} s")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Load:
    concurrency: int
    latencies_s: list[float]
    wall_s: float
    errors: int

    def summary(self) -> dict:
        lat = np.asarray(self.latencies_s) * 1000
        ok = len(lat)
        pct = (lambda q: float(np.percentile(lat, q))) if ok else (lambda q: float("nan"))
        return {"requests": ok + self.errors, "errors": self.errors,
                "rps": ok / self.wall_s if self.wall_s > 0 else float("nan"),
                "p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99),
                "mean_ms": float(lat.mean()) if ok else float("nan")}


async def _drive(url: str, bodies: Sequence[bytes], concurrency: int, requests: int,
                 timeout_s: float, advance: Callable[[], None] | None) -> Load:
    latencies: list[float] = []
    errors = 0
    next_i = 0
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            nonlocal next_i, errors
            while next_i < requests:
                i = next_i
                next_i += 1
                t = time.perf_counter()
                try:
                    r = await client.post("/answer", content=bodies[i % len(bodies)],
                                          headers=headers)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t)
                else:
                    errors += 1
                if advance:
                    advance()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Load(concurrency, latencies, wall, errors)


def drive(url: str, bodies: Sequence[bytes], concurrency: int, requests: int,
          timeout_s: float = 120.0, advance: Callable[[], None] | None = None) -> Load:
    """Send `requests` POST /answer bodies from `concurrency` clients; each client sends
    its next request as soon as its previous one is answered (closed loop)."""
    return asyncio.run(_drive(url, bodies, concurrency, requests, timeout_s, advance))


def _merge(parts: list[Load]) -> Load:
    return Load(parts[0].concurrency, [x for p in parts for x in p.latencies_s],
                sum(p.wall_s for p in parts), sum(p.errors for p in parts))


# the stages of `timings_ms` that are the model's (not `decode_wait`, spent before queueing)
MODEL_STAGES = ("queue", "generate", "readout", "heads")


def _post_timed(client: httpx.Client, body: bytes) -> tuple[float, float] | None:
    """Seconds the request took at the client and the seconds the server reports for its
    model stages (queue, generate, readout, heads); None when it failed."""
    t = time.perf_counter()
    try:
        r = client.post("/answer", content=body, headers={"content-type": "application/json"})
    except httpx.HTTPError:
        return None
    took = time.perf_counter() - t
    if r.status_code != 200:
        return None
    timings = r.json()["timings_ms"]
    return took, sum(timings[k] for k in MODEL_STAGES) / 1000


def http_bench(bodies: Sequence[bytes], server_flags: dict[str, object],
               requests: dict[int, int], threads: int | None = None, batch_size: int = 16,
               rounds: int = 2, in_process_b1: Callable[[int], float] | None = None,
               in_process_b8: Callable[[], tuple[int, float]] | None = None,
               progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict:
    """Requests/s and latency percentiles at each concurrency, micro-batching on
    (`--max-batch-size batch_size`) and off (`--max-batch-size 1`).

    Both servers run at once and are driven in alternating rounds, so a change in machine
    load between them does not land in their ratio. At one client, each request to each
    server alternates with `in_process_b1(i)` (seconds for item i answered in process);
    at the highest concurrency, each round alternates with `in_process_b8()` (items and
    seconds of an in-process batch-8 pass): overhead and ceiling come from the same window.
    """
    labels = {"batching": batch_size, "no_batching": 1}
    servers = {k: ServeProcess({**server_flags, "max_batch_size": mbs}, threads).start()
               for k, mbs in labels.items()}          # both load at once
    try:
        for label, srv in servers.items():
            srv.wait_ready()
            drive(srv.url, bodies, labels[label], 2 * labels[label])   # warm-up, not counted
        return {f"c{c}": _at(c, n, c == max(requests), servers, bodies, rounds,
                             in_process_b1, in_process_b8, progress)
                for c, n in requests.items()}
    finally:
        for srv in servers.values():
            srv.stop()


def _at(c: int, n: int, top: bool, servers: dict[str, ServeProcess], bodies: Sequence[bytes],
        rounds: int, in_process_b1, in_process_b8, progress) -> dict:
    """One concurrency level against both servers (and the in-process reference)."""
    adv = progress(f"HTTP, {c} client(s), batching on and off", n * len(servers)) \
        if progress else None
    if c == 1:
        return _paired_single(servers, bodies, n, in_process_b1, adv)
    parts: dict[str, list[Load]] = {k: [] for k in servers}
    inproc: list[tuple[int, float]] = []
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for label in order:
            parts[label].append(drive(servers[label].url, bodies, c, n // rounds, advance=adv))
        if top and in_process_b8:
            inproc.append(in_process_b8())
    out: dict = {k: _merge(v).summary() for k, v in parts.items()}
    if inproc:
        out["in_process_b8_rps"] = sum(i for i, _ in inproc) / sum(s for _, s in inproc)
    return out


def _paired_single(servers: dict[str, ServeProcess], bodies: Sequence[bytes], n: int,
                   in_process_b1: Callable[[int], float] | None,
                   advance: Callable[[], None] | None) -> dict:
    """One client: request i to each server, then item i in process, order rotated."""
    clients = {k: httpx.Client(base_url=s.url, timeout=120) for k, s in servers.items()}
    # the client's seconds of request i (None: it failed), and per answered request those
    # less what the server reports for the model stages
    lat: dict[str, list[float | None]] = {k: [None] * n for k in servers}
    outside: dict[str, list[float]] = {k: [] for k in servers}
    errors = dict.fromkeys(servers, 0)
    walls = dict.fromkeys(servers, 0.0)
    inproc: list[float] = []
    steps = [*servers, "in_process"]
    try:
        for i in range(n):
            k = i % len(steps)
            for step in steps[k:] + steps[:k]:
                if step == "in_process":
                    if in_process_b1:
                        inproc.append(in_process_b1(i))
                    continue
                t = time.perf_counter()
                got = _post_timed(clients[step], bodies[i % len(bodies)])
                walls[step] += time.perf_counter() - t
                if got is None:
                    errors[step] += 1
                else:
                    lat[step][i] = got[0]
                    outside[step].append(got[0] - got[1])
                if advance:
                    advance()
    finally:
        for c in clients.values():
            c.close()
    out: dict = {k: Load(1, [x for x in lat[k] if x is not None], walls[k],
                         errors[k]).summary() for k in servers}
    for k in servers:
        out[k]["outside_model_ms"] = float(np.median(outside[k]) * 1000) if outside[k] \
            else float("nan")
        diffs = [h - p for h, p in zip(lat[k], inproc) if h is not None]
        out[k]["paired_overhead_ms"] = float(np.median(diffs) * 1000) if diffs \
            else float("nan")
        out[k]["paired_requests"] = len(diffs)
    if inproc:
        out["in_process_b1_ms"] = float(np.median(inproc) * 1000)
    return out
