"""Keep the host memory a CPU training step frees mapped in the process, for the next step.

A step on a CPU device allocates its activations, gradients and messages with the C library's
``malloc`` and frees them when the backward has run. glibc hands large blocks back to the
operating system: a block above its mmap threshold is unmapped when freed, and free memory at the
top of the heap beyond its trim threshold is trimmed. Both thresholds start at 128 KiB and grow
with what the process frees, but a step that frees tens of megabytes at once still trims most of
it. The next step then touches fresh pages and takes a page fault per 4 KiB page. On the 2-core
VM of ``benchmarks/README.md``, 20 rounds of eight 4 MiB tensors allocated and freed took 17,373
minor faults as glibc was, and none with :class:`KeptHostMemory` on. A 4-rank plan whose
layers stream 2 MiB activations (``bench_plan.py``'s held-out seed 4, model 0) stepped through
``Trainer.fit`` at 1.146 and 1.194x its predicted step as glibc was and at 0.999 and 1.063x with
both thresholds raised, in alternating runs: the planner's profile times each layer in a loop
that reuses the same blocks, so it took no faults either.

:class:`KeptHostMemory` raises both (glibc's ``mallopt``: ``M_MMAP_THRESHOLD`` to 32 MiB, its
largest on a 64-bit system, and ``M_TRIM_THRESHOLD`` to 1 GiB), so blocks up to 32 MiB come from
the heap and the heap keeps what a step frees, as a caching allocator does on an accelerator.
Its cost: the process's resident memory stays near its peak between steps instead of falling
back. Blocks above 32 MiB are still mapped per allocation. :meth:`KeptHostMemory.release` sets
both thresholds back to glibc's starting values and trims the heap (glibc then keeps them fixed:
setting a threshold turns off its growth). Outside glibc (macOS, musl, Windows) it does nothing.
Hand-written because neither torch nor Python exposes ``mallopt``.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any, Optional

__all__ = ["KEPT_MMAP_THRESHOLD", "KEPT_TRIM_THRESHOLD", "KeptHostMemory"]

M_TRIM_THRESHOLD = -1  # glibc's malloc.h parameter numbers
M_MMAP_THRESHOLD = -3
KEPT_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest on 64-bit (half its HEAP_MAX_SIZE)
KEPT_TRIM_THRESHOLD = 1024 * 1024 * 1024
GLIBC_DEFAULT_THRESHOLD = 128 * 1024  # both thresholds' starting value


def _glibc() -> Optional[Any]:
    """The process's C library if it is glibc (with ``mallopt`` and ``malloc_trim``), else ``None``."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class KeptHostMemory:
    """Raise glibc's mmap and trim thresholds (:meth:`keep`), set them back (:meth:`release`);
    both idempotent and process-wide. A no-op outside glibc."""

    def __init__(self) -> None:
        self.kept = False

    def keep(self) -> bool:
        """Keep freed blocks up to 32 MiB and the heap's free top in the process; whether it did."""
        if self.kept:
            return False
        libc = _glibc()
        if libc is None:
            return False
        mapped = libc.mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)
        if not (mapped and libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD)):
            return False
        self.kept = True
        return True

    def release(self) -> None:
        """Both thresholds back to glibc's starting values; the heap's free memory returned to
        the operating system (nothing if :meth:`keep` did nothing)."""
        if not self.kept:
            return
        libc = _glibc()
        assert libc is not None, "kept without glibc"
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
        libc.malloc_trim(0)
        self.kept = False
