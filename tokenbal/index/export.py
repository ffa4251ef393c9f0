"""Export an index's per-sample tokens for other pipelines, and join lengths back by key.

``export_index(index, out_dir, fmt)`` writes one table, a row per indexed sample in index order, with
columns ``key``, ``shard``, ``length`` (vision + text tokens), ``vision_tokens``, ``text_tokens``:

* ``parquet``: ``lengths.parquet`` (pyarrow); a ``length`` column is what transformers' length-grouped
  samplers, ms-swift and LlamaFactory packing read;
* ``jsonl``: ``lengths.jsonl``, one object per line;
* ``npy``: ``lengths.npy`` (int64, shape (N, 3): length, vision, text), ``keys.txt`` and
  ``shards.txt`` (one line per sample; keys with a line break, ``\\n`` or ``\\r``, are refused for
  this format).

``lengths_for_keys(source, keys)`` gives the ``length`` of each of ``keys`` from an export or an
index, in the order of ``keys``: a dataset listed in another order (another tool's sample list, a
filtered subset) gets its lengths for ``TokenBalancedBatchSampler(lengths, ...)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import numpy as np

FORMATS = ("parquet", "jsonl", "npy")
COLUMNS = ("length", "vision_tokens", "text_tokens")


def export_index(index, out_dir: str | os.PathLike, fmt: str = "parquet",
                 progress: Callable[[int, int, str], None] | None = None) -> str:
    """Write the per-sample table of ``index`` (a ``TokenIndex`` or its folder) into ``out_dir``;
    returns the path of the main file written. A damaged index (``store.index_problems``) raises
    ``IndexDamagedError`` naming the file. ``progress(done, total, "rows")``: the rows of a JSONL
    export written (a row at a time, ~6 s per million), every ``PROGRESS_ROWS`` and at the end."""
    from tokenbal.index.store import MANIFEST, IndexDamagedError, TokenIndex, index_problems

    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}")
    if os.path.isfile(os.path.join(out_dir, MANIFEST)):
        # An index keeps its own lengths.npy there: the npy export would overwrite it (N x 3 in place
        # of the index's column), and any export would mix foreign files into the index.
        raise ValueError(f"export folder {os.fspath(out_dir)} holds a tokenbal index; write the export to "
                         "another folder")
    idx = index if isinstance(index, TokenIndex) else TokenIndex.open(index)
    # The export copies the columns as they are, for pipelines that trust them: a damaged index (a
    # shard id out of range would even name another shard, by Python's negative indexing) is refused.
    damage = index_problems(idx)
    if damage:
        raise IndexDamagedError(f"cannot export {idx.path}: {'; '.join(damage)}; rebuild the index")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        # makedirs' own "[Errno 17] File exists: 'x'" does not say that a file stands where the
        # export folder (or one above it) should be.
        raise ValueError(f"export folder {os.fspath(out_dir)}: a file of that name (or of a folder above "
                         "it) is in the way; give a folder to write lengths.* into") from None
    keys = list(idx.keys)
    shard_ids = np.asarray(idx.shard_ids)
    shards = [idx.shard_paths[int(s)] for s in shard_ids]
    cols = {"length": np.asarray(idx.lengths), "vision_tokens": np.asarray(idx.vision_tokens),
            "text_tokens": np.asarray(idx.text_tokens)}
    # Each file is written under a temporary name and renamed into place once every file is complete:
    # a failure (a full disk) leaves the previous export whole and no half-written file behind.
    writes: dict[str, Callable[[str], None]] = {}
    if fmt == "parquet":
        from tokenbal._extras import require

        pa = require("pyarrow", "Parquet exports (the default --format; jsonl and npy need nothing)")
        pq = require("pyarrow.parquet", "Parquet exports (the default --format; jsonl and npy need nothing)")

        path = os.path.join(out_dir, "lengths.parquet")
        table = pa.table({"key": pa.array(keys, pa.string()), "shard": pa.array(shards, pa.string()),
                          **{k: pa.array(v, pa.int64()) for k, v in cols.items()}})
        writes[path] = lambda tmp: pq.write_table(table, tmp)
    elif fmt == "jsonl":
        path = os.path.join(out_dir, "lengths.jsonl")

        def write_jsonl(tmp: str) -> None:
            from tokenbal.index.scan import PROGRESS_ROWS

            with open(tmp, "w", encoding="utf-8") as f:
                for j, key in enumerate(keys):
                    if progress is not None and j and j % PROGRESS_ROWS == 0:
                        progress(j, len(keys), "rows")
                    row = {"key": key, "shard": shards[j], **{k: int(v[j]) for k, v in cols.items()}}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            if progress is not None and keys:
                progress(len(keys), len(keys), "rows")

        writes[path] = write_jsonl
    else:
        # A carriage return is a line break to every text reader that translates newlines (Python's
        # default among them): a key holding one would come back split, or without it.
        bad = next((k for k in keys + shards if "\n" in k or "\r" in k), None)
        if bad is not None:
            raise ValueError(f"key or shard {bad!r} holds a line break (\\n or \\r); export it as parquet "
                             "or jsonl")
        path = os.path.join(out_dir, "lengths.npy")
        array = np.stack([cols[c] for c in COLUMNS], axis=1).astype(np.int64).reshape(-1, 3)

        def write_npy(tmp: str) -> None:
            with open(tmp, "wb") as f:   # a file object: np.save would append .npy to the temporary name
                np.save(f, array)

        def write_lines(lines: list[str]) -> Callable[[str], None]:
            def write(tmp: str) -> None:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write("".join(k + "\n" for k in lines))
            return write

        writes[path] = write_npy
        writes[os.path.join(out_dir, "keys.txt")] = write_lines(keys)
        writes[os.path.join(out_dir, "shards.txt")] = write_lines(shards)
    _write_all(writes)
    return path


def _write_all(writes: dict[str, Callable[[str], None]]) -> None:
    """Run ``write(tmp)`` for each ``{path: write}`` into a temporary file beside ``path``, then rename
    them all into place; on an error remove the temporary files and raise it naming the file."""
    tmps = {path: f"{path}.tmp-{os.getpid()}" for path in writes}
    try:
        for path, write in writes.items():
            try:
                write(tmps[path])
            except OSError as e:   # "[Errno 28] No space left on device" alone does not say where
                raise OSError(e.errno, f"{e.strerror or e}: writing {path}") from None
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.remove(tmp)


def read_export(path: str | os.PathLike) -> tuple[list[str], dict[str, np.ndarray]]:
    """``(keys, {column: values})`` of an export (its folder or main file) or of an index folder.

    Every count is checked to be an integer >= 0 and every key a string (an export written or
    edited by another tool may hold floats, nulls or -1): a bad one raises ``ValueError`` naming
    the file, the row (line) and the column, instead of being truncated or cast to a made-up count."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from tokenbal.index.store import MANIFEST

        if os.path.isfile(os.path.join(path, MANIFEST)):
            from tokenbal.index.store import TokenIndex

            idx = TokenIndex.open(path)
            return list(idx.keys), {"length": np.asarray(idx.lengths),
                                    "vision_tokens": np.asarray(idx.vision_tokens),
                                    "text_tokens": np.asarray(idx.text_tokens)}
        found = [f for f in ("lengths.parquet", "lengths.jsonl", "lengths.npy")
                 if os.path.isfile(os.path.join(path, f))]
        if not found:
            raise FileNotFoundError(f"{path} holds neither a tokenbal index nor an export "
                                    "(lengths.parquet / lengths.jsonl / lengths.npy)")
        if len(found) > 1:
            # Two exports of one folder in different formats, likely of different builds: taking
            # one silently could read the stale one.
            raise ValueError(f"{path} holds exports in {len(found)} formats ({', '.join(found)}), maybe of "
                             "different builds; pass the file to read")
        path = os.path.join(path, found[0])
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(".jsonl"):
        keys, values = [], []
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _utf8_line(path, lineno, raw)
                if line.strip():
                    key, counts = _jsonl_row(path, lineno, line)
                    keys.append(key)
                    values.append(counts)
        arr = np.array(values, np.int64).reshape(-1, len(COLUMNS))
        return keys, {c: arr[:, j] for j, c in enumerate(COLUMNS)}
    if path.endswith(".npy"):
        try:
            arr = np.load(path)
        except Exception as e:  # noqa: BLE001 - ValueError, EOFError, OSError, a flipped header's TokenError
            # numpy's own words ('EOF: reading array header', 'No data left in file', 'Object arrays
            # cannot be loaded ...') name neither the file nor the export folder it was read from
            raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}): not the N x 3 int64 array an npy "
                             f"export of {os.path.dirname(os.path.abspath(path))} holds; export the "
                             "index again") from None
        if arr.dtype.kind not in "iu" or arr.ndim != 2 or arr.shape[1] != len(COLUMNS):
            raise ValueError(f"{path}: dtype {arr.dtype} shape {arr.shape}, expected integers of shape "
                             f"(N, {len(COLUMNS)}): {', '.join(COLUMNS)}")
        keys = _read_keys_txt(path)
        if len(keys) != len(arr):
            raise ValueError(f"{path}: {len(arr)} rows but keys.txt has {len(keys)} keys")
        cols = {c: _int64_counts(path, c, arr[:, j]) for j, c in enumerate(COLUMNS)}
        _check_counts(path, cols)
        return keys, cols
    raise ValueError(f"{path}: not an export (.parquet / .jsonl / .npy) nor an index folder")


def _read_parquet(path: str) -> tuple[list[str], dict[str, np.ndarray]]:
    """A Parquet export's keys and counts, each column checked (see ``read_export``). Keys may be in
    any Arrow string layout (dictionary-encoded, as polars / pandas write a categorical column;
    large or view strings): each read as a Python string."""
    from tokenbal._extras import require

    pa = require("pyarrow", "reading a Parquet export")
    pc = require("pyarrow.compute", "reading a Parquet export")
    pq = require("pyarrow.parquet", "reading a Parquet export")

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid / OSError name no file
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}): not a Parquet export of "
                         f"{os.path.dirname(os.path.abspath(path))}; export the index again") from None
    absent = [c for c in ("key", *COLUMNS) if c not in names]
    if absent:   # pyarrow's own error lists its internal fields (__fragment_index, ...), not the file's
        raise ValueError(f"{path}: no column {', '.join(map(repr, absent))} (columns: {', '.join(names)}); "
                         f"an export has key, {', '.join(COLUMNS)}")
    try:
        t = pq.read_table(path, columns=["key", *COLUMNS])
    except Exception as e:  # noqa: BLE001 - a damaged page or footer: pyarrow's words name no file
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); export the index again") from None
    cols = {}
    for name in ("key", *COLUMNS):
        col = t.column(name)
        kind = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
        if name == "key":
            is_view = getattr(pa.types, "is_string_view", lambda t: False)   # pyarrow >= 16
            fits = pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)
        else:
            fits = pa.types.is_integer(kind)
        if not fits:
            raise ValueError(f"{path}: column {name!r} has type {col.type}, expected "
                             f"{'strings' if name == 'key' else 'integers'}")
        if col.null_count:
            row = col.to_pylist().index(None)
            raise ValueError(f"{path}: row {row}: {name} is null")
        if name != "key":
            cols[name] = _int64_counts(path, name, pc.cast(col, kind).to_numpy())
    _check_counts(path, cols)
    return t.column("key").to_pylist(), cols   # any string layout: Python strings (no 2 GiB cast)


def _int64_counts(path: str, name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as int64; an unsigned count past int64's range is named with its value (a plain cast
    wraps it to a negative number)."""
    if values.dtype.kind == "u":
        big = np.flatnonzero(values > np.iinfo(np.int64).max)
        if len(big):
            raise ValueError(f"{path}: row {int(big[0])}: {name} is {int(values[big[0]])}, more than int64 "
                             f"holds ({np.iinfo(np.int64).max}); {len(big)} such row(s)")
    return values.astype(np.int64)


def _utf8_line(path: str, lineno: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:   # the codec's own message names neither the file nor the line
        raise ValueError(f"{path}: line {lineno} is not UTF-8 ({e.reason} at byte {e.start} of the line); "
                         "exports are written in UTF-8: export it again") from None


def _read_keys_txt(npy: str) -> list[str]:
    """The keys beside an npy export, one per line exactly as written (``\r`` kept: no newline
    translation); a last key without its line break is kept."""
    file = os.path.join(os.path.dirname(npy), "keys.txt")
    try:
        with open(file, "rb") as f:
            lines = [_utf8_line(file, n, raw) for n, raw in enumerate(f, 1)]
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} not found: an npy export keeps its keys there, beside "
                                f"{npy}") from None
    return [line[:-1] if line.endswith("\n") else line for line in lines]


def _jsonl_row(path: str, lineno: int, line: str) -> tuple[str, list[int]]:
    """One line of a JSONL export: its key and counts, each checked (a float, a bool, a null or a
    negative number is an error naming the line, not a count truncated or cast into another)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {lineno} is not JSON ({e}); a cut-short export? export it "
                         "again") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}: line {lineno} holds a {type(row).__name__}, not an object")
    if not isinstance(row.get("key"), str):
        raise ValueError(f"{path}: line {lineno}: key is {row.get('key', '<absent>')!r}, not a string")
    counts = []
    for c in COLUMNS:
        value = row.get(c, "<absent>")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: line {lineno}: {c} is {value!r}, not a count (an integer >= 0)")
        if value > np.iinfo(np.int64).max:
            raise ValueError(f"{path}: line {lineno}: {c} is {value}, more than int64 holds "
                             f"({np.iinfo(np.int64).max})")
        counts.append(value)
    return row["key"], counts


def _check_counts(path: str, cols: dict[str, np.ndarray]) -> None:
    """Token counts are never negative: a negative one (another tool's -1 for 'unknown') is named."""
    for c, values in cols.items():
        bad = np.flatnonzero(values < 0)
        if len(bad):
            raise ValueError(f"{path}: row {int(bad[0])}: {c} is {int(values[bad[0]])}, not a count "
                             f"(an integer >= 0); {len(bad)} such row(s)")


def lengths_for_keys(source, keys: Sequence[str], column: str = "length") -> np.ndarray:
    """``column`` (``length``, ``vision_tokens`` or ``text_tokens``) for each of ``keys``, in that order,
    from ``source``: an export (folder or file), an index folder or a ``TokenIndex``.

    Raises ``KeyError`` naming keys that are absent, and ``ValueError`` when the source holds one key
    twice (keys repeat across shards in some corpora: join on keys only where they are unique).
    """
    from tokenbal.index.store import TokenIndex

    if column not in COLUMNS:
        raise ValueError(f"column must be one of {COLUMNS}, got {column!r}")
    if isinstance(source, TokenIndex):
        have_keys, cols = list(source.keys), {"length": np.asarray(source.lengths),
                                              "vision_tokens": np.asarray(source.vision_tokens),
                                              "text_tokens": np.asarray(source.text_tokens)}
    else:
        have_keys, cols = read_export(source)
    where: dict[str, int] = {}
    dups = []
    for j, k in enumerate(have_keys):
        if where.setdefault(k, j) != j:
            dups.append(k)
    if dups:
        raise ValueError(f"{len(dups)} key(s) appear more than once in {source}, e.g. {dups[:3]}; "
                         "lengths cannot be joined by key")
    missing = [k for k in keys if k not in where]
    if missing:
        raise KeyError(f"{len(missing)} of {len(keys)} keys not in {source}, e.g. {missing[:5]}")
    return cols[column][np.fromiter((where[k] for k in keys), np.int64, count=len(keys))].astype(np.int64)
