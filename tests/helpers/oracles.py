"""Skips for oracles an older transformers does not have (the check, not the library, is missing)."""

from __future__ import annotations

from typing import Any


def require_oracle(owner: Any, name: str) -> None:
    """Skip unless ``owner`` (a transformers class or instance) has ``name``: a processor helper the
    test uses as its oracle that the installed transformers has not added yet."""
    import pytest
    import transformers

    if not hasattr(owner, name):
        kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
        pytest.skip(f"transformers {transformers.__version__}: {kind} has no {name} (the oracle)")


def require_usable(cls: Any) -> None:
    """Skip when ``cls`` is transformers' placeholder for a class whose backend (torchvision) is not
    installed: 5.6-5.9's ``Idefics3ImageProcessorPil`` / ``SmolVLMImageProcessorPil`` still need it."""
    import pytest
    import transformers

    try:
        cls()
    except ImportError as e:
        pytest.skip(f"transformers {transformers.__version__}: {cls.__name__} needs {str(e).split()[2]}")
    except Exception:  # noqa: BLE001 - only the import of the backend matters here
        pass
