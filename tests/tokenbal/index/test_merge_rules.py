"""``index merge`` of parts built with different token rules names what differs and which part
(one of 64 parts built with ``--exif ignore`` or another ``max_pixels`` was only 'other token rules');
indexes of an older release's scan rules are rescanned, not copied."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.corpus import Sample, write_shard
from tokenbal.index import build_index, merge_indexes
from tokenbal.index.build import SCAN_RULES


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


def _as_built_before_scan_rules(index_dir) -> None:
    """Make ``index_dir``'s manifest what a release before ``SCAN_RULES`` wrote (no ``scan_rules``)."""
    manifest = index_dir / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["scan_rules"]
    manifest.write_text(json.dumps(data))


def test_an_index_of_older_scan_rules_is_rescanned_not_copied_and_a_merge_keeps_its_parts_rules(shards,
                                                                                                tmp_path):
    # A release that scans a shard differently (a new check makes a counted sample an error) raises
    # SCAN_RULES; an incremental build must then rescan the shards an older release scanned, not copy
    # their rows, and a merge of older parts must not stamp them with this release's rules.
    out = tmp_path / "idx"
    build_index(shards, out, progress=False)
    assert json.loads((out / "manifest.json").read_text())["scan_rules"] == SCAN_RULES
    assert build_index(shards, out, progress=False).num_reused == len(shards)
    _as_built_before_scan_rules(out)
    report = build_index(shards, out, progress=False)
    assert report.num_reused == 0 and report.num_shards == len(shards)
    assert json.loads((out / "manifest.json").read_text())["scan_rules"] == SCAN_RULES
    assert build_index(shards, out, progress=False).num_reused == len(shards)

    parts = [build_index(shards, tmp_path / f"p{i}", part=(i, 2), progress=False).out for i in range(2)]
    for part in parts:
        _as_built_before_scan_rules(tmp_path / os.path.basename(part))
    merged = tmp_path / "merged"
    merge_indexes(merged, parts)
    assert json.loads((merged / "manifest.json").read_text())["scan_rules"] == 0
    assert build_index(shards, merged, progress=False).num_reused == 0
