"""``build_index``: scan shards (in parallel), count tokens, write the index folder atomically;
reuse the unchanged shards of an earlier build of the same folder.

Reliability (``docs/RELIABILITY.md``): one build per folder at a time (an exclusive ``flock`` on
``.<name>.lock`` beside it; a second build fails naming the holder); the folder being written
(``.<name>.tmp-*``) keeps a checkpoint (``progress.json``) of the shards it finished, so a build
killed by any signal, SIGKILL included, resumes from there, and the next build removes what a dead
build left; SIGTERM is handled like Ctrl-C; a scan worker that dies (the OOM killer) ends the build
with an error naming the shards it was scanning, the finished ones kept. Only files tokenbal writes
are ever deleted from an index folder; other files there are carried over to each new version.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tokenbal.index.annotations import is_annotation_file, scan_annotations
from tokenbal.index.parquet import ParquetOptions, is_parquet, scan_parquet
from tokenbal.index.parts import part_meta, select_part
from tokenbal.index.remote import DOWNLOAD, remote_unchanged, scan_remote_shard
from tokenbal.index.scan import HEADERS, PROGRESS_ROWS, ShardScan, scan_shard, shard_fingerprint
from tokenbal.index.sources import expand_sources
from tokenbal.index.store import (
    COLUMNS,
    ERRORS,
    FORMAT_VERSION,
    KEYS_BLOB,
    MANIFEST,
    OPTIONAL_COLUMNS,
    OWNED_FILES,
    PATHS_BLOB,
    TokenIndex,
    processor_files,
    version_in_use,
    version_path,
)
from tokenbal.index.videoindex import VIDEO_COLUMNS
from tokenbal.io.remote import RemoteOptions, is_url, threaded_map

PROGRESS = "progress.json"   # a checkpoint of the shards finished so far, in a folder being written
# What a shard's scan makes of the same bytes: raised whenever a release scans a shard differently (a
# new check that makes a counted sample an error, a count corrected), so an incremental build rescans
# the shards an older release scanned instead of copying their rows (manifest "scan_rules"; indexes
# from before it have none: 0). 1: cut-short BMP / TIFF / AVIF / JPEG 2000 images and Parquet rows,
# compressed members, a VP8X WebP canvas that is not its image, Parquet rows without text (session 26).
# 2: cut-short PPM / PGM / PBM / PFM, QOI, raw JPEG 2000 codestreams, RLE BMPs, uncompressed TGA / SGI /
# MSP / ... images, plain (ASCII) PBM / PGM / PPM, run-length TGAs and SGIs, an RLE BMP whose codes end early
# (session 27). 3: cut-short PCX / DDS / XBM / BLP images, a PCX run across a line end, a BLP short of
# pixels; an animated PNG / GIF cut after its first frame counted, not an error (session 28).
SCAN_RULES = 3


class IndexBuildError(RuntimeError):
    """A build could not finish (another build holds the folder, a scan worker died); names why."""


class OtherRulesError(ValueError):
    """``out`` holds an index built with other token rules (model, estimator options, tokenizer,
    ...) and the build was asked not to replace such an index silently; names every difference."""


class VisionEstimator(Protocol):
    """What the index needs from ``tokenbal.estimate.get_estimator(...)``."""
    name: str
    config: dict
    wrapper_tokens: int

    def image_tokens_batch(self, widths: np.ndarray, heights: np.ndarray) -> np.ndarray: ...


class TextCounter(Protocol):
    """What the index needs from ``tokenbal.estimate.get_text_counter(...)``."""
    name: str

    def count_batch(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass
class BuildReport:
    out: str
    num_shards: int
    num_bad_shards: int        # shards not indexed at all (corrupt, truncated, empty, ...)
    num_samples: int
    num_errors: int            # every line of errors.jsonl: bad samples + bad shards
    num_images: int
    total_tokens: int
    seconds: float
    num_reused: int = 0        # shards taken unchanged from the index already at ``out``
    num_kept: int = 0          # shards of the index at ``out`` kept although SOURCES did not name them
    bad_shards: list[dict] = field(default_factory=list)   # {"path", "status", "reason"} per bad shard

    @property
    def num_bad_samples(self) -> int:
        return self.num_errors - self.num_bad_shards

    def limit_problems(self, max_bad_shards: int | None = 0, max_bad_samples: int | float | None = None
                       ) -> list[str]:
        """Why this build should count as failed (a CI job's exit status), one line each; [] if it
        should not. ``max_bad_shards``: shards allowed to fail (``None``: any number).
        ``max_bad_samples``: bad samples allowed, a count (int) or a fraction (float in [0, 1)) of
        the samples seen (indexed + bad); ``None``: any number. A build that indexed no sample at
        all while something failed always counts as failed."""
        out = []
        if max_bad_shards is not None and self.num_bad_shards > max_bad_shards:
            shown = "; ".join(f"{s['path']} ({s['status']}: {s['reason']})" for s in self.bad_shards[:5])
            more = f"; and {len(self.bad_shards) - 5} more" if len(self.bad_shards) > 5 else ""
            out.append(f"{self.num_bad_shards} of {self.num_shards} shards could not be indexed (allowed: "
                       f"{max_bad_shards}, --max-bad-shards): {shown}{more}")
        bad = self.num_bad_samples
        if max_bad_samples is not None and bad:
            seen = self.num_samples + bad
            allowed = (int(max_bad_samples * seen) if isinstance(max_bad_samples, float)
                       else int(max_bad_samples))
            if bad > allowed:
                share = (f"{max_bad_samples:.2%} of {seen} = {allowed}" if isinstance(max_bad_samples, float)
                         else str(allowed))
                out.append(f"{bad} of {seen} samples could not be indexed (allowed: {share}, "
                           f"--max-bad-samples)")
        if not out and self.num_samples == 0 and self.num_errors:
            out.append("no sample was indexed")
        if out:
            out.append(f"every error is listed in {os.path.join(self.out, ERRORS)}; the index was written "
                       "without them")
        return out

    def summary(self) -> str:
        good = self.num_shards - self.num_bad_shards
        line = (f"indexed {self.num_samples} samples ({self.total_tokens:,} tokens, {self.num_images} "
                f"images) from {good}/{self.num_shards} shards in {self.seconds:.1f}s into {self.out}; "
                f"{self.num_errors} errors")
        if self.num_errors:
            n_shard = self.num_bad_shards
            line += (f" ({self.num_errors - n_shard} bad samples, {n_shard} bad shards), "
                     f"listed in {os.path.join(self.out, ERRORS)}")
        if self.num_reused:
            line += (f"; {self.num_reused} unchanged shards reused, "
                     f"{self.num_shards - self.num_reused} scanned")
        if self.num_kept:
            line += (f"; {self.num_kept} shards of the previous index kept though not named "
                     "(--drop-unlisted drops them)")
        return line


@dataclass
class ShardResult:
    """One shard, ready to append to the index: what a worker sends back (no texts, no images)."""
    entry: dict                  # manifest shard entry (without its id)
    keys: list[str]
    member_counts: np.ndarray    # per sample
    member_exts: list[str]
    member_offsets: np.ndarray
    member_sizes: np.ndarray
    image_counts: np.ndarray     # per sample
    image_wh: np.ndarray         # (n_images, 2)
    vision: np.ndarray
    text: np.ndarray
    errors: list[dict]
    member_paths: list[str] | None = None   # annotation sources: "name\0path" per member ("" for tar)
    video_counts: np.ndarray | None = None  # per sample; None: no videos (tokenbal.index.videoindex)
    video_info: np.ndarray | None = None
    video_params: np.ndarray | None = None
    member_stamps: np.ndarray | None = None  # (n_members, 2) header checksum, mtime; None: unknown (-1)


def build_index(sources: Sequence[str] | str, out: str | os.PathLike, model: str = "qwen2-vl",
                workers: int = 1, tokenizer: str | None = None, image_root: str | None = None,
                estimator_overrides: dict | None = None,
                progress: bool | Callable[[str, int, int, str], None] = True,
                incremental: bool = True, remote: RemoteOptions | None = None,
                parquet: ParquetOptions | None = None, part: tuple[int, int] | None = None,
                exif: str = "transpose", keep_unlisted: bool = True,
                checkpoint_seconds: float = 10.0, on_other_rules: str = "rescan",
                processor: str | os.PathLike | None = None) -> BuildReport:
    """Index the webdataset tar shards and JSON/JSONL annotation files named by ``sources`` into ``out``.

    ``sources``: paths, globs, brace patterns (``data-{000..099}.tar``); a missing one raises
    ``FileNotFoundError``. ``.json`` / ``.jsonl`` files are annotation files whose image paths are
    relative to ``image_root`` (``tokenbal.index.annotations``). ``model`` / ``estimator_overrides``
    pick the vision estimator (``tokenbal.estimate.get_estimator``); ``tokenizer`` a
    ``tokenizer.json`` (or its folder) for exact text counts, else the heuristic counter.
    ``workers`` > 1 scans shards in that many processes. ``progress``: a bar of the shards, and under
    it one per shard being scanned (a tar shard's header walk, then bytes of a tar shard, local or
    remote, or of an annotation file, or rows of a Parquet file, then samples whose text is counted: a
    single multi-GB file moves too), on stderr; ``False``: none; a callable: no bars, each shard's
    progress reported to it as ``(path, done, total, unit)``, ``unit`` ``"download"`` (a remote
    shard read whole), ``"headers"``, ``"B"``, ``"rows"`` or ``"samples"`` (``index_shard``).
    ``exif``: ``"transpose"`` (default) counts each image at its size after EXIF orientation, as
    transformers' ``load_image`` and tokenbal's reader give it; ``"ignore"`` at its stored size. The
    policy is recorded in the manifest.

    Re-running over an existing index (``incremental=True``): when it was built with the same token
    rules, every shard whose size and fingerprint are unchanged is copied from it without a rescan,
    in its old position; changed shards are rescanned in place; shards new to the index are appended
    after the old ones (so the rows of unchanged samples keep their numbers). Shards of the existing
    index that ``sources`` does not name are kept (``keep_unlisted=True``, so naming only new shards
    adds them) or dropped (``keep_unlisted=False``: the index holds exactly ``sources``). Different
    rules, or ``incremental=False``, rescan everything and index exactly ``sources``;
    ``on_other_rules="error"`` (what ``tokenbal index build`` passes unless ``--rebuild``) refuses
    the first case instead, raising ``OtherRulesError`` that names each setting both ways. The new index
    replaces the old one atomically (readers holding the old one keep it, ``tokenbal.index.store``);
    any other non-empty folder at ``out`` is refused.
    Resume: the folder being written keeps a checkpoint of its finished shards at least every
    ``checkpoint_seconds``; when a build is interrupted (Ctrl-C, SIGTERM, a crash in a worker, a
    full disk), they are kept as an index in ``.<out>.partial`` next to ``out``, and after SIGKILL
    the checkpoint is; the next build of ``out`` (same rules) copies them instead of rescanning.
    One build per ``out`` at a time: a second raises ``IndexBuildError`` naming the holder.
    Bad samples and shards never stop the build: they are listed in ``errors.jsonl`` and counted in
    the returned report (``BuildReport.limit_problems`` says whether they exceed a limit).
    A missing optional dependency (pyarrow for Parquet, fsspec for URLs, PyAV for videos) raises
    ``tokenbal._extras.MissingExtraError`` naming the pip extra, before any scan where it is known
    up front.

    Sources may be URLs (``s3://``, ``https://``, any fsspec protocol; ``remote`` says how they are
    read, ``tokenbal.index.remote``) and ``.parquet`` files (``parquet`` names the columns,
    ``tokenbal.index.parquet``). ``part=(i, n)`` indexes only part ``i`` of ``n`` of the shards
    (``tokenbal.index.merge``), for builds spread over machines.

    ``processor``: a checkpoint or processor folder (``processor.save_pretrained``): the estimator
    comes from its processor configs, text from its tokenizer, and records with chat turns
    (``messages``, or LLaVA ``conversations``) are counted through its chat template, so each
    sample's length is what the processor's ``apply_chat_template`` gives
    (``tokenbal.estimate.chat``). ``model`` may also be such a folder (estimator only).
    """
    from tokenbal.estimate.video import video_pipeline
    from tokenbal.index.imagesize import EXIF_POLICIES

    t0 = time.perf_counter()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if exif not in EXIF_POLICIES:
        raise ValueError(f"exif must be one of {', '.join(EXIF_POLICIES)}, got {exif!r}")
    if on_other_rules not in ("rescan", "error"):
        raise ValueError(f"on_other_rules must be 'rescan' or 'error', got {on_other_rules!r}")
    _require_extras([sources] if isinstance(sources, str) else sources)
    paths = expand_sources(sources, remote, out=os.fspath(out))
    _require_extras(paths)
    expanded = paths
    if part is not None:
        positions, paths = select_part(paths, part)
    if image_root is not None:
        if not any(is_annotation_file(p) for p in paths):
            raise ValueError("--image-root applies to JSON/JSONL annotation sources, and none was given; "
                             "tar shards carry their images")
        if not os.path.isdir(image_root):
            raise FileNotFoundError(f"--image-root {image_root} is not a folder")
    overrides = dict(estimator_overrides or {})
    # Built here as well as in the workers: a bad model name or option fails before any scanning.
    if processor is not None:
        if tokenizer is not None:
            raise ValueError("give --tokenizer or --processor, not both (the processor has its tokenizer)")
        processor = _processor_folder(processor)
    try:
        est = make_estimator(model, overrides, processor)
    except TypeError as e:   # an unknown --estimator-option: a usage error, reported as such
        raise ValueError(f"estimator {model!r}: {e}") from e
    counter = make_text_counter(tokenizer, processor)
    folder = processor if processor is not None else (model if os.path.isdir(str(model)) else None)
    if folder is not None:
        # The manifest names a family and settings that rebuild this estimator (readers call
        # get_estimator(model, **overrides)), not the folder, which may move.
        model, overrides = _recordable(est, folder)
    out = os.path.abspath(os.fspath(out))
    _check_out(out)
    meta = {
        "estimator": {"name": est.name, "model": model, "overrides": overrides,
                      "config": est.config, "wrapper_tokens": int(est.wrapper_tokens)},
        "text_counter": {"name": counter.name, "tokenizer": tokenizer,
                         **({"processor": processor, "processor_files": processor_files(processor)}
                            if processor else {})},
        "exif": exif,
        "image_sizes": ("from headers, after EXIF orientation (PIL.ImageOps.exif_transpose)"
                        if exif == "transpose" else "from headers, as stored: EXIF orientation ignored"),
        "member_stamps": True,
        "image_root": os.path.abspath(image_root) if image_root is not None else None,
        "video_pipeline": video_pipeline(est),
        "sources": list(sources) if not isinstance(sources, str) else [sources],
    }
    if any(is_parquet(p) for p in paths):
        meta["parquet"] = (parquet or ParquetOptions()).as_meta()
    if part is not None:
        # The whole list this part split, with each shard's identity: the merge checks the parts agree.
        meta["part"] = part_meta(part, positions, paths, expanded)
    with _BuildLock(out), _sigterm_as_exit():
        # An interrupted build's finished shards first (its .partial, then what dead builds left
        # in their folders), then the last complete index.
        if incremental and on_other_rules == "error":
            _refuse_other_rules(out, meta)
            if part is not None:
                _refuse_other_part(out, part)
        leftovers = _recover_leftovers(out)
        olds = [] if not incremental else [
            idx for idx in (_reusable_index(partial_path(out), meta),
                            *(_reusable_index(f, meta) for f in leftovers),
                            _reusable_index(out, meta)) if idx]
        current = olds[-1] if olds and olds[-1].path == out else None
        # A part index holds exactly its part (the merge places shards by their part positions).
        keep_from = current if keep_unlisted and part is None else None
        jobs, kept = _plan_jobs(paths, olds, keep_from, remote)
        scan_paths = [p for p, src in jobs if src is None]
        show_bars = bool(progress) and not callable(progress)
        bars = _FileBars() if show_bars else None
        on_file = bars.update if bars is not None else (progress if callable(progress) else None)
        scanned = _shard_results(scan_paths, workers, est, counter, model, overrides, tokenizer, image_root,
                                 exif, remote, parquet, processor, on_file)

        def results() -> Iterator[ShardResult]:
            for p, src in jobs:
                yield next(scanned) if src is None else _result_from_index(src, p)
            for old in olds:   # done copying: the old version may go once replaced
                old.release()

        # closing(): on an error the worker pool shuts down now, not when the traceback is freed; and
        # scanned.close() on success too (its last shard taken, the pool generator is still suspended
        # until something closes it), so no pool thread outlives the build.
        try:
            with contextlib.closing(_progress(results(), len(jobs), show_bars, bars)) as stream:
                totals = _write_index(out, stream, meta, checkpoint_seconds)
        finally:
            scanned.close()
            if bars is not None:
                bars.close()
        for folder in leftovers:
            _remove_owned(folder)
    return BuildReport(out=out, num_shards=len(jobs), num_bad_shards=totals.num_bad_shards,
                       num_samples=totals.num_samples, num_errors=totals.num_errors,
                       num_images=totals.num_images, total_tokens=totals.total_tokens,
                       seconds=time.perf_counter() - t0, num_reused=len(jobs) - len(scan_paths),
                       num_kept=kept, bad_shards=[{"path": s["path"], "status": s["status"],
                                                   "reason": s.get("reason")}
                                                  for s in totals.shards if s["status"] != "ok"])


def _require_extras(paths: Sequence[str]) -> None:
    """Fail before any work when a source needs an optional dependency that is not installed (rather
    than one error per file, or a traceback from the first worker)."""
    from tokenbal._extras import require

    if any(is_url(p) for p in paths):
        require("fsspec", "remote (URL) sources")
    if any(is_parquet(p) for p in paths):
        require("pyarrow.parquet", "Parquet sources")


# The settings a user chooses, as (label, manifest lookup); what differs among them is named when a
# build refuses to replace an index. Other parts of ``_rules`` (the video pipeline's version, member
# stamps) change with tokenbal itself: a difference there only means a rescan.
_USER_RULES = (
    ("model", lambda m: m["estimator"].get("model", m["estimator"]["name"])),
    ("text counter", lambda m: m["text_counter"]["name"]),
    ("--image-root", lambda m: m.get("image_root")),
    ("Parquet columns", lambda m: m.get("parquet")),
    ("--exif", lambda m: m.get("exif", "ignore")),
)


def rules_differences(built: dict, meta: dict) -> list[str]:
    """The user-chosen token settings in which the index manifest ``built`` and a build's ``meta``
    differ, each as ``"NAME: index A, this build B"`` (estimator options one by one)."""
    new = json.loads(json.dumps(meta, default=_jsonable))
    out = []
    for label, get in _USER_RULES:
        try:
            have = get(built)
        except (KeyError, TypeError):
            have = "<unknown>"
        want = get(new)
        if have != want and not (label == "model" and _rules(built)[:3] == _rules(new)[:3]):
            out.append(f"{label}: index {have!r}, this build {want!r}")
    have_cfg, want_cfg = built.get("estimator", {}).get("config", {}), new["estimator"]["config"]
    if built.get("estimator", {}).get("name") == new["estimator"]["name"]:
        for k in sorted(set(have_cfg) | set(want_cfg)):
            a, b = have_cfg.get(k, "<absent>"), want_cfg.get(k, "<absent>")
            if a != b:
                out.append(f"{k}: index {a!r}, this build {b!r}")
    return out


def existing_manifest(out: str) -> dict | None:
    """The manifest of the readable index at ``out``, or None: no index there, or a damaged one or one
    of another format, which a build (or merge) replaces as it would an empty folder."""
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        return None
    try:
        built = TokenIndex.open(out)
        manifest = built.manifest
        built.release()
    except (ValueError, KeyError, OSError):
        return None
    return manifest


def _refuse_other_part(out: str, part: tuple[int, int]) -> None:
    """Raise ``ValueError`` when ``out`` holds a whole index, or another part's index, that this build
    of part ``part`` would replace: the usual cause is an ``--out`` without ``{i}``, which makes every
    part of a split (one Slurm task or rank after another) overwrite the one before, unnoticed until
    the merge misses parts. A re-split (the same part number of another count) replaces its folder."""
    manifest = existing_manifest(out)
    if manifest is None:
        return
    had = manifest.get("part")
    if had is not None and had.get("index") == part[0]:
        return
    held = (f"part {had.get('index')}/{had.get('count')}" if had is not None
            else "a whole index (built without --part)")
    n = len(manifest.get("shards", []))
    raise ValueError(
        f"--out {out} holds {held} of {manifest.get('num_samples', '?')} samples from {n} shards, which "
        f"this build of part {part[0]}/{part[1]} would replace; give each part its own folder with {{i}} "
        "in --out (e.g. --out parts/part-{i}), or pass --rebuild to replace it")


def _refuse_other_rules(out: str, meta: dict) -> None:
    """Raise ``OtherRulesError`` when ``out`` holds a readable index whose user-chosen token settings
    differ from ``meta``'s: replacing it would rescan everything and could drop shards (it keeps only
    what this build names), which must not happen by accident."""
    manifest = existing_manifest(out)
    if manifest is None:
        return
    differences = rules_differences(manifest, meta)
    if differences:
        n = len(manifest.get("shards", []))
        raise OtherRulesError(
            f"--out {out} holds an index of {manifest.get('num_samples', '?')} samples from {n} shards "
            f"built with other settings ({'; '.join(differences)}); pass --rebuild "
            "(build_index(incremental=False)) to replace it with this build, or choose another --out")


def write_index(out: str | os.PathLike, results: Iterable[ShardResult], meta: dict,
                checkpoint_seconds: float = 10.0) -> _IndexWriter:
    """Write ``results`` (in order) as the index folder ``out``, atomically; ``meta`` goes into the
    manifest (estimator, text_counter, ...). Returns the writer, whose counters give the totals.

    This is the write half of ``build_index`` (holding the same lock); it also lets tests and
    benchmarks make a large index from synthetic columns without scanning shards.
    """
    out = os.path.abspath(os.fspath(out))
    with _BuildLock(out):
        return _write_index(out, results, meta, checkpoint_seconds)


def _write_index(out: str, results: Iterable[ShardResult], meta: dict,
                 checkpoint_seconds: float) -> _IndexWriter:
    _check_out(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    writer = None
    partial = partial_path(out)
    try:
        writer = _IndexWriter(tmp)
        last = time.monotonic()
        for result in results:
            writer.add(result)
            if time.monotonic() - last >= checkpoint_seconds:
                writer.checkpoint(meta)
                last = time.monotonic()
        writer.finish(meta)
        _replace_dir(tmp, out)
    except BaseException:
        if writer is not None:
            _save_partial(writer, meta, partial)
        _remove_owned(tmp)
        raise
    shutil.rmtree(partial, ignore_errors=True)   # its shards are all in ``out`` now
    return writer


def partial_path(out: str) -> str:
    """Where an interrupted build of ``out`` keeps the shards it finished (a complete index of them)."""
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial")


def lock_path(out: str) -> str:
    """The lock file of builds of ``out`` (beside it: ``out`` itself is replaced by each build)."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")


class _BuildLock:
    """An exclusive ``flock`` on ``lock_path(out)`` for the whole build; the holder (pid, host,
    start) is written into the file so that a second build can name it. Re-entrant per process."""

    _held: dict[str, tuple[int, int]] = {}     # path -> (owning thread, depth)
    _mutex = threading.Lock()

    def __init__(self, out: str) -> None:
        self.out, self.path, self.owner = out, lock_path(out), False

    def __enter__(self) -> _BuildLock:
        with self._mutex:
            me = threading.get_ident()
            if self.path in self._held:
                owner, depth = self._held[self.path]
                if owner != me:
                    raise IndexBuildError(f"another build is writing the index {self.out}: a thread of this "
                                          f"process (pid {os.getpid()}) holds {self.path}")
                self._held[self.path] = (owner, depth + 1)
                return self
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    holder = _read_text(fd)
                    os.close(fd)
                    raise IndexBuildError(
                        f"another build is writing the index {self.out}: {holder or 'holder unknown'} "
                        f"holds {self.path}; wait for it to finish (or stop it) and run this build again"
                    ) from None
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)   # the previous holder removed the file as we opened it: take the new one
            os.ftruncate(fd, 0)
            os.write(fd, (f"pid {os.getpid()} on host {socket.gethostname()} since "
                          f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n").encode())
            self.fd, self.owner = fd, True
            self._held[self.path] = (me, 1)
            return self

    def __exit__(self, *exc) -> None:
        with self._mutex:
            if not self.owner and self.path not in self._held:
                return
            owner, depth = self._held[self.path]
            if depth > 1:
                self._held[self.path] = (owner, depth - 1)
                return
            del self._held[self.path]
            with contextlib.suppress(OSError):
                os.remove(self.path)   # while still held, so no one waits on a removed file
            os.close(self.fd)


def _read_text(fd: int) -> str:
    try:
        return os.pread(fd, 400, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM during a build raises ``SystemExit(143)`` in the main thread, so the build saves its
    finished shards exactly as on Ctrl-C (the default action would kill it without that)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _recover_leftovers(out: str) -> list[str]:
    """Folders dead builds of ``out`` left (the lock is held, so their owners are gone): each one
    with a checkpoint is finished into a partial index and returned for reuse; the rest are removed
    (tokenbal's files only). Replaced versions no reader holds any more are removed too."""
    parent, base = os.path.dirname(out), os.path.basename(out)
    found = []
    for folder in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.tmp-*"))):
        if not os.path.isdir(folder):
            continue
        finished = os.path.isfile(os.path.join(folder, MANIFEST))
        if not finished and os.path.isfile(os.path.join(folder, PROGRESS)):
            try:
                _IndexWriter.resume(folder).finish_partial()
            except (OSError, ValueError, KeyError):
                pass   # a checkpoint cut by the kill itself: nothing to reuse
        if os.path.isfile(os.path.join(folder, MANIFEST)):
            found.append(folder)
        else:
            _remove_owned(folder)
    for folder in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.v-*")):
        if os.path.isdir(folder) and not version_in_use(folder):
            _remove_owned(folder)
    return found


def _remove_owned(folder: str) -> None:
    """Delete the files tokenbal writes in ``folder``, then the folder if nothing else is left."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if name in OWNED_FILES or name.endswith(".npy.raw"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _save_partial(writer: _IndexWriter, meta: dict, partial: str) -> None:
    """After an interruption or error: keep the finished shards as an index at ``partial``, which the
    next build of the same folder reuses (resume). Best effort: a failure here never hides the
    original error."""
    try:
        writer.rollback()
        if not writer.shards:
            writer.close()
            return
        writer.finish({**meta, "partial": True})
        _swap_in(writer.folder, partial)
    except Exception:
        with contextlib.suppress(Exception):
            writer.close()


def _processor_folder(processor: str | os.PathLike) -> str:
    """The ``--processor`` folder as an absolute path, once it is known to be there and transformers
    (which runs its chat template) is installed."""
    from tokenbal._extras import require

    folder = os.path.abspath(os.fspath(processor))
    if not os.path.exists(folder):
        raise FileNotFoundError(f"--processor {processor}: no such folder")
    if not os.path.isdir(folder):
        raise ValueError(f"--processor {processor} is a file; give the checkpoint or processor folder "
                         "(the one processor.save_pretrained wrote)")
    require("transformers", "--processor (counting through the processor's chat template)")
    return folder


def make_estimator(model: str, overrides: dict, processor: str | None = None) -> VisionEstimator:
    """The vision estimator of a build: a processor / checkpoint folder's own settings
    (``processor``, or ``model`` naming a folder), else the family ``model`` with ``overrides``."""
    from tokenbal.estimate import get_estimator, load_estimator

    folder = processor if processor is not None else (model if os.path.isdir(str(model)) else None)
    if folder is not None:
        return load_estimator(folder, **overrides)
    return get_estimator(model, **overrides)


def _recordable(est: VisionEstimator, folder: str) -> tuple[str, dict]:
    """``(family, settings)`` with ``get_estimator(family, **settings)`` equal to ``est``."""
    from tokenbal.estimate import get_estimator

    settings = {k: v for k, v in est.config.items() if k not in ("estimator", "family", "name")}
    try:
        same = get_estimator(est.name, **settings).config == est.config
    except (TypeError, ValueError):
        same = False
    if not same:
        raise ValueError(f"the {est.name} estimator read from {folder} cannot be recorded in the index "
                         f"manifest; pass --model {est.name} with --estimator-option settings instead")
    return est.name, settings


def make_text_counter(tokenizer: str | None, processor: str | None = None) -> TextCounter:
    """The text counter of a build: the processor folder's tokenizer and chat template
    (``processor``), else ``tokenbal.estimate.get_text_counter(tokenizer)``."""
    if processor is not None:
        from tokenbal.estimate.chat import ProcessorTextCounter

        return ProcessorTextCounter.from_pretrained(processor)
    from tokenbal.estimate import get_text_counter

    return get_text_counter(tokenizer)


def index_shard(path: str, est: VisionEstimator, counter: TextCounter,
                image_root: str | None = None, exif: str = "ignore", remote: RemoteOptions | None = None,
                parquet: ParquetOptions | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> ShardResult:
    """Scan one shard (or annotation / Parquet file, local or remote) and count its tokens with
    ``est`` and ``counter``; ``exif``: the orientation policy for image sizes (``build_index``);
    ``progress(done, total, unit)``: the shard's progress: a remote tar shard read whole, its download
    (unit ``"download"``: bytes written, ``remote.DOWNLOAD``); a tar shard's header walk, local or remote
    (unit ``"headers"``: the offset reached of the shard's bytes, ``scan.HEADERS``), bytes of the file
    scanned (unit ``"B"``, a tar shard, local or remote, or an annotation file) or rows (``"rows"``, a
    Parquet file, each row group), then the samples whose text tokens are counted (``"samples"``, every
    ``PROGRESS_ROWS`` and at the end). Reports are counts, never timed: the same on every run."""
    if is_parquet(path):
        scan = scan_parquet(path, parquet, remote, exif=exif, progress=progress)
    elif is_url(path) and is_annotation_file(path):
        # Annotation files are read from local disk with their images beside them; a URL of one is
        # not a tar shard to scan by ranges (it was reported as a corrupt tar).
        reason = (f"{path}: annotation files (.json / .jsonl) are read from local disk, with their images "
                  "and videos as local files; download it (and its media), or pack the samples into tar "
                  "shards, which may be URLs")
        scan = ShardScan(path=path, status="unreadable", reason=reason,
                         errors=[{"shard": path, "key": None, "reason": reason}])
    elif is_url(path):
        scan = scan_remote_shard(path, remote, exif=exif, progress=progress)
    else:
        scan = (scan_annotations(path, image_root, exif=exif, progress=progress) if is_annotation_file(path)
                else scan_shard(path, exif=exif, progress=progress))
    return _count_tokens(scan, est, counter, progress)


# --- incremental builds ---------------------------------------------------------------------------

# What each element of ``_rules`` is, in its order (the merge names the ones in which parts differ).
RULE_NAMES = ("estimator", "estimator config", "wrapper tokens", "text counter", "--image-root",
              "Parquet columns", "video pipeline", "--exif", "member stamps")


def _rules(meta: dict) -> tuple:
    e = meta["estimator"]
    return (e["name"], json.dumps(e["config"], sort_keys=True, default=_jsonable), int(e["wrapper_tokens"]),
            meta["text_counter"]["name"], meta.get("image_root"), json.dumps(meta.get("parquet")),
            meta.get("video_pipeline"), meta.get("exif", "ignore"), bool(meta.get("member_stamps")))


def _reusable_index(out: str, meta: dict) -> TokenIndex | None:
    """The index at ``out`` if it exists and was built with the same token rules, else ``None``."""
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        return None
    try:
        old = TokenIndex.open(out)
        same = _rules(old.manifest) == _rules(json.loads(json.dumps(meta, default=_jsonable)))
    except (ValueError, KeyError, OSError):   # another format version, a damaged index: rebuild
        return None
    if not same:
        old.release()
        return None
    return old


def _plan_jobs(paths: list[str], olds: list[TokenIndex],
               keep_from: TokenIndex | None = None,
               remote: RemoteOptions | None = None) -> tuple[list[tuple[str, TokenIndex | None]], int]:
    """(path, index to copy it from, or None to scan it) per shard, in index order: the old indexes'
    shards first, in their order, then the new ones in source order; and how many shards of
    ``keep_from`` (the index at ``out``) were kept although ``paths`` does not name them. A shard is
    copied only when unchanged and scanned under this release's ``SCAN_RULES``."""
    wanted = set(paths)
    done: set[str] = set()
    jobs: list[tuple[str, TokenIndex | None]] = []
    kept = 0
    for old in olds:
        for entry in old.manifest["shards"]:
            p = entry["path"]
            if p in done or (p not in wanted and old is not keep_from):
                continue
            kept += p not in wanted
            done.add(p)
            same = (old.manifest.get("scan_rules", 0) == SCAN_RULES and _unchanged(entry, remote)
                    and not _named_files_changed(old, p) and not _row_files_changed(entry))
            jobs.append((p, old if same else None))
    jobs.extend((p, None) for p in paths if p not in done)
    return jobs, kept


def _unchanged(entry: dict, remote: RemoteOptions | None = None) -> bool:
    if entry.get("fingerprint") is None or read_failed(entry):
        return False     # missing / unreadable at the last build (perhaps a passing store error): look again
    if is_url(entry["path"]):
        return remote_unchanged(entry, remote or RemoteOptions())
    try:
        st = os.stat(entry["path"])
        # mtime too: a member rewritten in the middle at the same size leaves the fingerprint as is.
        return (st.st_size == entry["size"] and st.st_mtime_ns == entry.get("mtime_ns")
                and shard_fingerprint(entry["path"], st.st_size) == entry["fingerprint"])
    except OSError:
        return False


def _named_files_changed(idx: TokenIndex, path: str) -> bool:
    """Whether an image or video file that a record of shard ``path`` names (annotation files) has
    another size or mtime than at the build of ``idx``: the shard's own bytes are the same, but
    its counts are not (a longer video under the same name), so it is rescanned."""
    from tokenbal.index.store import changed_files

    c = idx._cols
    if "member_mtime" not in c:
        return False   # an index from before member stamps: nothing to compare
    cache = idx.__dict__.setdefault("_sid_of", {})
    if not cache:
        cache.update({p: i for i, p in enumerate(idx.shard_paths)})
    sid = cache[path]
    a, b = (int(x) for x in np.searchsorted(idx.shard_ids, [sid, sid + 1]))
    return bool(changed_files(idx, (int(c["member_start"][a]), int(c["member_start"][b]))))


def _row_files_changed(entry: dict) -> bool:
    """Whether a file the shard's samples depend on outside the shard changed: a video file that a
    Parquet row names by path or a file that made an annotation record an error appeared, changed or is
    gone (``store.row_file_problems``, what ``verify`` reports). Then the shard is rescanned, as
    annotation files are when a counted image changes: a fixed file is counted, a record never stays an
    error for a stale reason."""
    from tokenbal.index.store import row_file_problems

    return bool(row_file_problems(entry))


# Statuses that say a read failed (the file was missing, an I/O error, a remote read out of retries),
# not what the bytes hold; "corrupt" / "truncated" / "empty" are verdicts on the bytes themselves.
READ_FAILURE_STATUSES = ("missing", "unreadable")


def read_failed(entry: dict) -> bool:
    """Whether the build could not read (all of) the shard of manifest ``entry``: such a shard is
    rescanned by the next build and reported by ``verify`` (``store.failed_shards``)."""
    return entry.get("status") in READ_FAILURE_STATUSES or bool(entry.get("n_read_failures"))


def _result_from_index(idx: TokenIndex, path: str) -> ShardResult:
    """The rows of shard ``path`` in ``idx``, as the ShardResult a rescan would give."""
    cache = idx.__dict__.setdefault("_reuse_cache", {})
    if not cache:   # built once per index: a lookup per shard must not scan all shards / all errors
        cache["sid"] = {p: i for i, p in enumerate(idx.shard_paths)}
        cache["errors"] = {}
        for e in idx.errors:
            cache["errors"].setdefault(e["shard"], []).append(e)
    sid = cache["sid"][path]
    entry = {k: v for k, v in idx.manifest["shards"][sid].items() if k != "id"}
    c = idx._cols
    a, b = (int(x) for x in np.searchsorted(idx.shard_ids, [sid, sid + 1]))   # rows are grouped by shard
    ms, ims = np.asarray(c["member_start"][a:b + 1]), np.asarray(c["image_start"][a:b + 1])
    m0, m1 = int(ms[0]), int(ms[-1])
    exts = idx._exts
    poff = np.asarray(c["member_path_offsets"][m0:m1 + 1])
    paths = [idx._member_paths[j] if poff[j - m0 + 1] > poff[j - m0] else "" for j in range(m0, m1)]
    video = {}
    if "video_start" in c:
        vs = np.asarray(c["video_start"][a:b + 1])
        video = {"video_counts": np.diff(vs), "video_info": np.array(c["video_info"][int(vs[0]):int(vs[-1])]),
                 "video_params": np.array(c["video_params"][int(vs[0]):int(vs[-1])])}
    return ShardResult(**video,
        entry=entry, keys=idx.keys[a:b], member_counts=np.diff(ms), member_exts=[
            exts[e] for e in c["member_ext"][m0:m1]],
        member_offsets=np.array(c["member_offset"][m0:m1]), member_sizes=np.array(c["member_size"][m0:m1]),
        image_counts=np.diff(ims), image_wh=np.array(c["image_size"][int(ims[0]):int(ims[-1])]),
        vision=np.array(idx.vision_tokens[a:b]), text=np.array(idx.text_tokens[a:b]),
        errors=list(cache["errors"].get(path, [])),
        member_paths=paths if any(paths) else None,
        member_stamps=(np.stack([c["member_chksum"][m0:m1], c["member_mtime"][m0:m1]], axis=1)
                       if "member_chksum" in c else None))


def _wrapper_tokens(est: VisionEstimator, wh: np.ndarray) -> np.ndarray | int:
    """Special tokens around each image: a constant for most families, but Idefics3 / SmolVLM add
    row and tile markers that depend on how the image is split."""
    per_size = getattr(est, "image_wrapper_tokens_batch", None)
    if per_size is not None:
        return np.asarray(per_size(wh[:, 0], wh[:, 1]), dtype=np.int64)
    return int(est.wrapper_tokens)


def _count_tokens(scan: ShardScan, est: VisionEstimator, counter: TextCounter,
                  progress: Callable[[int, int, str], None] | None = None) -> ShardResult:
    from tokenbal.estimate import image_tokens_checked
    from tokenbal.index.videoindex import plan_sample_videos, video_arrays

    errors = list(scan.errors)
    by_chat = hasattr(counter, "count_chat_text")
    samples = plan_sample_videos(scan.samples, est, counter, scan.path, errors, by_chat=by_chat)
    chat_text: dict[str, int] = {}
    # Text is counted in chunks of PROGRESS_ROWS samples, each chunk reported: a real tokenizer or a
    # processor's chat template over millions of rows takes minutes. Chats first, then plain texts.
    chats = [s for s in samples if s.chat is not None] if by_chat else []
    n_plain = sum(1 for s in samples if s.text and (not by_chat or s.chat is None))
    tally = _TextTally(len(chats) + n_plain, progress)
    if chats:
        # Through the processor's chat template; a record it would reject is an error, not a wrong count.
        counts, bad = _chat_text(counter, chats, tally)
        for k, s in enumerate(chats):
            if k in bad:
                errors.append({"shard": scan.path, "key": s.key, "reason": f"sample {s.key!r}: {bad[k]}"})
            else:
                chat_text[s.key] = int(counts[k])
        dropped = {chats[k].key for k in bad}
        samples = [s for s in samples if s.key not in dropped]
    wh = np.array([wh for s in samples for wh in s.image_sizes], dtype=np.int64).reshape(-1, 2)
    per_image = np.zeros(len(wh), np.int64)
    if len(wh):
        # One image the model's processor would reject (a zero side, an extreme aspect ratio) makes
        # its sample an error; it must not fail the shard's other samples.
        per_image, bad = image_tokens_checked(est, wh[:, 0], wh[:, 1])
        if bad:
            owner = np.repeat(np.arange(len(samples)), [len(s.image_sizes) for s in samples])
            bad_samples: dict[int, str] = {}
            for j, message in sorted(bad.items()):
                bad_samples.setdefault(int(owner[j]), f"image {int(j - np.searchsorted(owner, owner[j]))} "
                                                      f"({wh[j, 0]}x{wh[j, 1]}): {message}")
            for i, message in bad_samples.items():
                errors.append({"shard": scan.path, "key": samples[i].key,
                               "reason": f"sample {samples[i].key!r}: {message}"})
            keep_image = ~np.isin(owner, list(bad_samples))
            samples = [s for i, s in enumerate(samples) if i not in bad_samples]
            wh, per_image = wh[keep_image], np.asarray(per_image)[keep_image]
    n = len(samples)
    image_counts = np.fromiter((len(s.image_sizes) for s in samples), np.int64, count=n)
    vision = np.zeros(n, np.int64)
    if len(wh) and getattr(est, "family", None) == "llava-onevision":
        # transformers (processor and model) gives an image that shares its sample with other
        # images only its base view and newline; the estimator's images_in_sample says so.
        shared = np.repeat(image_counts, image_counts) > 1
        if shared.any():
            per_image = np.where(shared, est.image_tokens(1, 1, images_in_sample=2), per_image)
    if len(wh):
        per_image = np.asarray(per_image, dtype=np.int64) + _wrapper_tokens(est, wh)
        np.add.at(vision, np.repeat(np.arange(n), image_counts), per_image)
    video = {}
    if any(s.videos for s in samples):
        counts, video_tokens, info, params = video_arrays(samples)
        vision += video_tokens
        video = {"video_counts": counts, "video_info": info, "video_params": params}
    text = np.zeros(n, np.int64)
    for i, s in enumerate(samples):
        if s.chat is not None and s.key in chat_text:
            text[i] = chat_text[s.key]
    plain = [i for i, s in enumerate(samples) if s.text and s.key not in chat_text]
    for a in range(0, len(plain), PROGRESS_ROWS):
        chunk = plain[a:a + PROGRESS_ROWS]
        text[chunk] = np.asarray(counter.count_batch([samples[i].text for i in chunk]), np.int64)
        tally.add(len(chunk))
    tally.end()
    entry = {"path": scan.path, "size": scan.size, "mtime_ns": scan.mtime_ns,
             "fingerprint": scan.fingerprint, "status": scan.status, "reason": scan.reason,
             "n_members": scan.n_members, "n_samples": n, "n_errors": len(errors),
             "end_of_members": scan.end_of_members, "n_full_reads": scan.n_full_reads,
             "n_read_failures": scan.n_read_failures, **scan.extra}
    paths = None
    if any(s.paths for s in samples):
        paths = [p for s in samples for p in (s.paths or [""] * len(s.members))]
    entry["headers_digest"] = scan.headers_digest
    stamps = np.array([st for s in samples for st in (s.stamps or [(-1, -1)] * len(s.members))],
                      np.int64).reshape(-1, 2)
    return ShardResult(
        **video, entry=entry, keys=[s.key for s in samples], member_paths=paths,
        member_counts=np.fromiter((len(s.members) for s in samples), np.int64, count=n),
        member_exts=[m[0] for s in samples for m in s.members],
        member_offsets=np.array([m[1] for s in samples for m in s.members], np.int64),
        member_sizes=np.array([m[2] for s in samples for m in s.members], np.int64),
        image_counts=image_counts, image_wh=wh, vision=vision, text=text, errors=errors,
        member_stamps=stamps)


class _TextTally:
    """Reports ``(done, total, "samples")`` as a shard's text is counted: after each chunk, and once at
    the end with done == total (samples dropped for a bad image are not counted but still done)."""

    def __init__(self, total: int, progress: Callable[[int, int, str], None] | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None and self.done < self.total:
            self.progress(self.done, self.total, "samples")

    def end(self) -> None:
        if self.progress is not None and self.total:
            self.progress(self.total, self.total, "samples")


def _chat_text(counter, samples: list, tally: _TextTally | None = None) -> tuple[np.ndarray, dict[int, str]]:
    """Text tokens of samples with chat turns under the processor's template, and the reasons of the
    ones that cannot be counted (by position in ``samples``; their text entry is 0).

    Videos are counted as ``dataset_lengths`` counts them (``ChatTokenCounter``: the processor's own
    video settings and ``replace_video_token`` on the container header, ``tokenbal.estimate.
    chat_video``): each video's ``sampled`` / ``tokens`` are set to the frames the processor keeps
    and the tokens that replace its placeholder (the video table's rows, part of the sample's
    vision tokens), and the text count is the rest."""
    from tokenbal.estimate.chat import ChatCountError

    bad: dict[int, str] = {}
    for k, s in enumerate(samples):
        for j, v in enumerate(s.videos or ()):
            try:
                v.tokens, v.sampled = counter.video_tokens(v.info, f"{j} ({_video_name(s, v)})",
                                                           row_videos=[w.info for w in s.videos])
            except ChatCountError as e:
                bad[k] = str(e).split(": ", 1)[-1]
                break
            v.params = {}   # the processor samples by its own settings, not by the part's fields
    out = np.zeros(len(samples), np.int64)

    def videos(ks):
        return [[v.info for v in (samples[k].videos or ())] for k in ks]

    # In chunks of PROGRESS_ROWS samples (``tally`` reports each): the counts are per conversation,
    # so they are the same whatever the chunks.
    for a in range(0, len(samples), PROGRESS_ROWS):
        chunk = [k for k in range(a, min(a + PROGRESS_ROWS, len(samples))) if k not in bad]
        try:
            if chunk:
                out[chunk] = counter.count_chat_text([samples[k].chat for k in chunk],
                                                     [samples[k].image_sizes for k in chunk],
                                                     videos=videos(chunk))
        except Exception:  # noqa: BLE001 - one bad record (or a template error on it): find it, count the rest
            for k in chunk:
                try:
                    out[k] = counter.count_chat_text([samples[k].chat], [samples[k].image_sizes],
                                                     videos=videos([k]))[0]
                except ChatCountError as e:
                    bad[k] = str(e).split(": ", 1)[-1]
                except Exception as e:  # noqa: BLE001 - the template raised on this record
                    bad[k] = f"the chat template cannot render it: {type(e).__name__}: {e}"
        if tally is not None:
            tally.add(min(a + PROGRESS_ROWS, len(samples)) - a)
    return out, bad


def _video_name(sample, video) -> str:
    """The file of a sample's video, for errors: the path an annotation record names (and where
    it was found), else the tar member."""
    if sample.paths and sample.paths[video.member]:
        rel, _, full = sample.paths[video.member].partition("\0")
        return f"{rel!r} at {full}" if full and full != rel else repr(rel)
    ext = sample.members[video.member][0]
    return f"member {sample.key}.{ext}"


# --- parallel scan ------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(model: str, overrides: dict, tokenizer: str | None, image_root: str | None,
                 exif: str = "ignore", remote: RemoteOptions | None = None,
                 parquet: ParquetOptions | None = None, processor: str | None = None,
                 parent: int | None = None, reports=None) -> None:
    if parent is not None:
        die_with_parent(parent)
    # The parent handles Ctrl-C / SIGTERM and stops the pool; a worker must not die on its own first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER["est"] = make_estimator(model, overrides, processor)
    _WORKER["counter"] = make_text_counter(tokenizer, processor)
    _WORKER["image_root"] = image_root
    _WORKER["exif"] = exif
    _WORKER["remote"], _WORKER["parquet"] = remote, parquet
    if reports is not None:
        # Progress reports are a display: a worker ending with some unread must not wait on them.
        reports.cancel_join_thread()
    _WORKER["reports"] = reports


_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def die_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """End this process when process ``parent`` dies, however it dies: a build killed by SIGKILL
    cannot stop its scan workers, and a worker left behind keeps the build's stdout open (so
    ``tokenbal index build ... | cat`` never ends) and blocks on its result pipe forever.

    Linux: the kernel sends SIGKILL at the parent's death (``prctl(PR_SET_PDEATHSIG)``; strictly, at
    the end of the parent *thread* that started the worker: the build's own thread, which outlives
    its pool, since ``ProcessPoolExecutor`` starts workers from ``submit``). Everywhere,
    and as a second line where prctl is unavailable: a daemon thread that exits the process once it
    has been re-parented (``os.getppid()`` no longer ``parent``), checked every ``poll_s`` seconds.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:   # it died before the watch was set up
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tokenbal-parent-watch").start()


def _worker_index_shard(path: str) -> ShardResult:
    reports = _WORKER.get("reports")
    progress = None if reports is None else (lambda done, total, unit: reports.put((path, done, total, unit)))
    return index_shard(path, _WORKER["est"], _WORKER["counter"], _WORKER["image_root"], _WORKER["exif"],
                       _WORKER["remote"], _WORKER["parquet"], progress)


def _worker_index_shards(paths: list[str]) -> list[ShardResult]:
    # Remote shards: several at once per worker process, so requests stay in flight.
    inflight = (_WORKER["remote"] or RemoteOptions()).inflight
    return list(threaded_map(_worker_index_shard, paths, inflight))


def _shard_results(paths: list[str], workers: int, est: VisionEstimator, counter: TextCounter,
                   model: str, overrides: dict, tokenizer: str | None,
                   image_root: str | None, exif: str = "ignore", remote: RemoteOptions | None = None,
                   parquet: ParquetOptions | None = None, processor: str | None = None,
                   on_file: Callable[[str, int, int, str], None] | None = None) -> Iterator[ShardResult]:
    """Each shard's result, in order; ``on_file(path, done, total, unit)`` gets the progress of the
    shards as they are scanned (from the worker processes through a queue)."""
    inflight = (remote or RemoteOptions()).inflight if any(is_url(p) for p in paths) else 1
    if workers == 1 or len(paths) <= 1:
        def one(p: str) -> ShardResult:
            report = None if on_file is None else (lambda done, total, unit: on_file(p, done, total, unit))
            return index_shard(p, est, counter, image_root, exif, remote, parquet, report)
        yield from threaded_map(one, paths, inflight)
        return
    import queue
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: the parent may hold tokenizer / torch threads that a fork would copy mid-state.
    # concurrent.futures, not multiprocessing.Pool: a worker killed by a signal (the OOM killer) breaks
    # the executor and every pending result raises, where Pool waits for that result forever.
    n = min(workers, len(paths))
    context = multiprocessing.get_context("spawn")
    reports = context.Queue() if on_file is not None else None

    def show_reports() -> None:
        while reports is not None:
            try:
                on_file(*reports.get_nowait())
            except queue.Empty:
                return

    def result_of(fut):
        # Without reports, wait; with them, show them while the shard is scanned.
        while True:
            try:
                return fut.result(timeout=None if reports is None else 0.2)
            except FutureTimeout:
                show_reports()

    pool = ProcessPoolExecutor(n, mp_context=context, initializer=_init_worker,
                               initargs=(model, overrides, tokenizer, image_root, exif, remote, parquet,
                                         processor, os.getpid(), reports))
    # One task per shard; remote shards go ``inflight`` to a task, scanned by threads in the worker
    # so that requests stay in flight. Tasks come back in shard order: the index is identical
    # whatever the number of workers.
    if inflight <= 1:
        tasks, fn = [[p] for p in paths], _worker_index_shard   # looked up here: tests put a stand-in
    else:
        tasks, fn = [paths[k:k + inflight] for k in range(0, len(paths), inflight)], _worker_index_shards
    window: list = []          # (shards, future) in shard order
    nxt = 0
    try:
        while nxt < len(tasks) or window:
            while nxt < len(tasks) and len(window) < 2 * n:
                task = tasks[nxt]
                window.append((task, pool.submit(fn, task[0] if inflight <= 1 else task)))
                nxt += 1
            task, fut = window.pop(0)
            try:
                result = result_of(fut)
                show_reports()
            except BrokenProcessPool:
                flight = [*task] + [p for t, f in window
                                    if not f.done() or f.exception() is not None for p in t]
                raise IndexBuildError(
                    f"index build: a scan worker died (killed by a signal, e.g. the out-of-memory killer) "
                    f"while these shards were being scanned: {', '.join(flight[:8])}"
                    f"{f' and {len(flight) - 8} more' if len(flight) > 8 else ''}. "
                    "The shards finished before "
                    "are kept; run the build again (with fewer --workers if memory ran out)") from None
            if inflight <= 1:
                yield result
            else:
                yield from result
    finally:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)   # shutdown() forgets it
        pool.shutdown(wait=False, cancel_futures=True)
        # A scan in flight when the build stops (Ctrl-C, SIGTERM, an error) must not outlive it.
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.terminate()
        # Wait (bounded) for the executor's manager thread to finish its cleanup: on Python < 3.12 a
        # manager thread still closing its wakeup pipe at interpreter exit races concurrent.futures'
        # exit hook, which then writes to the closed pipe ("OSError: [Errno 9] Bad file descriptor"
        # printed by a build that exits 0).
        if manager is not None and manager is not threading.current_thread():
            manager.join(30)


def _progress(results: Iterator[ShardResult], total: int, enabled: bool,
              files: _FileBars | None = None) -> Iterator[ShardResult]:
    if not enabled:
        yield from results
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="shard", desc="indexing") as bar:
        samples = errors = 0
        for r in results:
            if files is not None:
                files.finish(r.entry["path"])
            samples += r.entry["n_samples"]
            errors += len(r.errors)
            bar.set_postfix(samples=samples, errors=errors, refresh=False)
            bar.update(1)
            yield r


class _FileBars:
    """A bar under the shard bar for each shard being scanned: a tar shard's header walk (bytes of the
    shard listed), bytes consumed (a tar shard, a JSON or JSONL file), then samples whose text tokens
    are counted."""

    # report unit -> (bar unit, what the bar's label adds)
    PHASES = {DOWNLOAD: ("B", " (download)"), HEADERS: ("B", " (headers)"),
              "samples": ("samples", " (tokens)")}

    def __init__(self) -> None:
        self.bars: dict = {}             # path -> (report unit, bar)
        self.finished: set[str] = set()
        self.lock = threading.Lock()     # in-process scans may report from threads

    def update(self, path: str, done: int, total: int, unit: str) -> None:
        from tqdm import tqdm

        with self.lock:
            if path in self.finished:
                return                   # a late report of a file whose result is in
            phase, bar = self.bars.get(path, (None, None))
            if (bar is None or phase != unit) and done >= total:
                if bar is not None:
                    bar.update(bar.total - bar.n)
                return                   # a phase done in one report (a small file): no bar to flash
            if bar is None or phase != unit:
                if bar is not None:
                    bar.close()
                shown, label = self.PHASES.get(unit, (unit, ""))
                bar = tqdm(total=total, unit=shown, unit_scale=shown == "B", leave=False,
                           desc=f"  {os.path.basename(path)}{label}")
                self.bars[path] = (unit, bar)
            bar.total = max(total, done)
            bar.update(done - bar.n)

    def finish(self, path: str) -> None:
        with self.lock:
            self.finished.add(path)
            _, bar = self.bars.pop(path, (None, None))
            if bar is not None:
                bar.close()

    def close(self) -> None:
        with self.lock:
            for _, bar in self.bars.values():
                bar.close()
            self.bars.clear()


# --- writing ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """An OS error while writing ``path`` (a full disk, a quota) names it: a write or flush raises
    ``OSError`` without a file name, which would leave the user guessing which disk filled up."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or str(e), path) from e
        raise


class _Column:
    """Append-only ``.npy`` column: raw bytes while building, a proper ``.npy`` at the end, so the
    builder never holds the whole dataset's columns in memory."""

    def __init__(self, folder: str, name: str, dtype, tail: tuple[int, ...],
                 resume_rows: int | None = None) -> None:
        self.path = os.path.join(folder, f"{name}.npy")
        self.raw_path = self.path + ".raw"
        self.dtype, self.tail, self.rows = np.dtype(dtype), tail, 0
        self.row_bytes = self.dtype.itemsize * int(np.prod(tail, dtype=np.int64))
        if resume_rows is None:
            self.f = open(self.raw_path, "wb")
        else:   # a checkpointed folder: keep its first ``resume_rows`` rows
            self.f = open(self.raw_path, "r+b")
            if os.fstat(self.f.fileno()).st_size < resume_rows * self.row_bytes:
                self.f.close()
                raise ValueError(f"{self.raw_path} is shorter than its checkpoint")
            self.f.truncate(resume_rows * self.row_bytes)
            self.f.seek(0, os.SEEK_END)
            self.rows = resume_rows

    def append(self, values) -> None:
        arr = np.ascontiguousarray(values, dtype=self.dtype).reshape((-1, *self.tail))
        with _writing(self.raw_path):
            arr.tofile(self.f)
        self.rows += len(arr)

    def finish(self) -> None:
        with _writing(self.raw_path):
            self.f.close()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, *self.tail)}
        with _writing(self.path), open(self.path, "wb") as f, open(self.raw_path, "rb") as raw:
            np.lib.format.write_array_header_1_0(f, header)
            shutil.copyfileobj(raw, f, 1 << 22)
        os.remove(self.raw_path)


_WRITTEN_COLUMNS = {**COLUMNS, **OPTIONAL_COLUMNS, **VIDEO_COLUMNS}


class _IndexWriter:
    def __init__(self, folder: str, progress: dict | None = None) -> None:
        self.folder = folder
        rows = progress["state"]["rows"] if progress is not None else {}
        self.cols = {name: _Column(folder, name, dt, tail, rows.get(name) if progress is not None else None)
                     for name, (dt, tail) in _WRITTEN_COLUMNS.items()}
        mode = "r+b" if progress is not None else "wb"
        self.keys_f = open(os.path.join(folder, KEYS_BLOB), mode)
        self.paths_f = open(os.path.join(folder, PATHS_BLOB), mode)
        self.path_bytes = 0
        self.errors_f = open(os.path.join(folder, ERRORS), mode)
        self.shards: list[dict] = []
        self.ext_ids: dict[str, int] = {}
        self.key_bytes = self.num_members = self.num_images = 0
        self.num_samples = self.num_errors = self.num_bad_shards = self.total_tokens = 0
        self.num_videos = 0
        if progress is not None:
            self.meta = progress["meta"]
            self.shards, self.ext_ids = progress["shards"], progress["ext_ids"]
            self._checkpoint = progress["state"]
            self.rollback()
            return
        # CSR tables start with a 0 so that sample i spans [start[i], start[i + 1]).
        for name in ("key_offsets", "member_start", "image_start", "member_path_offsets", "video_start"):
            self.cols[name].append([0])
        self._checkpoint = self._state()

    @classmethod
    def resume(cls, folder: str) -> _IndexWriter:
        """The writer of a folder a killed build left, back at its last checkpoint."""
        with open(os.path.join(folder, PROGRESS), encoding="utf-8") as f:
            return cls(folder, json.load(f))

    def checkpoint(self, meta: dict) -> None:
        """Record the shards finished so far, so that a build killed even by SIGKILL resumes from
        here (the data is in the page cache once written; no fsync: a process kill loses nothing)."""
        for f in (*(c.f for c in self.cols.values()), self.keys_f, self.paths_f, self.errors_f):
            with _writing(f.name):
                f.flush()
        progress = {"meta": meta, "state": self._checkpoint, "shards": self.shards, "ext_ids": self.ext_ids}
        tmp = os.path.join(self.folder, PROGRESS + ".tmp")
        with _writing(tmp), open(tmp, "w", encoding="utf-8") as f:
            json.dump(progress, f, default=_jsonable)
        os.replace(tmp, os.path.join(self.folder, PROGRESS))

    def finish_partial(self) -> None:
        self.finish({**self.meta, "partial": True})

    _COUNTERS = ("key_bytes", "path_bytes", "num_members", "num_images", "num_samples", "num_errors",
                 "num_bad_shards", "total_tokens", "num_videos")

    def _state(self) -> dict:
        return {"counters": {k: getattr(self, k) for k in self._COUNTERS}, "n_shards": len(self.shards),
                "rows": {name: col.rows for name, col in self.cols.items()},
                "errors_bytes": self.errors_f.tell()}

    def rollback(self) -> None:
        """Undo a partly written ``add`` (interrupted mid-way): back to the last complete shard."""
        ck = self._checkpoint
        for k, v in ck["counters"].items():
            setattr(self, k, v)
        del self.shards[ck["n_shards"]:]
        for name, col in self.cols.items():
            col.rows = ck["rows"][name]
            col.f.flush()
            col.f.truncate(col.rows * col.row_bytes)
            col.f.seek(0, os.SEEK_END)
        for f, n in ((self.keys_f, self.key_bytes), (self.paths_f, self.path_bytes)):
            f.flush()
            f.truncate(n)
            f.seek(0, os.SEEK_END)
        self.errors_f.flush()
        self.errors_f.truncate(ck["errors_bytes"])
        self.errors_f.seek(0, os.SEEK_END)

    def add(self, r: ShardResult) -> None:
        shard_id = len(self.shards)
        self.shards.append({"id": shard_id, **r.entry})
        n = len(r.keys)
        lengths = r.vision + r.text
        c = self.cols
        c["lengths"].append(lengths)
        c["vision_tokens"].append(r.vision)
        c["text_tokens"].append(r.text)
        c["shard_id"].append(np.full(n, shard_id, np.int32))
        encoded = [k.encode("utf-8") for k in r.keys]
        with _writing(self.keys_f.name):
            self.keys_f.write(b"".join(encoded))
        c["key_offsets"].append(self.key_bytes + np.cumsum([len(k) for k in encoded], dtype=np.int64))
        self.key_bytes += sum(len(k) for k in encoded)
        c["member_start"].append(self.num_members + np.cumsum(r.member_counts, dtype=np.int64))
        c["member_ext"].append([self.ext_ids.setdefault(e, len(self.ext_ids)) for e in r.member_exts])
        c["member_offset"].append(r.member_offsets)
        c["member_size"].append(r.member_sizes)
        stamps = (np.full((len(r.member_exts), 2), -1, np.int64) if r.member_stamps is None
                  else np.asarray(r.member_stamps, np.int64).reshape(-1, 2))
        c["member_chksum"].append(stamps[:, 0])
        c["member_mtime"].append(stamps[:, 1])
        if r.member_paths is None:   # tar members: empty ranges
            c["member_path_offsets"].append(np.full(len(r.member_exts), self.path_bytes, np.int64))
        else:
            blobs = [p.encode("utf-8", "surrogateescape") for p in r.member_paths]
            with _writing(self.paths_f.name):
                self.paths_f.write(b"".join(blobs))
            c["member_path_offsets"].append(self.path_bytes + np.cumsum([len(p) for p in blobs],
                                                                         dtype=np.int64))
            self.path_bytes += sum(len(p) for p in blobs)
        c["image_start"].append(self.num_images + np.cumsum(r.image_counts, dtype=np.int64))
        c["image_size"].append(r.image_wh)
        counts = r.video_counts if r.video_counts is not None else np.zeros(n, np.int64)
        c["video_start"].append(self.num_videos + np.cumsum(counts, dtype=np.int64))
        if r.video_info is not None:
            c["video_info"].append(r.video_info)
            c["video_params"].append(r.video_params)
            self.num_videos += len(r.video_info)
        with _writing(self.errors_f.name):
            for e in r.errors:
                self.errors_f.write((json.dumps(e, ensure_ascii=False) + "\n").encode("utf-8"))
        self.num_samples += n
        self.num_members += len(r.member_exts)
        self.num_images += len(r.image_wh)
        self.num_errors += len(r.errors)
        self.num_bad_shards += r.entry["status"] != "ok"
        self.total_tokens += int(lengths.sum())
        self._checkpoint = self._state()     # this shard is complete

    def close(self) -> None:
        """Close the open files (after an error; ``finish`` closes them on success)."""
        for f in (*(c.f for c in self.cols.values()), self.keys_f, self.paths_f, self.errors_f):
            f.close()

    def finish(self, meta: dict) -> None:
        for col in self.cols.values():
            col.finish()
        for f in (self.keys_f, self.paths_f, self.errors_f):
            with _writing(f.name):
                f.close()
        from tokenbal import __version__

        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenbal_version": __version__,
            "scan_rules": SCAN_RULES,
            "build_id": uuid.uuid4().hex,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
            "num_samples": self.num_samples, "num_members": self.num_members,
            "num_images": self.num_images, "num_videos": self.num_videos, "num_errors": self.num_errors,
            "total_tokens": self.total_tokens,
            "extensions": list(self.ext_ids),
            "shards": self.shards,
        }
        # Written last, so a folder with a manifest is a complete index.
        path = os.path.join(self.folder, MANIFEST)
        with _writing(path), open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, default=_jsonable, ensure_ascii=False)
            f.write("\n")
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.folder, PROGRESS))


def _jsonable(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)   # e.g. a Path in an estimator config: keep it readable rather than fail


def _check_out(out: str, label: str = "--out") -> None:
    """Refuse an ``out`` that is a file or a folder of something else; ``label`` names it as the
    command does (``--out`` for a build, ``OUT`` for a merge)."""
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ValueError(f"{label} {out} exists and is not a folder")
        if os.listdir(out) and not os.path.isfile(os.path.join(out, MANIFEST)):
            raise ValueError(f"{label} {out} is a non-empty folder that is not a tokenbal index; "
                             "refusing to replace it")


def _replace_dir(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` folder to ``out``; an existing index there is replaced.

    Files in ``out`` that tokenbal did not write (a user's notes) are moved into the new folder
    first. A rename cannot replace a non-empty folder, so the old one is renamed aside to its
    version folder (``store.version_path``); readers see either the old or the new complete index,
    never a mix (at worst, briefly, no folder), and a reader that holds the old version keeps it:
    it is deleted only once no process holds it (here, or by a later build).
    """
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    for name in os.listdir(out):
        theirs = name not in OWNED_FILES and not name.endswith(".npy.raw")
        if theirs and not os.path.exists(os.path.join(tmp, name)):
            os.rename(os.path.join(out, name), os.path.join(tmp, name))
    try:
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
            build_id = json.load(f).get("build_id")
    except (OSError, ValueError):
        build_id = None
    old = version_path(out, build_id or uuid.uuid4().hex)
    if os.path.exists(old):
        _remove_owned(old)
    os.rename(out, old)
    os.rename(tmp, out)
    if not version_in_use(old):
        _remove_owned(old)


def _swap_in(tmp: str, dest: str) -> None:
    """Replace the tokenbal-internal folder ``dest`` (a partial index) with ``tmp``."""
    if os.path.exists(dest):
        shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
