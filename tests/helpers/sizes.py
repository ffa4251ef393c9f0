"""The image-size grid every estimator test compares against the real processors.

The research note's 25 sides squared (625 sizes), plus 150 random sizes in [64, 4096]², plus each
family's own edge cases (tiny, thin, rounding boundaries, exact tile multiples, aspect limits).
"""

from __future__ import annotations

import random

SIDES = [64, 100, 128, 200, 256, 300, 336, 400, 448, 512, 640, 720, 768, 800, 1000, 1024, 1080, 1280,
         1440, 1920, 2048, 2560, 3000, 3840, 4096]


def size_grid(edge: list[tuple[int, int]], seed: int = 0) -> list[tuple[int, int]]:
    """(width, height) pairs: the side grid, 150 seeded random sizes, then ``edge``."""
    rng = random.Random(seed)
    grid = [(w, h) for w in SIDES for h in SIDES]
    grid += [(rng.randint(64, 4096), rng.randint(64, 4096)) for _ in range(150)]
    return grid + list(edge)
