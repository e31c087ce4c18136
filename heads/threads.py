"""numpy's BLAS on one thread while the heads score a batch.

The heads' products are small (a batch's image tokens or prompt states against a bank of a
few thousand rows). Measured on the 2-core machine (docs/performance.md), a second OpenBLAS
thread changed `Heads.assess`'s wall time by a few percent either way on a quiet machine,
doubled its CPU time, and while another job ran made it up to 3x slower; after each call
it keeps spinning on a core that decoding or another request needs. With one thread the
outputs are the same, bit for bit. The limit holds only while the heads score, and
applies to every BLAS library loaded by then: numpy's OpenBLAS here. torch's CPU wheel
brings an OpenMP pool, not a BLAS, and its threads (`--threads`) are left alone; a torch
build with its own OpenBLAS would score the heads' few torch products on one thread too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from functools import lru_cache

from threadpoolctl import ThreadpoolController


@lru_cache(maxsize=1)
def _blas() -> ThreadpoolController:
    # inspecting the loaded libraries takes ~1 ms: once; numpy's BLAS is loaded by then
    return ThreadpoolController().select(user_api="blas")


def one_blas_thread() -> AbstractContextManager:
    """A context in which numpy's BLAS runs on one thread (~10 µs to enter and leave).
    OpenBLAS has one process-wide setting: two threads scoring at once may leave it at
    either count on the way out, and either gives the same outputs."""
    return _blas().limit(limits=1)


def blas_threads() -> int:
    """How many threads numpy's BLAS would use now (the largest over its libraries)."""
    return max((lib.num_threads for lib in _blas().lib_controllers), default=1)
