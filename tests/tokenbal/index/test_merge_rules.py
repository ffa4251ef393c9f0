"""``index merge`` of parts built with different token rules names what differs and which part
(one of 64 parts built with ``--exif ignore`` or another ``max_pixels`` was only 'other token rules')."""

from __future__ import annotations

import pytest

from tests.helpers.corpus import Sample, write_shard
from tokenbal.index import build_index, merge_indexes


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    def shard(j: int) -> str:
        samples = [Sample(f"k{j}{i}", caption="hi " * i, images=[("jpg", 40, 30)]) for i in range(3)]
        return str(write_shard(root / f"s{j}.tar", samples))

    return [shard(0), shard(1)]


@pytest.mark.parametrize("option,words", [
    ({"exif": "ignore"}, "--exif: 'transpose' in part 0/2, 'ignore' in part 1/2"),
    ({"estimator_overrides": {"max_pixels": 1003520}},
     "max_pixels: 12845056 in part 0/2, 1003520 in part 1/2"),
    ({"model": "internvl"}, "estimator: 'qwen2-vl' in part 0/2, 'internvl' in part 1/2"),
])
def test_parts_with_other_token_rules_are_refused_naming_the_difference_and_the_part(shards, tmp_path, option,
                                                                                      words):
    p0 = build_index(shards, tmp_path / "p0", part=(0, 2), progress=False).out
    p1 = build_index(shards, tmp_path / "p1", part=(1, 2), progress=False, **option).out
    with pytest.raises(ValueError, match="other token rules") as e:
        merge_indexes(tmp_path / "out", [p0, p1])
    assert words in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()
