"""One-shot CUDA check of the packed data path: collate -> prefetch -> packed Qwen2/2.5/3-VL fwd/bwd.

Run on any CUDA machine from a checkout (no install needed, no downloads; tiny random models):

    python scripts/check_gpu.py            # exit 0: all checks passed; 1: a check failed
    python scripts/check_gpu.py --strict   # also exit 1 if code under collate/ synchronises

1. prefetcher: real PackedBatches (M-RoPE, images and videos, pinned by the collator) go through
   ``DevicePrefetcher`` under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call
   raises) while matmuls keep the consumer stream busy; every field must equal the host batch.
2. packed model, fp32 and bf16: a tiny random ``Qwen2VLForConditionalGeneration``, a
   ``Qwen2_5_VLForConditionalGeneration`` (windowed vision attention, timed video positions) and a
   ``Qwen3VLForConditionalGeneration`` (interleaved M-RoPE, DeepStack, per-frame video) with
   ``collate.models.enable_packed``; two packed batches (one with images and a video, one text-only,
   which runs the idle vision pass) from ``PackedCollator`` through ``DevicePrefetcher``, forward + backward
   under ``set_sync_debug_mode("warn")``. Every synchronising call is recorded with its python stack
   and reported by the line that issued it (collate/, transformers, or this script), so the summary
   says which ops sync instead of crashing at the first. Syncs inside ``loss.backward()`` surface
   (torch re-raises autograd-thread warnings in the caller) at this script's backward line, phase
   "backward". The loss must equal the token-weighted
   mean of per-sample unpacked HF losses (transformers computing its own positions). One warm-up
   pass runs first so one-time initialisation (cuBLAS handles, Triton compiles) is not counted.

Exits 0 with "no CUDA, skipped" on machines without CUDA. The model check also runs on CPU
(without sync recording) from tests/collate/test_prefetch.py, so its logic is tested everywhere.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import inspect
import pathlib
import sys
import traceback
import warnings
from collections.abc import Iterator

import numpy as np
import torch

# Run from a plain checkout too (no install): the repo root holds the `collate` package.
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from collate import DevicePrefetcher, PackedBatch, PackedCollator  # noqa: E402
from collate.prefetch import iter_tensors  # noqa: E402

IMG, VID, VS, VE = 120, 121, 122, 123
_TOKEN_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
VOCAB = 128
TOKENS_PER_SECOND = 2
PATCH_DIM = 3 * 2 * 14 * 14


# -- 1. prefetcher under "error" ------------------------------------------------------------------
def make_batches(n: int, seed: int = 0) -> list[PackedBatch]:
    rng = np.random.default_rng(seed)
    coll = PackedCollator(
        rope="mrope", image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, tokens_per_second=2
    )
    out = []
    for _ in range(n):
        samples = []
        for _ in range(4):
            ids = list(rng.integers(0, 100, size=int(rng.integers(5, 200))))
            s: dict = {}
            if rng.random() < 0.7:
                g = np.array([[1, 2 * int(rng.integers(1, 20)), 2 * int(rng.integers(1, 20))]])
                ids += [VS] + [IMG] * int(g.prod() // 4) + [VE]
                s["image_grid_thw"] = g
                s["pixel_values"] = rng.standard_normal((int(g.prod()), PATCH_DIM)).astype(np.float32)
            if rng.random() < 0.3:
                g = np.array([[3, 8, 8]])
                ids += [VS] + [VID] * int(g.prod() // 4) + [VE]
                s["video_grid_thw"] = g
                s["pixel_values_videos"] = rng.standard_normal((int(g.prod()), PATCH_DIM)).astype(np.float32)
                s["second_per_grid_ts"] = [1.0]
            ids += list(rng.integers(0, 100, size=int(rng.integers(1, 50))))
            s["input_ids"] = np.asarray(ids, dtype=np.int64)
            samples.append(s)
        out.append(coll(samples))
    return out


def check_prefetcher(device: torch.device) -> list[str]:
    """Problems found (empty: passed)."""
    host = make_batches(6)
    if not all(t.is_pinned() for b in host for t in iter_tensors(b)):
        return ["collator did not pin its tensors on a CUDA machine"]
    busy = torch.randn(2048, 2048, device=device)
    busy = torch.tanh(busy @ busy * 1e-3)  # create the cuBLAS handle before sync checking starts
    torch.cuda.synchronize()

    received: list[PackedBatch] = []
    sums = []
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in DevicePrefetcher(host, device=device, depth=2):
            # Keep the consumer stream busy so that copies for the next batch overlap with work.
            for _ in range(4):
                busy = torch.tanh(busy @ busy * 1e-3)
            # Use the tensors on the consumer stream, like a model would.
            sums.append(batch.input_ids.sum() + batch.position_ids.sum() + batch.cu_seqlens.sum())
            received.append(batch)
    except RuntimeError as e:
        torch.cuda.set_sync_debug_mode(prev)
        return [f"prefetcher synchronised: {e} at\n{traceback.format_exc(limit=-4)}"]
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()

    problems = []
    if len(received) != len(host):
        problems.append(f"got {len(received)} batches, sent {len(host)}")
    for i, (h, d) in enumerate(zip(host, received, strict=False)):
        for name, hv in h.items():
            dv = d[name]
            if isinstance(hv, torch.Tensor):
                if dv.device != device or not torch.equal(dv.cpu(), hv):
                    problems.append(f"batch {i} field {name}: device copy differs (on {dv.device})")
            elif dv is not hv:
                problems.append(f"batch {i} host field {name} was replaced")
        expect = h.input_ids.sum() + h.position_ids.sum() + h.cu_seqlens.sum()
        if int(sums[i]) != int(expect):
            problems.append(f"batch {i}: consumer-stream sum {int(sums[i])} != {int(expect)} (race?)")
    return problems


# -- 2. packed model under "warn", syncs recorded -------------------------------------------------
@dataclasses.dataclass
class SyncEvent:
    owner: str  # "collate" | "transformers" | "script" | "torch" | "other"
    where: str  # innermost non-torch frame: path:line in function
    code: str  # its source line
    phase: str


class SyncRecorder:
    """Records every "synchronizing CUDA operation" warning with the python line that caused it."""

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self.phase = ""

    @contextlib.contextmanager
    def record(self) -> Iterator[SyncRecorder]:
        """CUDA sync debug mode "warn" + :meth:`capture`."""
        prev_mode = torch.cuda.get_sync_debug_mode()
        with self.capture():
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(prev_mode)

    @contextlib.contextmanager
    def capture(self) -> Iterator[SyncRecorder]:
        """Route warnings to :meth:`_on_warning`; "always", so a sync in a loop is counted every time."""
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self._on_warning  # type: ignore[assignment]  (restored on exit)
            yield self

    def _on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if "synchroniz" not in str(message):
            return
        # The warning is raised synchronously inside the op, so the python stack is the caller's.
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        origin = next((f for f in reversed(frames) if not _is_torch(f.filename)), frames[-1])
        self.events.append(
            SyncEvent(
                owner=_owner(origin.filename),
                where=f"{_short(origin.filename)}:{origin.lineno} in {origin.name}",
                code=(origin.line or "").strip(),
                phase=self.phase,
            )
        )


def _is_torch(path: str) -> bool:
    p = pathlib.Path(path).as_posix()
    return "/torch/" in p and not p.startswith(REPO.as_posix())


def _owner(path: str) -> str:
    p = pathlib.Path(path).resolve().as_posix()
    if p.startswith((REPO / "collate").as_posix()):
        return "collate"
    if "/transformers/" in p:
        return "transformers"
    if p == pathlib.Path(__file__).resolve().as_posix():
        return "script"
    return "torch" if "/torch/" in p else "other"


def _short(path: str) -> str:
    p = pathlib.Path(path).as_posix()
    for marker in ("/collate/", "/transformers/", "/torch/", "/scripts/"):
        if marker in p:
            return marker.strip("/") + "/" + p.split(marker, 1)[1]
    return p


def tiny_qwen2vl_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2
        ),
        **_TOKEN_IDS,
        attn_implementation="sdpa",
    )


def tiny_qwen2_5vl_config():
    """Qwen2.5-VL: windowed vision attention (56 px = 2 merged tokens, so the test frames are cut
    into full and partial windows; block 1 attends over whole frames) and timed video positions."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=tiny_qwen2vl_config().text_config.to_dict(),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, tokens_per_second=TOKENS_PER_SECOND,
        ),
        **_TOKEN_IDS,
        attn_implementation="sdpa",
    )


def tiny_qwen3vl_config():
    """Qwen3-VL: q/k head norms, interleaved M-RoPE (section 6, 5, 5 over head_dim 32), DeepStack
    from vision blocks 0 and 1 into text layers 0 and 1, a 4 x 4 learned position grid interpolated
    to every image."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, bos_token_id=None,
            eos_token_id=None, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[6, 5, 5],
                                 mrope_interleaved=True),
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        ),
        **_TOKEN_IDS,
        attn_implementation="sdpa",
    )


# model family -> (transformers class name, tiny config, video frames laid out one by one)
FAMILIES = {
    "Qwen2-VL": ("Qwen2VLForConditionalGeneration", tiny_qwen2vl_config, False),
    "Qwen2.5-VL": ("Qwen2_5_VLForConditionalGeneration", tiny_qwen2_5vl_config, False),
    "Qwen3-VL": ("Qwen3VLForConditionalGeneration", tiny_qwen3vl_config, True),
}


def model_samples(seed: int = 1, frames_apart: bool = False) -> list[list[dict]]:
    """Two packed batches of host samples: text, images and a video (2 frames, 0.5 s per temporal
    patch); then text only. ``frames_apart``: Qwen3-VL's layout, every frame with its own
    timestamp text and ``<vision_start> ... <vision_end>`` (its timing is text, so no seconds)."""
    g = torch.Generator().manual_seed(seed)

    def sample(spec: list) -> dict:
        ids: list[int] = []
        media: dict[str, tuple[list, list]] = {"image": ([], []), "video": ([], [])}
        for kind, arg in spec:
            if kind == "text":
                ids += torch.randint(0, 100, (arg,), generator=g).tolist()
            else:
                t, h, w = arg
                if kind == "video" and frames_apart:
                    for _ in range(t):  # "<t.t seconds>" then the frame
                        ids += torch.randint(0, 100, (2,), generator=g).tolist()
                        ids += [VS] + [VID] * (h * w // 4) + [VE]
                else:
                    ids += [VS] + [IMG if kind == "image" else VID] * (t * h * w // 4) + [VE]
                media[kind][0].append(list(arg))
                media[kind][1].append(torch.randn(t * h * w, PATCH_DIM, generator=g))
        s: dict = {"input_ids": torch.tensor(ids)}
        labels = s["input_ids"].clone()
        labels[(s["input_ids"] == IMG) | (s["input_ids"] == VID)] = -100
        s["labels"] = labels
        for kind, (pv_key, grid_key) in (("image", ("pixel_values", "image_grid_thw")),
                                          ("video", ("pixel_values_videos", "video_grid_thw"))):
            grids, pixels = media[kind]
            if grids:
                s[pv_key] = torch.cat(pixels)
                s[grid_key] = torch.tensor(grids)
        if media["video"][0] and not frames_apart:
            s["second_per_grid_ts"] = torch.full((len(media["video"][0]),), 0.5)
        return s

    with_vision = [
        sample([("text", 9)]),
        sample([("text", 3), ("image", (1, 4, 6)), ("text", 5)]),
        sample([("text", 2), ("image", (1, 6, 4)), ("text", 4), ("image", (1, 2, 2)), ("text", 3)]),
        sample([("text", 4), ("video", (2, 4, 4)), ("text", 6)]),
    ]
    text_only = [sample([("text", 13)]), sample([("text", 21)])]
    return [with_vision, text_only]


def reference_loss(model, samples: list[dict], device: torch.device) -> torch.Tensor:
    """Token-weighted mean of per-sample unpacked HF losses (transformers computes the positions)."""
    total, count = 0.0, 0
    for s in samples:
        ids = s["input_ids"][None].to(device)
        kw = {"input_ids": ids, "labels": s["labels"][None].to(device)}
        vision = {k: v.to(device) for k, v in s.items() if k not in ("input_ids", "labels")}
        if vision:
            # transformers' get_rope_index groups the placeholders by modality: 1 image, 2 video.
            vision["mm_token_type_ids"] = (ids == IMG).int() + 2 * (ids == VID).int()
            if "second_per_grid_ts" in vision and "second_per_grid_ts" not in inspect.signature(
                    model.forward).parameters:
                del vision["second_per_grid_ts"]  # Qwen2-VL's positions have no video timing
        n = int((s["labels"][1:] != -100).sum())
        total = total + model(**kw, **vision).loss.float() * n
        count += n
    return total / count


def check_packed_model(
    device: torch.device, dtype: torch.dtype, recorder: SyncRecorder | None = None, family: str = "Qwen2-VL"
) -> dict:
    """Collate -> prefetch -> packed forward/backward of one of :data:`FAMILIES`. Returns a result
    dict (``problems`` empty: ok)."""
    import transformers

    from collate.models import enable_packed

    class_name, make_config, frames_apart = FAMILIES[family]
    torch.manual_seed(0)
    ref = getattr(transformers, class_name)(make_config()).to(device=device, dtype=dtype).eval()
    model = enable_packed(copy.deepcopy(ref))
    coll = PackedCollator.from_config(model.config)
    groups = model_samples(frames_apart=frames_apart)
    host = [coll(samples) for samples in groups]

    def run(tag: str) -> list[torch.Tensor]:
        losses = []
        model.zero_grad(set_to_none=True)
        for k, batch in enumerate(DevicePrefetcher(host, device=device, depth=2)):
            if recorder is not None:
                recorder.phase = f"{tag} batch {k} forward"
            loss = model(**batch).loss
            if recorder is not None:
                recorder.phase = f"{tag} batch {k} backward"
            loss.backward()
            losses.append(loss.detach())
        return losses

    if device.type == "cuda":
        run("warm-up")
        torch.cuda.synchronize()
    ctx = recorder.record() if recorder is not None else contextlib.nullcontext()
    with ctx:
        losses = run("steady")
    if device.type == "cuda":
        torch.cuda.synchronize()

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    problems = []
    got = [float(x) for x in losses]
    with torch.no_grad():
        want = [float(reference_loss(ref, samples, device)) for samples in groups]
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if not (np.isfinite(a) and abs(a - b) <= tol * abs(b)):
            problems.append(f"batch {k}: packed loss {a:.6f} vs per-sample HF {b:.6f} (rtol {tol})")
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    if not all(gr is not None and bool(torch.isfinite(gr).all()) for gr in grads):
        problems.append("some parameter has no or a non-finite gradient")
    if host[0].pixel_values_videos is None or host[1].pixel_values is not None:
        problems.append("test setup: expected one batch with images and videos and one without")
    windows, frames = host[0].vision_cu_window_seqlens_list, host[0].vision_cu_seqlens_list
    if family == "Qwen2.5-VL" and len(windows or []) <= len(frames):
        problems.append("test setup: the Qwen2.5-VL windows should cut the frames")
    return {"dtype": str(dtype).replace("torch.", ""), "losses": got, "reference": want, "problems": problems}


def summarise(events: list[SyncEvent]) -> tuple[str, int]:
    """Printable table of sync sites and the number of them inside collate/."""
    if not events:
        return "    no synchronising call recorded", 0
    sites: collections.Counter = collections.Counter((e.owner, e.where, e.code) for e in events)
    phases: dict = collections.defaultdict(set)
    for e in events:
        phases[(e.owner, e.where, e.code)].add(e.phase.split(" ", 1)[1])
    lines = []
    for (owner, where, code), n in sorted(sites.items(), key=lambda kv: (kv[0][0] != "collate", -kv[1])):
        when = ", ".join(sorted(phases[(owner, where, code)]))
        lines.append(f"    {n:3d}x [{owner}] {where}\n          {code}   ({when})")
    ours = sum(n for (owner, _, _), n in sites.items() if owner == "collate")
    return "\n".join(lines), ours


def _backend_name(module: object, selector: str, device: torch.device, dtype: torch.dtype) -> str:
    # Private dispatch helpers of collate.ops; only for the report, so never fail on them.
    try:
        chosen = getattr(module, selector)(device, dtype)
    except Exception as e:
        return f"? ({type(e).__name__})"
    return chosen if isinstance(chosen, str) else getattr(chosen, "__name__", repr(chosen))


def report_packed_model(device: torch.device, dtype: torch.dtype, strict: bool, family: str = "Qwen2-VL"
                        ) -> bool:
    """Run :func:`check_packed_model` with sync recording and print its report; True if it failed."""
    import transformers

    import collate.ops.attention
    import collate.ops.rope

    rec = SyncRecorder()
    try:
        res = check_packed_model(device, dtype, rec, family)
    except Exception:  # report and let the caller go on with the next dtype
        print(f"\n[2] packed {family} {dtype}: CRASH\n{traceback.format_exc()}")
        return True
    table, ours = summarise(rec.events)
    status = "FAIL" if res["problems"] else "ok"
    print(
        f"\n[2] collate -> prefetch -> packed {family} fwd/bwd, {res['dtype']} "
        f"(transformers {transformers.__version__}, attention "
        f"{_backend_name(collate.ops.attention, '_select', device, dtype)}, rope "
        f"{_backend_name(collate.ops.rope, '_select_backend', device, dtype)}): {status}"
    )
    got = ", ".join(f"{x:.5f}" for x in res["losses"])
    want = ", ".join(f"{x:.5f}" for x in res["reference"])
    print(f"    packed losses [{got}] vs per-sample HF [{want}]")
    for p in res["problems"]:
        print(f"    {p}")
    print(f"    synchronising calls in the steady pass: {len(rec.events)} ({ours} inside collate/)")
    print(table)
    return bool(res["problems"]) or (strict and ours > 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CUDA check: collate -> prefetch -> packed model, host syncs")
    ap.add_argument("--strict", action="store_true", help="exit 1 if code under collate/ synchronises")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA, skipped")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 loss comparison at 1e-4
    torch.backends.cudnn.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")

    problems = check_prefetcher(device)
    print(f"\n[1] DevicePrefetcher, 6 PackedBatches, sync debug mode 'error': {'FAIL' if problems else 'ok'}")
    for p in problems:
        print(f"    {p}")
    failed = bool(problems)

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("\n[2] packed model: transformers not installed, skipped")
    else:
        for family in FAMILIES:
            for dtype in (torch.float32, torch.bfloat16):
                failed |= report_packed_model(device, dtype, args.strict, family)

    print("\nsummary:", "FAILED" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
