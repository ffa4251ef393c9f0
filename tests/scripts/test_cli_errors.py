"""The CLI a newcomer meets (issue 31): every mistake is one ``error:`` line with the right exit status,
never a traceback; a build's exit status says whether shards or samples failed; an index of other
settings is not replaced by accident; a missing optional dependency names its pip extra.

Each case here is a row of the "CLI errors" table in docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.corpus import Sample, make_corpus, write_shard
from tests.helpers.paths import REPO
from tokenbal.cli import main
from tokenbal.index import TokenIndex, build_index

# every error line names its command, as argparse's usage errors do
BUILD = "tokenbal index build: error: "
SIMULATE = "tokenbal plan simulate: error: "
DEMO = "tokenbal demo: error: "


def run(args: list[str], capsys) -> tuple[int, str, str]:
    """``tokenbal ARGS`` in this process: (exit status, stdout, stderr), argparse's SystemExit too."""
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean 3-shard corpus and its qwen2-vl index."""
    root = tmp_path_factory.mktemp("clean")
    corpus = make_corpus(root / "data", n_shards=3, samples_per_shard=4, bad=False)
    return corpus, build_index(corpus.shards, root / "idx", progress=False).out


# --- usage errors: argparse style, exit 2 ---------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--estimator-option", "max_pixels"],
     "argument --estimator-option: expected KEY=VALUE, got 'max_pixels'"),
    (["--storage-option", "anon"], "argument --storage-option: expected KEY=VALUE, got 'anon'"),
    (["--estimator-option", "=3"], "argument --estimator-option: expected KEY=VALUE, got '=3'"),
    (["--model", "qwen9-vl"], "argument --model: unknown model 'qwen9-vl'; valid: "),
    (["--part", "3"], "--part expects I/N"),
    (["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["--max-bad-samples", "lots"], "argument --max-bad-samples: expected a count >= 0 or a percentage"),
    (["--max-bad-shards", "-1"], "argument --max-bad-shards: must be an integer >= 0"),
    # a negative timeout silently meant "no limit"; nan failed inside the remote reader
    (["--timeout", "-5"], "argument --timeout: expected seconds (a number >= 0; 0: no limit), got '-5'"),
    (["--total-timeout", "nan"], "argument --total-timeout: expected seconds (a number >= 0; 0: no limit), "
                                 "got 'nan'"),
])
def test_build_usage_errors(clean, tmp_path, capsys, extra, message):
    corpus, _ = clean
    code, out, err = run(["index", "build", *corpus.shards, "--out", str(tmp_path / "i"), "-q", *extra],
                         capsys)
    assert code == 2 and message in err and "tokenbal index build: error:" in err
    assert err.startswith("usage: tokenbal index build")
    assert not (tmp_path / "i").exists()
    if extra[0] == "--model":
        assert "qwen2-vl" in err and "internvl" in err     # the valid names, listed


def test_key_value_options_keep_values_that_are_not_plain_numbers_as_written():
    """``--storage-option secret=0123`` reached fsspec as the int 123 (int() drops leading zeros and
    reads ``1_000``); plain numbers and true / false are still converted."""
    from tokenbal.cli import build_parser

    args = build_parser().parse_args(["index", "build", "x.tar", "--out", "o"] + [
        a for kv in ("secret=0123", "project=1_000", "token=1e3", "block_size=5242880", "ratio=0.5",
                     "anon=true", "endpoint_url=http://minio:9000") for a in ("--storage-option", kv)])
    assert dict(args.storage_option) == {"secret": "0123", "project": "1_000", "token": "1e3",
                                         "block_size": 5242880, "ratio": 0.5, "anon": True,
                                         "endpoint_url": "http://minio:9000"}


@pytest.mark.parametrize("extra, message", [
    (["--stages"], SIMULATE + "--stages needs --cost flops"),
    (["--model-config", "config.json"], SIMULATE + "--model-config is used by --cost "
                                        "flops only"),
    (["--world-size", "8", "--sp-size", "3"], "error: --sp-size 3 must divide --world-size 8"),
])
def test_simulate_usage_errors(clean, capsys, extra, message):
    _, index = clean
    code, _, err = run(["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size",
                        "8", *extra], capsys)
    assert code == 2 and message in err


def test_simulate_help_says_world_size_counts_every_rank(capsys, monkeypatch):
    """``--world-size`` was described as "data-parallel ranks", but with ``--sp-size S`` it is every rank:
    the plan balances world-size / S groups (``--world-size 8 --sp-size 2``: 4 groups)."""
    monkeypatch.setenv("COLUMNS", "400")   # argparse's width: each option's help on its own line
    with pytest.raises(SystemExit):
        main(["plan", "simulate", "--help"])
    options = capsys.readouterr().out.split("\n  -")   # one entry per option: its name, then its help
    world = " ".join(next(o for o in options if o.startswith("-world-size WORLD_SIZE")).split()[2:])
    assert world == ("ranks in all: the data-parallel ranks, or with --sp-size S, S ranks per data-parallel "
                     "group")


def test_simulate_checks_the_plan_settings_before_reading_the_index(tmp_path, capsys):
    # One PlanSettings over the 4 data-parallel groups, checked before the (missing) index is opened.
    code, _, err = run(["plan", "simulate", "--index", str(tmp_path / "none"), "--world-size", "8",
                        "--sp-size", "2", "--global-batch-size", "2"], capsys)
    assert code == 2 and SIMULATE + "global_batch_size=2 is smaller than num_replicas=4" in err


def test_simulate_bad_model_config_is_one_line(clean, tmp_path, capsys):
    _, index = clean
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    common = ["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size", "4",
              "--cost", "flops"]
    code, _, err = run([*common, "--model-config", str(bad)], capsys)
    assert code == 2 and err.startswith(SIMULATE + f"--model-config {bad} is not valid JSON")
    code, _, err = run([*common, "--model-config", str(tmp_path / "none.json")], capsys)
    assert code == 2 and "no such file" in err
    bad.write_text(json.dumps({"hidden_size": 64}))
    code, _, err = run([*common, "--model-config", str(bad)], capsys)
    assert code == 2 and "is not a model config tokenbal can read" in err
    # A checkpoint folder (what --model takes) and a binary file: one line naming the option, exit 2
    # (they were an "[Errno 21] Is a directory" with exit 1 and a bare UnicodeDecodeError).
    code, _, err = run([*common, "--model-config", str(tmp_path)], capsys)
    assert code == 2 and err.strip() == SIMULATE + f"--model-config {tmp_path} is a folder; give {bad}"
    bad.write_bytes(b"\xff\xd8\xff\xe0 a JPEG, not a config")
    code, _, err = run([*common, "--model-config", str(bad)], capsys)
    assert code == 2
    assert err.strip() == SIMULATE + f"--model-config {bad} is not a text file (a config.json is UTF-8 JSON)"


def test_verbose_goes_before_or_after_the_command(tmp_path, capsys):
    """``-v`` is what one adds to a failing command for its traceback, at the end of the line: ``tokenbal
    index verify DIR -v`` was ``unrecognized arguments: -v``."""
    missing = str(tmp_path / "none")
    for argv in (["-v", "index", "verify", missing], ["index", "verify", missing, "-v"],
                 ["index", "verify", missing, "--verbose"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.endswith(f"tokenbal index verify: error: index folder not found: "
                                                   f"{missing}\n")
    assert main(["index", "verify", missing]) == 2
    assert capsys.readouterr().err == f"tokenbal index verify: error: index folder not found: {missing}\n"


def test_profile_without_a_folder_is_a_usage_error(capsys):
    code, _, err = run(["profile"], capsys)
    assert code == 2 and "tokenbal profile: error: give a trace folder, or --compare A B" in err


def test_plot_files_of_another_type_or_in_a_missing_folder_are_refused_before_the_work(clean, tmp_path,
                                                                                       capsys):
    """``plan simulate --plot ratios.txt`` (or ``R.CSV``) used to write PNG bytes under that name, and
    ``--plot missing/r.png`` to fail with a bare OSError only after the whole simulation."""
    pytest.importorskip("matplotlib")
    _, index = clean
    simulate = ["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size", "4"]
    code, out, err = run([*simulate, "--plot", str(tmp_path / "ratios.txt")], capsys)
    assert code == 2 and out == "" and not (tmp_path / "ratios.txt").exists()
    assert SIMULATE + f"--plot {tmp_path / 'ratios.txt'}: give a .png or .csv file name" in err
    code, out, err = run([*simulate, "--plot", str(tmp_path / "missing" / "r.png")], capsys)
    assert code == 2 and out == ""
    assert f"--plot {tmp_path / 'missing' / 'r.png'}: folder {tmp_path / 'missing'} does not exist" in err
    code, _, _ = run([*simulate, "--plot", str(tmp_path / "R.CSV")], capsys)
    assert code == 0 and (tmp_path / "R.CSV").read_text().startswith("step,DistributedSampler,")
    code, out, err = run(["index", "stats", index, "--plot", str(tmp_path / "h.csv")], capsys)
    assert code == 2 and out == "" and not (tmp_path / "h.csv").exists()
    assert "tokenbal index stats: error: --plot " in err and "give a .png file name" in err
    code, _, err = run(["profile", str(tmp_path), "--timeline", str(tmp_path / "t.jpg")], capsys)
    assert code == 2 and "tokenbal profile: error: --timeline " in err and "give a .png file name" in err


def test_output_files_that_are_folders_are_refused_before_the_work(clean, tmp_path, capsys):
    """``--plot x.csv`` / ``--timeline x.png`` naming an existing folder ran the whole simulation (or read
    every trace), printed its report, then failed with a bare "[Errno 21] Is a directory" (exit 1)."""
    _, index = clean
    for name in ("ratios.csv", "ratios.png", "hist.png", "timeline.png"):
        os.makedirs(tmp_path / name)
    simulate = ["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size", "4"]
    for name in ("ratios.csv", "ratios.png"):
        code, out, err = run([*simulate, "--plot", str(tmp_path / name)], capsys)
        assert code == 2 and out == ""
        assert err.splitlines()[-1] == SIMULATE + f"--plot {tmp_path / name} is a folder; give a file name " \
                                                  "in it"
    code, out, err = run(["index", "stats", index, "--plot", str(tmp_path / "hist.png")], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (f"tokenbal index stats: error: --plot {tmp_path / 'hist.png'} is a "
                                    "folder; give a file name in it")
    code, out, err = run(["profile", str(tmp_path), "--timeline", str(tmp_path / "timeline.png")], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == f"tokenbal profile: error: --timeline {tmp_path / 'timeline.png'} is a " \
                                   "folder; give a file name in it"


def test_simulate_padded_batch_not_divisible_is_refused_before_the_work(clean, capsys):
    """``--padded`` with a global batch the ranks x grad_accum do not divide: the first table was
    printed (exit 2 under a report), the error only after it; now refused first, naming the numbers."""
    _, index = clean
    code, out, err = run(["plan", "simulate", "--index", index, "--world-size", "2",
                          "--global-batch-size", "8", "--grad-accum", "3", "--padded", "-q"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (SIMULATE + "--padded: needs a global batch size divisible by ranks x "
                                    "grad_accum (2 x 3 = 6), got 8: the padded baselines take per-device "
                                    "batches of global / (ranks x grad_accum)")


def test_simulate_padded_seed_beyond_torch_generators_is_refused_before_the_work(clean, capsys):
    """``--seed 2**64 --padded``: the first table, then "error: Overflow when unpacking long long" (from
    torch.Generator.manual_seed); without --padded the seed only feeds numpy and stays accepted."""
    _, index = clean
    simulate = ["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size", "4", "-q"]
    code, out, err = run([*simulate, "--seed", str(2**64), "--padded"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (SIMULATE + f"--seed {2**64}: --padded runs torch's DistributedSampler "
                                    "and transformers' BatchRebalanceSampler, whose torch generators take "
                                    f"seeds up to 2**64 - 1 ({2**64 - 1})")
    assert run([*simulate, "--seed", str(2**64)], capsys)[0] == 0


def test_simulate_padded_says_n_a_for_a_baseline_without_a_whole_step(clean, capsys):
    """12 samples on 2 ranks, 4 per device, 3 micro-batches per step: each rank's DistributedSampler has
    6 samples, 2 batches, no whole optimizer step. Its row read 0 / 0.000 / 0 / 0 (the best figures
    in the table) for a baseline that ran no step; now n/a with 0 steps, and every row has its steps."""
    pytest.importorskip("transformers")
    _, index = clean
    code, out, _ = run(["plan", "simulate", "--index", index, "--world-size", "2",
                        "--global-batch-size", "24", "--grad-accum", "3", "--padded", "-q"], capsys)
    assert code == 0
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("method") and "Σ max padded" in line)
    assert lines[head].split()[-1] == "steps"
    rows = {line[:34].strip(): line[34:].split() for line in lines[head + 1:]}
    assert rows["DistributedSampler"] == ["n/a", "n/a", "n/a", "n/a", "0"]
    assert all(int(row[-1]) >= 1 for name, row in rows.items() if name != "DistributedSampler")


def test_a_file_given_for_the_index_folder_is_named_a_file(clean, capsys):
    """A shard or the manifest given where the index folder goes said "index folder not found: X" of a
    path that exists."""
    corpus, index = clean
    shard = corpus.shards[0]
    code, out, err = run(["plan", "simulate", "--index", shard, "--world-size", "2",
                          "--global-batch-size", "4"], capsys)
    assert code == 2 and out == ""
    assert err == (SIMULATE + f"{shard} is a file, not an index folder (give the folder `tokenbal index "
                   "build --out` wrote)\n")
    manifest = os.path.join(index, "manifest.json")
    for command in (["index", "stats", manifest], ["index", "verify", manifest, "-q"]):
        code, out, err = run(command, capsys)
        assert code == 2 and out == ""
        assert err == (f"tokenbal index {command[1]}: error: {manifest} is a file, not an index folder; give "
                       f"its folder {os.path.abspath(index)}\n")


def test_an_index_without_its_errors_file_is_named_damaged(clean, tmp_path, capsys):
    """errors.jsonl removed: stats and export said "[Errno 2] No such file or directory: ..." (verify
    already said "index file missing")."""
    import shutil

    _, index = clean
    copy = tmp_path / "idx"
    shutil.copytree(index, copy)
    os.remove(copy / "errors.jsonl")
    for command in (["index", "stats", str(copy)],
                    ["index", "export", str(tmp_path / "out"), "--index", str(copy)]):
        code, out, err = run(command, capsys)
        assert code == 2 and out == ""
        assert err.strip() == (f"tokenbal index {command[1]}: error: index file missing: "
                               f"{copy / 'errors.jsonl'} (rebuild the index)")


# --- plan simulate: ranks beyond the samples, step counts explained -------------------------------

def test_simulate_refuses_more_ranks_than_samples(clean, capsys):
    _, index = clean
    code, out, err = run(["plan", "simulate", "--index", index, "--world-size", "512",
                          "--global-batch-size", "512"], capsys)
    assert code == 2 and out == ""
    assert err.strip() == (SIMULATE + "512 ranks but only 12 samples: every step would leave at least "
                           "500 rank(s) without a sample; simulate at most 12 (data-parallel) ranks, or a "
                           "larger index")


def test_simulate_of_an_index_without_samples_says_so(tmp_path, capsys):
    """An index whose every shard failed: the planner's "1 ranks but only 0 samples ... simulate at most 0
    (data-parallel) ranks" pointed at the ranks, not at the empty index."""
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar\n")
    out = build_index([str(bad)], tmp_path / "idx", progress=False).out
    code, out_text, err = run(["plan", "simulate", "--index", out, "--world-size", "1",
                               "--global-batch-size", "1"], capsys)
    assert code == 2 and out_text == ""
    assert err.strip() == (SIMULATE + f"--index {out} holds no samples (1 error(s), listed in its "
                           "errors.jsonl): nothing to simulate")


def test_simulate_says_why_step_counts_differ(clean, capsys):
    _, index = clean
    code, out, _ = run(["plan", "simulate", "--index", index, "--world-size", "4", "--global-batch-size",
                        "8"], capsys)
    assert code == 0
    assert ("note: step counts differ: DistributedSampler drops the last 4 of 12 samples (drop_last); "
            "per-step LPT/KK drop the last 4 (they cut the epoch into full steps of 8); tokenbal plans every "
            "sample: 2 step(s), the last with 4 samples") in out
    # A global batch larger than the index: the baselines have no step, shown as n/a, not 1.000.
    code, out, _ = run(["plan", "simulate", "--index", index, "--world-size", "4", "--global-batch-size",
                        "16"], capsys)
    assert code == 0
    rows = {line[:34].strip(): line[34:].split() for line in out.splitlines()}
    assert rows["DistributedSampler"] == ["n/a", "n/a", "n/a", "0"] == rows["per-step LPT"]
    assert rows["tokenbal"][-1] == "1" and "note: n/a: 12 samples do not fill one step of 16" in out
    # With grad_accum the planner merges a last step of fewer samples than ranks x micro-batches: the
    # note said "a last step of 4 samples, fewer than the 2 ranks" (4 is not fewer than 2).
    code, out, _ = run(["plan", "simulate", "--index", index, "--world-size", "2", "--global-batch-size",
                        "8", "--grad-accum", "3", "-q"], capsys)
    assert code == 0
    assert ("tokenbal plans every sample: 1 step(s), the last with 12 samples (a last step of 4 samples, "
            "fewer than the 2 ranks x 3 micro-batches, is merged into it)") in out


# --- index build: exit status, other settings ------------------------------------------------------

def test_build_exit_status_counts_bad_shards_and_samples(tmp_path, capsys):
    # 2 good shards (one with 2 bad samples) and a truncated one
    corpus = make_corpus(tmp_path / "data", n_shards=2, samples_per_shard=4)
    (truncated,) = corpus.bad_shards
    args = ["index", "build", *corpus.shards, "-q"]
    code, out, err = run([*args, "--out", str(tmp_path / "a")], capsys)
    assert code == 1 and out.startswith(f"indexed {len(corpus.good)} samples")
    assert (BUILD + "1 of 3 shards could not be indexed (allowed: 0, "
            f"--max-bad-shards): {truncated} (truncated: ") in err
    assert "the index was written without them" in err
    assert len(TokenIndex.open(tmp_path / "a")) == len(corpus.good)    # written all the same
    # Bad samples do not fail a build by default; --max-bad-samples makes them.
    assert run([*args, "--out", str(tmp_path / "b"), "--max-bad-shards", "1"], capsys)[0] == 0
    code, _, err = run([*args, "--out", str(tmp_path / "c"), "--max-bad-shards", "1",
                        "--max-bad-samples", "1"], capsys)
    assert code == 1 and f"2 of {len(corpus.good) + 2} samples could not be indexed (allowed: 1" in err
    assert truncated not in err
    assert run([*args, "--out", str(tmp_path / "d"), "--max-bad-shards", "1", "--max-bad-samples", "25%"],
               capsys)[0] == 0


def test_build_refuses_to_replace_an_index_of_other_settings(clean, tmp_path, capsys):
    corpus, _ = clean
    out = str(tmp_path / "idx")
    args = ["index", "build", *corpus.shards[:2], "--out", out, "-q"]
    assert run(args, capsys)[0] == 0
    before = TokenIndex.open(out).build_id
    code, _, err = run([*args[:3], corpus.shards[2], *args[4:], "--model", "internvl"], capsys)
    assert code == 2
    assert err.startswith(BUILD + f"--out {out} holds an index of 8 samples from 2 shards built "
                          "with other settings (model: index 'qwen2-vl', this build 'internvl'); pass "
                          "--rebuild")
    code, _, err = run([*args, "--estimator-option", "max_pixels=200704"], capsys)
    assert code == 2 and "max_pixels: index 12845056, this build 200704" in err
    assert TokenIndex.open(out).build_id == before                 # untouched
    assert run([*args, "--model", "internvl", "--rebuild"], capsys)[0] == 0
    assert TokenIndex.open(out).manifest["estimator"]["model"] == "internvl"
    # Same settings: an ordinary incremental build.
    code, out_text, _ = run([*args, "--model", "internvl"], capsys)
    assert code == 0 and "2 unchanged shards reused" in out_text


def test_a_second_build_of_one_folder_is_one_line_exit_1(clean, tmp_path, capsys):
    import threading

    from tokenbal.index.build import _BuildLock

    corpus, _ = clean
    out = str(tmp_path / "idx")
    held, done = threading.Event(), threading.Event()

    def hold():   # another build in progress: a thread of this process holds the folder's lock
        with _BuildLock(os.path.abspath(out)):
            held.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        code, _, err = run(["index", "build", *corpus.shards, "--out", out, "-q"], capsys)
    finally:
        done.set()
        holder.join(60)
    assert code == 1 and err.startswith(BUILD + f"another build is writing the index {out}")
    assert err.count("\n") == 1


def test_stats_names_referenced_images_and_stored_members(clean, capsys):
    _, index = clean
    code, out, _ = run(["index", "stats", index], capsys)
    assert code == 0
    assert "images referenced: " in out and "stored members: " in out
    assert "  images: " not in out and "  members: " not in out


# --- missing optional dependencies: one line naming the extra --------------------------------------

def _block(monkeypatch, *modules: str) -> None:
    for name in modules:   # None in sys.modules: `import name` raises ImportError, as when not installed
        monkeypatch.setitem(sys.modules, name, None)


def test_parquet_build_and_export_without_pyarrow_name_the_extra(clean, tmp_path, capsys, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, index = clean
    pq.write_table(pa.table({"text": ["a caption"]}), tmp_path / "t.parquet")
    _block(monkeypatch, "pyarrow", "pyarrow.parquet")
    code, out, err = run(["index", "build", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "i"), "-q"],
                         capsys)
    assert code == 1 and out == "" and not (tmp_path / "i").exists()
    assert err == (BUILD + "Parquet sources need pyarrow, which is not installed: "
                   "pip install 'tokenbal[parquet]'\n")
    code, _, err = run(["index", "export", str(tmp_path / "x"), "--index", index], capsys)
    assert code == 1 and err.count("\n") == 1 and "pip install 'tokenbal[parquet]'" in err
    code, _, _ = run(["index", "export", str(tmp_path / "x"), "--index", index, "--format", "jsonl"], capsys)
    assert code == 0


def test_video_build_without_av_names_the_extra(tmp_path, capsys, monkeypatch):
    pytest.importorskip("av")
    from tests.helpers.videos import write_video

    clip = write_video(str(tmp_path / "c.mp4"), 4, 64, 48)
    with open(clip, "rb") as f:
        shard = write_shard(tmp_path / "v.tar", [Sample("v0", caption="a clip", raw=[("mp4", f.read())])])
    _block(monkeypatch, "av")
    code, _, err = run(["index", "build", shard, "--out", str(tmp_path / "i"), "-q"], capsys)
    assert code == 1
    assert err == (BUILD + "video samples need av (PyAV), which is not installed: "
                   "pip install 'tokenbal[video]'\n")


def test_url_sources_without_fsspec_name_the_extra(tmp_path, capsys, monkeypatch):
    _block(monkeypatch, "fsspec")
    code, _, err = run(["index", "build", "s3://bucket/data-{000..003}.tar", "--out", str(tmp_path / "i"),
                        "-q"], capsys)
    assert code == 1 and err.endswith("pip install 'tokenbal[remote]'\n") and err.count("\n") == 1


def test_url_sources_without_their_fsspec_backend_say_what_to_install(tmp_path, capsys, monkeypatch):
    pytest.importorskip("fsspec")
    _block(monkeypatch, "gcsfs")
    code, _, err = run(["index", "build", "gs://bucket/data-000.tar", "--out", str(tmp_path / "i"), "-q"],
                       capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(BUILD + "gs:// sources need an fsspec backend that is not installed")
    assert "gcsfs for gs://" in err


# --- the console: a closed pipe ----------------------------------------------------------------------

def test_stats_into_a_closed_pipe_exits_quietly(clean):
    _, index = clean
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # `tokenbal index stats DIR | head -0`: the reader is gone before the first line is written.
    proc = subprocess.Popen([sys.executable, "-m", "tokenbal.cli", "index", "stats", index], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == ""


# --- issue 51: no traceback, and every error names its option, file or row ---------------------------

# `python -c BLOCKER MODULE... -- ARGS`: tokenbal's CLI in a fresh process where importing the named
# top-level modules fails as if they were not installed (an import hook, nothing uninstalled).
BLOCKER = """
import importlib.abc, sys
blocked = set(sys.argv[1:sys.argv.index("--")])
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
from tokenbal.cli import main
sys.exit(main(sys.argv[sys.argv.index("--") + 1:]))
"""


def run_without(modules: list[str], args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", BLOCKER, *modules, "--", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def text_rows(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "a caption"}) + "\n")
    return str(rows)


def test_png_outputs_without_matplotlib_are_refused_before_the_work(clean, tmp_path):
    """``plan simulate --plot r.png`` / ``profile --timeline t.png`` without matplotlib ran the whole
    simulation (minutes with --padded at scale) or read every trace, printed the report, then said
    "plots need matplotlib" (exit 1); now said first, nothing printed."""
    _, index = clean
    done = run_without(["matplotlib"], ["plan", "simulate", "--index", index, "--world-size", "2",
                                        "--global-batch-size", "4", "-q", "--plot", str(tmp_path / "r.png")],
                       tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == SIMULATE + "plots need matplotlib: pip install 'tokenbal[plot]'\n"
    (tmp_path / "traces").mkdir()
    done = run_without(["matplotlib"], ["profile", str(tmp_path / "traces"), "-q", "--timeline",
                                        str(tmp_path / "t.png")], tmp_path)
    # (an empty folder: the trace read would have been the error; the missing extra comes first now)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "tokenbal profile: error: plots need matplotlib: pip install 'tokenbal[plot]'\n"


def test_simulate_padded_without_transformers_says_which_row_is_missing(clean, tmp_path):
    """Without transformers the batch_rebalance row was silently absent from the --padded table (its
    --help names it); now a note under the table says why."""
    _, index = clean
    done = run_without(["transformers"], ["plan", "simulate", "--index", index, "--world-size", "2",
                                          "--global-batch-size", "4", "-q", "--padded"], tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    assert "batch_rebalance (transformers)  " not in done.stdout
    assert done.stdout.splitlines()[-1] == ("note: no batch_rebalance (transformers) row: transformers is "
                                            "not installed (pip install 'tokenbal[hf]')")


def test_processor_and_tokenizer_without_their_packages_name_the_extra(text_rows, tmp_path):
    (tmp_path / "proc").mkdir()
    done = run_without(["transformers"], ["index", "build", text_rows, "--processor", str(tmp_path / "proc"),
                                          "--out", str(tmp_path / "i"), "-q"], tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr == (BUILD + "--processor (counting through the processor's chat template) "
                           "need transformers, which is not installed: pip install 'tokenbal[hf]'\n")
    done = run_without(["tokenizers"], ["index", "build", text_rows, "--tokenizer", str(tmp_path / "proc"),
                                        "--out", str(tmp_path / "i"), "-q"], tmp_path)
    assert done.returncode == 1 and done.stderr == (
        BUILD + "exact text counts (--tokenizer) need tokenizers, which is not installed: "
        "pip install 'tokenbal[hf]'\n")


def test_demo_without_transformers_is_one_line(tmp_path):
    done = run_without(["transformers"], ["demo", "--workdir", str(tmp_path / "w")], tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (DEMO + "tokenbal demo (it trains a tiny model with transformers' "
                           "classes) need transformers, which is not installed: pip install 'tokenbal[hf]'\n")


@pytest.mark.parametrize("extra, message", [
    # each of 16 ranks failed on its own after the data was written (batch_size=0, a traceback per rank)
    (["--ranks", "16"], "--ranks 16: the demo trains 8 samples per step, which the ranks must divide "
                        "(DistributedSampler takes 8 / ranks per rank); give 1, 2, 4 or 8"),
    (["--ranks", "3"], "--ranks 3: the demo trains 8 samples per step"),
    # the epoch was the 256 samples written while the report said 1000
    (["--train-samples", "1000"], "--train-samples 1000: the demo writes 256 samples and each of the 2 ranks "
                                  "needs one; give 2 to 256"),
    (["--ranks", "4", "--train-samples", "2"], "--train-samples 2: the demo writes 256 samples and each of "
                                               "the 4 ranks needs one; give 4 to 256"),
    # "[Errno 20] Not a directory: 'FILE/shards'" (exit 1) after the first line of the demo
    (["--workdir", "FILE"], "--workdir FILE is a file; give a folder (created if missing)"),
    # torch.manual_seed in every rank: "Overflow when unpacking long long"
    (["--seed", str(2**64)], f"--seed {2**64}: the demo seeds torch (the model's weights), whose torch "
                             "generators take seeds up to 2**64 - 1"),
])
def test_demo_settings_it_cannot_run_are_refused_before_the_work(tmp_path, capsys, extra, message):
    pytest.importorskip("transformers")
    (tmp_path / "afile").write_text("")
    extra = [str(tmp_path / "afile") if a == "FILE" else a for a in extra]
    code, out, err = run(["demo", *extra], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith(DEMO + message.replace("FILE", str(tmp_path / "afile")))


def test_processor_mistakes_are_named(text_rows, tmp_path, capsys):
    out = str(tmp_path / "i")
    missing = str(tmp_path / "none")
    code, _, err = run(["index", "build", text_rows, "--processor", missing, "--out", out, "-q"], capsys)
    assert code == 2 and err == BUILD + f"--processor {tmp_path / 'none'}: no such folder\n"
    code, _, err = run(["index", "build", text_rows, "--processor", text_rows, "--out", out, "-q"], capsys)
    assert code == 2 and err.startswith(BUILD + f"--processor {text_rows} is a file; give the ")
    (tmp_path / "proc").mkdir()
    code, _, err = run(["index", "build", text_rows, "--processor", str(tmp_path / "proc"), "--model",
                        "internvl", "--out", out, "-q"], capsys)
    assert code == 2 and err.splitlines()[-1] == (
        BUILD + "give --processor or --model, not both (--processor "
        f"{tmp_path / 'proc'} gives the estimator; --model internvl would be ignored)")
    assert not os.path.exists(out)


def test_host_based_url_sources_need_their_host(tmp_path, capsys):
    pytest.importorskip("fsspec")
    code, _, err = run(["index", "build", "ftp:///data/a.tar", "--out", str(tmp_path / "i"), "-q"], capsys)
    assert code == 2 and err == (BUILD + "ftp:// sources need host, which neither the URL nor "
                                 "--storage-option gives (e.g. ftp://HOST/path/data.tar, or --storage-option "
                                 "host=...)\n")
    # The host is read from the URL; a store that refuses the connection is named by its URL.
    url = "ftp://127.0.0.1:1/data/a.tar"
    code, _, err = run(["index", "build", url, "--out", str(tmp_path / "i"), "-q"], capsys)
    assert code == 1 and err.startswith(BUILD + f"{url}: cannot connect to its store (")
    assert err.count("\n") == 1


def test_a_url_image_in_an_annotation_row_says_urls_are_not_fetched(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "<image> a cat", "image": "http://example.com/cat.jpg"}) + "\n"
                    + json.dumps({"text": "a caption"}) + "\n"
                    + json.dumps({"text": "a clip", "video": "s3://bucket/clip.mp4"}) + "\n")
    code, _, _ = run(["index", "build", str(rows), "--out", str(tmp_path / "i"), "-q"], capsys)
    assert code == 0
    error, video = TokenIndex.open(tmp_path / "i").errors
    assert video["reason"].startswith(f"{rows}:3: video 0 's3://bucket/clip.mp4' is a URL: ")
    assert error["reason"].startswith(f"{rows}:1: image 0 'http://example.com/cat.jpg' is a URL: annotation "
                                      "records are read with their images as local files")
    assert "URLs are not fetched" in error["reason"] and "not found at" not in error["reason"]


def test_a_full_disk_names_the_file(clean, tmp_path, capsys, monkeypatch):
    import errno
    import shutil

    from tokenbal.index import build

    def full(*args, **kwargs):     # what a write() on a full disk raises: no file name
        raise OSError(errno.ENOSPC, "No space left on device")

    corpus, _ = clean
    monkeypatch.setattr(build.shutil, "copyfileobj", full)
    code, _, err = run(["index", "build", *corpus.shards, "--out", str(tmp_path / "i"), "-q"], capsys)
    monkeypatch.setattr(build.shutil, "copyfileobj", shutil.copyfileobj)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(BUILD + "[Errno 28] No space left on device: '") and ".npy'" in err
    assert f".{os.path.basename(tmp_path / 'i')}." in err       # the build's folder beside --out


@pytest.mark.parametrize("args,choices", [([], "{index,plan,profile,demo}"),
                                          (["index"], "{build,merge,export,stats,verify}"),
                                          (["plan"], "{simulate}")])
def test_a_missing_command_is_named_by_its_choices(args, choices, capsys):
    """``tokenbal index`` alone said "required: index_command", argparse's internal name."""
    code, _, err = run(args, capsys)
    assert code == 2 and err.strip().endswith(f"error: the following arguments are required: {choices}")


def test_output_folders_that_cannot_be_made_name_their_option(clean, tmp_path, capsys):
    """A build into ``/proc/x`` said ``[Errno 2] No such file or directory: '/proc/.x.lock'`` (the lock
    file, not the option), and into ``afile/sub`` ``[Errno 17] File exists: 'afile'`` with exit 1, as if
    the environment had failed; a merge or an export named the path alone."""
    corpus, index = clean
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    parts = [str(tmp_path / f"p{i}") for i in range(2)]
    for i, part in enumerate(parts):
        build_index(corpus.shards, part, progress=False, part=(i, 2))
    commands = {"--out": ["index", "build", *corpus.shards, "-q", "--out"],
                "merge output": ["index", "merge", "-q"],
                "export folder": ["index", "export", "-q", "--index", str(index)]}
    for option, command in commands.items():
        for out in [afile / "sub"] + ([Path("/proc/tokenbal-x")] if Path("/proc/self").exists() else []):
            args = command + [str(out)] + (parts if option == "merge output" else [])
            code, _, err = run(args, capsys)
            assert code == 2, (option, out, err)
            said = err.removeprefix(f"tokenbal index {command[1]}: error: {option} {out}: ")
            assert said != err, err
            if out.parent == afile:
                assert said.startswith("a file of that name (or of a folder above it) is in the way; give a "
                                       "folder")
            else:
                assert said.startswith("cannot be made there (No such file or directory: /proc/"), said
    assert afile.read_text() == "mine\n"


def test_only_errors_on_the_output_folder_are_renamed(tmp_path):
    """The rename must not blame ``--out`` for a source's error: a shard beside the output folder, or a
    folder whose name merely starts like it, stays the source's."""
    from tokenbal.cli import _is_output_path

    out = tmp_path / "idx"
    for path in (out, out / "lengths.npy", tmp_path, tmp_path.parent, tmp_path / ".idx.lock",
                 tmp_path / ".idx.tmp-123"):
        assert _is_output_path(str(out), str(path)), path
    for path in (tmp_path / "data.tar", tmp_path / "idx2", tmp_path / "idx2" / "a", tmp_path / ".other.lock"):
        assert not _is_output_path(str(out), str(path)), path
