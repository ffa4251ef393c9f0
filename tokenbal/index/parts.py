"""Which shards part ``i`` of ``n`` of a build takes (``--part i/n``), shared by the build
(:mod:`tokenbal.index.build`) and the merge of the parts (:mod:`tokenbal.index.merge`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["check_part", "parse_part", "part_meta", "select_part", "shard_identity"]


def parse_part(text: str, environ: dict | None = None) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)``; ``"env"``: from ``RANK`` / ``WORLD_SIZE`` (torchrun) or
    ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT`` (a Slurm array, counted from
    ``SLURM_ARRAY_TASK_MIN`` in steps of ``SLURM_ARRAY_TASK_STEP``)."""
    env = os.environ if environ is None else environ
    if text == "env":
        def number(name: str, default: str | None = None) -> int:
            value = env.get(name, default)
            try:
                return int(value)
            except (TypeError, ValueError):   # int()'s own message names neither the variable nor --part
                raise ValueError(f"--part env: {name}={value!r} is not an integer") from None

        if "RANK" in env and "WORLD_SIZE" in env:
            i, n = number("RANK"), number("WORLD_SIZE")
        elif "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            # An array with a step (--array=0-14:2) numbers its 8 tasks 0, 2, ..., 14: task k is
            # part k / step, or half the tasks would build the even parts and the rest fail.
            offset = number("SLURM_ARRAY_TASK_ID") - number("SLURM_ARRAY_TASK_MIN", "0")
            step = number("SLURM_ARRAY_TASK_STEP", "1")
            if step < 1 or offset % step:
                raise ValueError(f"--part env: SLURM_ARRAY_TASK_ID {env['SLURM_ARRAY_TASK_ID']} is not on "
                                 f"the array's step {step} from SLURM_ARRAY_TASK_MIN "
                                 f"{env.get('SLURM_ARRAY_TASK_MIN', '0')}; give --part I/N")
            i, n = offset // step, number("SLURM_ARRAY_TASK_COUNT")
        else:
            raise ValueError("--part env: neither RANK / WORLD_SIZE (torchrun) nor SLURM_ARRAY_TASK_ID / "
                             "SLURM_ARRAY_TASK_COUNT (Slurm array) is set")
    else:
        i_s, sep, n_s = text.partition("/")
        try:
            if not sep:
                raise ValueError
            i, n = int(i_s), int(n_s)
        except ValueError:
            raise ValueError(f"--part expects I/N (e.g. 0/8) or 'env', got {text!r}") from None
    check_part((i, n))
    return i, n


def check_part(part: tuple[int, int]) -> None:
    i, n = part
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"part {i}/{n}: need 0 <= i < n")


def select_part(paths: Sequence[str], part: tuple[int, int]) -> tuple[list[int], list[str]]:
    """``(positions, paths)`` of part ``i`` of ``n``: every n-th shard from ``i`` on."""
    check_part(part)
    i, n = part
    positions = list(range(i, len(paths), n))
    return positions, [paths[p] for p in positions]


def part_meta(part: tuple[int, int], positions: Sequence[int], paths: Sequence[str],
              expanded: Sequence[str] | None = None) -> dict:
    """The ``part`` record of a part index's manifest: which part, each of its shards' position in
    the full list and, with ``expanded``, that full list as this part saw it, each shard with its
    identity then (``shard_identity``), so that the merge can prove the parts split one list."""
    meta = {"index": part[0], "count": part[1], "positions": dict(zip(paths, positions, strict=True))}
    if expanded is not None:
        meta["expanded"] = [[p, *shard_identity(p)] for p in expanded]
    return meta


def shard_identity(path: str) -> tuple[int | None, int | None]:
    """``(size, mtime_ns)`` of a local shard from one ``stat`` (``None`` for a URL or a file that
    cannot be stat'ed: the build reports it); two parts that saw different values for one shard
    were built over different contents."""
    if "://" in path and not path.startswith("file://"):
        return None, None
    try:
        st = os.stat(path)
    except OSError:
        return None, None
    return st.st_size, st.st_mtime_ns
