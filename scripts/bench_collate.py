"""Benchmark PackedCollator against transformers' per-sample ``get_rope_index``, in one process.

Builds one 64-sample batch of about 32k tokens shaped like Qwen2-VL chat data (text only, one
image, several images, short videos; Qwen template ``<vision_start> placeholders <vision_end>``)
and times, on the same samples:

1. positions: ``collate.positions.mrope_positions`` per sample vs transformers 5.x
   ``Qwen2VLModel.get_rope_index`` per sample (packing needs per-sample ids; a padded 64-row call
   loops over rows internally and is timed too). Both outputs are compared for equality first.
2. the whole collate: ``PackedCollator(samples)`` with small pixel rows (the work that is not a
   memcpy), and with real-size pixel rows (1176 floats per patch) next to a bare ``torch.cat`` of
   the same pixel tensors, the memcpy floor no collator can beat.

Prints medians over ``--repeat`` runs and the ratios (timings: ``scripts/harness.py``). No GPU
needed. ``--baseline-tree DIR`` (e.g. a checkout of main) times ``packed_mrope_positions`` and the
collate call with that tree's ``collate`` in a subprocess right after ours, on the same batch, and
prints the speed-ups.

    python scripts/bench_collate.py [--samples 64] [--tokens 32768] [--repeat 30] [--seed 0]
        [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import torch
from harness import environment_line, measure, ratio

# ``--tree DIR`` (used by --baseline-tree) imports another checkout's collate instead of this one's.
_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else None
sys.path.insert(0, _TREE or str(pathlib.Path(__file__).resolve().parents[1]))

from collate import PackedCollator  # noqa: E402
from collate.positions import mrope_positions, packed_mrope_positions  # noqa: E402

IMG, VID, VS, VE = 151655, 151656, 151652, 151653
MERGE = 2
PATCH_FEAT = 1176  # 3 channels * 2 temporal * 14 * 14, Qwen2-VL's patch row


def make_samples(n: int, total_tokens: int, seed: int, feat: int) -> list[dict]:
    """``n`` samples, lengths scaled so they add up to about ``total_tokens``."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(["text", "image", "multi", "video"], size=n, p=[0.3, 0.35, 0.2, 0.15])
    target = total_tokens / n
    samples = []
    for kind in kinds:
        images, videos, ids = [], [], []
        if kind == "image":
            images = [_grid(rng, 1, 8, 56)]
        elif kind == "multi":
            images = [_grid(rng, 1, 4, 28) for _ in range(int(rng.integers(2, 6)))]
        elif kind == "video":
            videos = [_grid(rng, int(rng.integers(2, 9)), 4, 20)]
        blocks = [(IMG, g) for g in images] + [(VID, g) for g in videos]
        vision_tokens = sum(int(np.prod(g)) // MERGE**2 + 2 for _, g in blocks)
        text_budget = max(8, int(rng.normal(target, target / 3)) - vision_tokens)
        cuts = np.sort(rng.integers(0, text_budget, size=len(blocks)))
        pieces = np.diff(cuts, prepend=0, append=text_budget)
        for (tok, g), piece in zip(blocks, pieces[:-1], strict=True):
            ids.append(rng.integers(0, 150000, size=int(piece)))
            ids.append(np.array([VS] + [tok] * (int(np.prod(g)) // MERGE**2) + [VE]))
        ids.append(rng.integers(0, 150000, size=int(pieces[-1]) + 1))
        input_ids = np.concatenate(ids).astype(np.int64)
        labels = input_ids.copy()
        labels[: len(labels) // 3] = -100  # the prompt part is not trained
        s: dict = {"input_ids": input_ids, "labels": labels}
        if images:
            g = np.array(images, dtype=np.int64)
            s["image_grid_thw"] = g
            s["pixel_values"] = torch.randn(int(g.prod(1).sum()), feat)
        if videos:
            g = np.array(videos, dtype=np.int64)
            s["video_grid_thw"] = g
            s["pixel_values_videos"] = torch.randn(int(g.prod(1).sum()), feat)
        samples.append(s)
    return samples


def _grid(rng: np.random.Generator, t: int, lo: int, hi: int) -> list[int]:
    h, w = rng.integers(lo // 2, hi // 2 + 1, size=2)
    return [t, MERGE * int(h), MERGE * int(w)]


def mrope_positions_of(s: dict) -> np.ndarray:
    return mrope_positions(
        s["input_ids"],
        s.get("image_grid_thw"),
        s.get("video_grid_thw"),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        spatial_merge_size=MERGE,
    )


TIMES: dict[str, float] = {}


CPU: dict[str, float] = {}


def median_ms(fn: Callable[[], object], repeat: int, name: str = "") -> float:
    """Median wall time in ms; the minimum goes to TIMES[name] (less sensitive to a shared machine),
    the median CPU time to CPU[name]."""
    t = measure(fn, repeats=repeat, warmup=1)  # warm-up: imports, allocator
    TIMES[name] = t.wall_min * 1e3
    CPU[name] = t.cpu_median * 1e3
    return t.ms


def tiny_qwen2vl():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    text = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=151700,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
    )
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE)
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    with torch.device("meta"):  # get_rope_index needs the config only; skip the 151k-row embedding
        model = Qwen2VLModel(cfg)
    return cfg, model


def hf_inputs(samples: list[dict]) -> list[tuple[torch.Tensor, ...]]:
    """Per-sample tensors as a training loop would hand them to get_rope_index (built once, untimed)."""
    out = []
    for s in samples:
        ids = torch.from_numpy(s["input_ids"])[None]
        mm = (ids == IMG).int() + 2 * (ids == VID).int()
        img = torch.from_numpy(s["image_grid_thw"]) if "image_grid_thw" in s else None
        vid = torch.from_numpy(s["video_grid_thw"]) if "video_grid_thw" in s else None
        out.append((ids, mm, img, vid))
    return out


def core_timings(args: argparse.Namespace) -> dict[str, float]:
    """Median wall / CPU ms of the packed positions and of the collate call (small pixel rows)."""
    small = make_samples(args.samples, args.tokens, args.seed, feat=8)
    cfg, _ = tiny_qwen2vl()
    coll = PackedCollator.from_config(cfg, pin_memory=False)
    cu = np.concatenate(([0], np.cumsum([len(s["input_ids"]) for s in small])))
    ids = np.concatenate([s["input_ids"] for s in small])
    img = np.concatenate([s["image_grid_thw"] for s in small if "image_grid_thw" in s])
    vid = np.concatenate([s["video_grid_thw"] for s in small if "video_grid_thw" in s])
    per_img = np.array([len(s.get("image_grid_thw", ())) for s in small])
    per_vid = np.array([len(s.get("video_grid_thw", ())) for s in small])

    def positions() -> None:
        packed_mrope_positions(ids, cu, img, vid, images_per_sample=per_img, videos_per_sample=per_vid,
                               image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
                               spatial_merge_size=MERGE)

    out = {}
    for name, fn in (("positions", positions), ("collate", lambda: coll(small))):
        t = measure(fn, repeats=args.repeat, warmup=2)
        out[name + "_wall"], out[name + "_cpu"] = t.ms, t.cpu_median * 1e3
    return out


def compare_with_tree(args: argparse.Namespace) -> None:
    ours = core_timings(args)
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--tree", os.path.abspath(args.baseline_tree),
           "--samples", str(args.samples), "--tokens", str(args.tokens), "--repeat", str(args.repeat),
           "--seed", str(args.seed)]
    base = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"\nthis tree vs {args.baseline_tree} (run right after, same batch), ms, medians")
    print(f"  {'':<10}{'base wall':>10}{'ours wall':>11}{'speed-up':>10}{'base CPU':>11}{'ours CPU':>11}"
          f"{'speed-up':>10}")
    for name in ("positions", "collate"):
        bw, ow, bc, oc = base[name + "_wall"], ours[name + "_wall"], base[name + "_cpu"], ours[name + "_cpu"]
        print(f"  {name:<10}{bw:>10.2f}{ow:>11.2f}{ratio(bw, ow):>10}{bc:>11.2f}{oc:>11.2f}"
              f"{ratio(bc, oc):>10}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-tree", help="a checkout whose collate to time right after ours")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # read at import time, see _TREE
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # for --baseline-tree
    args = ap.parse_args()
    torch.set_num_threads(1)  # a DataLoader worker runs collate on one core
    if args.json:
        print(json.dumps(core_timings(args)))
        return 0
    print(environment_line())

    small = make_samples(args.samples, args.tokens, args.seed, feat=8)
    total = sum(len(s["input_ids"]) for s in small)
    n_img = sum(len(s.get("image_grid_thw", ())) for s in small)
    n_vid = sum(len(s.get("video_grid_thw", ())) for s in small)
    vis_tok = sum(int(np.isin(s["input_ids"], (IMG, VID)).sum()) for s in small)
    print(
        f"batch: {len(small)} samples, {total} tokens ({vis_tok} vision placeholders), "
        f"{n_img} images, {n_vid} videos; torch {torch.__version__}, 1 thread"
    )

    cfg, model = tiny_qwen2vl()
    coll = PackedCollator.from_config(cfg, pin_memory=False)
    inputs = hf_inputs(small)

    # Videos: ours follows the original rule for text *after* a video (documented), so compare
    # up to the first video's end; everything else must be identical.
    for s, (ids, mm, img, vid) in zip(small, inputs, strict=True):
        ref = model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=img, video_grid_thw=vid)[0][:, 0]
        got = mrope_positions_of(s)
        vid_at = np.flatnonzero(s["input_ids"] == VID)
        end = len(s["input_ids"]) if vid_at.size == 0 else int(vid_at[-1]) + 1
        if not np.array_equal(got[:, :end], ref[:, :end].numpy()):
            raise SystemExit("positions differ from transformers' get_rope_index")

    def hf_per_sample() -> None:
        for ids, mm, img, vid in inputs:
            model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=img, video_grid_thw=vid)

    max_len = max(len(s["input_ids"]) for s in small)
    padded = torch.zeros(len(small), max_len, dtype=torch.int64)
    mask = torch.zeros(len(small), max_len, dtype=torch.int64)
    for r, s in enumerate(small):
        padded[r, : len(s["input_ids"])] = torch.from_numpy(s["input_ids"])
        mask[r, : len(s["input_ids"])] = 1
    mm_pad = (padded == IMG).int() + 2 * (padded == VID).int()
    img_all = torch.from_numpy(np.concatenate([s["image_grid_thw"] for s in small if "image_grid_thw" in s]))
    vid_all = torch.from_numpy(np.concatenate([s["video_grid_thw"] for s in small if "video_grid_thw" in s]))

    def hf_padded() -> None:
        model.get_rope_index(
            padded,
            mm_token_type_ids=mm_pad,
            image_grid_thw=img_all,
            video_grid_thw=vid_all,
            attention_mask=mask,
        )

    cu = np.concatenate(([0], np.cumsum([len(s["input_ids"]) for s in small])))
    packed_ids = np.concatenate([s["input_ids"] for s in small])
    img_per = np.array([len(s.get("image_grid_thw", ())) for s in small])
    vid_per = np.array([len(s.get("video_grid_thw", ())) for s in small])

    def ours_packed() -> np.ndarray:
        return packed_mrope_positions(
            packed_ids,
            cu,
            img_all.numpy(),
            vid_all.numpy(),
            images_per_sample=img_per,
            videos_per_sample=vid_per,
            image_token_id=IMG,
            video_token_id=VID,
            vision_start_token_id=VS,
            spatial_merge_size=MERGE,
        )

    ref_rows = [mrope_positions_of(s) for s in small]
    if not np.array_equal(ours_packed(), np.concatenate(ref_rows, axis=1)):
        raise SystemExit("packed positions differ from the per-sample ones")

    def ours_per_sample() -> None:
        for s in small:
            mrope_positions_of(s)

    r = args.repeat
    few = max(5, r // 3)
    t_hf = median_ms(hf_per_sample, few, "hf")
    t_hf_pad = median_ms(hf_padded, few, "hf_pad")
    t_ref = median_ms(ours_per_sample, r, "ref")
    t_ours = median_ms(ours_packed, r, "packed")
    m = TIMES
    print("\npositions, ms per batch                      median      min")
    print(f"  transformers get_rope_index, per sample   : {t_hf:8.2f} {m['hf']:8.2f}")
    print(f"  transformers get_rope_index, padded 64xL  : {t_hf_pad:8.2f} {m['hf_pad']:8.2f}")
    print(f"  collate mrope_positions, per sample       : {t_ref:8.2f} {m['ref']:8.2f}")
    print(f"  collate packed_mrope_positions, one call  : {t_ours:8.2f} {m['packed']:8.2f}")
    print(
        f"  packed vs HF per sample: {t_hf / t_ours:6.1f}x (median) {m['hf'] / m['packed']:6.1f}x (min); "
        f"vs HF padded: {t_hf_pad / t_ours:6.1f}x (median)   target >= 20x"
    )

    t_coll_small = median_ms(lambda: coll(small), r, "coll")
    big = make_samples(args.samples, args.tokens, args.seed, feat=PATCH_FEAT)
    pv = [s["pixel_values"] for s in big if "pixel_values" in s]
    pvv = [s["pixel_values_videos"] for s in big if "pixel_values_videos" in s]
    mb = sum(t.numel() for t in pv + pvv) * 4 / 2**20
    t_coll_big = median_ms(lambda: coll(big), few, "coll_big")
    t_cat = median_ms(lambda: (torch.cat(pv), torch.cat(pvv)), few, "cat")
    print("\nwhole PackedCollator call (no pinning), ms      median      min")
    print(f"  pixel rows of 8 floats (non-memcpy work)  : {t_coll_small:8.2f} {m['coll']:8.2f}  target 2")
    print(f"  pixel rows of {PATCH_FEAT} floats ({mb:4.0f} MiB)  : {t_coll_big:8.2f} {m['coll_big']:8.2f}")
    print(f"  bare torch.cat of the same pixel tensors  : {t_cat:8.2f} {m['cat']:8.2f}   memcpy floor")
    print(
        f"  collate / bare cat with real pixel rows   : {t_coll_big / t_cat:8.2f}x"
        f" {m['coll_big'] / m['cat']:7.2f}x"
    )
    print(f"  CPU ms (median): collate small {CPU['coll']:.2f}, packed positions {CPU['packed']:.2f}")
    if args.baseline_tree:
        compare_with_tree(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
