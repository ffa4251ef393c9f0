"""``dataset_lengths`` under a real ``Phi4MultimodalProcessor`` (images; its audio is not counted).

Its image processor needs torchvision, which CI's venv lacks: here it is
``family_processors.StandInPhi4ImageProcessor`` (the real class's defaults, read off the class), so
these tests check the resolution (the class and a user's subclass), the ``<|image|>`` run the
processor writes, the refusals (audio, extreme aspect ratios, unmodelled crop sizes) and counts the
real processor gave in transformers 5.25 (measured in the ``tf-5.25-video`` env).
``test_real_phi4_processor`` (marker ``compat``) runs random rows against the real processor there
(``tests/helpers/phi4_oracle_check.py``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tests.helpers import family_processors as fp  # noqa: E402
from tokenbal.estimate.vision import processor_family  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

# (width, height, dynamic_hd) -> the real processor's <|image|> run (transformers 5.25, torchvision 0.29.1)
REAL_COUNTS = {(300, 200, 4): 460, (3000, 3000, 4): 1329, (448, 448, 4): 545, (12, 12, 4): 545}


def _proc(subclass: bool = False, **settings):
    try:
        return fp.phi4_processor(real=False, subclass=subclass, **settings)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"Phi-4-multimodal's processor cannot be built with this transformers: {e}")


def _row(*sizes, text="look", audio=False):
    parts = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": text}]
    if audio:
        parts.append({"type": "audio", "audio": "clip.wav"})
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}],
            "images": [fp.image_bytes(w, h, "PNG", 1) for w, h in sizes]}


def _text_tokens(proc, row, image_runs):
    text = proc.apply_chat_template([[dict(m) for m in row["messages"]]], tokenize=False)
    text = text[0] if isinstance(text, list) else text
    for n in image_runs:   # the processor's own replacement text for an image of n tokens
        try:
            run = proc.replace_image_token({"num_img_tokens": [n]}, 0)
        except (AttributeError, NotImplementedError):
            # 4.57-5.19's Phi-4 processor has none of its own: its __call__ writes the token n times
            run = proc.image_token * n
        text = text.replace(proc.image_token, run, 1)
    return len(proc.tokenizer([text])["input_ids"][0])


@pytest.mark.parametrize("subclass", [False, True])
def test_resolves_and_counts_the_real_processors_runs(subclass):
    proc = _proc(subclass=subclass, dynamic_hd=4)
    assert processor_family(proc) == "phi-4-multimodal"
    sizes = [(w, h) for (w, h, _) in REAL_COUNTS]
    rows = [_row(), _row(sizes[0]), _row(*sizes[1:3]), _row(*sizes[:3], text="three"), _row(sizes[3])]
    want = [_text_tokens(proc, r, [REAL_COUNTS[(w, h, 4)] for w, h in _sizes(r)]) for r in rows]
    assert list(dataset_lengths(rows, proc)) == want


def _sizes(row):
    from tokenbal.integrations.hf_lengths import _row_sizes

    return _row_sizes(row["images"], 0, "images")


def test_a_datasets_image_column_two_processes(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc = _proc(dynamic_hd=4)
    rows = [_row(), _row((300, 200)), _row((3000, 3000), (12, 12))] * 3
    ds = datasets.Dataset.from_list([{"messages": r["messages"], "images": r["images"]} for r in rows])
    ds = ds.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))
    assert list(dataset_lengths(ds, proc, num_proc=2)) == list(dataset_lengths(rows, proc))


def test_rows_with_audio_are_refused_naming_the_row():
    proc = _proc(dynamic_hd=4)
    refused = r"^row 1: has 1 audio part\(s\); tokenbal counts .*images but not its audio"
    with pytest.raises(ValueError, match=refused):
        dataset_lengths([_row((300, 200)), _row((300, 200), audio=True)], proc)
    typed = _row(text="listen <|audio|>")
    with pytest.raises(ValueError, match=r"^row 0: has the audio placeholder '<\|audio\|>'"):
        dataset_lengths([typed], proc)


def test_extreme_aspect_ratios_are_refused_as_the_processor_does():
    proc = _proc(dynamic_hd=4)
    with pytest.raises(ValueError, match=r"^row 2: image 1 \(5000x20\): .*rejects a side below 10 px"):
        dataset_lengths([_row(), _row((300, 200)), _row((300, 200), (5000, 20))], proc)


def test_unmodelled_crop_sizes_are_refused():
    proc = _proc(size={"height": 336, "width": 336})
    with pytest.raises(ValueError, match=r"Phi-4-multimodal image processor with size 336x336 .*modelled"):
        dataset_lengths([_row((300, 200))], proc)


def test_a_saved_folder_counts_without_torchvision(tmp_path):
    """The folder a Phi-4 checkpoint ships (its processor does not load without torchvision): read
    from its files, counted the same, audio rows refused."""
    from tokenbal.estimate.chat import ChatTokenCounter

    proc = _proc(dynamic_hd=4)
    proc.tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**proc.image_processor.to_dict(), "image_processor_type": "Phi4MultimodalImageProcessor",
         "processor_class": "Phi4MultimodalProcessor"}))
    (tmp_path / "chat_template.jinja").write_text(proc.chat_template)
    counter = ChatTokenCounter.from_pretrained(tmp_path)
    if counter.processor is None:   # read from the files (no torchvision here)
        assert counter.family == "phi-4-multimodal" and counter.estimator.dynamic_hd == 4
    rows = [_row(), _row((300, 200), (3000, 3000))]
    sizes = [_sizes(r) for r in rows]
    assert list(counter.count([r["messages"] for r in rows], sizes)) == list(dataset_lengths(rows, proc))
    with pytest.raises(ValueError, match=r"^row 0: has 1 audio part"):
        counter.count([_row(audio=True)["messages"]], [[]])


def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_real_phi4_processor(env):
    """Against the real processor (torchvision) in each ``tf-X.Y-video`` side env: 3 settings
    (``dynamic_hd`` 4 / 12 / the hub's 36; the class and a user's subclass) x 80 random rows of 0-3
    images, every row shape, sizes 8-2000 px and extreme aspect ratios: 0 wrong, rows the
    processor rejects rejected naming the row; the packed Trainer's ``process_row`` gives the counted
    length on 30 counted rows per setting."""
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.phi4_oracle_check", "80", "50")
    assert len(results) == 3 and sum(r["rows"] for r in results) >= 240
    for r in results:
        assert r["n_wrong"] == 0 and r["agree"] >= 60 and r["process_row"] == 30, r
        assert r["images_per_row"] == [0, 1, 2, 3] and len(r["shapes"]) == len(fp.SHAPES), r
    assert sum(r["rejected"] for r in results) >= 1   # extreme aspect ratios met
    assert {r["processor"] for r in results} == {"Phi4MultimodalProcessor", "MyPhi4MultimodalProcessor"}
