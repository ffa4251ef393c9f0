"""``build_index``: scan shards (in parallel), count tokens, write the index folder atomically;
reuse the unchanged shards of an earlier build of the same folder."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tokenbal.index.annotations import is_annotation_file, scan_annotations
from tokenbal.index.merge import part_meta, select_part
from tokenbal.index.parquet import ParquetOptions, is_parquet, scan_parquet
from tokenbal.index.remote import RemoteOptions, is_url, remote_unchanged, scan_remote_shard, threaded_map
from tokenbal.index.scan import ShardScan, scan_shard, shard_fingerprint
from tokenbal.index.sources import expand_sources
from tokenbal.index.store import COLUMNS, ERRORS, FORMAT_VERSION, KEYS_BLOB, MANIFEST, PATHS_BLOB, TokenIndex
from tokenbal.index.videoindex import VIDEO_COLUMNS


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


def build_index(sources: Sequence[str] | str, out: str | os.PathLike, model: str = "qwen2-vl",
                workers: int = 1, tokenizer: str | None = None, image_root: str | None = None,
                estimator_overrides: dict | None = None, progress: bool = True,
                incremental: bool = True, remote: RemoteOptions | None = None,
                parquet: ParquetOptions | None = None, part: tuple[int, int] | None = None) -> BuildReport:
    """Index the webdataset tar shards and JSON/JSONL annotation files named by ``sources`` into ``out``.

    ``sources``: paths, globs, brace patterns (``data-{000..099}.tar``); a missing one raises
    ``FileNotFoundError``. ``.json`` / ``.jsonl`` files are annotation files whose image paths are
    relative to ``image_root`` (``tokenbal.index.annotations``). ``model`` / ``estimator_overrides``
    pick the vision estimator (``tokenbal.estimate.get_estimator``); ``tokenizer`` a
    ``tokenizer.json`` (or its folder) for exact text counts, else the heuristic counter.
    ``workers`` > 1 scans shards in that many processes.

    Re-running over an existing index (``incremental=True``): when it was built with the same token
    rules, every listed shard whose size and fingerprint are unchanged is copied from it without a
    rescan, in its old position; changed shards are rescanned in place; shards new to the index are
    appended after the old ones (so the rows of unchanged samples keep their numbers); shards no
    longer listed are dropped. Different rules, or ``incremental=False``, rescan everything. The
    new index replaces the old one atomically; any other non-empty folder at ``out`` is refused.
    Resume: when a build is interrupted (Ctrl-C, a crash in a worker, a full disk), the shards it
    finished are kept as an index in ``.<out>.partial`` next to ``out``; the next build of ``out``
    (same rules) copies them from there instead of rescanning, then deletes it.
    Bad samples and shards never stop the build: they are listed in ``errors.jsonl`` and counted in
    the returned report.

    Sources may be URLs (``s3://``, ``https://``, any fsspec protocol; ``remote`` says how they are
    read, ``tokenbal.index.remote``) and ``.parquet`` files (``parquet`` names the columns,
    ``tokenbal.index.parquet``). ``part=(i, n)`` indexes only part ``i`` of ``n`` of the shards
    (``tokenbal.index.merge``), for builds spread over machines.
    """
    from tokenbal.estimate import get_estimator, get_text_counter
    from tokenbal.estimate.video import video_pipeline

    t0 = time.perf_counter()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    paths = expand_sources(sources, remote)
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
    try:
        est = get_estimator(model, **overrides)
    except TypeError as e:   # an unknown --estimator-option: a usage error, reported as such
        raise ValueError(f"estimator {model!r}: {e}") from e
    counter = get_text_counter(tokenizer)
    out = os.path.abspath(os.fspath(out))
    _check_out(out)
    meta = {
        "estimator": {"name": est.name, "model": model, "overrides": overrides,
                      "config": est.config, "wrapper_tokens": int(est.wrapper_tokens)},
        "text_counter": {"name": counter.name, "tokenizer": tokenizer},
        "image_sizes": "from headers, as stored: EXIF orientation ignored",
        "image_root": os.path.abspath(image_root) if image_root is not None else None,
        "video_pipeline": video_pipeline(est),
        "sources": list(sources) if not isinstance(sources, str) else [sources],
    }
    if any(is_parquet(p) for p in paths):
        meta["parquet"] = (parquet or ParquetOptions()).as_meta()
    if part is not None:
        meta["part"] = part_meta(part, positions, paths)
    # An interrupted build's finished shards first, then the last complete index.
    olds = [] if not incremental else [
        idx for idx in (_reusable_index(partial_path(out), meta), _reusable_index(out, meta)) if idx]
    jobs = _plan_jobs(paths, olds, remote)
    scan_paths = [p for p, src in jobs if src is None]
    scanned = _shard_results(scan_paths, workers, est, counter, model, overrides, tokenizer, image_root,
                             remote, parquet)

    def results() -> Iterator[ShardResult]:
        for p, src in jobs:
            yield next(scanned) if src is None else _result_from_index(src, p)

    # closing(): on an error the worker pool shuts down now, not when the traceback is freed.
    with contextlib.closing(_progress(results(), len(jobs), progress)) as stream:
        totals = write_index(out, stream, meta)
    return BuildReport(out=out, num_shards=len(jobs), num_bad_shards=totals.num_bad_shards,
                       num_samples=totals.num_samples, num_errors=totals.num_errors,
                       num_images=totals.num_images, total_tokens=totals.total_tokens,
                       seconds=time.perf_counter() - t0, num_reused=len(jobs) - len(scan_paths))


def write_index(out: str | os.PathLike, results: Iterable[ShardResult], meta: dict) -> _IndexWriter:
    """Write ``results`` (in order) as the index folder ``out``, atomically; ``meta`` goes into the
    manifest (estimator, text_counter, ...). Returns the writer, whose counters give the totals.

    This is the write half of ``build_index``; it also lets tests and benchmarks make a large index
    from synthetic columns without scanning shards.
    """
    out = os.path.abspath(os.fspath(out))
    _check_out(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    writer = None
    partial = partial_path(out)
    try:
        writer = _IndexWriter(tmp)
        for result in results:
            writer.add(result)
        writer.finish(meta)
        _replace_dir(tmp, out)
    except BaseException:
        if writer is not None:
            _save_partial(writer, meta, partial)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(partial, ignore_errors=True)   # its shards are all in ``out`` now
    return writer


def partial_path(out: str) -> str:
    """Where an interrupted build of ``out`` keeps the shards it finished (a complete index of them)."""
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial")


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
        _replace_dir(writer.folder, partial)
    except Exception:
        writer.close()


def index_shard(path: str, est: VisionEstimator, counter: TextCounter,
                image_root: str | None = None, remote: RemoteOptions | None = None,
                parquet: ParquetOptions | None = None) -> ShardResult:
    """Scan one shard (or annotation / Parquet file, local or remote) and count its tokens with
    ``est`` and ``counter``."""
    if is_parquet(path):
        scan = scan_parquet(path, parquet, remote)
    elif is_url(path):
        scan = scan_remote_shard(path, remote)
    else:
        scan = scan_annotations(path, image_root) if is_annotation_file(path) else scan_shard(path)
    return _count_tokens(scan, est, counter)


# --- incremental builds ---------------------------------------------------------------------------

def _rules(meta: dict) -> tuple:
    e = meta["estimator"]
    return (e["name"], json.dumps(e["config"], sort_keys=True, default=_jsonable), int(e["wrapper_tokens"]),
            meta["text_counter"]["name"], meta.get("image_root"), json.dumps(meta.get("parquet")),
            meta.get("video_pipeline"))


def _reusable_index(out: str, meta: dict) -> TokenIndex | None:
    """The index at ``out`` if it exists and was built with the same token rules, else ``None``."""
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        return None
    try:
        old = TokenIndex.open(out)
        same = _rules(old.manifest) == _rules(json.loads(json.dumps(meta, default=_jsonable)))
    except (ValueError, KeyError, OSError):   # another format version, a damaged index: rebuild
        return None
    return old if same else None


def _plan_jobs(paths: list[str], olds: list[TokenIndex],
               remote: RemoteOptions | None = None) -> list[tuple[str, TokenIndex | None]]:
    """(path, index to copy it from, or None to scan it) per shard, in index order: the old indexes'
    shards first, in their order, then the new ones in source order."""
    wanted = set(paths)
    jobs: list[tuple[str, TokenIndex | None]] = []
    for old in olds:
        for entry in old.manifest["shards"]:
            p = entry["path"]
            if p not in wanted:
                continue
            wanted.discard(p)
            jobs.append((p, old if _unchanged(entry, remote) else None))
    jobs.extend((p, None) for p in paths if p in wanted)
    return jobs


def _unchanged(entry: dict, remote: RemoteOptions | None = None) -> bool:
    if entry.get("fingerprint") is None:
        return False     # missing / unreadable at the last build: look again
    if is_url(entry["path"]):
        return remote_unchanged(entry, remote or RemoteOptions())
    try:
        size = os.stat(entry["path"]).st_size
        return size == entry["size"] and shard_fingerprint(entry["path"], size) == entry["fingerprint"]
    except OSError:
        return False


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
        member_paths=paths if any(paths) else None)


def _wrapper_tokens(est: VisionEstimator, wh: np.ndarray) -> np.ndarray | int:
    """Special tokens around each image: a constant for most families, but Idefics3 / SmolVLM add
    row and tile markers that depend on how the image is split."""
    per_size = getattr(est, "image_wrapper_tokens_batch", None)
    if per_size is not None:
        return np.asarray(per_size(wh[:, 0], wh[:, 1]), dtype=np.int64)
    return int(est.wrapper_tokens)


def _count_tokens(scan: ShardScan, est: VisionEstimator, counter: TextCounter) -> ShardResult:
    from tokenbal.estimate import image_tokens_checked
    from tokenbal.index.videoindex import plan_sample_videos, video_arrays

    errors = list(scan.errors)
    samples = plan_sample_videos(scan.samples, est, counter, scan.path, errors)
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
    nonempty = [i for i, s in enumerate(samples) if s.text]
    if nonempty:
        text[nonempty] = np.asarray(counter.count_batch([samples[i].text for i in nonempty]), np.int64)
    entry = {"path": scan.path, "size": scan.size, "mtime_ns": scan.mtime_ns,
             "fingerprint": scan.fingerprint, "status": scan.status, "reason": scan.reason,
             "n_members": scan.n_members, "n_samples": n, "n_errors": len(errors),
             "end_of_members": scan.end_of_members, "n_full_reads": scan.n_full_reads, **scan.extra}
    paths = None
    if any(s.paths for s in samples):
        paths = [p for s in samples for p in (s.paths or [""] * len(s.members))]
    return ShardResult(
        **video, entry=entry, keys=[s.key for s in samples], member_paths=paths,
        member_counts=np.fromiter((len(s.members) for s in samples), np.int64, count=n),
        member_exts=[m[0] for s in samples for m in s.members],
        member_offsets=np.array([m[1] for s in samples for m in s.members], np.int64),
        member_sizes=np.array([m[2] for s in samples for m in s.members], np.int64),
        image_counts=image_counts, image_wh=wh, vision=vision, text=text, errors=errors)


# --- parallel scan ------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(model: str, overrides: dict, tokenizer: str | None, image_root: str | None,
                 remote: RemoteOptions | None = None, parquet: ParquetOptions | None = None) -> None:
    from tokenbal.estimate import get_estimator, get_text_counter

    _WORKER["est"] = get_estimator(model, **overrides)
    _WORKER["counter"] = get_text_counter(tokenizer)
    _WORKER["image_root"] = image_root
    _WORKER["remote"], _WORKER["parquet"] = remote, parquet


def _worker_index_shard(path: str) -> ShardResult:
    return index_shard(path, _WORKER["est"], _WORKER["counter"], _WORKER["image_root"],
                       _WORKER["remote"], _WORKER["parquet"])


def _worker_index_shards(paths: list[str]) -> list[ShardResult]:
    # Remote shards: several at once per worker process, so requests stay in flight.
    inflight = (_WORKER["remote"] or RemoteOptions()).inflight
    return list(threaded_map(_worker_index_shard, paths, inflight))


def _shard_results(paths: list[str], workers: int, est: VisionEstimator, counter: TextCounter,
                   model: str, overrides: dict, tokenizer: str | None,
                   image_root: str | None, remote: RemoteOptions | None = None,
                   parquet: ParquetOptions | None = None) -> Iterator[ShardResult]:
    inflight = (remote or RemoteOptions()).inflight if any(is_url(p) for p in paths) else 1
    if workers == 1 or len(paths) <= 1:
        yield from threaded_map(lambda p: index_shard(p, est, counter, image_root, remote, parquet),
                                paths, inflight)
        return
    # spawn, not fork: the parent may hold tokenizer / torch threads that a fork would copy mid-state.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(paths)), initializer=_init_worker,
                  initargs=(model, overrides, tokenizer, image_root, remote, parquet)) as pool:
        # imap keeps shard order, so the index is identical whatever the number of workers.
        if inflight <= 1:
            yield from pool.imap(_worker_index_shard, paths, chunksize=1)
            return
        groups = [paths[k:k + inflight] for k in range(0, len(paths), inflight)]
        for group in pool.imap(_worker_index_shards, groups, chunksize=1):
            yield from group


def _progress(results: Iterator[ShardResult], total: int, enabled: bool) -> Iterator[ShardResult]:
    if not enabled:
        yield from results
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="shard", desc="indexing") as bar:
        samples = errors = 0
        for r in results:
            samples += r.entry["n_samples"]
            errors += len(r.errors)
            bar.set_postfix(samples=samples, errors=errors, refresh=False)
            bar.update(1)
            yield r


# --- writing ------------------------------------------------------------------------------------

class _Column:
    """Append-only ``.npy`` column: raw bytes while building, a proper ``.npy`` at the end, so the
    builder never holds the whole dataset's columns in memory."""

    def __init__(self, folder: str, name: str, dtype, tail: tuple[int, ...]) -> None:
        self.path = os.path.join(folder, f"{name}.npy")
        self.raw_path = self.path + ".raw"
        self.dtype, self.tail, self.rows = np.dtype(dtype), tail, 0
        self.row_bytes = self.dtype.itemsize * int(np.prod(tail, dtype=np.int64))
        self.f = open(self.raw_path, "wb")

    def append(self, values) -> None:
        arr = np.ascontiguousarray(values, dtype=self.dtype).reshape((-1, *self.tail))
        arr.tofile(self.f)
        self.rows += len(arr)

    def finish(self) -> None:
        self.f.close()
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, *self.tail)}
        with open(self.path, "wb") as f, open(self.raw_path, "rb") as raw:
            np.lib.format.write_array_header_1_0(f, header)
            shutil.copyfileobj(raw, f, 1 << 22)
        os.remove(self.raw_path)


class _IndexWriter:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.cols = {name: _Column(folder, name, dt, tail)
                     for name, (dt, tail) in {**COLUMNS, **VIDEO_COLUMNS}.items()}
        self.keys_f = open(os.path.join(folder, KEYS_BLOB), "wb")
        self.paths_f = open(os.path.join(folder, PATHS_BLOB), "wb")
        self.path_bytes = 0
        self.errors_f = open(os.path.join(folder, ERRORS), "wb")
        self.shards: list[dict] = []
        self.ext_ids: dict[str, int] = {}
        self.key_bytes = self.num_members = self.num_images = 0
        self.num_samples = self.num_errors = self.num_bad_shards = self.total_tokens = 0
        # CSR tables start with a 0 so that sample i spans [start[i], start[i + 1]).
        self.num_videos = 0
        for name in ("key_offsets", "member_start", "image_start", "member_path_offsets", "video_start"):
            self.cols[name].append([0])
        self._checkpoint = self._state()

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
        self.keys_f.write(b"".join(encoded))
        c["key_offsets"].append(self.key_bytes + np.cumsum([len(k) for k in encoded], dtype=np.int64))
        self.key_bytes += sum(len(k) for k in encoded)
        c["member_start"].append(self.num_members + np.cumsum(r.member_counts, dtype=np.int64))
        c["member_ext"].append([self.ext_ids.setdefault(e, len(self.ext_ids)) for e in r.member_exts])
        c["member_offset"].append(r.member_offsets)
        c["member_size"].append(r.member_sizes)
        if r.member_paths is None:   # tar members: empty ranges
            c["member_path_offsets"].append(np.full(len(r.member_exts), self.path_bytes, np.int64))
        else:
            blobs = [p.encode("utf-8", "surrogateescape") for p in r.member_paths]
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
        self.keys_f.close()
        self.paths_f.close()
        self.errors_f.close()
        from tokenbal import __version__

        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenbal_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
            "num_samples": self.num_samples, "num_members": self.num_members,
            "num_images": self.num_images, "num_videos": self.num_videos, "num_errors": self.num_errors,
            "total_tokens": self.total_tokens,
            "extensions": list(self.ext_ids),
            "shards": self.shards,
        }
        # Written last, so a folder with a manifest is a complete index.
        with open(os.path.join(self.folder, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, default=_jsonable, ensure_ascii=False)
            f.write("\n")


def _jsonable(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)   # e.g. a Path in an estimator config: keep it readable rather than fail


def _check_out(out: str) -> None:
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ValueError(f"--out {out} exists and is not a folder")
        if os.listdir(out) and not os.path.isfile(os.path.join(out, MANIFEST)):
            raise ValueError(f"--out {out} is a non-empty folder that is not a tokenbal index; "
                             "refusing to replace it")


def _replace_dir(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` folder to ``out``; an existing index there is replaced.

    A rename cannot replace a non-empty folder, so the old one is first renamed aside; readers see
    either the old or the new complete index, never a mix (at worst, briefly, no folder).
    """
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    os.rmdir(old)
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
