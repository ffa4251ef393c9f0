"""Runs inside the VeOmni environment (tests/envs/veomni.txt) on each of 2 gloo ranks; driven by
test_veomni.py. VeOmni's own data path: its parallel state (dp 2, CPU), its mapping dataset and
``plaintext`` transform over a JSONL file, its ``MainCollator`` (packing), and its
``build_dataloader`` with ``"native"`` (``--train.dyn_bsz false``) and with tokenbal's ``"tokenbal"``
entry. Records per rank, step and micro-batch the rows read and the packed tokens, for 2 epochs, and
two resumes from the loader's ``state_dict`` (mid-epoch; after an epoch's last step, restored as
VeOmni's checkpoint callback does: ``load_state_dict``, ``iter``, then ``set_epoch``), and the first
steps of a run whose ``train_steps`` is capped (``--train.max_steps``), and 2 epochs of 42 rows whose
step count no batch size plans exactly.

    python -m torch.distributed.run --nproc-per-node 2 veomni_driver.py DIR
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

GLOBAL_BATCH, MICRO_BATCH, LOADER_BATCH = 8, 2, 4    # 2 micro-batches per rank and step


def main(folder: Path) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from veomni.data import build_dataloader, build_dataset
    from veomni.data.data_collator import MainCollator
    from veomni.data.data_transform import build_data_transform
    from veomni.distributed.parallel_state import init_parallel_state

    from tokenbal.integrations.veomni import register

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    init_parallel_state(dp_size=2, dp_shard_size=2, dp_mode="fsdp2", device_type="cpu")
    register()
    tok = AutoTokenizer.from_pretrained(str(folder / "model"))
    transform = build_data_transform("plaintext", tokenizer=tok, max_seq_len=4096, text_keys="text")
    dataset = build_dataset("mapping", train_path=str(folder / "train.jsonl"), transform=transform, seed=0)
    reads: list[int] = []
    getitem = type(dataset).__getitem__
    type(dataset).__getitem__ = lambda self, i: (reads.append(int(i)), getitem(self, i))[1]
    # VeOmni's own count (BaseTrainer._build_dataset / compute_train_steps, fixed batching)
    train_steps = math.floor(len(dataset) / 2 / LOADER_BATCH)

    def loader_of(data):
        return build_dataloader("tokenbal", dataset=data, micro_batch_size=MICRO_BATCH,
                                global_batch_size=GLOBAL_BATCH, dataloader_batch_size=LOADER_BATCH,
                                max_seq_len=4096, train_steps=train_steps, dyn_bsz=False, num_workers=0,
                                prefetch_factor=None, pin_memory=False, seed=0, collate_fn=MainCollator())

    def loader(kind: str, steps_per_epoch: int = train_steps):
        return build_dataloader(kind, dataset=dataset, micro_batch_size=MICRO_BATCH,
                                global_batch_size=GLOBAL_BATCH, dataloader_batch_size=LOADER_BATCH,
                                max_seq_len=4096, train_steps=steps_per_epoch, dyn_bsz=False, num_workers=0,
                                prefetch_factor=None, pin_memory=False, drop_last=True, seed=0,
                                collate_fn=MainCollator())

    def steps(dl, limit=None):
        out = []
        for step in itertools.islice(dl, limit):    # the loop receives exactly `limit` steps
            out.append({"micro_tokens": [int(mb["input_ids"].numel()) for mb in step], "rows": list(reads)})
            reads.clear()
        reads.clear()
        return out

    result = {"train_steps": train_steps}
    for kind in ("native", "tokenbal"):
        dl = loader(kind)
        epochs = []
        for epoch in range(2):
            dl.set_epoch(epoch)
            epochs.append(steps(dl))
        result[kind] = epochs
    # VeOmni's own token balancing: dyn_bsz (a per-rank token budget of micro_batch_size x max_seq_len,
    # filled from a buffer as samples load), its step count from the data's total tokens as
    # compute_train_steps does it (data.train_size tokens, bsz_warmup_ratio 0)
    dyn_seq = 320          # budget 640 tokens per micro-batch: the longest row fits
    total = int(sum(len(dataset[i][0]["input_ids"]) for i in range(len(dataset))))
    reads.clear()
    dyn_steps = math.ceil(total / (GLOBAL_BATCH * dyn_seq))
    dyn = build_dataloader("native", dataset=dataset, micro_batch_size=MICRO_BATCH,
                           global_batch_size=GLOBAL_BATCH, dataloader_batch_size=1, max_seq_len=dyn_seq,
                           train_steps=dyn_steps, dyn_bsz=True, bsz_warmup_ratio=0.0, num_workers=0,
                           prefetch_factor=None, pin_memory=False, seed=0, collate_fn=MainCollator())
    result["dyn_bsz"] = steps(dyn)
    result["dyn_budget"] = MICRO_BATCH * dyn_seq
    # resume mid-epoch 1 (after its first step) and at the end of epoch 0, each in a new loader
    dl = loader("tokenbal")
    dl.set_epoch(0)
    steps(dl)
    edge_state = dl.state_dict()
    dl.set_epoch(1)
    steps(dl, limit=1)
    mid_state = dl.state_dict()
    new = loader("tokenbal")
    new.set_epoch(1)
    new.load_state_dict(mid_state)
    result["mid"] = steps(new)
    new = loader("tokenbal")
    new.load_state_dict(edge_state)
    iter(new)                       # VeOmni's checkpoint callback, when start_step == 0
    new.set_epoch(1)
    result["edge"] = steps(new)
    # --train.max_steps 2: VeOmni's train_steps (args.train_steps) is then 2, and its loop stops each
    # epoch after 2 steps of the loader
    capped = loader("tokenbal", steps_per_epoch=2)
    capped.set_epoch(0)
    result["capped"] = steps(capped, limit=2)
    # 42 rows, global batch 4, micro-batch 2 (dataloader_batch_size 2): VeOmni counts floor(42 / 2 / 2)
    # = 10 steps, and no batch size plans exactly 10 (4 per step plans 11, 5 plans 9)
    os.environ["TOKENBAL_INDEX"] = str(folder / "index42")
    rows42 = build_dataset("mapping", train_path=str(folder / "train42.jsonl"), transform=transform, seed=0)
    type(rows42).__getitem__ = lambda self, i: (reads.append(int(i)), getitem(self, i))[1]
    uneven = build_dataloader("tokenbal", dataset=rows42, micro_batch_size=2, global_batch_size=4,
                              dataloader_batch_size=2, max_seq_len=4096, train_steps=len(rows42) // 2 // 2,
                              dyn_bsz=False, num_workers=0, prefetch_factor=None, pin_memory=False, seed=0,
                              collate_fn=MainCollator())
    result["uneven"] = []
    for epoch in range(2):
        uneven.set_epoch(epoch)
        result["uneven"].append(steps(uneven))
    # VeOmni's streaming dataset (--data.datasets_type iterable): no rows to index
    stream = build_dataset("iterable", train_path=str(folder / "train.jsonl"), transform=transform, seed=0)
    try:
        loader_of(stream)
    except Exception as e:
        result["iterable"] = f"{type(e).__name__}: {e}"
    (folder / f"veomni.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def prepare(folder: Path) -> None:
    """train.jsonl (heavy-tailed text rows), a tokenizer folder, and `tokenbal index build` of it."""
    import random

    from tests.helpers import chat_processors as cp
    from tokenbal.cli import main as tokenbal_main

    cp.tokenizer(bos_post_processor=False).save_pretrained(str(folder / "model"))
    rng = random.Random(3)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(40):
            words = rng.choices(cp.WORDS, k=rng.choice([5, 20, 60, 150, 600]))
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    rc = tokenbal_main(["index", "build", str(folder / "train.jsonl"), "--tokenizer", str(folder / "model"),
                        "--out", str(folder / "index"), "-q"])
    assert rc in (0, None), rc
    with open(folder / "train.jsonl") as f, open(folder / "train42.jsonl", "w") as out:
        rows = f.read().splitlines()
        out.write("\n".join(rows + rows[:2]) + "\n")
    rc = tokenbal_main(["index", "build", str(folder / "train42.jsonl"), "--tokenizer", str(folder / "model"),
                        "--out", str(folder / "index42"), "-q"])
    assert rc in (0, None), rc


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
