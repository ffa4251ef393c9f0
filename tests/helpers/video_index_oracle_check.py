"""``tokenbal index build --processor DIR`` on video chat records against the real processors'
video path and ``dataset_lengths``, in a side environment that has torchvision (the video
processors need it). Run as ``python -m tests.helpers.video_index_oracle_check N_VIDEOS N_ROWS
SEED [FAMILY,...]`` with this checkout on PYTHONPATH
(``tests/tokenbal/index/test_processor_videos.py::test_real_video_processors_index_build`` does, in
each ``tf-X.Y-video`` env: torch 2.14.1 + torchvision 0.29.1 + PyAV). InternVL records its processor's
``__call__`` cannot take (videos of different frame counts) are expected at ``process_row``'s length.

Per family x video settings: the real processor (``family_processors.video_family_processor(real=
True)``) is saved with its own ``save_pretrained`` and the build loads that folder (AutoProcessor,
no stand-in); random rows become JSONL records (videos in a ``videos`` field or named in the parts)
and tar samples (one video member each), indexed by two scan workers. Prints one JSON line per
case: records where the index, ``dataset_lengths`` and the processor's own ``input_ids``
(``family_processors.video_oracle``) agree, records all three reject (the index lists them as
errors), and every disagreement.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path


def records_of(rows: list, folder: Path) -> list[dict]:
    """Rows as annotation records: image files in ``images``, videos in ``videos`` (column shapes)
    or named in the parts."""
    from tests.helpers.family_processors import write_images

    out = []
    for i, row in enumerate(rows):
        images = write_images(row["images"], folder, f"img{i}", ".png")
        rec = {"id": f"r{i}", "messages": row["messages"]}
        if images:
            rec["images"] = images
        if row["shape"].startswith("column") and row["files"]:
            rec["videos"] = list(row["files"])
        out.append(rec)
    return out


def check(family: str, settings: dict, videos: list[str], n_rows: int, seed: int, folder: Path) -> dict:
    from tests.helpers import family_processors as fp
    from tests.helpers.corpus import Sample, write_shard
    from tests.helpers.video_oracle_check import processor_length
    from tokenbal import TokenIndex
    from tokenbal.index import build_index
    from tokenbal.integrations.hf_lengths import dataset_lengths

    proc = fp.video_family_processor(family, real=True, settings=settings)
    pdir = folder / "processor"
    proc.save_pretrained(str(pdir))
    rows = fp.random_video_rows(n_rows, seed=seed, videos=videos)
    records = records_of(rows, folder)
    src = folder / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records))
    # tar samples: a JSON member with one video part and the video as a member
    mp4 = [v for v in videos if v.endswith(".mp4")][:6]
    samples, tar_rows = [], []
    for i, v in enumerate(mp4):
        ask = {"type": "text", "text": f"what is in clip {i}?"}
        msgs = [{"role": "user", "content": [{"type": "video"}, ask]},
                {"role": "assistant", "content": [{"type": "text", "text": "a clip"}]}]
        samples.append(Sample(key=f"t{i}", messages=msgs, raw=[("mp4", Path(v).read_bytes())]))
        tar_rows.append({"messages": msgs, "images": [], "files": [v], "videos": [v]})
    shard = write_shard(folder / "train-000.tar", samples)
    # two scan workers (spawned processes, each loading the folder's processor itself)
    build_index([str(src), shard], folder / "idx", processor=str(pdir), progress=False, workers=2)
    idx = TokenIndex.open(folder / "idx")
    got = dict(zip(idx.keys, idx.lengths.tolist(), strict=True))
    errors = {e["key"]: e["reason"] for e in idx.errors}
    agree = rejected = 0
    wrong = []
    cases = [(r["id"], r, row) for r, row in zip(records, rows, strict=True)]
    cases += [(f"t{i}", row, row) for i, row in enumerate(tar_rows)]
    for key, rec, row in cases:
        want, _ = processor_length(proc, family, row)
        try:
            lengths = int(dataset_lengths([{k: v for k, v in rec.items() if k != "files"}], proc)[0])
        except ValueError as e:
            lengths = f"raises {type(e).__name__}"
        indexed = got.get(key, f"error: {errors.get(key, 'not indexed, no error')}")
        if isinstance(want, str) and isinstance(lengths, str) and key in errors:
            rejected += 1
        elif want == lengths == indexed:
            agree += 1
        else:
            wrong.append({"key": key, "processor": want, "dataset_lengths": lengths,
                          "index": str(indexed)[:300], "shape": row.get("shape", "tar")})
    return {"family": family, "settings": settings, "records": len(cases), "agree": agree,
            "all_reject": rejected, "wrong": wrong[:5], "n_wrong": len(wrong),
            "videos_indexed": int(idx.manifest["num_videos"]),
            "shapes": sorted({row.get("shape", "tar") for key, _, row in cases if key in got})}


def main(n_videos: int, n_rows: int, seed: int, families: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    from tests.helpers import family_processors as fp

    root = Path(tempfile.mkdtemp(prefix="tokenbal-index-videos-"))
    videos = fp.write_videos(root, n_videos, seed=seed)
    failed = 0
    for family in families or fp.VIDEO_ENV_FAMILIES:
        pool = fp.oracle_video_pool(family, videos, root, n_videos, seed, least=3)
        for k, settings in enumerate(fp.VIDEO_SETTINGS[family]):
            folder = root / f"{family}-{k}"
            folder.mkdir()
            result = check(family, settings, pool, n_rows, seed + 7 * k + len(family), folder)
            failed += result["n_wrong"]
            print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    only = sys.argv[4].split(",") if sys.argv[4:] else None
    sys.exit(main(*(int(a) for a in sys.argv[1:4]), families=only))
