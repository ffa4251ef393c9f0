"""The on-disk token index: its layout, ``TokenIndex`` (read side), ``verify_index``, ``index_stats``.

One folder, written atomically by ``build_index`` (built in a temporary sibling folder, then renamed):

* ``manifest.json`` — format version, estimator name + config, text counter name, counts, the list of
  member extensions, and one entry per shard: path (absolute), size, mtime_ns, fingerprint (see
  ``scan.shard_fingerprint``), status (ok | empty | corrupt | truncated | missing | unreadable),
  reason, n_members, n_samples, n_errors.
* Per sample (N rows), memory-mapped ``.npy``: ``lengths`` (int64, vision + text tokens),
  ``vision_tokens``, ``text_tokens`` (int64), ``shard_id`` (int32, row of the manifest shard list),
  ``key_offsets`` (int64, N+1: byte ranges of the keys in ``keys.bin``, UTF-8),
  ``member_start`` / ``image_start`` (int64, N+1: each sample's rows in the member / image tables).
* Member table (one row per tar member of an indexed sample, in tar order): ``member_ext`` (int32,
  index into the manifest's ``extensions``; the member name is ``key + "." + ext``),
  ``member_offset`` (int64, payload offset in the shard), ``member_size`` (int64).
* ``member_path_offsets`` (int64, one more row than the member table): byte ranges in
  ``member_paths.bin`` (UTF-8). Empty for a tar member; for a sample from a JSON/JSONL annotation
  file it is the image path as written in the record, a NUL, and the file's absolute path; that
  member's offset is 0 and its size the file size (``members(i)`` then names the file itself as
  the member's ``shard``).
* ``member_chksum`` / ``member_mtime`` (int64, one row per member; optional, absent in indexes from
  older tokenbal): the checksum and mtime fields of the member's own ustar header (-1 for a file
  named by an annotation record; its ``member_mtime`` is the file's mtime in ns). ``verify`` and the
  reader compare them to catch a member rewritten at the same size.
* Image table: ``image_size`` (int32, shape (M, 2): width, height after the manifest's ``exif``
  policy — ``"transpose"``: as ``PIL.ImageOps.exif_transpose`` / transformers' ``load_image`` give
  them; ``"ignore"`` or absent: as stored).
* ``errors.jsonl`` — one JSON object per sample or shard that was not indexed: shard, key (null for
  a shard-level error), reason.

Versions: every build writes a ``build_id`` into the manifest. A rebuild renames the folder it
replaces to ``.<name>.v-<build_id>`` beside it and deletes it only once no reader holds it: an open
``TokenIndex`` holds a shared ``flock`` on its manifest, and one pickled to another process (a
spawn-started DataLoader worker) reopens the version it was opened as, from that folder if the index
was rebuilt in between. So a job never mixes two versions of an index.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import operator
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tokenbal.index.scan import shard_fingerprint

FORMAT_VERSION = 2   # 2: member_path_offsets / member_paths.bin (annotation sources)
MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"
KEYS_BLOB = "keys.bin"
PATHS_BLOB = "member_paths.bin"
# name -> (dtype, trailing shape); all live in "<name>.npy".
COLUMNS: dict[str, tuple[type, tuple[int, ...]]] = {
    "lengths": (np.int64, ()),
    "vision_tokens": (np.int64, ()),
    "text_tokens": (np.int64, ()),
    "shard_id": (np.int32, ()),
    "key_offsets": (np.int64, ()),
    "member_start": (np.int64, ()),
    "member_ext": (np.int32, ()),
    "member_offset": (np.int64, ()),
    "member_size": (np.int64, ()),
    "member_path_offsets": (np.int64, ()),
    "image_start": (np.int64, ()),
    "image_size": (np.int32, (2,)),
}
# Optional columns: read when present (indexes from older tokenbal lack them).
OPTIONAL_COLUMNS: dict[str, tuple[type, tuple[int, ...]]] = {
    "member_chksum": (np.int64, ()),
    "member_mtime": (np.int64, ()),
}
INDEX_FILES = (MANIFEST, ERRORS, KEYS_BLOB, PATHS_BLOB, *(f"{c}.npy" for c in COLUMNS))
# Every name tokenbal writes inside an index folder; nothing else there is ever deleted.
OWNED_FILES = frozenset((*INDEX_FILES, *(f"{c}.npy" for c in OPTIONAL_COLUMNS), "progress.json",
                         "progress.json.tmp",
                         # tokenbal.index.videoindex.VIDEO_COLUMNS (not imported here: it imports video)
                         "video_start.npy", "video_info.npy", "video_params.npy"))


class IndexDamagedError(ValueError):
    """An index file is unreadable or inconsistent (cut short, not JSON, wrong shape); names the file."""


def version_path(path: str, build_id: str) -> str:
    """Where a replaced version of the index at ``path`` is kept while readers hold it."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.v-{build_id}")


def _load_column(file: str, dtype, tail: tuple[int, ...]) -> np.ndarray:
    try:
        arr = np.load(file, mmap_mode="r")
    except FileNotFoundError:
        raise IndexDamagedError(f"index file missing: {file} (rebuild the index)") from None
    except Exception as e:  # noqa: BLE001 - a cut or flipped header or body: numpy's words, no file name
        # (ValueError, OSError, EOFError; a flipped bit in the header dict even tokenize.TokenError)
        raise IndexDamagedError(f"index file {file} is damaged ({type(e).__name__}: {e}); rebuild the "
                                "index") from None
    if arr.dtype != dtype or arr.shape[1:] != tail:
        raise IndexDamagedError(f"index file {file} has dtype {arr.dtype} shape {arr.shape}, "
                                f"expected {np.dtype(dtype)} (*, {', '.join(map(str, tail))})")
    return arr


@dataclass(frozen=True)
class Member:
    """One tar member of a sample: full member name, absolute shard path, payload byte range."""
    name: str
    shard: str
    offset: int
    size: int


class KeyList(Sequence):
    """Strings decoded on access from a memory-mapped blob (no N Python strings): the sample keys."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray, file: str = KEYS_BLOB) -> None:
        self._blob, self._off, self._file = blob, offsets, file

    def __len__(self) -> int:
        return len(self._off) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = _check_row(i, len(self))
        try:
            return self._blob[self._off[i]:self._off[i + 1]].tobytes().decode("utf-8")
        except UnicodeDecodeError as e:   # a flipped bit: named, not a bare codec error
            raise IndexDamagedError(f"index file {self._file} is damaged: row {i} is not UTF-8 ({e.reason} "
                                    f"at byte {int(self._off[i]) + e.start}); rebuild the index") from None

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"KeyList({len(self)} keys)"


class TokenIndex:
    """Read side of an index folder; arrays are memory-mapped, so opening costs milliseconds.

    ``lengths`` / ``vision_tokens`` / ``text_tokens`` / ``shard_ids`` hold one value per indexed
    sample (``np.memmap``: nothing is read until used), ``keys`` the sample keys (decoded on access),
    ``errors`` every sample or shard that was not indexed (read on first access). Opening reads the
    manifest and the ``.npy`` headers only, so it takes the same few milliseconds at 10M samples.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        # Held while this object lives: a rebuild keeps this version on disk until it is released.
        hold = _hold_version(self.path)
        self._release = weakref.finalize(self, os.close, hold) if hold is not None else None
        self.manifest: dict = read_manifest(self.path)
        self.build_id: str | None = self.manifest.get("build_id")
        cols = {}
        for name, (dtype, tail) in COLUMNS.items():
            cols[name] = _load_column(os.path.join(self.path, f"{name}.npy"), dtype, tail)
        for name, (dtype, tail) in OPTIONAL_COLUMNS.items():
            if os.path.exists(os.path.join(self.path, f"{name}.npy")):
                cols[name] = _load_column(os.path.join(self.path, f"{name}.npy"), dtype, tail)
        try:
            n = int(self.manifest["num_samples"])
            n_members = int(cols["member_start"][-1]) if len(cols["member_start"]) else -1
            n_images = int(cols["image_start"][-1]) if len(cols["image_start"]) else -1
        except (KeyError, TypeError, ValueError) as e:
            raise IndexDamagedError(f"index {self.path} is damaged ({MANIFEST} or member_start.npy: "
                                    f"{type(e).__name__}: {e}); rebuild it") from None
        checks = [("lengths", n), ("vision_tokens", n), ("text_tokens", n), ("shard_id", n),
                  ("key_offsets", n + 1), ("member_start", n + 1), ("image_start", n + 1),
                  ("member_ext", n_members), ("member_offset", n_members),
                  ("member_size", n_members), ("member_path_offsets", n_members + 1),
                  ("image_size", n_images)]
        checks += [(name, n_members) for name in OPTIONAL_COLUMNS if name in cols]
        for name, want in checks:
            if len(cols[name]) != want:
                raise IndexDamagedError(f"index {self.path} is inconsistent: {name}.npy has "
                                        f"{len(cols[name])} "
                                        f"rows, expected {want} (rebuild it)")
        for blob, offsets in ((KEYS_BLOB, "key_offsets"), (PATHS_BLOB, "member_path_offsets")):
            file = os.path.join(self.path, blob)
            have = os.path.getsize(file) if os.path.exists(file) else -1
            if have < int(cols[offsets][-1]):
                raise IndexDamagedError(f"index file {file} is damaged: {have} bytes, {offsets}.npy needs "
                                        f"{int(cols[offsets][-1])} (rebuild the index)")
        # Public columns stay np.memmap; lookups go through plain ndarray views of the same pages,
        # because indexing an np.memmap element by element costs ~10x more (subclass overhead).
        cols.update(_video_columns(self.path, n))
        self._cols = {name: np.asarray(arr) for name, arr in cols.items()}
        self.lengths: np.ndarray = cols["lengths"]
        self.vision_tokens: np.ndarray = cols["vision_tokens"]
        self.text_tokens: np.ndarray = cols["text_tokens"]
        self.shard_ids: np.ndarray = cols["shard_id"]
        self.shard_paths: list[str] = [s["path"] for s in self.manifest["shards"]]
        self._exts: list[str] = list(self.manifest["extensions"])

    def release(self) -> None:
        """Drop this object's hold on its index version (a rebuild may then delete it once replaced);
        the arrays stay readable in this process."""
        if self._release is not None:
            self._release()

    def __reduce__(self):
        # Pickled (to a spawn-started worker): reopen the same version, not whatever is at the path now.
        return (_reopen_pinned, (self.path, self.build_id))

    @classmethod
    def open(cls, path: str | os.PathLike, *, expect_model: str | None = None,
             expect_estimator=None, expect_text_counter=None) -> TokenIndex:
        """Open the index at ``path``; with an ``expect_*`` argument, also check that it was built
        with the same token rules (``check_index_rules``), so a stale index is an error, not silently
        wrong lengths."""
        idx = cls(os.fspath(path))
        if expect_model is not None or expect_estimator is not None or expect_text_counter is not None:
            check_index_rules(idx.manifest, model=expect_model, estimator=expect_estimator,
                              text_counter=expect_text_counter, where=idx.path)
        return idx

    def __len__(self) -> int:
        return len(self.lengths)

    def __repr__(self) -> str:
        return (f"TokenIndex({self.path!r}, {len(self)} samples, {len(self.shard_paths)} shards, "
                f"{self.manifest['num_errors']} errors)")

    @cached_property
    def keys(self) -> KeyList:
        file = os.path.join(self.path, KEYS_BLOB)
        return KeyList(np.asarray(_blob(file)), self._cols["key_offsets"], file)

    @cached_property
    def _member_paths(self) -> KeyList:
        file = os.path.join(self.path, PATHS_BLOB)
        return KeyList(np.asarray(_blob(file)), self._cols["member_path_offsets"], file)

    @cached_property
    def errors(self) -> list[dict]:
        file = os.path.join(self.path, ERRORS)
        out = []
        try:
            f = open(file, encoding="utf-8")
        except FileNotFoundError:
            # As a missing column reads (a bare "[Errno 2] ..." said nothing of the index).
            raise IndexDamagedError(f"index file missing: {file} (rebuild the index)") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise IndexDamagedError(f"index file {file} is damaged at line {lineno} ({e}); "
                                                "rebuild the index") from None
                    if not isinstance(entry, dict):   # every reader takes its shard / key / reason
                        raise IndexDamagedError(f"index file {file} is damaged at line {lineno}: it holds a "
                                                f"{type(entry).__name__}, not an object; rebuild the index")
                    out.append(entry)
        return out

    def _damaged(self, file: str, what: str) -> IndexDamagedError:
        return IndexDamagedError(f"index file {os.path.join(self.path, file)} is damaged: {what}; "
                                 "run `tokenbal index verify` and rebuild the index")

    def _shard_id(self, i: int) -> int:
        """Sample ``i``'s row in the manifest's shard list, checked (a damaged ``shard_id.npy`` is
        named, not a bare IndexError)."""
        sid = int(self._cols["shard_id"][i])
        if not 0 <= sid < len(self.shard_paths):
            raise self._damaged("shard_id.npy", f"sample {i} has shard id {sid}, the manifest lists "
                                                     f"{len(self.shard_paths)} shards")
        return sid

    def _span(self, name: str, i: int, total: int) -> tuple[int, int]:
        """Sample ``i``'s rows ``[a, b)`` in the table that CSR column ``name`` points into, checked."""
        col = self._cols[name]
        a, b = int(col[i]), int(col[i + 1])
        if not 0 <= a <= b <= total:
            raise self._damaged(f"{name}.npy", f"sample {i} spans rows {a}..{b} of a {total}-row table "
                                               "(the column must rise from 0 to the table's length)")
        return a, b

    def member_stamps(self, i: int) -> list[tuple[int, int]] | None:
        """(header checksum, mtime) of each member of sample ``i`` (see ``OPTIONAL_COLUMNS``), or
        ``None`` for an index built without them."""
        c = self._cols
        if "member_chksum" not in c:
            return None
        i = _check_row(i, len(self))
        a, b = self._span("member_start", i, len(c["member_ext"]))
        return list(zip(c["member_chksum"][a:b].tolist(), c["member_mtime"][a:b].tolist(), strict=True))

    def shard(self, i: int) -> str:
        """Absolute path of the shard (or annotation file) holding sample ``i``."""
        return self.shard_paths[self._shard_id(_check_row(i, len(self)))]

    def members(self, i: int) -> list[Member]:
        """Every member of sample ``i`` (images, text and others), in tar order.

        For a tar shard: the tar members (``shard`` = the tar, payload ``offset`` and ``size``). For
        a JSON/JSONL annotation record: its image files (``name`` = the path as written in the
        record, ``shard`` = the absolute file path, ``offset`` 0, ``size`` = the file size); the
        record's text lives in the annotation file (``shard(i)``), not in a member.
        """
        i = _check_row(i, len(self))
        c = self._cols
        a, b = self._span("member_start", i, len(c["member_ext"]))
        key, shard = self.keys[i], self.shard_paths[self._shard_id(i)]
        exts = self._exts
        poff = c["member_path_offsets"][a:b + 1].tolist()
        out = []
        for j, (e, o, size) in enumerate(zip(c["member_ext"][a:b].tolist(), c["member_offset"][a:b].tolist(),
                                             c["member_size"][a:b].tolist(), strict=True)):
            if poff[j + 1] > poff[j]:
                name, _, file = self._member_paths[a + j].partition("\0")
                out.append(Member(name, file, o, size))
            elif 0 <= e < len(exts):
                out.append(Member(f"{key}.{exts[e]}", shard, o, size))
            else:
                raise self._damaged("member_ext.npy", f"member {a + j} (of sample {i}) has extension id "
                                                      f"{e}, the manifest lists {len(exts)} extensions")
        return out

    @cached_property
    def image_tokens_table(self) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, tokens)``: every image's placeholder tokens (without wrapper tokens), recomputed
        from the stored sizes with the estimator the index was built with; sample ``i``'s images are
        ``tokens[offsets[i]:offsets[i + 1]]``. Cost models use it (the vision tower attends per image)."""
        from tokenbal.estimate import get_estimator

        built = self.manifest["estimator"]
        est = get_estimator(built["model"], **built.get("overrides", {}))
        wh = self._cols["image_size"]
        tokens = est.image_tokens_batch(wh[:, 0], wh[:, 1]) if len(wh) else np.zeros(0, np.int64)
        tokens = np.asarray(tokens, np.int64)
        offsets = self._cols["image_start"]
        if len(wh) and getattr(est, "family", None) == "llava-onevision":
            # As the index build counts them (and transformers' processor and model do): an image
            # that shares its sample with other images gets only its base view and newline.
            per_sample = np.diff(offsets)
            shared = np.repeat(per_sample, per_sample) > 1
            tokens = np.where(shared, est.image_tokens(1, 1, images_in_sample=2), tokens)
        return offsets, tokens

    @cached_property
    def video_frames(self) -> np.ndarray:
        """Frames each sample's videos feed the model (the family's sampling), per sample; zeros
        for samples without video (``tokenbal.index.videoindex`` has the per-video table)."""
        from tokenbal.index.videoindex import per_sample

        return per_sample(self, 5)

    @cached_property
    def video_tokens(self) -> np.ndarray:
        """Tokens of each sample's videos (placeholders, special and timestamp text), per sample;
        included in ``vision_tokens``."""
        from tokenbal.index.videoindex import per_sample

        return per_sample(self, 6)

    def image_sizes(self, i: int) -> list[tuple[int, int]]:
        """(width, height) of each image of sample ``i``, in member order."""
        i = _check_row(i, len(self))
        a, b = self._span("image_start", i, len(self._cols["image_size"]))
        return [(int(w), int(h)) for w, h in self._cols["image_size"][a:b]]


def _video_columns(path: str, n: int) -> dict:
    """The optional video table (``tokenbal.index.videoindex``); {} for an index without it."""
    from tokenbal.index.videoindex import VIDEO_COLUMNS

    if not os.path.isfile(os.path.join(path, "video_start.npy")):
        return {}
    cols = {name: _load_column(os.path.join(path, f"{name}.npy"), dtype, tail)
            for name, (dtype, tail) in VIDEO_COLUMNS.items()}
    v = int(cols["video_start"][-1]) if len(cols["video_start"]) else 0
    for name, want in (("video_start", n + 1), ("video_info", v), ("video_params", v)):
        if len(cols[name]) != want:
            raise IndexDamagedError(f"index {path} is inconsistent: {name}.npy has {len(cols[name])} rows, "
                                    f"expected {want} (rebuild it)")
    return cols


def _hold_version(path: str) -> int | None:
    """An open descriptor of ``path``'s manifest with a shared flock (None where locks fail)."""
    try:
        fd = os.open(os.path.join(path, MANIFEST), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None   # read_manifest words the error
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass          # a file system without flock: the version is then not protected
    return fd


def version_in_use(path: str) -> bool:
    """Whether some process holds the index version at ``path`` open (a shared flock on it)."""
    try:
        fd = os.open(os.path.join(path, MANIFEST), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)     # closing drops the probe's own lock


def _reopen_pinned(path: str, build_id: str | None) -> TokenIndex:
    idx = TokenIndex(path)
    if build_id is None or idx.build_id == build_id:
        return idx
    kept = version_path(path, build_id)
    if os.path.isfile(os.path.join(kept, MANIFEST)):
        old = TokenIndex(kept)
        if old.build_id == build_id:
            return old
    raise IndexDamagedError(f"index {path} was rebuilt (build {idx.build_id}) after this process's parent "
                            f"opened build {build_id}, and that version is gone; restart the job")


def _blob(file: str) -> np.ndarray:
    # np.memmap refuses empty files.
    return np.memmap(file, dtype=np.uint8, mode="r") if os.path.getsize(file) else np.zeros(0, np.uint8)


def _normal(obj):
    """JSON round trip: the manifest's view of a config (tuples -> lists, numpy scalars -> ints)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)))


def check_index_rules(manifest: dict, *, model: str | None = None, estimator=None, text_counter=None,
                      where: str = "index") -> None:
    """Raise ``ValueError`` unless the index was built with the caller's token rules.

    ``model``: an estimator name (``get_estimator(model)`` with its current defaults);
    ``estimator``: an estimator object (its ``name`` and ``config`` are compared);
    ``text_counter``: a text counter object or its ``name`` string (e.g. ``"heuristic:..."`` or the
    tokenizer id). Every difference is named, e.g. ``max_pixels: index 12845056, expected 1003520``.
    """
    problems = []
    built = manifest.get("estimator", {})
    if model is not None and estimator is None:
        from tokenbal.estimate import get_estimator

        estimator = get_estimator(model)
    if estimator is not None:
        if built.get("name") != estimator.name:
            problems.append(f"estimator: index {built.get('name')!r}, expected {estimator.name!r}")
        else:
            have, want = built.get("config", {}), _normal(estimator.config)
            for k in sorted(set(have) | set(want)):
                if have.get(k, "<absent>") != want.get(k, "<absent>"):
                    problems.append(f"{k}: index {have.get(k, '<absent>')!r}, expected "
                                    f"{want.get(k, '<absent>')!r}")
    if text_counter is not None:
        want = text_counter if isinstance(text_counter, str) else text_counter.name
        have = manifest.get("text_counter", {}).get("name")
        if have != want:
            problems.append(f"text counter: index {have!r}, expected {want!r}")
    if problems:
        raise ValueError(f"{where} was built with other token rules ({'; '.join(problems)}); rebuild it "
                         "with `tokenbal index build` and the same model / options / tokenizer")


def _check_row(i: int, n: int) -> int:
    i = operator.index(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"sample {i} out of range for an index of {n} samples")
    return i


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        if os.path.exists(path):
            # A shard or the manifest itself given for the folder: "not found" sent one looking for it.
            folder = os.path.dirname(os.path.abspath(path))
            inside = (f"; give its folder {folder}" if os.path.basename(path) == MANIFEST
                      else " (give the folder `tokenbal index build --out` wrote)")
            raise FileNotFoundError(f"{path} is a file, not an index folder{inside}")
        raise FileNotFoundError(f"index folder not found: {path}")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path} is not a tokenbal index (no {MANIFEST})")
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexDamagedError(f"index file {file} is damaged (not valid JSON: {e}); it was cut short or "
                                "overwritten: rebuild the index") from None
    if not isinstance(manifest, dict):
        raise IndexDamagedError(f"index file {file} is damaged: it holds a {type(manifest).__name__}, "
                                "not an object; rebuild the index")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"index {path} has format_version {version!r}; this tokenbal reads "
                         f"{FORMAT_VERSION} (rebuild the index)")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise IndexDamagedError(f"index file {file} is damaged: {problem}; rebuild the index")
    return manifest


# The manifest fields every reader indexes into, with their JSON types: a manifest that parses but
# lacks one (written by another tool, edited by hand) is named here, not a KeyError deep in a reader.
_MANIFEST_FIELDS = (("num_samples", int, "an integer"), ("num_errors", int, "an integer"),
                    ("extensions", list, "a list"), ("shards", list, "a list"),
                    ("estimator", dict, "an object"), ("text_counter", dict, "an object"))


def _manifest_problem(manifest: dict) -> str | None:
    def kind(value) -> str:
        name = type(value).__name__
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"

    for name, want, words in _MANIFEST_FIELDS:
        if name not in manifest:
            return f"no {name!r} field"
        value = manifest[name]
        if not isinstance(value, want) or isinstance(value, bool):
            return f"{name!r} is {kind(value)}, not {words}"
    for k, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict):
            return f"shards[{k}] is {kind(entry)}, not an object"
        if "path" not in entry:
            return f"shards[{k}] has no 'path'"
        if not isinstance(entry["path"], str):
            return f"shards[{k}].path is {kind(entry['path'])}, not a string"
        # stats counts the statuses (a missing or null one was a KeyError / TypeError traceback there)
        if not isinstance(entry.get("status"), str):
            return f"shards[{k}] has no 'status' string"
        failures = entry.get("n_read_failures")
        if failures is not None and (not isinstance(failures, int) or isinstance(failures, bool)):
            return f"shards[{k}].n_read_failures is {kind(failures)}, not an integer"
    for k, ext in enumerate(manifest["extensions"]):
        if not isinstance(ext, str):
            return f"extensions[{k}] is {kind(ext)}, not a string"
    for name in ("estimator", "text_counter"):
        if not isinstance(manifest[name].get("name"), str):
            return f"{name} has no 'name'"
    return None


def failed_shards(manifest: dict) -> list[str]:
    """``verify``'s lines for the shards the build could not read (missing, unreadable, a remote read
    out of retries: ``build.read_failed``), so their samples are absent from the index. Each is
    rescanned by the next build; verify reports them until then."""
    out = []
    for entry in manifest.get("shards", []):
        status, n_failed = entry.get("status"), int(entry.get("n_read_failures") or 0)
        if status in ("missing", "unreadable"):
            out.append(f"shard failed at build time: {entry['path']} ({status}: {entry.get('reason')}); "
                       "none of its samples are indexed: rebuild the index to retry it")
        elif n_failed:
            out.append(f"shard partly failed at build time: {entry['path']} ({n_failed} sample(s) could not "
                       "be read, listed in errors.jsonl); rebuild the index to retry them")
    return out


def _not_utf8(file: str, chunk: int = 1 << 24) -> int | None:
    """The offset of the first byte of ``file`` that is not UTF-8 (read in chunks), or None."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    with open(file, "rb") as f:
        while True:
            block = f.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                # the decoder may hold up to 3 bytes of a character begun in the previous block
                return max(0, done + e.start - len(e.object) + len(block))
            if not block:
                return None
            done += len(block)


def _first_rows(bad: np.ndarray) -> tuple[int, int]:
    rows = np.flatnonzero(bad)
    return len(rows), int(rows[0]) if len(rows) else -1


def index_problems(idx: TokenIndex) -> list[str]:
    """The index's own invariants, one line per broken one, naming the file: what a flipped bit or a
    hand edit breaks and the reader would otherwise misread (a length that is not vision + text, a
    shard id past the manifest's shards, CSR offsets that do not rise, ...). Reads every column once."""
    out: list[str] = []
    c = idx._cols
    f = lambda name: os.path.join(idx.path, name)  # noqa: E731
    n, n_shards = len(idx), len(idx.shard_paths)
    lengths, vision, text = (np.asarray(c[k], np.int64) for k in ("lengths", "vision_tokens", "text_tokens"))
    bad, first = _first_rows(lengths != vision + text)
    if bad:
        out.append(f"index damaged: {f('lengths.npy')}: {bad} sample(s) whose length is not vision_tokens + "
                   f"text_tokens (first: sample {first}: {int(lengths[first])} != {int(vision[first])} + "
                   f"{int(text[first])})")
    for name, col in (("vision_tokens", vision), ("text_tokens", text)):
        bad, first = _first_rows(col < 0)
        if bad:
            out.append(f"index damaged: {f(name + '.npy')}: {bad} negative count(s) (first: sample {first}: "
                       f"{int(col[first])})")
    sid = np.asarray(c["shard_id"], np.int64)
    bad, first = _first_rows((sid < 0) | (sid >= n_shards))
    if bad:
        out.append(f"index damaged: {f('shard_id.npy')}: {bad} shard id(s) outside 0..{n_shards - 1} "
                   f"(first: sample {first}: {int(sid[first])})")
    elif n:
        bad, first = _first_rows(np.diff(sid) < 0)
        counts = np.bincount(sid, minlength=n_shards)
        want = np.array([int(e.get("n_samples", -1)) for e in idx.manifest["shards"]], np.int64)
        if bad:
            out.append(f"index damaged: {f('shard_id.npy')}: shard ids go down at sample {first + 1} "
                       f"({int(sid[first])} -> {int(sid[first + 1])}); rows are grouped by shard")
        elif (counts != want).any():
            k = int(np.flatnonzero(counts != want)[0])
            out.append(f"index damaged: {f('shard_id.npy')}: shard {k} ({idx.shard_paths[k]}) has "
                       f"{int(counts[k])} rows, {MANIFEST} says {int(want[k])} samples")
    tables = {"key_offsets": None, "member_start": "member_ext", "image_start": "image_size",
              "member_path_offsets": None, "video_start": "video_info"}
    for name in tables:
        if name not in c:
            continue
        col = np.asarray(c[name], np.int64)
        if len(col) and col[0] != 0:
            out.append(f"index damaged: {f(name + '.npy')}: starts at {int(col[0])}, not 0")
        bad, first = _first_rows(np.diff(col) < 0)
        if bad:
            out.append(f"index damaged: {f(name + '.npy')}: not monotonic: {bad} place(s) where it goes down "
                       f"(first: row {first + 1}: {int(col[first])} -> {int(col[first + 1])})")
    ext = np.asarray(c["member_ext"], np.int64)
    bad, first = _first_rows((ext < 0) | (ext >= len(idx._exts)))
    if bad:
        out.append(f"index damaged: {f('member_ext.npy')}: {bad} extension id(s) outside "
                   f"0..{len(idx._exts) - 1} (first: member {first}: {int(ext[first])})")
    offset, size = np.asarray(c["member_offset"], np.int64), np.asarray(c["member_size"], np.int64)
    bad, first = _first_rows((offset < 0) | (size < 0))
    if bad:
        out.append(f"index damaged: member_offset.npy / member_size.npy: {bad} negative value(s) "
                   f"(first: member {first})")
    wh = np.asarray(c["image_size"], np.int64)
    bad, first = _first_rows((wh <= 0).any(axis=1) if len(wh) else np.zeros(0, bool))
    if bad:
        out.append(f"index damaged: {f('image_size.npy')}: {bad} image(s) with a side <= 0 "
                   f"(first: image {first}: {wh[first].tolist()})")
    for blob, offsets in ((KEYS_BLOB, "key_offsets"), (PATHS_BLOB, "member_path_offsets")):
        where = _not_utf8(os.path.join(idx.path, blob))
        if where is not None:
            row = int(np.searchsorted(np.asarray(c[offsets]), where, side="right")) - 1
            out.append(f"index damaged: {f(blob)}: byte {where} (row {row}) is not UTF-8")
    # errors.jsonl cut at a line boundary still parses: only its count against the manifest shows
    # that samples or shards that were not indexed went unreported.
    n_errors = len(idx.errors)
    if n_errors != int(idx.manifest.get("num_errors", -1)):
        out.append(f"index damaged: {f(ERRORS)}: {n_errors} line(s), {MANIFEST} says num_errors "
                   f"{idx.manifest.get('num_errors')} (errors were lost: rebuild the index)")
    if not out and int(lengths.sum()) != int(idx.manifest.get("total_tokens", -1)):
        out.append(f"index damaged: {f(MANIFEST)}: total_tokens {idx.manifest.get('total_tokens')} but "
                   f"lengths.npy sums to {int(lengths.sum())}")
    return out


def verify_index(path: str | os.PathLike, remote=None, allow_failed: bool = False,
                 progress: Callable[[int, int, str], None] | None = None) -> list[str]:
    """Problems that make the index at ``path`` stale or unusable, one line each, naming the file;
    [] if none.

    The index itself first: every file must open and agree (a cut ``manifest.json`` or ``lengths.npy``
    is reported as ``index damaged``). Then every shard: missing, not a regular file, another size, or
    another mtime is re-listed (headers only) and each indexed member's header (name, offset, size,
    checksum, mtime) compared with the index, so a member rewritten in place at the same size is
    named; the first/last MiB fingerprint is compared too. A shard whose mtime changed while every
    header and the fingerprint are the same is reported as modified (a copy that dropped mtimes looks
    the same as a payload edited in place; ``touch -r`` it back or rebuild). Image and video files
    named by annotation records are checked by size and mtime, and so are the video files Parquet rows
    name by path and the files that made a record an error (``row_file_problems``). A Parquet file has
    no member headers: size, fingerprint and mtime only.
    A remote shard (URL) is checked through its store (``tokenbal.index.remote.remote_problems``,
    ``remote``: its ``RemoteOptions``): an unchanged ETag is trusted, else size and fingerprint; its
    member headers are not re-listed here (the reader still compares each member's stamp).
    The index's own invariants are checked too (``index_problems``: lengths = vision + text, ids in
    range, offsets monotonic), and a shard the build could not read (missing, unreadable, a remote
    read out of retries) is a problem (``failed_shards``) unless ``allow_failed``.
    ``progress(done, total, unit)`` is called as the checks go (thousands of shards each read or asked
    of their store, millions of named files each stat'ed: minutes): after each shard (unit
    ``"shards"``), then every ``PROGRESS_ROWS`` named files and at the end (``"files"``).
    """
    from tokenbal.index.scan import headers_digest, list_shard_members, regular_file_stat

    report = progress or (lambda done, total, unit: None)

    path = os.fspath(path)
    try:
        manifest = read_manifest(path)
    except IndexDamagedError as e:
        return [f"index damaged: {e}"]
    problems = [f"index file missing: {os.path.join(path, f)}"
                for f in INDEX_FILES if not os.path.isfile(os.path.join(path, f))]
    idx = None
    if not problems:
        try:
            idx = TokenIndex(path)
            idx.errors   # noqa: B018 - parse errors.jsonl too
        except (IndexDamagedError, OSError) as e:
            return [f"index damaged: {e}"]
        damage = index_problems(idx)
        if damage:   # the shard checks below read the same columns: stop at the damage
            return damage
    if not allow_failed:
        problems.extend(failed_shards(manifest))
    n_shards = len(manifest["shards"])
    for sid, entry in enumerate(manifest["shards"]):
        if sid:
            report(sid, n_shards, "shards")
        shard = entry["path"]
        problems.extend(row_file_problems(entry))
        if "://" in shard and not shard.startswith("file://"):
            from tokenbal.index.remote import remote_problems
            from tokenbal.io.remote import RemoteOptions

            problems.extend(remote_problems(entry, remote or RemoteOptions()))
            continue
        try:
            st = regular_file_stat(shard)
        except FileNotFoundError:
            problems.append(f"shard missing: {shard}")
            continue
        except OSError as e:
            problems.append(f"shard unreadable: {shard}: {e}")
            continue
        if entry.get("fingerprint") is None:
            continue   # it could not be read at build time; it was recorded as an error then
        if st.st_size != entry["size"]:
            problems.append(f"shard changed: {shard} (size {entry['size']} -> {st.st_size} bytes)")
            continue
        try:
            fp = shard_fingerprint(shard, st.st_size)
        except OSError as e:
            problems.append(f"shard unreadable: {shard}: {e}")
            continue
        same_mtime = entry.get("mtime_ns") in (None, st.st_mtime_ns)
        if fp == entry["fingerprint"] and same_mtime:
            continue
        found = None
        if entry.get("headers_digest") is not None:
            try:
                members, scan = list_shard_members(shard)
            except OSError as e:
                problems.append(f"shard unreadable: {shard}: {e}")
                continue
            if scan.status != "ok":
                found = f"it no longer lists as a tar ({scan.reason})"
            elif headers_digest(members) != entry["headers_digest"]:
                found = _first_changed_member(idx, sid, members) or "a member header changed"
        if found is None and fp != entry["fingerprint"]:
            found = "same size, different content in its first/last MiB"
        if found is not None:
            problems.append(f"shard changed: {shard} ({found})")
        elif not same_mtime:
            problems.append(f"shard modified: {shard} (mtime changed since the build; every member header is "
                            "unchanged, but a payload may have been edited in place: rebuild, or "
                            "`touch -r` it "
                            "back if it is an unchanged copy)")
    if n_shards:
        report(n_shards, n_shards, "shards")
    if idx is not None and "member_mtime" in idx._cols:
        problems.extend(changed_files(idx, progress=report))
    problems.extend(processor_problems(manifest))
    return problems


# The files of a --processor folder that its tokenizer, chat template and image / video settings are
# read from (transformers' AutoTokenizer / AutoProcessor, tokenbal.estimate.load_estimator): the
# index's counts depend on them. A file appearing or disappearing counts as a change too.
PROCESSOR_FILES = ("chat_template.jinja", "chat_template.json", "processor_config.json",
                   "preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "config.json")


def processor_files(folder: str) -> dict[str, str]:
    """``{file name: sha256 (16 hex)}`` of the :data:`PROCESSOR_FILES` present in ``folder``."""
    out = {}
    for name in PROCESSOR_FILES:
        file = os.path.join(folder, name)
        if os.path.isfile(file):
            h = hashlib.sha256()
            with open(file, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
            out[name] = h.hexdigest()[:16]
    return out


def processor_problems(manifest: dict) -> list[str]:
    """The ``--processor`` folder an index was counted with, compared with what the build recorded
    of it (``text_counter.processor_files``): one line naming each file changed, added or removed."""
    counter = manifest.get("text_counter") or {}
    folder, recorded = counter.get("processor"), counter.get("processor_files")
    if not folder or recorded is None:
        return []
    if not os.path.isdir(folder):
        return [f"processor folder missing: {folder} (the text counts were made with its chat template and "
                "settings; they cannot be checked)"]
    now = processor_files(folder)
    changes = [f"{name} {'added' if name not in recorded else 'removed' if name not in now else 'changed'}"
               for name in PROCESSOR_FILES if recorded.get(name) != now.get(name)]
    if not changes:
        return []
    return [f"processor changed: {folder} ({', '.join(changes)} since the build; the text counts depend on "
            f"its chat template and settings): rebuild the index with --processor {folder}"]


def _first_changed_member(idx: TokenIndex | None, sid: int, members: list) -> str | None:
    """The first indexed member of shard ``sid`` whose header differs from ``members`` (a fresh
    listing), worded for ``verify``; None when the index has no stamps to compare."""
    if idx is None or "member_chksum" not in idx._cols:
        return None
    by_offset = {m.offset_data: m for m in members}
    c = idx._cols
    a, b = (int(x) for x in np.searchsorted(idx.shard_ids, [sid, sid + 1]))
    for i in range(a, b):
        for j, m in zip(range(int(c["member_start"][i]), int(c["member_start"][i + 1])), idx.members(i),
                        strict=True):
            now = by_offset.get(m.offset)
            want = (m.name, m.size, int(c["member_chksum"][j]), int(c["member_mtime"][j]))
            if now is None:
                return (f"member {m.name!r} of sample {idx.keys[i]!r}: no member starts at byte {m.offset} "
                        "any more")
            have = (now.name, now.size, now.chksum, now.mtime)
            if have != want:
                what = [f for f, x, y in zip(("name", "size", "header checksum", "mtime"), want, have,
                                             strict=True) if x != y]
                return (f"member {m.name!r} of sample {idx.keys[i]!r} at byte {m.offset} was rewritten: "
                        f"{', '.join(what)} differ")
    return None


def row_file_problems(entry: dict) -> list[str]:
    """The files outside a shard its samples depend on, as the build recorded them (path, size, mtime;
    -1, -1 when missing): videos a Parquet row names by path (``video_files``) and files that made an
    annotation record an error (``error_files``). One changed, gone or (for an error's) appeared since
    makes the index stale, as a rebuild rescans the shard for it (``build._row_files_changed``)."""
    out = []
    for kind, key in (("video file", "video_files"), ("file", "error_files")):
        for path, size, mtime_ns in entry.get(key) or ():
            try:
                st = os.stat(path)
            except OSError:
                if size != -1:
                    out.append(f"{kind} missing: {path} (named by {entry['path']})")
                continue
            if size == -1:
                out.append(f"{kind} appeared: {path} (named by {entry['path']}, missing at the build: its "
                           "samples are errors a rebuild would count)")
            elif (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
                out.append(f"{kind} changed: {path} (named by {entry['path']}; size {size} -> {st.st_size} "
                           "bytes, or its mtime)")
    return out


def changed_files(idx: TokenIndex, members: tuple[int, int] | None = None,
                  progress: Callable[[int, int, str], None] | None = None) -> list[str]:
    """Image and video files named by annotation records whose size or mtime changed since the
    build (``members``: only the member rows ``[a, b)``, e.g. one shard's). ``progress(done, total,
    "files")``: every ``PROGRESS_ROWS`` files checked and at the end."""
    from tokenbal.index.scan import PROGRESS_ROWS

    c = idx._cols
    a, b = members if members is not None else (0, len(c["member_path_offsets"]) - 1)
    poff = np.asarray(c["member_path_offsets"][a:b + 1])
    out = []
    named = (a + np.flatnonzero(np.diff(poff) > 0)).tolist()
    for k, j in enumerate(named):
        if progress is not None and k and k % PROGRESS_ROWS == 0:
            progress(k, len(named), "files")
        _, _, file = idx._member_paths[j].partition("\0")
        try:
            st = os.stat(file)
        except OSError:
            out.append(f"image or video file missing: {file}")
            continue
        if st.st_size != int(c["member_size"][j]) or (int(c["member_mtime"][j]) not in (-1, st.st_mtime_ns)):
            out.append(f"image or video file changed: {file} (size or mtime differs from the build)")
    if progress is not None and named:
        progress(len(named), len(named), "files")
    return out


def index_stats(path: str | os.PathLike, plot: str | os.PathLike | None = None) -> str:
    """Human-readable summary of an index: counts, shard statuses, token percentiles. With ``plot``,
    also write a PNG histogram of vision and text tokens per sample there (``tokenbal.index.plot``)."""
    idx = TokenIndex.open(path)
    if plot is not None:
        from tokenbal.index.plot import plot_token_histogram

        plot_token_histogram(idx.vision_tokens, idx.text_tokens, plot, title=f"tokens per sample, {idx.path}")
    m = idx.manifest
    statuses: dict[str, int] = {}
    for s in m["shards"]:
        statuses[s["status"]] = statuses.get(s["status"], 0) + 1
    n_err = len(idx.errors)
    n_shard_err = sum(1 for e in idx.errors if e.get("key") is None)
    shard_status = ", ".join(f"{v} {k}" for k, v in sorted(statuses.items()))
    lines = [
        f"index {idx.path}",
        f"  samples: {len(idx)}   shards: {len(idx.shard_paths)} ({shard_status})   "
        f"errors: {n_err} ({n_err - n_shard_err} bad samples, {n_shard_err} bad shards)",
        f"  estimator: {m['estimator']['name']}   text counter: {m['text_counter']['name']}",
    ]
    n_img = np.diff(np.asarray(idx._cols["image_start"]))
    # Two different counts, named so they cannot be read as one: images the samples reference (a
    # Parquet row or an annotation record may hold several, the same file twice) and the stored items
    # the index points into (a tar sample's text / JSON members count too).
    lines.append(f"  images referenced: {int(n_img.sum())}   samples with 0 / 1 / 2+ images: "
                 f"{int((n_img == 0).sum())} / {int((n_img == 1).sum())} / {int((n_img >= 2).sum())}")
    lines.append(f"  stored members: {m['num_members']} (tar members of any kind, files named by annotation "
                 "records, one per Parquet row)")
    if len(idx) == 0:
        lines.append("  no samples indexed")
        return "\n".join(lines)
    from tokenbal.index.videoindex import stats_line

    video_line = stats_line(idx)
    if video_line:
        lines.append(video_line)
    lines.append(f"  total tokens: {int(np.asarray(idx.lengths).sum()):,}")
    qs = (0, 50, 90, 99, 100)
    heads = ("min", "p50", "p90", "p99", "max", "mean")
    lines.append(f"  {'tokens':<8}" + "".join(f"{h:>10}" for h in heads))
    for label, arr in (("length", idx.lengths), ("vision", idx.vision_tokens), ("text", idx.text_tokens)):
        a = np.asarray(arr)
        vals = [int(v) for v in np.percentile(a, qs, method="nearest")]
        lines.append(f"  {label:<8}" + "".join(f"{v:>10}" for v in vals) + f"{a.mean():>10.1f}")
    return "\n".join(lines)
