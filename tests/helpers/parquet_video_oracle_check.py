"""``tokenbal index build --processor DIR`` on Parquet rows with videos against the real processors'
video path, in a side environment with torchvision (the video processors need it). Run as
``python -m tests.helpers.parquet_video_oracle_check N_VIDEOS N_ROWS SEED`` with this checkout on
PYTHONPATH (``tests/tokenbal/index/test_parquet_videos.py::test_real_video_processors_parquet``
does, in each ``tf-X.Y-video`` env).

Per video family (its class-default video settings): the real processor saved with its own
``save_pretrained`` and loaded by the build from that folder; random video rows
(``family_processors.random_video_rows``: 0-2 videos and 0-2 images, system turns, every video row
shape) written as Parquet files the way ``datasets.Dataset.to_parquet`` lays them out: a
``messages`` column of part structs, an ``images`` column of bytes and a ``videos`` column per file
of paths, of bytes, or of ``{bytes, path}`` structs (Arrow holds one type per column, so one file
per kind), and a file whose parts name the videos (no ``videos`` column). The index's length of
each row must be the processor's own ``input_ids`` length of the row
(``video_oracle_check.processor_length``); rows it rejects must be errors naming the row.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

# video row shape -> the Parquet file it goes to (the kind of its ``videos`` column)
FILE_OF_SHAPE = {"column": "paths", "parts": "paths", "column_bytes": "bytes", "column_dict": "structs",
                 "inline_video": "inline", "inline_path": "inline", "inline_url": "inline"}


def write_parquet_files(rows: list, folder: Path) -> dict[str, list[int]]:
    """Each row in the Parquet file of its shape's kind (``FILE_OF_SHAPE``), in order; returns
    ``{file path: [row index in rows, ...]}`` (Parquet row ``k`` of the file is ``rows[ids[k]]``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(FILE_OF_SHAPE[row["shape"]], []).append(i)
    out = {}
    for kind, ids in groups.items():
        cols = {"messages": [rows[i]["messages"] for i in ids],
                "images": [list(rows[i]["images"]) for i in ids]}
        if kind != "inline":
            cols["videos"] = [list(rows[i]["videos"]) for i in ids]
        path = folder / f"{kind}.parquet"
        pq.write_table(pa.table(cols), str(path))
        out[str(path)] = ids
    return out


def check(family: str, videos: list[str], n_rows: int, seed: int, folder: Path) -> dict:
    from tests.helpers import family_processors as fp
    from tests.helpers.index_oracles import build_and_read
    from tests.helpers.video_oracle_check import processor_length

    proc = fp.video_family_processor(family, real=True)
    pdir = folder / "processor"
    proc.save_pretrained(str(pdir))
    rows = fp.random_video_rows(n_rows, seed=seed, videos=videos)
    files = write_parquet_files(rows, folder)
    got, errors, idx = build_and_read(list(files), folder / "idx", pdir)
    agree = rejected = 0
    wrong = []
    shapes = set()
    for path, ids in files.items():
        for k, i in enumerate(ids):
            key = f"{Path(path).name}:0:{k}"
            want, _ = processor_length(proc, family, rows[i])
            indexed = got.get(key, f"error: {errors.get(key, 'not indexed, no error')}")
            if isinstance(want, str) and key in errors:
                rejected += 1
            elif want == indexed:
                agree += 1
                shapes.add(rows[i]["shape"])
            else:
                wrong.append({"key": key, "processor": want, "index": str(indexed)[:300],
                              "shape": rows[i]["shape"]})
    return {"family": family, "rows": len(rows), "agree": agree, "all_reject": rejected,
            "n_wrong": len(wrong), "wrong": wrong[:5], "videos_indexed": int(idx.manifest["num_videos"]),
            "shapes": sorted(shapes)}


def main(n_videos: int, n_rows: int, seed: int) -> int:
    warnings.filterwarnings("ignore")
    from tests.helpers.index_oracles import each_video_family

    return 1 if each_video_family("tokenbal-parquet-videos-", n_videos, seed, check, n_rows) else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:4])))
