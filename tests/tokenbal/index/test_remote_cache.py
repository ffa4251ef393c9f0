"""``tokenbal.io.remote._Segments``: the cache of fetched byte ranges a remote shard scan reads from."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.io.remote import _Segments

OBJECT = bytes(range(256)) * 8


def _covered_without_gap(spans, start, end):
    reach = None
    for s, e in sorted(spans):
        if reach is None:
            if s <= start < e:
                reach = e
        elif s <= reach:
            reach = max(reach, e)
        if reach is not None and reach >= end:
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, len(OBJECT) - 1), st.integers(1, 400)), max_size=8),
       reads=st.lists(st.tuples(st.integers(0, len(OBJECT) - 1), st.integers(1, 600)), min_size=1,
                      max_size=8))
def test_segments_answer_with_the_objects_bytes_whenever_they_cover_the_read(spans, reads):
    """A read is answered with exactly the object's bytes, joined across segments that touch or
    overlap (the header walk's windows), and it is answered whenever the segments cover it without a
    gap (up to 8 segments: ``get`` looks at the 8 starting last before the offset)."""
    cache = _Segments()
    for start, n in spans:
        cache.add(start, OBJECT[start:start + n])
    held = [(s, s + len(seg)) for s, seg in zip(cache.starts, cache.segs, strict=True)]
    for offset, n in reads:
        n = min(n, len(OBJECT) - offset)
        got = cache.get(n, offset)
        assert got is None or got == OBJECT[offset:offset + n]
        assert (got is not None) == _covered_without_gap(held, offset, offset + n)
