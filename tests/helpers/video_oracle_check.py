"""``dataset_lengths`` on video rows against the real processors' video path, in a side environment
that has torchvision (the video processors need it; CI's venv has none). Run as
``python -m tests.helpers.video_oracle_check N_VIDEOS N_ROWS SEED [FAMILY,...]`` with this checkout on
PYTHONPATH (``tests/tokenbal/integrations/test_lengths_videos.py::test_real_video_processors``
does, in each ``tf-X.Y-video`` env: torch + torchvision 0.29.1 + PyAV). Prints one JSON line
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
    from tokenbal.integrations.trainer_support import process_row

    folder = Path(tempfile.mkdtemp(prefix="tokenbal-videos-"))
    videos = fp.write_videos(folder, n_videos, seed=seed)
    failed = 0
    for family in families or fp.VIDEO_ENV_FAMILIES:
        pool = fp.oracle_video_pool(family, videos, folder, n_videos, seed, least=4)
        for k, settings in enumerate(fp.VIDEO_SETTINGS[family]):
            rows = fp.random_video_rows(n_rows, seed=seed + 7 * k + len(family), videos=pool)
            if family == "smolvlm":   # + text-only rows of string content (its own template)
                rows += [{**r, "videos": [], "files": []}
                         for r in fp.random_rows(n_rows // 10, seed=seed + k, shapes=("string",))]
            proc = fp.video_family_processor(family, real=True, settings=settings, subclass=True)
            judged = [processor_length(proc, family, row) for row in rows]
            by_parts = sum(from_parts for _, from_parts in judged)
            agree, rejected, accepted, wrong = fp.tally_lengths(proc, rows, [want for want, _ in judged])
            # the accepted rows in one call too (rows with and without videos in one batch)
            batch = dataset_lengths([rows[i] for i in accepted], proc).tolist()
            wrong += [{"row": i, "batched": got, "processor": judged[i][0]}
                      for i, got in zip(accepted, batch, strict=True) if got != judged[i][0]]
            # the packed Trainer's collator step: the processor's own output for the row (rows of two
            # videos of different frame counts: OneVision's / InternVL's video by video)
            collated = refused_by_process_row = 0
            for i in ([i for i in accepted if len(rows[i]["files"]) <= 1][:12]
                      + [i for i in accepted if len(rows[i]["files"]) > 1][:8]):
                if family == "smolvlm" and rows[i]["files"] and rows[i]["images"]:
                    # its processor returns only the videos' pixel_values for such a row: refused
                    try:
                        process_row(rows[i], proc)
                        wrong.append({"row": i, "process_row": "took a row with images and videos"})
                    except ValueError as e:
                        refused_by_process_row += "returns only the videos' pixel_values" in str(e)
                    continue
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
            # a user's subclass overriding the processor (dataset_lengths then runs the longest rows
            # through it) over a videos column of another name: the check reads that column too
            renamed_override = 0
            column_rows = [i for i in accepted if rows[i]["shape"] == "column" and rows[i]["files"]][:6]
            if k == 0 and column_rows:
                overriding = _overriding_call(proc)
                renamed = [{("clips" if key == "videos" else key): v for key, v in rows[i].items()}
                           for i in column_rows]
                try:
                    got = dataset_lengths(renamed, overriding, videos="clips", cache=False).tolist()
                except ValueError as e:
                    got = f"raises {e}"[:300]
                expect = [int(dataset_lengths([rows[i]], proc)[0]) for i in column_rows]
                if got == expect:
                    renamed_override = len(column_rows)
                else:
                    wrong.append({"renamed_videos_column_override": got, "want": expect})
            parts_equal = 0
            if family in ("internvl", "llava-onevision"):
                for i in [i for i in accepted if rows[i]["files"]][:12]:
                    if (err := _parts_equal_call(proc, family, rows[i])) is None:
                        parts_equal += 1
                    elif err != "processor raises":
                        wrong.append({"row": i, "parts_vs_call": err})
            failed += len(wrong)
            shapes = sorted({rows[i]["shape"] for i in accepted})
            print(json.dumps({"family": family, "settings": settings, "rows": len(rows), "agree": agree,
                              "both_reject": rejected, "process_row": collated,
                              "process_row_refused": refused_by_process_row, "by_parts": by_parts,
                              "parts_equal_call": parts_equal, "renamed_override": renamed_override,
                              "wrong": wrong[:5],
                              "n_wrong": len(wrong), "shapes": shapes, "videos": n_videos}), flush=True)
    return 1 if failed else 0


def _overriding_call(proc):
    """``proc`` as an instance of a user's subclass whose ``__call__`` overrides the processor's
    without changing what it returns (so dataset_lengths checks its counts against it)."""
    import copy

    def __call__(self, *args, **kwargs):
        return super(type(self), self).__call__(*args, **kwargs)

    mine = copy.copy(proc)
    mine.__class__ = type(f"My{type(proc).__name__}", (type(proc),), {"__call__": __call__})
    return mine


def _prepared(proc, row: dict) -> tuple:
    """What ``process_row`` hands the processor: text, images, video arguments, special-token rule."""
    from tokenbal.integrations import trainer_support as ts

    conv = [dict(m) for m in row["messages"]]
    text = proc.apply_chat_template([conv], tokenize=False)
    text = text[0] if isinstance(text, list) else text
    imgs = [ts._as_image(v) for v in row["images"]]
    kw = {"add_special_tokens": False} if text.startswith(proc.tokenizer.bos_token) else {}
    return text, imgs, ts._row_videos(row, conv, proc, 0, "messages"), kw


def processor_length(proc, family: str, row: dict) -> tuple[int | str, bool]:
    """(the row's length by the real processor, whether it came from the processor's parts): its
    own ``input_ids`` (``family_processors.video_oracle``), or "raises X" where it rejects the row;
    InternVL rows its ``__call__`` cannot stack are built from the processor's parts, as the packed
    Trainer builds them (``_parts_equal_call`` checks those against ``__call__`` where it runs)."""
    from tests.helpers import family_processors as fp
    from tokenbal.integrations.trainer_support import process_row

    try:
        return fp.video_oracle(proc, row), False
    except Exception as e:  # noqa: BLE001 - the processor rejects the row
        if family == "internvl" and internvl_call_rejects(proc, row):
            return len(process_row(row, proc)["input_ids"]), True
        return f"raises {type(e).__name__}", False


def internvl_call_rejects(proc, row: dict) -> bool:
    """Whether InternVL's ``__call__`` cannot take the row (videos of different frame counts, a
    video before the first image): the packed Trainer builds such rows from the processor's parts."""
    from tokenbal.estimate.chat_video import internvl_row_rejected

    try:
        text, _, videos, _ = _prepared(proc, row)
    except ValueError:   # a video the processor cannot sample (too short): rejected anyway
        return False
    frames = [len(f) for f in videos.get("videos", [[]])[0]]
    why = internvl_row_rejected(text, proc.image_token, proc.video_token, frames) if frames else None
    return why is not None


def _parts_equal_call(proc, family: str, row: dict) -> str | None:
    """The video-by-video sample (``internvl_by_parts`` / ``_onevision_videos_apart``) against the
    processor's own ``return_tensors="pt"`` call on a row that call takes: None if input_ids and
    pixels are equal, else what differs ("processor raises" where the call cannot take the row)."""
    import torch

    from tokenbal.integrations import trainer_support as ts

    text, imgs, videos, kw = _prepared(proc, row)
    try:
        full = proc(text=[text], images=[imgs] if imgs else None, return_tensors="pt", **kw, **videos)
    except Exception:  # noqa: BLE001
        return "processor raises"
    if family == "internvl":
        parts = ts.internvl_by_parts(proc, text, imgs, videos, kw)
        pixels = [("pixel_values", parts["pixel_values"], full["pixel_values"])]
    else:
        parts = ts._onevision_videos_apart(proc, text, imgs, videos, kw)
        pixels = [("pixel_values_videos", torch.cat(parts["pixel_values_videos"]),
                   full["pixel_values_videos"].flatten(0, 1))]
        if imgs:   # the call pads each image's crops to the row's most: drop the all-zero padding
            crops = full["pixel_values"].flatten(0, 1)
            pixels.append(("pixel_values", parts["pixel_values"], crops[crops.flatten(1).abs().sum(1) > 0]))
    if not torch.equal(torch.as_tensor(parts["input_ids"]), torch.as_tensor(full["input_ids"])):
        return "input_ids differ"
    for name, a, b in pixels:
        if a.shape != b.shape or not torch.equal(a, b):
            return f"{name} differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return None


if __name__ == "__main__":
    only = sys.argv[4].split(",") if sys.argv[4:] else None
    sys.exit(main(*(int(a) for a in sys.argv[1:4]), families=only))
