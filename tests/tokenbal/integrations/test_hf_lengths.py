"""``dataset_lengths`` equals the real transformers processor's ``apply_chat_template`` count, row
for row, under Qwen2-VL's own chat template and two more written for the tests; images are read
from headers only (decoded and ``decode=False`` columns, paths, PIL objects, content parts); the
fingerprint cache; errors naming the row; the Trainer computing its lengths."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers import chat_processors as cp  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

N_ROWS = 200


pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module")
def rows():
    out = cp.chat_rows(N_ROWS, seed=7)
    # EXIF-rotated photos: datasets' decoder transposes them, so must the header read
    out[3]["images"] = [_rotated(50, 300, 6), _rotated(400, 90, 8)]
    out[3]["messages"][-2]["content"] = [{"type": "image", "text": None}, {"type": "image", "text": None},
                                         {"type": "text", "text": "two rotated"}]
    return out


@pytest.fixture(scope="module")
def ds(rows):
    return cp.hf_dataset(rows)


@pytest.fixture(scope="module")
def tok():
    return cp.tokenizer()


def _rotated(w: int, h: int, orientation: int) -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (90, 20, 200)).save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("template", sorted(cp.TEMPLATES))
def test_equals_processor_on_every_row(ds, tok, template, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = cp.processor(cp.TEMPLATES[template], tok=tok)
    got = dataset_lengths(ds, proc)
    want = np.array([cp.oracle_length(proc, ds[i]) for i in range(len(ds))])
    assert got.dtype == np.int64 and got.shape == (N_ROWS,)
    np.testing.assert_array_equal(got, want)
    # the corpus covers what the issue asks for
    n_images = np.array([len(r) for r in ds.with_format("arrow")["images"].to_pylist()])
    assert {0, 1, 2, 3} <= set(n_images.tolist())
    roles = [[m["role"] for m in ms] for ms in ds["messages"]]
    assert any(r[0] == "system" for r in roles) and any(len(r) >= 6 for r in roles)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "llava-next"])
def test_other_processors(rows, tok, family, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    small = cp.hf_dataset(rows[:30 if family != "llava-next" else 16])
    if family == "llava-next":   # "<image>" placeholders, anyres crops: a different replacement rule
        proc = cp.llava_next_processor(tok=tok)
    else:
        proc = cp.processor(cp.QWEN2_VL, family=family, tok=tok, max_pixels=32 * 32 * 80)
    want = [cp.oracle_length(proc, small[i]) for i in range(len(small))]
    np.testing.assert_array_equal(dataset_lengths(small, proc), want)


def test_image_sources_give_the_same_counts(rows, tok, tmp_path, monkeypatch):
    """Image(decode=False), PIL objects in a list of dicts, paths, images named in content parts."""
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    from PIL import Image

    sub = rows[:40]
    proc = cp.processor(tok=tok)
    decoded = cp.hf_dataset(sub)
    want = dataset_lengths(decoded, proc, cache=False)
    np.testing.assert_array_equal(dataset_lengths(cp.hf_dataset(sub, decode=False), proc, cache=False), want)
    as_pil = [{"messages": r["messages"], "images": list(decoded[i]["images"])} for i, r in enumerate(sub)]
    np.testing.assert_array_equal(dataset_lengths(as_pil, proc), want)
    paths, parts = [], []
    for i, r in enumerate(sub):
        files = []
        for j, b in enumerate(r["images"]):
            f = tmp_path / f"{i}_{j}.img"
            f.write_bytes(b)
            files.append(str(f))
        paths.append({"messages": r["messages"], "images": files})
        it = iter(files)

        def part(c, it=it):
            return {"type": "image", "image": next(it)} if c["type"] == "image" else {"type": "text",
                                                                                     "text": c["text"]}

        parts.append({"messages": [{**m, "content": [part(c) for c in m["content"]]} for m in r["messages"]]})
    np.testing.assert_array_equal(dataset_lengths(paths, proc), want)
    np.testing.assert_array_equal(dataset_lengths(datasets.Dataset.from_list(paths), proc, cache=False), want)
    np.testing.assert_array_equal(dataset_lengths(parts, proc, images=None), want)
    # ... and the processor agrees on the content-part form, loading the files itself
    for i in (0, 3, 7):
        assert len(proc.apply_chat_template([parts[i]["messages"]], tokenize=True, return_dict=True)
                   ["input_ids"][0]) == want[i]
    assert isinstance(as_pil[3]["images"][0], Image.Image)


def test_cached_by_fingerprint(ds, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = cp.processor(tok=tok)
    first = dataset_lengths(ds, proc)
    files = list(tmp_path.glob("tokenbal-lengths-*.npy"))
    assert len(files) == 1
    from tokenbal.estimate.chat import ChatTokenCounter

    def boom(*a, **k):
        raise AssertionError("recounted although cached")

    monkeypatch.setattr(ChatTokenCounter, "count", boom)
    np.testing.assert_array_equal(dataset_lengths(ds, proc), first)
    monkeypatch.undo()
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    # another processor setting, another dataset: other keys, other files
    bigger = cp.processor(tok=tok, max_pixels=28 * 28 * 400)
    assert (dataset_lengths(ds, bigger) >= first).all()
    dataset_lengths(ds.select(range(10)), proc)
    assert len(list(tmp_path.glob("tokenbal-lengths-*.npy"))) == 3
    # a dataset on disk caches beside its Arrow files
    saved = tmp_path / "saved"
    ds.select(range(20)).save_to_disk(str(saved))
    on_disk = datasets.load_from_disk(str(saved))
    np.testing.assert_array_equal(dataset_lengths(on_disk, proc), first[:20])
    assert list(saved.glob("tokenbal-lengths-*.npy"))


def test_errors_name_the_row(rows, tok):
    proc = cp.processor(tok=tok)
    bad = [dict(r) for r in rows[:8]]
    k = next(i for i, r in enumerate(bad) if r["images"])
    bad[k] = {**bad[k], "images": bad[k]["images"] + [cp.image_bytes(40, 40)]}
    with pytest.raises(ValueError, match=rf"row {k}: the chat template renders \d+ image placeholder"):
        dataset_lengths(cp.hf_dataset(bad), proc, cache=False)
    bad = [dict(r) for r in rows[:8]]
    bad[k] = {**bad[k], "images": [b"not an image"] + bad[k]["images"][1:]}
    with pytest.raises(ValueError, match=rf"row {k}: image images\[0\]"):
        dataset_lengths(cp.hf_dataset(bad, decode=False), proc, cache=False)
    with pytest.raises(ValueError, match="no 'conversation' column"):
        dataset_lengths(cp.hf_dataset(rows[:2]), proc, messages="conversation")


def test_num_proc_equals_one_process(ds, tok):
    proc = cp.processor(tok=tok)
    sub = ds.select(range(60))
    np.testing.assert_array_equal(dataset_lengths(sub, proc, num_proc=2, cache=False),
                                  dataset_lengths(sub, proc, cache=False))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(cp.WORDS + ["\n", " ", "<|im_end|>"]), st.integers(0, 2)),
                min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(1, 900), st.integers(1, 900)), max_size=3))
def test_placeholder_shortcut_equals_expanded_text(tok_and_counter, pieces, sizes):
    """Counting each placeholder once and adding n - 1 equals tokenizing the expanded text."""
    counter = tok_and_counter
    sizes = [(w, h) for w, h in sizes if max(w, h) / min(w, h) <= 200]
    text = "".join(w for w, _ in pieces)
    parts = [{"type": "text", "text": text}] + [{"type": "image"} for _ in sizes]
    conv = [{"role": "user", "content": parts}]
    cp.assert_counts_without_expansion_equal_expanded(counter, conv, sizes)


@pytest.fixture(scope="module")
def tok_and_counter(tok):
    from tokenbal.estimate.chat import ChatTokenCounter

    return ChatTokenCounter.from_processor(cp.processor(tok=tok))


def test_estimator_from_processor_reads_its_settings(tok):
    from tokenbal.estimate import estimator_from_processor

    proc = cp.processor(tok=tok, min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 50)
    est = estimator_from_processor(proc)
    settings = (est.name, est.min_pixels, est.max_pixels, est.patch_size)
    assert settings == ("qwen2-vl", 28 * 28 * 2, 28 * 28 * 50, 14)
    for w, h in [(1000, 700), (28, 28), (3000, 40)]:
        grid = proc.image_processor(images=[cp_image(w, h)])["image_grid_thw"][0]
        assert est.image_tokens(w, h) == int(np.prod(grid)) // 4
    with pytest.raises(ValueError, match="no tokenbal estimator for"):
        estimator_from_processor(object())


def cp_image(w: int, h: int):
    from PIL import Image

    return Image.new("RGB", (w, h))


def test_trainer_computes_lengths(ds, tok, tmp_path, monkeypatch):
    """No token_lengths=: a 'length' column is used when present, else dataset_lengths."""
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    from transformers import TrainingArguments

    from collate.train.tiny import tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    proc = cp.processor(tok=tok)
    sub = ds.select(range(24))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, remove_unused_columns=False)
    model = tiny_qwen2_vl()
    t = TokenBalancedTrainer(model=model, args=args, train_dataset=sub, processing_class=proc)
    np.testing.assert_array_equal(t.tokenbal_token_lengths, dataset_lengths(sub, proc))
    np.testing.assert_array_equal(t.tokenbal_sampler.lengths, dataset_lengths(sub, proc))
    given_lengths = np.arange(24) + 5
    with_length = sub.add_column("length", given_lengths.tolist())
    t = TokenBalancedTrainer(model=model, args=args, train_dataset=with_length, processing_class=proc)
    np.testing.assert_array_equal(t.tokenbal_token_lengths, given_lengths)


def test_a_tokenizer_counts_text_rows(rows):
    """A text-only model's tokenizer as the processing class: its own apply_chat_template count."""
    tok = cp.tokenizer()
    tok.chat_template = cp.QWEN2_VL
    text_rows = [{"messages": r["messages"]} for r in rows[:40] if not r["images"]]
    want = [len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)) for r in text_rows]
    got = dataset_lengths(datasets.Dataset.from_list(text_rows), tok, cache=False)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="map-style"):
        dataset_lengths(iter(text_rows), tok)


def test_a_count_of_several_batches_shows_a_bar_of_its_rows_unless_datasets_bars_are_off(
        rows, ds, tok, capsys, monkeypatch):
    """A chat template over a million rows counted for minutes in silence (num_proc > 1 shows
    Dataset.map's bar): the rows counted are shown on stderr, following datasets' switch."""
    import tokenbal.integrations.hf_lengths as hl

    proc = cp.processor(tok=tok)
    want = dataset_lengths(rows, proc, cache=False)
    capsys.readouterr()
    monkeypatch.setattr(hl, "BATCH_ROWS", 64)           # 200 rows: four batches
    for source in (rows, ds):
        np.testing.assert_array_equal(dataset_lengths(source, proc, cache=False), want)
        err = capsys.readouterr().err
        assert "counting tokens" in err and "/200" in err and "rows" in err
    datasets.disable_progress_bars()
    try:
        for source in (rows, ds):
            np.testing.assert_array_equal(dataset_lengths(source, proc, cache=False), want)
            assert "counting tokens" not in capsys.readouterr().err
    finally:
        datasets.enable_progress_bars()


def test_an_images_column_without_any_image_counts_the_rows_parts(rows, tok, tmp_path, monkeypatch):
    """A datasets.Dataset whose images column holds no image in any row has an Arrow null type
    (``from_list`` of ``[]`` or ``None`` values: a text-only subset): its rows are counted like rows
    without images, the images of their content parts included (before: ValueError "images column
    'images' has Arrow type list<item: null>"). A row with a None entry still raises naming it."""
    import pyarrow as pa

    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    # a template that renders a part by its type: datasets gives the text part an "image": None key,
    # which Qwen2-VL's own template (`'image' in content`) renders as a second image
    proc = cp.processor(template=cp.TEMPLATES["llama-style"], tok=tok)
    text_only = [r for r in rows if not r["images"]][:10]
    assert len(text_only) == 10
    with_image_part = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": cp.image_bytes(90, 200)}, {"type": "text", "text": "what is it"}]}]}
    for empty in ([], None):
        data = [{"messages": r["messages"], "images": empty} for r in text_only]
        ds = datasets.Dataset.from_list(data)
        kind = ds.data.column("images").type
        assert pa.types.is_null(kind if empty is None else kind.value_type)
        want = [cp.oracle_length(proc, {**r, "images": []}) for r in text_only]
        np.testing.assert_array_equal(dataset_lengths(ds, proc, cache=False), want)
        parts = datasets.Dataset.from_list([{**with_image_part, "images": empty}])
        np.testing.assert_array_equal(dataset_lengths(parts, proc, cache=False),
                                      dataset_lengths([with_image_part], proc, images=None))
    nones = datasets.Dataset.from_list([{"messages": text_only[0]["messages"], "images": [None]}])
    with pytest.raises(ValueError, match=r"row 0: image images\[0\]"):
        dataset_lengths(nones, proc, cache=False)


def test_one_image_outside_a_list_is_one_image_for_the_packed_collator_too(tok):
    """dataset_lengths takes a row's images value as a list or one image; the packed Trainer's
    process_row renders such a row the same (before: TypeError "only a single or a list of entries
    is supported but got type=<class 'int'>" from transformers iterating the bytes)."""
    from tokenbal.integrations.trainer_support import process_row

    proc = cp.processor(tok=tok)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]
    image = cp.image_bytes(90, 200)
    want = cp.oracle_length(proc, {"messages": messages, "images": [image]})
    for value in (image, [image]):
        row = {"messages": messages, "images": value}
        assert len(process_row(row, proc)["input_ids"]) == dataset_lengths([row], proc)[0] == want
