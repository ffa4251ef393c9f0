"""Processor fixtures shared by the estimator tests and the index tests that compare against them."""

from __future__ import annotations

import pytest

from tests.helpers import processors


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    return processors.word_tokenizer()


@pytest.fixture(scope="module")
def next_proc(tokenizer):
    return processors.llava_next_processor(tokenizer)


@pytest.fixture(scope="module")
def ov_proc():
    pytest.importorskip("transformers")
    return processors.llava_onevision_processor()


@pytest.fixture(scope="module")
def phi4_oracle():
    pytest.importorskip("transformers")
    return processors.phi4_token_counter()
