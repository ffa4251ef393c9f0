"""Fixtures shared across the test tree (plain helper functions and classes are in tests/helpers/).
A test module's own fixture of the same name overrides these (e.g. a corpus of another size)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The default real tar corpus of tests/helpers/corpus.py: good and bad samples in every image
    format, one truncated shard; one per test module."""
    from tests.helpers.corpus import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on loopback with an empty bucket ``corpus``: (endpoint URL, boto3 client)."""
    from tests.helpers.servers import moto_s3

    with moto_s3(monkeypatch) as (endpoint, client):
        yield endpoint, client


@pytest.fixture(scope="session")
def qwen2_vl_ckpt(tmp_path_factory):
    """A tiny local Qwen2-VL checkpoint folder (tokenizer trained on the corpus words, official image
    processor sizes, a random tiny model): ``tests.helpers.processors.qwen2_vl_checkpoint``, built
    once per session for the ProcessorDataset and README Quick start tests."""
    pytest.importorskip("transformers")
    from tests.helpers.corpus import WORDS
    from tests.helpers.processors import qwen2_vl_checkpoint

    return qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2vl") / "Qwen2-VL-2B-Instruct",
                               [" ".join(WORDS)] * 20, model=True)


@pytest.fixture
def quiet_transformers():
    """transformers' warnings off for one test (apply_chat_template(images=...) logs one per call
    about processor kwargs), its verbosity restored after."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)
