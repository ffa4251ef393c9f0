"""``tokenbal index build --processor DIR``: the index's lengths equal the processor's own
``apply_chat_template`` counts (chat template included) for JSONL and Parquet rows with messages;
``--model DIR`` takes the estimator from the folder; records the processor rejects are errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

from tests.helpers import chat_processors as cp  # noqa: E402
from tokenbal import TokenIndex  # noqa: E402
from tokenbal.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("proc")
    proc = cp.processor(cp.QWEN2_VL)
    return proc, cp.save_folder(proc, d / "qwen")


def _jsonl_records(rows, folder):
    """Qwen-VL style records: the image paths inside the messages' image parts."""
    out = []
    for i, row in enumerate(rows):
        files = []
        for j, b in enumerate(row["images"]):
            f = folder / f"{i}_{j}.png"
            f.write_bytes(b)
            files.append(str(f))
        it = iter(files)

        def part(c, it=it):
            return ({"type": "image", "image": next(it)} if c["type"] == "image"
                    else {"type": "text", "text": c["text"]})

        msgs = [{"role": m["role"], "content": [part(c) for c in m["content"]]} for m in row["messages"]]
        out.append({"messages": msgs})
    return out


def test_jsonl_lengths_equal_processor(setup, tmp_path):
    proc, folder = setup
    records = _jsonl_records(cp.chat_rows(40, seed=11), tmp_path)
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records))
    assert main(["index", "build", str(src), "--processor", str(folder), "--out", str(tmp_path / "idx"),
                 "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "idx")
    want = [len(proc.apply_chat_template([r["messages"]], tokenize=True, return_dict=True)["input_ids"][0])
            for r in records]
    np.testing.assert_array_equal(idx.lengths, want)
    # vision = placeholders + wrappers of each image, text = the template and the words
    assert (idx.text_tokens > 0).all() and idx.vision_tokens.sum() > 0
    assert idx.manifest["text_counter"]["processor"] == str(folder)
    # without the processor the same index is short by the template's tokens (the bug)
    assert main(["index", "build", str(src), "--model", str(folder), "--tokenizer", str(folder),
                 "--out", str(tmp_path / "plain"), "-q"]) == 0
    plain = TokenIndex.open(tmp_path / "plain")
    np.testing.assert_array_equal(plain.vision_tokens, idx.vision_tokens)   # --model DIR: same estimator
    assert (plain.lengths < idx.lengths).all()


def test_parquet_lengths_equal_processor(setup, tmp_path):
    import datasets

    proc, folder = setup
    rows = cp.chat_rows(40, seed=12)
    ds = cp.hf_dataset(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    assert main(["index", "build", str(tmp_path / "train.parquet"), "--processor", str(folder),
                 "--out", str(tmp_path / "idx"), "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "idx")
    want = [cp.oracle_length(proc, ds[i]) for i in range(len(ds))]
    np.testing.assert_array_equal(idx.lengths, want)
    # and the same numbers as dataset_lengths on the datasets.Dataset
    from tokenbal.integrations.hf import dataset_lengths

    reread = datasets.Dataset.from_parquet(str(tmp_path / "train.parquet"))
    np.testing.assert_array_equal(dataset_lengths(reread, proc, cache=False), want)


def test_llava_conversations_and_rejected_records(setup, tmp_path):
    proc, folder = setup
    img = tmp_path / "a.png"
    img.write_bytes(cp.image_bytes(300, 200))
    records = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                             {"from": "gpt", "value": "A square."}]},
        {"conversations": [{"from": "human", "value": "text only"}, {"from": "gpt", "value": "yes"}]},
        # two image parts, one image: the processor raises on it, so it is an error, not a count
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "image"}]}]},
    ]
    src = tmp_path / "llava.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records))
    assert main(["index", "build", str(src), "--processor", str(folder), "--out", str(tmp_path / "idx"),
                 "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "idx")
    from PIL import Image

    from tokenbal.index.text import chat_messages

    def oracle(r):
        return cp.oracle_length(proc, {"messages": chat_messages(r),
                                       "images": [Image.open(img)] if "image" in r else []})

    want = [oracle(r) for r in records[:2]]
    np.testing.assert_array_equal(idx.lengths, want)
    assert len(idx.errors) == 1 and "image placeholder" in idx.errors[0]["reason"]
    assert idx.errors[0]["key"] == "llava.jsonl:3"
    with pytest.raises(ValueError, match="not both"):
        from tokenbal.index import build_index

        build_index([str(src)], tmp_path / "x", processor=folder, tokenizer=str(folder), progress=False)


def test_load_estimator_reads_a_processor_folder(setup):
    from tokenbal.estimate import estimator_from_processor, load_estimator

    proc, folder = setup
    keys = ("estimator", "min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size")
    # image settings only: this processor has no video processor, the folder's videos read
    # preprocessor_config.json (transformers' lookup order)
    assert {k: load_estimator(folder).config[k] for k in keys} == {
        k: estimator_from_processor(proc).config[k] for k in keys}


def test_tar_json_messages_through_the_template(setup, tmp_path):
    """webdataset samples: a .json member with messages (image parts without paths) + image members."""
    import io
    import tarfile

    from PIL import Image

    proc, folder = setup
    rows = cp.chat_rows(12, seed=13)
    shard = tmp_path / "data-000.tar"
    with tarfile.open(shard, "w") as tar:
        for i, row in enumerate(rows):
            members = [(f"{i:04d}.json", json.dumps({"messages": row["messages"]}).encode())]
            members += [(f"{i:04d}.{j}.png", b) for j, b in enumerate(row["images"])]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert main(["index", "build", str(shard), "--processor", str(folder), "--out", str(tmp_path / "idx"),
                 "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "idx")
    want = [cp.oracle_length(proc, {"messages": r["messages"],
                                    "images": [Image.open(io.BytesIO(b)) for b in r["images"]]})
            for r in rows]
    np.testing.assert_array_equal(idx.lengths, want)


def test_verify_names_the_processor_file_that_changed(setup, tmp_path, capsys):
    """Issue 51 part 6: the counts depend on the --processor folder's chat template and settings;
    `verify` records and checks them (it said "up to date" after the template changed)."""
    import shutil

    _, folder = setup
    mine = shutil.copytree(folder, tmp_path / "proc")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"hello {i}"}]})
                              for i in range(3)) + "\n")
    out = str(tmp_path / "idx")
    assert main(["index", "build", str(rows), "--processor", str(mine), "--out", out, "-q"]) == 0
    assert main(["index", "verify", out]) == 0
    assert "index is up to date" in capsys.readouterr().out
    template = mine / "chat_template.jinja"
    template.write_text(template.read_text() + "{{ '\\n' }}")
    (mine / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert main(["index", "verify", out]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"processor changed: {mine} (chat_template.jinja changed, chat_template.json added "
                     "since the build; the text counts depend on its chat template and settings): rebuild "
                     f"the index with --processor {mine}", "1 problem(s) found"]
    shutil.rmtree(mine)
    assert main(["index", "verify", out]) == 1
    assert f"processor folder missing: {mine}" in capsys.readouterr().out

# SmolVLM: test_a_tile_family_folder_whose_processor_does_not_load_is_refused (its folder loads only
# where its video processor's torchvision is installed)
FOLDER_FAMILIES = ["internvl", "idefics3", "glm-4.1v", "llava-onevision", "llava-next", "qwen3-vl", "llava"]


@pytest.mark.parametrize("family", FOLDER_FAMILIES)
def test_every_family_folder(family, tmp_path):
    """``--processor DIR`` of each family's processor folder: lengths equal that processor's, rows
    with 0-3 images (paths in the parts), string content and system turns."""
    from tests.helpers import family_processors as fp

    try:
        proc = fp.processor(family)
    except ImportError as e:
        pytest.skip(f"{family}'s processor cannot be built here: {str(e).strip().splitlines()[0]}")
    folder = fp.save_folder(proc, family, tmp_path / family)
    rows = fp.materialise(fp.random_rows(40, seed=5, shapes=("inline", "string")), tmp_path)
    keep, want = [], []
    for r in rows:
        try:
            want.append(fp.oracle(proc, r))
            keep.append({"messages": r["messages"]})
        except ValueError:   # 4.57's GLM rejects sides < 28 px; the index names those rows
            pass
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in keep))
    assert main(["index", "build", str(src), "--processor", str(folder), "--out", str(tmp_path / "idx"),
                 "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "idx")
    np.testing.assert_array_equal(idx.lengths, want)
    assert idx.vision_tokens.sum() > 0 and not idx.errors


def _handmade_tile_folder(family: str, folder):
    """An Idefics3 / SmolVLM processor folder written without its classes (which may not load here):
    tokenizer files, the image processor's and the processor's settings, the chat template."""
    from tests.helpers import family_processors as fp

    folder.mkdir(parents=True)
    fp.tokenizer().save_pretrained(str(folder))
    name = "Idefics3" if family == "idefics3" else "SmolVLM"
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": f"{name}ImageProcessor", "processor_class": f"{name}Processor",
        "do_image_splitting": True, "do_resize": True, "size": {"longest_edge": 128},
        "max_image_size": {"longest_edge": 32}}))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": f"{name}Processor",
                                                              "image_seq_len": 3}))
    (folder / "chat_template.jinja").write_text(fp.template(family))
    return folder


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_a_tile_family_folder_whose_processor_does_not_load_is_refused(family, tmp_path, capsys):
    """Idefics3 / SmolVLM are counted through their loaded processor. Where this transformers cannot
    load it (SmolVLM on 4.57: its module imports torchvision; 5.6 / 5.9: its image processor asks
    for torchvision; no num2words), ``--processor DIR`` is refused naming the version and the
    requirement; where it loads, the folder's lengths are the processor's."""
    from tests.helpers import family_processors as fp
    from tokenbal.estimate.chat import ChatTokenCounter
    from tokenbal.hf_compat import transformers_version

    folder = _handmade_tile_folder(family, tmp_path / family)
    rows = fp.materialise(fp.random_rows(20, seed=9, shapes=("inline", "string")), tmp_path)
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps({"messages": r["messages"]}) for r in rows))
    args = ["index", "build", str(src), "--processor", str(folder), "--out", str(tmp_path / "idx"), "-q"]
    try:
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - ImportError on 4.57, "Unrecognized image processor" on 5.6 / 5.9
        message = rf"{family} processor does not load with transformers {transformers_version()} here"
        requirement = r" \(.*\); missing here: .*(torchvision|num2words)"
        with pytest.raises(ValueError, match=message + requirement):
            ChatTokenCounter.from_pretrained(folder)
        assert main(args) != 0
        assert f"does not load with transformers {transformers_version()}" in capsys.readouterr().err
        return
    if family == "smolvlm" and getattr(proc, "video_processor", None) is None:   # see fp.processor
        import types

        proc.video_processor = types.SimpleNamespace(num_frames=64, fps=1)
    assert main(args) == 0
    want = [fp.oracle(proc, r) for r in rows]
    np.testing.assert_array_equal(TokenIndex.open(tmp_path / "idx").lengths, want)


def test_llava_1_5_folders_at_the_checkpoint_settings(tmp_path):
    """LLaVA-1.5 (336-px centre crop, CLIP patch 14, ``default`` strategy, one extra token: 576 per
    image): ``--processor DIR`` gives ``LlavaProcessor``'s own counts, ``--model DIR`` of a
    checkpoint folder (config.json + preprocessor_config.json) 576 vision tokens per image."""
    from tests.helpers import family_processors as fp

    proc = fp._build(fp.processor_class("llava"),
                     image_processor=fp._pil("CLIPImageProcessor")(size={"shortest_edge": 336},
                                                                   crop_size={"height": 336, "width": 336}),
                     tokenizer=fp.tokenizer(), chat_template=fp.template("llava"), patch_size=14,
                     vision_feature_select_strategy="default", num_additional_image_tokens=1)
    folder = fp.save_folder(proc, "llava", tmp_path / "llava")
    rows = fp.materialise(fp.random_rows(30, seed=15, shapes=("inline", "string")), tmp_path)
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps({"messages": r["messages"]}) for r in rows))
    out = str(tmp_path / "a")
    assert main(["index", "build", str(src), "--processor", str(folder), "--out", out, "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "a")
    np.testing.assert_array_equal(idx.lengths, [fp.oracle(proc, r) for r in rows])
    from tokenbal.estimate.chat import content_images

    n_images = np.array([len(content_images(r["messages"])) for r in rows])
    assert set(n_images) >= {0, 1, 2} and np.array_equal(idx.vision_tokens, 576 * n_images)
    # the checkpoint folder (no processor_config.json): the model's 576 per image
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llava", "vision_feature_select_strategy":
                                                  "default", "vision_config": {"patch_size": 14}}))
    proc.image_processor.save_pretrained(str(ckpt))
    from tokenbal.estimate import load_estimator

    est = load_estimator(ckpt)
    assert est.image_tokens(1000, 700) == est.image_tokens(50, 3000) == 576


def test_the_chat_template_count_reports_its_samples_in_chunks_with_the_same_counts(setup, tmp_path,
                                                                                     monkeypatch):
    """A processor's chat template over millions of rows ran minutes without a sign: the text is now
    counted PROGRESS_ROWS samples at a time (chats, then plain texts), each chunk reported; the counts
    and the errors are those of one batch."""
    import tokenbal.index.build as build_mod
    from tokenbal.index import build_index

    _, folder = setup
    img = tmp_path / "a.png"
    img.write_bytes(cp.image_bytes(300, 200))
    chats = _jsonl_records(cp.chat_rows(9, seed=13), tmp_path)
    # rejected by the processor: two image parts, one image
    chats.insert(4, {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                              {"type": "image"}]}]})
    plain = [{"text": f"caption number {i}"} for i in range(4)]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in chats + plain))
    whole = TokenIndex.open(build_index([str(src)], tmp_path / "whole", processor=str(folder),
                                        progress=False).out)
    monkeypatch.setattr(build_mod, "PROGRESS_ROWS", 3)
    reports = []
    chunked = TokenIndex.open(build_index([str(src)], tmp_path / "chunked", processor=str(folder),
                                          progress=lambda *r: reports.append(r)).out)
    np.testing.assert_array_equal(chunked.lengths, whole.lengths)
    np.testing.assert_array_equal(chunked.text_tokens, whole.text_tokens)
    assert chunked.errors == whole.errors and len(whole.errors) == 1 and len(whole.lengths) == 13
    counted = [(done, total) for _, done, total, unit in reports if unit == "samples"]
    # 9 chats (the rejected record never reaches the count), then 4 plain texts
    assert counted == [(3, 13), (6, 13), (9, 13), (12, 13), (13, 13)]
