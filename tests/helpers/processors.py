"""transformers' processors as the estimator oracles (tiny configs, nothing downloaded), built once
here for the estimator tests and the index tests that check EXIF orientation against them.
transformers is imported inside each builder, so importing this module needs none of it."""

from __future__ import annotations

import importlib
import sys
import types

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
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    ip = LlavaNextImageProcessorPil(
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
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

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
