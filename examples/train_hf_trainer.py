"""Fine-tune a Qwen2-VL with transformers' Trainer on token-balanced batches.

    python examples/train_hf_trainer.py --output-dir /tmp/tb_run                  # padded batches, 1 process
    python examples/train_hf_trainer.py --output-dir /tmp/tb_run --packed --max-tokens-per-rank 400
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --output-dir /tmp/tb_run --packed \\
        --max-tokens-per-rank 400
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --output-dir /tmp/tb_run --resume

It trains a tiny *random* Qwen2-VL (``collate/train/tiny.py``), so it runs anywhere (CPU, no
downloads). Two ways to batch:

* default: pre-tokenized samples (``TinyVLDataset``) padded per micro-batch (``pad_collate``); the
  plan minimises what padded steps cost (``cost="padded"``, the Trainer default under tokenbal);
* ``--packed``: raw chat rows (``messages`` + ``images``) rendered per sample by a real
  ``Qwen2VLProcessor`` and packed into one row per rank and step (``PackedCollator``, the model
  patched with ``enable_packed``: varlen attention over ``cu_seqlens``), each row at most
  ``--max-tokens-per-rank`` real tokens.

With your own model and data: load the model and its processor with ``from_pretrained``, pass
your ``datasets.Dataset`` of chat rows and its lengths (``dataset_lengths(ds, processor)``, a
``length`` column, or a token index from ``tokenbal index build``); see docs/integrations.md.
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--per-device-batch", type=int, default=4, help="samples per micro-batch (padded mode)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-tokens-per-rank", type=int, default=None,
                   help="a token budget per rank and micro-batch instead of a fixed batch size "
                        "(required with --packed)")
    p.add_argument("--packed", action="store_true",
                   help="raw chat rows rendered by the processor, packed into one row per rank and step")
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    args = p.parse_args()
    if args.packed and args.max_tokens_per_rank is None:
        p.error("--packed needs --max-tokens-per-rank (the budget of every packed row)")

    from transformers import TrainingArguments

    from collate.train.tiny import (
        TinyVLDataset,
        chat_rows,
        pad_collate,
        tiny_qwen2_vl,
        tiny_qwen2_vl_processor,
    )
    from tokenbal.integrations.hf import TokenBalancedTrainer

    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, num_train_epochs=args.epochs, learning_rate=1e-3,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=5, report_to=[],
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, log_level="info")
    if args.packed:
        processor = tiny_qwen2_vl_processor()
        rows = chat_rows(args.samples)   # 0-2 images of 56-112 px, system turns, multi-turn chats
        trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=training_args, train_dataset=rows,
                                       processing_class=processor, token_lengths=_lengths(rows, processor),
                                       packed=True, max_tokens_per_rank=args.max_tokens_per_rank)
    else:
        # 4-199 text tokens; every third sample also has an image of 4x4 to 8x8 patches.
        dataset = TinyVLDataset(args.samples, max_text=200, image_sides=(2, 5))
        options = {"max_tokens_per_rank": args.max_tokens_per_rank} if args.max_tokens_per_rank else {}
        trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=training_args, train_dataset=dataset,
                                       data_collator=pad_collate, token_lengths=dataset.lengths(),
                                       sampler_options=options)
    start = _checkpoint_step(args.output_dir) if args.resume else 0
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        # Trainer's training_loss is the mean over the steps this call trained (0.0 when a resumed
        # run had none left), so both are said as such.
        ran = result.global_step - start
        loss = f"mean loss of these steps {result.training_loss:.3f}" if ran else "nothing left to train"
        print(f"at step {result.global_step} ({ran} trained by this run), "
              f"{len(trainer.get_train_dataloader())} per epoch on each rank; {loss}")


def _checkpoint_step(output_dir: str) -> int:
    """The step of the checkpoint ``--resume`` continues from (``checkpoint-N``), else 0."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    return int(last.rsplit("-", 1)[1]) if last else 0


def _lengths(rows: list[dict], processor) -> list[int]:
    """Exact token counts of the rows as the processor renders them (chat template included):
    ``dataset_lengths`` where this tokenbal has it (from image headers, no pixels), else the processor."""
    try:
        from tokenbal.integrations.hf import dataset_lengths
    except ImportError:
        from tokenbal.integrations.trainer_support import process_row

        return [len(process_row(r, processor)["input_ids"]) for r in rows]
    import datasets

    return list(dataset_lengths(datasets.Dataset.from_list(rows), processor))


if __name__ == "__main__":
    main()
