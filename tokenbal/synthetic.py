"""A small, deterministic, heavy-tailed multimodal corpus: real image files in real tar shards.

Used by ``tokenbal demo``, the benchmarks and the tests. Each sample is one of the kinds that make
real VLM fine-tuning data skewed: photos (~640×480 JPEG), scanned documents (~1700×2300 PNG),
screenshots (1920×1080 PNG), tiny icons, multi-image posts and text-only samples of very
different lengths. Images are drawn cheaply (gradients and boxes) so that generation is fast,
but they are genuine JPEG/PNG files that any decoder and header parser must handle.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field

import numpy as np

# (kind, weight): the mixture's proportions.
MIXTURE: tuple[tuple[str, float], ...] = (
    ("photo", 0.35),
    ("document", 0.10),
    ("screenshot", 0.10),
    ("icon", 0.10),
    ("multi_image", 0.10),
    ("text_short", 0.15),
    ("text_long", 0.10),
)

_WORDS = (
    "the a model image token rank step batch data shard video frame patch vision text loss "
    "gradient layer attention rotary position sequence packed balance sampler index tile resize "
    "photo document screenshot icon caption describe shows contains left right top bottom red "
    "green blue large small table chart figure page line word number person street building "
    "window sky tree water light dark bright scene object detail region corner center edge"
).split()


@dataclass(frozen=True)
class SyntheticImage:
    width: int
    height: int
    fmt: str  # "jpg" or "png"


@dataclass(frozen=True)
class SyntheticSample:
    key: str
    kind: str
    text: str
    images: tuple[SyntheticImage, ...] = field(default_factory=tuple)


def _sentence(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(_WORDS, size=n_words)
    return " ".join(words.tolist()) + "."


def _jitter(rng: np.random.Generator, base: int, spread: float) -> int:
    return max(8, int(round(base * rng.uniform(1 - spread, 1 + spread))))


def make_samples(n: int, seed: int = 0) -> list[SyntheticSample]:
    """Draw ``n`` samples from :data:`MIXTURE`; a pure function of ``(n, seed)``."""
    rng = np.random.default_rng(seed)
    kinds = [k for k, _ in MIXTURE]
    weights = np.array([w for _, w in MIXTURE])
    drawn = rng.choice(len(kinds), size=n, p=weights / weights.sum())
    samples = []
    for i, ki in enumerate(drawn):
        kind = kinds[ki]
        images: list[SyntheticImage] = []
        if kind == "photo":
            landscape = rng.random() < 0.7
            w, h = _jitter(rng, 640, 0.2), _jitter(rng, 480, 0.2)
            images = [SyntheticImage(w, h, "jpg") if landscape else SyntheticImage(h, w, "jpg")]
            text = _sentence(rng, int(rng.integers(8, 40)))
        elif kind == "document":
            images = [SyntheticImage(_jitter(rng, 1700, 0.05), _jitter(rng, 2300, 0.05), "png")]
            text = _sentence(rng, int(rng.integers(20, 120)))
        elif kind == "screenshot":
            images = [SyntheticImage(1920, 1080, "png")]
            text = _sentence(rng, int(rng.integers(10, 60)))
        elif kind == "icon":
            side = int(rng.choice([16, 24, 32, 48, 64]))
            images = [SyntheticImage(side, side, "png")]
            text = _sentence(rng, int(rng.integers(3, 12)))
        elif kind == "multi_image":
            images = [SyntheticImage(_jitter(rng, 640, 0.25), _jitter(rng, 480, 0.25), "jpg")
                      for _ in range(int(rng.integers(2, 5)))]
            text = _sentence(rng, int(rng.integers(10, 50)))
        elif kind == "text_short":
            text = _sentence(rng, int(rng.integers(5, 60)))
        else:  # text_long: long instructions / documents without images
            n_sentences = int(rng.integers(20, 80))
            text = " ".join(_sentence(rng, int(rng.integers(10, 30))) for _ in range(n_sentences))
        samples.append(SyntheticSample(key=f"{i:06d}", kind=kind, text=text, images=tuple(images)))
    return samples


def render_image(img: SyntheticImage, seed: int) -> bytes:
    """Encode a cheap but genuine image: a colour gradient with a few boxes."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    c0, c1 = rng.integers(0, 256, size=3), rng.integers(0, 256, size=3)
    # A horizontal gradient built at width 1 and resized is far cheaper than per-pixel numpy.
    ramp = np.linspace(0.0, 1.0, img.height, dtype=np.float32)[:, None]
    col = (c0[None, :] * (1 - ramp) + c1[None, :] * ramp).astype(np.uint8)
    im = Image.fromarray(col[:, None, :].repeat(1, axis=1), "RGB").resize((img.width, img.height),
                                                                          Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(2, 6))):
        x0, x1 = sorted(rng.integers(0, img.width, size=2).tolist())
        y0, y1 = sorted(rng.integers(0, img.height, size=2).tolist())
        draw.rectangle([x0, y0, x1, y1], fill=tuple(rng.integers(0, 256, size=3).tolist()))
    buf = io.BytesIO()
    if img.fmt == "jpg":
        im.save(buf, format="JPEG", quality=80)
    else:
        im.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def image_member_names(sample: SyntheticSample) -> list[str]:
    """Member extensions of a sample's images: ``jpg`` for one image, ``0.jpg``, ``1.jpg``… for several."""
    if len(sample.images) == 1:
        return [sample.images[0].fmt]
    return [f"{i}.{im.fmt}" for i, im in enumerate(sample.images)]


def write_shards(samples: list[SyntheticSample], out_dir: str, samples_per_shard: int = 64,
                 prefix: str = "data") -> list[str]:
    """Write ``samples`` as webdataset tar shards (``{key}.txt`` plus images); return the paths."""
    import webdataset as wds

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for shard_no, start in enumerate(range(0, len(samples), samples_per_shard)):
        path = os.path.join(out_dir, f"{prefix}-{shard_no:05d}.tar")
        with wds.TarWriter(path) as sink:
            for s in samples[start:start + samples_per_shard]:
                record: dict[str, object] = {"__key__": s.key, "txt": s.text}
                for j, (ext, img) in enumerate(zip(image_member_names(s), s.images, strict=True)):
                    record[ext] = render_image(img, seed=int(s.key) * 16 + j)
                sink.write(record)
        paths.append(path)
    return paths
