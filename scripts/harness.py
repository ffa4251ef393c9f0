"""The benchmark scripts' one timer: medians of repeated runs, CPU and wall time, and the
environment line every result in docs/BENCHMARKS.md is quoted with.

Scripts run as ``python scripts/<name>.py``, which puts this folder on ``sys.path``, so they
import it as ``from harness import measure, environment_line``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``repeats`` timed calls (after ``warmup`` untimed ones)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)

    @property
    def wall_min(self) -> float:
        return min(self.wall)

    @property
    def cpu_min(self) -> float:
        return min(self.cpu)

    @property
    def ms(self) -> float:
        """Median wall time in milliseconds, the unit most scripts print."""
        return self.wall_median * 1e3


def measure(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times, timing wall and process CPU.

    CPU time is reported next to wall time because the machines these numbers come from are
    shared: a loaded machine stretches wall time, not the CPU seconds a call needs.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return Timing(wall=wall, cpu=cpu)


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """One call of ``fn`` for benchmarks that need its result: ``(result, wall s, CPU s)``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def ratio(baseline: float, ours: float) -> str:
    """``baseline / ours`` as ``"3.2x"``; ``"n/a"`` when ours is zero."""
    return f"{baseline / ours:.1f}x" if ours > 0 else "n/a"


def environment_line(**extra: object) -> str:
    """Python, numpy / torch versions, CPU count and load: the line a result is quoted with."""
    parts = [f"python {platform.python_version()}", platform.machine(), f"{os.cpu_count()} CPUs"]
    try:
        load = os.getloadavg()
        parts.append(f"load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    except OSError:
        pass
    for module in ("numpy", "torch", "transformers"):
        mod = _imported(module)
        if mod is not None:
            parts.append(f"{module} {mod.__version__}")
    parts.extend(f"{k} {v}" for k, v in extra.items())
    return ", ".join(parts)


def _imported(name: str):
    # Only report libraries the script already loaded: importing torch just to print its
    # version would add seconds to a numpy-only benchmark.
    import sys

    return sys.modules.get(name)


def jpeg_photo(w: int, h: int, seed: int) -> bytes:
    """A ``w`` x ``h`` JPEG that compresses like a photo (a gradient plus noise), for the lengths benches."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
    pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    return buf.getvalue()
