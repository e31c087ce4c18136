"""The image check in a process of its own, so that it runs beside decoding.

The check reads pixels only, so nothing stops it from running while the batch decodes —
except the interpreter lock: beside a thread running checks, greedy decoding of the
embedded actor slowed ×1.6 (both are many small numpy/torch calls holding the lock in
turns). A process has its own lock and another core. It is a plain child
(`python -m heads.check_process`, not multiprocessing: that would re-run the caller's
main script in the child), imports numpy, PIL and `heads.image_check` only (no torch:
it starts in a fifth of a second), receives each image's bytes after the size bounds
over a pipe and returns scores and p-values equal to `Heads.image_readings`.

Nothing the caller does waits on the child: batches go to the pipe from a writer thread
(a child that stopped reading would otherwise block the model worker once a batch is
larger than the pipe's buffer) and replies come back on a reader thread. Each child keeps
its own pending batches, so a dying child fails only what it was given. A child that dies
is reaped and replaced on the next batch; a child killed for not answering counts as a
death too. After MAX_DEATHS deaths in a row without one reply the process is given up for
RETRY_AFTER_S (the caller checks images itself meanwhile), then tried once more. On Linux
the child is killed with its parent, even when it is stopped.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from heads.conformal import kth_distance, p_values
from heads.image_check import bounded, pixel_features_many

if TYPE_CHECKING:
    from heads.novelty import Novelty, NoveltyReading

PARENT_ENV = "DUALREAD_CHECK_PARENT"     # the server's pid, for the child to watch
MAX_DEATHS = 3          # children lost in a row, without one reply, before giving up
RETRY_AFTER_S = 60.0    # how long a given-up process stays given up before one more try

log = logging.getLogger("dualread.check")
ROOT = Path(__file__).resolve().parent.parent     # where `heads` is importable from


@dataclass(frozen=True)
class CheckTables:
    """A fitted k-NN image check as numpy arrays: what its process needs to score."""

    mean: np.ndarray
    scale: np.ndarray
    bank: np.ndarray
    k: int
    calibration: np.ndarray       # ascending
    alpha: float

    @classmethod
    def of(cls, check: Novelty, alpha: float) -> CheckTables:
        t = check.t
        return cls(t["mean"].numpy(), t["scale"].numpy(), t["bank"].numpy(), check.k,
                   t["calibration"].numpy(), alpha)

    def read(self, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Scores and p-values of images given as `bounded` arrays."""
        z = (pixel_features_many(arrays) - self.mean) / self.scale
        s = kth_distance(z, self.bank, self.k)
        return s, p_values(self.calibration, s, presorted=True)


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The child's loop: the tables, then (id, arrays) → (id, scores, p-values, CPU
    seconds) or (id, error text), until the parent closes the pipe."""
    tables: CheckTables = pickle.load(inp)
    while True:
        try:
            rid, arrays = pickle.load(inp)
        except EOFError:
            return
        c = time.process_time()
        try:
            s, p = tables.read(arrays)
            reply: tuple = (rid, s, p, time.process_time() - c)
        except Exception as e:                   # one bad batch is that batch's error
            reply = (rid, f"{type(e).__name__}: {e}")
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


class _Child:
    """One running child: its process, the batches it was given, its two pipe threads."""

    def __init__(self, owner: CheckProcess) -> None:
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-m", "heads.check_process"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.dead = False
        self.outbox.put(owner.tables)
        # the threads hold the owner weakly: a forgotten CheckProcess is collected, and
        # its finaliser ends the child
        ref = weakref.ref(owner)
        for target, name in ((self._write, "image-check-writer"),
                             (lambda: self._read(ref), "image-check-reader")):
            threading.Thread(target=target, daemon=True, name=name).start()

    def give(self, rid: int, arrays: list[np.ndarray], fut: Future) -> None:
        with self.lock:
            if self.dead:
                fut.set_exception(RuntimeError("the image check's process ended"))
                return
            self.pending[rid] = fut
        self.outbox.put((rid, arrays))

    def _write(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        while True:
            item = self.outbox.get()
            if item is None:
                return
            try:
                pickle.dump(item, stdin, protocol=pickle.HIGHEST_PROTOCOL)
                stdin.flush()
            except Exception:          # noqa: BLE001 (a dead or killed child: the reader ends it)
                self.end()
                return

    def _read(self, owner: weakref.ref) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        while True:
            try:
                reply = pickle.load(stdout)
            except Exception:          # noqa: BLE001 (EOF, a broken or polluted stream)
                break
            with self.lock:
                fut = self.pending.pop(reply[0], None) if isinstance(reply, tuple) else None
            check = owner()
            if fut is None or check is None:
                continue
            if len(reply) == 2:
                fut.set_exception(RuntimeError(f"image check failed: {reply[1]}"))
            else:
                _, s, p, cpu = reply
                check.replied(cpu)
                fut.set_result(check.readings(s, p))
            del check
        ended_by_us = self.dead
        self.end()
        check = owner()
        if check is not None and not ended_by_us:
            check.died(self)

    def end(self) -> None:
        """Kills and reaps the child, closes its pipes and fails what it was given
        (idempotent; never waits on a child that stopped: SIGKILL ends stopped ones too)."""
        with self.lock:
            first = not self.dead
            self.dead = True
            left = list(self.pending.values())
            self.pending.clear()
        if first:
            self.outbox.put(None)
            try:
                self.proc.kill()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except Exception:      # noqa: BLE001 (closing after a failed write)
                    pass
        for f in left:
            if not f.done():
                f.set_exception(RuntimeError("the image check's process ended"))


class CheckProcess:
    """Sends batches of images to the check's process; (re)started when needed."""

    def __init__(self, check: Novelty, alpha: float) -> None:
        if check.kind != "knn":
            raise ValueError(f"only a k-NN image check runs in a process, not {check.kind!r}")
        self.tables = CheckTables.of(check, alpha)
        self.lock = threading.Lock()
        self.box: dict[str, _Child | None] = {"child": None}   # the finaliser's view
        self.next_id = 0
        self.deaths = 0              # children lost in a row without a reply
        self.last_death = 0.0        # time.monotonic() of the latest
        self.cpu_seconds = 0.0       # the process's CPU time over every finished batch
        weakref.finalize(self, _end_boxed, self.box)

    @property
    def given_up(self) -> bool:
        return self.deaths >= MAX_DEATHS and \
            time.monotonic() - self.last_death < RETRY_AFTER_S

    @property
    def proc(self) -> subprocess.Popen | None:
        child = self.box["child"]
        return None if child is None or child.dead else child.proc

    def start(self) -> None:
        """Starts the process now rather than with the first batch."""
        with self.lock:
            self._child()

    def _child(self) -> _Child:
        child = self.box["child"]
        if child is None or child.dead:
            child = self.box["child"] = _Child(self)
        return child

    def replied(self, cpu: float) -> None:
        self.deaths = 0
        self.cpu_seconds += cpu

    def died(self, child: _Child, why: str | None = None) -> None:
        with self.lock:
            if self.box["child"] is child:
                self.box["child"] = None
            self.deaths += 1
            self.last_death = time.monotonic()
            deaths = self.deaths
        log.warning("the image check's process %s%s", why or
                    f"ended (exit code {child.proc.returncode})",
                    f"; given up for {RETRY_AFTER_S:.0f} s: images are checked in the server"
                    if deaths >= MAX_DEATHS else "; the next batch starts another")

    def readings(self, s: np.ndarray, p: np.ndarray) -> list[NoveltyReading]:
        from heads.novelty import NoveltyReading

        alpha = self.tables.alpha
        return [NoveltyReading(float(a), float(b), bool(b < alpha)) for a, b in zip(s, p)]

    def submit(self, images: list) -> Future[list[NoveltyReading]]:
        """The readings of `images`, in order, once the process has measured them. Never
        waits on the child."""
        return self.send([bounded(im) for im in images])

    def send(self, arrays: list[np.ndarray]) -> Future[list[NoveltyReading]]:
        """`submit` for images already given as `bounded` arrays."""
        if self.given_up:
            raise RuntimeError("the image check's process was given up")
        fut: Future[list[NoveltyReading]] = Future()
        with self.lock:
            child = self._child()
            rid = self.next_id
            self.next_id += 1
        child.give(rid, arrays, fut)
        return fut

    def close(self, kill: bool = False) -> None:
        """Ends the process; the next batch starts a new one. `kill`: because it stopped
        answering, which counts as a death (a child that hangs every time is given up like
        one that dies every time)."""
        with self.lock:
            child, self.box["child"] = self.box["child"], None
        if child is not None:
            child.end()
            if kill:
                self.died(child, "did not answer in time and was killed")


def _end_boxed(box: dict) -> None:
    child = box.get("child")
    if child is not None:
        child.end()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a stopped child never reads the
    EOF that would end it). Elsewhere the EOF alone ends it."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))           # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    _die_with_parent()
    if str(os.getppid()) != os.environ.get(PARENT_ENV, str(os.getppid())):
        sys.exit(0)                          # the parent died before the line above
    # the protocol owns the pipe on fd 1; anything else written there (a stray print, a
    # library's warning) goes to stderr instead
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, protocol_out)
