"""The model families tokenbal knows, in one table: a family's key is the same everywhere.

``get_estimator(key)``, ``tokenbal index build --model KEY``, the index manifest, the docs and
``collate.models.enable_packed`` (through the ``model_type`` values of a row) all spell a family
by its ``key``. Transformers' ``model_type`` values and the original repositories' spellings are
accepted wherever a key is (:func:`family`).

Adding a family: a row here, then one file per layer it reaches: ``tokenbal/estimate/<estimate>.py``
(the token rule, registered in ``tokenbal/estimate/vision.py``) and, for packed training,
``collate/models/<packed>.py`` (imported by ``collate/models/__init__.py``).
``tests/tokenbal/estimate/test_families.py`` checks that every layer agrees with the table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family", "family", "family_keys", "model_type_family"]


@dataclass(frozen=True)
class Family:
    key: str                            # the one name (lower case, as get_estimator takes it)
    model_types: tuple[str, ...] = ()   # transformers ``config.model_type`` values of this family
    aliases: tuple[str, ...] = ()       # other accepted spellings (original repos' model_type, ...)
    estimate: str = ""                  # tokenbal/estimate/<estimate>.py holds the token rule
    packed: str | None = None           # collate/models/<packed>.py patches it; None: no packed patch


FAMILIES: tuple[Family, ...] = (
    Family("qwen2-vl", ("qwen2_vl",), (), "qwen", "qwen2_vl"),
    # Qwen2.5-VL's text stack is Qwen2-VL's (same attention / rotary code): the same patch file.
    Family("qwen2.5-vl", ("qwen2_5_vl",), ("qwen2.5_vl",), "qwen", "qwen2_vl"),
    Family("qwen3-vl", ("qwen3_vl", "qwen3_vl_moe"), (), "qwen", "qwen3_vl"),
    # internvl_chat: the original OpenGVLab repo's remote-code model (counted, not patched).
    Family("internvl", ("internvl",), ("internvl_chat",), "tiles", "internvl"),
    Family("tiles", (), (), "tiles"),
    Family("llava-next", ("llava_next",), (), "llava", "llava_next"),
    Family("llava-onevision", ("llava_onevision",), (), "llava", "llava_onevision"),
    Family("idefics3", ("idefics3",), (), "idefics"),
    Family("smolvlm", ("smolvlm",), (), "idefics"),
    # glm4v_moe (GLM-4.5V): the same image processor class, so the same counts; not patched.
    # glm46v (GLM-4.6V): GLM-4V's model and image processor subclassed unchanged; patched when its
    # text model is GLM-4V's dense one (collate/models/glm4v.py refuses a MoE text model).
    # glm_ocr (GLM-OCR): GLM-4V's generation class, text stack and get_rope_index; its vision
    # attention adds per-head q / k norms (applied by the packed vision attention). Its counts are
    # GLM-4.1V's rule; the checkpoint's own pixel bounds come from load_estimator / --processor.
    Family("glm-4.1v", ("glm4v", "glm46v", "glm_ocr"), ("glm4.1v", "glm4v_moe"), "glm4v", "glm4v"),
    Family("phi-4-multimodal", ("phi4_multimodal",), ("phi4-multimodal",), "phi4"),
)

_BY_NAME = {name: f for f in FAMILIES for name in (f.key, *f.model_types, *f.aliases)}


def family_keys() -> list[str]:
    """Every family's key, sorted."""
    return sorted(f.key for f in FAMILIES)


def family(name: str) -> Family:
    """The family a key, a transformers ``model_type`` or an alias names (case-insensitive);
    ``ValueError`` listing the keys otherwise."""
    found = _BY_NAME.get(str(name).lower())
    if found is None:
        raise ValueError(f"unknown model family {name!r}; known: {family_keys()}")
    return found


def model_type_family(model_type: str) -> Family | None:
    """The family whose transformers ``model_type`` this is (aliases excluded), or None."""
    found = _BY_NAME.get(str(model_type).lower())
    return found if found is not None and model_type in found.model_types else None
