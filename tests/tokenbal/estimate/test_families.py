"""The family table (tokenbal.estimate.families) is the one place a family's key and spellings
live: the estimators, the packed patches, the demo's model classes and the docs agree with it."""

import json
import re

import pytest

from tests.helpers.paths import REPO as ROOT
from tokenbal.estimate import estimator_names, get_estimator
from tokenbal.estimate.base import Estimator
from tokenbal.estimate.families import FAMILIES, family, family_keys, model_type_family


def test_keys_and_spellings_are_unique_and_lower_case():
    owners: dict[str, set[str]] = {}
    for f in FAMILIES:
        for spelling in (f.key, *f.model_types, *f.aliases):
            owners.setdefault(spelling, set()).add(f.key)
    assert {s: o for s, o in owners.items() if len(o) > 1} == {}, "a spelling names two families"
    assert all(s == s.lower() for s in owners)
    assert family_keys() == sorted(f.key for f in FAMILIES)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.key)
def test_every_spelling_gives_the_familys_estimator(fam):
    est = get_estimator(fam.key)
    assert isinstance(est, Estimator) and est.name == fam.key and est.config["estimator"] == fam.key
    assert type(est).__module__ == f"tokenbal.estimate.{fam.estimate}"
    for spelling in (*fam.model_types, *fam.aliases, fam.key.upper()):
        assert family(spelling) is fam
        assert get_estimator(spelling) == est
    for model_type in fam.model_types:
        assert model_type_family(model_type) is fam
    for alias in fam.aliases:
        assert model_type_family(alias) is None
    # a config survives the manifest's JSON round trip as the same estimator
    settings = json.loads(json.dumps(est.config))
    assert settings.pop("estimator") == fam.key
    settings.pop("family")
    assert get_estimator(fam.key, **settings) == est


def test_estimator_names_are_the_table_keys_and_unknown_names_list_them():
    assert estimator_names() == family_keys()
    with pytest.raises(ValueError, match="unknown estimator 'gpt-9'; known: "):
        get_estimator("gpt-9")
    with pytest.raises(ValueError, match=re.escape(f"known: {family_keys()}")):
        family("gpt-9")


def test_packed_patches_come_from_the_table():
    import collate.models as models

    expected = {mt: f.packed for f in FAMILIES if f.packed for mt in f.model_types}
    assert set(models.PACKED_ONLY).isdisjoint(expected)  # a family with a row is patched through it
    expected.update(models.PACKED_ONLY)
    assert sorted(models._PATCHES) == sorted(expected)
    for model_type, (enable, disable) in models._PATCHES.items():
        assert enable.__module__ == disable.__module__ == f"collate.models.{expected[model_type]}"
    for f in FAMILIES:
        assert (ROOT / "tokenbal" / "estimate" / f"{f.estimate}.py").is_file()
        assert f.packed is None or (ROOT / "collate" / "models" / f"{f.packed}.py").is_file()


def test_demo_model_classes_name_the_familys_key():
    from collate.train.builders import MODEL_CLASSES

    for model_type, (_, _, key) in MODEL_CLASSES.items():
        assert model_type_family(model_type).key == key


def test_docs_list_every_family_by_its_key():
    doc = (ROOT / "docs" / "estimators.md").read_text()
    missing = [f.key for f in FAMILIES if f"`{f.key}`" not in doc]
    assert not missing, f"docs/estimators.md does not name {missing}"


def test_replace_is_checked_the_same_way_for_every_estimator():
    for key in family_keys():
        est = get_estimator(key)
        with pytest.raises(TypeError, match=f"{key}: unknown setting"):
            est.replace(no_such_setting=1)
        assert est.replace() == est
