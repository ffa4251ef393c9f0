"""collate.fields spells the batch's field names once: every name it lists is a field of the
dataclass that carries it, and the wrapper never takes a field transformers needs."""

from __future__ import annotations

import dataclasses

from collate import PackedBatch, fields
from collate.models import core
from collate.sp import SP_KEYS, SPBatch

PACKED = {f.name for f in dataclasses.fields(PackedBatch)}
SP = {f.name for f in dataclasses.fields(SPBatch)}


def test_every_listed_name_is_a_batch_field():
    for group in (fields.TOWER_INPUTS, fields.SEGMENTS, fields.VISION_PLAN):
        assert set(group) <= PACKED, set(group) - PACKED
    assert set(fields.SP_ROUTING) <= SP - PACKED  # what an SP slice adds
    assert set(fields.CONSUMED_BY_WRAPPER) <= SP


def test_the_wrapper_leaves_transformers_its_inputs():
    taken = set(fields.CONSUMED_BY_WRAPPER)
    assert not taken & {"input_ids", "labels", "shift_labels", *fields.TOWER_INPUTS}
    assert len(taken) == len(fields.CONSUMED_BY_WRAPPER)  # no name listed twice


def test_the_old_names_are_the_same_lists():
    assert core.CONSUMED_KEYS == fields.CONSUMED_BY_WRAPPER
    assert core.VISION_KEYS == fields.VISION_PLAN
    assert SP_KEYS == fields.SP_ROUTING
    assert set(core.SP_KEYS) == {*fields.SP_ROUTING, "sp_padding"}
