"""``dataset_lengths`` per family against the family's real transformers processor, built from a
user's subclass of it, on 200 seeded random rows of every row shape (images column of bytes,
images inline in the parts as paths, OpenAI ``image_url`` parts, string content; system turns,
1-3 exchanges, 0-3 images of many sizes and aspect ratios, EXIF-rotated JPEGs), on whichever
transformers is installed (4.57 to 5.x); resolution by what a processor is; the packed Trainer's
``process_row`` on public calls."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from tests.helpers import chat_processors as cp  # noqa: E402
from tests.helpers import family_processors as fp  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

N_ROWS = 200
pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _processor_or_skip(family: str, subclass: bool = True):
    try:
        return fp.processor(family, subclass=subclass)
    except (ImportError, ModuleNotFoundError) as e:   # SmolVLM needs num2words; 5.6's Idefics3 torchvision
        pytest.skip(f"{family}'s processor cannot be built here: {str(e).strip().splitlines()[0]}")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return fp.materialise(fp.random_rows(N_ROWS, seed=50), tmp_path_factory.mktemp("images"))


@pytest.mark.parametrize("family", fp.FAMILIES)
def test_equals_the_processor_on_random_rows(family, rows, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = _processor_or_skip(family)
    assert type(proc).__name__.startswith("My")   # a user's subclass resolves like its base
    converts = fp._converts_image_url(proc)
    ok, want = [], []
    for i, r in enumerate(rows):
        if not converts and _has_image_url(r):
            continue
        try:
            want.append(fp.oracle(proc, r))
            ok.append(i)
        except ValueError as e:   # the installed processor rejects the row (4.57's GLM: a side < 28 px)
            with pytest.raises(ValueError, match="row 0: image"):
                dataset_lengths([r], proc)
            assert "factor" in str(e)
    assert len(ok) >= N_ROWS // 2
    got = dataset_lengths([rows[i] for i in ok], proc)
    np.testing.assert_array_equal(got, want)
    # the corpus covers what the issue asks for
    n_images = [len(r["images"]) or sum(1 for m in r["messages"] if isinstance(m["content"], list)
                                        for p in m["content"] if p["type"] != "text") for r in rows]
    assert {0, 1, 2, 3} <= set(n_images)
    assert any(isinstance(r["messages"][0]["content"], str) for r in rows)
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    # the same rows as a datasets.Dataset: images column of Image(decode=False) bytes or paths
    ds_rows = [rows[i] for i in ok if rows[i]["shape"] in ("column", "inline")]
    ds = datasets.Dataset.from_list([{"messages": _json_messages(r["messages"]),
                                      "images": [{"bytes": b, "path": None} for b in r["images"]]}
                                     for r in ds_rows[:60]])
    ds = ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
    np.testing.assert_array_equal(dataset_lengths(ds, proc),
                                  [fp.oracle(proc, r) for r in ds_rows[:60]])
    if not converts:   # transformers 4.x: image_url parts are not images; a row with them is named
        k = next(i for i, r in enumerate(rows) if _has_image_url(r))
        with pytest.raises(ValueError, match=rf"row {k}: the chat template renders"):
            dataset_lengths(rows[:k + 1], proc)


def _has_image_url(row) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] == "image_url" for p in m["content"])
               for m in row["messages"])


def _json_messages(messages):
    """Messages with every part holding the same keys (as Arrow stores them: missing -> None)."""
    out = []
    for m in messages:
        if isinstance(m["content"], str):
            part = {"type": "text", "text": m["content"], "image": None}
            out.append({"role": m["role"], "content": [part]})
            continue
        out.append({"role": m["role"], "content": [{"type": p["type"], "text": p.get("text"),
                                                    "image": p.get("image")} for p in m["content"]
                                                   if p["type"] != "image_url"]})
    return out


@pytest.mark.parametrize("family", ["qwen2.5-vl", "internvl", "llava-onevision"])
def test_num_proc_gives_the_same_lengths(family, rows, tmp_path, monkeypatch):
    """``num_proc=2`` (``Dataset.map`` workers, each with a pickled counter) counts every row as one
    process does, images as bytes and as paths, and the cache holds the same array."""
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = _processor_or_skip(family, subclass=False)
    column = [r for r in rows if r["shape"] == "column"][:60]
    ds = datasets.Dataset.from_list([{"messages": r["messages"], "images": r["images"]} for r in column])
    one = dataset_lengths(ds, proc, cache=False)
    np.testing.assert_array_equal(one, [fp.oracle(proc, r) for r in column])
    np.testing.assert_array_equal(dataset_lengths(ds, proc, num_proc=2, cache=False), one)
    np.testing.assert_array_equal(dataset_lengths(ds, proc, num_proc=2), one)   # cached by the workers' run
    np.testing.assert_array_equal(dataset_lengths(ds, proc), one)


def test_literal_apply_chat_template_where_it_runs(rows):
    """Where the installed transformers takes ``images=`` (5.24 and later), the literal expression
    of the contract equals the count."""
    proc = _processor_or_skip("qwen2-vl")
    row = next(r for r in rows if r["images"] and not _has_image_url(r))
    imgs = [fp.load(b) for b in row["images"]]
    try:
        out = proc.apply_chat_template([row["messages"]], images=[imgs], tokenize=True, return_dict=True)
    except TypeError as e:   # 4.57 - 5.19: "got multiple values for keyword argument 'images'"
        pytest.skip(f"this transformers' apply_chat_template cannot take images=: {e}")
    assert len(out["input_ids"][0]) == dataset_lengths([row], proc)[0] == fp.oracle(proc, row)


# -- resolution ------------------------------------------------------------------------------------


def test_a_processor_written_around_a_known_image_processor_resolves_by_it():
    import transformers

    from tokenbal.estimate.vision import processor_family

    qwen = fp.processor("qwen2-vl")

    class Scratch(transformers.ProcessorMixin):   # not a subclass of any known processor
        attributes = []

        def __init__(self):   # noqa: D107 - nothing of ProcessorMixin's own init is needed here
            pass

    scratch = Scratch()
    scratch.image_processor = qwen.image_processor
    assert processor_family(scratch) == "qwen2-vl"


def test_an_unknown_processor_is_named_with_the_supported_ones():
    import transformers

    from tokenbal.estimate.vision import estimator_from_processor

    class OwnImages:
        def to_dict(self):
            return {}

    class Unknown(transformers.ProcessorMixin):
        attributes = []

        def __init__(self):   # noqa: D107
            pass

    proc = Unknown()
    proc.image_processor = OwnImages()
    with pytest.raises(ValueError, match=r"processor Unknown \(transformers bases: ProcessorMixin.*"
                                         r"image processor: OwnImages.*Qwen2VLProcessor"):
        estimator_from_processor(proc)


@pytest.mark.parametrize("family", [f for f in fp.FAMILIES if f != "phi-4-multimodal"])
def test_an_image_processor_that_does_not_resize_is_refused_not_miscounted(family, rows, tmp_path):
    # do_resize=False keeps each image at its own size (a Qwen2-VL 644x476 image is 391 tokens there, not
    # the 40 of the resized one): no estimator models it, so every entry point refuses it by name.
    from tokenbal.estimate import estimator_from_processor, load_estimator

    proc = _processor_or_skip(family, subclass=False)
    proc.image_processor.do_resize = False
    with pytest.raises(ValueError, match=r"do_resize=False is not modelled"):
        estimator_from_processor(proc)
    with pytest.raises(ValueError, match=r"do_resize=False is not modelled"):
        dataset_lengths(rows[:1], proc)
    folder = fp.save_folder(proc, family, tmp_path / family)
    with pytest.raises(ValueError, match=rf"{tmp_path}.*do_resize=False is not modelled"):
        load_estimator(folder)


# -- row shapes and errors ---------------------------------------------------------------------------


def test_string_messages_and_bad_turns_name_the_row(rows):
    proc = _processor_or_skip("qwen2-vl", subclass=False)
    bad = [rows[0], {"messages": "USER: hello", "images": []}]
    with pytest.raises(ValueError, match=r"row 1: 'messages' is a string \('USER: hello'\)"):
        dataset_lengths(bad, proc)
    with pytest.raises(ValueError, match=r"row 0: messages\[0\] is str"):
        dataset_lengths([{"messages": ["hi"], "images": []}], proc)
    ds = datasets.Dataset.from_list([{"messages": "a"}, {"messages": "USER: b"}])
    with pytest.raises(ValueError, match=r"row 0: 'messages' is a string"):
        dataset_lengths(ds, proc, cache=False)


@pytest.mark.parametrize("family", ["qwen2-vl", "llava-next"])
def test_base64_and_data_uri_image_parts_count_as_the_processor_loads_them(family, tmp_path):
    # transformers' load_image takes a string that is no file as base64 (a data: URI's payload), and
    # the chat template's image parts pass "base64" / "image" strings to it.
    import base64

    proc = _processor_or_skip(family, subclass=False)
    data = fp.image_bytes(301, 207, "png", seed=3)
    b64 = base64.b64encode(data).decode()
    parts = [{"type": "image", "base64": b64}, {"type": "image", "image": f"data:image/png;base64,{b64}"},
             {"type": "image", "image": b64}]
    for part in parts:
        row = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]}
        want = len(proc.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"][0])
        assert dataset_lengths([row], proc, cache=False).tolist() == [want]
    missing = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")},
                                                        {"type": "text", "text": "x"}]}]}
    with pytest.raises(ValueError, match=r"row 0: image .*a\.png' is no image file \(no such file\) and no "
                                         r"base64 image data"):
        dataset_lengths([missing], proc, cache=False)


def test_images_column_forms(rows, tmp_path):
    """One row's images as bytes, PIL (its size as given), paths, {bytes, path} dicts."""
    from PIL import Image

    proc = _processor_or_skip("llava-next", subclass=False)
    row = next(r for r in rows if len(r["images"]) >= 2)
    want = fp.oracle(proc, row)
    paths = []
    for j, b in enumerate(row["images"]):
        (tmp_path / f"{j}.img").write_bytes(b)
        paths.append(str(tmp_path / f"{j}.img"))
    forms = [paths, [{"bytes": b, "path": None} for b in row["images"]],
             [{"bytes": None, "path": p} for p in paths], [fp.load(b) for b in row["images"]]]
    for images in forms:
        assert dataset_lengths([{"messages": row["messages"], "images": images}], proc)[0] == want
    assert isinstance(forms[-1][0], Image.Image)


# -- truth over caching -----------------------------------------------------------------------------


def test_a_changed_image_file_is_recounted(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path / "cache"))
    proc = _processor_or_skip("qwen2-vl", subclass=False)
    path = tmp_path / "a.png"
    path.write_bytes(fp.image_bytes(40, 40, "PNG", 1))
    msgs = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "hi"}]}]
    ds = datasets.Dataset.from_list([{"messages": msgs, "images": [str(path)]}])
    first = dataset_lengths(ds, proc)
    path.write_bytes(fp.image_bytes(300, 200, "PNG", 1))   # the same path, another image
    second = dataset_lengths(ds, proc)
    assert second[0] == fp.oracle(proc, {"messages": msgs, "images": [str(path)]}) > first[0]


def test_a_transform_is_counted_through(rows, tmp_path, monkeypatch):
    """``with_transform`` adding a system turn: the counts are those of the rows the Trainer loads."""
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = _processor_or_skip("qwen2-vl", subclass=False)
    base = [{"messages": _json_messages(r["messages"]), "images": r["images"]} for r in rows[:30]
            if r["shape"] in ("column", "string")]
    ds = datasets.Dataset.from_list(base)

    def add_system(batch):
        sys = {"role": "system", "content": [{"type": "text", "text": "be brief and exact", "image": None}]}
        return {"messages": [[sys] + list(m) for m in batch["messages"]], "images": batch["images"]}

    plain = dataset_lengths(ds, proc)
    transformed = ds.with_transform(add_system)
    got = dataset_lengths(transformed, proc)
    want = [fp.oracle(proc, transformed[i]) for i in range(len(ds))]
    np.testing.assert_array_equal(got, want)
    assert (got > plain).all()
    tokenized = ds.with_transform(lambda b: {"input_ids": [[1, 2]] * len(b["messages"])})
    with pytest.raises(ValueError, match=r"transform \('<lambda>'\) returns the columns \['input_ids'\], "
                                         r"without 'messages'"):
        dataset_lengths(tokenized, proc)


# -- the length column ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), 1e30, 2.0**63, -3, 2.5])
def test_length_column_is_checked_before_the_cast(value):
    from tokenbal.integrations.hf_lengths import lengths_column

    ds = datasets.Dataset.from_dict({"length": [5.0, 7.0, value, 9.0]})
    with pytest.raises((ValueError, TypeError), match=r"dataset column 'length'.*sample 2"):
        lengths_column(ds)
    import pyarrow as pa

    big = datasets.Dataset(pa.table({"length": pa.array([1, 2**63 + 5], pa.uint64())}))
    with pytest.raises(ValueError, match=r"dataset column 'length' must fit in int64.*sample 1"):
        lengths_column(big)
    assert lengths_column(datasets.Dataset.from_dict({"length": [5.0, 7.0]})).tolist() == [5, 7]


# -- the packed Trainer's per-row processing --------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2-vl", "llava-next", "internvl", "glm-4.1v"])
def test_process_row_matches_the_count_with_exif_images(family, tmp_path):
    """``process_row`` (the packed Trainer's collator) runs on every transformers (public calls only)
    and reads path / ``Image(decode=False)`` images EXIF-transposed, as counted."""
    from tokenbal.integrations.trainer_support import PackedTrainCollator, process_row

    proc = _processor_or_skip(family, subclass=False)
    for rotated in (fp.exif_jpeg(60, 200, 6), fp.xmp_jpeg(60, 200, 8)):   # stored 60x200, shown 200x60
        _process_row_case(proc, rotated, tmp_path, PackedTrainCollator, process_row)


def _process_row_case(proc, rotated: bytes, tmp_path, PackedTrainCollator, process_row) -> None:
    from PIL import Image

    assert fp.load(rotated).size == (200, 60) and Image.open(io.BytesIO(rotated)).size == (60, 200)
    path = tmp_path / "r.jpg"
    path.write_bytes(rotated)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]
    for images in ([str(path)], [{"bytes": rotated, "path": None}], [{"bytes": None, "path": str(path)}]):
        row = {"messages": msgs, "images": images}
        sample = process_row(row, proc)
        n = dataset_lengths([row], proc)[0]
        assert len(sample["input_ids"]) == n == fp.oracle(proc, row)
        upright = proc.image_processor(images=[fp.load(rotated)], return_tensors="pt")
        key = "pixel_values"
        assert tuple(sample[key].shape) == tuple(upright[key].shape)
        np.testing.assert_allclose(np.asarray(sample[key]), np.asarray(upright[key]))
        if "image_sizes" in upright:   # LLaVA-NeXT / OneVision: the collator needs them with the crops
            assert np.asarray(sample["image_sizes"]).tolist() == np.asarray(upright["image_sizes"]).tolist()
    inline = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                        {"type": "text", "text": "and this"}]}], "images": []}
    assert len(process_row(inline, proc)["input_ids"]) == dataset_lengths([inline], proc)[0]
    collate = PackedTrainCollator(lambda samples: {"n": [len(s["input_ids"]) for s in samples]},
                                  np.array([n, dataset_lengths([inline], proc)[0]]), None, proc)
    out = collate([{**row, "_tokenbal_index": 0}, {**inline, "_tokenbal_index": 1}])
    assert out["n"] == [n, dataset_lengths([inline], proc)[0]] and collate.mismatched == 0


def test_a_video_row_is_refused_naming_it():
    """A video row whose file cannot be read is named with the file (video rows are counted from
    their headers: tests/tokenbal/integrations/test_lengths_videos.py), not counted as one token."""
    proc = _processor_or_skip("qwen2-vl", subclass=False)
    text_part = "{% elif c['type'] == 'text' %}"
    video_part = "{% elif c['type'] == 'video' %}" + proc.video_token
    proc.chat_template = proc.chat_template.replace(text_part, video_part + text_part)
    rows = [{"messages": [{"role": "user", "content": "hi"}], "images": []},
            {"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}], "images": []}]
    with pytest.raises(ValueError, match=r"row 1: video messages video part\[0\] \('a.mp4'\): "):
        dataset_lengths(rows, proc)


_COUNTERS: dict = {}


def _counter(family: str):
    from tokenbal.estimate.chat import ChatTokenCounter

    if family not in _COUNTERS:
        _COUNTERS[family] = ChatTokenCounter.from_processor(_processor_or_skip(family, subclass=False))
    return _COUNTERS[family]


@pytest.mark.parametrize("family", ["idefics3", "internvl", "llava-onevision", "glm-4.1v"])
def test_expansion_shortcut_equals_expanded_text(family):
    """Counting each placeholder once plus its expansion's tokens equals tokenizing the expanded text
    (the tile layouts with newlines included), for random texts around random images."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.helpers.chat_processors import WORDS

    counter = _counter(family)

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.sampled_from(WORDS + ["\n", "\n\n", " ", "<|im_end|>"]), min_size=1, max_size=10),
           st.lists(st.tuples(st.integers(30, 900), st.integers(30, 900)), max_size=3))
    def check(words, sizes):
        parts = [{"type": "text", "text": "".join(words)}] + [{"type": "image"} for _ in sizes]
        conv = [{"role": "user", "content": parts}]
        cp.assert_counts_without_expansion_equal_expanded(counter, conv, sizes)

    check()


def test_onevision_at_its_checkpoint_settings():
    """SigLIP-384 with 14-px patches: 27 x 27 = 729 tokens a view (384 is no multiple of 27)."""
    proc = fp._build(fp.processor_class("llava-onevision"),
                     image_processor=fp._pil("LlavaOnevisionImageProcessor")(
                         size={"height": 384, "width": 384},
                         image_grid_pinpoints=[[384 * i, 384 * j] for i in range(1, 4) for j in range(1, 4)]),
                     tokenizer=fp.tokenizer(), chat_template=fp.template("llava-onevision"),
                     video_processor=None, num_image_tokens=729, vision_feature_select_strategy="full")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}]
    rows = [{"messages": msgs, "images": [fp.image_bytes(w, h, "PNG", 0)]}
            for w, h in [(500, 300), (90, 700)]]
    rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                 "images": [fp.image_bytes(400, 400, "PNG", 1), fp.image_bytes(100, 60, "PNG", 2)]})
    np.testing.assert_array_equal(dataset_lengths(rows, proc), [fp.oracle(proc, r) for r in rows])


# -- a user's subclass that changes what the processor emits ----------------------------------------


def _subclassed(family: str, methods: dict, image_methods: dict | None = None):
    """The family's real processor as an instance of a user's subclass defining ``methods`` (and its
    image processor one of a subclass defining ``image_methods``)."""
    proc = fp.processor(family)
    proc.__class__ = type("MyProcessor", (type(proc),), methods)
    if image_methods:
        ip = proc.image_processor
        ip.__class__ = type("MyImageProcessor", (type(ip),), image_methods)
    return proc


def _call_adding_two_tokens_per_image_row(self, *args, **kwargs):
    # e.g. a subclass appending an end-of-image marker pair to rows with images
    out = type(self).__mro__[1].__call__(self, *args, **kwargs)
    if kwargs.get("images") is not None:
        out["input_ids"] = [list(ids) + [0, 0] for ids in out["input_ids"]]
    return out


def _call_unchanged(self, *args, **kwargs):   # e.g. a subclass that only logs its calls
    return type(self).__mro__[1].__call__(self, *args, **kwargs)


def _preprocess_half_size(self, images, *args, **kwargs):
    # e.g. a subclass that downsizes images before the base class's resize
    def half(image):
        if isinstance(image, (list, tuple)):
            return [half(x) for x in image]
        return image.resize((max(1, image.size[0] // 2), max(1, image.size[1] // 2)))

    return type(self).__mro__[1].preprocess(self, half(images), *args, **kwargs)


def test_a_subclass_overriding_what_the_processor_emits_is_not_trusted_silently(rows, tmp_path, monkeypatch,
                                                                                 caplog):
    """dataset_lengths counts by the rules of the processor's transformers base class. A user's
    subclass whose methods change the token counts (its __call__ adds tokens; its image processor
    resizes first) raises naming the row and the overriding methods (before: 18 of 30 and 11 of 30
    rows silently wrong); one whose override changes nothing counts as before, with a warning that
    names the override and the rows checked against the processor itself."""
    import logging

    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    plain = [r for r in rows if not _has_image_url(r)][:30]
    as_dataset = datasets.Dataset.from_list([{"messages": r["messages"], "images": r["images"]}
                                             for r in plain if r["shape"] == "column"])
    adding = _subclassed("qwen2-vl", {"__call__": _call_adding_two_tokens_per_image_row})
    for data in (plain, as_dataset):
        with pytest.raises(ValueError, match=r"row \d+: MyProcessor gives \d+ tokens.*overrides "
                                             r"MyProcessor.__call__"):
            dataset_lengths(data, adding, cache=False)
    halving = _subclassed("qwen2-vl", {}, {"preprocess": _preprocess_half_size})
    with pytest.raises(ValueError, match=r"overrides MyImageProcessor.preprocess"):
        dataset_lengths(plain, halving)
    logging_only = _subclassed("qwen2-vl", {"__call__": _call_unchanged})
    with caplog.at_level(logging.WARNING, logger="tokenbal"):
        got = dataset_lengths(plain, logging_only)
    np.testing.assert_array_equal(got, [fp.oracle(logging_only, r) for r in plain])
    assert "overrides MyProcessor.__call__" in caplog.text and "checked" in caplog.text


def _array_rows() -> list[tuple[str, dict]]:
    """Rows whose images are numpy arrays / torch tensors, as a user's own loader (or a torchvision
    transform) leaves them: HWC and CHW, uint8 and float, one-channel, channels-first and -last in
    one row, after a PIL image, and the ambiguous (3, H, 3)."""
    import torch
    from PIL import Image

    rng = np.random.default_rng(5)
    u8 = lambda *shape: rng.integers(0, 256, shape, dtype=np.uint8)   # noqa: E731
    kinds = {
        "HWC uint8": [u8(90, 200, 3)], "CHW uint8": [u8(3, 90, 200)],
        "HWC float32": [rng.random((90, 200, 3), dtype=np.float32)],
        "CHW float64": [rng.random((3, 300, 50))],
        "HW1 uint8": [u8(90, 200, 1)], "1HW uint8": [u8(1, 90, 200)], "HWC RGBA": [u8(120, 40, 4)],
        "torch CHW float": [torch.rand(3, 90, 200)], "torch HWC uint8": [torch.randint(0, 256, (64, 250, 3),
                                                                                      dtype=torch.uint8)],
        "CHW then HWC": [u8(3, 90, 200), u8(300, 50, 3)], "PIL then CHW": [Image.new("RGB", (50, 300)),
                                                                             u8(3, 90, 200)],
        "ambiguous 3xHx3": [u8(3, 90, 3)],
    }
    return [(name, {"messages": [{"role": "user", "content": [{"type": "image"}] * len(images)
                                  + [{"type": "text", "text": "what is it"}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}],
                    "images": images}) for name, images in kinds.items()]


@pytest.mark.parametrize("family", fp.FAMILIES)
def test_array_images_count_what_process_row_gives(family):
    """``process_row`` (the packed Trainer) hands numpy arrays and torch tensors to the processor,
    which takes them; ``dataset_lengths`` refused every such row ('is a ndarray, not a PIL image,
    {bytes, path} dict, path or bytes'). Now each counts what the processor gives, the height and
    width read by the installed transformers' channel rule; a 2-D (grayscale) array, which these
    processors refuse ('Unsupported number of image dimensions: 2'), is refused by both."""
    from tokenbal.integrations.trainer_support import process_row

    proc = _processor_or_skip(family, subclass=False)
    want, taken = {}, []
    for name, row in _array_rows():
        try:
            want[name] = len(process_row(row, proc)["input_ids"])
            taken.append((name, row))
        except (ValueError, TypeError):   # 4.57 refuses some (one channel: "mean must have 1 elements")
            with pytest.raises(ValueError, match=r"row 0: image "):
                dataset_lengths([row], proc)
    assert len(taken) >= 6, sorted(want)
    got = dataset_lengths([row for _, row in taken], proc)
    assert dict(zip([n for n, _ in taken], got.tolist(), strict=True)) == want
    flat = {**taken[0][1], "images": [np.zeros((90, 200), np.uint8)]}
    with pytest.raises(ValueError):   # 5.x: 'Unsupported number of image dimensions: 2'
        process_row(flat, proc)
    with pytest.raises(ValueError, match=r"row 1: image images\[0\]: (is a ndarray of shape \(90, 200\) and "
                                         r"dtype uint8, which \w+ refuses \(ValueError: |Unsupported)"):
        dataset_lengths([taken[0][1], flat], proc)
