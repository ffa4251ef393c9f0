"""build_index / TokenIndex / verify_index / index_stats / the CLI, on real tar shards."""

from __future__ import annotations

import json
import os
import tarfile

import numpy as np
import pytest

from tests.helpers.corpus import WORDS, Sample, image_bytes, make_corpus, write_shard
from tokenbal.cli import main
from tokenbal.estimate import get_estimator, get_text_counter
from tokenbal.index import Member, TokenIndex, build_index, index_stats, verify_index


def expected_tokens(sample: Sample, est, counter) -> tuple[int, int]:
    vision = sum(est.image_tokens(w, h) + est.wrapper_tokens for w, h in sample.image_sizes)
    return vision, counter.count(sample.expected_text)


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("idx") / "index"
    report = build_index([os.path.join(corpus.root, "data-*.tar")], out, progress=False)
    return report, TokenIndex.open(out)


def test_exact_tokens_for_good_samples(corpus, built):
    report, idx = built
    est, counter = get_estimator("qwen2-vl"), get_text_counter(None)
    assert list(idx.keys) == [s.key for s in corpus.good]
    assert isinstance(idx.lengths, np.memmap) and idx.lengths.dtype == np.int64
    for i, s in enumerate(corpus.good):
        vision, text = expected_tokens(s, est, counter)
        got = (idx.vision_tokens[i], idx.text_tokens[i], idx.lengths[i])
        assert got == (vision, text, vision + text), s.key
        assert idx.image_sizes(i) == s.image_sizes
        assert idx.shard(i) == s.shard
    # Every kind of sample is present: multi-image, text-only, image-only, chats.
    n_img = [len(s.images) for s in corpus.good]
    assert min(n_img) == 0 and max(n_img) >= 2 and any(not s.expected_text for s in corpus.good)
    assert report.num_samples == len(corpus.good) == len(idx)
    assert report.total_tokens == int(idx.lengths.sum())
    assert report.num_images == sum(n_img)


def test_members_point_at_the_bytes(corpus, built):
    _, idx = built
    for i, s in enumerate(corpus.good):
        members = idx.members(i)
        assert [m.name for m in members] == [f"{s.key}.{ext}" for ext, _ in s.members()]
        with open(s.shard, "rb") as f:
            for m, (_, data) in zip(members, s.members(), strict=True):
                assert m.shard == s.shard and m.size == len(data)
                f.seek(m.offset)
                assert f.read(m.size) == data


def test_bad_samples_and_shards_are_listed(corpus, built):
    report, idx = built
    by_key = {e["key"]: e for e in idx.errors}
    for s in corpus.bad:
        assert s.key not in set(idx.keys)
        assert by_key[s.key]["shard"] == s.shard
        assert s.bad_reason in by_key[s.key]["reason"]
    shard_errors = [e for e in idx.errors if e["key"] is None]
    assert [e["shard"] for e in shard_errors] == list(corpus.bad_shards)
    assert "truncated" in shard_errors[0]["reason"]
    statuses = {s["path"]: s["status"] for s in idx.manifest["shards"]}
    assert statuses == {p: corpus.bad_shards.get(p, "ok") for p in corpus.shards}
    assert report.num_errors == len(idx.errors) == len(corpus.bad) + len(corpus.bad_shards)
    assert report.num_bad_shards == len(corpus.bad_shards)
    summary = report.summary()
    assert f"indexed {len(corpus.good)} samples" in summary
    assert f"{report.num_errors} errors ({len(corpus.bad)} bad samples, 1 bad shards)" in summary


def test_manifest_and_stats(corpus, built):
    _, idx = built
    m = idx.manifest
    assert m["estimator"]["name"] == "qwen2-vl" and m["estimator"]["wrapper_tokens"] == 2
    assert m["estimator"]["config"]["max_pixels"] == get_estimator("qwen2-vl").config["max_pixels"]
    assert m["text_counter"]["name"] == get_text_counter(None).name
    for entry in m["shards"]:
        assert entry["fingerprint"].startswith("blake2b:") and entry["size"] == os.path.getsize(entry["path"])
    text = index_stats(idx.path)
    assert f"samples: {len(idx)}" in text and "1 truncated" in text
    assert f"{int(np.percentile(idx.lengths, 50, method='nearest')):>10}" in text.splitlines()[-3]


def test_workers_and_tokenizer_give_the_same_index(tmp_path, corpus):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *sorted(set(WORDS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    counter = get_text_counter(tok_path)

    one = TokenIndex.open(build_index(corpus.shards, tmp_path / "w1", tokenizer=tok_path, progress=False).out)
    two = TokenIndex.open(build_index(corpus.shards, tmp_path / "w2", tokenizer=tok_path, workers=2,
                                      progress=False).out)
    for i, s in enumerate(corpus.good):
        assert one.text_tokens[i] == counter.count(s.expected_text)
    assert one.manifest["text_counter"]["name"] == counter.name
    for name in ("lengths", "vision_tokens", "text_tokens", "shard_ids"):
        np.testing.assert_array_equal(getattr(one, name), getattr(two, name))
    assert list(one.keys) == list(two.keys) and one.errors == two.errors
    assert [one.members(i) for i in range(len(one))] == [two.members(i) for i in range(len(two))]


def test_cli_end_to_end_and_verify(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "data", n_shards=2, samples_per_shard=4, bad=False)
    out = str(tmp_path / "idx")
    pattern = str(tmp_path / "data" / "data-{000..001}.tar")
    assert main(["index", "build", pattern, "--out", out, "--model", "qwen2-vl",
                 "--estimator-option", "max_pixels=200704", "-q"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"indexed {len(corpus.good)} samples") and "0 errors" in line
    idx = TokenIndex.open(out)
    est = get_estimator("qwen2-vl", max_pixels=200704)
    assert idx.manifest["estimator"]["overrides"] == {"max_pixels": 200704}
    for i, s in enumerate(corpus.good):
        assert idx.vision_tokens[i] == expected_tokens(s, est, get_text_counter(None))[0]

    assert main(["index", "stats", out]) == 0
    assert f"samples: {len(corpus.good)}" in capsys.readouterr().out
    assert main(["index", "verify", out]) == 0
    assert "up to date" in capsys.readouterr().out
    assert verify_index(out) == []

    # Rewrite shard 0 with different samples of the same byte size: size alone would not notice.
    first = corpus.shards[0]
    size = os.path.getsize(first)
    write_shard(first, [Sample(s.key, images=s.images, caption=(s.caption or "").upper(), seed=s.seed + 1,
                               conversations=s.conversations, messages=s.messages)
                        for s in corpus.good if s.shard == first])
    assert os.path.getsize(first) == size
    os.remove(corpus.shards[1])
    problems = verify_index(out)
    # The re-listed headers name the first member that differs.
    assert problems[0].startswith(f"shard changed: {first} (member 's000/00000.jpg' of sample 's000/00000'")
    assert problems[1:] == [f"shard missing: {corpus.shards[1]}"]
    assert main(["index", "verify", out]) == 1
    printed = capsys.readouterr().out
    assert first in printed and corpus.shards[1] in printed and "2 problem(s)" in printed


def test_webdataset_tarwriter_shard(tmp_path):
    import webdataset as wds  # imports torch: only this test pays for it

    path = str(tmp_path / "wds-000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(3):
            # Sample 2's JPEG has a 200 KB ICC profile: its size needs the full-member fallback.
            jpg = image_bytes("jpg", 100 + i, 50, icc_size=200_000 if i == 2 else 0)
            sink.write({"__key__": f"sample{i:04d}", "jpg": jpg,
                        "1.png": image_bytes("png", 10, 10 + i), "txt": f"caption {i}"})
    idx = TokenIndex.open(build_index([path], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["sample0000", "sample0001", "sample0002"]
    # TarWriter writes members in sorted extension order: 1.png, jpg, txt.
    assert [m.name for m in idx.members(1)] == ["sample0001.1.png", "sample0001.jpg", "sample0001.txt"]
    assert idx.image_sizes(1) == [(10, 11), (101, 50)]
    assert idx.image_sizes(2) == [(10, 12), (102, 50)]
    assert idx.errors == [] and idx.manifest["shards"][0]["n_full_reads"] == 1
    from tests.helpers.shards import tarfile_listing, walk_listing

    assert walk_listing(path) == tarfile_listing(path)      # the fast walk took this shard


def test_rebuild_replaces_atomically(tmp_path, corpus):
    out = tmp_path / "idx"
    build_index(corpus.shards, out, progress=False)
    # keep_unlisted=False (--drop-unlisted): exactly the shards named; the default keeps the others.
    report = build_index(corpus.shards[1:2], out, progress=False, keep_unlisted=False)
    expected = sum(s.shard == corpus.shards[1] for s in corpus.good)
    assert len(TokenIndex.open(out)) == report.num_samples == expected
    assert sorted(os.listdir(tmp_path)) == ["idx"]      # no temporary folders left behind
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a tokenbal index"):
        build_index(corpus.shards, tmp_path / "notes", progress=False)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_all_bad_index_and_open_errors(tmp_path, capsys):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"")
    report = build_index([str(bad)], tmp_path / "idx", progress=True)
    assert "indexing: 100%" in capsys.readouterr().err        # the tqdm bar, over shards
    assert (report.num_samples, report.num_errors) == (0, 1)
    idx = TokenIndex.open(tmp_path / "idx")
    assert len(idx) == 0 and list(idx.keys) == [] and idx.errors[0]["shard"] == str(bad)
    assert "no samples indexed" in index_stats(tmp_path / "idx")
    assert main(["index", "build", str(bad), "--out", str(tmp_path / "idx2"), "-q"]) == 1
    with pytest.raises(FileNotFoundError, match="not a tokenbal index"):
        TokenIndex.open(tmp_path)
    with pytest.raises(IndexError):
        idx.members(0)


def test_argument_errors(tmp_path, capsys, corpus):
    with pytest.raises(FileNotFoundError, match="nope-003.tar"):
        build_index([str(tmp_path / "nope-{000..003}.tar")], tmp_path / "idx", progress=False)
    assert main(["index", "build", str(tmp_path / "nope.tar"), "--out", str(tmp_path / "i"), "-q"]) == 2
    assert "nope.tar" in capsys.readouterr().err
    with pytest.raises(ValueError, match="estimator 'qwen2-vl'"):
        build_index(corpus.shards, tmp_path / "idx", estimator_overrides={"no_such_option": 1},
                    progress=False)
    with pytest.raises(ValueError, match="image-root applies to JSON/JSONL"):
        build_index(corpus.shards, tmp_path / "idx", image_root=str(tmp_path), progress=False)
    assert not (tmp_path / "idx").exists()


def test_index_access_api(built):
    _, idx = built
    n = len(idx)
    assert idx.keys[-1] == idx.keys[n - 1] and idx.keys[1:3] == [idx.keys[1], idx.keys[2]]
    assert idx.members(-1) == idx.members(n - 1)
    with pytest.raises(IndexError):
        idx.image_sizes(n)
    assert idx.shard_paths == [s["path"] for s in idx.manifest["shards"]]
    errors_file = os.path.join(idx.path, "errors.jsonl")
    assert [json.loads(line) for line in open(errors_file)] == idx.errors


def test_image_the_processor_would_reject_is_an_error_of_its_sample_only(tmp_path):
    # 600x2 is beyond Qwen's 200:1 aspect-ratio rule: transformers' processor raises on it.
    samples = [Sample("ok0", images=[("png", 64, 48)], caption="fine"),
               Sample("thin", images=[("png", 32, 32), ("png", 600, 2)], caption="too thin"),
               Sample("ok1", caption="text only")]
    shard = write_shard(tmp_path / "s.tar", samples)
    report = build_index([shard], tmp_path / "idx", progress=False)
    idx = TokenIndex.open(report.out)
    assert list(idx.keys) == ["ok0", "ok1"] and report.num_errors == 1
    (err,) = idx.errors
    assert err["key"] == "thin" and "image 1 (600x2)" in err["reason"] and "200" in err["reason"]


# --- incremental builds -----------------------------------------------------------------------------

def index_rows(idx: TokenIndex) -> list[tuple]:
    """Everything the index says about each sample, for comparing two indexes."""
    return [(idx.keys[i], idx.shard(i), int(idx.vision_tokens[i]), int(idx.text_tokens[i]),
             idx.image_sizes(i), idx.members(i)) for i in range(len(idx))]


def test_rerun_reuses_unchanged_shards_and_appends_new_ones(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_shards=3, samples_per_shard=4, seed=5)
    out = tmp_path / "idx"
    first = build_index(corpus.shards, out, progress=False)
    before = TokenIndex.open(out)
    rows0, errors0 = index_rows(before), before.errors

    again = build_index(corpus.shards, out, progress=False)
    assert again.num_reused == len(corpus.shards)
    assert "4 unchanged shards reused, 0 scanned" in again.summary()
    idx = TokenIndex.open(out)
    assert index_rows(idx) == rows0 and idx.errors == errors0 and again.num_errors == first.num_errors
    for name in ("lengths", "vision_tokens", "text_tokens"):
        np.testing.assert_array_equal(getattr(idx, name), getattr(before, name))

    # A new shard that sorts first in the glob is still appended: old rows keep their numbers.
    new = make_corpus(tmp_path / "more", n_shards=1, samples_per_shard=3, seed=9, bad=False)
    first_new = os.path.join(tmp_path / "data", "a-new.tar")
    os.rename(new.shards[0], first_new)
    for s in new.good:
        s.shard = first_new
    report = build_index([os.path.join(tmp_path / "data", "*.tar")], out, progress=False)
    assert report.num_reused == len(corpus.shards)
    idx = TokenIndex.open(out)
    assert index_rows(idx)[:len(rows0)] == rows0
    est, counter = get_estimator("qwen2-vl"), get_text_counter(None)
    for i, s in enumerate(new.good, start=len(rows0)):
        assert (idx.keys[i], idx.shard(i)) == (s.key, first_new)
        assert (idx.vision_tokens[i], idx.text_tokens[i]) == expected_tokens(s, est, counter)

    # Same as a fresh build over the same shards in the same order.
    fresh = TokenIndex.open(build_index(idx.shard_paths, tmp_path / "fresh", progress=False).out)
    assert index_rows(fresh) == index_rows(idx) and fresh.errors == idx.errors


def test_rerun_rescans_changed_shards_drops_unlisted_and_respects_rules(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "data", n_shards=3, samples_per_shard=4, seed=6, bad=False)
    out = tmp_path / "idx"
    build_index(corpus.shards, out, progress=False)
    # Shard 1 rewritten with the same size and new captions: rescanned in place.
    mid = corpus.shards[1]
    size = os.path.getsize(mid)
    changed = [Sample(s.key, images=s.images, caption=(s.caption or "x").upper(), seed=s.seed,
                      conversations=s.conversations, messages=s.messages)
               for s in corpus.good if s.shard == mid]
    write_shard(mid, changed)
    assert os.path.getsize(mid) == size
    report = build_index(corpus.shards[:2], out, progress=False, keep_unlisted=False)   # shard 2 dropped
    assert (report.num_reused, report.num_shards) == (1, 2)
    idx = TokenIndex.open(out)
    assert idx.shard_paths == corpus.shards[:2]
    counter = get_text_counter(None)
    rows = [i for i in range(len(idx)) if idx.shard(i) == mid]
    assert [idx.keys[i] for i in rows] == [s.key for s in changed]
    assert [int(idx.text_tokens[i]) for i in rows] == [counter.count(s.expected_text) for s in changed]
    assert verify_index(out) == []
    # Other rules (a different pixel budget) or --rebuild: everything is rescanned.
    other = build_index(corpus.shards[:2], out, estimator_overrides={"max_pixels": 200704}, progress=False)
    assert other.num_reused == 0
    capsys.readouterr()
    # The CLI does not replace an index of other rules silently: it names the setting both ways.
    assert main(["index", "build", *corpus.shards[:2], "--out", str(out), "-q", "--drop-unlisted"]) == 2
    assert "max_pixels: index 200704, this build 12845056" in capsys.readouterr().err
    assert main(["index", "build", *corpus.shards[:2], "--out", str(out), "-q", "--rebuild"]) == 0
    assert "reused" not in capsys.readouterr().out   # rules changed above: everything rescanned
    assert main(["index", "build", *corpus.shards[:2], "--out", str(out), "-q"]) == 0
    assert "2 unchanged shards reused, 0 scanned" in capsys.readouterr().out
    assert main(["index", "build", *corpus.shards[:2], "--out", str(out), "--rebuild", "-q"]) == 0
    assert "reused" not in capsys.readouterr().out


# --- large index, plot, rules ------------------------------------------------------------------------

def test_open_is_lazy_and_memory_mapped_on_a_large_index(tmp_path):
    from tokenbal.index.build import ShardResult, write_index

    rows, chunk = 1_000_000, 250_000
    rng = np.random.default_rng(0)
    vision, text = rng.integers(0, 16384, rows), rng.integers(1, 4096, rows)

    def results():
        for start in range(0, rows, chunk):
            sl = slice(start, start + chunk)
            ones = np.ones(chunk, np.int64)
            yield ShardResult(
                entry={"path": f"/x/shard-{start // chunk}.tar", "size": 0, "mtime_ns": 0,
                       "fingerprint": None, "status": "ok", "reason": None, "n_members": chunk,
                       "n_samples": chunk, "n_errors": 0},
                keys=[f"k{i}" for i in range(start, start + chunk)], member_counts=ones,
                member_exts=["jpg"] * chunk,
                member_offsets=np.arange(start, start + chunk) * 1024, member_sizes=ones * 1000,
                image_counts=ones, image_wh=np.full((chunk, 2), 448), vision=vision[sl], text=text[sl],
                errors=[])

    meta = {"estimator": {"name": "synthetic", "config": {}, "wrapper_tokens": 2},
            "text_counter": {"name": "synthetic"}}
    write_index(tmp_path / "big", results(), meta)
    idx = TokenIndex.open(tmp_path / "big")
    for name in ("lengths", "vision_tokens", "text_tokens", "shard_ids"):
        assert isinstance(getattr(idx, name), np.memmap), name
    # Keys and errors are not read by open(), only when first used.
    assert "keys" not in idx.__dict__ and "errors" not in idx.__dict__
    assert len(idx) == rows and int(idx.lengths.sum()) == int((vision + text).sum())
    np.testing.assert_array_equal(idx.lengths[-5:], (vision + text)[-5:])
    mid = rows // 2 + 7
    assert idx.keys[mid] == f"k{mid}" and idx.shard(mid) == "/x/shard-2.tar"
    assert idx.members(mid) == [Member(f"k{mid}.jpg", "/x/shard-2.tar", mid * 1024, 1000)]
    assert idx.image_sizes(mid) == [(448, 448)] and idx.errors == []


def test_stats_plot_is_a_histogram_of_the_index(tmp_path, corpus, built, capsys):
    from PIL import Image

    from tokenbal.index.plot import TEXT_RGB, VISION_RGB

    _, idx = built
    png = tmp_path / "hist.png"
    assert main(["index", "stats", idx.path, "--plot", str(png)]) == 0
    assert f"histogram written to {png}" in capsys.readouterr().out
    from tokenbal.index.plot import token_histogram

    hist = token_histogram(idx.vision_tokens, idx.text_tokens)
    # Reference: each sample's bin is 0 for 0 tokens, else the bit length of its count.
    for col, counts in ((idx.vision_tokens, hist.vision), (idx.text_tokens, hist.text)):
        want = np.zeros(len(hist.labels), np.int64)
        for v in col:
            want[int(v).bit_length()] += 1
        np.testing.assert_array_equal(counts, want)
    assert hist.vision[0] == sum(1 for s in corpus.good if not s.images)
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (960, 540)
        colors = {c for _, c in im.convert("RGB").getcolors(1 << 20)}
    assert VISION_RGB in colors and TEXT_RGB in colors


def test_open_checks_the_token_rules(tmp_path, corpus):
    out = build_index(corpus.shards[:1], tmp_path / "idx", estimator_overrides={"max_pixels": 200704},
                      progress=False).out
    TokenIndex.open(out, expect_estimator=get_estimator("qwen2-vl", max_pixels=200704),
                    expect_text_counter=get_text_counter(None))
    with pytest.raises(ValueError, match=r"max_pixels: index 200704, expected 12845056.*rebuild"):
        TokenIndex.open(out, expect_model="qwen2-vl")
    with pytest.raises(ValueError, match="estimator: index 'qwen2-vl', expected 'internvl'"):
        TokenIndex.open(out, expect_model="internvl")
    with pytest.raises(ValueError, match="text counter: index 'heuristic"):
        TokenIndex.open(out, expect_text_counter="tokenizer:other")


def test_interrupted_build_resumes_from_its_finished_shards(tmp_path, monkeypatch):
    import tokenbal.index.build as build_mod

    corpus = make_corpus(tmp_path / "data", n_shards=4, samples_per_shard=3, seed=8, bad=False)
    out = tmp_path / "idx"
    real, calls = build_mod.index_shard, []

    def interrupted(path, *args):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt   # Ctrl-C while the third shard is scanned
        return real(path, *args)

    monkeypatch.setattr(build_mod, "index_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus.shards, out, progress=False)
    assert not out.exists()
    partial = TokenIndex.open(tmp_path / ".idx.partial")
    assert partial.shard_paths == corpus.shards[:2] and partial.manifest["partial"] is True
    assert list(partial.keys) == [s.key for s in corpus.good if s.shard in corpus.shards[:2]]

    calls.clear()
    monkeypatch.setattr(build_mod, "index_shard", lambda path, *a: calls.append(path) or real(path, *a))
    report = build_index(corpus.shards, out, progress=False)
    assert calls == corpus.shards[2:] and report.num_reused == 2      # only the unfinished shards
    assert sorted(os.listdir(tmp_path)) == ["data", "idx"]            # the partial index is gone
    fresh = TokenIndex.open(build_index(corpus.shards, tmp_path / "fresh", progress=False).out)
    assert index_rows(TokenIndex.open(out)) == index_rows(fresh)


def test_writer_rollback_drops_a_half_written_shard(tmp_path, corpus):
    from tokenbal.estimate import get_estimator as ge
    from tokenbal.index.build import _IndexWriter, index_shard

    est, counter = ge("qwen2-vl"), get_text_counter(None)
    good, second = (index_shard(p, est, counter) for p in corpus.shards[:2])
    writer = _IndexWriter(str(tmp_path))
    writer.add(good)
    second.member_sizes = "not numbers"           # fails after some columns were already appended
    with pytest.raises(ValueError):
        writer.add(second)
    writer.rollback()
    writer.finish({"estimator": {"name": est.name}, "text_counter": {"name": counter.name}})
    idx = TokenIndex(str(tmp_path))
    assert list(idx.keys) == good.keys and idx.shard_paths == [corpus.shards[0]]
    assert [e["shard"] for e in idx.errors] == [corpus.shards[0]] * len(good.errors)


def test_idefics3_tile_markers_are_counted_per_image(tmp_path):
    from tokenbal.estimate import get_estimator

    # Split images carry row and tile markers, so a constant per-image wrapper would be wrong.
    samples = [Sample("big", images=[("png", 1456, 1000)], caption="x"),
               Sample("small", images=[("png", 64, 64)], caption="x")]
    shard = write_shard(tmp_path / "s.tar", samples)
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", model="idefics3", progress=False).out)
    est = get_estimator("idefics3")
    for i, (w, h) in enumerate([(1456, 1000), (64, 64)]):
        assert idx.vision_tokens[i] == est.image_tokens(w, h) + est.image_wrapper_tokens(w, h)
    assert est.image_wrapper_tokens(1456, 1000) != est.wrapper_tokens


def test_a_glob_that_matches_the_out_folder_does_not_take_the_index_as_a_source(tmp_path):
    # `index build "data/*" --out data/idx`: the first build worked, and every rebuild was refused with
    # "source 'data/idx' is a directory" (the glob now matches the index it wrote).
    corpus = make_corpus(tmp_path / "data", n_shards=2, samples_per_shard=3, bad=False)
    pattern, out = os.path.join(corpus.root, "*"), os.path.join(corpus.root, "idx")
    first = build_index([pattern], out, progress=False)
    again = build_index([pattern], out, progress=False)
    assert again.num_samples == first.num_samples == 6
    assert sorted(TokenIndex.open(out).shard_paths) == sorted(os.path.abspath(s) for s in corpus.shards)
    # Another folder the glob matches is still refused: only the index being built is passed over.
    os.makedirs(os.path.join(corpus.root, "other"))
    with pytest.raises(ValueError, match="other' is a directory"):
        build_index([pattern], out, progress=False)


def _marks(offsets, size: int, unit: str) -> list[tuple[int, int, str]]:
    """The reports ``scan.ProgressMarks`` makes of a phase passing ``offsets``: each one at least
    PROGRESS_BYTES past the last report, then (size, size) at the end."""
    from tokenbal.index.scan import PROGRESS_BYTES

    want, last = [], 0
    for done in offsets:
        if done - last >= PROGRESS_BYTES:
            want.append((done, size, unit))
            last = done
    return [*want, (size, size, unit)]


def big_tar_shard(folder, n: int = 2500) -> tuple[str, list, list]:
    """A ~10 MB shard of ``n`` samples (one image and a ~4 KB caption each); with the offsets its
    header walk reports at (each header, then the end-of-archive blocks) and its sample pass (each
    sample's end)."""
    from tests.helpers.corpus import member_offsets

    samples = [Sample(key=f"{i:05d}", images=[("png", 8 + i % 5, 8)], caption=" ".join(WORDS[:3]) * 280)
               for i in range(n)]
    shard = write_shard(folder / "big.tar", samples)
    members = member_offsets(shard)
    headers = [hdr for _, hdr, _, _ in members] + [members[-1][2] + -(-members[-1][3] // 512) * 512]
    ends = [off + sz for _, _, off, sz in members][1::2]     # each sample's last member (image, caption)
    return shard, headers, ends


def test_a_large_tar_shard_reports_its_header_walk_then_bytes_read_then_texts_counted(tmp_path, capsys):
    """A multi-GB tar shard showed nothing until its whole scan and count were done; and nothing while
    its member headers were walked (with tarfile's fallback too)."""
    from tests.helpers.corpus import member_offsets
    from tokenbal.index.scan import HEADERS, PROGRESS_BYTES, PROGRESS_ROWS, scan_shard
    from tokenbal.io.tar import walk_members

    n = 2500
    shard, headers, ends = big_tar_shard(tmp_path, n)
    size = os.path.getsize(shard)
    reports = []
    scan = scan_shard(shard, progress=lambda *r: reports.append(r))
    assert len(scan.samples) == n and not scan.errors
    # The walk every PROGRESS_BYTES of the shard (at the header past each mark), then the end; then
    # the samples read, every PROGRESS_BYTES (at the end of the sample past each mark), then the end.
    walked, read = _marks(headers, size, HEADERS), _marks(ends, size, "B")
    assert len(walked) == len(read) == size // PROGRESS_BYTES + 1
    assert reports == walked + read
    assert [s.key for s in scan_shard(shard).samples] == [s.key for s in scan.samples]
    # A shard the fast walk leaves to tarfile (its last member's mtime in GNU base-256) reports its
    # listing the same way, once: the walk's reports before it gave up are not repeated.
    odd = str(tmp_path / "odd.tar")
    with tarfile.open(shard) as src, tarfile.open(odd, "w", format=tarfile.GNU_FORMAT) as dst:
        for ti in src:
            ti.mtime = -1 if ti.name == "02499.txt" else ti.mtime
            dst.addfile(ti, src.extractfile(ti))
    with open(odd, "rb") as f:
        assert walk_members(f.fileno(), os.path.getsize(odd)) is None
    odd_reports = []
    assert len(scan_shard(odd, progress=lambda *r: odd_reports.append(r)).samples) == n
    assert [r for r in odd_reports if r[2] == HEADERS] == \
        _marks([hdr for _, hdr, _, _ in member_offsets(odd)], os.path.getsize(odd), HEADERS)

    small = write_shard(tmp_path / "small.tar", [Sample(key="a", caption="one caption")])
    for workers in (1, 2):      # in process, and from the scan processes through their queue
        seen = []
        build_index([shard, small], tmp_path / f"idx{workers}", workers=workers,
                    progress=lambda *r, seen=seen: seen.append(r))
        assert [r[1:] for r in seen if r[0] == shard and r[3] in (HEADERS, "B")] == reports
        counted = [(k, n, "samples") for k in range(PROGRESS_ROWS, n, PROGRESS_ROWS)] + [(n, n, "samples")]
        assert [r[1:] for r in seen if r[0] == shard and r[3] == "samples"] == counted
        small_size = os.path.getsize(small)
        assert [r[1:] for r in seen if r[0] == small] == \
            [(small_size, small_size, HEADERS), (small_size, small_size, "B"), (1, 1, "samples")]
    assert main(["index", "build", shard, "--out", str(tmp_path / "cli")]) == 0
    err = capsys.readouterr().err
    assert "indexing" in err and "big.tar (headers)" in err and "big.tar (tokens)" in err
    assert main(["index", "build", shard, "--out", str(tmp_path / "q"), "-q"]) == 0
    assert capsys.readouterr().err == ""
