"""Runs inside the VeOmni environment; driven by test_veomni.py. VeOmni 0.1.12's VLMTrainer with a
tiny random Qwen2-VL on 2 gloo CPU ranks, through ``python -m tokenbal.integrations.veomni``'s entry.

    python veomni_trainer_driver.py prepare DIR
    python -m torch.distributed.run --nproc-per-node 2 veomni_trainer_driver.py train DIR NAME ARGS...

CPU shims (test only): a gloo process group made before the trainer (VeOmni would ask for its device's
backend), ``torch.cpu`` stand-ins for the device-name and memory queries of its meters; the run's
arguments pick eager ops (liger, flash-attn and Triton are not installed) and no final HF save (VeOmni's
DCP consolidation patch refuses torch 2.14). Records, per rank and step, the rows read and their
token counts (VeOmni's own processed ``input_ids``).
"""

from __future__ import annotations

import atexit
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

ROWS = 16


def prepare(folder: Path) -> None:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from tests.helpers import chat_processors as cp
    from tests.helpers.tiny_qwen2_vl import tiny_config_for
    from tokenbal.cli import main as tokenbal_main

    proc = cp.processor(tok=cp.tokenizer(bos_post_processor=False), min_pixels=28 * 28 * 4,
                        max_pixels=28 * 28 * 64)
    cp.save_folder(proc, folder / "model")
    tok = proc.tokenizer
    cfg = tiny_config_for(tok)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(folder / "model")
    rng = random.Random(1)
    (folder / "img").mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for i in range(ROWS):
            w, h = rng.choice([56, 112, 224]), rng.choice([56, 112, 224])
            path = folder / "img" / f"{i}.png"
            path.write_bytes(cp.image_bytes(w, h, seed=i))
            answer = " ".join(rng.choices(cp.WORDS, k=rng.choice([3, 30, 200])))
            f.write(json.dumps({"source": "sharegpt4v_captioner", "images": [str(path)], "conversations": [
                {"from": "human", "value": "<image>describe"}, {"from": "gpt", "value": answer}]}) + "\n")
    rc = tokenbal_main(["index", "build", str(folder / "train.jsonl"), "--model", str(folder / "model"),
                        "--tokenizer", str(folder / "model"), "--image-root", "/",
                        "--out", str(folder / "index"), "-q"])
    assert rc in (0, None), rc


def train(folder: Path, name: str, args: list[str]) -> None:
    import collections

    import torch
    import torch.distributed as dist

    torch.cpu.get_device_name = lambda *a, **k: "CPU"
    for fn in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
               "reset_peak_memory_stats", "empty_cache", "reset_max_memory_allocated"):
        if not hasattr(torch.cpu, fn):
            setattr(torch.cpu, fn, lambda *a, **k: 0)
    torch.cpu.mem_get_info = lambda *a, **k: (0, 0)
    torch.cpu.memory_stats = lambda *a, **k: collections.defaultdict(int)
    dist.init_process_group("gloo")

    from veomni.data.dataset import MappingDataset
    from veomni.trainer.vlm_trainer import VLMTrainer

    pending: list[tuple[int, int]] = []
    steps: list[dict] = []
    getitem = MappingDataset.__getitem__

    def __getitem__(self, index):
        out = getitem(self, index)
        pending.append((int(index), int(out[0]["input_ids"].shape[-1])))
        return out

    MappingDataset.__getitem__ = __getitem__
    train_step = VLMTrainer.train_step

    def recording_train_step(self, data_iterator):
        pending.clear()
        out = train_step(self, data_iterator)
        steps.append({"epoch": self.base.state.epoch, "rows": [r for r, _ in pending],
                      "lengths": [n for _, n in pending]})
        return out

    VLMTrainer.train_step = recording_train_step
    rank = dist.get_rank()
    atexit.register(lambda: (folder / f"{name}.rank{rank}.json").write_text(json.dumps(steps)))
    sys.argv = [sys.argv[0], *args]
    from tokenbal.integrations.veomni import main

    main()


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        train(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
