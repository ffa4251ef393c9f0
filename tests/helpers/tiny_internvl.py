"""A tiny random InternVL config (Qwen2 text, 32-px tiles, 4 tokens per tile). transformers is
imported when the config is built."""

from __future__ import annotations

IMG = 120
SIDE = 32  # tile side; patch 8 -> 4 x 4 features, pixel shuffle 0.5 -> 4 tokens per tile


def tiny_config(attn: str = "sdpa"):
    from transformers import InternVLConfig

    return InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=[SIDE, SIDE], patch_size=[8, 8]),
        image_token_id=IMG, image_seq_length=4, attn_implementation=attn)
