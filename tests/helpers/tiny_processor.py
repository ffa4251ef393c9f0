"""The tiny Qwen2-VL's processor and chat rows (they live in ``collate.train.tiny``, shared with
``examples/train_hf_trainer.py``): a real ``Qwen2VLProcessor`` over a word-level tokenizer whose ids
match ``tiny_qwen2_vl``; rows with 0-2 images, system turns and multi-turn chats."""

from collate.train.tiny import CHAT_TEMPLATE, chat_rows, tiny_qwen2_vl_processor

__all__ = ["CHAT_TEMPLATE", "chat_rows", "tiny_qwen2_vl_processor"]
