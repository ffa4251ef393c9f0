"""``IndexedParquetDataset``: ``ds[i]`` is row ``i`` of an index built from Parquet files.

Each indexed sample remembers its (file, row group, row) (``tokenbal.index.parquet``), so a row is
found without scanning: the file's footer is read once per process, and the row group holding the
row is read (only ``columns``, default all) and kept until a row of another group is asked for. A
``TokenBalancedBatchSampler`` batch touches many row groups, so keep row groups small (datasets'
``to_parquet`` writes ~100 rows per group for image data) or sort a batch's reads by row group, as
``__getitems__`` does.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset


def _is_parquet(path: str) -> bool:
    from tokenbal.index.parquet import is_parquet

    return is_parquet(path)


class IndexedParquetDataset(Dataset):
    """Map-style dataset over a ``TokenIndex`` built from ``.parquet`` sources.

    ``index``: the ``TokenIndex`` or its folder. ``columns``: columns to return (default: all).
    ``decode_images``: ``None`` returns the image column as stored (``{bytes, path}`` structs);
    ``"pil"`` turns each image into a ``PIL.Image`` (the column named by the index's build options,
    or ``images`` / ``image``), EXIF-oriented when the index was built with ``exif="transpose"``.
    ``storage_options``: for remote files (fsspec). Returned dict: the row's
    columns plus ``__key__``, ``__shard__`` (the file) and ``__index__``.
    """

    def __init__(self, index: Any, columns: Sequence[str] | None = None, decode_images: str | None = None,
                 storage_options: dict | None = None, max_open_files: int = 8) -> None:
        from tokenbal.index import TokenIndex

        self.index = index if isinstance(index, TokenIndex) else TokenIndex.open(index)
        if decode_images not in (None, "pil"):
            raise ValueError(f"decode_images must be None or 'pil', got {decode_images!r}")
        self.columns = list(columns) if columns is not None else None
        self.decode_images = decode_images
        self.storage_options = dict(storage_options or {})
        self.max_open_files = max_open_files
        built = self.index.manifest.get("parquet") or {}
        self.image_column = built.get("image_column")
        # Decoded images match the index's counts: oriented like transformers' load_image when the
        # index counted them after EXIF orientation (its manifest says).
        self.exif = self.index.manifest.get("exif", "ignore")
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._group: tuple[str, int, Any] | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["index"] = self.index.path
        state["_files"], state["_group"] = OrderedDict(), None
        return state

    def __setstate__(self, state: dict) -> None:
        from tokenbal.index import TokenIndex

        self.__dict__.update(state)
        self.index = TokenIndex.open(state["index"])
        self._reset()

    def __len__(self) -> int:
        return len(self.index)

    def _file(self, path: str):
        from tokenbal._extras import require

        pq = require("pyarrow.parquet", "Parquet-backed datasets")

        if os.getpid() != self._pid:   # a forked DataLoader worker: do not share open files
            self._reset()
        pf = self._files.get(path)
        if pf is None:
            from tokenbal.io.remote import RemoteOptions, RetryingFile, is_url, object_info

            if is_url(path):
                # Each ranged read retried, with deadlines (as the index build reads the file).
                opts = RemoteOptions(storage_options=self.storage_options)
                pf = pq.ParquetFile(RetryingFile(path, object_info(path, opts)["size"], opts),
                                    page_checksum_verification=True)
            else:   # page CRCs checked where the file has them, as the index build does
                pf = pq.ParquetFile(path, page_checksum_verification=True)
            self._files[path] = pf
            while len(self._files) > self.max_open_files:
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(path)
        return pf

    def locate(self, i: int) -> tuple[str, int, int]:
        """``(file, row group, row in group)`` of sample ``i``."""
        path = self.index.shard(i)
        if not _is_parquet(path):   # a tar / annotation sample (the index may mix sources)
            from tokenbal.data.indexed import SampleReadError

            raise SampleReadError(f"sample {i} ({self.index.keys[i]!r}) comes from {path}, not a Parquet "
                                  "file: read it with tokenbal.data.IndexedShardDataset")
        (m,) = self.index.members(i)
        return path, m.offset, m.size

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        path, rg, row = self.locate(i)
        if self._group is None or self._group[:2] != (path, rg) or os.getpid() != self._pid:
            pf = self._file(path)
            self._group = (path, rg, pf.read_row_group(rg, columns=self.columns))
        table = self._group[2]
        if row >= table.num_rows:
            raise IndexError(f"sample {i} ({self.index.keys[i]!r}): row {row} of row group {rg} of {path} "
                             f"does not exist ({table.num_rows} rows); the file changed since the index "
                             "was built (rebuild it)")
        out = {name: table.column(name)[row].as_py() for name in table.column_names}
        if self.decode_images == "pil":
            self._decode(out)
        return {"__key__": self.index.keys[i], "__shard__": path, "__index__": i, **out}

    def _decode(self, row: dict) -> None:
        from PIL import Image, ImageOps

        col = self.image_column or next((c for c in ("images", "image") if c in row), None)
        if col is None or row.get(col) is None:
            return
        value = row[col]

        def one(v):
            data = v.get("bytes") if isinstance(v, dict) else v
            im = Image.open(io.BytesIO(data))
            im.load()
            return ImageOps.exif_transpose(im) if self.exif == "transpose" else im

        row[col] = [one(v) for v in value] if isinstance(value, list) else one(value)

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """A batch, read in (file, row group) order so each group is read once, returned as asked."""
        order = sorted(range(len(indices)), key=lambda j: self.locate(int(indices[j]))[:2])
        out: list[dict | None] = [None] * len(indices)
        for j in order:
            out[j] = self[indices[j]]
        return out  # type: ignore[return-value]
