"""``dataset_lengths`` against running each family's processor, in the same process, on the same
rows (issue 50).

Per family, the real transformers processor at its checkpoints' image settings (Qwen2/2.5/3-VL
``max_pixels`` 1003520, GLM-4.1V class defaults, InternVL 448-px tiles up to 12 + thumbnail with
256 tokens each, LLaVA-1.5 336-px crop, LLaVA-NeXT 336 px and the five v1.6 pinpoints, OneVision
384 px and its 36 pinpoints, Idefics3 1456 / 364 px with 169 tokens per tile), over a byte-level
BPE tokenizer trained here (no downloads), with a chat template of the family's layout. Rows: a
mixture of text-only, one-image and multi-image (2-3) rows, system turns, 1-3 exchanges, JPEG
photos of random sizes in ``--min-side``..``--max-side`` in a ``datasets.Dataset`` images column.

Baseline: what ``apply_chat_template([row["messages"]], images=[row["images"]], tokenize=True)``
does for each ``row = ds[i]`` (datasets decodes the images; the processor resizes and
patchifies), through the public steps that run on every transformers (render, then the processor's
call). Ours: ``dataset_lengths(ds, processor, cache=False)``, single process, then ``num_proc=N``.
The counts are checked equal on every row before any time is printed.

    python scripts/bench_lengths_families.py [--rows 200] [--families qwen2-vl,internvl] [--num-proc 2]

``--videos N`` (needs torchvision: the video processors; run it in a ``tf-X.Y-video`` side env): per
family with videos, ``--rows`` rows of 1-2 videos (a third also with an image) drawn from ``N``
videos written here (mp4 / webm, 320x240 .. 640x360, 24 / 25 / 30 fps, 2-8 s); the family's
real video processor at its class defaults, except that Qwen2 / 2.5-VL sample at 2 fps and
LLaVA-OneVision / InternVL sample 8 frames and SmolVLM at 1 fps up to 64 (its checkpoints'; their
classes take every frame by default; SmolVLM needs num2words: a ``tf-X.Y-video-smolvlm`` env); baseline:
each video decoded whole with PyAV, then the processor (``family_processors.video_oracle``).

``--videos N --index``: ``tokenbal index build --processor DIR`` on the same rows written as JSONL
records (DIR: the processor's own ``save_pretrained``, loaded by the build), against the processor.

``--num-proc`` measures ``dataset_lengths`` with ``num_proc=1`` and ``N`` on ``--scale-rows`` rows
(the image mixture repeated, images as paths) in records/s, wall time, same run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harness import environment_line, jpeg_photo, measure, ratio, timed  # noqa: E402


def official_processor(family: str):
    """The family's processor at its checkpoints' image settings (see the module docstring)."""
    from tests.helpers import family_processors as fp

    pil = fp._pil
    if family.startswith("qwen"):
        ip = pil("Qwen2VLImageProcessor")(min_pixels=3136, max_pixels=1003520,
                                          patch_size=16 if family == "qwen3-vl" else 14)
    elif family == "glm-4.1v":
        ip = pil("Glm4vImageProcessor")()
    elif family == "internvl":
        ip = pil("GotOcr2ImageProcessor")(size={"height": 448, "width": 448}, crop_to_patches=True,
                                          max_patches=12, min_patches=1)
    elif family == "llava":
        ip = pil("CLIPImageProcessor")(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    elif family == "llava-next":
        ip = pil("LlavaNextImageProcessor")(
            size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
            image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
    elif family == "llava-onevision":
        ip = pil("LlavaOnevisionImageProcessor")(
            size={"height": 384, "width": 384},
            image_grid_pinpoints=[[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)])
    else:
        ip = pil("Idefics3ImageProcessor" if family == "idefics3" else "SmolVLMImageProcessor")()
    kw = dict(image_processor=ip, tokenizer=fp.tokenizer(), chat_template=fp.template(family))
    if family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "glm-4.1v", "internvl", "llava-onevision", "smolvlm"):
        kw["video_processor"] = None
    if family == "internvl":
        kw["image_seq_length"] = 256
    if family in ("llava", "llava-next"):
        kw.update(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    if family == "llava-onevision":
        kw.update(num_image_tokens=729, vision_feature_select_strategy="full")
    if family in ("idefics3", "smolvlm"):
        kw["image_seq_len"] = 169
    proc = fp._build(fp.processor_class(family), **kw)
    if family == "smolvlm":   # apply_chat_template reads num_frames / fps of its video processor
        import types

        proc.video_processor = types.SimpleNamespace(num_frames=64, fps=1)
    return proc


def mixture(n: int, min_side: int, max_side: int, seed: int):
    """A ``datasets.Dataset``: a third text-only rows, a third one image, a third 2-3 images."""
    import datasets

    from tests.helpers import family_processors as fp

    rng = random.Random(seed)
    raw = fp.random_rows(n, seed=seed, shapes=("column",))
    out = []
    for i, row in enumerate(raw):
        k = (0, 1, rng.choice([2, 3]))[i % 3]
        msgs, placed = [], 0
        for m in row["messages"]:
            parts = [p for p in m["content"] if p["type"] == "text"]
            if m["role"] == "user" and placed < k:
                parts = [{"type": "image", "text": None} for _ in range(k - placed)] + list(parts)
                placed = k
            msgs.append({"role": m["role"], "content": [{"type": p["type"], "text": p.get("text")}
                                                        for p in parts]})
        images = [jpeg_photo(rng.randint(min_side, max_side), rng.randint(min_side, max_side), i * 7 + j)
                  for j in range(k)]
        out.append({"messages": msgs, "images": [{"bytes": b, "path": None} for b in images]})
    ds = datasets.Dataset.from_list(out)
    return ds.cast_column("images", datasets.List(datasets.Image()))


VIDEO_SETTINGS = {"qwen2-vl": {"do_sample_frames": True, "fps": 2.0},
                  "qwen2.5-vl": {"do_sample_frames": True, "fps": 2.0},
                  "qwen3-vl": {}, "glm-4.1v": {},
                  "llava-onevision": {"do_sample_frames": True, "num_frames": 8},
                  "internvl": {"do_sample_frames": True, "num_frames": 8},
                  # SmolVLM2's checkpoints: 1 fps, at most 64 frames (its class takes every frame)
                  "smolvlm": {"do_sample_frames": True, "fps": 1, "num_frames": 64}}


def video_rows(n: int, n_videos: int, seed: int):
    """Rows with 1-2 videos (a third also with one image), videos as paths in a videos column."""
    import datasets

    from tests.helpers import family_processors as fp
    from tests.helpers.videos import write_video

    rng = random.Random(seed)
    folder = tempfile.mkdtemp(prefix="tokenbal-bench-videos-")
    files = []
    for i in range(n_videos):
        ext = rng.choice(["mp4", "mp4", "webm"])
        w, h = rng.choice([(320, 240), (480, 270), (640, 360)])
        fps = rng.choice([24, 25, 30])
        files.append(write_video(os.path.join(folder, f"v{i}.{ext}"), int(fps * rng.uniform(2, 8)), w, h, fps,
                                 noise=True))
    rows = []
    for i in range(n):
        vids = [rng.choice(files) for _ in range(rng.choice([1, 1, 2]))]
        images = [jpeg_photo(rng.randint(256, 1024), rng.randint(256, 1024), i)] if i % 3 == 0 else []
        parts = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in vids]
        parts.append({"type": "text", "text": fp._text(rng)})
        msgs = [{"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": fp._text(rng)}]}]
        rows.append({"messages": msgs, "images": images, "videos": vids, "files": vids})
    ds = datasets.Dataset.from_list([{"messages": r["messages"], "images": [{"bytes": b, "path": None}
                                                                            for b in r["images"]],
                                      "videos": r["videos"]} for r in rows])
    return rows, ds.cast_column("images", datasets.List(datasets.Image()))


def video_records(rows: list, folder: str) -> str:
    """The rows as a JSONL annotation file (images written as JPEG files, videos by path)."""
    import json

    path = os.path.join(folder, "train.jsonl")
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            images = []
            for j, data in enumerate(r["images"]):
                images.append(os.path.join(folder, f"img{i}_{j}.jpg"))
                with open(images[-1], "wb") as g:
                    g.write(data)
            f.write(json.dumps({"id": f"r{i}", "messages": r["messages"], "images": images,
                                "videos": r["videos"]}) + "\n")
    return path


def video_baselines(args, rows: list):
    """Per family with videos: ``(family, processor with its real video processor, the processor's
    own lengths of ``rows``, baseline wall s, baseline CPU s)`` (``family_processors.video_oracle``)."""
    import transformers

    from tests.helpers import family_processors as fp

    for family in args.families.split(","):
        if family not in VIDEO_SETTINGS:
            continue
        proc = official_processor(family)
        proc.video_processor = getattr(transformers, fp.VIDEO_CLASS[family][1])(**VIDEO_SETTINGS[family])
        proc.chat_template = fp.template(family, video_token=proc.video_token)

        def baseline(proc=proc) -> np.ndarray:
            return np.array([fp.video_oracle(proc, r) for r in rows])

        want, base_wall, base_cpu = timed(baseline)
        yield family, proc, want, base_wall, base_cpu


def bench_videos(args) -> None:
    import transformers

    from tokenbal.index import video as index_video
    from tokenbal.integrations.hf import dataset_lengths

    rows, ds = video_rows(args.rows, args.videos, args.seed)
    print(f"{len(rows)} video rows (1-2 videos, a third with an image) over {args.videos} videos "
          f"(mp4 / webm, 320x240..640x360, 2-8 s); transformers {transformers.__version__}")
    if args.index:
        return bench_videos_index(args, rows)
    print("| family | video settings | baseline CPU ms/row | dataset_lengths CPU ms/row | "
          "speed-up CPU (wall) |")
    print("|---|---|---|---|---|")
    for family, proc, want, base_wall, base_cpu in video_baselines(args, rows):
        got = dataset_lengths(ds, proc, cache=False)
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise SystemExit(f"{family}: MISMATCH on {len(bad)} video rows, first {bad[:5].tolist()}")
        def ours_fresh(proc=proc):   # every file's header read again, as a new process would
            index_video._PROBED.clear()
            return dataset_lengths(ds, proc, cache=False)

        ours = measure(ours_fresh, repeats=args.repeats, warmup=0)
        n = len(rows)
        print(f"| {family} | {VIDEO_SETTINGS[family] or 'class defaults'} | {base_cpu / n * 1e3:.1f} | "
              f"{ours.cpu_median / n * 1e3:.2f} | **{ratio(base_cpu, ours.cpu_median)}** "
              f"({ratio(base_wall, ours.wall_median)}) |", flush=True)


def bench_videos_index(args, rows: list) -> None:
    """``tokenbal index build --processor DIR`` (``build_index``, one process) on the rows as JSONL
    records against the processor on the same rows, same run; DIR is the processor saved with its
    own ``save_pretrained`` and loaded by the build (AutoProcessor). The build's time includes
    loading the folder, scanning the JSONL, reading every image and video header, and writing the
    index; the counts are checked equal to the processor's on every record first."""
    import shutil

    from tokenbal import TokenIndex
    from tokenbal.index import build_index
    from tokenbal.index import video as index_video

    folder = tempfile.mkdtemp(prefix="tokenbal-bench-index-videos-")
    src = video_records(rows, folder)
    print("| family | video settings | baseline records/CPU-s | index build records/CPU-s | "
          "speed-up CPU (wall) |")
    print("|---|---|---|---|---|")
    for family, proc, want, base_wall, base_cpu in video_baselines(args, rows):
        pdir = os.path.join(folder, f"proc-{family}")
        proc.save_pretrained(pdir)
        out = os.path.join(folder, f"idx-{family}")

        def ours(pdir=pdir, out=out) -> np.ndarray:   # every header read again, as a new process would
            index_video._PROBED.clear()
            shutil.rmtree(out, ignore_errors=True)
            build_index(src, out, processor=pdir, progress=False, incremental=False)
            return TokenIndex.open(out).lengths

        got = ours()
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want) if len(got) == len(want) else [f"{len(got)} of {len(want)}"]
            raise SystemExit(f"{family}: MISMATCH on the index of the video records, first {list(bad)[:5]}")
        m = measure(ours, repeats=args.repeats, warmup=0)
        n = len(rows)
        print(f"| {family} | {VIDEO_SETTINGS[family] or 'class defaults'} | {n / base_cpu:.2f} | "
              f"{n / m.cpu_median:.0f} | **{ratio(base_cpu, m.cpu_median)}** "
              f"({ratio(base_wall, m.wall_median)}) |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--families", default="qwen2-vl,qwen2.5-vl,qwen3-vl,glm-4.1v,internvl,llava,llava-next,"
                                          "llava-onevision,idefics3,smolvlm")
    ap.add_argument("--min-side", type=int, default=256)
    ap.add_argument("--max-side", type=int, default=1600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--scale-rows", type=int, default=20000,
                    help="rows (the mixture repeated) for the num_proc measurement, first family only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--videos", type=int, default=0, help="video rows over this many videos (torchvision)")
    ap.add_argument("--index", action="store_true",
                    help="with --videos: index build --processor on the rows as JSONL records instead of "
                         "dataset_lengths")
    args = ap.parse_args()
    if args.videos:
        import transformers

        transformers.logging.set_verbosity_error()
        print(environment_line())
        return bench_videos(args)

    import transformers

    from tests.helpers import family_processors as fp
    from tokenbal.integrations.hf import dataset_lengths

    transformers.logging.set_verbosity_error()
    ds = mixture(args.rows, args.min_side, args.max_side, args.seed)
    n_images = sum(len(x) for x in ds.with_format("arrow")["images"].to_pylist())
    print(environment_line())
    print(f"{args.rows} rows (text / 1 image / 2-3 images in thirds), {n_images} JPEG images "
          f"{args.min_side}..{args.max_side} px")
    print("| family | baseline CPU ms/row | dataset_lengths CPU ms/row | speed-up CPU (wall) |")
    print("|---|---|---|---|")
    first = None
    for family in args.families.split(","):
        try:
            proc = official_processor(family)
        except ImportError as e:
            print(f"| {family} | not run: {str(e).strip().splitlines()[0][:80]} | | | |")
            continue
        def baseline(proc=proc) -> np.ndarray:   # ds[i] decodes the row's images, as a user's loop does
            return np.array([fp.oracle(proc, ds[i]) for i in range(len(ds))])

        want, base_wall, base_cpu = timed(baseline)
        got = dataset_lengths(ds, proc, cache=False)
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise SystemExit(f"{family}: MISMATCH on {len(bad)} rows, first {bad[:5].tolist()}: "
                             f"{got[bad[:5]].tolist()} vs {want[bad[:5]].tolist()}")
        ours = measure(lambda proc=proc: dataset_lengths(ds, proc, cache=False), repeats=args.repeats,
                       warmup=0)
        n = len(ds)
        print(f"| {family} | {base_cpu / n * 1e3:.1f} | {ours.cpu_median / n * 1e3:.2f} | "
              f"**{ratio(base_cpu, ours.cpu_median)}** ({ratio(base_wall, ours.wall_median)}) |", flush=True)
        first = first or (family, proc)
    if first is not None and args.num_proc > 1 and args.scale_rows:
        import datasets

        family, proc = first
        # images as paths (files written once): an in-memory dataset is pickled whole to each worker,
        # so image bytes inside it would measure the pickling, not the counting
        folder = tempfile.mkdtemp(prefix="tokenbal-bench-")
        table = ds.with_format("arrow")[:]
        paths = []
        for i, images in enumerate(table.column("images").to_pylist()):
            row = []
            for j, im in enumerate(images):
                path = os.path.join(folder, f"{i}_{j}.jpg")
                with open(path, "wb") as f:
                    f.write(im["bytes"])
                row.append(path)
            paths.append(row)
        messages = table.column("messages").to_pylist()
        by_path = datasets.Dataset.from_dict({"messages": messages, "images": paths})
        big = datasets.concatenate_datasets([by_path] * max(1, args.scale_rows // len(ds)))
        one = dataset_lengths(big, proc, cache=False)
        assert np.array_equal(one, dataset_lengths(big, proc, cache=False, num_proc=args.num_proc))
        # alternated, so load changes on the shared machine hit both alike; wall time (the workers'
        # CPU is not this process's)
        solo, par = [], []
        for _ in range(args.repeats):
            solo.append(measure(lambda: dataset_lengths(big, proc, cache=False), repeats=1, warmup=0).wall[0])
            par.append(measure(lambda: dataset_lengths(big, proc, cache=False, num_proc=args.num_proc),
                               repeats=1, warmup=0).wall[0])
        s1, sn = float(np.median(solo)), float(np.median(par))
        print(f"num_proc: {family}, {len(big)} rows, {os.cpu_count()} CPUs, median of {args.repeats} "
              f"alternated runs: num_proc=1 {len(big) / s1:,.0f} records/s ({s1:.2f} s wall), "
              f"num_proc={args.num_proc} {len(big) / sn:,.0f} records/s ({sn:.2f} s wall), "
              f"{ratio(s1, sn)}; equal counts")


if __name__ == "__main__":
    main()
