"""Allocator settings for training processes: :func:`keep_freed_memory` (glibc keeps freed
activations for the next step on CPU ranks, instead of page-faulting them in again every step)."""

from __future__ import annotations

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's <malloc.h>


def keep_freed_memory(trim_threshold: int = 2**31 - 1) -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    A CPU training step allocates and frees the same few hundred MB of activations every step. By
    default glibc serves large blocks with ``mmap`` and unmaps them when freed, and trims its heap
    once the free top exceeds a threshold, so the next step page-faults that memory in again: the
    demo model's forward + backward on scripts/probe_fsdp_overhead.py's 16-image batch took 83k-166k
    minor faults per 6 steps. Here every block comes from the heap and up to ``trim_threshold``
    bytes of free heap are kept: 4k-7.5k faults (the heap's growth); on one core the step's median
    of 4 alternating runs fell from 0.92 to 0.87 s and its maxima from 0.96-1.17 to 0.90-1.00 s
    (docs/BENCHMARKS.md, section "no page faults per step"). What jemalloc or tcmalloc (the PyTorch
    CPU tuning guide's advice) do, without an ``LD_PRELOAD``. Process-wide, from the next allocation
    on; the price is that the process's resident memory stays at its peak.

    Returns False, changing nothing, where the C library has no ``mallopt`` (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, trim_threshold))
