"""VeOmni 0.1.12 from the registry (tests/envs/veomni.txt): its own data path on 2 gloo CPU ranks
(parallel state, mapping dataset, ``plaintext`` transform, ``MainCollator``, ``build_dataloader``)
with tokenbal's ``"tokenbal"`` DATALOADER_REGISTRY entry against VeOmni's ``"native"`` loader
(``--train.dyn_bsz false``) in the same run, 2 epochs, and resumed from the loader's state_dict.
veomni_driver.py runs in the environment. Then VeOmni's VLMTrainer with a tiny random Qwen2-VL through
``python -m tokenbal.integrations.veomni``'s entry (veomni_trainer_driver.py): 2 epochs, against its
native loader, resumed from its own checkpoints mid-epoch and at an epoch's end."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import frameworks as fw

pytestmark = pytest.mark.frameworks

DRIVER = Path(__file__).with_name("veomni_driver.py")
ROWS = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("veomni")
    env = {**fw.driver_environ(), "TOKENBAL_INDEX": str(tmp / "index")}
    python = fw.prepared_env("veomni", DRIVER, tmp, env)
    return fw.driver_on_ranks(python, DRIVER, tmp, env, "veomni")


def _rows(ranks, kind, epoch):
    return sorted(i for r in ranks for step in r[kind][epoch] for i in step["rows"])


def test_veomnis_step_count_and_every_sample_once(run):
    steps = run[0]["train_steps"]
    for r in run:
        assert [len(e) for e in r["tokenbal"]] == [steps, steps]
        assert all(len(step["micro_tokens"]) == 2 for e in r["tokenbal"] for step in e)
    assert _rows(run, "tokenbal", 0) == _rows(run, "tokenbal", 1) == list(range(ROWS))
    # the native loader drops the tail VeOmni's floor() leaves out
    assert len(_rows(run, "native", 0)) == 2 * steps * 4 <= ROWS
    assert run[0]["tokenbal"][0] != run[0]["tokenbal"][1]          # set_epoch reached the plan


def test_balance_against_veomnis_native_loader(run):
    def imbalance(kind):
        ratios = []
        for e in range(2):
            for s0, s1 in zip(run[0][kind][e], run[1][kind][e], strict=True):
                for t0, t1 in zip(s0["micro_tokens"], s1["micro_tokens"], strict=True):
                    ratios.append(max(t0, t1) / ((t0 + t1) / 2))
        return sum(ratios) / len(ratios)

    tb, native = imbalance("tokenbal"), imbalance("native")
    dyn = [max(a, b) / ((a + b) / 2) for s0, s1 in zip(run[0]["dyn_bsz"], run[1]["dyn_bsz"], strict=False)
           for a, b in zip(s0["micro_tokens"], s1["micro_tokens"], strict=True)]
    reads = [sum(len(s["rows"]) for s in r["dyn_bsz"]) for r in run]
    print(f"busiest/mean packed tokens per micro-batch: tokenbal {tb:.4f}, VeOmni native {native:.4f}, "
          f"VeOmni dyn_bsz {sum(dyn) / len(dyn):.4f} ({len(run[0]['dyn_bsz'])} steps, sample reads per rank "
          f"{reads} for {ROWS // 2} rows each)")
    assert tb < native
    # dyn_bsz fills every micro-batch up to its token budget (text tokens) from a buffer of samples
    assert all(t <= run[0]["dyn_budget"] for r in run for s in r["dyn_bsz"] for t in s["micro_tokens"])


@pytest.mark.parametrize("name, skip", [("mid", 1), ("edge", 0)])
def test_resume_from_the_loader_state(run, name, skip):
    for r in run:
        assert [s["rows"] for s in r[name]] == [s["rows"] for s in r["tokenbal"][1][skip:]]


def test_max_steps_stops_the_epoch_early_without_bigger_batches(run):
    # --train.max_steps below VeOmni's own per-epoch count makes its train_steps smaller: the run
    # trains the first steps of the same plan (same samples per step), as VeOmni's native loader does
    for r in run:
        assert r["capped"] == r["tokenbal"][0][:2]


def test_a_step_count_no_batch_size_plans_exactly_is_padded(run):
    # 42 rows in VeOmni's 10 steps of 4: the loader builds, both ranks take 10 steps of 1 micro-batch,
    # every row once per epoch, no empty micro-batch
    for r in run:
        assert [len(e) for e in r["uneven"]] == [10, 10]
        assert all(len(s["micro_tokens"]) == 1 and s["rows"] for e in r["uneven"] for s in e)
    for epoch in range(2):
        assert sorted(i for r in run for s in r["uneven"][epoch] for i in s["rows"]) == list(range(42))


def test_an_iterable_dataset_is_refused_naming_the_option(run):
    for r in run:
        assert r["iterable"].startswith("ValueError") and "--data.datasets_type mapping" in r["iterable"]


TRAINER = Path(__file__).with_name("veomni_trainer_driver.py")
TRAINER_ROWS = 16
OPS = ("attn", "moe", "cross_entropy_loss", "rms_norm", "swiglu_mlp", "rotary_pos_emb", "load_balancing_loss")


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """VeOmni's VLMTrainer, 2 epochs of 4 steps: tokenbal's entry (checkpoints every 2 steps), VeOmni's
    native loader, and tokenbal's resumed from VeOmni's checkpoints after step 2 and step 4."""
    tmp = tmp_path_factory.mktemp("veomni-trainer")
    env = {**fw.driver_environ(), "TOKENBAL_INDEX": str(tmp / "index"), "WANDB_MODE": "disabled"}
    python = fw.prepared_env("veomni", TRAINER, tmp, env)

    def train(name, kind, *extra):
        args = [f"--model.{k}" for k in ("config_path", "model_path", "tokenizer_path")]
        cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(fw.free_port()), str(TRAINER), "train", str(tmp), name,
               *[x for a in args for x in (a, str(tmp / "model"))],
               "--data.train_path", str(tmp / "train.jsonl"), "--data.chat_template", "qwen2vl",
               "--data.max_seq_len", "2048", "--data.dataloader.type", kind,
               "--data.dataloader.num_workers", "0",
               "--train.dyn_bsz", "false", "--train.micro_batch_size", "1", "--train.global_batch_size", "4",
               "--train.num_train_epochs", "2", "--train.checkpoint.output_dir", str(tmp / f"out-{name}"),
               "--train.checkpoint.save_hf_weights", "false",
               *[x for op in OPS for x in (f"--model.ops_implementation.{op}_implementation", "eager")],
               *extra]
        start = time.monotonic()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        print(f"VeOmni VLMTrainer {name}: {time.monotonic() - start:.0f} s")
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
        return [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(2)]

    ckpt = tmp / "out-tb" / "checkpoints"
    return {"tb": train("tb", "tokenbal", "--train.checkpoint.save_steps", "2"),
            "capped": train("capped", "tokenbal", "--train.max_steps", "2"),
            "native": train("native", "native"),
            "mid": train("mid", "tokenbal", "--train.checkpoint.load_path", str(ckpt / "global_step_2")),
            "edge": train("edge", "tokenbal", "--train.checkpoint.load_path", str(ckpt / "global_step_4"))}


def test_vlm_trainer_two_epochs_every_sample_once(trainer_runs):
    tb = trainer_runs["tb"]
    assert [len(r) for r in tb] == [8, 8]
    for epoch in range(2):
        rows = sorted(i for r in tb for s in r if s["epoch"] == epoch for i in s["rows"])
        assert rows == list(range(TRAINER_ROWS))


def test_vlm_trainer_balance_against_its_native_loader(trainer_runs):
    def imbalance(ranks):
        loads = [(sum(a["lengths"]), sum(b["lengths"])) for a, b in zip(*ranks, strict=True)]
        return sum(max(x, y) / ((x + y) / 2) for x, y in loads) / len(loads)

    tb, native = imbalance(trainer_runs["tb"]), imbalance(trainer_runs["native"])
    print(f"VLMTrainer, busiest/mean tokens per step: tokenbal {tb:.4f}, VeOmni native {native:.4f}")
    assert tb < native


def test_vlm_trainer_max_steps_trains_the_first_steps_of_each_epochs_plan(trainer_runs):
    # --train.max_steps 2 (VeOmni's train_steps then 2 of its 4): each epoch stops after 2 steps of the
    # same plan, as VeOmni's native loader stops early, not a plan of 2 steps of every row
    for full, capped in zip(trainer_runs["tb"], trainer_runs["capped"], strict=True):
        assert [s["rows"] for s in capped] == [s["rows"] for s in full[0:2] + full[4:6]]


@pytest.mark.parametrize("name, done", [("mid", 2), ("edge", 4)])
def test_vlm_trainer_resumes_exactly_from_its_checkpoints(trainer_runs, name, done):
    for full, resumed in zip(trainer_runs["tb"], trainer_runs[name], strict=True):
        assert [s["rows"] for s in resumed] == [s["rows"] for s in full[done:]]
