"""``dataset_lengths`` against running the processor, in the same process, on the same dataset.

Baseline: what a user writes today, ``len(processor.apply_chat_template([row["messages"]],
images=[row["images"]] or None, tokenize=True, return_dict=True)["input_ids"][0])`` for every
row ``row = ds[i]`` (datasets decodes the images; the processor resizes and patchifies them).
Ours: ``tokenbal.integrations.hf.dataset_lengths(ds, processor)`` (headers only, one batched
tokenizer call per 1000 rows), uncached, then the cached call.

The processor is transformers' real ``Qwen2VLProcessor`` with Qwen2-VL's chat template, a
byte-level BPE tokenizer trained here (no downloads) and ``--max-pixels`` (default 1003520, i.e.
1280 image tokens, a common fine-tuning setting). Images are JPEG photos-like (noise + gradient) of
random sizes in ``--min-side``..``--max-side``, 0-3 per row, multi-turn chats with system turns.
The counts are checked equal before any time is printed.

    python scripts/bench_hf_lengths.py [--rows 200] [--repeats 3]
    python scripts/bench_hf_lengths.py --min-side 28 --max-side 640 --max-pixels 75264  # tiny images
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harness import environment_line, jpeg_photo, measure, ratio, timed  # noqa: E402


def _rows(n: int, min_side: int, max_side: int, seed: int, text_only: bool = False) -> list[dict]:
    from tests.helpers import chat_processors as cp

    rows = cp.chat_rows(n, seed=seed)
    rng = random.Random(seed)
    for i, row in enumerate(rows):   # photo-sized images instead of the tests' tiny ones
        if text_only:
            row["images"] = []
            for m in row["messages"]:
                kept = [c for c in m["content"] if c["type"] != "image"]
                m["content"] = kept or [{"type": "text", "text": "x"}]
        row["images"] = [jpeg_photo(rng.randint(min_side, max_side), rng.randint(min_side, max_side),
                                    i * 7 + j)
                         for j in range(len(row["images"]))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of dataset_lengths (median)")
    ap.add_argument("--max-pixels", type=int, default=1003520)
    ap.add_argument("--min-side", type=int, default=256)
    ap.add_argument("--max-side", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-only", action="store_true", help="no images: the template and tokenizer alone")
    args = ap.parse_args()

    import tempfile

    import transformers

    from tests.helpers import chat_processors as cp
    from tokenbal.integrations.hf import dataset_lengths

    transformers.logging.set_verbosity_error()
    proc = cp.processor(cp.QWEN2_VL, min_pixels=3136, max_pixels=args.max_pixels)
    rows = _rows(args.rows, args.min_side, args.max_side, args.seed, args.text_only)
    ds = cp.hf_dataset(rows)
    n_images = sum(len(r["images"]) for r in rows)
    print(environment_line())
    print(f"{args.rows} rows, {n_images} JPEG images {args.min_side}..{args.max_side} px, "
          f"max_pixels={args.max_pixels}, Qwen2VLProcessor + Qwen2-VL chat template")

    def baseline() -> np.ndarray:
        return np.array([cp.oracle_length(proc, ds[i]) for i in range(len(ds))])

    want, base_wall, base_cpu = timed(baseline)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TOKENBAL_CACHE"] = cache
        got = dataset_lengths(ds, proc, cache=False)
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise SystemExit(f"MISMATCH on {len(bad)} rows, first {bad[:5].tolist()}: "
                             f"{got[bad[:5]].tolist()} vs {want[bad[:5]].tolist()}")
        ours = measure(lambda: dataset_lengths(ds, proc, cache=False), repeats=args.repeats, warmup=0)
        dataset_lengths(ds, proc)   # fills the cache
        cached = measure(lambda: dataset_lengths(ds, proc), repeats=args.repeats, warmup=0)
    print(f"counts equal on all {len(want)} rows (total {int(want.sum()):,} tokens)")
    print(f"processor (baseline): {base_wall:8.3f} s wall {base_cpu:8.3f} s CPU  "
          f"({base_wall / len(ds) * 1e3:.2f} ms/row)")
    per_row = ours.wall_median / len(ds) * 1e3
    print(f"dataset_lengths:      {ours.wall_median:8.3f} s wall {ours.cpu_median:8.3f} s CPU  "
          f"({per_row:.3f} ms/row)  speed-up {ratio(base_wall, ours.wall_median)} wall, "
          f"{ratio(base_cpu, ours.cpu_median)} CPU")
    print(f"dataset_lengths cached: {cached.wall_median * 1e3:.2f} ms wall  "
          f"speed-up {ratio(base_wall, cached.wall_median)} wall")


if __name__ == "__main__":
    main()
