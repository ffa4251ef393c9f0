"""Fine-tune a Qwen2-VL with transformers' Trainer on token-balanced batches.

    python examples/train_hf_trainer.py --output-dir /tmp/tb_run              # 1 process
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --output-dir /tmp/tb_run
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --output-dir /tmp/tb_run --resume

Without ``--model`` it trains a tiny *random* Qwen2-VL on synthetic image+text samples, so it runs
anywhere (CPU, no downloads). With real data, replace ``SyntheticVL`` by your dataset and the
lengths by a token index built offline (``tokenbal index build ... --model qwen2-vl`` then
``TokenIndex.open(dir)``): one entry per dataset item, in dataset order, estimated from image
headers without running the processor.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

IMG, VSTART, VEND = 120, 122, 123
PATCH_DIM = 3 * 2 * 14 * 14


class SyntheticVL(torch.utils.data.Dataset):
    """Text of 4-200 tokens; every third sample also has one image of 4x4 to 8x8 patches."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            n_text = int(torch.randint(4, 200, (1,), generator=g))
            ids = torch.randint(0, 100, (n_text,), generator=g).tolist()
            item = {}
            if i % 3 == 0:
                h = w = int(torch.randint(2, 5, (1,), generator=g)) * 2
                ids = ids[:2] + [VSTART] + [IMG] * (h * w // 4) + [VEND] + ids[2:]
                item["pixel_values"] = torch.randn(h * w, PATCH_DIM, generator=g)
                item["image_grid_thw"] = torch.tensor([[1, h, w]])
            item["input_ids"] = torch.tensor(ids)
            item["labels"] = torch.where(item["input_ids"] == IMG, -100, item["input_ids"])
            self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def token_lengths(self) -> np.ndarray:
        return np.array([len(it["input_ids"]) for it in self.items], dtype=np.int64)


def collate(features: list[dict]) -> dict:
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    labels = torch.full((len(features), n), -100, dtype=torch.long)
    mask = torch.zeros(len(features), n, dtype=torch.long)
    for r, f in enumerate(features):
        k = len(f["input_ids"])
        ids[r, :k], labels[r, :k], mask[r, :k] = f["input_ids"], f["labels"], 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask,
             "mm_token_type_ids": (ids == IMG).int()}
    images = [f for f in features if "pixel_values" in f]
    if images:
        batch["pixel_values"] = torch.cat([f["pixel_values"] for f in images])
        batch["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in images])
    return batch


def tiny_model():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, patch_size=14,
                           spatial_merge_size=2),
        image_token_id=IMG, video_token_id=121, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-tokens-per-rank", type=int, default=None,
                   help="a token budget per rank and micro-batch instead of a fixed batch size")
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    args = p.parse_args()

    from transformers import TrainingArguments

    from tokenbal.integrations.hf import TokenBalancedTrainer

    dataset = SyntheticVL(args.samples)
    options = {"max_tokens_per_rank": args.max_tokens_per_rank} if args.max_tokens_per_rank else {}
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, num_train_epochs=args.epochs, learning_rate=1e-3,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=5, report_to=[],
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, disable_tqdm=True)
    trainer = TokenBalancedTrainer(model=tiny_model(), args=training_args, train_dataset=dataset,
                                   data_collator=collate, token_lengths=dataset.token_lengths(),
                                   sampler_options=options)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} steps, {len(trainer.get_train_dataloader())} per epoch on each "
              f"rank; final loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
