"""A small, real webdataset corpus for tests: tar shards with real JPEG/PNG/WebP bytes from Pillow.

Reusable by any test that needs shards::

    from tests.helpers.corpus import Sample, make_corpus, write_shard, image_bytes
    corpus = make_corpus(tmp_path)                  # good + bad samples, one truncated shard
    corpus.good          # samples the index must hold, in index order (shard order, then tar order)
    corpus.bad           # samples the index must list in its errors (each with .bad_reason)
    corpus.bad_shards    # {path: expected status} for damaged shards

``Sample.expected_text`` states the index's text rule independently of ``tokenbal.index.text``:
caption as is; chat turns joined with newlines; ``<image>`` placeholders removed.
"""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from dataclasses import dataclass, field

from PIL import Image

# format name -> (member extension, Pillow save arguments)
FORMATS = {
    "jpg": ("jpg", {"format": "JPEG", "quality": 80}),
    "png": ("png", {"format": "PNG"}),
    "webp": ("webp", {"format": "WEBP", "quality": 70}),                   # lossy: VP8 chunk
    "webp-lossless": ("webp", {"format": "WEBP", "lossless": True}),        # VP8L chunk
    "webp-alpha": ("webp", {"format": "WEBP", "quality": 70}),             # RGBA lossy: VP8X chunk
    "gif": ("gif", {"format": "GIF"}),
    "bmp": ("bmp", {"format": "BMP"}),
}

SIZES = [(64, 48), (320, 240), (1000, 30), (28, 28), (600, 900), (1280, 720), (17, 200), (513, 257)]
WORDS = ("a cat sits on the red mat while the dog looks at a bird in the tall green tree near "
         "an old house under grey clouds").split()


def image_bytes(fmt: str, width: int, height: int, seed: int = 0, icc_size: int = 0) -> bytes:
    """Encoded image of exactly ``width`` x ``height``; ``icc_size`` > 0 (JPEG) embeds an ICC
    profile that large, pushing the SOF marker past any small read prefix."""
    ext, kwargs = FORMATS[fmt]
    rng = random.Random(seed)
    mode = "RGBA" if fmt == "webp-alpha" else "RGB"
    color = tuple(rng.randrange(256) for _ in range(len(mode)))
    im = Image.new(mode, (width, height), color)
    # A second colour block, so encoders produce a real (not degenerate) bitstream.
    second = tuple(rng.randrange(256) for _ in range(len(mode)))
    im.paste(second, (0, 0, max(1, width // 2), max(1, height // 3)))
    if icc_size:
        kwargs = {**kwargs, "icc_profile": bytes(rng.randrange(256) for _ in range(icc_size))}
    buf = io.BytesIO()
    im.save(buf, **kwargs)
    return buf.getvalue()


@dataclass
class Sample:
    key: str
    images: list[tuple[str, int, int]] = field(default_factory=list)   # (format, width, height)
    caption: str | None = None                 # written as <key>.txt
    conversations: list[dict] | None = None    # written as <key>.json {"conversations": ...}
    messages: list[dict] | None = None         # written as <key>.json {"messages": ...}
    raw: list[tuple[str, bytes]] = field(default_factory=list)   # extra members, verbatim (ext, bytes)
    bad_reason: str | None = None              # expected substring of the index error; None = good
    seed: int = 0
    shard: str | None = None                   # set by write_shard (absolute path)

    def members(self) -> list[tuple[str, bytes]]:
        """(extension, bytes) of every member, in the order they are written."""
        out = []
        for i, (fmt, w, h) in enumerate(self.images):
            ext = FORMATS[fmt][0]
            out.append((ext if len(self.images) == 1 else f"{i}.{ext}",
                        image_bytes(fmt, w, h, seed=self.seed * 31 + i)))
        if self.caption is not None:
            out.append(("txt", self.caption.encode("utf-8")))
        if self.conversations is not None:
            out.append(("json", json.dumps({"conversations": self.conversations}).encode()))
        if self.messages is not None:
            out.append(("json", json.dumps({"messages": self.messages}).encode()))
        out.extend(self.raw)
        return out

    @property
    def image_sizes(self) -> list[tuple[int, int]]:
        return [(w, h) for _, w, h in self.images]

    @property
    def expected_text(self) -> str:
        pieces: list[str] = []
        if self.caption is not None:
            pieces.append(self.caption)
        for turn in self.conversations or []:
            pieces.append(turn["value"])
        for msg in self.messages or []:
            content = msg["content"]
            if isinstance(content, str):
                pieces.append(content)
            else:
                pieces.extend(p["text"] for p in content if p.get("type") == "text")
        return "\n".join(pieces).replace("<image>", "")


def write_shard(path: str | os.PathLike, samples: list[Sample]) -> str:
    """Write ``samples`` as a tar shard (members in the order given); returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for s in samples:
            s.shard = path
            for ext, data in s.members():
                ti = tarfile.TarInfo(f"{s.key}.{ext}")
                ti.size, ti.mtime, ti.mode = len(data), 1_700_000_000, 0o644
                tf.addfile(ti, io.BytesIO(data))
    return path


def good_sample(key: str, rng: random.Random, kind: str) -> Sample:
    """One good sample of ``kind``: caption | chat | messages | text | image."""
    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def img(fmt: str | None = None) -> tuple[str, int, int]:
        w, h = rng.choice(SIZES)
        return (fmt or rng.choice(["jpg", "png", "webp", "webp-lossless", "webp-alpha"]), w, h)

    seed = rng.randrange(1 << 30)
    if kind == "caption":
        return Sample(key, images=[img()], caption=sentence(rng.randrange(3, 40)), seed=seed)
    if kind == "chat":
        conv = [{"from": "human", "value": "<image>\n" + sentence(8) + "?"},
                {"from": "gpt", "value": sentence(rng.randrange(5, 60))}]
        return Sample(key, images=[img()], conversations=conv, seed=seed)
    if kind == "messages":
        n = rng.randrange(2, 4)
        parts = [{"type": "image"} for _ in range(n)] + [{"type": "text", "text": sentence(10)}]
        msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": sentence(20)}]
        return Sample(key, images=[img() for _ in range(n)], messages=msgs, seed=seed)
    if kind == "text":
        return Sample(key, caption=sentence(rng.randrange(20, 200)), seed=seed)
    if kind == "image":
        return Sample(key, images=[img("jpg")], seed=seed)
    raise ValueError(kind)


@dataclass
class Corpus:
    root: str
    shards: list[str]
    good: list[Sample]
    bad: list[Sample]
    bad_shards: dict[str, str]


KINDS = ("caption", "chat", "messages", "text", "caption", "image", "chat")


def make_corpus(root: str | os.PathLike, n_shards: int = 3, samples_per_shard: int = 7, seed: int = 0,
                bad: bool = True) -> Corpus:
    """Write ``n_shards`` shards ``data-000.tar``… under ``root``.

    With ``bad=True``: shard 0 also holds a non-image file named ``.jpg`` and a zero-byte ``.png``
    sample, and one more shard ``data-<n>.tar`` is truncated mid-payload (nothing of it is indexed).
    """
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    rng = random.Random(seed)
    shards, good, bad_samples, bad_shards = [], [], [], {}
    for s in range(n_shards):
        samples = [good_sample(f"s{s:03d}/{i:05d}", rng, KINDS[(s + i) % len(KINDS)])
                   for i in range(samples_per_shard)]
        good.extend(samples)
        if bad and s == 0:
            junk = Sample("s000/bad-notimage", caption="junk", raw=[("jpg", b"this is not a jpeg\n" * 20)],
                          bad_reason="member 's000/bad-notimage.jpg' is not a readable image")
            empty = Sample("s000/bad-empty", caption="empty", raw=[("png", b"")],
                           bad_reason="member 's000/bad-empty.png' is not a readable image: empty")
            samples[2:2] = [junk]
            samples.insert(5, empty)
            bad_samples += [junk, empty]
        shards.append(write_shard(os.path.join(root, f"data-{s:03d}.tar"), samples))
    if bad:
        path = write_shard(os.path.join(root, f"data-{n_shards:03d}.tar"),
                           [good_sample(f"t/{i:05d}", rng, "caption") for i in range(4)])
        truncate_mid_payload(path)
        shards.append(path)
        bad_shards[path] = "truncated"
    return Corpus(root, shards, good, bad_samples, bad_shards)


# --- damage ---------------------------------------------------------------------------------------

def member_offsets(path: str) -> list[tuple[str, int, int, int]]:
    """(name, header offset, payload offset, size) of every member, via tarfile."""
    with tarfile.open(path, "r:") as tf:
        return [(ti.name, ti.offset, ti.offset_data, ti.size) for ti in tf]


def truncate_mid_payload(path: str) -> None:
    """Cut the file in the middle of its last member's payload."""
    _, _, data, size = member_offsets(path)[-1]
    os.truncate(path, data + max(1, size // 2))


def truncate_bytes(path: str, n: int) -> None:
    """Keep only the first ``n`` bytes."""
    os.truncate(path, n)


def corrupt_header(path: str, member: int) -> None:
    """Overwrite the start of member ``member``'s header: its checksum no longer matches, which
    CPython's tarfile silently treats as the end of the archive."""
    _, hdr, _, _ = member_offsets(path)[member]
    with open(path, "r+b") as f:
        f.seek(hdr)
        f.write(b"\xff" * 100)


def strip_end_blocks(path: str) -> None:
    """Remove the end-of-archive zero blocks (and record padding) after the last member."""
    _, _, data, size = member_offsets(path)[-1]
    os.truncate(path, data + -(-size // 512) * 512)

def rotated_jpeg(path, w: int, h: int, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    im = Image.new("RGB", (w, h), (120, 30, 200))
    im.paste((10, 200, 40), (0, 0, w // 3, h // 2))
    im.save(path, "JPEG", quality=85, exif=exif.tobytes())
    return open(path, "rb").read()
