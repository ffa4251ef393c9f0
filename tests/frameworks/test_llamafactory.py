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
- a run killed after a mid-epoch checkpoint, resumed with ``resume_from_checkpoint``, trains exactly
  the steps the uninterrupted run trained;
- the ``FORCE_TORCHRUN=1 NPROC_PER_NODE=2`` launch of LLaMA-Factory's users.

`make test-frameworks`; the environment takes ~5.5 min to build the first time (6.6 GB), the module
~6 min on the 2-core VM."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers import frameworks as fw
from tests.helpers.envs import env_python
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

N, WORLD, PER_DEVICE = 24, 2, 2
STEPS = N // (WORLD * PER_DEVICE)   # 6 per epoch, 2 epochs
SAVE_AT, KILL_AT = 8, 10            # a checkpoint in the middle of epoch 1, a kill two steps later


@pytest.fixture(scope="module")
def lf(tmp_path_factory):
    pytest.importorskip("transformers")
    start = time.monotonic()
    python = env_python("llamafactory")
    print(f"llamafactory environment ready in {time.monotonic() - start:.0f} s: {python}")
    root = tmp_path_factory.mktemp("lf")
    rows = fw.corpus(N)
    fw.write_images(rows, root / "images")
    model = fw.checkpoint(root / "Qwen2-VL-tiny", rows)
    return {"python": str(python), "root": root, "rows": rows, "model": model}


def _run(lf: dict, name: str, *, tokenbal: dict | None, env: dict | None = None, extra: dict | None = None,
         module: str = "tests.helpers.lf_record", torchrun: bool = True, overrides: tuple = (),
         record_name: str = "record"):
    """One LLaMA-Factory training run of project ``name``; returns (completed process, record folder)."""
    import subprocess

    cfg = dict(extra or {})
    if tokenbal is not None:
        cfg["tokenbal"] = tokenbal
    project = fw.llamafactory_project(lf["root"] / name, lf["rows"], lf["model"], extra=cfg)
    record = lf["root"] / name / record_name
    full_env = {**os.environ, **fw.env_for_ranks(), "RECORD_DIR": str(record),
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                **({"TOKENBAL": "1"} if tokenbal is not None else {}), **(env or {})}
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
              str(_free_port())] if torchrun else []
    cmd = [lf["python"], *launch, "-m", module, "train", str(project), *overrides]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=1200)
    print(f"{name}: rc {done.returncode} in {time.monotonic() - start:.0f} s")
    return done, record


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(record: Path) -> dict[int, list[dict]]:
    """step -> each rank's record of it."""
    ranks = [[json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(WORLD)]
    out: dict[int, list[dict]] = {}
    for recs in ranks:
        for rec in recs:
            out.setdefault(rec["step"], []).append(rec)
    return out


def _ok(done) -> None:
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


def _figures(steps: dict[int, list[dict]]) -> tuple[float, float]:
    """(mean over steps of max ÷ mean real tokens over the ranks, padded ÷ real tokens in all)."""
    ratios = [max(r["real"] for r in recs) / (sum(r["real"] for r in recs) / len(recs))
              for recs in steps.values()]
    padded = sum(r["padded"] for recs in steps.values() for r in recs)
    real = sum(r["real"] for recs in steps.values() for r in recs)
    return sum(ratios) / len(ratios), padded / real


def test_llamafactory_cli_token_balanced(lf):
    tb, tb_rec = _run(lf, "tokenbal", tokenbal={})
    _ok(tb)
    assert "tokenbal: 24 samples, 6 steps per epoch on 2 ranks" in tb.stderr + tb.stdout
    steps = _steps(tb_rec)
    assert sorted(steps) == list(range(1, 2 * STEPS + 1))
    assert all(len(recs) == WORLD for recs in steps.values())          # every rank, every step
    for epoch in range(2):
        rows = [i for s in range(epoch * STEPS + 1, (epoch + 1) * STEPS + 1) for r in steps[s]
                for i in r["rows"]]
        assert sorted(rows) == list(range(N)), f"epoch {epoch}"        # each sample once
    lengths = json.loads((tb_rec / "lengths.json").read_text())
    assert lengths["tokenbal"] == lengths["llamafactory"]                  # 100 % of the rows
    # some rows' images are above image_max_pixels: LLaMA-Factory's own resize is in the count
    assert any(w * h > 160 * 160 for r in lf["rows"] for w, h in r["sizes"])

    default, default_rec = _run(lf, "default", tokenbal=None)
    _ok(default)
    balance, pad = _figures(steps)
    d_balance, d_pad = _figures(_steps(default_rec))
    print(f"per-step max/mean real tokens: tokenbal {balance:.3f}, LLaMA-Factory default {d_balance:.3f}; "
          f"padded/real: tokenbal {pad:.3f}, default {d_pad:.3f}")
    assert balance < d_balance
    assert pad < d_pad

    # killed two steps after a mid-epoch checkpoint, then resumed: the steps of the uninterrupted run
    killed, k_rec = _run(lf, "killed", tokenbal={}, env={"KILL_AT": str(KILL_AT)},
                         extra={"save_steps": SAVE_AT})
    assert killed.returncode != 0
    ckpt = lf["root"] / "killed" / "out" / f"checkpoint-{SAVE_AT}"
    assert json.loads((ckpt / "tokenbal_sampler.json").read_text())["epoch"] == 1
    resumed, r_rec = _run(lf, "killed", tokenbal={}, record_name="resumed",
                          extra={"save_steps": SAVE_AT, "resume_from_checkpoint": str(ckpt)})
    _ok(resumed)

    def batches(steps_: dict) -> dict[int, list[list[int]]]:   # step -> each rank's rows, rank order
        return {s: [r["rows"] for r in recs] for s, recs in steps_.items()}

    full, k_steps, r_steps = batches(steps), batches(_steps(k_rec)), batches(_steps(r_rec))
    assert sorted(k_steps) == list(range(1, KILL_AT + 1))
    assert k_steps == {s: full[s] for s in k_steps}
    assert r_steps == {s: full[s] for s in range(SAVE_AT + 1, 2 * STEPS + 1)}


def test_llamafactory_force_torchrun_launch_and_cutoff_error(lf):
    # LLaMA-Factory's users start ranks with FORCE_TORCHRUN / NPROC_PER_NODE; the module does the same
    done, _ = _run(lf, "force", tokenbal={"seed": 3}, module="tokenbal.integrations.llamafactory",
                   torchrun=False, env={"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(WORLD)},
                   extra={"save_steps": 2}, overrides=("max_steps=2",))
    _ok(done)
    assert "tokenbal: 24 samples, 6 steps per epoch on 2 ranks" in done.stderr + done.stdout
    assert (lf["root"] / "force" / "out" / "checkpoint-2" / "tokenbal_sampler.json").is_file()

    # rows LLaMA-Factory cuts at cutoff_len: not what tokenbal counts, so no plan and no training
    cut, _ = _run(lf, "cut", tokenbal={}, module="tokenbal.integrations.llamafactory",
                  overrides=("cutoff_len=40",))   # under torchrun, the other launch users have
    assert cut.returncode != 0
    assert "disagree with what LLaMA-Factory tokenized" in cut.stderr + cut.stdout
