"""DevicePrefetcher scheduling, driven on CPU through a recording stream/event backend."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from collate import DevicePrefetcher, PackedCollator
from collate.prefetch import StreamOps, iter_tensors, map_tensors, resolve_device
from tests.helpers.paths import REPO


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[int] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event.id)
        LOG.append(("wait", self.name, event.id))


class FakeEvent:
    count = 0

    def __init__(self) -> None:
        FakeEvent.count += 1
        self.id = FakeEvent.count

    def record(self, stream: FakeStream) -> None:
        LOG.append(("event", stream.name, self.id))


LOG: list[tuple] = []


class FakeModule:
    """Stands in for torch.cuda / torch.npu: the real StreamOps code runs against it."""

    Event = FakeEvent
    main = FakeStream("main")
    current = main

    @staticmethod
    def Stream(device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        return FakeStream("side")

    @classmethod
    @contextlib.contextmanager
    def stream(cls, s):
        prev, cls.current = cls.current, s
        LOG.append(("enter", s.name))
        try:
            yield
        finally:
            cls.current = prev
            LOG.append(("exit", s.name))

    @classmethod
    def current_stream(cls, device=None):
        return cls.current


class RecordingOps(StreamOps):
    """Real StreamOps over FakeModule; only the two tensor calls CPU cannot do are replaced."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.module = FakeModule
        FakeModule.current = FakeModule.main

    def copy(self, tensor):
        assert FakeModule.current.name == "side", "copies must run on the side stream"
        LOG.append(("copy", tuple(tensor.shape)))
        return tensor.clone()

    def record_stream(self, tensor, stream):
        LOG.append(("record_stream", stream.name))


@pytest.fixture(autouse=True)
def _clear_log():
    LOG.clear()
    yield
    LOG.clear()


def counting(items):
    for i, x in enumerate(items):
        LOG.append(("pull", i))
        yield x


def batches(n: int) -> list[dict]:
    return [{"x": torch.full((2,), float(i)), "y": torch.arange(3) + i, "n": i} for i in range(n)]


def test_order_depth_and_events():
    n, depth = 5, 2
    pf = DevicePrefetcher(counting(batches(n)), depth=depth, ops=RecordingOps())
    for i, b in enumerate(pf):
        pulls = [e for e in LOG if e[0] == "pull"]
        # when batch i is handed over, batches up to i+depth-1 have been pulled (and their copies issued)
        assert len(pulls) == min(i + depth, n)
        assert b["n"] == i and torch.equal(b["x"], torch.full((2,), float(i)))
        LOG.append(("yield", i))
    assert [e[1] for e in LOG if e[0] == "yield"] == list(range(n))
    # Per batch: enter side, 2 copies, event on side, exit; later the main stream waits on that
    # event and record_stream runs once per tensor, all before the batch is yielded.
    events = [e for e in LOG if e[0] == "event"]
    assert len(events) == n and all(e[1] == "side" for e in events)
    for k, ev in enumerate(events):
        at = LOG.index(ev)
        assert LOG[at - 3 : at] == [("enter", "side"), ("copy", (2,)), ("copy", (3,))]
        assert LOG[at + 1] == ("exit", "side")
        wait = LOG.index(("wait", "main", ev[2]))
        y = LOG.index(("yield", k))
        assert at < wait < y
        assert LOG[wait + 1 : wait + 3] == [("record_stream", "main")] * 2
        assert LOG[wait + 3] == ("yield", k)


@pytest.mark.parametrize("depth", [1, 3])
def test_depth_pulls_ahead(depth):
    seen = []
    pf = DevicePrefetcher(counting(batches(6)), depth=depth, ops=RecordingOps())
    for _ in pf:
        seen.append(sum(e[0] == "pull" for e in LOG))
    assert seen == [min(i + depth, 6) for i in range(6)]


def test_exhaustion_and_reiteration():
    src = batches(3)
    pf = DevicePrefetcher(src, depth=4, ops=RecordingOps())
    assert len(pf) == 3
    assert [b["n"] for b in pf] == [0, 1, 2]
    assert [b["n"] for b in pf] == [0, 1, 2]  # a list is re-iterable, so is the prefetcher
    assert list(DevicePrefetcher([], depth=2, ops=RecordingOps())) == []
    it = iter(DevicePrefetcher(src, ops=RecordingOps()))
    for _ in range(3):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_source_error_propagates():
    def bad():
        yield {"x": torch.zeros(1)}
        raise RuntimeError("boom")

    it = iter(DevicePrefetcher(bad(), depth=2, ops=RecordingOps()))
    with pytest.raises(RuntimeError, match="boom"):
        next(it)


def test_packed_batch_host_fields_untouched():
    rng = np.random.default_rng(0)
    samples = [
        {"input_ids": [1, 62, 60, 60, 63], "pixel_values": rng.random((8, 4), dtype=np.float32),
         "image_grid_thw": [[1, 2, 4]]},
        {"input_ids": [5, 6, 7]},
    ]  # fmt: skip
    coll = PackedCollator(rope="mrope", image_token_id=60, video_token_id=61, vision_start_token_id=62)
    host = coll(samples)
    (dev,) = list(DevicePrefetcher([host], ops=RecordingOps()))
    assert type(dev) is type(host)
    for name, value in host.items():
        moved = dev[name]
        if isinstance(value, torch.Tensor):
            assert moved is not value and torch.equal(moved, value), name  # copied
        else:
            assert moved is value, name  # host ints / lists / None: the very same object
    n_tensors = sum(isinstance(v, torch.Tensor) for v in host.values())
    assert sum(e[0] == "copy" for e in LOG) == n_tensors == sum(e[0] == "record_stream" for e in LOG)


Pair = namedtuple("Pair", "a b")


def test_containers():
    item = ({"t": torch.ones(2), "meta": [1, 2]}, [torch.zeros(1), 3], Pair(torch.ones(1), "s"))
    (out,) = list(DevicePrefetcher([item], ops=RecordingOps()))
    assert isinstance(out, tuple) and isinstance(out[2], Pair) and out[2].b == "s"
    assert out[0]["meta"] is item[0]["meta"] and out[1][1] == 3
    assert out[0]["t"] is not item[0]["t"] and torch.equal(out[0]["t"], item[0]["t"])
    assert len(list(iter_tensors(item))) == 3
    assert map_tensors(7, lambda t: t) == 7


def test_user_dict_batches_are_copied():
    """transformers' BatchEncoding / BatchFeature (what its data collators and processors return) are
    ``UserDict``s, not dicts: their tensors must reach the device too, in a batch of the same type
    that keeps its other attributes."""
    from collections import UserDict

    class Encoding(UserDict):  # the shape of transformers.BatchEncoding: data plus own attributes
        def __init__(self, data=None, encodings=None):
            super().__init__(data)
            self.encodings = encodings

    item = Encoding({"input_ids": torch.ones(2, 3), "n": 4}, encodings=["kept"])
    (out,) = list(DevicePrefetcher([item], ops=RecordingOps()))
    assert type(out) is Encoding and out.encodings == ["kept"] and out["n"] == 4
    assert out["input_ids"] is not item["input_ids"] and torch.equal(out["input_ids"], item["input_ids"])
    assert ("copy", (2, 3)) in LOG and ("record_stream", "main") in LOG
    assert item["input_ids"] is not out["input_ids"]  # the host batch is left as it was
    assert len(list(iter_tensors(item))) == 1


def test_transformers_batch_feature_is_copied():
    transformers = pytest.importorskip("transformers")
    feature = transformers.BatchFeature({"pixel_values": torch.zeros(4, 2),
                                         "image_grid_thw": torch.ones(1, 3, dtype=torch.long)})
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(1, 5, dtype=torch.long)})
    for item in (feature, encoding):
        (out,) = list(DevicePrefetcher([item], ops=RecordingOps()))
        assert type(out) is type(item) and out.keys() == item.keys()
        assert all(out[k] is not item[k] and torch.equal(out[k], item[k]) for k in item)


class NoReadback(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__"):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_never_reads_device_tensors_back():
    coll = PackedCollator(rope="1d")
    host = [coll([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]) for _ in range(3)]
    with NoReadback() as mode:
        out = list(DevicePrefetcher(host, depth=2, ops=RecordingOps()))
    assert mode.calls == []
    assert len(out) == 3
    with NoReadback() as mode:  # the mode does see these calls
        torch.ones(1).item(), torch.ones(1).tolist(), torch.ones(1).cpu()
    assert mode.calls == ["item", "tolist", "cpu"]


def test_cpu_passthrough():
    src = batches(3)
    pf = DevicePrefetcher(src, device="cpu", depth=5)
    assert not pf.uses_side_stream and pf.device == torch.device("cpu")
    assert all(a is b for a, b in zip(pf, src, strict=True))
    if not torch.accelerator.is_available():
        pf = DevicePrefetcher(src)  # default device on a CPU-only machine
        assert not pf.uses_side_stream and [b["n"] for b in pf] == [0, 1, 2]


class FakeAccelerator:
    """Stands in for ``torch.accelerator`` on a machine whose current accelerator is xpu:3."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_accelerator() -> torch.device:
        return torch.device("xpu")

    @staticmethod
    def current_device_index() -> int:
        return 3


def test_device_comes_from_torch_accelerator(monkeypatch):
    monkeypatch.setattr(torch, "accelerator", FakeAccelerator)
    assert resolve_device(None) == torch.device("xpu", 3)
    assert resolve_device("xpu") == torch.device("xpu", 3)
    assert resolve_device(1) == torch.device("xpu", 1)
    assert resolve_device("xpu:0") == torch.device("xpu", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    pf = DevicePrefetcher([], depth=2)  # nothing is touched on the device until iteration
    assert pf.device == torch.device("xpu", 3) and pf.uses_side_stream
    assert pf.ops.module is torch.xpu


def test_int_device_without_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("accelerator present")
    with pytest.raises(ValueError, match="no accelerator"):
        resolve_device(0)


def test_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher([], depth=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_gpu_script():
    assert _load_check_gpu().main([]) == 0


def _load_check_gpu():
    path = REPO / "scripts" / "check_gpu.py"
    spec = importlib.util.spec_from_file_location("check_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # a tiny model's forward/backward x2 plus references: ~3 s, ~10 s with cold imports
@pytest.mark.parametrize("family", ["Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL"])
def test_check_gpu_model_path_on_cpu(family, monkeypatch, capsys):
    """The script's collate -> prefetch -> packed fwd/bwd check and its report, run on CPU (sync
    recording reduced to warning capture): the packed loss equals the per-sample HF reference, so a
    CUDA run tests only CUDA behaviour."""
    pytest.importorskip("transformers")
    mod = _load_check_gpu()
    monkeypatch.setattr(mod.SyncRecorder, "record", mod.SyncRecorder.capture)
    assert mod.report_packed_model(torch.device("cpu"), torch.float32, strict=True, family=family) is False
    out = capsys.readouterr().out
    assert f"packed {family} fwd/bwd, float32" in out and ": ok" in out
    assert "synchronising calls in the steady pass: 0" in out
    if not torch.cuda.is_available():
        assert mod.main([]) == 0 and capsys.readouterr().out.strip() == "no CUDA, skipped"


def test_check_gpu_sync_attribution():
    """A sync warning raised from collate/ code is attributed to that line; one from here to the script."""
    import warnings

    mod = _load_check_gpu()
    rec = mod.SyncRecorder()
    with rec.capture():
        rec.phase = "steady batch 0 forward"
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert len(rec.events) == 1
    ev = rec.events[0]
    assert "test_prefetch.py" in ev.where and ev.owner == "other"  # not collate/, transformers, the script
    assert "synchronizing" in ev.code and ev.phase == "steady batch 0 forward"
    collate_ev = mod.SyncEvent(owner="collate", where="collate/x.py:1 in f", code="t.item()", phase="s b fwd")
    table, ours = mod.summarise([collate_ev, *rec.events])
    assert ours == 1 and table.splitlines()[0].strip().startswith("1x [collate]")
    assert mod.summarise([]) == ("    no synchronising call recorded", 0)


def test_an_accelerate_prepared_loader_is_prefetched_stateless_unless_it_wraps_a_stateful_one():
    # accelerate's DataLoaderShard (what accelerator.prepare returns) has state_dict and load_state_dict
    # whatever it wraps, and its state_dict raises AttributeError ('DataLoader' object has no attribute
    # 'dl_state_dict') around a plain DataLoader. The prefetcher took the methods for a stateful loader's and
    # snapshotted the state per batch: DevicePrefetcher(accelerator.prepare(loader)) crashed at its first
    # batch on every accelerator (the side-stream path; CPU is a passthrough).
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    prepared = Accelerator(cpu=True).prepare(DataLoader(list(range(10)), batch_size=3))
    pf = DevicePrefetcher(prepared, depth=2, ops=RecordingOps())
    assert [b.tolist() for b in pf] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(TypeError, match="wrapped DataLoaderShard has no state_dict"):
        pf.state_dict()
