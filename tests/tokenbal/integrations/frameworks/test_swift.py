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
- a run killed after a mid-epoch checkpoint, resumed with ``--resume_from_checkpoint``, trains
  exactly the steps the uninterrupted run trained.

`make test-frameworks`."""

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
SAVE_AT, KILL_AT = 8, 10


@pytest.fixture(scope="module")
def sw(tmp_path_factory):
    pytest.importorskip("transformers")
    start = time.monotonic()
    python = env_python("swift")
    print(f"swift environment ready in {time.monotonic() - start:.0f} s: {python}")
    root = tmp_path_factory.mktemp("swift")
    rows = fw.corpus(N)
    fw.write_images(rows, root / "images")
    model = fw.checkpoint(root / "Qwen2-VL-tiny", rows)
    data = fw.swift_dataset(root / "data", rows)
    return {"python": Path(python), "root": root, "rows": rows, "model": model, "data": data}


def _run(sw: dict, name: str, *, tokenbal: bool, extra: tuple = (), env: dict | None = None,
         record_name: str = "record"):
    import subprocess

    out = sw["root"] / name / "out"
    record = sw["root"] / name / record_name
    plugins = []
    if tokenbal:
        plugins.append(str(REPO / "tokenbal" / "integrations" / "swift_plugin" / "tokenbal_plugin.py"))
    plugins.append(str(REPO / "tests" / "helpers" / "swift_record.py"))
    args = fw.swift_args(sw["data"], sw["model"], out, *extra, "--external_plugins", *plugins)
    full_env = {**os.environ, **fw.env_for_ranks(), "RECORD_DIR": str(record), "NPROC_PER_NODE": str(WORLD),
                "MASTER_PORT": str(_free_port()),
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                **(env or {})}
    start = time.monotonic()
    done = subprocess.run([str(sw["python"].parent / "swift"), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=1200)
    print(f"{name}/{record_name}: rc {done.returncode} in {time.monotonic() - start:.0f} s")
    return done, record, out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ok(done) -> None:
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


def _steps(record: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in range(WORLD):
        for line in (record / f"rank{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["step"], []).append(rec)
    return out


def _figures(steps: dict[int, list[dict]]) -> tuple[float, float]:
    ratios = [max(r["real"] for r in recs) / (sum(r["real"] for r in recs) / len(recs))
              for recs in steps.values()]
    padded = sum(r["padded"] for recs in steps.values() for r in recs)
    real = sum(r["real"] for recs in steps.values() for r in recs)
    return sum(ratios) / len(ratios), padded / real


def _exactly_once(steps: dict[int, list[dict]]) -> None:
    assert sorted(steps) == list(range(1, 2 * STEPS + 1))
    assert all(len(recs) == WORLD for recs in steps.values())
    for epoch in range(2):
        rows = [i for s in range(epoch * STEPS + 1, (epoch + 1) * STEPS + 1)
                for r in steps[s] for i in r["rows"]]
        assert sorted(rows) == list(range(N)), f"epoch {epoch}"


@pytest.mark.parametrize("lazy", ["true", "false"])
def test_swift_sft_token_balanced(sw, lazy):
    done, record, _ = _run(sw, f"tokenbal-lazy-{lazy}", tokenbal=True, extra=("--lazy_tokenize", lazy))
    _ok(done)
    steps = _steps(record)
    _exactly_once(steps)
    lengths = json.loads((record / "lengths.json").read_text())
    assert lengths["tokenbal"] == lengths["swift"]                      # 100 % of the items
    # ms-swift shuffles at load (--data_seed): the items are not in file order, the plan follows them
    if lazy == "false":
        default, d_record, _ = _run(sw, "default", tokenbal=False, extra=("--lazy_tokenize", lazy))
        _ok(default)
        _exactly_once(_steps(d_record))
        balance, pad = _figures(steps)
        d_balance, d_pad = _figures(_steps(d_record))
        print(f"per-step max/mean real tokens: tokenbal {balance:.3f}, ms-swift default {d_balance:.3f}; "
              f"padded/real: tokenbal {pad:.3f}, default {d_pad:.3f}")
        assert balance < d_balance
        assert pad < d_pad


def test_swift_kill_and_resume_exact(sw):
    full, f_record, _ = _run(sw, "full", tokenbal=True, extra=("--save_steps", str(SAVE_AT)))
    _ok(full)
    killed, k_record, out = _run(sw, "killed", tokenbal=True, extra=("--save_steps", str(SAVE_AT)),
                                 env={"KILL_AT": str(KILL_AT)})
    assert killed.returncode != 0
    ckpt = out / f"checkpoint-{SAVE_AT}"
    assert json.loads((ckpt / "tokenbal_sampler.json").read_text())["epoch"] == 1
    resumed, r_record, _ = _run(sw, "killed", tokenbal=True, record_name="resumed",
                                extra=("--save_steps", str(SAVE_AT), "--resume_from_checkpoint", str(ckpt)))
    _ok(resumed)

    def batches(steps: dict) -> dict[int, list[list[int]]]:
        return {s: [r["rows"] for r in recs] for s, recs in steps.items()}

    whole, k_steps, r_steps = batches(_steps(f_record)), batches(_steps(k_record)), batches(_steps(r_record))
    assert sorted(k_steps) == list(range(1, KILL_AT + 1))
    assert k_steps == {s: whole[s] for s in k_steps}
    assert r_steps == {s: whole[s] for s in range(SAVE_AT + 1, 2 * STEPS + 1)}
