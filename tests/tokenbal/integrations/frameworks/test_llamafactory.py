"""LLaMA-Factory 0.9.5, installed from the registry into its own environment (tests/envs/llamafactory.txt,
built on first use by scripts/envs.py), trained through its own CLI on 2 gloo ranks with a tiny random
Qwen2-VL and its ``qwen2_vl`` template, with and without tokenbal's integration
(``python -m tokenbal.integrations.llamafactory train CONFIG.yaml``):

- every sample exactly once per epoch across the ranks, the same number of steps on each rank;
- the planned lengths equal LLaMA-Factory's own ``len(input_ids)`` on every row (images above its
  ``image_max_pixels`` included), computed without its image processor; rows it cuts at
  ``cutoff_len`` are an error, not a plan;
- per-step balance (max ÷ mean real tokens over the ranks) and padded ÷ real tokens, against
  LLaMA-Factory's default sampler on the same data in the same test;
- packed rows (``tokenbal: {packed: true, max_tokens_per_rank: B}``): no rank's row over ``B``, no
  padding, the first step's loss equal to LLaMA-Factory's per-micro-batch token mean of the samples'
  own unpacked losses, against LLaMA-Factory's own ``neat_packing`` (cutoff ``B``) in the same test;
- a run killed after a mid-epoch checkpoint, resumed with ``resume_from_checkpoint``, trains exactly
  the steps the uninterrupted run trained (padded and packed);
- the ``FORCE_TORCHRUN=1 NPROC_PER_NODE=2`` launch of LLaMA-Factory's users;
- video rows (real mp4 files): lengths from the container headers under LLaMA-Factory's
  ``video_fps`` / ``video_maxlen`` / ``video_max_pixels``, equal to its own ``len(input_ids)`` on
  every row, and trained on, padded and packed (the packed first-step loss per sample).

`make test-frameworks`; the environment takes ~5.5 min to build the first time (6.6 GB)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import frameworks as fw
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

N, WORLD, EPOCHS = 24, 2, 2
STEPS = N // (WORLD * 2)            # padded: 2 rows per rank and step, 6 steps per epoch
SAVE_AT, KILL_AT = 8, 10            # a checkpoint in the middle of epoch 1, a kill two steps later
BUDGET = 320                        # packed: real tokens per rank and step


@pytest.fixture(scope="module")
def lf(tmp_path_factory):
    pytest.importorskip("transformers")
    return fw.setup("llamafactory", tmp_path_factory.mktemp("lf"), N)


def _run(lf: dict, name: str, *, tokenbal: dict | None, env: dict | None = None, extra: dict | None = None,
         module: str = "tests.helpers.lf_record", torchrun: bool = True, overrides: tuple = (),
         record_name: str = "record"):
    """One LLaMA-Factory training run of project ``name``; returns (completed process, its steps or
    None, project folder)."""
    cfg = dict(extra or {})
    if tokenbal is not None:
        cfg["tokenbal"] = tokenbal
    folder = lf["root"] / name
    project = fw.llamafactory_project(folder, lf["rows"], lf["model"], extra=cfg)
    record = folder / record_name
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
              str(fw.free_port())] if torchrun else []
    env = {"RECORD_DIR": str(record), **({"TOKENBAL": "1"} if tokenbal is not None else {}), **(env or {})}
    done = fw.run_cli([str(lf["python"]), *launch, "-m", module, "train", str(project), *overrides],
                      f"{name}/{record_name}", env)
    steps = fw.steps(record, WORLD) if (record / "rank0.jsonl").is_file() else None
    return done, steps, folder


def _lengths_equal(folder) -> list[int]:
    lengths = json.loads((folder / "record" / "lengths.json").read_text())
    assert lengths["tokenbal"] == lengths["llamafactory"]                  # 100 % of the rows
    return lengths["tokenbal"]


def test_llamafactory_cli_token_balanced(lf):
    tb, steps, folder = _run(lf, "tokenbal", tokenbal={})
    fw.assert_ok(tb)
    # LLaMA-Factory destroys the group once its sft workflow returned; the gloo threads stop only if
    # nothing holds the trainer then (before: tokenbal's sampler-state callback did, a reference cycle,
    # and they ran at exit on every rank; with LLaMA-Factory's own trainer they never did)
    fw.assert_exit_clean(folder / "record", WORLD)
    assert "tokenbal: 24 samples, 6 steps per epoch on 2 ranks" in tb.stderr + tb.stdout
    assert fw.epochs_of(steps, N, EPOCHS, WORLD) == [STEPS] * EPOCHS
    _lengths_equal(folder)
    # some rows' images are above image_max_pixels: LLaMA-Factory's own resize is in the count
    assert any(w * h > 160 * 160 for r in lf["rows"] for w, h in r["sizes"])

    default, d_steps, _ = _run(lf, "default", tokenbal=None)
    fw.assert_ok(default)
    fw.assert_beats_default(steps, d_steps, "LLaMA-Factory")

    # killed two steps after a mid-epoch checkpoint, then resumed: the steps of the uninterrupted run
    killed, k_steps, k_folder = _run(lf, "killed", tokenbal={}, env={"KILL_AT": str(KILL_AT)},
                                     extra={"save_steps": SAVE_AT})
    assert killed.returncode != 0
    ckpt = k_folder / "out" / f"checkpoint-{SAVE_AT}"
    assert json.loads((ckpt / "tokenbal_sampler.json").read_text())["epoch"] == 1
    resumed, r_steps, _ = _run(lf, "killed", tokenbal={}, record_name="resumed",
                               extra={"save_steps": SAVE_AT, "resume_from_checkpoint": str(ckpt)})
    fw.assert_ok(resumed)
    fw.assert_exit_clean(k_folder / "resumed", WORLD)
    fw.assert_resumed(steps, k_steps, r_steps, SAVE_AT, KILL_AT)


def test_llamafactory_packed_rows_under_a_token_budget(lf):
    options = {"packed": True, "max_tokens_per_rank": BUDGET}
    tb, steps, folder = _run(lf, "packed", tokenbal=options)
    fw.assert_ok(tb)
    per_epoch = fw.epochs_of(steps, N, EPOCHS, WORLD)
    fw.assert_packed(steps, BUDGET)
    lengths = _lengths_equal(folder)
    losses = fw.assert_first_step_loss(steps, global_mean=False)   # LLaMA-Factory's micro-batch mean
    fill = sum(r["real"] for recs in steps.values() for r in recs) / (len(steps) * WORLD * BUDGET)
    balance, _ = fw.figures(steps)

    # LLaMA-Factory's own packing on the same rows: neat_packing, cutoff_len = the budget
    neat, n_steps, _ = _run(lf, "neat", tokenbal=None, extra={
        "packing": True, "neat_packing": True, "cutoff_len": BUDGET, "per_device_train_batch_size": 1})
    fw.assert_ok(neat)
    n_balance, n_pad = fw.figures(n_steps)
    n_fill = sum(r["real"] for recs in n_steps.values() for r in recs) / (len(n_steps) * WORLD * BUDGET)
    print(f"packed, budget {BUDGET}, rows of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all): "
          f"steps per epoch {per_epoch}; first-step losses {losses}; per-step "
          f"max/mean real tokens: tokenbal {balance:.3f}, neat_packing {n_balance:.3f}; fill (real / "
          f"steps x ranks x budget): tokenbal {fill:.3f}, neat_packing {n_fill:.3f} ({len(n_steps)} steps); "
          f"padded/real: tokenbal 1.000, neat_packing {n_pad:.3f}")
    assert balance < n_balance

    # kill + resume on packed rows: a checkpoint in the middle of epoch 1
    save_at = per_epoch[0] + per_epoch[1] // 2
    kill_at = save_at + 1
    killed, k_steps, k_folder = _run(lf, "packed-killed", tokenbal=options, env={"KILL_AT": str(kill_at)},
                                     extra={"save_steps": save_at})
    assert killed.returncode != 0
    ckpt = k_folder / "out" / f"checkpoint-{save_at}"
    resumed, r_steps, _ = _run(lf, "packed-killed", tokenbal=options, record_name="resumed",
                               extra={"save_steps": save_at, "resume_from_checkpoint": str(ckpt)})
    fw.assert_ok(resumed)
    fw.assert_resumed(steps, k_steps, r_steps, save_at, kill_at)


def test_llamafactory_force_torchrun_launch_and_cutoff_error(lf):
    # LLaMA-Factory's users start ranks with FORCE_TORCHRUN / NPROC_PER_NODE; the module does the same
    done, _, folder = _run(lf, "force", tokenbal={"seed": 3}, module="tokenbal.integrations.llamafactory",
                           torchrun=False, env={"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(WORLD)},
                           extra={"save_steps": 2}, overrides=("max_steps=2",))
    fw.assert_ok(done)
    assert "tokenbal: 24 samples, 6 steps per epoch on 2 ranks" in done.stderr + done.stdout
    assert (folder / "out" / "checkpoint-2" / "tokenbal_sampler.json").is_file()

    # rows LLaMA-Factory cuts at cutoff_len: not what tokenbal counts, so no plan and no training
    cut, _, _ = _run(lf, "cut", tokenbal={}, module="tokenbal.integrations.llamafactory",
                     overrides=("cutoff_len=40",))   # under torchrun, the other launch users have
    assert cut.returncode != 0
    assert "disagree with what LLaMA-Factory tokenized" in cut.stderr + cut.stdout


@pytest.mark.parametrize("setting", ["use_hyper_parallel=true", "USE_MCA=1", "USE_RAY=1"])
def test_llamafactory_paths_past_the_balanced_trainer_are_refused(lf, setting):
    # LLaMA-Factory's HyperParallel / Megatron (mcore_adapter) / Ray paths train without the trainer
    # tokenbal puts in place: refused by tokenbal before any rank starts, not left to run unbalanced
    key, value = setting.split("=")
    env, overrides = ({key: value}, ()) if key.isupper() else ({}, (setting,))
    done, steps, _ = _run(lf, f"past-{key.lower()}", tokenbal={}, module="tokenbal.integrations.llamafactory",
                          torchrun=False, env=env, overrides=overrides)
    assert done.returncode != 0 and steps is None
    assert "tokenbal: " in done.stderr and (key in done.stderr), done.stderr[-3000:]


def test_llamafactory_misspelt_tokenbal_key_is_refused_before_any_rank_starts(lf):
    done, steps, _ = _run(lf, "misspelt", tokenbal={"max_token_per_rank": 300},
                          module="tokenbal.integrations.llamafactory", torchrun=False)
    assert done.returncode != 0 and steps is None
    assert "tokenbal: unknown key(s) under the config's `tokenbal:`: max_token_per_rank" in done.stderr, \
        done.stderr[-3000:]


def test_llamafactory_launch_reads_the_launchers_variables():
    # what llamafactory-cli's launcher (0.9.5) gives its ranks: the allocator / NCCL settings unless
    # OPTIM_TORCH=0, and with RDZV_ID an elastic rendezvous with MAX_RESTARTS
    from tests.helpers.envs import run_in_env

    code = ("import json, os\n"
            "from tokenbal.integrations.llamafactory import _launch_command\n"
            "cmd, env = _launch_command(['cfg.yaml'])\n"
            "print(json.dumps({'cmd': cmd, 'alloc': env.get('PYTORCH_CUDA_ALLOC_CONF'),\n"
            "                  'nccl': env.get('TORCH_NCCL_AVOID_RECORD_STREAMS')}))\n")

    def launch(**environ):
        clean = {k: "" for k in ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_AVOID_RECORD_STREAMS")}
        environ = {**clean, "NPROC_PER_NODE": "2", "MASTER_PORT": "29500", **environ}
        done = run_in_env("llamafactory", ["-c", code], cwd=REPO, env=environ, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    static = launch()
    assert static["alloc"] == "expandable_segments:True" and static["nccl"] == "1"
    assert static["cmd"][-4:] == ["-m", "tokenbal.integrations.llamafactory", "train", "cfg.yaml"]
    assert static["cmd"][static["cmd"].index("--nproc_per_node") + 1] == "2"
    assert launch(OPTIM_TORCH="0")["alloc"] == ""
    elastic = launch(RDZV_ID="job7", MIN_NNODES="1", MAX_NNODES="2", MAX_RESTARTS="3")["cmd"]
    for flag, value in (("--nnodes", "1:2"), ("--rdzv-id", "job7"), ("--rdzv-backend", "c10d"),
                        ("--rdzv-endpoint", "127.0.0.1:29500"), ("--max-restarts", "3")):
        assert elastic[elastic.index(flag) + 1] == value, elastic


def test_llamafactory_video_rows_lengths_from_headers(lf, tmp_path):
    rows = [dict(r) for r in lf["rows"]]
    fw.write_videos(rows, tmp_path / "videos")
    video = {"video_fps": 3.0, "video_maxlen": 8, "video_max_pixels": 96 * 96}
    done, steps, folder = _run({**lf, "rows": rows}, "video", tokenbal={}, extra=video,
                               overrides=("max_steps=2",))
    fw.assert_ok(done)
    _lengths_equal(folder)                          # every row, videos included
    assert len(steps) == 2
    counts = json.loads((folder / "record" / "lengths.json").read_text())["video_tokens"]
    assert [c > 0 for c in counts] == [bool(r["videos"]) for r in rows]   # LF expanded every video
    assert len(set(c for c in counts if c)) > 3                            # of many sizes

    # packed: the videos through LLaMA-Factory's own plugin, the first step's loss per sample
    options = {"packed": True, "max_tokens_per_rank": 400}
    packed, p_steps, p_folder = _run({**lf, "rows": rows}, "video-packed", extra=video,
                                     overrides=("max_steps=2",), tokenbal=options)
    fw.assert_ok(packed)
    _lengths_equal(p_folder)
    fw.assert_packed(p_steps, 400)
    fw.assert_first_step_loss(p_steps, global_mean=False)


_PLUGIN_CHECK = """
import sys, datasets
from transformers import AutoProcessor
from llamafactory.data.mm_plugin import get_mm_plugin
from tokenbal.integrations.llamafactory import llamafactory_lengths

processor = AutoProcessor.from_pretrained(sys.argv[1])
rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "images": [[sys.argv[2]]]})
for name, kw in [("qwen3_vl", dict(image_token="<|image_pad|>", video_token="<|video_pad|>")),
                 ("llava", dict(image_token="<image>")), ("llava_next", dict(image_token="<image>")),
                 ("intern_vl", dict(image_token="<image>", video_token="<video>"))]:
    template = type("Template", (), {"mm_plugin": get_mm_plugin(name, **kw)})()
    try:
        llamafactory_lengths(rows, processor, template)
    except ValueError as e:
        print(name, "->", e)
"""


def test_llamafactory_other_mm_plugins_are_refused_by_name(lf):
    # LLaMA-Factory 0.9.5's own plugins of tokenbal's other families: not modelled, so refused,
    # naming the plugin, before any row is planned
    image = next(i for r in lf["rows"] for i in r["images"])
    done = fw.run_cli([str(lf["python"]), "-c", _PLUGIN_CHECK, lf["model"], image], "plugins", {})
    fw.assert_ok(done)
    for name, cls in [("qwen3_vl", "Qwen3VLPlugin"), ("llava", "LlavaPlugin"),
                      ("llava_next", "LlavaNextPlugin"), ("intern_vl", "InternVLPlugin")]:
        line = f"{name} -> tokenbal: LLaMA-Factory's {cls} is not modelled (supported: Qwen2VLPlugin"
        assert line in done.stdout, done.stdout + done.stderr[-3000:]
