"""Builds spread over machines: ``--part i/n`` indexes a deterministic 1/n of the shards, and
``merge_indexes(out, parts)`` joins the parts into the index one machine would have built.

Part ``i`` of ``n`` takes every ``n``-th shard of the expanded source list, starting at ``i`` (strided,
so that parts get shards from all over the list when shard sizes drift along it). Each part index
records its part, every shard's position in the full list and that full list itself as the part
expanded it, each local shard with its size and mtime then. The merge checks that the parts are
``0..n-1`` of the same sources and token rules, exactly once each, that every part expanded the same
list (a shard added, removed or rewritten between the parts' builds would otherwise be indexed twice
or not at all: the error names those shards), and that the parts' shards are disjoint and cover that
list exactly; then it writes the shards in list order
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

__all__ = ["check_part", "check_split", "merge_indexes", "parse_part", "part_meta", "refuse_to_replace",
           "rules_named", "select_part"]


def merge_indexes(out: str | os.PathLike, parts: Sequence[str | os.PathLike], progress: bool = False,
                  replace: bool = False):
    """Join part indexes (``build_index(..., part=(i, n))``) into one index at ``out``.

    Raises ``ValueError`` naming the problem when the parts are not one complete set: a folder that is
    not a part index, parts of different builds (sources, token rules, tokenbal versions or part
    counts differ), a part missing or given twice, parts that split different shard lists or saw a
    shard changed, shards in two parts or in none (``check_split``), a damaged part
    (``store.index_problems``: counts that do not sum, ``errors.jsonl`` cut short), an interrupted
    part's saved shards (``.<out>.partial``). Unless ``replace``, it also refuses an ``out`` that holds
    an index the merge would lose something of (``refuse_to_replace``): one of other token settings, or
    with shards the parts do not hold. Returns the ``BuildReport`` of the merged index.
    """
    import time

    from tokenbal.index.build import (
        BuildReport,
        _BuildLock,
        _check_out,
        _result_from_index,
        _rules,
        write_index,
    )
    from tokenbal.index.store import TokenIndex, index_problems

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
        if m.get("partial"):
            # What an interrupted build saved (``.<out>.partial``) to resume from: its part is not done.
            done, want = len(m.get("shards", [])), len(m["part"].get("positions", {}))
            raise ValueError(f"merge: {idx.path} is an interrupted build of part {i}/{n} ({done} of its "
                             f"{want} shards done); run that part's build again to finish it (it resumes "
                             "from these shards) and merge its output folder")
        if n != first["part"]["count"]:
            raise ValueError(f"merge: {idx.path} is part {i}/{n}, {parts[0]} part of "
                             f"{first['part']['count']}; all parts must come from one split")
        if m.get("sources") != first.get("sources"):
            raise ValueError(f"merge: {idx.path} was built from other sources ({m.get('sources')}) than "
                             f"{idxs[0].path} ({first.get('sources')})")
        if _rules(m) != _rules(first):
            raise ValueError(f"merge: {idx.path} was built with other token rules than {idxs[0].path} "
                             f"({rules_named(first, m, _part_label(first), _part_label(m))}); rebuild the "
                             "parts with the same model, options, tokenizer / processor and --exif")
        if m.get("tokenbal_version") != first.get("tokenbal_version"):
            # The token rules name the settings, not the counting code: another release may count
            # the same sample differently, and the merged index would mix both counts.
            raise ValueError(f"merge: {idx.path} was built by tokenbal {m.get('tokenbal_version')}, "
                             f"{idxs[0].path} by tokenbal {first.get('tokenbal_version')}; rebuild the parts "
                             "with one version")
        if i in seen:
            raise ValueError(f"merge: part {i}/{n} given twice ({seen[i]} and {idx.path})")
        seen[i] = idx.path
    n = first["part"]["count"]
    absent = sorted(set(range(n)) - set(seen))
    if absent:
        raise ValueError(f"merge: part(s) {', '.join(f'{i}/{n}' for i in absent)} missing; "
                         f"got {len(seen)} of {n}")
    check_split(idxs)
    # The merge copies each part's columns as they are and writes a fresh, self-consistent index:
    # damage in a part (a length that is not vision + text, errors.jsonl cut short) would pass
    # every later verify of the merged index, so it is refused here, naming the part.
    for idx in idxs:
        damage = index_problems(idx)
        if damage:
            raise ValueError(f"merge: part {idx.manifest['part']['index']}/{n} ({idx.path}) is damaged: "
                             f"{'; '.join(damage)}; rebuild that part")
    jobs = []
    for idx in idxs:
        positions = idx.manifest["part"]["positions"]
        for path in idx.shard_paths:
            jobs.append((int(positions[path]), path, idx))
    jobs.sort(key=lambda j: j[0])
    meta = {k: v for k, v in first.items()
            if k in ("estimator", "text_counter", "exif", "image_sizes", "member_stamps", "image_root",
                     "sources", "parquet", "video_pipeline")}
    # The parts' scan rules (one tokenbal version, checked above), not this release's: a later build
    # into the merged folder rescans what older rules scanned.
    meta["scan_rules"] = first.get("scan_rules", 0)
    # Under the build lock, so that no build of ``out`` slips in between the check and the write.
    with _BuildLock(os.path.abspath(os.fspath(out))):
        _check_out(os.path.abspath(os.fspath(out)), label="merge: OUT")   # merge has no --out to name
        if not replace:
            refuse_to_replace(os.path.abspath(os.fspath(out)), meta, [path for _, path, _ in jobs])
        results = (_result_from_index(idx, path) for _, path, idx in jobs)
        if progress:
            from tqdm import tqdm

            results = tqdm(results, total=len(jobs), unit="shard", desc="merging")
        writer = write_index(out, results, meta)
    return BuildReport(out=os.path.abspath(os.fspath(out)), num_shards=len(jobs),
                       num_bad_shards=writer.num_bad_shards, num_samples=writer.num_samples,
                       num_errors=writer.num_errors, num_images=writer.num_images,
                       total_tokens=writer.total_tokens, seconds=time.perf_counter() - t0,
                       # as a one-machine build reports them, so limit_problems names each one
                       bad_shards=[{"path": s["path"], "status": s["status"], "reason": s.get("reason")}
                                   for s in writer.shards if s["status"] != "ok"])


def _part_label(manifest: dict) -> str:
    return f"part {manifest['part']['index']}/{manifest['part']['count']}"


def rules_named(a: dict, b: dict, a_label: str, b_label: str) -> str:
    """The token rules (``build._rules``) in which the manifests ``a`` and ``b`` differ, each as
    ``"NAME: A in a_label, B in b_label"`` (estimator options one by one)."""
    from tokenbal.index.build import RULE_NAMES, _rules

    out = []
    other_estimator = a["estimator"].get("name") != b["estimator"].get("name")
    for name, x, y in zip(RULE_NAMES, _rules(a), _rules(b), strict=True):
        if x == y or (other_estimator and name in ("estimator config", "wrapper tokens")):
            continue   # another estimator's settings all differ: its name says it
        if name == "estimator config":
            ca, cb = a["estimator"].get("config", {}), b["estimator"].get("config", {})
            for k in sorted(set(ca) | set(cb)):
                va, vb = ca.get(k, "<absent>"), cb.get(k, "<absent>")
                if va != vb:
                    out.append(f"{k}: {va!r} in {a_label}, {vb!r} in {b_label}")
        else:
            out.append(f"{name}: {x!r} in {a_label}, {y!r} in {b_label}")
    return "; ".join(out)


def refuse_to_replace(out: str, meta: dict, shards: Sequence[str]) -> None:
    """Raise ``ValueError`` when ``out`` holds an index that merging ``shards`` with the token settings
    of ``meta`` would silently lose something of: other token settings (another model, tokenizer,
    estimator options...: every length would change), or shards the parts do not hold (they would be
    dropped). ``tokenbal index build`` refuses the first for the same reason; re-running one merge, or
    merging into one of its own parts, replaces nothing but the same shards and passes."""
    from tokenbal.index.build import existing_manifest, rules_differences

    manifest = existing_manifest(out)
    if manifest is None:
        return
    lost = []
    differences = rules_differences(manifest, meta)
    if differences:
        lost.append(f"it was built with other settings ({'; '.join(differences)})")
    kept = set(shards)
    dropped = [e["path"] for e in manifest.get("shards", []) if e["path"] not in kept]
    if dropped:
        lost.append(f"{len(dropped)} of its shards are in none of the parts ({_names(dropped, 3)})")
    if lost:
        raise ValueError(
            f"merge: {out} holds an index of {manifest.get('num_samples', '?')} samples from "
            f"{len(manifest.get('shards', []))} shards that the merge would replace, and {'; '.join(lost)}; "
            "pass --replace (merge_indexes(replace=True)) to replace it, or choose another OUT")


def _names(paths, limit: int = 5) -> str:
    paths = list(paths)
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def check_split(idxs: Sequence) -> None:
    """Raise ``ValueError`` unless the part indexes ``idxs`` (one per part, checked to be ``0..n-1``)
    split one shard list: every part expanded the same list, saw each local shard with the same size
    and mtime, and the parts' shards are disjoint with that list as their union. The error names the
    shards missing, doubled or changed, and says which part saw what."""
    label = {id(idx): f"part {idx.manifest['part']['index']}/{idx.manifest['part']['count']} ({idx.path})"
             for idx in idxs}
    for idx in idxs:
        if "expanded" not in idx.manifest["part"]:
            raise ValueError(f"merge: {label[id(idx)]} was built by a tokenbal that did not record the shard "
                             "list it split, so the merge cannot check that no shard is lost or doubled; "
                             "rebuild the parts with this version")
    ref = min(idxs, key=lambda idx: idx.manifest["part"]["index"])
    ref_list = [e[0] for e in ref.manifest["part"]["expanded"]]
    for idx in idxs:
        got = [e[0] for e in idx.manifest["part"]["expanded"]]
        if got == ref_list:
            continue
        got_set, ref_set = set(got), set(ref_list)
        only_ref = [p for p in ref_list if p not in got_set]
        only_got = [p for p in got if p not in ref_set]
        what = []
        if only_got:
            what.append(f"only {label[id(idx)]} saw {_names(only_got)}")
        if only_ref:
            what.append(f"only {label[id(ref)]} saw {_names(only_ref)}")
        if not what:
            what.append("the same shards in another order")
        raise ValueError(f"merge: the parts split different shard lists ({label[id(ref)]}: {len(ref_list)} "
                         f"shards, {label[id(idx)]}: {len(got)}): {'; '.join(what)}. The sources changed "
                         "between the parts' builds, so merging would lose or double shards; rebuild every "
                         "part over the same shards")
    # Each local shard's (size, mtime) as every part saw it, and as the part that indexed it read it.
    seen: dict[str, tuple] = {}
    changed: list[str] = []
    named: set[str] = set()
    for idx in idxs:
        for path, size, mtime in idx.manifest["part"]["expanded"]:
            if size is None:
                continue
            if path in seen and seen[path][:2] != (size, mtime) and path not in named:
                named.add(path)
                changed.append(f"{path} (size {seen[path][0]}, mtime_ns {seen[path][1]} for {seen[path][2]}; "
                               f"size {size}, mtime_ns {mtime} for {label[id(idx)]})")
            seen.setdefault(path, (size, mtime, label[id(idx)]))
    for idx in idxs:
        for entry in idx.manifest["shards"]:
            path, had = entry["path"], seen.get(entry["path"])
            if had is None or entry.get("fingerprint") is None:
                continue
            if (entry.get("size"), entry.get("mtime_ns")) != had[:2] and path not in named:
                named.add(path)
                changed.append(f"{path} (indexed by {label[id(idx)]} at size {entry.get('size')}, mtime_ns "
                               f"{entry.get('mtime_ns')}; {had[2]} saw size {had[0]}, mtime_ns {had[1]})")
    if changed:
        raise ValueError(f"merge: {len(changed)} shard(s) changed between the parts' builds: "
                         f"{_names(changed, 3)}; the parts describe different data: rebuild them")
    owner: dict[str, list[str]] = {}
    for idx in idxs:
        for path in idx.shard_paths:
            owner.setdefault(path, []).append(label[id(idx)])
    doubled = [f"{p} (in {' and '.join(who)})" for p, who in owner.items() if len(who) > 1]
    missing = [p for p in ref_list if p not in owner]
    listed = set(ref_list)
    foreign = [p for p in owner if p not in listed]
    problems = []
    if doubled:
        problems.append(f"{len(doubled)} shard(s) in more than one part: {_names(doubled, 3)}")
    if missing:
        problems.append(f"{len(missing)} shard(s) of the list in no part: {_names(missing)}")
    if foreign:
        problems.append(f"{len(foreign)} shard(s) not in the list the parts split: {_names(foreign)}")
    if problems:
        raise ValueError(f"merge: the parts do not cover their {len(ref_list)} shards exactly once: "
                         f"{'; '.join(problems)}")
