"""image_tokens_batch == image_tokens, element by element, on sizes hypothesis picks (the batch
paths use closed forms and shortcuts; the scalar paths are plain ports of transformers)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.estimate import estimator_names, get_estimator
from tokenbal.estimate._sizes import MAX_SIDE

# Random sides, and sides in small integer ratios (exact aspect ties with the pinpoints / grids).
RATIO = st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 500)).map(
    lambda x: (x[0] * x[2], x[1] * x[2]))
SIDES = st.lists(st.tuples(st.integers(1, 6000), st.integers(1, 6000)) | RATIO, min_size=1, max_size=60)
# Sizes near the pinpoint/crop multiples, where truncation and ties decide.
MULTIPLE = st.integers(1, 16).map(lambda k: 384 * k) | st.integers(1, 16).map(lambda k: 336 * k)
NEAR = st.lists(st.tuples(MULTIPLE, st.integers(-2, 2), st.integers(1, 4000)), min_size=1, max_size=40)


def _check(est, sizes):
    w = np.array([a for a, _ in sizes], np.int64)
    h = np.array([b for _, b in sizes], np.int64)
    try:
        want = [est.image_tokens(int(a), int(b)) for a, b in sizes]
    except ValueError:            # e.g. Phi-4's extreme aspect ratios: the batch must reject them too
        try:
            est.image_tokens_batch(w, h)
        except ValueError:
            return
        raise AssertionError("the scalar path rejects a size the batch path accepts") from None
    assert est.image_tokens_batch(w, h).tolist() == want


@settings(max_examples=80, deadline=None)
@given(sizes=SIDES, name=st.sampled_from(sorted(estimator_names())))
def test_batch_equals_scalar(sizes, name):
    _check(get_estimator(name), sizes)


@settings(max_examples=80, deadline=None)
@given(near=NEAR, name=st.sampled_from(["llava-next", "llava-onevision"]), swap=st.booleans())
def test_llava_batch_equals_scalar_near_multiples(near, name, swap):
    sizes = [(max(1, m + d), o) for m, d, o in near]
    if swap:
        sizes = [(b, a) for a, b in sizes]
    _check(get_estimator(name), sizes)


@settings(max_examples=60, deadline=None)
@given(sizes=SIDES, rows=st.integers(1, 4), cols=st.integers(1, 4))
def test_llava_grid_pinpoints_other_than_onevision(sizes, rows, cols):
    for name, crop in (("llava-next", 336), ("llava-onevision", 384)):
        pins = [(crop * i, crop * j) for i in range(1, rows + 1) for j in range(1, cols + 1)]
        _check(get_estimator(name).replace(pinpoints=pins), sizes)


# Sides up to the largest taken (MAX_SIDE, 2^24 - 1): no int64 product of the formulas may overflow there.
HUGE = st.lists(st.tuples(st.integers(1, MAX_SIDE), st.integers(1, MAX_SIDE)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(sizes=HUGE, name=st.sampled_from(sorted(estimator_names())))
def test_batch_equals_scalar_up_to_the_largest_side(sizes, name):
    _check(get_estimator(name), sizes + [(MAX_SIDE, MAX_SIDE)])


def test_a_side_past_the_largest_is_refused_by_both_paths_naming_it():
    for name in estimator_names():
        est = get_estimator(name)
        with pytest.raises(ValueError, match=rf"width {MAX_SIDE + 1} is larger than any image side"):
            est.image_tokens(MAX_SIDE + 1, 100)
        with pytest.raises(ValueError, match=rf"heights\[1\] {2**40} is larger than any image side"):
            est.image_tokens_batch(np.array([100, 100]), np.array([100, 2**40]))
