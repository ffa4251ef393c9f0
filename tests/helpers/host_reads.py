"""A spy for device -> host reads, shared by the packed-model tests."""

from __future__ import annotations

import torch


class HostReads:
    """Records, in its scope, every call that reads a device tensor back on an accelerator:
    ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), ops whose output size
    depends on values (``nonzero``, ``masked_select``, ``repeat_interleave`` by a tensor without
    ``output_size``: free on the CPU, a sync on a GPU), and ``.tolist()`` / ``.cpu()`` /
    ``.numpy()`` / ``.item()``."""

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.seen: list[str] = []
        seen = self.seen
        aten = torch.ops.aten
        syncing = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in syncing or (func is aten.repeat_interleave.Tensor
                                       and kwargs.get("output_size") is None):
                    seen.append(str(func))
                return func(*args, **kwargs)

        self.mode = Spy()
        self.monkeypatch = monkeypatch
        for name in ("tolist", "cpu", "numpy", "item"):
            real = getattr(torch.Tensor, name)

            def spy(tensor, *a, _name=name, _real=real, **k):
                seen.append(_name)
                return _real(tensor, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.monkeypatch.undo()


def host_reads_of_step(model, batch, monkeypatch) -> list[str]:
    """The host reads one packed forward + backward of ``model`` on ``batch`` makes."""
    with HostReads(monkeypatch) as reads:
        model(**batch).loss.backward()
    return reads.seen


def host_tensors_of_step(model, batch) -> list[str]:
    """The tensors one packed forward + backward of ``model`` on ``batch`` builds from python data
    (``torch.tensor(...)``: ``aten.lift_fresh``), by the function that built them. On an
    accelerator each is a blocking host-to-device copy, which waits for the stream like a read."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    built: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.lift_fresh.default:
                outside = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
                built.append(f"{outside[-1].filename}:{outside[-1].name}" if outside else "?")
            return func(*args, **(kwargs or {}))

    with Spy():
        model(**batch).loss.backward()
    return built


def skip_unless_tower_takes(visual, *inputs: str) -> None:
    """Skip a sync-free / batch-segment check where the installed transformers' vision tower cannot
    take the collator's precomputed ``inputs`` (it derives them from ``grid_thw`` on the host: before
    5.9 for segments and rotary ids, before 5.19 for Qwen3-VL's interpolation taps). The packed
    forward there is still exact; the other tests check that."""
    import pytest
    import transformers

    from tokenbal.hf_compat import tower_inputs

    missing = [name for name in inputs if name not in tower_inputs(visual)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__}: {type(visual).__name__} derives "
                    f"{', '.join(missing)} from grid_thw itself (host reads)")
