"""``build_index``: scan shards (in parallel), count tokens, write the index folder atomically."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tokenbal.index.scan import ShardScan, scan_shard
from tokenbal.index.sources import expand_sources
from tokenbal.index.store import COLUMNS, ERRORS, FORMAT_VERSION, KEYS_BLOB, MANIFEST


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

    def summary(self) -> str:
        good = self.num_shards - self.num_bad_shards
        line = (f"indexed {self.num_samples} samples ({self.total_tokens:,} tokens, {self.num_images} "
                f"images) from {good}/{self.num_shards} shards in {self.seconds:.1f}s into {self.out}; "
                f"{self.num_errors} errors")
        if self.num_errors:
            n_shard = self.num_bad_shards
            line += (f" ({self.num_errors - n_shard} bad samples, {n_shard} bad shards), "
                     f"listed in {os.path.join(self.out, ERRORS)}")
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


def build_index(sources: Sequence[str] | str, out: str | os.PathLike, model: str = "qwen2-vl",
                workers: int = 1, tokenizer: str | None = None, image_root: str | None = None,
                estimator_overrides: dict | None = None, progress: bool = True) -> BuildReport:
    """Index the webdataset tar shards named by ``sources`` into the folder ``out``.

    ``sources``: paths, globs, brace patterns (``data-{000..099}.tar``); a missing one raises
    ``FileNotFoundError``. ``model`` / ``estimator_overrides`` pick the vision estimator
    (``tokenbal.estimate.get_estimator``); ``tokenizer`` a ``tokenizer.json`` (or its folder) for exact
    text counts, else the heuristic counter. ``workers`` > 1 scans shards in that many processes.
    An existing index at ``out`` is replaced; any other non-empty folder there is refused.
    Bad samples and shards never stop the build: they are listed in ``errors.jsonl`` and counted in
    the returned report.
    """
    from tokenbal.estimate import get_estimator, get_text_counter

    t0 = time.perf_counter()
    if image_root is not None:
        raise ValueError("--image-root applies to JSON/JSONL annotation sources, which are not supported "
                         "yet; tar shards carry their images")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    paths = expand_sources(sources)
    overrides = dict(estimator_overrides or {})
    # Built here as well as in the workers: a bad model name or option fails before any scanning.
    try:
        est = get_estimator(model, **overrides)
    except TypeError as e:   # an unknown --estimator-option: a usage error, reported as such
        raise ValueError(f"estimator {model!r}: {e}") from e
    counter = get_text_counter(tokenizer)
    out = os.path.abspath(os.fspath(out))
    _check_out(out)

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    writer = None
    try:
        writer = _IndexWriter(tmp)
        results = _shard_results(paths, workers, est, counter, model, overrides, tokenizer)
        # closing(): on an error the worker pool shuts down now, not when the traceback is freed.
        with contextlib.closing(_progress(results, len(paths), progress)) as stream:
            for result in stream:
                writer.add(result)
        writer.finish({
            "estimator": {"name": est.name, "model": model, "overrides": overrides,
                          "config": est.config, "wrapper_tokens": int(est.wrapper_tokens)},
            "text_counter": {"name": counter.name, "tokenizer": tokenizer},
            "image_sizes": "from headers, as stored: EXIF orientation ignored",
            "sources": list(sources) if not isinstance(sources, str) else [sources],
        })
        _replace_dir(tmp, out)
    except BaseException:
        if writer is not None:
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildReport(out=out, num_shards=len(paths), num_bad_shards=writer.num_bad_shards,
                       num_samples=writer.num_samples, num_errors=writer.num_errors,
                       num_images=writer.num_images, total_tokens=writer.total_tokens,
                       seconds=time.perf_counter() - t0)


def index_shard(path: str, est: VisionEstimator, counter: TextCounter) -> ShardResult:
    """Scan one shard and count its tokens with ``est`` (vision) and ``counter`` (text)."""
    return _count_tokens(scan_shard(path), est, counter)


def _count_tokens(scan: ShardScan, est: VisionEstimator, counter: TextCounter) -> ShardResult:
    from tokenbal.estimate import image_tokens_checked

    samples = scan.samples
    errors = list(scan.errors)
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
    if len(wh):
        per_image = np.asarray(per_image, dtype=np.int64) + int(est.wrapper_tokens)
        np.add.at(vision, np.repeat(np.arange(n), image_counts), per_image)
    text = np.zeros(n, np.int64)
    nonempty = [i for i, s in enumerate(samples) if s.text]
    if nonempty:
        text[nonempty] = np.asarray(counter.count_batch([samples[i].text for i in nonempty]), np.int64)
    entry = {"path": scan.path, "size": scan.size, "mtime_ns": scan.mtime_ns,
             "fingerprint": scan.fingerprint, "status": scan.status, "reason": scan.reason,
             "n_members": scan.n_members, "n_samples": n, "n_errors": len(errors),
             "end_of_members": scan.end_of_members, "n_full_reads": scan.n_full_reads}
    return ShardResult(
        entry=entry, keys=[s.key for s in samples],
        member_counts=np.fromiter((len(s.members) for s in samples), np.int64, count=n),
        member_exts=[m[0] for s in samples for m in s.members],
        member_offsets=np.array([m[1] for s in samples for m in s.members], np.int64),
        member_sizes=np.array([m[2] for s in samples for m in s.members], np.int64),
        image_counts=image_counts, image_wh=wh, vision=vision, text=text, errors=errors)


# --- parallel scan ------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(model: str, overrides: dict, tokenizer: str | None) -> None:
    from tokenbal.estimate import get_estimator, get_text_counter

    _WORKER["est"] = get_estimator(model, **overrides)
    _WORKER["counter"] = get_text_counter(tokenizer)


def _worker_index_shard(path: str) -> ShardResult:
    return index_shard(path, _WORKER["est"], _WORKER["counter"])


def _shard_results(paths: list[str], workers: int, est: VisionEstimator, counter: TextCounter,
                   model: str, overrides: dict, tokenizer: str | None) -> Iterator[ShardResult]:
    if workers == 1 or len(paths) == 1:
        for p in paths:
            yield index_shard(p, est, counter)
        return
    # spawn, not fork: the parent may hold tokenizer / torch threads that a fork would copy mid-state.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(paths)), initializer=_init_worker,
                  initargs=(model, overrides, tokenizer)) as pool:
        # imap keeps shard order, so the index is identical whatever the number of workers.
        yield from pool.imap(_worker_index_shard, paths, chunksize=1)


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
        self.cols = {name: _Column(folder, name, dt, tail) for name, (dt, tail) in COLUMNS.items()}
        self.keys_f = open(os.path.join(folder, KEYS_BLOB), "wb")
        self.errors_f = open(os.path.join(folder, ERRORS), "w", encoding="utf-8")
        self.shards: list[dict] = []
        self.ext_ids: dict[str, int] = {}
        self.key_bytes = self.num_members = self.num_images = 0
        self.num_samples = self.num_errors = self.num_bad_shards = self.total_tokens = 0
        # CSR tables start with a 0 so that sample i spans [start[i], start[i + 1]).
        for name in ("key_offsets", "member_start", "image_start"):
            self.cols[name].append([0])

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
        c["image_start"].append(self.num_images + np.cumsum(r.image_counts, dtype=np.int64))
        c["image_size"].append(r.image_wh)
        for e in r.errors:
            self.errors_f.write(json.dumps(e, ensure_ascii=False) + "\n")
        self.num_samples += n
        self.num_members += len(r.member_exts)
        self.num_images += len(r.image_wh)
        self.num_errors += len(r.errors)
        self.num_bad_shards += r.entry["status"] != "ok"
        self.total_tokens += int(lengths.sum())

    def close(self) -> None:
        """Close the open files (after an error; ``finish`` closes them on success)."""
        for f in (*(c.f for c in self.cols.values()), self.keys_f, self.errors_f):
            f.close()

    def finish(self, meta: dict) -> None:
        for col in self.cols.values():
            col.finish()
        self.keys_f.close()
        self.errors_f.close()
        from tokenbal import __version__

        manifest = {
            "format_version": FORMAT_VERSION,
            "tokenbal_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
            "num_samples": self.num_samples, "num_members": self.num_members,
            "num_images": self.num_images, "num_errors": self.num_errors,
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
