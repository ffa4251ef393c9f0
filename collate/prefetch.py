"""DevicePrefetcher: copy batches to the accelerator on a side stream, ``depth`` batches ahead.

Per batch: on a side stream, every tensor is copied with ``non_blocking=True`` (truly async when
the host tensor is pinned, which PackedCollator does on accelerator machines), then an event is
recorded on the side stream. When the consumer asks for the batch, its current stream waits on
that event (a device-side wait, no host sync) and ``record_stream`` tells the caching allocator the
copies are used on the consumer stream, so their memory is not recycled while the step runs.
Host values (python ints, lists) pass through untouched and nothing is ever read back from the
device: no ``.item()``, ``.tolist()``, ``.cpu()``.

The handful of device calls go through :class:`StreamOps`, so tests can drive the exact same
scheduling on CPU with a recording implementation.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["DevicePrefetcher", "StreamOps", "iter_tensors", "map_tensors", "resolve_device"]


class StreamOps:
    """Stream/event calls for one device, through its torch module (``torch.cuda``, ``torch.npu``,
    ``torch.xpu``: they share this API)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = getattr(torch, device.type)

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device)

    def use_stream(self, stream: Any) -> Any:
        """Context manager making ``stream`` current."""
        return self.module.stream(stream)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def record_event(self, stream: Any) -> Any:
        event = self.module.Event()
        event.record(stream)
        return event

    def consumer_stream(self) -> Any:
        return self.module.current_stream(self.device)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``None`` -> the current accelerator (CUDA, NPU, XPU, ... via ``torch.accelerator``) or CPU;
    a device without an index (``"cuda"``, ``"npu"``) -> that type with the current device index.

    An ``int`` is an index on the current accelerator, as in ``torch.device(int)``.
    """
    acc = getattr(torch, "accelerator", None)
    acc_type = None
    if acc is not None and acc.is_available():
        acc_type = acc.current_accelerator().type
    if device is None:
        if acc_type is None:
            return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = acc_type
    elif isinstance(device, int):
        if acc_type is None:
            raise ValueError(f"device={device} names an accelerator index, but no accelerator is available")
        device = torch.device(acc_type, device)
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        if device.type == acc_type:
            device = torch.device(device.type, acc.current_device_index())  # type: ignore[union-attr]
        else:
            module = getattr(torch, device.type, None)
            if hasattr(module, "current_device"):
                device = torch.device(device.type, module.current_device())
    return device


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in dataclasses (e.g. PackedBatch), dicts, ``UserDict``s
    (transformers' ``BatchEncoding`` / ``BatchFeature``), lists, tuples and namedtuples; everything
    else (ints, lists of ints, strings) is returned as the same object."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, collections.UserDict):
        # A shallow copy keeps the type and its own attributes (BatchEncoding's encodings); only
        # the mapping is replaced. Its constructor may take other arguments, so it is not called.
        out = copy.copy(obj)
        out.data = {k: map_tensors(v, fn) for k, v in obj.data.items()}
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        if not any(_has_tensor(v) for v in obj):
            return obj  # host lists (seq_lens, cu_seqlens_list) stay the very same object
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return isinstance(obj, (dict, collections.UserDict)) or dataclasses.is_dataclass(obj)


class DevicePrefetcher:
    """Iterate ``iterable`` and yield its batches already on ``device``.

    ``depth`` is how many batches have their copy issued before one is handed over: when batch ``i``
    is yielded, batches ``i+1 .. i+depth-1`` are already in flight (``depth=2`` is double
    buffering; ``depth=1`` still copies on the side stream but does not overlap). On CPU (or
    ``device="cpu"``) this is a plain passthrough. Re-iterable when ``iterable`` is (e.g. a
    DataLoader, once per epoch). ``ops`` replaces the device backend (tests pass a recording one).

    Over a DataLoader whose ``batch_sampler`` is a ``TokenBalancedBatchSampler``, a ``load_state_dict``
    inside the loop (a rollback) drops the batches the prefetcher holds that were fetched before the load,
    so the loop's next batch is the loaded one; under ``sampler.track(prefetcher)`` track does that.
    Around a torchdata ``StatefulDataLoader``, checkpoint :meth:`state_dict` (the loader's state as of the
    batch the loop last received), not the loader's own, which counts the batches held here.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        device: torch.device | str | int | None = None,
        depth: int = 2,
        *,
        ops: StreamOps | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        _refuse_counted_iterable(iterable)
        self.iterable = iterable
        self.depth = depth
        self._delivered_state: dict[str, Any] | None = None
        self.ops: StreamOps | None = ops
        if ops is not None:
            self.device = ops.device
        else:
            self.device = resolve_device(device)
            module = getattr(torch, self.device.type, None)
            if self.device.type != "cpu" and all(
                hasattr(module, name) for name in ("Stream", "Event", "stream", "current_stream")
            ):
                self.ops = StreamOps(self.device)

    @property
    def uses_side_stream(self) -> bool:
        return self.ops is not None

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's ``state_dict()`` (torchdata's ``StatefulDataLoader``) as of the last batch
        this prefetcher handed to the loop. The loader's own counts the batches it gave the prefetcher,
        up to ``depth - 1`` more than the loop has received: a resume from it would skip those. Checkpoint
        this one, and restore with :meth:`load_state_dict` (or the loader's own)."""
        if not _stateful(self.iterable):
            raise TypeError(f"DevicePrefetcher.state_dict: the wrapped {type(self.iterable).__name__} has no "
                            "state_dict() (a torchdata StatefulDataLoader has)")
        if self._delivered_state is not None:
            return self._delivered_state
        return self.iterable.state_dict()   # nothing read ahead (no pass running, or a passthrough)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped loader's state (what :meth:`state_dict` returned); the next pass resumes."""
        self._delivered_state = None
        self.iterable.load_state_dict(state)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        self._delivered_state = None
        if self.ops is not None:
            yield from self._prefetch(iter(self.iterable), self.ops, _tokenbal_sampler(self.iterable))
        elif self.device.type == "cpu":
            yield from self.iterable
        else:
            # A backend without a stream API (e.g. MPS): plain copies, still correct.
            for batch in self.iterable:
                yield map_tensors(batch, lambda t: t.to(self.device))

    def _prefetch(self, source: Iterator[Any], ops: StreamOps, sampler: Any = None) -> Iterator[Any]:
        # Copies allocate on the side stream; record_stream (below) keeps the caching allocator from
        # handing those blocks back to the side stream before the consumer's work on them is done.
        side = ops.new_stream()
        in_flight: collections.deque[tuple[Any, Any, Any, int, Any]] = collections.deque()
        # A stateful loader's state as of each batch it gives here, handed over with the batch (state_dict).
        snapshot = self.iterable.state_dict if _stateful(self.iterable) else None
        while True:
            # the sampler's pass_token() and rollback_mark() once this pass's first batch is fetched
            token: list = []
            try:
                yield from self._hand_over(source, ops, sampler, side, in_flight, snapshot, token)
            except GeneratorExit:
                # The loop stopped early (a break for an eval): the batches held here never reach it. Tell the
                # sampler what the loop received, so a new pass continues there rather than after them.
                if sampler is not None and token:
                    sampler.reader_stopped(source, len(in_flight), token[0])
                raise
            if sampler is None or not token or not sampler.fetched_before_load(token[1][0]) \
                    or not sampler.rolled_back_since(token[1]):
                return
            # A rollback in the loop (a load of this pass's plan) after the DataLoader had handed over its
            # last batch: it ended its pass without the loaded batches, where with nothing reading ahead the
            # loop goes on at the loaded batch. Go on the same way: a new pass of the loader starts there.
            # (Under track, which counts the passes itself, track does this.)
            source = iter(self.iterable)

    def _hand_over(self, source: Iterator[Any], ops: StreamOps, sampler: Any, side: Any,
                   in_flight: collections.deque, snapshot: Any, token: list) -> Iterator[Any]:
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < self.depth:
                try:
                    host = next(source)
                except StopIteration:
                    exhausted = True
                    break
                with ops.use_stream(side):
                    moved = map_tensors(host, ops.copy)
                    event = ops.record_event(side)
                # Holding the host batch until hand-over keeps its pinned buffers alive for the copy
                # even with allocators that do not track host-side stream use.
                in_flight.append((host, moved, event, 0 if sampler is None else sampler.loads(),
                                  None if snapshot is None else snapshot()))
                if sampler is not None and not token:
                    token += [sampler.pass_token(), sampler.rollback_mark()]
            if not in_flight:
                self._delivered_state = None   # the pass is over: the loader's own state is the loop's
                return
            host, moved, event, loads, state = in_flight.popleft()
            if sampler is not None and sampler.fetched_before_load(loads):
                # The tokenbal sampler was loaded (a rollback inside the loop) after this batch was fetched:
                # it is not the loaded position's, and the loop's next batch must be the loaded one (as
                # with no read-ahead at all).
                continue
            consumer = ops.consumer_stream()
            ops.wait_event(consumer, event)
            for tensor in iter_tensors(moved):
                ops.record_stream(tensor, consumer)
            del host
            if state is not None:
                self._delivered_state = state
            yield moved


def _stateful(iterable: Any) -> bool:
    """``iterable`` saves and restores its position (torchdata's ``StatefulDataLoader``). An adapter around
    another loader (accelerate's ``DataLoaderShard``, whose ``base_dataloader`` it is) has ``state_dict`` /
    ``load_state_dict`` whatever it wraps, and they work only when that loader is stateful (its
    ``state_dict`` raises ``AttributeError: ... 'dl_state_dict'`` around a plain DataLoader)."""
    base = getattr(iterable, "base_dataloader", None)
    if base is not None:
        return _stateful(base)
    return all(callable(getattr(iterable, name, None)) for name in ("state_dict", "load_state_dict"))


def _refuse_counted_iterable(iterable: Any) -> None:
    """``DevicePrefetcher(sampler.track(loader))`` (or around ``prepare_loader``'s loader): track would
    count the batches the prefetcher fetched (up to ``depth`` ahead of the loop) as received, so
    ``state_dict()`` would save a step the loop has not reached and a resume would skip those batches. On
    CPU (a passthrough) nothing is ahead, but the same code on a device would skip: refused everywhere,
    naming the order that works."""
    if "tokenbal" not in sys.modules:
        return
    from tokenbal.balance.sampler import TokenBalancedBatchSampler

    if getattr(iterable, "gi_code", None) is TokenBalancedBatchSampler.track.__code__:
        raise ValueError("DevicePrefetcher(sampler.track(loader)): track must be outermost, "
                         "sampler.track(DevicePrefetcher(loader)), so that it counts the batches the loop "
                         "receives, not the ones the prefetcher fetched ahead (a resume would skip them)")
    if getattr(type(iterable), "counts_received_batches", False) is True:
        # tokenbal.integrations.accelerate.TokenBalancedLoader: the same count, one level up.
        raise ValueError(f"DevicePrefetcher({type(iterable).__name__}): that loader counts the batches it "
                         "yields as received by the training loop, and the prefetcher fetches them ahead of "
                         "the loop (a resume would skip them). accelerate already places its batches on the "
                         "device: iterate the prepared loader directly")
    accelerate_loader = getattr(iterable, "base_dataloader", None) is not None
    if accelerate_loader and _tokenbal_sampler(iterable, through_wrappers=True) is not None:
        # accelerate's DataLoaderShard (tokenbal.integrations.accelerate.neutralise, a skip_first_batches
        # loader of it): it fetches each batch one step before it yields it, to mark the last one. A batch it
        # gives here after a load_state_dict in the loop may have been fetched before the load, which the
        # prefetcher cannot tell (measured: a stale batch trained after the load, two skipped after a break).
        raise ValueError(f"DevicePrefetcher({type(iterable).__name__}) over a TokenBalancedBatchSampler: "
                         "accelerate's prepared loader fetches each batch one step before it yields it, so a "
                         "load_state_dict inside the loop would train a batch fetched before the load and a "
                         "break would skip batches. accelerate already places its batches on the device: "
                         "iterate the prepared loader directly, through "
                         "tokenbal.integrations.accelerate.prepare_loader (which counts the batches the loop "
                         "receives)")


def _tokenbal_sampler(iterable: Any, through_wrappers: bool = False) -> Any:
    """The ``TokenBalancedBatchSampler`` a DataLoader draws its batches from (its ``batch_sampler``; with
    ``through_wrappers`` also one that accelerate's ``BatchSamplerShard`` / ``SkipBatchSampler`` keep as their
    ``batch_sampler``), or None: the prefetcher then drops the batches it holds that were fetched before a
    ``load_state_dict``."""
    sampler = getattr(iterable, "batch_sampler", None)
    if sampler is None or "tokenbal" not in sys.modules:
        return None   # no tokenbal sampler can exist without tokenbal imported
    from tokenbal.balance.sampler import TokenBalancedBatchSampler

    for _ in range(8 if through_wrappers else 1):   # a chain of wrappers, never a cycle's worth
        if sampler is None or isinstance(sampler, TokenBalancedBatchSampler):
            break
        sampler = getattr(sampler, "batch_sampler", None)
    return sampler if isinstance(sampler, TokenBalancedBatchSampler) else None


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (same containers as :func:`map_tensors`)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
    elif isinstance(obj, (dict, collections.UserDict)):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
