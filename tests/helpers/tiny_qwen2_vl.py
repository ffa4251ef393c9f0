"""The tiny random Qwen2-VL config of the packed Qwen2-VL model tests (also the empty-rank test).
transformers is imported when the config is built."""

from __future__ import annotations

VOCAB = 128
IMG, VID, VSTART, VEND = 120, 121, 122, 123
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch


def tiny_config(attn: str = "sdpa"):
    from transformers import Qwen2VLConfig

    from tokenbal.hf_compat import rope_config

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=None,
            **rope_config(Qwen2VLConfig, 10000.0, mrope_section=[2, 3, 3]),
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        attn_implementation=attn,
    )


def tiny_config_for(tokenizer, attn: str = "eager"):
    """:func:`tiny_config` over ``tokenizer``'s vocabulary, its vision token ids read from it (the
    framework drivers' checkpoints, whose tokenizer is a real one)."""
    cfg = tiny_config(attn=attn)
    cfg.text_config.vocab_size = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t)
           for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    cfg.image_token_id, cfg.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    cfg.vision_start_token_id, cfg.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    return cfg
