"""``tokenbal index build --processor DIR`` on Phi-4-multimodal image records against the real
``Phi4MultimodalProcessor`` (its image processor needs torchvision; CI's venv has none). Run as
``python -m tests.helpers.phi4_index_oracle_check N_ROWS SEED`` with this checkout on PYTHONPATH
(``tests/tokenbal/index/test_processor_phi4.py::test_real_phi4_processor_index_build`` does, in
each ``tf-X.Y-video`` env).

Per setting (``dynamic_hd`` 4 / 12 / the hub's 36; the class and a user's subclass): the real
processor, with its real audio feature extractor, saved with its own ``save_pretrained``; random rows
of 0-3 images (8-2,000 px, extreme aspect ratios, EXIF-rotated JPEGs; every row shape: an
``images`` field, image paths in the parts, OpenAI ``image_url`` parts, string content; system
and multi-turn) as JSONL records, the ``images``-field rows also as tar samples (a ``.json`` member
+ image members), plus records with audio (an ``audios`` field, an audio part); indexed by two scan
workers loading the folder. Prints one JSON line per setting: records where the index's length is
the processor's own ``input_ids`` length (``family_processors.oracle``), records both reject (the
processor raising, the index listing the record as an error), and every disagreement.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

SETTINGS = [({"dynamic_hd": 4}, False), ({"dynamic_hd": 12}, True), ({}, True)]   # {}: the hub's 36


def phi4_exif_rows(n_rows: int, seed: int) -> list:
    """``family_processors.phi4_rows`` with about one image in six an EXIF-rotated JPEG (orientation
    3 / 5-8: stored sideways, transposed by the processor's loader)."""
    import random

    from tests.helpers import family_processors as fp

    rng = random.Random(seed + 2)
    rows = fp.phi4_rows(n_rows, seed)
    for row in rows:
        row["images"] = [fp.exif_jpeg(*fp.phi4_image_size(rng), rng.choice([3, 5, 6, 7, 8]),
                                      rng.randrange(99)) if rng.random() < 0.17 else b
                         for b in row["images"]]
    return rows


def _ext(data: bytes) -> str:
    return "jpg" if data[:2] == b"\xff\xd8" else "png"


def records_of(rows: list, folder: Path) -> tuple[list[dict], list]:
    """JSONL records of materialised rows (``family_processors.materialise``: parts name image
    files; ``column`` rows keep their bytes, written here to files named in ``images``), and tar
    samples of the ``column`` rows (``(key, Sample)``)."""
    from tests.helpers.corpus import Sample
    from tests.helpers.family_processors import write_images

    records, samples = [], []
    for i, row in enumerate(rows):
        rec = {"id": f"r{i}", "messages": row["messages"]}
        if row["images"]:
            rec["images"] = write_images(row["images"], folder, f"c{i}", ".img")
        records.append(rec)
        if row["shape"] == "column" and row["images"]:
            many = len(row["images"]) > 1
            raw = [(f"{j}.{_ext(b)}" if many else _ext(b), b) for j, b in enumerate(row["images"])]
            samples.append((i, Sample(key=f"t{i}", messages=row["messages"], raw=raw)))
    return records, samples


def audio_records() -> list[dict]:
    text = [{"type": "text", "text": "what do you hear"}]
    reply = {"role": "assistant", "content": [{"type": "text", "text": "a bird"}]}
    clip = {"type": "audio", "audio": "clip.wav"}
    return [{"id": "audios_field", "messages": [{"role": "user", "content": text}, reply],
             "audios": ["clip.wav"]},
            {"id": "audio_part", "messages": [{"role": "user", "content": [clip, *text]}, reply]}]


def check(settings: dict, subclass: bool, n_rows: int, seed: int, folder: Path) -> dict:
    from tests.helpers import family_processors as fp
    from tests.helpers.corpus import write_shard
    from tests.helpers.index_oracles import build_and_read

    proc = fp.phi4_processor(real=True, subclass=subclass, **settings)
    pdir = folder / "processor"
    proc.save_pretrained(str(pdir))
    saved_as = json.loads((pdir / "processor_config.json").read_text()).get("processor_class")
    raw = phi4_exif_rows(n_rows, seed)
    rows = fp.materialise(raw, folder)
    records, samples = records_of(rows, folder)
    src = folder / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records + audio_records()))
    shard = write_shard(folder / "train-000.tar", [s for _, s in samples])
    got, errors, _ = build_and_read([str(src), shard], folder / "idx", pdir)
    cases = [(r["id"], row) for r, row in zip(records, rows, strict=True)]
    cases += [(s.key, rows[i]) for i, s in samples]
    agree = rejected = 0
    wrong, n_images = [], set()
    for key, row in cases:
        try:
            want = fp.oracle(proc, row)
        except ValueError as e:
            want = f"processor raises: {str(e)[:80]}"
        indexed = got.get(key, f"error: {errors.get(key, 'not indexed, no error')}")
        if isinstance(want, str) and key in errors:
            rejected += 1
        elif want == indexed:
            agree += 1
            n_images.add(len(raw[int(key[1:])]["images"]))
        else:
            wrong.append({"key": key, "processor": want, "index": str(indexed)[:300], "shape": row["shape"]})
    audio = {k: errors.get(k, "") for k in ("audios_field", "audio_part")}
    audio_errors = sum("audio" in reason for reason in audio.values())
    exif = sum(1 for key, row in cases if key in got and any(b[:2] == b"\xff\xd8" and b"Exif" in b[:64]
                                                              for b in raw[int(key[1:])]["images"]))
    return {"processor": type(proc).__name__, "saved_as": saved_as, "exif_rows": exif,
            "settings": settings, "records": len(cases),
            "agree": agree, "rejected": rejected, "n_wrong": len(wrong), "wrong": wrong[:5],
            "audio_errors": audio_errors, "audio_reasons": list(audio.values()),
            "tar_samples": len(samples), "images_per_row": sorted(n_images),
            "shapes": sorted({row["shape"] for key, row in cases if key in got})}


def main(n_rows: int, seed: int) -> int:
    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(prefix="tokenbal-index-phi4-"))
    failed = 0
    for k, (settings, subclass) in enumerate(SETTINGS):
        folder = root / str(k)
        folder.mkdir()
        result = check(settings, subclass, n_rows, seed + k, folder)
        failed += result["n_wrong"] + (result["audio_errors"] != 2)
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
