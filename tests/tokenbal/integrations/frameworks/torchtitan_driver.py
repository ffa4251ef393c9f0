"""Runs inside the torchtitan environment (tests/envs/torchtitan.txt); driven by test_torchtitan.py.

    python torchtitan_driver.py prepare DIR      # tokenizer, 2 webdataset shards (jpg + txt), tokenbal index
    python -m torch.distributed.run --nproc-per-node 2 torchtitan_driver.py DIR

torchtitan's own multimodal data path on 2 gloo CPU ranks: its ``MultiModalTokenizer``, its cc12m
sample processor (``_process_cc12_wd_sample``, with the keywords its ``MMDataLoader`` passes), its
``MultiModalCollator``; its ``MMDataLoader`` (``cc12m-test`` over the same shards, split by node) as
the baseline, and ``tokenbal.integrations.torchtitan.build_dataloader`` over
``tokenbal.data.IndexedShardDataset``. Records per rank and step the samples read, the real (unpadded)
tokens, and the processed lengths; one epoch; a resume from the per-DP-rank ``state_dict``.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

SEQ_LEN, LOCAL_BATCH = 2048, 3
N_SHARDS, PER_SHARD = 2, 12
PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}


def prepare(folder: Path) -> None:
    import random

    # tokenizers only (the environment has no transformers): chat_processors' BPE, trained the same way
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.helpers import chat_processors as cp
    from tokenbal.cli import main as tokenbal_main

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=cp.SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    bpe.train_from_iterator([" ".join(rng.choices(cp.WORDS, k=12)) for _ in range(300)], trainer)
    (folder / "model").mkdir()
    bpe.save(str(folder / "model" / "tokenizer.json"))
    rng = random.Random(5)
    (folder / "shards").mkdir()
    for s in range(N_SHARDS):
        with tarfile.open(folder / "shards" / f"shard-{s}.tar", "w") as tar:
            for j in range(PER_SHARD):
                # shard 1 holds the big images and long captions: a per-node split is then unbalanced
                big = s == 1 and j % 2 == 0
                w, h = (rng.choice([300, 448]), 448) if big else (rng.choice([56, 84]), 56)
                words = rng.choices(cp.WORDS, k=rng.choice([150, 300] if big else [3, 10]))
                members = (("jpg", cp.image_bytes(w, h, "JPEG", seed=j)), ("txt", " ".join(words).encode()))
                for ext, data in members:
                    info = tarfile.TarInfo(f"s{s}-{j:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    shards = [str(p) for p in sorted((folder / "shards").glob("*.tar"))]
    rc = tokenbal_main(["index", "build", *shards, "--model", "qwen2-vl",
                        "--tokenizer", str(folder / "model" / "tokenizer.json"),
                        "--estimator-option", f"min_pixels={PIXELS['min_pixels']}",
                        "--estimator-option", f"max_pixels={PIXELS['max_pixels']}",
                        "--out", str(folder / "index"), "-q"])
    assert rc in (0, None), rc


def main(folder: Path) -> None:
    import itertools

    import torch.distributed as dist
    from torchtitan.components.tokenizer import MultiModalTokenizer
    from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator
    from torchtitan.hf_datasets.multimodal.mm_datasets import MMDataLoader, _process_cc12_wd_sample
    from torchtitan.hf_datasets.multimodal.utils.image import resize_to_pixel_budget

    from tokenbal import TokenIndex
    from tokenbal.data import IndexedShardDataset
    from tokenbal.integrations.torchtitan import build_dataloader, packed_collate

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = MultiModalTokenizer(MultiModalTokenizer.Config(
        image_token="<|image_pad|>", video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>", pad_token="<|endoftext|>"), tokenizer_path=str(folder / "model"))
    vision = dict(patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    processor_kwargs = dict(tokenizer=tok, **vision, **PIXELS, image_mean=mean, image_std=std,
                            resize_fn=resize_to_pixel_budget, max_patches=4096, max_patches_per_side=512,
                            video_dir="", video_fps=2.0, video_min_frames=4, video_max_frames=768,
                            seq_len=SEQ_LEN)

    def real_tokens(inputs) -> int:
        return int((inputs["input"] != tok.pad_id).sum())

    # torchtitan's own loader: cc12m-test over the same shards, finite, split by node
    cfg = MMDataLoader.Config(dataset="cc12m-test", dataset_path=str(folder / "shards"), infinite=False,
                              max_images_per_batch=16, **vision, **PIXELS, image_mean=mean, image_std=std)
    native = MMDataLoader(cfg, dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=SEQ_LEN,
                          local_batch_size=LOCAL_BATCH)
    result = {"native": [real_tokens(inputs) for inputs, _ in native]}

    index = TokenIndex.open(folder / "index")
    reads: list[tuple[int, int]] = []
    processor = _process_cc12_wd_sample

    def recording(sample, **kw):
        out = processor(sample=sample, **kw)
        reads.append((keys.index(sample["__key__"]), int(out["input_ids"].shape[0])))
        return out

    keys = list(index.keys)
    collator = MultiModalCollator(batch_size=LOCAL_BATCH + 2, seq_len=SEQ_LEN, max_images_per_batch=16,
                                  **vision, tokenizer=tok, build_mrope_positions=False)

    def loader(collate):
        return build_dataloader(IndexedShardDataset(index), index, dp_rank=rank, dp_world_size=world,
                                sample_processor=recording, processor_kwargs=processor_kwargs,
                                collate_fn=collate, global_batch_size=LOCAL_BATCH * world, infinite=False)

    def run(dl, limit=None):
        steps = []
        for inputs, _labels in itertools.islice(dl, limit):
            real = int(inputs["input"].numel()) if "cu_seqlens" in inputs else real_tokens(inputs)
            steps.append({"rows": [r for r, _ in reads], "lengths": [n for _, n in reads], "real": real})
            reads.clear()
        return steps

    dl = loader(collator)
    result["tokenbal"] = run(dl)
    # resume: after one step, from torchtitan's per-DP-rank state, in a new loader
    dl = loader(collator)
    run(dl, limit=1)
    state = dl.state_dict()
    assert set(state) == {f"dp_rank_{rank}", "world_size"}, state.keys()
    new = loader(collator)
    new.load_state_dict(state)
    result["resumed"] = run(new)
    # the packed alternative: one row per rank and step, no padding
    packed = run(loader(packed_collate()))
    result["packed_real"] = [s["real"] for s in packed]
    result["index_lengths"] = [int(index.lengths[i]) for i in range(len(index))]
    (folder / f"titan.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
