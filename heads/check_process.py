"""The image check in a process of its own, so that it runs beside decoding.

The check reads pixels only, so nothing stops it from running while the batch decodes —
except the interpreter lock: beside a thread running checks, greedy decoding of the
embedded actor slowed ×1.6 (both are many small numpy/torch calls holding the lock in
turns). A process has its own lock and another core. It is a plain child
(`python -m heads.check_process`, not multiprocessing: that would re-run the caller's
main script in the child), imports numpy, PIL and `heads.image_check` only (no torch:
it starts in a fifth of a second), receives each image's bytes after the size bounds
over a pipe and returns scores and p-values equal to `Heads.image_readings`.
"""

from __future__ import annotations

import logging
import os
import pickle
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


class CheckProcess:
    """Sends batches of images to the check's process; (re)started when needed."""

    def __init__(self, check: Novelty, alpha: float) -> None:
        if check.kind != "knn":
            raise ValueError(f"only a k-NN image check runs in a process, not {check.kind!r}")
        self.tables = CheckTables.of(check, alpha)
        self.proc: subprocess.Popen | None = None
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.next_id = 0
        self.cpu_seconds = 0.0       # the process's CPU time over every finished batch

    def start(self) -> None:
        """Starts the process now rather than with the first batch."""
        with self.lock:
            self._running()

    def _running(self) -> subprocess.Popen:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.Popen([sys.executable, "-m", "heads.check_process"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        pickle.dump(self.tables, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()
        # The reply thread holds this object weakly, and a forgotten one closes the pipe
        # when collected: the child then ends instead of living as long as the server.
        threading.Thread(target=_replies, args=(weakref.ref(self), proc), daemon=True,
                         name="image-check-replies").start()
        weakref.finalize(self, _end, proc)
        self.proc = proc
        return proc

    def _reply(self, proc: subprocess.Popen, reply: tuple | None) -> None:
        """Hands one reply to its future; None: the process ended, fail what is left."""
        if reply is None:
            with self.lock:
                unexpected = self.proc is proc        # not ended by `close`
                if unexpected:
                    self.proc = None
                left = list(self.pending.values())
                self.pending.clear()
            if unexpected:
                log.warning("the image check's process ended (exit code %s); the next batch "
                            "starts another", proc.poll())
            for f in left:
                f.set_exception(RuntimeError("the image check's process ended"))
            return
        with self.lock:
            fut = self.pending.pop(reply[0], None)
        if fut is None:
            return
        if len(reply) == 2:
            fut.set_exception(RuntimeError(f"image check failed: {reply[1]}"))
            return
        _, s, p, cpu = reply
        self.cpu_seconds += cpu
        fut.set_result(self._readings(s, p))

    def _readings(self, s: np.ndarray, p: np.ndarray) -> list[NoveltyReading]:
        from heads.novelty import NoveltyReading

        alpha = self.tables.alpha
        return [NoveltyReading(float(a), float(b), bool(b < alpha)) for a, b in zip(s, p)]

    def submit(self, images: list) -> Future[list[NoveltyReading]]:
        """The readings of `images`, in order, once the process has measured them."""
        return self.send([bounded(im) for im in images])

    def send(self, arrays: list[np.ndarray]) -> Future[list[NoveltyReading]]:
        """`submit` for images already given as `bounded` arrays."""
        fut: Future[list[NoveltyReading]] = Future()
        with self.lock:
            proc = self._running()
            rid = self.next_id
            self.next_id += 1
            self.pending[rid] = fut
            try:
                assert proc.stdin is not None
                pickle.dump((rid, arrays), proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                proc.stdin.flush()
            except OSError as e:        # it died since: this batch fails, the next restarts
                self.pending.pop(rid, None)
                fut.set_exception(RuntimeError(f"the image check's process is gone: {e}"))
        return fut

    def close(self, kill: bool = False) -> None:
        """Ends the process (closing its input ends its loop; `kill`: at once, as for a
        process that stopped answering). The next batch starts a new one."""
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            _end(proc, kill)


def _end(proc: subprocess.Popen, kill: bool = False) -> None:
    try:
        if kill:
            proc.kill()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def _replies(owner: weakref.ref, proc: subprocess.Popen) -> None:
    """The reply thread: reads the child's answers until it ends."""
    assert proc.stdout is not None
    while True:
        try:
            reply = pickle.load(proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            reply = None
        check = owner()
        if check is None:
            return
        check._reply(proc, reply)
        del check
        if reply is None:
            return


if __name__ == "__main__":
    # the protocol owns the pipe on fd 1; anything else written there (a stray print, a
    # library's warning) goes to stderr instead
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, protocol_out)
