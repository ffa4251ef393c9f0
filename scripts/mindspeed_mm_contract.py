#!/usr/bin/env python3
"""tokenbal's MindSpeed-MM loader against MindSpeed-MM's own source files (not installable here: its
package needs MindSpeed / megatron / torch_npu, so the files that use none of them are loaded by path).

    git clone https://github.com/Ascend/MindSpeed-MM && git -C MindSpeed-MM checkout 57069cd55a8a
    python scripts/mindspeed_mm_contract.py MindSpeed-MM

Runs, in one process (dp ranks simulated: each rank's loader built with its dp_rank), with MindSpeed-MM's
``Trainer._validate_and_set_train_iters`` (taken from ``mindspeed_mm/fsdp/train/trainer.py`` by ``ast``,
its logger stubbed), ``build_iterations`` (``mindspeed_mm/fsdp/data/data_utils/utils.py``) and its
``BaseRandomBatchSampler`` (``mindspeed_mm/fsdp/data/dataloader/sampler.py``) as the baseline:
iterations per epoch from its formula, every sample once per epoch through its cyclic iterator, and the
busiest / mean tokens per micro-batch of both. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _validate_fn(trainer_py: Path):
    tree = ast.parse(trainer_py.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    name = "_validate_and_set_train_iters"
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.args.args[1].annotation = None      # `args: Arguments`: the class is not importable here
    module = ast.Module(body=[fn], type_ignores=[])
    scope = {"print_rank": lambda *a, **k: None, "logger": types.SimpleNamespace(info=None)}
    exec(compile(module, str(trainer_py), "exec"), scope)   # noqa: S102 - MindSpeed-MM's own function
    return scope["_validate_and_set_train_iters"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="a MindSpeed-MM checkout")
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args(argv)
    src = a.source / "mindspeed_mm" / "fsdp"
    utils = _module(src / "data" / "data_utils" / "utils.py", "ms_utils")
    sampler_mod = _module(src / "data" / "dataloader" / "sampler.py", "ms_sampler")
    validate = _validate_fn(src / "train" / "trainer.py")

    from tokenbal.integrations.mindspeed_mm import build_dataloader

    rng = np.random.default_rng(0)
    # a heavy tail like VLM SFT data: most samples short, some long (images, long answers)
    lengths = np.where(rng.random(a.samples) < 0.2, rng.integers(2000, 12000, a.samples),
                       rng.integers(100, 1500, a.samples))
    gbs = a.micro_batch_size * a.dp * a.accum
    loaders = [build_dataloader(list(range(a.samples)), lengths, global_batch_size=gbs,
                                micro_batch_size=a.micro_batch_size, dp_size=a.dp, dp_rank=r, collate_fn=list)
               for r in range(a.dp)]
    args = types.SimpleNamespace(training=types.SimpleNamespace(
        train_epochs=a.epochs, global_batch_size=gbs, micro_batch_size=a.micro_batch_size, train_iters=None),
        data=types.SimpleNamespace(dataloader_param=types.SimpleNamespace(drop_last=True)))
    validate(types.SimpleNamespace(train_dataloader=loaders[0]), args)
    train_iters = args.training.train_iters
    iters = [utils.build_iterations(loader)[0] for loader in loaders]
    seen, loads = [set() for _ in range(a.epochs)], []
    per_epoch = train_iters // a.epochs
    for it in range(train_iters):
        for _ in range(a.accum):
            micro = [next(i) for i in iters]
            loads.append([lengths[m].sum() for m in micro])
            seen[it // per_epoch].update(j for m in micro for j in m)
    tb = float(np.mean([max(x) / np.mean(x) for x in loads]))
    # MindSpeed-MM's own sampler: its micro-batches of micro_batch_size per rank, same data
    base = [sampler_mod.BaseRandomBatchSampler(list(range(a.samples)), batch_size=a.micro_batch_size,
                                               num_replicas=a.dp, rank=r, shuffle=True) for r in range(a.dp)]
    base_loads = [[lengths[m].sum() for m in micro] for micro in zip(*base, strict=False)]
    ms = float(np.mean([max(x) / np.mean(x) for x in base_loads]))
    print(json.dumps({"source": str(a.source), "samples": a.samples, "dp": a.dp, "global_batch_size": gbs,
                      "train_iters": train_iters, "iters_per_epoch": per_epoch,
                      "every_sample_once_per_epoch": all(s == set(range(a.samples)) for s in seen),
                      "busiest_over_mean_tokenbal": round(tb, 4),
                      "busiest_over_mean_BaseRandomBatchSampler": round(ms, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
