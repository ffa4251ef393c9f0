"""Fine-tune a Qwen2-VL with transformers' Trainer on token-balanced batches.

    python examples/train_hf_trainer.py --output-dir /tmp/tb_run              # 1 process
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --output-dir /tmp/tb_run
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --output-dir /tmp/tb_run --resume

Without ``--model`` it trains a tiny *random* Qwen2-VL on synthetic image+text samples, so it runs
anywhere (CPU, no downloads). With real data, replace ``TinyVLDataset`` (``collate/train/tiny.py``)
by your dataset and the lengths by a token index built offline (``tokenbal index build ...
--model qwen2-vl`` then ``TokenIndex.open(dir)``): one entry per dataset item, in dataset order,
estimated from image headers without running the processor.
"""

from __future__ import annotations

import argparse

import torch

from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl


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

    # 4-199 text tokens; every third sample also has an image of 4x4 to 8x8 patches.
    dataset = TinyVLDataset(args.samples, max_text=200, image_sides=(2, 5))
    options = {"max_tokens_per_rank": args.max_tokens_per_rank} if args.max_tokens_per_rank else {}
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, num_train_epochs=args.epochs, learning_rate=1e-3,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=5, report_to=[],
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, disable_tqdm=True)
    trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=training_args, train_dataset=dataset,
                                   data_collator=pad_collate, token_lengths=dataset.lengths(),
                                   sampler_options=options)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        print(f"trained {result.global_step} steps, {len(trainer.get_train_dataloader())} per epoch on each "
              f"rank; final loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
