"""ms-swift 4.6.0, installed from the registry into its own environment (tests/envs/swift.txt, built on
first use by scripts/envs.py), trained through its own CLI (``swift sft``, ``NPROC_PER_NODE=2``) on 2
gloo ranks with a tiny random Qwen2-VL and its ``qwen2_vl`` template, with and without tokenbal's
``--external_plugins`` file:

- every sample exactly once per epoch across the ranks, the same number of steps on each rank, with
  lazy tokenization (ms-swift's multimodal default) and with ``--lazy_tokenize false`` (its per-row
  ``lengths`` lists);
- the planned lengths equal ms-swift's own encoding of every item, in the order ms-swift hands the
  items to the trainer (after its load-time shuffle, ``--data_seed``);
- per-step balance (max ÷ mean real tokens over the ranks) and padded ÷ real tokens against
  ms-swift's default sampler on the same data, in the same test;
- packed rows (a plugin file with ``register(packed=True, max_tokens_per_rank=B)``): no rank's row
  over ``B``, no padding, the first step's loss equal to ms-swift's global token mean of the samples'
  own unpacked losses;
- a run killed after a mid-epoch checkpoint, resumed with ``--resume_from_checkpoint``, trains
  exactly the steps the uninterrupted run trained (padded and packed);
- ``--sequence_parallel_size 2`` on 4 ranks: the two peers of each SP group train the same batches,
  the two data-parallel ranks disjoint ones covering the epoch; packed rows with it are refused.

`make test-frameworks`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import frameworks as fw
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

N, WORLD, EPOCHS = 24, 2, 2
STEPS = N // (WORLD * 2)            # padded: 2 rows per rank and step, 6 steps per epoch
SAVE_AT, KILL_AT = 8, 10
BUDGET = 320                        # packed: real tokens per rank and step
TOKENBAL_PLUGIN = REPO / "tokenbal" / "integrations" / "swift_plugin" / "tokenbal_plugin.py"


@pytest.fixture(scope="module")
def sw(tmp_path_factory):
    pytest.importorskip("transformers")
    sw = fw.setup("swift", tmp_path_factory.mktemp("swift"), N)
    sw["data"] = fw.swift_dataset(sw["root"] / "data", sw["rows"])
    # the docs' own-options recipe: a plugin file of one's own
    sw["packed_plugin"] = sw["root"] / "packed_plugin.py"
    sw["packed_plugin"].write_text("from tokenbal.integrations.swift import register\n"
                                   f"register(packed=True, max_tokens_per_rank={BUDGET})\n")
    return sw


def _run(sw: dict, name: str, *, plugin: Path | None, extra: tuple = (), env: dict | None = None,
         record_name: str = "record", world: int = WORLD):
    """One ``swift sft`` run on ``world`` ranks; returns (completed process, its steps or None, output
    folder)."""
    out = sw["root"] / name / "out"
    record = sw["root"] / name / record_name
    plugins = [*([str(plugin)] if plugin else []), str(REPO / "tests" / "helpers" / "swift_record.py")]
    args = fw.swift_args(sw["data"], sw["model"], out, *extra, "--external_plugins", *plugins)
    done = fw.run_cli([str(sw["python"].parent / "swift"), *args], f"{name}/{record_name}",
                      {"RECORD_DIR": str(record), "NPROC_PER_NODE": str(world),
                       "MASTER_PORT": str(fw.free_port()), **(env or {})})
    steps = fw.steps(record, world) if (record / "rank0.jsonl").is_file() else None
    return done, steps, out


def _lengths_equal(out: Path) -> list[int]:
    lengths = json.loads((out.parent / "record" / "lengths.json").read_text())
    assert lengths["tokenbal"] == lengths["swift"]                      # 100 % of the items
    return lengths["tokenbal"]


@pytest.mark.parametrize("lazy", ["true", "false"])
def test_swift_sft_token_balanced(sw, lazy):
    done, steps, out = _run(sw, f"tokenbal-lazy-{lazy}", plugin=TOKENBAL_PLUGIN,
                            extra=("--lazy_tokenize", lazy))
    fw.assert_ok(done)
    assert fw.epochs_of(steps, N, EPOCHS, WORLD) == [STEPS] * EPOCHS
    # ms-swift shuffles at load (--data_seed): the items are not in file order, the plan follows them
    _lengths_equal(out)
    if lazy == "false":
        default, d_steps, _ = _run(sw, "default", plugin=None, extra=("--lazy_tokenize", lazy))
        fw.assert_ok(default)
        fw.epochs_of(d_steps, N, EPOCHS, WORLD)
        fw.assert_beats_default(steps, d_steps, "ms-swift")


def test_swift_no_shuffle_option_is_kept(sw):
    # --train_dataloader_shuffle false: ms-swift's own loader keeps one order; tokenbal's plan then has
    # no random order either (shuffle=False), the same steps in every epoch
    done, steps, _ = _run(sw, "no-shuffle", plugin=TOKENBAL_PLUGIN,
                          extra=("--train_dataloader_shuffle", "false", "--lazy_tokenize", "false"))
    fw.assert_ok(done)
    assert fw.epochs_of(steps, N, EPOCHS, WORLD) == [STEPS] * EPOCHS
    batches = fw.batches(steps)
    assert [batches[s] for s in range(1, STEPS + 1)] == [batches[s] for s in range(STEPS + 1, 2 * STEPS + 1)]


def test_swift_kill_and_resume_exact(sw):
    full, f_steps, _ = _run(sw, "full", plugin=TOKENBAL_PLUGIN, extra=("--save_steps", str(SAVE_AT)))
    fw.assert_ok(full)
    # ms-swift never destroys the group: tokenbal's exit hook does, and its gloo threads stop there (before:
    # running at exit on every rank of every run; the abort it allows failed this run once in a full run)
    fw.assert_exit_clean(sw["root"] / "full" / "record", WORLD)
    killed, k_steps, out = _run(sw, "killed", plugin=TOKENBAL_PLUGIN, extra=("--save_steps", str(SAVE_AT)),
                                env={"KILL_AT": str(KILL_AT)})
    assert killed.returncode != 0
    ckpt = out / f"checkpoint-{SAVE_AT}"
    assert json.loads((ckpt / "tokenbal_sampler.json").read_text())["epoch"] == 1
    resumed, r_steps, _ = _run(sw, "killed", plugin=TOKENBAL_PLUGIN, record_name="resumed",
                               extra=("--save_steps", str(SAVE_AT), "--resume_from_checkpoint", str(ckpt)))
    fw.assert_ok(resumed)
    fw.assert_exit_clean(sw["root"] / "killed" / "resumed", WORLD)
    fw.assert_resumed(f_steps, k_steps, r_steps, SAVE_AT, KILL_AT)


def test_swift_packed_rows_under_a_token_budget(sw):
    done, steps, out = _run(sw, "packed", plugin=sw["packed_plugin"])
    fw.assert_ok(done)
    per_epoch = fw.epochs_of(steps, N, EPOCHS, WORLD)
    fw.assert_packed(steps, BUDGET)
    lengths = _lengths_equal(out)
    losses = fw.assert_first_step_loss(steps, global_mean=True)     # ms-swift's global token mean
    balance, _ = fw.figures(steps)
    fill = sum(r["real"] for recs in steps.values() for r in recs) / (len(steps) * WORLD * BUDGET)
    print(f"packed, budget {BUDGET}, rows of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all): "
          f"steps per epoch {per_epoch}; first-step losses {losses}; per-step "
          f"max/mean real tokens {balance:.3f}; fill (real / steps x ranks x budget) {fill:.3f}")

    save_at = per_epoch[0] + per_epoch[1] // 2
    kill_at = save_at + 1
    killed, k_steps, k_out = _run(sw, "packed-killed", plugin=sw["packed_plugin"],
                                  extra=("--save_steps", str(save_at)), env={"KILL_AT": str(kill_at)})
    assert killed.returncode != 0
    ckpt = k_out / f"checkpoint-{save_at}"
    resumed, r_steps, _ = _run(sw, "packed-killed", plugin=sw["packed_plugin"], record_name="resumed",
                               extra=("--save_steps", str(save_at), "--resume_from_checkpoint", str(ckpt)))
    fw.assert_ok(resumed)
    fw.assert_resumed(steps, k_steps, r_steps, save_at, kill_at)


def test_swift_sequence_parallel_peers_share_batches(sw):
    # --sequence_parallel_size 2 on 4 ranks: ms-swift's ("data", "sequence") mesh makes two
    # data-parallel ranks of two SP peers each (ranks 0-1 and 2-3), and splits each padded row across
    # the peers. The peers must train the same batches, the data-parallel ranks disjoint ones.
    world, sp = 4, 2
    done, steps, _ = _run(sw, "sequence-parallel", plugin=TOKENBAL_PLUGIN, world=world,
                          extra=("--sequence_parallel_size", str(sp), "--num_train_epochs", "1",
                                 "--lazy_tokenize", "false"))
    fw.assert_ok(done)
    assert sorted(steps) == list(range(1, N // (2 * (world // sp)) + 1))   # 2 rows per DP rank and step
    seen = []
    for s in sorted(steps):
        rows = [r["rows"] for r in steps[s]]
        assert rows[0] == rows[1] and rows[2] == rows[3], (s, rows)      # SP peers: one batch
        assert not set(rows[0]) & set(rows[2]), (s, rows)                 # DP ranks: different ones
        seen += rows[0] + rows[2]
    assert sorted(seen) == list(range(N))                                 # the epoch, each row once


def test_swift_packed_sequence_parallel_is_refused(sw):
    done, _, _ = _run(sw, "sequence-parallel-packed", plugin=sw["packed_plugin"],
                      extra=("--sequence_parallel_size", "2", "--num_train_epochs", "1"))
    assert done.returncode != 0
    said = "tokenbal: packed=True with --sequence_parallel_size > 1 is not supported"
    assert said in done.stderr + done.stdout


def test_other_tasks_refused_instead_of_silently_unbalanced():
    # ms-swift picks its trainer by task_type / rlhf_type (TrainerFactory.get_trainer_cls); with the
    # plugin loaded, a task it does not balance must stop with a message, not train on ms-swift's sampler
    from tests.helpers.envs import run_in_env

    code = ("import runpy, types\n"
            f"runpy.run_path({str(TOKENBAL_PLUGIN)!r})\n"
            "from swift.trainers.trainer_factory import TrainerFactory as F\n"
            "sft = types.SimpleNamespace(task_type='causal_lm')\n"
            "print('causal_lm', F.get_trainer_cls(sft).__qualname__)\n"
            "for args in (types.SimpleNamespace(task_type='seq_cls'),\n"
            "             types.SimpleNamespace(task_type='causal_lm', rlhf_type='dpo')):\n"
            "    try:\n"
            "        print('picked', F.get_trainer_cls(args).__qualname__)\n"
            "    except ValueError as e:\n"
            "        print('refused', e)\n")
    done = run_in_env("swift", ["-c", code], cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "causal_lm TokenBalancedSeq2SeqTrainer" in lines
    refused = [line for line in lines if line.startswith(("refused", "picked"))]
    assert len(refused) == 2 and all(line.startswith("refused tokenbal:") for line in refused), refused
    assert "'seq_cls'" in refused[0] and "'dpo'" in refused[1]


def test_a_misspelt_register_option_is_refused_as_the_plugin_loads():
    from tests.helpers.envs import run_in_env

    code = ("from tokenbal.integrations.swift import register\n"
            "try:\n"
            "    register(max_token_per_rank=300)\n"
            "    print('registered')\n"
            "except ValueError as e:\n"
            "    print('refused', e)\n")
    done = run_in_env("swift", ["-c", code], cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "refused tokenbal: register() got unknown option(s) max_token_per_rank" in done.stdout, done.stdout
