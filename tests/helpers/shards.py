"""Indexed tar shards and their references for the dataset / tar-walk tests: a clean corpus with its
index, every member as ``tarfile`` reads it, and the raw header walk's listing in the same form."""

from __future__ import annotations

import os
import tarfile

from tests.helpers.corpus import make_corpus
from tokenbal.index import TokenIndex, build_index
from tokenbal.io.tar import walk_members


def build(root, n_shards=3, samples_per_shard=7, seed=0) -> tuple[TokenIndex, list[str]]:
    """A clean corpus under ``root`` and its index; returns (index, shard paths)."""
    corpus = make_corpus(os.path.join(root, "shards"), n_shards=n_shards,
                         samples_per_shard=samples_per_shard, seed=seed, bad=False)
    out = os.path.join(root, "index")
    build_index(corpus.shards, out, progress=False)
    return TokenIndex.open(out), corpus.shards


def tar_members(shards) -> dict[str, bytes]:
    """Every member of every shard, read by tarfile: {member name: bytes}."""
    out = {}
    for path in shards:
        with tarfile.open(path, "r:") as tf:
            for ti in tf:
                out[ti.name] = tf.extractfile(ti).read()
    return out


def as_members(sample: dict) -> dict[str, bytes]:
    """{member name: bytes} of a raw sample dict."""
    return {f"{sample['__key__']}.{k}": v for k, v in sample.items() if not k.startswith("__")}


def first_key_batch(batch):
    return batch   # collate_fn: keep the list of sample dicts

def tarfile_listing(path: str):
    """(name, type, size, payload offset) per member and the end offset, as tarfile reads them."""
    with tarfile.open(path, "r:") as tf:
        members = [(ti.name, ti.type, ti.size, ti.offset_data) for ti in tf]
        return members, tf.offset


def walk_listing(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        got = walk_members(fd, os.path.getsize(path))
    finally:
        os.close(fd)
    if got is None:
        return None
    members, end = got
    return [(m.name, m.type, m.size, m.offset_data) for m in members], end
