"""``dataset_lengths`` on video rows against the real processors' video path, in a side environment
that has torchvision (the video processors need it; CI's venv has none). Run as
``python -m tests.helpers.video_oracle_check N_VIDEOS N_ROWS SEED [FAMILY,...]`` with this checkout on
PYTHONPATH (``tests/tokenbal/integrations/test_lengths_videos.py::test_real_video_processors``
does, in the ``swift`` env: transformers 5.19 + torchvision 0.29.1 + PyAV). Prints one JSON line
per family x video settings: rows where both agree, rows both reject, and every disagreement.

The oracle (``family_processors.video_oracle``): the processor's chat template rendered, the
images and the videos handed to the processor's own ``__call__``, each video decoded whole with
PyAV with the metadata a whole-file decoder reports (transformers' own loader needs torchcodec,
absent there), so the processor's frame sampling, resizing, grids and prompt text are its own.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path


def main(n_videos: int, n_rows: int, seed: int, families: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    import datasets

    from tests.helpers import family_processors as fp
    from tokenbal.integrations.hf_lengths import dataset_lengths

    folder = Path(tempfile.mkdtemp(prefix="tokenbal-videos-"))
    videos = fp.write_videos(folder, n_videos, seed=seed)
    failed = 0
    for family in families or fp.VIDEO_FAMILIES:
        for k, settings in enumerate(fp.VIDEO_SETTINGS[family]):
            rows = fp.random_video_rows(n_rows, seed=seed + 7 * k + len(family), videos=videos)
            proc = fp.video_family_processor(family, real=True, settings=settings, subclass=True)
            agree = rejected = 0
            wrong = []
            accepted = []
            for i, row in enumerate(rows):
                try:
                    want = fp.video_oracle(proc, row)
                except Exception as e:  # noqa: BLE001 - the processor rejects the row
                    want = f"raises {type(e).__name__}"
                try:
                    got = int(dataset_lengths([row], proc)[0])
                except ValueError as e:
                    got = f"raises {type(e).__name__}" if str(e).startswith("row 0") else f"unnamed: {e}"
                if isinstance(want, str) and isinstance(got, str) and not got.startswith("unnamed"):
                    rejected += 1
                elif want == got:
                    agree += 1
                    accepted.append(i)
                else:
                    wrong.append({"row": i, "processor": want, "dataset_lengths": got, "shape": row["shape"]})
            # the packed Trainer's collator step: the processor's own output for the row
            from tokenbal.integrations.trainer_support import process_row

            collated = 0
            for i in [i for i in accepted if len(rows[i]["files"]) <= 1][:12]:
                # (rows of 2+ videos: OneVision / InternVL stack a row's videos into one tensor,
                # which fails for different frame counts with return_tensors="pt")
                got = len(process_row(rows[i], proc)["input_ids"])
                want = int(dataset_lengths([rows[i]], proc)[0])
                collated += 1
                if got != want:
                    wrong.append({"row": i, "process_row": got, "dataset_lengths": want})
            # the same rows as a datasets.Dataset (a Video(decode=False) column where the rows hold
            # files), counted in one call and with num_proc=2
            table = [{"messages": rows[i]["messages"], "images": rows[i]["images"],
                      "videos": [{"bytes": None, "path": p} for p in rows[i]["files"]]}
                     for i in accepted if rows[i]["shape"] in ("column", "parts")]
            if table:
                column = datasets.Sequence(datasets.Video(decode=False))
                ds = datasets.Dataset.from_list(table).cast_column("videos", column)
                expect = [int(dataset_lengths([rows[i]], proc)[0]) for i in accepted
                          if rows[i]["shape"] in ("column", "parts")]
                for num_proc in (None, 2):
                    got = dataset_lengths(ds, proc, num_proc=num_proc, cache=False).tolist()
                    if got != expect:
                        wrong.append({"dataset": True, "num_proc": num_proc, "got": got, "want": expect})
            failed += len(wrong)
            shapes = sorted({rows[i]["shape"] for i in accepted})
            print(json.dumps({"family": family, "settings": settings, "rows": len(rows), "agree": agree,
                              "both_reject": rejected, "process_row": collated, "wrong": wrong[:5],
                              "n_wrong": len(wrong), "shapes": shapes, "videos": n_videos}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    only = sys.argv[4].split(",") if sys.argv[4:] else None
    sys.exit(main(*(int(a) for a in sys.argv[1:4]), families=only))
