"""``tokenbal index build --processor DIR`` with a Phi-4-multimodal processor folder, and records
with audio (refused, naming the record, in every build and in ``dataset_lengths``).

Here (CI: no torchvision, so Phi-4's image processor does not load): the folder is what
``Phi4MultimodalProcessor.save_pretrained`` writes on transformers 5.x (``processor_config.json``
with the image processor and the real audio feature extractor nested, tokenizer files naming
``<|image|>`` / ``<|audio|>``, ``chat_template.jinja``), with the image processor's settings from
``family_processors.StandInPhi4ImageProcessor`` (the real class's defaults); the build reads it from
its files and counts as ``dataset_lengths`` does under the processor (itself checked against counts
the real processor gave, ``tests/tokenbal/integrations/test_lengths_phi4.py``).
``test_real_phi4_processor_index_build`` (marker ``compat``) runs the build against the real
processor saved with its own ``save_pretrained``, in the ``tf-X.Y-video`` side envs
(``tests/helpers/phi4_index_oracle_check.py``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from tests.helpers import family_processors as fp  # noqa: E402
from tests.helpers.phi4_index_oracle_check import audio_records, records_of  # noqa: E402
from tokenbal import TokenIndex  # noqa: E402
from tokenbal.cli import main  # noqa: E402
from tokenbal.index import build_index  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _proc(subclass: bool = False, **settings):
    try:
        return fp.phi4_processor(real=False, subclass=subclass, **settings)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"Phi-4-multimodal's processor cannot be built with this transformers: {e}")


def save_phi4_folder(proc, folder):
    """The files ``save_pretrained`` writes for ``proc`` on transformers 5.x (its image processor,
    a stand-in here, cannot save itself): the processor class it names (a subclass names its own)."""
    folder.mkdir(parents=True, exist_ok=True)
    proc.tokenizer.save_pretrained(str(folder))
    image = {**proc.image_processor.to_dict(), "image_processor_type": "Phi4MultimodalImageProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_processor": image, "audio_processor": proc.audio_processor.to_dict(),
         "processor_class": type(proc).__name__}))
    (folder / "chat_template.jinja").write_text(proc.chat_template)
    return folder


def _row(*sizes, text="look"):
    parts = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}],
            "images": [fp.image_bytes(w, h, "PNG", 1) for w, h in sizes], "shape": "column"}


@pytest.mark.parametrize("subclass", [False, True])
def test_a_phi4_folder_indexes_as_dataset_lengths_counts(subclass, tmp_path, monkeypatch):
    """JSONL records of every row shape and tar samples: the index's lengths equal
    ``dataset_lengths`` under the processor; a 300x200 image is the real processor's 460 tokens
    (``dynamic_hd`` 4); a user's subclass saved under its own class name resolves by its image
    processor; records with audio are errors naming the record."""
    from tests.helpers.corpus import write_shard

    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = _proc(subclass=subclass, dynamic_hd=4)
    folder = save_phi4_folder(proc, tmp_path / "proc")
    saved = json.loads((folder / "processor_config.json").read_text())
    assert saved["processor_class"] == type(proc).__name__
    raw = [_row((300, 200))] + fp.random_rows(24, seed=5)
    rows = fp.materialise(raw, tmp_path)
    records, samples = records_of(rows, tmp_path)
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records + audio_records()))
    shard = write_shard(tmp_path / "train-000.tar", [s for _, s in samples])
    out = tmp_path / "idx"
    assert main(["index", "build", str(src), shard, "--processor", str(folder), "--out", str(out), "-q"]) == 0
    idx = TokenIndex.open(tmp_path / "idx")
    got = dict(zip(idx.keys, idx.lengths.tolist(), strict=True))
    want = {r["id"]: int(n) for r, n in zip(records, dataset_lengths(rows, proc), strict=True)}
    want.update({s.key: want[f"r{i}"] for i, s in samples})
    assert got == want and len(samples) >= 3 and {row["shape"] for row in rows} == set(fp.SHAPES)
    assert int(idx.vision_tokens[idx.keys.index("r0")]) == 460   # the real processor's run (5.25)
    errors = {e["key"]: e["reason"] for e in idx.errors}
    assert set(errors) == {"audios_field", "audio_part"}
    assert "1 audio(s) in its 'audios' field" in errors["audios_field"]
    assert "train.jsonl:" in errors["audios_field"]
    assert "1 audio part(s)" in errors["audio_part"]


def test_records_with_audio_are_errors_in_every_build(tmp_path):
    """Without a processor too (the text counted plain would miss the clip): JSONL records with an
    ``audios`` / ``audio`` field or audio parts, a tar sample whose JSON has an ``audios`` field, a
    Parquet row with an ``audios`` value: each an error naming it; empty / null / false are fine."""
    from tests.helpers.corpus import Sample, write_shard

    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    records = [{"id": "plain", "messages": msgs},
               {"id": "empty", "messages": msgs, "audios": [], "audio": False},
               {"id": "field", "messages": msgs, "audios": ["a.wav", "b.wav"]},
               {"id": "one", "messages": msgs, "audio": "a.wav"},
               {"id": "part", "messages": [{"role": "user", "content": [
                   {"type": "input_audio", "input_audio": {}}, {"type": "text", "text": "hi"}]}]}]
    src = tmp_path / "a.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records))
    tar_json = json.dumps({"messages": msgs, "audios": ["a.wav"]}).encode()
    shard = write_shard(tmp_path / "a-000.tar", [Sample(key="ok", messages=msgs),
                                                 Sample(key="heard", raw=[("json", tar_json)])])
    sources = [str(src), shard]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"messages": [msgs, msgs], "audios": [[], ["c.wav"]]})
    pq.write_table(table, str(tmp_path / "a.parquet"))
    sources.append(str(tmp_path / "a.parquet"))
    report = build_index(sources, tmp_path / "idx", progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    errors = {e["key"]: e["reason"] for e in idx.errors}
    assert sorted(idx.keys) == ["a.parquet:0:0", "empty", "ok", "plain"] and report.num_bad_samples == 5
    assert "2 audio(s) in its 'audios' field" in errors["field"] and "a.jsonl:3" in errors["field"]
    assert "1 audio(s) in its 'audio' field" in errors["one"]
    assert "1 audio part(s)" in errors["part"]
    assert "member 'heard.json'" in errors["heard"] and "audio(s) in its 'audios' field" in errors["heard"]
    assert "row group 0 row 1" in errors["a.parquet:0:1"] and "'audios' column" in errors["a.parquet:0:1"]


def test_dataset_lengths_refuses_rows_with_audios(tmp_path, monkeypatch):
    """An ``audios`` column (LLaMA-Factory's layout) is looked at: a row with audio raises naming
    the row and the column, for row dicts and for a ``datasets.Dataset`` (any processor: tokenbal
    counts no audio); empty / null values are counted as the rows they are."""
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = fp.processor("qwen2-vl")
    rows = [{**_row((40, 30)), "audios": []}, {**_row(), "audios": None},
            {**_row(), "audios": [{"path": "a.wav"}]}]
    for r in rows:
        r.pop("shape")
    want = dataset_lengths(rows[:2], proc)
    with pytest.raises(ValueError, match=r"^row 2: has 1 audio\(s\) in column 'audios'; tokenbal counts"):
        dataset_lengths(rows, proc)
    np.testing.assert_array_equal(dataset_lengths(rows, proc, audios=None), [*want, want[1]])
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{**r, "audios": [a["path"] for a in r["audios"] or []]} for r in rows])
    with pytest.raises(ValueError, match=r"^row 2: has 1 audio\(s\) in column 'audios'"):
        dataset_lengths(ds, proc)
    np.testing.assert_array_equal(dataset_lengths(ds.select([0, 1]), proc), want)
    late = ds.select([1] * 1203 + [2])   # past the first batch of rows checked
    with pytest.raises(ValueError, match=r"^row 1203: has 1 audio\(s\)"):
        dataset_lengths(late, proc)
    phi4 = _proc(dynamic_hd=4)
    with pytest.raises(ValueError, match=r"^row 2: has 1 audio\(s\) in column 'audios'"):
        dataset_lengths(ds, phi4, num_proc=2)


def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_real_phi4_processor_index_build(env):
    """Against the real processor (torchvision) in each ``tf-X.Y-video`` side env: 3 settings
    (``dynamic_hd`` 4 / 12 / the hub's 36; the class and a user's subclass), each saved with its own
    ``save_pretrained`` and indexed from that folder by two scan workers; 70 random rows of 0-3
    images (8-2,000 px, extreme aspect ratios, EXIF-rotated JPEGs), every row shape, as JSONL records
    and tar samples: the index's length is the processor's ``input_ids`` length on every record, the
    records it rejects are errors, and the two audio records are errors naming them."""
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.phi4_index_oracle_check", "70", "60")
    assert len(results) == 3 and sum(r["records"] for r in results) >= 200
    for r in results:
        assert r["n_wrong"] == 0 and r["agree"] >= 60 and r["audio_errors"] == 2, r
        assert r["images_per_row"] == [0, 1, 2, 3] and r["shapes"] == sorted(fp.SHAPES), r
        assert r["tar_samples"] > 0 and r["exif_rows"] > 0, r
    assert {r["saved_as"] for r in results} == {"Phi4MultimodalProcessor", "MyPhi4MultimodalProcessor"}
