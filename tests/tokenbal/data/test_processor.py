"""ProcessorDataset: indexed samples (tar shards, JSONL annotations, Parquet rows) tokenized by a real
transformers Qwen2-VL processor (built locally) have exactly the index's token counts, and collate."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from tests.helpers.corpus import Sample, image_bytes, write_shard

pytest.importorskip("transformers")

from collate import PackedCollator  # noqa: E402
from tokenbal.data import IndexedShardDataset, ProcessorDataset, load_processor  # noqa: E402
from tokenbal.index import TokenIndex, build_index  # noqa: E402


def samples() -> list[Sample]:
    """Every text layout the index reads: caption, LLaVA turns with and without <image>, messages with
    image parts, several images, text only, image only; small images so the test stays fast."""
    chat = [{"from": "human", "value": "<image>\nwhat is the cat on?"}, {"from": "gpt", "value": "a red mat"}]
    two = [{"from": "human", "value": "<image> and <image>\nsame bird?"}, {"from": "gpt", "value": "no"}]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                         {"type": "text", "text": "the tall green tree"}]},
            {"role": "assistant", "content": "near an old house"}]
    return [
        Sample("a/0", images=[("jpg", 64, 48)], caption="a cat sits on the red mat", seed=1),
        Sample("a/1", images=[("png", 28, 28)], conversations=chat, seed=2),
        Sample("a/2", images=[("webp", 17, 200), ("jpg", 90, 30)], conversations=two, seed=3),
        Sample("a/3", images=[("jpg", 40, 40), ("png", 56, 84)], messages=msgs, seed=4),
        Sample("a/4", caption="the dog looks at a bird under grey clouds " * 3, seed=5),
        Sample("a/5", images=[("jpg", 120, 64)], seed=6),
    ]


@pytest.fixture(scope="module")
def ckpt(qwen2_vl_ckpt):
    return qwen2_vl_ckpt


@pytest.fixture(scope="module")
def processor(ckpt):
    return load_processor(ckpt)


@pytest.fixture(scope="module")
def tar_index(tmp_path_factory, ckpt):
    root = tmp_path_factory.mktemp("tar")
    shard = write_shard(root / "data-000.tar", samples())
    build_index([shard], root / ".tokindex", model="qwen2-vl", tokenizer=ckpt, progress=False)
    return TokenIndex.open(root / ".tokindex")


def _oracle_ids(processor, sample: Sample) -> list[int]:
    """What the processor itself gives for the sample's images and text, built from the test's own
    description of the sample (images first unless the text places them)."""
    import io

    from PIL import Image

    images = [Image.open(io.BytesIO(image_bytes(f, w, h, seed=sample.seed * 31 + k))).convert("RGB")
              for k, (f, w, h) in enumerate(sample.images)]
    span = "<|vision_start|><|image_pad|><|vision_end|>"
    pieces = ([sample.caption] if sample.caption else []) + [t["value"] for t in sample.conversations or []]
    for m in sample.messages or []:
        c = m["content"]
        pieces += [c] if isinstance(c, str) else [p["text"] for p in c if p["type"] == "text"]
    text = "\n".join(pieces)
    text = text.replace("<image>", span) if "<image>" in text else span * len(images) + text
    out = processor(text=[text], images=images or None, add_special_tokens=False)
    return list(out["input_ids"][0])


def test_token_counts_equal_the_index_and_the_processor(tar_index, processor, caplog):
    ds = ProcessorDataset(IndexedShardDataset(tar_index, decode="pil"), processor, strict=True)
    assert ds.exact_lengths
    by_key = {s.key: s for s in samples()}
    for i in range(len(ds)):
        item = ds[i]
        assert len(item["input_ids"]) == tar_index.lengths[i], tar_index.keys[i]
        assert list(item["input_ids"]) == _oracle_ids(processor, by_key[tar_index.keys[i]])
        n_img = len(by_key[tar_index.keys[i]].images)
        if n_img:
            assert item["image_grid_thw"].shape == (n_img, 3)
            merged = int(item["image_grid_thw"].prod(-1).sum()) // 4
            pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            assert int((item["input_ids"] == pad).sum()) == merged
            # vision tokens and their wrappers carry no loss, every text token does
            assert int((item["labels"] == -100).sum()) == merged + 2 * n_img
        else:
            assert "pixel_values" not in item and (item["labels"] == item["input_ids"]).all()
    assert ds.length_mismatches == 0


def test_a_processor_without_video_pickles(processor, tar_index):
    import pickle

    # Without torchvision (this venv) load_processor leaves the video processor out; the dataset must
    # still reach DataLoader workers started with spawn.
    original = ProcessorDataset(IndexedShardDataset(tar_index), processor)
    ds = pickle.loads(pickle.dumps(original))
    assert type(ds.processor).__name__ == type(processor).__name__
    assert list(ds[0]["input_ids"]) == list(original[0]["input_ids"])


def test_a_batch_collates(tar_index, processor, ckpt):
    from transformers import AutoConfig

    ds = ProcessorDataset(IndexedShardDataset(tar_index), ckpt)     # a checkpoint folder works too
    items = ds.__getitems__([5, 0, 3, 4])
    b = PackedCollator.from_config(AutoConfig.from_pretrained(ckpt))(items)
    assert b.seq_lens == [int(tar_index.lengths[i]) for i in (5, 0, 3, 4)]
    assert b["image_grid_thw"].shape[0] == 4
    assert b["pixel_values"].shape[0] == int(b["image_grid_thw"].prod(-1).sum())


def test_annotations_and_parquet_rows(tmp_path, processor, ckpt):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "img.png").write_bytes(image_bytes("png", 64, 48, seed=9))
    recs = [{"image": "img.png", "conversations": [{"from": "human", "value": "<image>\nthe cat?"},
                                                   {"from": "gpt", "value": "on the mat"}]},
            {"text": "a bird in the tall green tree"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (tmp_path / "train.json").write_text(json.dumps(recs[::-1]))     # a .json list: keys file[i]
    build_index([str(tmp_path / "train.jsonl"), str(tmp_path / "train.json")], tmp_path / "ann",
                model="qwen2-vl", tokenizer=ckpt, progress=False)
    rows = {"images": [[{"bytes": image_bytes("jpg", 50, 70, seed=3), "path": None}], []],
            "messages": [[{"role": "user", "content": "<image>what is it"},
                          {"role": "assistant", "content": "a dog"}],
                         [{"role": "user", "content": "grey clouds"}]]}
    pq.write_table(pa.table(rows), tmp_path / "train.parquet")
    build_index([str(tmp_path / "train.parquet")], tmp_path / "pq", model="qwen2-vl", tokenizer=ckpt,
                progress=False)
    from tokenbal.data import IndexedParquetDataset

    pq_ds = IndexedParquetDataset(tmp_path / "pq")
    for source in (IndexedShardDataset(tmp_path / "ann"), pq_ds):
        ds = ProcessorDataset(source, processor, strict=True)
        got = [len(ds[i]["input_ids"]) for i in range(len(ds))]
        assert got == list(source.index.lengths) and len(got) == (4 if source is not pq_ds else 2)


def test_annotation_records_are_found_by_the_key_the_index_gave_them(tmp_path, processor, ckpt):
    # Records with an id are keyed by it (LLaVA / ShareGPT files), the rest by their place; an id spelled
    # like a place ("item:2") must not be read as a line number; a file starting with a UTF-8 BOM is read
    # as the index read it. Each sample's own text is tokenized, at the index's count.
    recs = [{"id": "item:2", "text": "a cat sits on the red mat"},
            {"id": "item:1", "text": "the dog looks at a bird in the tall green tree near"},
            {"id": 17, "text": "grey clouds over the sea"},
            {"id": "twice", "text": "one of two records with one id"},
            {"id": "twice", "text": "the other record with that id"},
            {"text": "no id at all here"}]
    (tmp_path / "ids.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in recs).encode())
    (tmp_path / "ids.json").write_text(json.dumps(recs[::-1]))
    build_index([str(tmp_path / "ids.jsonl"), str(tmp_path / "ids.json")], tmp_path / "idx", model="qwen2-vl",
                tokenizer=ckpt, progress=False)
    source = IndexedShardDataset(tmp_path / "idx")
    assert {"item:2", "item:1", "17", "ids.jsonl:4", "ids.json[1]"} <= set(source.index.keys)
    ds = ProcessorDataset(source, processor, strict=True)
    texts = [processor.tokenizer.decode(ds[i]["input_ids"]) for i in range(len(ds))]
    assert sorted(texts) == sorted(r["text"] for r in recs + recs)
    assert [len(ds[i]["input_ids"]) for i in range(len(ds))] == list(source.index.lengths)


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_samples_of_several_annotation_files_read_each_file_once(tmp_path, processor, ckpt, monkeypatch, fmt):
    """Only the last annotation file read was kept: a batch drawing from two files (as a shuffled
    sampler's does) read and parsed a whole file again at every switch (two 15 MB JSONL files: 1.2 s
    per sample). Each file is now read once; of a JSONL file only where each record's line lies is
    kept, and the line is read when asked."""
    from tokenbal.index import annotations

    paths = []
    for f in range(2):
        recs = [{"id": f"f{f}-{i}", "text": f"file {f} record {i} the cat"} for i in range(4)] + \
            [{"text": f"file {f} record without an id"}]
        path = tmp_path / f"ann{f}.{fmt}"
        path.write_text("\n".join(json.dumps(r) for r in recs) if fmt == "jsonl" else json.dumps(recs))
        paths.append(str(path))
    build_index(paths, tmp_path / "idx", model="qwen2-vl", tokenizer=ckpt, progress=False)
    source = IndexedShardDataset(tmp_path / "idx")
    scans = []
    for name in ("annotation_records", "jsonl_record_spans"):
        real = getattr(annotations, name, None)
        if real is not None:
            monkeypatch.setattr(annotations, name, lambda path, real=real: scans.append(path) or real(path))
    ds = ProcessorDataset(source, processor, strict=True)
    n = len(ds)
    order = [i for pair in zip(range(n // 2), range(n // 2, n), strict=True) for i in pair]   # alternating
    texts = {source.index.keys[i]: processor.tokenizer.decode(ds[i]["input_ids"]) for i in order}
    assert sorted(scans) == paths
    assert texts["f1-2"] == "file 1 record 2 the cat" and len(texts) == n == 10
    want = [f"file {f} record {i} the cat" for f in range(2) for i in range(4)]
    assert sorted(texts.values()) == sorted(want + [f"file {f} record without an id" for f in range(2)])


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_an_annotation_file_changed_since_the_index_is_a_stale_index_not_other_records(tmp_path, processor,
                                                                                     fmt):
    """A record added at the top of an annotation file moved every place key (``ann.jsonl:1``) onto
    another record: sample 0 was tokenized from the new line, sample 1 from the old first record, and
    so on, with no error. The file is now checked against the index (size, fingerprint) first."""
    import os
    import re

    recs = [{"text": f"record number {i}"} for i in range(4)]
    path = tmp_path / f"ann.{fmt}"
    write = (lambda rs: path.write_text("\n".join(json.dumps(r) for r in rs) + "\n")) if fmt == "jsonl" else \
        (lambda rs: path.write_text(json.dumps(rs)))
    write(recs)
    build_index([str(path)], tmp_path / "idx", model="qwen2-vl", progress=False)
    source = IndexedShardDataset(tmp_path / "idx")
    os.utime(path, (1, 1))                        # only its mtime changed: still the same records
    first = ProcessorDataset(source, processor)[0]["input_ids"]
    assert processor.tokenizer.decode(first) == "record number 0"
    write([{"text": "a new first one"}] + recs)
    stale = rf"stale index: annotation file {re.escape(str(path))} changed since the index was built"
    with pytest.raises(ValueError, match=stale + r" \(size \d+ -> \d+ bytes\)"):
        ProcessorDataset(source, processor)[0]
    write([{"text": "record number X"}] + recs[1:])   # the same size, another record
    with pytest.raises(ValueError, match="same size .* bytes, other content"):
        ProcessorDataset(source, processor)[1]


def test_mismatches_are_named(tmp_path, processor, ckpt, caplog):
    # The index counted images at other processor settings: every image sample disagrees.
    shard = write_shard(tmp_path / "d.tar", samples()[:2])
    build_index([shard], tmp_path / "idx", model="qwen2-vl", tokenizer=ckpt, progress=False,
                estimator_overrides={"min_pixels": 112 * 112})
    idx = TokenIndex.open(tmp_path / "idx")
    with pytest.raises(ValueError, match=r"sample 0 \(key 'a/0'.*the processor gave \d+ tokens, the index "
                                         r"counted \d+"):
        ProcessorDataset(IndexedShardDataset(idx), processor, strict=True)[0]
    ds = ProcessorDataset(IndexedShardDataset(idx), processor)
    with caplog.at_level(logging.WARNING, logger="tokenbal"):
        for i in range(len(ds)):
            ds[i]
    assert ds.length_mismatches == 2 and sum("the index counted" in r.message for r in caplog.records) == 1


def test_placeholders_must_match_the_images(processor, tar_index):
    ds = ProcessorDataset(IndexedShardDataset(tar_index), processor)
    with pytest.raises(ValueError, match=r"sample 1 \(key 'k'.*2 <image> placeholders for 1 images"):
        ds.tokenize({"__index__": 1, "__key__": "k", "__shard__": "s.tar", "txt": "<image><image> hi",
                     "jpg": __import__("PIL.Image").Image.new("RGB", (32, 32))})
    with pytest.raises(ValueError, match="has a video"):
        ds.tokenize({"__index__": 1, "__key__": "k", "__shard__": "s.tar", "mp4": np.zeros((2, 4, 4, 3))})
