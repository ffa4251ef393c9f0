"""``dataset_lengths``: each row's exact token count under a transformers processor, without
running the processor on pixels.

For every row ``r`` the result is ``len(processor.apply_chat_template([r[messages]],
images=[r[images]] or None, tokenize=True, return_dict=True)["input_ids"][0])``:
:class:`tokenbal.estimate.chat.ChatTokenCounter` renders the processor's chat template with
transformers' own machinery, tokenizes the rendered texts in batches with the processor's
tokenizer, and adds each image's placeholder tokens from the tokenbal estimator built from the
processor's own image-processor settings (min / max pixels, patch and merge sizes). Videos (a
``videos`` column, or the ``{"type": "video"}`` parts' files) are counted from their container
headers with the processor's own video settings and its own ``replace_video_token`` text
(:mod:`tokenbal.estimate.chat_video`).

Images are never decoded: a ``datasets.Dataset`` is read as Arrow (``with_format("arrow")``), so an
``Image()`` column, decoded or ``Image(decode=False)``, gives its stored bytes / path, and only the
image header is parsed (``tokenbal.index.imagesize``, EXIF orientation applied as ``datasets``'
decoder applies it). Other sequences of row dicts may hold PIL images (their ``.size``, as the
processor sees them), numpy arrays / torch tensors (their shape, laid out by the installed
transformers' channel rule: ``tokenbal.hf_compat.array_image_axes``; a kind of array the image
processor refuses is refused naming the row), ``{"bytes", "path"}`` dicts, paths or bytes.

Results of a ``datasets.Dataset`` are cached under its cache folder (``<cache dir>/tokenbal-lengths-
<key>.npy``; in-memory datasets: ``$TOKENBAL_CACHE`` or ``~/.cache/tokenbal/lengths``), keyed by the
dataset's ``_fingerprint``, the column names, the counter's fingerprint (vocabulary, chat
template, special tokens, estimator settings) and the path, size and mtime of every image and video
file the rows name, so a changed dataset, processor or file is recounted.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tokenbal.estimate.chat import ChatCountError, ChatTokenCounter
from tokenbal.estimate.conversation import chat_turns

logger = logging.getLogger("tokenbal")

CACHE_VERSION = 2      # bump when the counting rules change, so old cache files are not reused
BATCH_ROWS = 1000


def dataset_lengths(dataset: Any, processor: Any, *, messages: str = "messages",
                    images: str | None = "images", videos: str | None = "videos",
                    num_proc: int | None = None, cache: bool = True,
                    audios: str | None = "audios") -> np.ndarray:
    """Token count of every row of ``dataset`` under ``processor`` (int64, in row order); see the
    module docstring. ``processor`` may also be a tokenizer (text-only rows, counted as its
    ``apply_chat_template(messages, tokenize=True)``). ``images=None`` (or a dataset without that
    column) takes the images named in the messages' image parts; ``videos`` likewise for video
    files (paths, bytes or ``{bytes, path}``; else the ``{"type": "video"}`` parts' ``video`` /
    ``url`` / ``path``), counted from their container headers with the processor's own video
    settings (``tokenbal.estimate.chat_video``). A row with audio (a non-empty value in the
    ``audios`` column, or audio message parts under a processor that takes audio) raises
    ``ValueError`` naming the row: audio tokens are not counted. ``num_proc`` > 1 counts a
    ``datasets.Dataset`` in that many processes (``Dataset.map``). Raises ``ValueError`` naming the
    row for a row the processor would reject (placeholders and images disagree) or whose image
    or video header cannot be read."""
    counter = ChatTokenCounter.from_processor(processor)
    arrays = _ARRAYS.set(_ArrayImages(getattr(processor, "image_processor", None)))
    try:
        return _dataset_lengths(dataset, processor, counter, messages, images, videos, num_proc, cache,
                                audios)
    finally:
        _ARRAYS.reset(arrays)


def _dataset_lengths(dataset: Any, processor: Any, counter: ChatTokenCounter, messages: str,
                     images: str | None, videos: str | None, num_proc: int | None, cache: bool,
                     audios: str | None) -> np.ndarray:
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"dataset_lengths needs a map-style dataset (len and indexing), got "
                        f"{type(dataset).__name__}; for an IterableDataset, index it offline "
                        "(tokenbal index build --processor DIR)")
    if _is_hf_dataset(dataset):
        lengths = _dataset_lengths_hf(dataset, counter, messages, images, videos, num_proc, cache, audios)
    else:
        lengths = _rows_lengths(dataset, counter, messages, images, videos, audios)
    _check_overrides(dataset, processor, lengths, messages, images, videos)
    return lengths


# -- a user's processor subclass -------------------------------------------------------------------

# Methods a processor subclass may define that cannot change what its call returns for a row.
_COUNT_NEUTRAL = frozenset({"__init__", "__repr__", "__str__", "to_dict", "to_json_string", "to_json_file",
                            "save_pretrained", "from_pretrained", "push_to_hub", "batch_decode", "decode"})
CHECK_ROWS = 8   # rows run through an overriding processor itself


def processor_overrides(processor: Any) -> list[str]:
    """``Class.method`` for every method that a class outside transformers (a user's subclass, or
    remote code) defines in front of the transformers class of ``processor``, its image processor
    or its video processor. tokenbal counts by the rules of that transformers class, so any of these
    may make the processor emit other counts. Empty for a tokenizer (its own template and
    tokenization are what the count runs) and for parts that are no transformers class at all."""
    if getattr(processor, "tokenizer", None) is None:
        return []
    found = []
    for part in (processor, getattr(processor, "image_processor", None),
                 getattr(processor, "video_processor", None)):
        mro = type(part).__mro__ if part is not None else ()
        first = next((i for i, c in enumerate(mro) if c.__module__.split(".")[0] == "transformers"), None)
        for cls in mro[:first or 0]:
            for name, value in vars(cls).items():
                if name in _COUNT_NEUTRAL or name.startswith("post_process") or isinstance(value, type):
                    continue
                if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                    found.append(f"{cls.__qualname__}.{name}")
    return found


def _check_overrides(dataset: Any, processor: Any, lengths: np.ndarray, messages: str,
                     images: str | None, videos: str | None) -> None:
    """A processor whose class overrides transformers' methods is not trusted silently: the longest
    rows (the likeliest to hold images / videos) and the shortest are run through the processor
    itself (:func:`~tokenbal.integrations.trainer_support.process_row`, what the packed Trainer
    runs); a different count raises naming the row and the overrides, equal counts are logged as
    a warning naming them and the rows checked."""
    overrides = processor_overrides(processor)
    if not overrides or not len(lengths):
        return
    from tokenbal.integrations.trainer_support import process_row

    name = type(processor).__name__
    base = next(c.__name__ for c in type(processor).__mro__ if c.__module__.split(".")[0] == "transformers")
    said = f"{name} overrides {', '.join(overrides)} of transformers' {base}"
    order = np.argsort(-lengths, kind="stable")
    checked = sorted({int(i) for i in order[:CHECK_ROWS - 1]} | {int(order[-1])})
    for i in checked:
        try:
            got = len(process_row(dataset[i], processor, messages=messages, images=images or "",
                                  videos=videos or "")["input_ids"])
        except Exception as e:
            raise ValueError(f"row {i}: {said}, and running it on the row failed ({type(e).__name__}: "
                             f"{e}), so the counts of its base class's rules cannot be checked; pass "
                             "token_lengths= counted with the processor itself") from e
        if got != int(lengths[i]):
            raise ValueError(f"row {i}: {name} gives {got} tokens, but dataset_lengths counted "
                             f"{int(lengths[i])} by the rules of transformers' {base}: {name} overrides "
                             f"{', '.join(overrides)}, which changes the counts. Pass token_lengths= counted "
                             "with the processor itself (len(processor.apply_chat_template([messages], "
                             "images=..., tokenize=True, return_dict=True)['input_ids'][0]) per row), or "
                             "give the dataset a 'length' column")
    logger.warning("tokenbal: %s; dataset_lengths counts by the base class's rules, checked equal to "
                   "the processor itself on rows %s; an override that changes the counts of other rows only "
                   "is not seen (pass token_lengths= counted with the processor to be sure)", said, checked)


# -- datasets.Dataset ------------------------------------------------------------------------------

def _is_hf_dataset(obj: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(obj, datasets.Dataset)


def _dataset_lengths_hf(ds: Any, counter: ChatTokenCounter, messages: str, images: str | None,
                        videos: str | None, num_proc: int | None, cache: bool,
                        audios: str | None = None) -> np.ndarray:
    if messages not in ds.column_names:
        raise ValueError(f"dataset has no {messages!r} column (columns: {', '.join(ds.column_names)}); "
                         "pass messages=<column of chat turns>")
    image_col = images if images is not None and images in ds.column_names else None
    video_col = videos if videos is not None and videos in ds.column_names else None
    transform = _transform(ds)
    if transform is not None:
        # The rows the Trainer loads are the transform's output: count those (no cache: a
        # transform's result cannot be fingerprinted).
        rows = _TransformedRows(ds)
        if len(ds) and messages not in rows[0]:
            name = getattr(transform, "__name__", transform)
            raise ValueError(f"the dataset's transform ({name!r}) returns the columns {sorted(rows[0])}, "
                             f"without {messages!r}: its rows cannot be counted as chat rows; pass "
                             "messages=<the transformed column of chat turns>")
        return _rows_lengths(rows, counter, messages, images, videos, audios)
    if audios is not None and audios in ds.column_names:
        _refuse_audio_column(ds, audios, counter)
    path = None
    if cache:
        files = _files_digest(ds, counter, messages, image_col, video_col)
        parts = [str(CACHE_VERSION), str(ds._fingerprint), messages, str(image_col), str(video_col),
                 counter.fingerprint, files]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
        path = _cache_file(ds, key)
    else:
        key = hashlib.sha256(str(ds._fingerprint).encode()).hexdigest()[:24]
    if path is not None and os.path.isfile(path):
        try:
            cached = np.load(path)
            if cached.shape == (len(ds),) and cached.dtype == np.int64:
                return cached
        except (OSError, ValueError):
            pass   # a damaged cache file is recomputed and replaced
    columns = [messages] + [c for c in (image_col, video_col) if c]
    table_ds = ds.select_columns(columns).with_format("arrow")
    if num_proc and num_proc > 1 and len(ds) > 1:
        out = table_ds.map(_MapCount(counter, messages, image_col, video_col), batched=True,
                           batch_size=BATCH_ROWS,
                           with_indices=True, num_proc=int(num_proc), remove_columns=columns,
                           keep_in_memory=True, new_fingerprint=f"tokenbal-lengths-{key}")
        # the column straight from the Arrow table: `ds[column]` is a lazy per-row Column on
        # datasets 4+, which np.asarray walks row by row (seconds for 100k rows)
        lengths = out.with_format("arrow")[:].column("tokenbal_length").to_numpy().astype(np.int64)
    else:
        parts = []
        with _rows_bar(len(ds)) as bar:
            for a in range(0, len(ds), BATCH_ROWS):
                table = table_ds[a:a + BATCH_ROWS]
                parts.append(_count_table(counter, table, messages, image_col, a, video_col))
                bar(len(parts[-1]))
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if path is not None:
        _save(path, lengths)
    return lengths


def _transform(ds: Any) -> Any:
    """The ``with_transform`` / ``set_transform`` function of a ``datasets.Dataset``, or None."""
    fmt = getattr(ds, "format", None) or {}
    if fmt.get("type") == "custom" or (fmt.get("format_kwargs") or {}).get("transform") is not None:
        return (fmt.get("format_kwargs") or {}).get("transform")
    return None


class _TransformedRows:
    """A transformed ``datasets.Dataset`` as row dicts, read in batches through its transform."""

    def __init__(self, ds: Any) -> None:
        self.ds, self._start, self._rows = ds, -1, []

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        if not self._start <= i < self._start + len(self._rows):
            self._start = i - i % BATCH_ROWS
            batch = self.ds[self._start:self._start + BATCH_ROWS]
            if not isinstance(batch, dict):
                raise ValueError(f"the dataset's transform returns {type(batch).__name__} for rows "
                                 f"{self._start}..; a dict of columns is needed to count its rows")
            n = len(next(iter(batch.values()))) if batch else 0
            self._rows = [{k: v[j] for k, v in batch.items()} for j in range(n)]
        return self._rows[i - self._start]


def _files_digest(ds: Any, counter: ChatTokenCounter, messages: str, image_col: str | None,
                  video_col: str | None = None) -> str:
    """A digest of the image and video files the rows name by path (each path's size and mtime): the dataset's
    fingerprint covers its own bytes, not the files behind its paths, so a changed file must change
    the cache key. Images held as bytes are covered by the fingerprint already."""
    import pyarrow as pa
    import pyarrow.compute as pc

    h = hashlib.sha256()
    table_ds = ds.select_columns([messages] + [c for c in (image_col, video_col) if c]).with_format("arrow")
    for a in range(0, len(ds), 4 * BATCH_ROWS):
        table = table_ds[a:a + 4 * BATCH_ROWS]
        paths: list = []
        for media_col in (image_col, video_col):
            if media_col is None:
                continue
            col = table.column(media_col).combine_chunks()
            flat = col.flatten() if (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) else col
            if pa.types.is_struct(flat.type):
                names = [flat.type.field(i).name for i in range(flat.type.num_fields)]
                if "path" in names:
                    p = pc.struct_field(flat, "path")
                    if "bytes" in names:
                        p = pc.if_else(pc.is_null(pc.struct_field(flat, "bytes")), p, pa.scalar(None, p.type))
                    paths.extend(p.drop_null().to_pylist())
            elif pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type):
                paths.extend(flat.drop_null().to_pylist())
        text = table.column(messages)
        if any(k in str(text.type) for k in ("image", "url", "path", "video")):
            for conv in text.to_pylist():
                if isinstance(conv, list):
                    paths.extend(v for v in counter.row_images(conv) if isinstance(v, str))
                    paths.extend(v for v in counter.row_videos(conv) if isinstance(v, str))
        for path in paths:
            try:
                st = os.stat(path)
                h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            except (OSError, ValueError):
                h.update(f"{path}\0missing\0".encode())
    return h.hexdigest()


class _MapCount:
    """The ``Dataset.map`` function of ``num_proc`` > 1 (a class, so it pickles to the workers)."""

    def __init__(self, counter: ChatTokenCounter, messages: str, image_col: str | None,
                 video_col: str | None = None) -> None:
        self.counter, self.messages, self.image_col, self.video_col = counter, messages, image_col, video_col

    def __call__(self, table: Any, indices: list[int]) -> dict:
        first = int(indices[0]) if len(indices) else 0
        return {"tokenbal_length": _count_table(self.counter, table, self.messages, self.image_col, first,
                                                self.video_col)}


def _count_table(counter: ChatTokenCounter, table: Any, messages: str, image_col: str | None,
                 first_row: int, video_col: str | None = None) -> np.ndarray:
    values = table.column(messages).to_pylist()
    convs = [chat_turns(c, first_row + r, messages) for r, c in enumerate(values)]
    sizes = _arrow_sizes(table.column(image_col), first_row, image_col) if image_col is not None else None
    if sizes is None:
        sizes = [[] for _ in convs]
    for r, conv in enumerate(convs):
        if not sizes[r]:   # no images column value: the images named in the parts
            parts = counter.row_images(conv)
            sizes[r] = [_image_size(im, first_row + r, f"{messages} image part {j}", parts[0])
                        for j, im in enumerate(parts)]
    column = table.column(video_col).to_pylist() if video_col is not None else None
    return _count_rows(counter, convs, sizes, first_row,
                       _videos(counter, convs, column, first_row, messages, video_col))


def _count_rows(counter: ChatTokenCounter, convs: list, sizes: list, first_row: int,
                infos: list | None) -> np.ndarray:
    """``counter.count`` of these rows; where the template raises on one, an error naming it."""
    try:
        return counter.count(convs, sizes, first_row, videos=infos)
    except ChatCountError:
        raise
    except Exception as e:   # the template raising on a row: find the row, name it
        raise _row_error(counter, convs, sizes, first_row, e, infos) from e


def _videos(counter: ChatTokenCounter, convs: list, column: list | None, first_row: int, messages: str,
            video_col: str | None) -> list | None:
    """Per row, the headers of its videos (the videos column's value, else its video parts')."""
    from tokenbal.index.video import probe_row_video

    out = []
    for r, conv in enumerate(convs):
        value = column[r] if column is not None else None
        if value is None or (isinstance(value, (list, tuple)) and not value):
            items, field = counter.row_videos(conv), f"{messages} video part"
        else:
            items, field = (value if isinstance(value, (list, tuple)) else [value]), str(video_col)
        out.append([probe_row_video(v, first_row + r, f"{field}[{j}]") for j, v in enumerate(items)])
    return out


def _row_error(counter: ChatTokenCounter, convs: list, sizes: list, first_row: int,
               error: Exception, videos: list | None = None) -> Exception:
    for r, conv in enumerate(convs):
        try:
            counter.count([conv], [sizes[r]], first_row + r,
                          videos=[videos[r]] if videos is not None else None)
        except Exception as e:  # noqa: BLE001 - re-raised below with the row named
            return ValueError(f"row {first_row + r}: {type(e).__name__}: {e}")
    return error


def _cache_file(ds: Any, key: str) -> str | None:
    files = [f.get("filename") for f in (getattr(ds, "cache_files", None) or []) if f.get("filename")]
    folder = os.path.dirname(files[0]) if files else os.environ.get("TOKENBAL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenbal", "lengths")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    return os.path.join(folder, f"tokenbal-lengths-{key}.npy")


def _save(path: str, lengths: np.ndarray) -> None:
    # Atomic: a reader never sees half a file, and two writers of the same key write the same data.
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tokenbal-lengths-", suffix=".npy", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            np.save(f, lengths)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("tokenbal: could not cache lengths at %s: %s", path, e)


# -- any sequence of row dicts ---------------------------------------------------------------------

def _rows_lengths(rows: Any, counter: ChatTokenCounter, messages: str, images: str | None,
                  videos: str | None = None, audios: str | None = None) -> np.ndarray:
    n = len(rows)
    out = []
    with _rows_bar(n) as bar:
        for a in range(0, n, BATCH_ROWS):
            b = min(n, a + BATCH_ROWS)
            out.append(_rows_batch(rows, a, b, counter, messages, images, videos, audios))
            bar(len(out[-1]))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


@contextlib.contextmanager
def _rows_bar(n: int) -> Iterator[Callable[[int], None]]:
    """A bar of the rows counted (on stderr, what ``Dataset.map`` shows for ``num_proc`` > 1) when the
    count takes more than one batch: a chat template over a million rows takes minutes. It follows
    ``datasets``' switch (``datasets.disable_progress_bars()``, ``HF_DATASETS_DISABLE_PROGRESS_BARS``)."""
    enabled = n > BATCH_ROWS
    if enabled:
        try:
            from datasets.utils.logging import is_progress_bar_enabled
        except ImportError:
            pass
        else:
            enabled = is_progress_bar_enabled()
    if not enabled:
        yield lambda k: None
        return
    from tqdm import tqdm

    with tqdm(total=n, unit="rows", desc="counting tokens", leave=False) as bar:
        yield bar.update


def _rows_batch(rows: Any, a: int, b: int, counter: ChatTokenCounter, messages: str, images: str | None,
                videos: str | None, audios: str | None) -> np.ndarray:
    """The counts of rows ``a`` to ``b``."""
    from tokenbal.index.text import audio_count

    convs, sizes, column = [], [], []
    for r in range(a, b):
        row = rows[r]
        if not isinstance(row, dict) or messages not in row:
            raise ValueError(f"row {r}: has no {messages!r} field")
        conv = chat_turns(row[messages], r, messages)
        if audios is not None and audio_count(row.get(audios)):
            raise ValueError(_audio_message(r, audio_count(row[audios]), audios, counter))
        value = row.get(images) if images is not None else None
        if value is None or (isinstance(value, (list, tuple)) and not value):
            parts = counter.row_images(conv)
            sizes.append([_image_size(im, r, f"{messages} image part {j}", parts[0])
                          for j, im in enumerate(parts)])
        else:
            sizes.append(_row_sizes(value, r, images))
        convs.append(conv)
        column.append(row.get(videos) if videos is not None else None)
    return _count_rows(counter, convs, sizes, a, _videos(counter, convs, column, a, messages, videos))


# -- audio: refused, naming the row ----------------------------------------------------------------

def _audio_message(row: int, n: int, column: str, counter: ChatTokenCounter) -> str:
    return (f"row {row}: has {n} audio(s) in column {column!r}; tokenbal counts {counter.source}'s text, "
            "images and videos but not audio (remove the audio or count those rows yourself)")


def _refuse_audio_column(ds: Any, column: str, counter: ChatTokenCounter) -> None:
    """``ValueError`` naming the first row of a ``datasets.Dataset`` whose ``column`` holds audio
    (checked on the Arrow column, ``BATCH_ROWS`` rows at a time: no row is decoded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tokenbal.index.text import audio_count

    table_ds = ds.select_columns([column]).with_format("arrow")
    for a in range(0, len(ds), BATCH_ROWS):
        arr = table_ds[a:a + BATCH_ROWS].column(column).combine_chunks()
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            has = pc.greater(pc.list_value_length(arr), 0)
        elif pa.types.is_string(arr.type) or pa.types.is_binary(arr.type):
            has = pc.greater(pc.binary_length(arr), 0)
        elif pa.types.is_boolean(arr.type):
            has = arr
        else:   # a struct (datasets' Audio()) or another single value per row
            has = arr.is_valid()
        first = pc.index(pc.fill_null(has, False), True).as_py()
        if first >= 0:
            raise ValueError(_audio_message(a + first, audio_count(arr[first].as_py()), column, counter))


# -- image sizes from headers ----------------------------------------------------------------------

def _arrow_sizes(column: Any, first_row: int, field: str) -> list[list[tuple[int, int]]]:
    """Per row, ``(width, height)`` of the images of an Arrow images column: a list of / one
    ``{bytes, path}`` struct (datasets' ``Image()``), binary or path string. Only each value's
    first KiBs and last bytes leave Arrow (``_ArrowImage``), unless its header lies further in."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tokenbal.index.imagesize import FIRST_READ

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        offsets, valid, flat = arr.offsets.to_pylist(), arr.is_valid().to_pylist(), arr.flatten()
    else:   # one image per row
        offsets, valid, flat = list(range(len(arr) + 1)), arr.is_valid().to_pylist(), arr
    if pa.types.is_null(flat.type):
        # No image in any row (datasets types a column of only [] / None values as null): each row's
        # images are those of its parts; an entry in such a list is a missing image.
        for r in range(len(offsets) - 1):
            if flat is not arr and offsets[r + 1] > offsets[r]:
                raise ValueError(f"row {first_row + r}: image {field}[0] is None (no bytes, no path)")
        return [[] for _ in range(len(offsets) - 1)]
    if pa.types.is_struct(flat.type):
        names = [flat.type.field(i).name for i in range(flat.type.num_fields)]
        data = pc.struct_field(flat, "bytes") if "bytes" in names else None
        paths = pc.struct_field(flat, "path").to_pylist() if "path" in names else [None] * len(flat)
    elif pa.types.is_binary(flat.type) or pa.types.is_large_binary(flat.type):
        data, paths = flat, [None] * len(flat)
    elif pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type):
        data, paths = None, flat.to_pylist()
    else:
        raise ValueError(f"images column {field!r} has Arrow type {arr.type}; expected datasets' Image() "
                         "(a {bytes, path} struct), a list of them, binary or path strings")
    if data is not None:
        heads = pc.binary_slice(data, 0, FIRST_READ).to_pylist()
        tails = pc.binary_slice(data, -64).to_pylist()
        lengths = pc.binary_length(data).to_pylist()
    out = []
    for r in range(len(offsets) - 1):
        row = []
        if valid[r]:
            for k, j in enumerate(range(offsets[r], offsets[r + 1])):
                if data is not None and heads[j] is not None:
                    image: Any = _ArrowImage(heads[j], tails[j], lengths[j], data, j)
                elif paths[j]:
                    image = paths[j]
                else:
                    raise ValueError(f"row {first_row + r}: image {field}[{k}] has neither bytes nor a path")
                row.append(_image_size(image, first_row + r, f"{field}[{k}]"))
        out.append(row)
    return out


class _ArrowImage:
    """One image value inside an Arrow array, read through ``pread``: its first KiBs and last bytes
    are already in hand; any other range copies the whole value out of Arrow once."""

    def __init__(self, head: bytes, tail: bytes, size: int, data: Any, j: int) -> None:
        self.head, self.tail, self.size, self._data, self._j, self._full = head, tail, size, data, j, None

    def pread(self, n: int, offset: int) -> bytes:
        if offset + n <= len(self.head):
            return self.head[offset:offset + n]
        if offset >= self.size - len(self.tail):
            start = offset - (self.size - len(self.tail))
            return self.tail[start:start + n]
        if self._full is None:
            self._full = self._data[self._j].as_py()
        return self._full[offset:offset + n]


def _row_sizes(value: Any, row: int, field: str) -> list[tuple[int, int]]:
    """``(width, height)`` of each image of one row's images value (a list, or one image)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_image_size(im, row, f"{field}[{j}]", items[0]) for j, im in enumerate(items)]


def _image_size(image: Any, row: int, where: str, row_first: Any = None) -> tuple[int, int]:
    """``(width, height)`` of one image value of a row as the processor sees it; ``row_first``: the
    row's first image (transformers 4.57's slow image processors read every array of a call in the
    layout of the first)."""
    from tokenbal.index.imagesize import ImageSizeError

    try:
        size = getattr(image, "size", None)
        if isinstance(size, tuple) and len(size) == 2 and hasattr(image, "mode"):   # a PIL image
            return int(size[0]), int(size[1])
        if _is_array(image):
            return (_ARRAYS.get() or _ArrayImages(None)).size(image, row_first)
        if isinstance(image, dict):
            data, path = image.get("bytes"), image.get("path")
            if data is not None:
                return _bytes_size(data)
            if path:
                return _path_size(path)
            raise ValueError("has neither bytes nor a path")
        if isinstance(image, _ArrowImage):
            from tokenbal.index.imagesize import read_image_size

            return read_image_size(image, 0, image.size, exif="transpose")[0]
        if isinstance(image, (bytes, bytearray, memoryview)):
            return _bytes_size(bytes(image))
        if isinstance(image, (str, os.PathLike)):
            return _path_size(os.fspath(image))
        raise ValueError(f"is a {type(image).__name__}, not a PIL image, numpy array / torch tensor, "
                         "{bytes, path} dict, path or bytes")
    except (ImageSizeError, OSError, ValueError) as e:
        raise ValueError(f"row {row}: image {where}: {e}") from e


def _is_array(value: Any) -> bool:
    """A numpy array or a torch tensor (what transformers' image processors take besides PIL images)."""
    return isinstance(value, np.ndarray) or (type(value).__module__.split(".")[0] == "torch"
                                             and hasattr(value, "shape") and hasattr(value, "dtype"))


class _ArrayImages:
    """The size a processor reads from an array image: its shape, laid out by the installed
    transformers' channel rule (:func:`tokenbal.hf_compat.array_image_size`). Whether the processor
    takes such an array at all (a 2-D grayscale one fails in the PIL backend's RGB conversion, 'the
    channel dimension' of a 4-channel one under 4.57) is asked of its image processor once per kind
    of array (dimensions, layout, channels, dtype), on a 64 x 64 stand-in of that kind: the row is
    refused with the processor's own error instead of counted and then failing in training."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor
        self._verdicts: dict[tuple, str | None] = {}

    def size(self, array: Any, row_first: Any) -> tuple[int, int]:
        from tokenbal.hf_compat import array_image_axes

        shape = tuple(int(n) for n in array.shape)
        first = tuple(int(n) for n in row_first.shape) if _is_array(row_first) else None
        h_axis, w_axis = array_image_axes(shape)
        if self.image_processor is not None:
            # the stand-in: the array's kind with its height and width axes set to 64, after a stand-in
            # of the row's first image (4.57's slow processors lay every array out as the first)
            kind = tuple(-1 if i in (h_axis, w_axis) else n for i, n in enumerate(shape))
            lead = None if row_first is array else (first or "image")
            key = (kind, str(array.dtype), type(array).__module__, lead)
            if key not in self._verdicts:
                probe = tuple(64 if n < 0 else n for n in kind)
                self._verdicts[key] = self._ask(array, probe, row_first, lead)
            if self._verdicts[key] is not None:
                raise ValueError(f"is a {type(array).__name__} of shape {shape} and dtype {array.dtype}, "
                                 f"which {type(self.image_processor).__name__} refuses "
                                 f"({self._verdicts[key]})")
        return shape[w_axis], shape[h_axis]

    def _ask(self, array: Any, shape: tuple[int, ...], row_first: Any, lead: Any) -> str | None:
        from PIL import Image

        def zeros(like: Any, of: tuple[int, ...]) -> Any:
            if isinstance(like, np.ndarray):
                return np.zeros(of, like.dtype)
            import torch

            return torch.zeros(of, dtype=like.dtype)

        probes = [zeros(array, shape)]
        if lead == "image":
            probes.insert(0, Image.new("RGB", (64, 64)))
        elif lead is not None:
            from tokenbal.hf_compat import array_image_axes

            axes = array_image_axes(lead)
            probes.insert(0, zeros(row_first, tuple(64 if i in axes else n for i, n in enumerate(lead))))
        try:
            self.image_processor(images=[probes])   # nested by row, as the processor passes them
        except Exception as e:  # noqa: BLE001 - the processor's own refusal, named in the row's error
            try:   # a processor that refuses a plain 64 x 64 RGB image too is not judging the array
                self.image_processor(images=[[Image.new("RGB", (64, 64))]])
            except Exception:  # noqa: BLE001
                return None
            return f"{type(e).__name__}: {e}"
        return None


# the processor of the running dataset_lengths call (the row readers below are plain functions)
_ARRAYS: contextvars.ContextVar[_ArrayImages | None] = contextvars.ContextVar("tokenbal_array_images",
                                                                              default=None)


class _Bytes:
    """In-memory bytes behind the ``pread`` interface ``tokenbal.index.imagesize`` reads through."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def pread(self, n: int, offset: int) -> bytes:
        return self.data[offset:offset + n]


def _bytes_size(data: bytes) -> tuple[int, int]:
    from tokenbal.index.imagesize import read_image_size

    (w, h), _ = read_image_size(_Bytes(data), 0, len(data), exif="transpose")
    return w, h


def _path_size(path: str) -> tuple[int, int]:
    """A string image as transformers' ``load_image`` takes it: a local file, else a base64 string (a
    ``data:image/...;base64,`` URI's payload); http(s) URLs are not fetched."""
    if path.startswith(("http://", "https://")) or ("://" in path and not os.path.isfile(path)):
        raise ValueError(f"{_short(path)} is a URL; only local image paths are read")
    from tokenbal.index.imagesize import read_image_size

    if not os.path.isfile(path):
        from tokenbal.index.imagesize import ImageSizeError

        encoded = path.split(",")[1] if path.startswith("data:image/") and "," in path else path
        try:
            return _bytes_size(base64.decodebytes(encoded.encode()))
        except (ValueError, UnicodeEncodeError, ImageSizeError) as e:
            raise ValueError(f"{_short(path)} is no image file (no such file) and no base64 image data "
                             f"({e})") from None
    fd = os.open(path, os.O_RDONLY)
    try:
        (w, h), _ = read_image_size(fd, 0, os.fstat(fd).st_size, exif="transpose")
    finally:
        os.close(fd)
    return w, h


def _short(text: str, keep: int = 200) -> str:
    """``repr`` of a string cut to ``keep`` characters (base64 payloads run to megabytes)."""
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


def lengths_column(dataset: Any, column: str = "length") -> np.ndarray | None:
    """Per-row lengths from a column of a ``datasets.Dataset``, int64, or ``None`` without one: a
    number column is taken as is (transformers' ``length`` convention), a list column (``input_ids``)
    gives each list's length. A missing value raises naming the row."""
    names = getattr(dataset, "column_names", None)
    if not _is_hf_dataset(dataset):
        return None
    if _transform(dataset) is not None:
        # The Trainer loads the transform's rows, whose column can differ from the stored one (a
        # truncating transform) or exist only there (a tokenizing one): read it through the transform.
        return _transformed_column(dataset, column)
    if not names or column not in names:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    values = dataset.with_format("arrow", columns=[column])[:].column(column).combine_chunks()
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        values = pc.list_value_length(values)
    elif not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise ValueError(f"dataset column {column!r} has type {values.type}, not token counts")
    if values.null_count:
        row = int(np.flatnonzero(~np.asarray(values.is_valid()))[0])
        raise ValueError(f"row {row}: dataset column {column!r} is missing")
    from tokenbal._checks import check_sample_values

    # checked on the values as stored (a cast first would turn inf, 1e30 or 2**63 into -2**63)
    return check_sample_values(values.to_numpy(zero_copy_only=False), f"dataset column {column!r}",
                               whole=True).astype(np.int64)


def _transformed_column(dataset: Any, column: str) -> np.ndarray | None:
    """:func:`lengths_column` of the rows a ``set_transform`` / ``with_transform`` dataset returns
    (every row through its transform once, in batches), or ``None`` when they have no such column."""
    from tokenbal._checks import check_sample_values

    rows = _TransformedRows(dataset)
    if not len(rows) or column not in rows[0]:
        return None
    logger.info("tokenbal: reading the %r column of %d rows through the dataset's transform", column,
                len(rows))
    values = []
    for i in range(len(rows)):
        value = rows[i].get(column)
        if value is None:
            raise ValueError(f"row {i}: the dataset's transform returns no {column!r} value")
        values.append(value if np.ndim(value) == 0 else len(value))
    checked = check_sample_values(np.asarray(values), f"transformed column {column!r}", whole=True)
    return checked.astype(np.int64)


__all__ = ["dataset_lengths", "lengths_column", "processor_overrides"]
