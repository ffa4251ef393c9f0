"""``tokenbal index build --processor DIR`` on LLaVA-Video / OneVision style records (``{"video":
"x.mp4", "conversations": [{"from": "human", "value": "<video>\\n..."}, ...]}``) against the real
processors' video path, in a side environment with torchvision (the video processors need it). Run
as ``python -m tests.helpers.llava_video_oracle_check N_VIDEOS N_RECORDS SEED`` with this checkout
on PYTHONPATH (``tests/tokenbal/index/test_llava_video_records.py::
test_real_processors_llava_video_records`` does, in each ``tf-X.Y-video`` env).

Per video family (its class-default video settings): the real processor saved with its own
``save_pretrained``, loaded by the build from that folder. Each record is drawn as turns of pieces
(text, and one ``<video>`` in a human turn, placed first, last or inside the text; system turns,
1-3 exchanges) and written twice: as the LLaVA record (the pieces joined into ``value`` strings, the
file in ``video``) and, independently of tokenbal's conversion, as the chat row the processor takes
(``{"type": "video"}`` part in place, the text pieces verbatim). The record's length in the index
must be that row's ``input_ids`` length under the processor (``video_oracle_check.processor_length``);
JSONL records and tar samples (a ``.json`` member + the video member); a record whose ``<video>``
count differs from its videos must be an error naming it.
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path

_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _part(piece: str | None) -> dict:
    return {"type": "video"} if piece is None else {"type": "text", "text": piece}


def llava_video_record(rng: random.Random, video: str, key: str) -> tuple[dict, dict]:
    """(the LLaVA record, the chat row the processor takes for it)."""
    from tests.helpers.family_processors import _text

    turns = []
    if rng.random() < 0.3:
        turns.append(("system", [_text(rng)]))
    n = rng.randint(1, 3)
    for t in range(n):
        ask = [_text(rng)]
        if t == 0:   # the video in the first human turn, as the datasets put it
            where = rng.choice(["first", "first", "last", "inside"])
            if where == "first":
                ask = [None, "\n" + ask[0]]
            elif where == "last":
                ask = [ask[0] + "\n", None]
            else:
                ask = [ask[0] + " ", None, " " + _text(rng)]
        turns.append(("human", ask))
        turns.append(("gpt", [_text(rng)]))
    conversations = [{"from": who, "value": "".join("<video>" if p is None else p for p in pieces)}
                     for who, pieces in turns]
    messages = [{"role": _ROLES[who], "content": [_part(p) for p in pieces if p != ""]}
                for who, pieces in turns]
    record = {"id": key, "video": video, "conversations": conversations}
    return record, {"messages": messages, "images": [], "files": [video], "videos": [video]}


def check(family: str, videos: list[str], n_records: int, seed: int, folder: Path) -> dict:
    from tests.helpers import family_processors as fp
    from tests.helpers.corpus import Sample, write_shard
    from tests.helpers.index_oracles import build_and_read
    from tests.helpers.video_oracle_check import processor_length

    proc = fp.video_family_processor(family, real=True)
    pdir = folder / "processor"
    proc.save_pretrained(str(pdir))
    rng = random.Random(seed)
    cases = [llava_video_record(rng, rng.choice(videos), f"r{i}") for i in range(n_records)]
    bad = {"id": "two_placeholders", "video": videos[0],
           "conversations": [{"from": "human", "value": "<video>\n<video>\nboth?"},
                             {"from": "gpt", "value": "one"}]}
    src = folder / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [c[0] for c in cases] + [bad]))
    mp4 = [c for c in cases if c[0]["video"].endswith(".mp4")][:4]
    samples = [Sample(key=f"t{k}", conversations=rec["conversations"],
                      raw=[("mp4", Path(rec["video"]).read_bytes())]) for k, (rec, _) in enumerate(mp4)]
    shard = write_shard(folder / "train-000.tar", samples)
    got, errors, idx = build_and_read([str(src), shard], folder / "idx", pdir)
    agree = rejected = 0
    wrong = []
    keyed = [(rec["id"], row) for rec, row in cases]
    keyed += [(s.key, row) for s, (_, row) in zip(samples, mp4, strict=True)]
    for key, row in keyed:
        want, _ = processor_length(proc, family, row)
        indexed = got.get(key, f"error: {errors.get(key, 'not indexed, no error')}")
        if isinstance(want, str) and key in errors:
            rejected += 1
        elif want == indexed:
            agree += 1
        else:
            wrong.append({"key": key, "processor": want, "index": str(indexed)[:300]})
    return {"family": family, "records": len(keyed), "agree": agree, "all_reject": rejected,
            "n_wrong": len(wrong), "wrong": wrong[:5], "tar_samples": len(samples),
            "videos_indexed": int(idx.manifest["num_videos"]),
            "placeholder_error": "2 video placeholder(s)" in errors.get("two_placeholders", "")}


def main(n_videos: int, n_records: int, seed: int) -> int:
    warnings.filterwarnings("ignore")
    from tests.helpers.index_oracles import each_video_family

    return 1 if each_video_family("tokenbal-llava-video-", n_videos, seed, check, n_records) else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:4])))
