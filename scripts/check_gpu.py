"""Check PackedCollator + DevicePrefetcher on a real CUDA device without host syncs.

Builds a few real PackedBatches (M-RoPE mode, images and videos), runs DevicePrefetcher over them
under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call raises) while a matmul
keeps the consumer stream busy, then compares every field with the host batch.
Exits 0 with "no CUDA, skipped" on machines without CUDA.

    python scripts/check_gpu.py
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import torch

# Run from a plain checkout too (no install): the repo root holds the `collate` package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from collate import DevicePrefetcher, PackedBatch, PackedCollator  # noqa: E402

IMG, VID, VS, VE = 60, 61, 62, 63


def make_batches(n: int, seed: int = 0) -> list[PackedBatch]:
    rng = np.random.default_rng(seed)
    coll = PackedCollator(
        rope="mrope", image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, tokens_per_second=2
    )
    out = []
    for _ in range(n):
        samples = []
        for _ in range(4):
            ids = list(rng.integers(0, 50, size=int(rng.integers(5, 200))))
            s: dict = {}
            if rng.random() < 0.7:
                g = np.array([[1, 2 * int(rng.integers(1, 20)), 2 * int(rng.integers(1, 20))]])
                ids += [VS] + [IMG] * int(g.prod() // 4) + [VE]
                s["image_grid_thw"] = g
                s["pixel_values"] = rng.standard_normal((int(g.prod()), 1176)).astype(np.float32)
            if rng.random() < 0.3:
                g = np.array([[3, 8, 8]])
                ids += [VS] + [VID] * int(g.prod() // 4) + [VE]
                s["video_grid_thw"] = g
                s["pixel_values_videos"] = rng.standard_normal((int(g.prod()), 1176)).astype(np.float32)
                s["second_per_grid_ts"] = [1.0]
            ids += list(rng.integers(0, 50, size=int(rng.integers(1, 50))))
            s["input_ids"] = np.asarray(ids, dtype=np.int64)
            samples.append(s)
        out.append(coll(samples))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA, skipped")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    host = make_batches(6)
    assert all(b.input_ids.is_pinned() for b in host), "collator should pin on a CUDA machine"
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
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()

    assert len(received) == len(host)
    for i, (h, d) in enumerate(zip(host, received, strict=True)):
        for name, hv in h.items():
            dv = d[name]
            if isinstance(hv, torch.Tensor):
                assert dv.device == device, (i, name, dv.device)
                assert torch.equal(dv.cpu(), hv), (i, name)
            else:
                assert dv is hv, (i, name)
        expect = h.input_ids.sum() + h.position_ids.sum() + h.cu_seqlens.sum()
        assert int(sums[i]) == int(expect), (i, int(sums[i]), int(expect))
    print(
        f"ok: {len(host)} PackedBatches prefetched to {device} with no host sync; "
        "every field equals the host batch"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
