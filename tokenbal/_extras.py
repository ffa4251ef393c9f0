"""Optional dependencies: one place that knows which pip extra installs which module.

A missing one is a :class:`MissingExtraError` whose one-line message names the extra
(``pip install 'tokenbal[parquet]'``), raised before any work starts where the need is known up
front (a Parquet source, a URL) and at first use otherwise (the first video member). It is an
``ImportError``, so code that already handles those keeps working; the CLI prints it as
``tokenbal <command>: error: ...`` without a traceback, and a build never turns it into one error per file.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (pip extra, the distribution that provides it)
EXTRAS: dict[str, tuple[str, str]] = {
    "pyarrow": ("parquet", "pyarrow"),
    "av": ("video", "av (PyAV)"),
    "fsspec": ("remote", "fsspec"),
    "transformers": ("hf", "transformers"),
    "tokenizers": ("hf", "tokenizers"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def install_hint(module: str) -> str:
    """``pip install 'tokenbal[EXTRA]'`` for the top-level package of ``module``."""
    extra, _ = EXTRAS[module.split(".")[0]]
    return f"pip install 'tokenbal[{extra}]'"


def require(module: str, needed_for: str) -> ModuleType:
    """Import ``module`` (e.g. ``"pyarrow.parquet"``), or raise :class:`MissingExtraError` saying
    that ``needed_for`` (e.g. ``"Parquet sources"``) needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if top not in EXTRAS:
            raise
        _, dist = EXTRAS[top]
        raise MissingExtraError(f"{needed_for} need {dist}, which is not installed: "
                                f"{install_hint(top)}") from e


def fsspec_filesystem(protocol: str, **storage_options):
    """``fsspec.filesystem(protocol, ...)``, with a missing fsspec or protocol backend (aiohttp for
    http(s)://, s3fs for s3://, ...) as a :class:`MissingExtraError` that says what to install, and
    an option the filesystem cannot be made without (an ftp:// host) as a ``ValueError`` naming it."""
    import inspect

    fsspec = require("fsspec", "remote (URL) sources")
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        how = ("pip install 'tokenbal[remote]'" if protocol in ("http", "https")
               else "install the package fsspec names (s3fs for s3://, gcsfs for gs://, adlfs for az://)")
        raise MissingExtraError(f"{protocol}:// sources need an fsspec backend that is not installed "
                                f"({e}): {how}") from e
    # Checked before the filesystem is made: a half-made one complains again when it is collected.
    needed = [name for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]
              if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
              and name not in storage_options]
    if needed:
        raise ValueError(f"{protocol}:// sources need {', '.join(needed)}, which neither the URL nor "
                         f"--storage-option gives (e.g. {protocol}://HOST/path/data.tar, or --storage-option "
                         f"{needed[0]}=...)")
    return fsspec.filesystem(protocol, **storage_options)
