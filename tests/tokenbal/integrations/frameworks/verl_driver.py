"""Runs inside the verl environment (tests/envs/verl.txt); driven by test_verl.py.

    python verl_driver.py prepare DIR          # tiny Qwen2-VL checkpoint, train.parquet, tokenbal index
    python -m torch.distributed.run --nproc-per-node 2 verl_driver.py train {tokenbal,verl} LOG OVERRIDES...

``train`` applies the CPU shims this machine needs (below), records what every rank trained at
every step (dataset rows, and the token count verl itself computed for each), and then runs
``tokenbal.integrations.verl.main`` (``tokenbal``) or verl's own ``verl.trainer.sft_trainer.main``
(``verl``, the default loader, its collate made safe as tokenbal's is) with the overrides: the same
Hydra entry either way. ``collate`` shows verl's own collate failing on a text-only row first.

CPU shims (tests only, none of them in the library): verl 0.9.1 has no CPU platform, so one is
registered (``VERL_PLATFORM=cpu``: device ``cpu``, backend ``gloo``) and the FSDP engine is picked
with ``VERL_ENGINE_DEVICE=cuda``; verl's process group string would name ``cpu`` twice, so the group
is made with gloo alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))   # the checkout: tests.helpers

N_ROWS = 24


def prepare(folder: Path) -> None:
    """The model folder (tokenizer, processor config, chat template, random Qwen2-VL weights), a
    Parquet file of chat rows in verl's layout (``messages`` with ``<image>`` placeholders, ``images``
    a list of ``{bytes}``), and ``tokenbal index build`` of it."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from tests.helpers import chat_processors as cp
    from tests.helpers.tiny_qwen2_vl import tiny_config_for

    model_dir = folder / "model"
    # no BOS post-processor: verl tokenizes turn by turn and checks the concatenation against the whole
    proc = cp.processor(tok=cp.tokenizer(bos_post_processor=False), min_pixels=28 * 28 * 4,
                        max_pixels=28 * 28 * 64)
    cp.save_folder(proc, model_dir)
    tok = proc.tokenizer
    cfg = tiny_config_for(tok)
    cfg.text_config.bos_token_id = tok.bos_token_id
    cfg.text_config.eos_token_id = tok.eos_token_id
    cfg.text_config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(model_dir)

    rng = random.Random(7)
    rows = []
    for i in range(N_ROWS):
        # a heavy tail, as in real SFT data: most rows short, a few long answers or many images
        n_img = rng.choice([0, 0, 1, 1, 2, 4])
        words = " ".join(rng.choices(cp.WORDS, k=rng.randint(2, 20)))
        answer = " ".join(rng.choices(cp.WORDS, k=rng.choice([3, 10, 30, 60, 200, 800])))
        sizes = [(rng.choice([56, 112, 200, 224, 320]), rng.choice([56, 84, 150, 224])) for _ in range(n_img)]
        rows.append({"messages": [{"role": "user", "content": "<image>" * n_img + words},
                                  {"role": "assistant", "content": answer}],
                     "images": [{"bytes": cp.image_bytes(w, h, seed=i + j), "path": None}
                                for j, (w, h) in enumerate(sizes)]})
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, folder / "train.parquet", row_group_size=10)
    from tokenbal.cli import main as tokenbal_main

    # verl's rows name images with "<image>" in string content; `--processor` renders such a string
    # through the chat template as text, so the image count comes from the estimator (--model) and
    # the text from the tokenizer: the template's few tokens per turn are not counted.
    rc = tokenbal_main(["index", "build", str(folder / "train.parquet"), "--model", str(model_dir),
                        "--tokenizer", str(model_dir), "--out", str(folder / "index"), "-q"])
    assert rc in (0, None), rc


def cpu_shims() -> None:
    import torch
    import torch.distributed as dist
    import verl.utils.distributed as vdist
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    class CPUModule:
        """torch.cpu plus the memory queries verl makes of a device module (zeros on CPU)."""

        def __getattr__(self, name):
            if hasattr(torch.cpu, name):
                return getattr(torch.cpu, name)
            if name == "get_device_name":      # verl's MFU: an unknown name counts as no peak FLOPs
                return lambda *a: "CPU"
            if name in ("get_rng_state", "set_rng_state"):   # the "cpu" generator, saved by verl anyway
                return getattr(torch, name)
            if name.startswith(("memory_", "max_memory_", "reset_", "mem_get_info", "empty_cache")):
                return lambda *a, **k: (0, 0) if name == "mem_get_info" else 0
            raise AttributeError(name)

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPUModule()

        def is_available(self): return True
        def current_device(self): return "cpu"   # where verl moves modules and tensors
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        @contextlib.contextmanager
        def nvtx_range(self, msg): yield
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    PlatformRegistry.register("cpu")(CPUPlatform)
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")

    def gloo_group(timeout_second=36000):
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        return int(os.environ["LOCAL_RANK"]), dist.get_rank(), dist.get_world_size()

    vdist.initialize_global_process_group = gloo_group


def record_steps(log: Path) -> None:
    """Wrap verl's dataset and ``SFTTrainer._get_batch_seqlens`` (called once per step, before the
    step's forward) so that every rank writes, per step, the rows it trained and their lengths."""
    import torch.distributed as dist
    from verl.trainer import sft_trainer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    pending: list[int] = []
    steps: list[dict] = []
    getitem = MultiTurnSFTDataset.__getitem__

    def __getitem__(self, item):
        out = getitem(self, item)
        pending.append((int(item), int(out["input_ids"].shape[0])))   # verl's own token count of the row
        return out

    MultiTurnSFTDataset.__getitem__ = __getitem__
    seqlens = sft_trainer.SFTTrainer._get_batch_seqlens

    def wrap(get):
        def _get_batch_seqlens(self, data):
            local = data["input_ids"].offsets().diff().tolist()
            steps.append({"epoch": self.train_sampler.epoch if hasattr(self.train_sampler, "cursor")
                          else getattr(self.train_sampler, "epoch", None),
                          "rows": [r for r, _ in pending], "row_lengths": [n for _, n in pending],
                          "lengths": local})   # `lengths`: in the collated order (an image row first)
            pending.clear()
            out = get(self, data)
            if dist.get_rank() == 0:
                steps[-1]["global"] = out
            return out
        return _get_batch_seqlens

    sft_trainer.SFTTrainer._get_batch_seqlens = wrap(seqlens)
    from tokenbal.integrations import verl as tb_verl

    make = tb_verl.sft_trainer_class

    def sft_trainer_class():
        cls = make()
        cls._get_batch_seqlens = wrap(cls._get_batch_seqlens)
        return cls

    tb_verl.sft_trainer_class = sft_trainer_class

    import atexit

    def dump():
        rank = dist.get_rank() if dist.is_initialized() else os.environ["RANK"]
        path = log.with_name(f"{log.stem}.rank{rank}.json")
        path.write_text(json.dumps(steps))

    atexit.register(dump)


def collate_check() -> None:
    """verl's SFTTensorCollator(no_padding) on [text-only row, image row]: KeyError; through
    tokenbal's FirstItemComplete: a batch whose text-only entry of multi_modal_inputs is None."""
    import torch
    from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

    from tokenbal.integrations.verl import FirstItemComplete

    text = {"input_ids": torch.arange(3), "loss_mask": torch.ones(3, dtype=torch.int64)}
    image = {"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.int64),
             "multi_modal_inputs": {"pixel_values": torch.ones(4, 8),
                                    "image_grid_thw": torch.tensor([[1, 2, 2]])}}
    collator = SFTTensorCollator(DatasetPadMode.NO_PADDING)
    try:
        collator([text, image])
        raise AssertionError("verl's collate accepted a text-only row first")
    except KeyError as e:
        assert e.args == ("multi_modal_inputs",), e.args
    out = FirstItemComplete(collator)([text, image, text])
    assert out["input_ids"].offsets().diff().tolist() == [5, 3, 3]
    mm = [x.data if hasattr(x, "data") else x for x in out["multi_modal_inputs"]]
    assert mm[0] is not None and mm[1] is None and mm[2] is None, mm
    print("collate ok")


def rl_check(folder: str) -> None:
    """tokenbal's balance_batch installed on verl's RayPPOTrainer, run on a DataProto rollout batch
    whose rows have the same attention-mask sums but different images: verl's own _balance_batch
    sees them as equal; tokenbal's cost (vision tower + LLM) does not. Prints both placements' cost."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import Qwen2VLConfig
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from tokenbal.integrations import verl as tb_verl

    # the cost model reads the actor's config.json only: Qwen2-VL-7B's dimensions (no weights)
    model_dir = os.path.join(folder, "qwen2-vl-7b-config")
    Qwen2VLConfig(text_config=dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                                   num_attention_heads=28, num_key_value_heads=4),
                  vision_config=dict(embed_dim=1280, depth=32, hidden_size=3584, num_heads=16,
                                     mlp_ratio=4)).save_pretrained(model_dir)
    verls = RayPPOTrainer._balance_batch
    tb_verl.patch_rl_trainer()
    assert RayPPOTrainer._balance_batch is tb_verl.balance_batch

    def batch():
        # rows 0-1: 300 tokens with an image (its 400 placeholder tokens merged from 1,600 patches);
        # row 2: 900 text tokens; rows 3-7: 300 text tokens. Equal attention-mask sums for verl.
        sizes = [300, 300, 900, 300, 300, 300, 300, 300]
        mask = torch.zeros(len(sizes), 1000, dtype=torch.int64)
        for i, n in enumerate(sizes):
            mask[i, :n] = 1
        mm = [{"image_grid_thw": torch.tensor([[1, 40, 40]])} if i < 2 else None for i in range(len(sizes))]
        return DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(len(sizes))},
                                   non_tensors={"multi_modal_inputs": np.array(mm, dtype=object)})

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": model_dir},
                                                             "actor": {"ppo_mini_batch_size": 8}}})
    trainer.actor_rollout_wg = None
    trainer._get_dp_size = lambda wg, role: 2
    costs = tb_verl.sample_costs(batch(), tb_verl._hf_config(model_dir))
    result = {}
    for name, fn in (("verl", verls), ("tokenbal", tb_verl.balance_batch)):
        b, metrics = batch(), {}
        fn(trainer, b, metrics)
        rows = b.batch["row"].tolist()
        loads = [int(costs[rows[:4]].sum()), int(costs[rows[4:]].sum())]
        result[name] = max(loads) / (sum(loads) / 2)
        assert sorted(rows) == list(range(8)) and "global_seqlen/max" in metrics, (rows, metrics)
    import itertools

    best = min(max(costs[list(c)].sum(), costs.sum() - costs[list(c)].sum())
               for c in itertools.combinations(range(8), 4)) / (costs.sum() / 2)
    result["best"] = float(best)
    print("rl", json.dumps(result))
    assert result["tokenbal"] <= result["verl"] and result["tokenbal"] <= best * 1.0001, result


def main() -> None:
    cmd = sys.argv[1]
    if cmd == "prepare":
        prepare(Path(sys.argv[2]))
        return
    if cmd == "collate":
        collate_check()
        return
    if cmd == "rl":
        rl_check(sys.argv[2])
        return
    assert cmd == "train", cmd
    which, log, overrides = sys.argv[2], Path(sys.argv[3]), sys.argv[4:]
    cpu_shims()
    record_steps(log)
    sys.argv = [sys.argv[0], *overrides]
    if which == "tokenbal":
        from tokenbal.integrations.verl import main as entry
        entry()
    else:
        # verl's own loader, with only its collate made safe (a text-only row first in a batch with
        # images raises KeyError 'multi_modal_inputs' there too, whichever sampler made the batch)
        from verl.trainer.sft_trainer import main as entry
        from verl.utils.dataset.dataset_utils import SFTTensorCollator

        from tokenbal.integrations.verl import complete_first

        collate = SFTTensorCollator.collate_variable_batch
        SFTTensorCollator.collate_variable_batch = lambda self, batch: collate(self, complete_first(batch))
        entry()


if __name__ == "__main__":
    main()
