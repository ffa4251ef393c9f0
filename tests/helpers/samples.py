"""Random vision-language samples in the Qwen-VL placeholder layout, for the packed-model, FSDP2 and
sequence-parallel tests: one builder, so every family's samples come from the same rules."""

from __future__ import annotations

import torch


def vl_sample(g: torch.Generator, spec: list, *, image: int, video: int, start: int, end: int,
              patch_dim: int, text_vocab: int = 80, frame_stamps: bool = False) -> dict:
    """spec: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w)) in patch units.

    Each image or video is ``<start> placeholder * (t*h*w / 4) <end>`` (2x2 spatial merge); its
    pixels are random ``(t*h*w, patch_dim)`` rows. ``frame_stamps``: a video is laid out as
    Qwen3-VL's processor does, every frame (one temporal patch) with its own two timestamp tokens
    and ``<start> ... <end>``, which transformers' ``get_rope_index`` needs to split the video
    grid into per-frame grids. Placeholders are not loss targets.
    """
    ids: list[int] = []
    grids: dict[str, list] = {"image": [], "video": []}
    pixels: dict[str, list] = {"image": [], "video": []}
    for kind, arg in spec:
        if kind == "text":
            ids += torch.randint(0, text_vocab, (arg,), generator=g).tolist()
            continue
        t, h, w = arg
        if kind == "video" and frame_stamps:
            for _ in range(t):
                ids += torch.randint(0, text_vocab, (2,), generator=g).tolist()  # "<t.t seconds>"
                ids += [start] + [video] * (h * w // 4) + [end]
        else:
            ids += [start] + [image if kind == "image" else video] * (t * h * w // 4) + [end]
        grids[kind].append(list(arg))
        pixels[kind].append(torch.randn(t * h * w, patch_dim, generator=g))
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[(input_ids == image) | (input_ids == video)] = -100
    sample = {"input_ids": input_ids, "labels": labels}
    if grids["image"]:
        sample.update(pixel_values=torch.cat(pixels["image"]), image_grid_thw=torch.tensor(grids["image"]))
    if grids["video"]:
        sample.update(pixel_values_videos=torch.cat(pixels["video"]),
                      video_grid_thw=torch.tensor(grids["video"]))
    return sample


def text_only(samples: list[dict]) -> list[dict]:
    """The samples without an image or a video."""
    return [s for s in samples if "pixel_values" not in s and "pixel_values_videos" not in s]
