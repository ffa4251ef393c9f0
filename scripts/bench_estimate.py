"""Benchmark the token estimators against what they replace, in one process.

Vision (``--skip-vision`` to leave out):

* ``est.image_tokens_batch(widths, heights)`` on ``--n`` random sizes (each side uniform in
  64..4096 px) for every family: images/s, median of ``--repeats`` runs;
* baseline 1, the real thing: transformers' ``Qwen2VLImageProcessorPil`` (official Qwen2-VL hub
  limits) on PIL images of the first ``--processor`` of those sizes, already in memory (no decoding,
  which a real pipeline pays on top): images/s over the whole run, and its ``image_grid_thw`` checked
  against the estimator for every image;
* baseline 2: the processor's pixel-free helper ``get_number_of_image_patches`` (what vLLM uses) on
  the first ``--helper`` sizes, checked too; and our own scalar ``image_tokens`` in a Python loop;
* the ratios ``image_tokens_batch`` / baseline.

Text (``--skip-text`` to leave out): the heuristic counter's error against a real tokenizer. No
model tokenizer can be downloaded here, so byte-level BPE tokenizers (GPT-2 / Qwen2 / Llama-3
style) are trained with the ``tokenizers`` library on local text: Vim's documentation (English
technical prose) plus half of the Python standard library's modules (code). They are evaluated on
held-out text split into "samples" (paragraphs / top-level code blocks, >= 20 bytes): English legal
prose (``/usr/share/common-licenses``) and the other half of the stdlib modules. Reported per
vocabulary size and domain: real bytes per token, the heuristic's total error (sum of estimates /
sum of true counts - 1) and the spread of its per-sample relative error, plus both counters' speed.

``--baseline-tree DIR`` (e.g. a checkout of main) re-runs the ``image_tokens_batch`` timings with
that tree's ``tokenbal`` in a subprocess right after ours (same sizes, same machine) and prints
the per-family speed-up, per CPU-second and per wall second. Timings use ``scripts/harness.py``.

    python scripts/bench_estimate.py [--n 1000000] [--processor 100] [--helper 20000]
        [--repeats 5] [--vocab 32000,64000] [--skip-vision] [--skip-text] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np
from harness import environment_line, measure, ratio

from tokenbal.estimate import HeuristicTextCounter, TextTokenCounter, estimator_names, get_estimator

HUB_QWEN2 = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2)


def _median_time(fn, repeats: int) -> tuple[float, float]:
    """Median (wall seconds, CPU seconds of this process) over ``repeats`` calls. On a shared
    machine the CPU time is the steadier number (it does not count waiting for a core)."""
    t = measure(fn, repeats=repeats, warmup=0)
    return t.wall_median, t.cpu_median


def _sizes(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(64, 4097, n), rng.integers(64, 4097, n)


def batch_rates(n: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per family: (images per wall second, images per CPU second) of ``image_tokens_batch``."""
    w, h = _sizes(n)
    out = {}
    for name in estimator_names():
        est = get_estimator(name)
        est.image_tokens_batch(w[:1000], h[:1000])  # warm-up (caches, lazy imports)
        t = measure(lambda est=est: est.image_tokens_batch(w, h), repeats=repeats, warmup=1)
        out[name] = (n / t.wall_median, n / t.cpu_median)
    return out


def compare_with_tree(tree: str, n: int, repeats: int, ours: dict[str, tuple[float, float]]) -> None:
    """The same timings with ``tree``'s tokenbal, in a subprocess, and the speed-ups."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    cmd = [sys.executable, os.path.abspath(__file__), "--rates-json", "--n", str(n),
           "--repeats", str(repeats)]
    base = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    print(f"\n== image_tokens_batch: this tree vs {tree} (run right after, same sizes) ==")
    print(f"{'family':<18}{'base /CPU-s':>12}{'ours /CPU-s':>12}{'speed-up':>9}"
          f"{'base /wall-s':>13}{'ours /wall-s':>13}{'speed-up':>9}")
    for name, (wall, cpu) in ours.items():
        if name not in base:
            continue
        bw, bc = base[name]
        print(f"{name:<18}{_rate(bc):>12}{_rate(cpu):>12}{ratio(1 / bc, 1 / cpu):>9}"
              f"{_rate(bw):>13}{_rate(wall):>13}{ratio(1 / bw, 1 / wall):>9}")


def _rate(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.1f}"


def bench_vision(n: int, n_proc: int, n_helper: int, repeats: int, baseline_tree: str | None = None) -> None:
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    w, h = _sizes(n)
    print(f"== vision: image_tokens_batch on {n:,} random sizes (sides uniform in 64..4096 px), "
          f"median of {repeats} ==")
    print(f"{'family':<18}{'wall s':>9}{'images/s':>11}{'CPU s':>9}{'images/CPU-s':>14}")
    both = batch_rates(n, repeats)
    rates = {k: v[0] for k, v in both.items()}
    cpu_rates = {k: v[1] for k, v in both.items()}
    for name, (r, c) in both.items():
        print(f"{name:<18}{n / r:>9.4f}{_rate(r):>11}{n / c:>9.4f}{_rate(c):>14}"
              f"{'' if c >= 5e6 else '   below 5M/CPU-s'}")
    if baseline_tree:
        compare_with_tree(baseline_tree, n, repeats, both)

    est = get_estimator("qwen2-vl")
    want = est.image_tokens_batch(w, h)

    # baseline 1: the real processor on in-memory PIL images (creation not timed)
    proc = Qwen2VLImageProcessorPil(**HUB_QWEN2)
    per_image, per_image_cpu, equal = [], [], 0
    for i in range(n_proc):
        im = Image.new("RGB", (int(w[i]), int(h[i])), (90, 160, 30))
        t0, c0 = time.perf_counter(), time.process_time()
        out = proc(images=im, input_data_format="channels_last")
        per_image.append(time.perf_counter() - t0)
        per_image_cpu.append(time.process_time() - c0)
        equal += int(np.prod(out["image_grid_thw"][0])) // 4 == int(want[i])
    proc_rate, proc_cpu_rate = n_proc / sum(per_image), n_proc / sum(per_image_cpu)

    # baseline 2: the pixel-free helper, and our scalar path, in Python loops
    def helper_loop():
        return [proc.get_number_of_image_patches(int(h[i]), int(w[i]), {}) // 4 for i in range(n_helper)]

    def scalar_loop():
        return [est.image_tokens(int(w[i]), int(h[i])) for i in range(n_helper)]

    helper_equal = int(np.sum(np.asarray(helper_loop()) == want[:n_helper]))
    ht, hc = _median_time(helper_loop, 3)
    st, sc = _median_time(scalar_loop, 3)

    bt, bc = rates["qwen2-vl"], cpu_rates["qwen2-vl"]
    print("\n== vision baselines (qwen2-vl, hub limits 3136..12845056 px; same sizes) ==")
    print(f"Qwen2VLImageProcessorPil, {n_proc} in-memory PIL images: {_rate(proc_rate)} images/s wall, "
          f"{_rate(proc_cpu_rate)} images/CPU-s (median {statistics.median(per_image) * 1e3:.1f} ms/image "
          f"wall, max {max(per_image) * 1e3:.0f} ms); token counts equal: {equal}/{n_proc}")
    print(f"pixel-free get_number_of_image_patches, {n_helper:,} sizes: {_rate(n_helper / ht)} images/s "
          f"wall, {_rate(n_helper / hc)} images/CPU-s; equal: {helper_equal}/{n_helper}")
    print(f"our scalar image_tokens loop, {n_helper:,} sizes: {_rate(n_helper / st)} images/s wall, "
          f"{_rate(n_helper / sc)} images/CPU-s")
    print("ratios of image_tokens_batch to (wall | CPU):")
    print(f"  / processor:         {bt / proc_rate:>14,.0f}x | {bc / proc_cpu_rate:>14,.0f}x")
    print(f"  / pixel-free helper: {bt * ht / n_helper:>14,.0f}x | {bc * hc / n_helper:>14,.0f}x")
    print(f"  / scalar loop:       {bt * st / n_helper:>14,.0f}x | {bc * sc / n_helper:>14,.0f}x")


# ------------------------------------------------------------------------------------------------
# text


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _stdlib_split() -> tuple[list[str], list[str]]:
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    # alternate files: half train, half held out (deterministic)
    return files[::2], files[1::2]


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if len(p.strip().encode("utf-8")) >= 20]


def _code_blocks(text: str) -> list[str]:
    # top-level blocks: split before every line that starts at column 0 with def/class/@
    parts = re.split(r"\n(?=(?:def |class |@))", text)
    return [p for p in parts if len(p.strip().encode("utf-8")) >= 20]


def bench_text(vocabs: list[int]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train_prose = sorted(glob.glob("/usr/share/vim/vim*/doc/*.txt"))
    train_code, test_code = _stdlib_split()
    licenses = [p for p in sorted(glob.glob("/usr/share/common-licenses/*")) if os.path.isfile(p)]
    if not train_prose or not licenses:
        print("text: Vim docs or /usr/share/common-licenses not found; skipped")
        return
    train = [_read(p) for p in train_prose + train_code]
    test = {
        "English prose (licences)": [p for f in licenses for p in _paragraphs(_read(f))],
        "Python code (held-out stdlib)": [b for f in test_code for b in _code_blocks(_read(f))],
    }
    mb = sum(len(t.encode("utf-8")) for t in train) / 1e6
    print(f"\n== text: heuristic (bytes/4) vs byte-level BPE trained here on {mb:.1f} MB "
          f"({len(train_prose)} Vim doc files + {len(train_code)} stdlib modules) ==")
    for name, samples in test.items():
        nb = sum(len(s.encode("utf-8")) for s in samples)
        print(f"test set {name}: {len(samples):,} samples, {nb / 1e3:.0f} kB")

    heur = HeuristicTextCounter()
    print(f"{'vocab':>7}  {'test set':<31}{'bytes/tok':>10}{'total err':>10}"
          f"{'p5':>8}{'median':>8}{'p95':>8}{'|err| mean':>11}")
    for vocab in vocabs:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        t0 = time.perf_counter()
        tok.train_from_iterator(train, trainer)
        train_s = time.perf_counter() - t0
        exact = TextTokenCounter(tok, f"bpe{vocab}")
        for name, samples in test.items():
            true = exact.count_batch(samples)
            est = heur.count_batch(samples)
            nbytes = np.array([len(s.encode("utf-8")) for s in samples])
            rel = est / true - 1.0
            p5, med, p95 = np.percentile(rel, [5, 50, 95])
            total = est.sum() / true.sum() - 1
            print(f"{vocab:>7}  {name:<31}{nbytes.sum() / true.sum():>10.2f}{total:>+10.1%}"
                  f"{p5:>+8.1%}{med:>+8.1%}{p95:>+8.1%}{np.abs(rel).mean():>11.1%}")
        print(f"         (training took {train_s:.1f} s)")

    # speed of both counters on the prose samples (the exact one with the last tokenizer)
    samples = test["English prose (licences)"] * 20
    t_h, _ = _median_time(lambda: heur.count_batch(samples), 5)
    t_e, _ = _median_time(lambda: exact.count_batch(samples), 3)
    print(f"speed on {len(samples):,} prose samples (wall): heuristic {_rate(len(samples) / t_h)} texts/s, "
          f"BPE count_batch {_rate(len(samples) / t_e)} texts/s ({t_e / t_h:.0f}x slower)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="sizes for image_tokens_batch")
    ap.add_argument("--processor", type=int, default=100, help="images through the real processor")
    ap.add_argument("--helper", type=int, default=20_000, help="sizes through the pixel-free helper")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", default="32000,64000", help="BPE vocabulary sizes, comma-separated")
    ap.add_argument("--skip-vision", action="store_true")
    ap.add_argument("--skip-text", action="store_true")
    ap.add_argument("--baseline-tree", help="a tree whose tokenbal to time right after ours")
    ap.add_argument("--rates-json", action="store_true", help=argparse.SUPPRESS)  # for --baseline-tree
    a = ap.parse_args(argv)
    if a.rates_json:
        print(json.dumps(batch_rates(a.n, a.repeats)))
        return
    print(environment_line())
    if not a.skip_vision:
        bench_vision(a.n, a.processor, a.helper, a.repeats, a.baseline_tree)
    if not a.skip_text:
        bench_text([int(v) for v in a.vocab.split(",")])


if __name__ == "__main__":
    main()
