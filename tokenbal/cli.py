"""The ``tokenbal`` command line: ``tokenbal index build|stats|verify`` and ``tokenbal demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_index_build(args: argparse.Namespace) -> int:
    from tokenbal.index import build_index

    overrides = dict(_parse_override(o) for o in args.estimator_option)
    report = build_index(args.sources, args.out, model=args.model, workers=args.workers,
                         tokenizer=args.tokenizer, image_root=args.image_root,
                         estimator_overrides=overrides, progress=not args.quiet,
                         incremental=not args.rebuild, exif=args.exif, keep_unlisted=not args.drop_unlisted)
    print(report.summary())
    return 0 if report.num_samples > 0 or report.num_errors == 0 else 1


def _cmd_index_stats(args: argparse.Namespace) -> int:
    from tokenbal.index import index_stats

    print(index_stats(args.dir, plot=args.plot))
    if args.plot:
        print(f"  histogram written to {args.plot}")
    return 0


def _cmd_index_verify(args: argparse.Namespace) -> int:
    from tokenbal.index import verify_index

    problems = verify_index(args.dir)
    for p in problems:
        print(p)
    print("index is up to date" if not problems else f"{len(problems)} problem(s) found")
    return 1 if problems else 0


def _cmd_plan_simulate(args: argparse.Namespace) -> int:
    from tokenbal.index import TokenIndex
    from tokenbal.plan import simulate

    index = TokenIndex.open(args.index)
    cost = None if args.cost == "tokens" else args.cost
    config = None
    if args.cost == "flops" and args.model_config:
        import json

        with open(args.model_config) as f:
            config = json.load(f)
    if config is not None:
        from tokenbal.cost import FlopsModel

        cost = FlopsModel.from_config(config)
    if args.stages and args.cost != "flops":
        raise SystemExit("--stages needs --cost flops (it splits each sample's FLOPs into vision tower "
                         "and LLM)")
    sim = simulate(index, args.world_size, args.global_batch_size, grad_accum=args.grad_accum, cost=cost,
                   seed=args.seed, baseline_steps=args.baseline_steps, stages=True if args.stages else None)
    print(sim.table())
    if args.plot:
        _write_plot(sim, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _write_plot(sim, path: str) -> None:
    if path.endswith(".csv"):
        import csv

        names = list(sim.ratios)
        rows = max(len(r) for r in sim.ratios.values())
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", *names])
            for i in range(rows):
                w.writerow([i, *(f"{sim.ratios[n][i]:.6f}" if i < len(sim.ratios[n]) else "" for n in names)])
        return
    from tokenbal.plot import plot_step_ratios

    plot_step_ratios(sim.ratios, path, title=f"{sim.world_size} ranks, global batch {sim.global_batch_size}: "
                                             "per-step max / mean rank cost")


def _cmd_demo(args: argparse.Namespace) -> int:
    # The demo drives the whole path (index → sampler → collator → model), so it needs the
    # `collate` layer; it is the one place the CLI reaches it, lazily.
    from collate.demo import run_demo

    return run_demo(workdir=args.workdir, train_samples=args.train_samples, ranks=args.ranks, seed=args.seed)


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--estimator-option expects KEY=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenbal",
        description="Token-balanced data loading for multimodal LLM training. "
                    "Build a token index offline, then let every rank plan balanced steps from it.")
    sub = parser.add_subparsers(dest="command", required=True)

    index = sub.add_parser("index", help="build, inspect and verify an on-disk token index")
    isub = index.add_subparsers(dest="index_command", required=True)

    build = isub.add_parser(
        "build", help="estimate every sample's tokens and write an index folder",
        description="Scan webdataset tar shards (or JSON/JSONL annotations with --image-root), read "
                    "image sizes from headers only, count vision tokens with the model's exact formula "
                    "and text tokens with a tokenizer (or a calibrated heuristic), and write a "
                    "memory-mapped index. Bad samples are listed in the index's errors file.")
    build.add_argument("sources", nargs="+",
                       help="tar shards: paths, globs or brace patterns (data-{000..099}.tar); "
                            "or .json/.jsonl annotation files")
    build.add_argument("--model", default="qwen2-vl",
                       help="estimator name (see tokenbal.estimate.get_estimator); default qwen2-vl")
    build.add_argument("--out", required=True, help="index folder to write")
    build.add_argument("--workers", type=int, default=1, help="processes scanning shards in parallel")
    build.add_argument("--tokenizer", default=None,
                       help="local tokenizer folder or tokenizer.json for exact text counts "
                            "(default: a calibrated bytes-per-token heuristic)")
    build.add_argument("--image-root", default=None,
                       help="folder that image paths in JSON/JSONL annotations are relative to")
    build.add_argument("--estimator-option", action="append", default=[], metavar="KEY=VALUE",
                       help="override an estimator setting, e.g. max_pixels=1003520 (repeatable)")
    build.add_argument("--rebuild", action="store_true",
                       help="rescan every shard and index exactly SOURCES; by default an existing index at "
                            "--out built with the same rules keeps its shards (unchanged ones without a "
                            "rescan, even those SOURCES does not name) and new shards are appended")
    build.add_argument("--drop-unlisted", action="store_true",
                       help="index exactly SOURCES: drop the existing index's shards that SOURCES does not "
                            "name (unchanged ones are still reused without a rescan)")
    build.add_argument("--exif", choices=["transpose", "ignore"], default="transpose",
                       help="EXIF orientation: 'transpose' (default) counts images as transformers' "
                            "load_image and tokenbal's reader see them (orientations 5-8 swap width and "
                            "height); 'ignore' counts them as stored. Recorded in the index")
    build.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=_cmd_index_build)

    stats = isub.add_parser("stats", help="print counts and token percentiles of an index")
    stats.add_argument("dir", help="index folder")
    stats.add_argument("--plot", default=None, metavar="PNG",
                       help="also write a histogram of vision / text tokens per sample to this PNG")
    stats.set_defaults(func=_cmd_index_stats)

    verify = isub.add_parser("verify", help="check an index and its shards (exit 1 if damaged or stale)")
    verify.add_argument("dir", help="index folder")
    verify.set_defaults(func=_cmd_index_verify)

    plan = sub.add_parser("plan", help="simulate the balance of an epoch plan")
    psub = plan.add_subparsers(dest="plan_command", required=True)
    sim = psub.add_parser(
        "simulate", help="per-step rank balance: DistributedSampler, per-step LPT/KK and tokenbal",
        description="Plan one epoch from an index and print, per method, the mean / p95 / max over "
                    "steps of max/mean rank cost (1.000 = perfect), and how long tokenbal took to plan.")
    sim.add_argument("--index", required=True, help="index folder (tokenbal index build)")
    sim.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    sim.add_argument("--global-batch-size", type=int, required=True, help="samples per step, all ranks")
    sim.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    sim.add_argument("--cost", choices=["tokens", "flops"], default="tokens", help="what to balance")
    sim.add_argument("--model-config", default=None,
                     help="config.json of the model for --cost flops (default: Qwen2-VL-7B dimensions)")
    sim.add_argument("--stages", action="store_true",
                     help="with --cost flops: also report Σ_stage max_rank / ideal per step (FSDP waits for "
                          "the slowest rank in the vision tower and again in the LLM), with and without "
                          "balancing the two stages separately")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--baseline-steps", type=int, default=500,
                     help="steps simulated for the per-step LPT/KK baselines (default 500)")
    sim.add_argument("--plot", default=None, help="write per-step ratios: a .png chart or a .csv table")
    sim.set_defaults(func=_cmd_plan_simulate)

    demo = sub.add_parser(
        "demo", help="run the whole path on synthetic data, on CPU",
        description="Generate a small multimodal webdataset (real JPEG/PNG images of mixed sizes), "
                    "build its token index, compare per-step rank balance of DistributedSampler and "
                    "TokenBalancedBatchSampler at 8 ranks, train a tiny random Qwen2-VL with FSDP2 "
                    "on 2 CPU ranks with each sampler, and check the packed loss against transformers.")
    demo.add_argument("--workdir", default=None, help="keep the generated data here (default: a temp dir)")
    demo.add_argument("--train-samples", type=int, default=64,
                      help="samples in the training epoch run with each sampler (default 64)")
    demo.add_argument("--ranks", type=int, default=2, help="CPU ranks for the FSDP2 part")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenbal: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from tokenbal.index.build import IndexBuildError

        if not isinstance(e, IndexBuildError):
            raise
        print(f"tokenbal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
