"""transformers' processors as the estimator oracles (tiny configs, nothing downloaded), built once
here for the estimator tests and the index tests that check EXIF orientation against them.
transformers is imported inside each builder, so importing this module needs none of it."""

from __future__ import annotations

import importlib
import sys
import types


def write_json(folder, name: str, obj) -> None:
    """One JSON file of a checkpoint folder (``config.json``, ``preprocessor_config.json``, ...)."""
    import json

    (folder / name).write_text(json.dumps(obj))


NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
OV_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]


def word_tokenizer():
    """A word-level tokenizer knowing ``<image>`` (id 1), ``<video>`` (2) and ``hi`` (3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<image>": 1, "<video>": 2, "hi": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", additional_special_tokens=["<image>", "<video>"]
    )


def llava_next_processor(tokenizer):
    """``LlavaNextProcessor`` at LLaVA-NeXT's 336-px settings over ``tokenizer``."""
    from transformers import LlavaNextProcessor

    from tests.helpers.family_processors import _pil

    ip = _pil("LlavaNextImageProcessor")(
        image_grid_pinpoints=NEXT_PINPOINTS,
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
    )
    return LlavaNextProcessor(
        image_processor=ip,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def llava_onevision_processor():
    """``LlavaOnevisionProcessor``'s counting methods at LLaVA-OneVision's 384-px settings."""
    from transformers import LlavaOnevisionProcessor

    from tokenbal.hf_compat import image_processor_class

    LlavaOnevisionImageProcessorPil = image_processor_class("LlavaOnevisionImageProcessorPil")

    # __init__ insists on a video processor, which needs torchvision; the counting methods do not.
    p = object.__new__(LlavaOnevisionProcessor)
    p.image_processor = LlavaOnevisionImageProcessorPil(
        image_grid_pinpoints=OV_PINPOINTS, size={"height": 384, "width": 384}
    )
    p.num_image_tokens = 729
    p.vision_feature_select_strategy = "full"
    p.vision_aspect_ratio = "anyres_max_9"
    p.image_token = "<image>"
    return p


def phi4_token_counter():
    """``count(w, h, dynamic_hd=36)``: transformers' Phi4MultimodalImageProcessor's
    ``num_img_tokens``, with shape-only stand-ins for the two torchvision pixel functions it calls
    (``resize``, ``pad``). torchvision cannot be installed beside this torch build; the token
    count depends only on shapes (it is read off the attention mask ``dynamic_preprocess``
    builds), so transformers' own ``_preprocess`` runs on empty tensors of the right shape."""
    import torch
    from transformers.image_utils import SizeDict

    def resize(image, size, *args, **kwargs):
        return torch.empty((*image.shape[:-2], int(size[0]), int(size[1])), dtype=image.dtype)

    def pad(image, padding, *args, **kwargs):
        left, top, right, bottom = padding
        shape = (*image.shape[:-2], image.shape[-2] + top + bottom, image.shape[-1] + left + right)
        return torch.empty(shape, dtype=image.dtype)

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    names.append("torchvision.transforms.v2.functional")
    stubs = {n: types.ModuleType(n) for n in names}
    stubs[names[3]].resize, stubs[names[3]].pad = resize, pad
    for parent, child in zip(names, names[1:], strict=False):
        setattr(stubs[parent], child.rsplit(".", 1)[1], stubs[child])
    modname = "transformers.models.phi4_multimodal.image_processing_phi4_multimodal"
    if importlib.util.find_spec(modname) is None:
        import pytest

        pytest.skip("this transformers has no PIL Phi-4-multimodal image processor (the oracle; 4.57 has "
                    "only the torchvision one)")
    saved = {n: sys.modules.get(n) for n in [*names, modname]}
    # the stubs live in sys.modules only while the module imports, so nothing else sees them
    sys.modules.pop(modname, None)
    sys.modules.update(stubs)
    try:
        mod = importlib.import_module(modname)
    finally:
        for n, v in saved.items():
            if v is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = v
    proc = object.__new__(mod.Phi4MultimodalImageProcessor)  # __init__ checks for torchvision
    proc.resize = lambda image, size, **kw: resize(image, [size.height, size.width])  # global view

    def count(w: int, h: int, dynamic_hd: int = 36) -> int:
        out = proc._preprocess(
            [torch.empty((3, h, w), dtype=torch.uint8)],
            do_resize=True,
            size=SizeDict(height=448, width=448),
            resample=None,
            do_rescale=False,
            rescale_factor=1 / 255,
            do_normalize=False,
            image_mean=None,
            image_std=None,
            patch_size=14,
            dynamic_hd=dynamic_hd,
            return_tensors=None,
        )
        return int(out["num_img_tokens"][0])

    return count


QWEN_SPECIALS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def qwen2_vl_checkpoint(path, corpus_text: list[str], model: bool = False) -> str:
    """A local Qwen2-VL checkpoint folder at ``path``, the way ``hf download`` leaves one: a byte-level
    BPE ``tokenizer.json`` trained on ``corpus_text`` (with Qwen's vision special tokens), the official
    ``preprocessor_config.json`` sizes (min_pixels 3136, max_pixels 12845056, patch 14, merge 2),
    ``processor_config.json`` naming ``Qwen2VLProcessor``, and with ``model=True`` a tiny random
    ``Qwen2VLForConditionalGeneration`` (``config.json`` + weights) whose token ids are the tokenizer's.
    Nothing is downloaded. Returns the folder."""
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tokenbal.hf_compat import image_processor_class

    Qwen2VLImageProcessorPil = image_processor_class("Qwen2VLImageProcessorPil")

    os.makedirs(path, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus_text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Qwen2VLProcessor"}, f)
    if model:
        import torch
        from transformers import Qwen2VLForConditionalGeneration

        from tests.helpers.tiny_qwen2_vl import tiny_config

        cfg = tiny_config()
        ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
        cfg.text_config.vocab_size = len(tok)
        cfg.image_token_id, cfg.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
        cfg.vision_start_token_id, cfg.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
        torch.manual_seed(0)
        Qwen2VLForConditionalGeneration(cfg).save_pretrained(path)
    return str(path)
