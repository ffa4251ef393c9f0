"""The ``tokenbal`` command line: ``index build|stats|verify``, ``plan simulate``, ``profile``, ``demo``.

Exit status: 0 done; 1 the work ran but failed a check (a build over ``--max-bad-shards`` /
``--max-bad-samples``, ``verify`` found problems, a missing optional dependency, another build
holding the index folder, a killed scan worker, an OS error such as a full disk); 2 a usage error
or bad input (an unknown option value, a missing file, a malformed ``KEY=VALUE``), printed as one
``... error: ...`` line (with the usage for command-line mistakes), never a traceback. Output cut
short by its reader (``| head``) ends quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbal.parallel import ParallelLayout


class UsageError(Exception):
    """Options that do not go together (argparse checks each option on its own); printed with the
    sub-command's usage, exit 2."""


def _remote_options(args: argparse.Namespace):
    from tokenbal.io.remote import RemoteOptions

    timeouts = {k: getattr(args, k) for k in ("timeout", "total_timeout")
                if getattr(args, k, None) is not None}
    more = {"read_through": args.read_through} if getattr(args, "read_through", None) is not None else {}
    return RemoteOptions(storage_options=dict(args.storage_option),
                         mode=getattr(args, "remote_read", "auto"), inflight=getattr(args, "inflight", 8),
                         **{k: (None if v <= 0 else v) for k, v in timeouts.items()}, **more)


def _cmd_index_build(args: argparse.Namespace) -> int:
    from tokenbal.estimate.vision import get_estimator
    from tokenbal.index import build_index
    from tokenbal.index.merge import parse_part
    from tokenbal.index.parquet import ParquetOptions

    if args.processor is not None and args.model is not None:
        raise UsageError(f"give --processor or --model, not both (--processor {args.processor} gives the "
                         f"estimator; --model {args.model} would be ignored)")
    model = args.model if args.model is not None else "qwen2-vl"
    if not _is_folder(model):
        try:
            get_estimator(model)   # aliases (transformers model_type spellings) are accepted too
        except ValueError:
            raise UsageError(f"argument --model: unknown model {model!r}; valid: "
                             f"{', '.join(_model_names())} (or a checkpoint / processor folder)") from None
    overrides = dict(args.estimator_option)
    try:
        part = parse_part(args.part) if args.part else None
    except ValueError as e:
        raise UsageError(str(e)) from None   # it names --part
    out = args.out
    if part is not None:   # one --out for every part of a launcher: {i} / {n} tell them apart
        out = out.replace("{i}", str(part[0])).replace("{n}", str(part[1]))
    elif "{i}" in out or "{n}" in out:
        # Without --part they stay as written: a folder literally named part-{i}.
        raise UsageError(f"--out {out}: {{i}} and {{n}} are replaced only with --part I/N (or --part env); "
                         "add --part, or name the folder")
    parquet = ParquetOptions(image_column=args.image_column, text_column=args.text_column,
                             messages_column=args.messages_column, video_column=args.video_column)
    with _naming_output_folder("--out", out):
        report = build_index(args.sources, out, model=model, workers=args.workers,
                             tokenizer=args.tokenizer, image_root=args.image_root,
                             estimator_overrides=overrides, progress=not args.quiet,
                             incremental=not args.rebuild, remote=_remote_options(args),
                             parquet=parquet, part=part, exif=args.exif,
                             keep_unlisted=not args.drop_unlisted, processor=args.processor,
                             on_other_rules="rescan" if args.rebuild else "error")
    print(report.summary())
    problems = report.limit_problems(args.max_bad_shards, args.max_bad_samples)
    for line in problems:
        print(f"tokenbal index build: error: {line}", file=sys.stderr)
    return 1 if problems else 0


def _cmd_index_stats(args: argparse.Namespace) -> int:
    from tokenbal.index import index_stats

    _check_output_file("--plot", args.plot, (".png",))
    print(index_stats(args.dir, plot=args.plot))
    if args.plot:
        print(f"  histogram written to {args.plot}")
    return 0


def _cmd_index_verify(args: argparse.Namespace) -> int:
    from tokenbal.index import verify_index
    from tokenbal.index.store import failed_shards, read_manifest

    with _progress_bar(not args.quiet, "verifying") as report:
        problems = verify_index(args.dir, remote=_remote_options(args), allow_failed=args.allow_failed,
                                progress=report)
    for p in problems:
        print(p)
    if args.allow_failed and not any(p.startswith("index damaged") for p in problems):
        for line in failed_shards(read_manifest(args.dir)):
            print(f"note (--allow-failed): {line}")
    print("index is up to date" if not problems else f"{len(problems)} problem(s) found")
    return 1 if problems else 0


def _cmd_index_merge(args: argparse.Namespace) -> int:
    from tokenbal.index.merge import merge_indexes

    with _naming_output_folder("merge output", args.out):
        report = merge_indexes(args.out, args.parts, progress=not args.quiet, replace=args.replace)
    print(report.summary())
    return 0


def _cmd_index_export(args: argparse.Namespace) -> int:
    from tokenbal.index.export import export_index

    with (_progress_bar(not args.quiet, "exporting") as report,
          _naming_output_folder("export folder", args.dir)):
        path = export_index(args.index, args.dir, args.format, progress=report)
    print(f"wrote {path}")
    return 0


def _cmd_plan_simulate(args: argparse.Namespace) -> int:
    from tokenbal.balance.settings import PlanSettings
    from tokenbal.balance.simulate import simulate
    from tokenbal.index import TokenIndex

    if args.stages and args.cost != "flops":
        raise UsageError("--stages needs --cost flops (it splits each sample's FLOPs into vision tower "
                         "and LLM)")
    if args.model_config and args.cost != "flops":
        raise UsageError(f"--model-config is used by --cost flops only (this run balances {args.cost}); "
                         "add --cost flops, or drop --model-config")
    _check_output_file("--plot", args.plot, (".png", ".csv"))
    # One checked PlanSettings over the data-parallel ranks: a bad batch size fails before the index is read.
    settings = PlanSettings.from_layout(_layout(args.world_size, args.sp_size),
                                        global_batch_size=args.global_batch_size, grad_accum=args.grad_accum)
    replicas = settings.num_replicas
    if args.padded and args.seed > _TORCH_SEED_MAX:
        raise UsageError(_torch_seed_error(args.seed, "--padded runs torch's DistributedSampler and "
                                                      "transformers' BatchRebalanceSampler"))
    if args.padded and settings.global_batch_size % (replicas * settings.grad_accum):
        # Refused here: after the index read and the first table it came as an error below a report.
        raise UsageError(_padded_batch_error(replicas, settings.global_batch_size, settings.grad_accum))
    index = TokenIndex.open(args.index)
    if len(index) == 0:
        # The planner would say "1 ranks but only 0 samples ... simulate at most 0 ranks".
        raise ValueError(f"--index {args.index} holds no samples ({len(index.errors)} error(s), listed in "
                         "its errors.jsonl): nothing to simulate")
    cost = None if args.cost == "tokens" else args.cost
    if args.model_config:
        cost = _flops_model(args.model_config)
    if args.sp_size > 1:
        # SP peers share one packed row: the plan balances the data-parallel groups, each S devices.
        print(f"sequence parallel size {args.sp_size}: balancing {replicas} data-parallel groups of "
              f"{args.sp_size} ranks")
    with _progress_bar(not args.quiet, "simulating") as report:
        sim = simulate(index, replicas, settings.global_batch_size, grad_accum=settings.grad_accum,
                       cost=cost, seed=args.seed, baseline_steps=args.baseline_steps,
                       stages=True if args.stages else None, progress=report)
    print(sim.table())
    if args.padded:
        from tokenbal.balance.baselines import padded_comparison

        with _progress_bar(not args.quiet, "padded baselines") as report:
            table = padded_comparison(index, replicas, settings.global_batch_size, settings.grad_accum,
                                      seed=args.seed, progress=report)
        print(table)
    if args.plot:
        _write_plot(sim, args.plot)
        print(f"wrote {args.plot}")
    return 0


# torch.Generator.manual_seed takes seeds up to 2**64 - 1 ("Overflow when unpacking long long" above).
_TORCH_SEED_MAX = 2**64 - 1


def _torch_seed_error(seed: int, who: str) -> str:
    return f"--seed {seed}: {who}, whose torch generators take seeds up to 2**64 - 1 ({_TORCH_SEED_MAX})"


def _padded_batch_error(replicas: int, global_batch: int, grad_accum: int) -> str:
    from tokenbal.balance.baselines import padded_batch_error

    return f"--padded: {padded_batch_error(replicas, global_batch, grad_accum)}"


def _layout(world_size: int, sp_size: int) -> ParallelLayout:
    from tokenbal.parallel import ParallelLayout

    try:
        return ParallelLayout.from_world(world_size, sp_size)
    except ValueError:
        raise UsageError(f"--sp-size {sp_size} must divide --world-size {world_size}") from None


def _flops_model(path: str):
    import json

    from tokenbal.balance.cost import FlopsModel

    if os.path.isdir(path):
        # A checkpoint folder is what --model takes; here the file inside it is wanted.
        inside = os.path.join(path, "config.json")
        hint = f"; give {inside}" if os.path.isfile(inside) else " holding no config.json"
        raise ValueError(f"--model-config {path} is a folder{hint}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-config {path} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--model-config {path} is not a text file (a config.json is UTF-8 JSON)") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"--model-config {path}: no such file") from None
    except OSError as e:   # unreadable (permissions, a device): still the option's value to fix
        raise ValueError(f"--model-config {path} cannot be read ({e.strerror or e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {path} holds a {type(config).__name__}, not a config object")
    try:
        return FlopsModel.from_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--model-config {path} is not a model config tokenbal can read "
                         f"({type(e).__name__}: {e})") from None


def _check_output_file(option: str, path: str | None, suffixes: tuple[str, ...]) -> None:
    """Refuse, before any work, an output file name the command would write the wrong thing under
    (PNG bytes in ``ratios.txt``) or could only fail to write after the work (a missing folder)."""
    if path is None:
        return
    if not path.lower().endswith(suffixes):
        raise UsageError(f"{option} {path}: give a {' or '.join(suffixes)} file name (it writes "
                         f"{'a PNG chart or a CSV table' if len(suffixes) > 1 else 'a PNG chart'})")
    if path.lower().endswith(".png"):
        from tokenbal.plot import pyplot

        pyplot()   # before the work: "plots need matplotlib" came after the whole simulation / trace read
    if os.path.isdir(path):   # else found only when the file is written, after the work
        raise UsageError(f"{option} {path} is a folder; give a file name in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: folder {folder} is not writable")


@contextlib.contextmanager
def _naming_output_folder(option: str, path: str) -> Iterator[None]:
    """Name the option where its output folder cannot be made or written: the OS error names a path
    only, and for a build the lock file beside the folder (``No such file or directory:
    '/proc/.x.lock'``). Only errors on the folder, inside it, beside it under its name (the lock, the
    temporary folders) or on a folder above it are renamed; a source's error stays the source's."""
    try:
        yield
    except OSError as e:
        failed = os.fspath(e.filename) if e.filename else None
        if e.errno not in _FOLDER_ERRNOS or failed is None or not _is_output_path(path, failed):
            raise
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            reason = "a file of that name (or of a folder above it) is in the way"
        else:
            reason = f"cannot be made there ({e.strerror or e}: {failed})"
        raise ValueError(f"{option} {path}: {reason}; give a folder that can be created") from None


# The errors that say the output folder itself cannot be made there (not a full disk or a network failure).
_FOLDER_ERRNOS = {errno.ENOENT, errno.EEXIST, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                  errno.EISDIR}


def _is_output_path(out: str, failed: str) -> bool:
    """Whether ``failed`` is the output folder ``out``, inside it, a folder above it, or beside it under
    its name (``.out.lock``, ``.out.tmp-…``)."""
    out, failed = os.path.abspath(out), os.path.abspath(failed)
    if failed == out or failed.startswith(out + os.sep) or out.startswith(failed.rstrip(os.sep) + os.sep):
        return True
    return (os.path.dirname(failed) == os.path.dirname(out)
            and os.path.basename(failed).startswith(f".{os.path.basename(out)}"))


def _write_plot(sim, path: str) -> None:
    if path.lower().endswith(".csv"):
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
    from tokenbal._extras import require

    # Checked here, once: without it each rank's process would fail with its own traceback.
    require("transformers", "tokenbal demo (it trains a tiny model with transformers' classes)")
    from collate.demo import DEMO_GLOBAL_BATCH, DEMO_SAMPLES, MODEL_CLASSES, run_demo

    # Checked before minutes of data generation: each rank failed on its own ("batch_size should be a
    # positive integer value, but got batch_size=0", one traceback per rank), or the epoch was silently
    # the 256 samples written while the report said --train-samples.
    if DEMO_GLOBAL_BATCH % args.ranks:
        raise UsageError(f"--ranks {args.ranks}: the demo trains {DEMO_GLOBAL_BATCH} samples per step, which "
                         f"the ranks must divide (DistributedSampler takes {DEMO_GLOBAL_BATCH} / ranks per "
                         "rank); give 1, 2, 4 or 8")
    if not args.ranks <= args.train_samples <= DEMO_SAMPLES:
        raise UsageError(f"--train-samples {args.train_samples}: the demo writes {DEMO_SAMPLES} samples and "
                         f"each of the {args.ranks} ranks needs one; give {args.ranks} to {DEMO_SAMPLES}")
    if args.seed > _TORCH_SEED_MAX:
        raise UsageError(_torch_seed_error(args.seed, "the demo seeds torch (the model's weights)"))
    if args.workdir is not None and os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        raise UsageError(f"--workdir {args.workdir} is a file; give a folder (created if missing)")
    if args.model_config is not None:
        # Fail before minutes of data generation, not after them.
        import json

        try:
            with open(args.model_config) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {args.model_config}: not a readable config.json ({e})") from None
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type not in MODEL_CLASSES:
            raise ValueError(f"--model {args.model_config}: model_type {model_type!r} is not one the demo "
                             f"trains; valid: {', '.join(sorted(MODEL_CLASSES))}")

    return run_demo(workdir=args.workdir, train_samples=args.train_samples, ranks=args.ranks, seed=args.seed,
                    repeats=args.repeats, model=args.model_config)


def _cmd_profile(args: argparse.Namespace) -> int:
    import json

    from tokenbal import profile

    if args.compare and args.trace_dir:
        raise UsageError(f"give a trace folder or --compare A B, not both ({args.trace_dir} was given with "
                         "--compare)")
    if not args.compare and not args.trace_dir:
        raise UsageError("give a trace folder, or --compare A B")
    _check_output_file("--timeline", args.timeline, (".png",))
    dirs = args.compare or [args.trace_dir]
    picks = args.run or [None] * len(dirs)
    if len(picks) != len(dirs):
        raise UsageError(f"--run takes {'one run number' if len(dirs) == 1 else 'two run numbers (A B)'} "
                         f"here, got {len(picks)}")
    runs = []
    for d, n in zip(dirs, picks, strict=True):
        # On stderr (tqdm's default): a --json document on stdout stays whole.
        with _progress_bar(not args.quiet, "reading traces" if len(dirs) == 1 else f"reading {d}") as report:
            runs.append(profile.profile_run(d, run=n, progress=report))
    if args.compare:
        print(json.dumps(profile.compare_as_dict(*runs), indent=1) if args.json
              else profile.format_compare(*runs))
    else:
        print(json.dumps(profile.profile_as_dict(runs[0]), indent=1) if args.json
              else profile.format_report(runs[0]))
    # With --json, stdout is one JSON document for a script to parse: what else is said goes to stderr.
    notes = sys.stderr if args.json else sys.stdout
    if args.hta:
        print(_hta_summary(dirs), file=notes)
    if args.timeline:
        profile.write_timeline(runs, args.timeline)
        print(f"timeline written to {args.timeline}", file=notes)
    return 0


@contextlib.contextmanager
def _progress_bar(enabled: bool, desc: str) -> Iterator[Callable[[int, int, str], None] | None]:
    """A tqdm bar on stderr that a ``progress(done, total, unit)`` callable moves (None under -q); it
    is drawn from the first report on, with that report's unit, and cleared at the end."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def report(done: int, total: int, unit: str) -> None:
        bar = bars.get(unit)
        if bar is None and done >= total:
            return          # a phase done in one report (one trace file): no bar to flash
        if bar is None:
            for old in bars.values():   # the next phase (shards checked, then files): one bar at a time
                old.close()
            bar = bars[unit] = tqdm(total=total, unit=unit, desc=desc, leave=False)
        bar.total = max(total, done)
        bar.update(done - bar.n)

    try:
        yield report
    finally:
        for bar in bars.values():
            bar.close()


def _hta_summary(dirs: Sequence[str]) -> str:
    """Holistic Trace Analysis' own per-rank tables, for traces with GPU kernels (HTA reads only those)."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return "--hta: HolisticTraceAnalysis is not installed (pip install HolisticTraceAnalysis)"
    out = []
    for d in dirs:
        try:
            analysis = TraceAnalysis(trace_dir=d)
            out += [f"HTA temporal breakdown ({d}):",
                    analysis.get_temporal_breakdown(visualize=False).to_string(),
                    f"HTA comm/comp overlap ({d}):",
                    analysis.get_comm_comp_overlap(visualize=False).to_string()]
        except Exception as e:  # noqa: BLE001 - HTA fails on host-only traces; say so and go on
            out.append(f"HTA could not analyse {d} ({type(e).__name__}: {e}); it needs GPU kernel events")
    return "\n".join(out)


# Numbers as written plainly: a value spelled otherwise ("0123", "1_000", "1e3", "nan") stays a string,
# since int() / float() would turn a numeric secret or id with leading zeros into another value.
_PLAIN_INT = re.compile(r"-?(0|[1-9][0-9]*)")
_PLAIN_FLOAT = re.compile(r"-?(0|[1-9][0-9]*)\.[0-9]+")


def _parse_override(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE as an int (``12``), a float (``0.5``), true / false, or else the string as
    given; an argparse type, so a malformed one is a usage error that argparse prefixes with the option's
    own name."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if _PLAIN_INT.fullmatch(value):
        return key, int(value)
    if _PLAIN_FLOAT.fullmatch(value):
        return key, float(value)
    return key, {"true": True, "false": False}.get(value.lower(), value)


_parse_override.__name__ = "KEY=VALUE"   # argparse names the type in "invalid KEY=VALUE value"


def _sample_limit(text: str) -> int | float:
    """``--max-bad-samples``: a count (``0``, ``25``) or a share of the samples seen (``0.5%``)."""
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if not 0 <= share <= 1:
                raise ValueError
            return share
        value = int(text)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or a percentage such as 1%, got {text!r}") \
            from None


def _seconds(text: str) -> float:
    """``--timeout`` / ``--total-timeout``: seconds >= 0 (0: no limit). A negative number or nan was
    taken as "no limit" (or failed deep in the remote reader), so a typo lifted the limit silently."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0; 0: no limit), got {text!r}") \
            from None
    if not value >= 0:   # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0; 0: no limit), got {text!r}")
    return value


_seconds.__name__ = "seconds"


def _add_remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", type=_parse_override,
                   help="fsspec option for remote URLs, e.g. endpoint_url=http://... (repeatable); "
                        "credentials come from the store's usual environment / config files")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="remote reads: seconds one request may take before it is retried (default 60; "
                        "0: no limit)")
    p.add_argument("--total-timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="remote reads: seconds one read may take, retries included, before it fails naming "
                        "the URL (default 600; 0: no limit)")


def _model_names() -> list[str]:
    from tokenbal.estimate.vision import estimator_names

    return list(estimator_names())


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``, so a bad value is a usage error naming the option,
    not a traceback from deep inside the planner."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = "positive integer" if low == 1 else f"integer >= {low}"
    return parse


_POSITIVE, _NON_NEGATIVE = _int_at_least(1), _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenbal",
        description="Token-balanced data loading for multimodal LLM training. "
                    "Build a token index offline, then let every rank plan balanced steps from it.")
    from tokenbal import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress details (INFO) and print a traceback with an error")
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
                       help="tar shards (local paths or fsspec URLs), globs or brace patterns "
                            "(data-{000..099}.tar); .json/.jsonl annotation files; .parquet files")
    build.add_argument("--model", default=None,
                       help="estimator (model family), one of: " + ", ".join(_model_names())
                            + "; or a checkpoint / processor folder (its processor configs); "
                              "default qwen2-vl")
    build.add_argument("--processor", default=None, metavar="DIR",
                       help="checkpoint or processor folder: estimator, tokenizer and chat template from "
                            "it, so rows with messages / conversations count what its apply_chat_template "
                            "gives (template tokens included; videos with the processor's own video "
                            "settings, from their headers); replaces --model and --tokenizer")
    build.add_argument("--out", required=True, help="index folder to write")
    build.add_argument("--workers", type=_POSITIVE, default=1, help="processes scanning shards in parallel")
    build.add_argument("--tokenizer", default=None,
                       help="local tokenizer folder or tokenizer.json for exact text counts "
                            "(default: a calibrated bytes-per-token heuristic)")
    build.add_argument("--image-root", default=None,
                       help="folder that image paths in JSON/JSONL annotations are relative to")
    build.add_argument("--estimator-option", action="append", default=[], metavar="KEY=VALUE",
                       type=_parse_override,
                       help="override an estimator setting, e.g. max_pixels=1003520 (repeatable)")
    build.add_argument("--rebuild", action="store_true",
                       help="rescan every shard and index exactly SOURCES; by default an existing index at "
                            "--out built with the same rules keeps its shards (unchanged ones without a "
                            "rescan, even those SOURCES does not name) and new shards are appended, and one "
                            "built with other rules (--model, --estimator-option, --tokenizer, --exif, "
                            "--image-root, Parquet columns) is refused, naming each difference, and so is "
                            "(with --part) one of another part or a whole index")
    build.add_argument("--max-bad-shards", type=_NON_NEGATIVE, default=0, metavar="N",
                       help="exit 1 (after writing the index) when more than N shards could not be indexed "
                            "(missing, unreadable, corrupt, empty); they are named on stderr (default 0)")
    build.add_argument("--max-bad-samples", type=_sample_limit, default=None, metavar="N|P%",
                       help="exit 1 when more than N samples (or P%% of the samples seen) were bad; by "
                            "default bad samples are listed in errors.jsonl and counted in the summary "
                            "without failing the build, unless no sample at all was indexed")
    build.add_argument("--drop-unlisted", action="store_true",
                       help="index exactly SOURCES: drop the existing index's shards that SOURCES does not "
                            "name (unchanged ones are still reused without a rescan)")
    build.add_argument("--exif", choices=["transpose", "ignore"], default="transpose",
                       help="EXIF orientation: 'transpose' (default) counts images as transformers' "
                            "load_image and tokenbal's reader see them (orientations 5-8 swap width and "
                            "height); 'ignore' counts them as stored. Recorded in the index")
    build.add_argument("--image-column", default=None,
                       help="Parquet sources: column of images (default images, else image)")
    build.add_argument("--messages-column", default=None,
                       help="Parquet sources: column of chat turns (default messages, else conversations)")
    build.add_argument("--text-column", default=None,
                       help="Parquet sources: column of plain text (used instead of a messages column)")
    build.add_argument("--video-column", default=None,
                       help="Parquet sources: column of a row's videos (paths, bytes or {bytes, path} "
                            "structs; default videos where the file has it, else the files the video "
                            "parts name)")
    build.add_argument("--part", default=None, metavar="I/N",
                       help="index only part I of N of the shards (0-based), for builds spread over "
                            "machines; 'env' reads RANK/WORLD_SIZE (torchrun) or the Slurm array ids. "
                            "{i} and {n} in --out are replaced. Join parts with `tokenbal index merge`")
    _add_remote_args(build)
    build.add_argument("--remote-read", choices=["auto", "ranges", "whole"], default="auto",
                       help="remote tar shards: ranged reads of headers and image heads (auto: unless the "
                            "server ignores ranges), or download each whole object")
    build.add_argument("--inflight", type=_POSITIVE, default=8,
                       help="remote shards scanned at once per worker process (default 8)")
    build.add_argument("--read-through", type=_NON_NEGATIVE, default=None, metavar="BYTES",
                       help="ranged reads: the tar header walk reads straight through stretches whose "
                            "members lie at most BYTES apart on average, in windows growing to 4 MiB, "
                            "instead of one request per member (default 262144; 0: never)")
    build.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=_cmd_index_build, command_parser=build)

    merge = isub.add_parser("merge", help="join part indexes (build --part) into one index",
                            description="Join the part indexes of one split into the index a single "
                                        "machine would have built (same rows, order and errors).")
    merge.add_argument("out", help="index folder to write")
    merge.add_argument("parts", nargs="+", help="part index folders (all parts of one split)")
    merge.add_argument("--replace", action="store_true",
                       help="replace an index at OUT even when it was built with other token settings or "
                            "holds shards the parts do not (refused by default, naming what would be lost)")
    merge.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    merge.set_defaults(func=_cmd_index_merge, command_parser=merge)

    export = isub.add_parser("export", help="write key / length / vision / text tokens as a table",
                             description="Export per-sample tokens (key, shard, length, vision_tokens, "
                                         "text_tokens) for other pipelines.")
    export.add_argument("dir", help="folder to write lengths.{parquet,jsonl,npy} into")
    export.add_argument("--index", required=True, help="index folder")
    export.add_argument("--format", choices=["parquet", "jsonl", "npy"], default="parquet",
                        help="lengths.parquet (default parquet), lengths.jsonl (one object per line), or "
                             "lengths.npy (N x 3 int64: length, vision, text) with keys.txt and shards.txt "
                             "(keys with a line break are refused)")
    export.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    export.set_defaults(func=_cmd_index_export, command_parser=export)

    stats = isub.add_parser("stats", help="print counts and token percentiles of an index",
                            description="Print an index's counts (samples, shards by status, errors, "
                                        "images, videos) and the min / p50 / p90 / p99 / max / mean of its "
                                        "tokens per sample (length, vision, text).")
    stats.add_argument("dir", help="index folder")
    stats.add_argument("--plot", default=None, metavar="PNG",
                       help="also write a histogram of vision / text tokens per sample to this PNG")
    stats.set_defaults(func=_cmd_index_stats, command_parser=stats)

    verify = isub.add_parser("verify", help="check an index and its shards (exit 1 if damaged or stale)",
                             description="Check an index's own files and every shard, annotation image and "
                                         "video file it was built from (size, mtime, member headers, "
                                         "fingerprint), and its --processor folder; print one line per "
                                         "problem. Exit 0 when there is none, 1 when the index is damaged "
                                         "or stale (rebuild it), 2 on a usage error or a folder that is "
                                         "not an index.")
    verify.add_argument("dir", help="index folder")
    verify.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    verify.add_argument("--allow-failed", action="store_true",
                        help="do not fail on shards the build could not read (missing, unreadable, a remote "
                             "read out of retries); they are still listed")
    _add_remote_args(verify)
    verify.set_defaults(func=_cmd_index_verify, command_parser=verify)

    plan = sub.add_parser("plan", help="simulate the balance of an epoch plan")
    psub = plan.add_subparsers(dest="plan_command", required=True)
    sim = psub.add_parser(
        "simulate", help="per-step rank balance: DistributedSampler, per-step LPT/KK and tokenbal",
        description="Plan one epoch from an index and print, per method, the mean / p95 / max over "
                    "steps of max/mean rank cost (1.000 = perfect), and how long tokenbal took to plan.")
    sim.add_argument("--index", required=True, help="index folder (tokenbal index build)")
    sim.add_argument("--world-size", type=_POSITIVE, required=True,
                     help="ranks in all: the data-parallel ranks, or with --sp-size S, S ranks per "
                          "data-parallel group")
    sim.add_argument("--global-batch-size", type=_POSITIVE, required=True, help="samples per step, all ranks")
    sim.add_argument("--grad-accum", type=_POSITIVE, default=1, help="micro-batches per rank per step")
    sim.add_argument("--sp-size", type=_POSITIVE, default=1,
                     help="sequence-parallel group size S: the ranks of an SP group share one packed row, so "
                          "the plan balances world-size / S data-parallel groups")
    sim.add_argument("--cost", choices=["tokens", "flops"], default="tokens", help="what to balance")
    sim.add_argument("--model-config", default=None,
                     help="config.json of the model for --cost flops (default: Qwen2-VL-7B dimensions)")
    sim.add_argument("--stages", action="store_true",
                     help="with --cost flops: also report Σ_stage max_rank / ideal per step (FSDP waits for "
                          "the slowest rank in the vision tower and again in the LLM), with and without "
                          "balancing the two stages separately")
    sim.add_argument("--seed", type=_NON_NEGATIVE, default=0,
                     help="seed of the epoch's order: tokenbal's plan and every baseline's permutation "
                          "(default 0)")
    sim.add_argument("--baseline-steps", type=_NON_NEGATIVE, default=500,
                     help="steps simulated for the per-step LPT/KK baselines (default 500)")
    sim.add_argument("--padded", action="store_true",
                     help="also padded batches: DistributedSampler, transformers' BatchRebalanceSampler and "
                          "tokenbal's cost='padded' plan on Σ per-step max padded tokens, padded/real, "
                          "packed")
    sim.add_argument("--plot", default=None, help="write per-step ratios: a .png chart or a .csv table")
    sim.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(func=_cmd_plan_simulate, command_parser=sim)

    prof = sub.add_parser(
        "profile", help="read every rank's profiler trace and name the bottleneck",
        description="Read the Chrome/Kineto JSON traces torch.profiler wrote (one per rank; torch_npu's "
                    "ASCEND_PROFILER_OUTPUT/trace_view.json too) and report, per rank and step, compute, "
                    "communication, exposed communication, overlap and idle time; per collective, the "
                    "count, bytes and arrival skew across ranks (the straggler signature); host syncs and "
                    "H2D copies inside the step (the cu_seqlens signature); copy operators inside rotary-"
                    "embedding code (the RoPE signature, needs with_stack=True); and a verdict table: what "
                    "each costs of the step and the tokenbal feature that addresses it. "
                    "scripts/train_fsdp2.py --profile DIR writes such traces.")
    prof.add_argument("trace_dir", nargs="?", help="folder of one run's traces (searched recursively)")
    prof.add_argument("--compare", nargs=2, metavar=("A", "B"),
                      help="two runs side by side, e.g. DistributedSampler (A) vs tokenbal (B)")
    prof.add_argument("--run", type=_POSITIVE, nargs="+", metavar="N",
                      help="the run to analyse when a folder holds traces of several runs (they are listed, "
                           "numbered oldest first, when none is picked); with --compare one number per "
                           "side (A B)")
    prof.add_argument("--timeline", metavar="PNG", help="write a per-rank step / wait timeline")
    prof.add_argument("--json", action="store_true",
                      help="print every table (per rank and step, collectives, verdict, notes) as JSON "
                           "instead of text, for scripts and CI")
    prof.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    prof.add_argument("--hta", action="store_true",
                      help="also print Holistic Trace Analysis' temporal breakdown and comm/comp overlap "
                           "(GPU traces only)")
    prof.set_defaults(func=_cmd_profile, command_parser=prof)

    demo = sub.add_parser(
        "demo", help="run the whole path on synthetic data, on CPU",
        description="Generate a small multimodal webdataset (real JPEG/PNG images of mixed sizes), "
                    "build its token index, compare per-step rank balance of DistributedSampler and "
                    "TokenBalancedBatchSampler at 8 ranks, train a tiny random Qwen2-VL with FSDP2 "
                    "on 2 CPU ranks with each sampler (alternating repeats), and check the packed loss "
                    "against transformers.")
    demo.add_argument("--workdir", default=None, help="keep the generated data here (default: a temp dir)")
    demo.add_argument("--train-samples", type=_POSITIVE, default=32,
                      help="samples in the training epoch run with each sampler, from --ranks to the 256 "
                           "written (default 32)")
    demo.add_argument("--repeats", type=_POSITIVE, default=2,
                      help="epochs per sampler, alternating between the two, for the speed-up and its noise "
                           "(default 2)")
    demo.add_argument("--ranks", type=_POSITIVE, default=2,
                      help="CPU ranks for the FSDP2 part: 1, 2, 4 or 8, dividing its global batch of 8 "
                           "(default 2)")
    # dest model_config: --model of the other commands is an estimator name, checked as one in main().
    demo.add_argument("--model", dest="model_config", metavar="CONFIG.json", default=None,
                      help="a config.json (Qwen2/2.5/3-VL, LLaVA-NeXT, LLaVA-OneVision, InternVL, GLM-4.1V) "
                           "to train randomly initialised instead of the tiny Qwen2-VL")
    demo.add_argument("--seed", type=_NON_NEGATIVE, default=0,
                      help="seed of the synthetic data, the model's random weights and both samplers' "
                           "orders (default 0)")
    demo.set_defaults(func=_cmd_demo, command_parser=demo)
    # -v after the command too (`tokenbal index verify DIR -v`, where one adds it to a failing command):
    # SUPPRESS keeps a -v given before the command when the sub-command's own is absent.
    for command in (build, merge, export, stats, verify, sim, prof, demo):
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log progress details (INFO) and print a traceback with an error")
    # A missing (sub-)command is named by its choices, not by the internal dest ("index_command").
    for group in (sub, isub, psub):
        group.metavar = "{" + ",".join(group.choices) + "}"
    return parser


def _is_folder(model: str) -> bool:
    import os

    return os.path.isdir(model)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tokenbal ARGS``; returns the exit status (argparse's own usage errors, ``--help`` and
    ``--version`` raise ``SystemExit`` as argparse does)."""
    try:
        code = _main(argv)
        sys.stdout.flush()   # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`tokenbal index stats DIR | head`): stop quietly. Python's recipe:
        # point stdout at devnull so that the flush at exit does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):   # stdout is not a real file (captured): nothing to flush
            pass
        return 1


def _main(argv: Sequence[str] | None) -> int:
    from tokenbal._extras import MissingExtraError
    from tokenbal.index.build import IndexBuildError

    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="tokenbal: %(levelname)s: %(message)s")
    logging.getLogger("tokenbal").setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except UsageError as e:
        args.command_parser.print_usage(sys.stderr)
        print(f"{args.command_parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise      # main's: not an error of this command
    except MissingExtraError:
        return _report(args, 1)
    except (ValueError, FileNotFoundError):
        return _report(args, 2)   # bad input: what the message names must be fixed
    except IndexBuildError:
        return _report(args, 1)   # another build holds the folder, a scan worker was killed
    except KeyboardInterrupt:
        print("tokenbal: interrupted", file=sys.stderr)
        return 130
    except OSError:
        return _report(args, 1)   # the environment: permissions, a full disk, a network failure


def _report(args: argparse.Namespace, code: int) -> int:
    """One ``tokenbal <command>: error:`` line for the exception being handled (its traceback with
    -v), the command named as argparse names it in a usage error (``tokenbal index build``)."""
    e = sys.exc_info()[1]
    if args.verbose:
        import traceback

        traceback.print_exc()
    print(f"{_command_name(args)}: error: {e}", file=sys.stderr)
    return code


def _command_name(args: argparse.Namespace) -> str:
    """``tokenbal index build``: the program, the command and its sub-command, if any."""
    command = getattr(args, "command", None)
    sub = getattr(args, f"{command}_command", None) if command else None
    return " ".join(part for part in ("tokenbal", command, sub) if part)


if __name__ == "__main__":
    sys.exit(main())
