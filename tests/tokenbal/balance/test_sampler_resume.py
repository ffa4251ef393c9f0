"""Resume across changed inputs: another index, changed settings, serialised states."""
import dataclasses

import numpy as np
import pytest

from tokenbal import TokenBalancedBatchSampler, TokenIndex


@pytest.fixture(scope="module")
def twin_indexes(tmp_path_factory):
    """Two real indexes whose samples have the same token counts in the same order but are other
    samples (other keys, other shards): a fixed-length corpus and its successor look like this."""
    from tokenbal.index import build_index
    from tokenbal.synthetic import make_samples, write_shards

    root = tmp_path_factory.mktemp("twins")
    samples = [s for s in make_samples(60, seed=3) if s.kind in ("text_short", "text_long", "icon")]
    other = [dataclasses.replace(s, key=str(int(s.key) + 50_000)) for s in samples]
    a = build_index(write_shards(samples, str(root / "a"), 16), root / "idx-a", progress=False).out
    b = build_index(write_shards(other, str(root / "b"), 16, prefix="next"), root / "idx-b",
                    progress=False).out
    return TokenIndex(str(a)), TokenIndex(str(b))


def test_a_state_from_another_index_with_the_same_lengths_is_refused_by_name(twin_indexes):
    # The fingerprint held only the lengths' digest: a checkpoint of index A loaded into a sampler over
    # index B with the same token counts resumed silently, on other samples.
    a, b = twin_indexes
    assert np.array_equal(a.lengths, b.lengths) and list(a.keys) != list(b.keys)
    s = TokenBalancedBatchSampler(a, 2, 0, global_batch_size=4)
    it = iter(s)
    next(it)
    state = s.state_dict()
    other = TokenBalancedBatchSampler(b, 2, 0, global_batch_size=4)
    with pytest.raises(ValueError, match="samples_sha256.*other samples"):
        other.load_state_dict(state)
    assert other.cursor == 0
    # the same index (reopened), or its lengths as an array (no keys to compare), resume as before
    same = TokenBalancedBatchSampler(TokenIndex(a.path), 2, 0, global_batch_size=4)
    same.load_state_dict(state)
    assert same.cursor == 1
    plain = TokenBalancedBatchSampler(np.asarray(a.lengths), 2, 0, global_batch_size=4)
    plain.load_state_dict(state)
    s.load_state_dict(plain.state_dict())
    # a checkpoint from before the key existed still loads
    old = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "samples_sha256"}}
    other.load_state_dict(old)


def _state_after(batches=1, **kw):
    s = TokenBalancedBatchSampler(np.arange(1, 101), 2, 0, global_batch_size=8, **kw)
    it = iter(s)
    for _ in range(batches):
        next(it)
    return s.state_dict()


def test_a_state_of_a_newer_format_is_refused_instead_of_read_as_this_one():
    # version 99 (or "x") loaded as version 1: a newer tokenbal's state, whose fields may mean something
    # else, resumed silently.
    state = _state_after()
    for version in (99, "x", 1.5):
        fresh = TokenBalancedBatchSampler(np.arange(1, 101), 2, 0, global_batch_size=8)
        with pytest.raises(ValueError, match=rf"state\['version'\] is {version!r}.*version 1"):
            fresh.load_state_dict({**state, "version": version})
        assert fresh.cursor == 0
    fresh.load_state_dict({k: v for k, v in state.items() if k != "version"})   # before versions: 1
    assert fresh.cursor == 1


def test_a_damaged_elastic_history_names_the_missing_setting_instead_of_a_key_error():
    # segments[0]['fingerprint'] without num_replicas: a bare KeyError('num_replicas') from the replan.
    state = _state_after()
    seg = {"fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "num_replicas"}, "cursor": 0}
    for elastic in (False, True):
        fresh = TokenBalancedBatchSampler(np.arange(1, 101), 2, 0, global_batch_size=8, elastic=elastic)
        with pytest.raises(ValueError, match=r"\['segments'\]\[0\]\['fingerprint'\] has no num_replicas"):
            fresh.load_state_dict({**state, "segments": [seg]})
        assert fresh.cursor == 0 and fresh._segments == []
