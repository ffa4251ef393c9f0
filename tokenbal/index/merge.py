"""Builds spread over machines: ``--part i/n`` indexes a deterministic 1/n of the shards, and
``merge_indexes(out, parts)`` joins the parts into the index one machine would have built.

Part ``i`` of ``n`` takes every ``n``-th shard of the expanded source list, starting at ``i`` (strided,
so that parts get shards from all over the list when shard sizes drift along it). Each part index
records its part and every shard's position in the full list; the merge checks that the parts are
``0..n-1`` of the same sources and token rules, exactly once each, then writes the shards in list order
with their rows, errors and manifest entries unchanged, so the merged index equals a one-machine
build of the same sources (same lengths, keys, members, errors, order; only ``created`` differs).

Any launcher can run the parts: the part number can come from the environment (``--part env``:
``RANK`` / ``WORLD_SIZE`` under ``torchrun``, ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT`` in a
Slurm array); see ``docs/remote-and-parquet.md`` for Slurm, torchrun and Ray recipes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# The part selection is shared with the build; re-exported here, where it is documented.
from tokenbal.index.parts import check_part, parse_part, part_meta, select_part

__all__ = ["check_part", "merge_indexes", "parse_part", "part_meta", "select_part"]


def merge_indexes(out: str | os.PathLike, parts: Sequence[str | os.PathLike], progress: bool = False):
    """Join part indexes (``build_index(..., part=(i, n))``) into one index at ``out``.

    Raises ``ValueError`` naming the problem when the parts are not one complete set: a folder that is
    not a part index, parts of different builds (sources, token rules or part counts differ), a part
    missing or given twice. Returns the ``BuildReport`` of the merged index.
    """
    import time

    from tokenbal.index.build import BuildReport, _result_from_index, _rules, write_index
    from tokenbal.index.store import TokenIndex

    t0 = time.perf_counter()
    if not parts:
        raise ValueError("merge: no part indexes given")
    idxs = [TokenIndex.open(p) for p in parts]
    first = idxs[0].manifest
    seen: dict[int, str] = {}
    for idx in idxs:
        m = idx.manifest
        if "part" not in m:
            raise ValueError(f"merge: {idx.path} is not a part index (built without --part)")
        i, n = m["part"]["index"], m["part"]["count"]
        if n != first["part"]["count"]:
            raise ValueError(f"merge: {idx.path} is part {i}/{n}, {parts[0]} part of "
                             f"{first['part']['count']}; all parts must come from one split")
        if m.get("sources") != first.get("sources"):
            raise ValueError(f"merge: {idx.path} was built from other sources ({m.get('sources')}) than "
                             f"{idxs[0].path} ({first.get('sources')})")
        if _rules(m) != _rules(first):
            raise ValueError(f"merge: {idx.path} was built with other token rules than {idxs[0].path}")
        if i in seen:
            raise ValueError(f"merge: part {i}/{n} given twice ({seen[i]} and {idx.path})")
        seen[i] = idx.path
    n = first["part"]["count"]
    absent = sorted(set(range(n)) - set(seen))
    if absent:
        raise ValueError(f"merge: part(s) {', '.join(f'{i}/{n}' for i in absent)} missing; "
                         f"got {len(seen)} of {n}")
    jobs = []
    for idx in idxs:
        positions = idx.manifest["part"]["positions"]
        for path in idx.shard_paths:
            jobs.append((int(positions[path]), path, idx))
    jobs.sort(key=lambda j: j[0])
    meta = {k: v for k, v in first.items()
            if k in ("estimator", "text_counter", "exif", "image_sizes", "member_stamps", "image_root",
                     "sources", "parquet", "video_pipeline")}
    writer = write_index(out, (_result_from_index(idx, path) for _, path, idx in jobs), meta)
    return BuildReport(out=os.path.abspath(os.fspath(out)), num_shards=len(jobs),
                       num_bad_shards=writer.num_bad_shards, num_samples=writer.num_samples,
                       num_errors=writer.num_errors, num_images=writer.num_images,
                       total_tokens=writer.total_tokens, seconds=time.perf_counter() - t0)
