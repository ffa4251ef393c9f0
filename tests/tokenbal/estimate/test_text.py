"""Text counters: the exact counter equals the real ``tokenizers`` tokenizer; the heuristic is
deterministic, monotone in length and validates its input."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from tokenbal.estimate import (  # noqa: E402
    HeuristicTextCounter,
    TextTokenCounter,
    get_text_counter,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Token balancing keeps every rank equally busy during FSDP training.",
    "Dynamic resolution makes one sample sixty tokens and the next sixteen thousand.",
    "A picture is worth a thousand words, and sometimes sixteen thousand tokens.",
    "Packing samples back to back avoids padding and wasted compute.",
]

SAMPLES = [
    "",
    " ",
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Unseen words: zygote, quixotic, 12345, and émigré café naïve.",
    "多模态大模型的数据均衡",  # CJK: falls back to byte tokens for this tiny vocabulary
    "emoji 🙂 and tabs\tand\nnewlines",
    "[UNK] [CLS] literal special-token text",
] + CORPUS


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # A post-processor that adds BOS/EOS lets us check that add_special_tokens is honoured.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))],
    )
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return tok, d


def test_counter_equals_tokenizer(trained):
    tok, d = trained
    c = TextTokenCounter.from_pretrained(d)
    expected = [len(tok.encode(s, add_special_tokens=False).ids) for s in SAMPLES]
    assert [c.count(s) for s in SAMPLES] == expected
    got = c.count_batch(SAMPLES)
    assert got.dtype == np.int64 and got.tolist() == expected
    assert c.count_batch([]).shape == (0,)


def test_counter_special_tokens_opt_in(trained):
    tok, d = trained
    c = TextTokenCounter.from_pretrained(d / "tokenizer.json", add_special_tokens=True)
    expected = [len(tok.encode(s).ids) for s in SAMPLES]
    assert c.count_batch(SAMPLES).tolist() == expected
    assert c.count("hello") == len(tok.encode("hello", add_special_tokens=False).ids) + 2


def test_counter_name_is_file_hash(trained):
    _, d = trained
    c = get_text_counter(str(d))
    digest = hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    assert isinstance(c, TextTokenCounter)
    assert c.name == f"tokenizer.json:sha256={digest[:16]}"


def test_counter_missing_or_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        TextTokenCounter.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextTokenCounter.from_pretrained(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        TextTokenCounter.from_pretrained(bad)


def test_heuristic_default_and_values():
    c = get_text_counter(None)
    assert isinstance(c, HeuristicTextCounter)
    assert c.name == "heuristic:bytes_per_token=4"
    for s in SAMPLES:
        assert c.count(s) == math.ceil(len(s.encode("utf-8")) / 4.0)
    assert c.count_batch(SAMPLES).tolist() == [c.count(s) for s in SAMPLES]
    assert c.count_batch(SAMPLES).dtype == np.int64
    assert c.count("") == 0 and c.count("abcd") == 1 and c.count("abcde") == 2
    c3 = HeuristicTextCounter(bytes_per_token=3.5)
    assert c3.count("x" * 7) == 2 and c3.name == "heuristic:bytes_per_token=3.5"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "4"])
def test_heuristic_rejects_bad_ratio(bad):
    with pytest.raises(ValueError, match="bytes_per_token"):
        HeuristicTextCounter(bytes_per_token=bad)


def test_non_str_names_index(trained):
    _, d = trained
    for c in (HeuristicTextCounter(), TextTokenCounter.from_pretrained(d)):
        with pytest.raises(TypeError, match="index 1 must be str, got NoneType"):
            c.count_batch(["ok", None])
        with pytest.raises(TypeError, match="must be str, got bytes"):
            c.count(b"abc")


# ---------------------------------------------------------------------------------------------
# chat templates: count_chat equals transformers' apply_chat_template on the same files

# A ChatML template (the layout Qwen uses) with a default system prompt, written for this test.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
)
ADDED_EOS = {"__type": "AddedToken", "content": "</s>"}  # the dict form real tokenizer_config.json files use
CHATS = [
    [{"role": "user", "content": "Describe the picture."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The quick brown fox?"},
        {"role": "assistant", "content": "It jumps over the lazy dog."},
    ],
    [{"role": "user", "content": "多模态 émigré 🙂"}, {"role": "assistant", "content": ""}],
]


def _chat_dir(tmp_path, trained, config: dict, jinja: str | None = None):
    import json

    from tokenizers import AddedToken

    tok, _ = trained
    d = tmp_path / "chat"
    d.mkdir()
    t = tokenizers.Tokenizer.from_str(tok.to_str())
    t.post_processor = None
    t.add_special_tokens([AddedToken(s, special=True) for s in ("<|im_start|>", "<|im_end|>")])
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config})
    )
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


@pytest.mark.parametrize(
    ("config", "jinja"),
    [
        ({"chat_template": CHATML, "eos_token": "<|im_end|>"}, None),
        ({"chat_template": BOS_TEMPLATE, "bos_token": "<s>", "eos_token": ADDED_EOS}, None),
        ({"chat_template": [{"name": "default", "template": CHATML}], "eos_token": "<|im_end|>"}, None),
        ({"chat_template": "unused {{ nothing }}", "bos_token": "<s>", "eos_token": "</s>"}, BOS_TEMPLATE),
    ],
)
def test_count_chat_equals_apply_chat_template(tmp_path, trained, config, jinja):
    from transformers import AutoTokenizer

    d = _chat_dir(tmp_path, trained, config, jinja)
    hf = AutoTokenizer.from_pretrained(str(d))
    c = TextTokenCounter.from_pretrained(d)
    for chat in CHATS:
        for gen in (False, True):
            want = len(
                hf.apply_chat_template(chat, tokenize=True, return_dict=False, add_generation_prompt=gen)
            )
            assert c.count_chat(chat, add_generation_prompt=gen) == want, (chat, gen)


def test_chat_overhead_per_turn(tmp_path, trained):
    d = _chat_dir(tmp_path, trained, {"chat_template": CHATML})
    c = TextTokenCounter.from_pretrained(d)
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))

    def n(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False).ids)

    one = [{"role": "user", "content": "The quick brown fox?"}]
    two = one + [{"role": "assistant", "content": "It jumps over the lazy dog."}]
    system = n("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    user_turn = n("<|im_start|>user\n") + n("<|im_end|>\n")
    assistant_turn = n("<|im_start|>assistant\n") + n("<|im_end|>\n")
    assert c.chat_overhead(one) == system + user_turn
    assert c.chat_overhead(two) - c.chat_overhead(one) == assistant_turn
    assert c.count_chat(two) == c.chat_overhead(two) + c.count_batch([m["content"] for m in two]).sum()


def test_count_chat_errors(tmp_path, trained):
    _, plain = trained
    c = TextTokenCounter.from_pretrained(plain)
    assert c.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        c.count_chat(CHATS[0])
    assert c.count_chat(CHATS[0], template=CHATML) > c.count("Describe the picture.")
    d = _chat_dir(tmp_path, trained, {"chat_template": CHATML})
    c = TextTokenCounter.from_pretrained(d)
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with str 'role' and str 'content'"):
        c.count_chat([{"role": "user", "content": "hi"}, {"role": "user", "content": None}])
    with pytest.raises(ValueError, match="non-empty list"):
        c.chat_overhead([])
