"""Benchmark fused mixed-dim RoPE against the slice / rotate / concat path frameworks use.

CPU part (always):
  * ``fused``   -- ``collate.apply_mrope`` (the vectorised reference backend on CPU): one gather of
                   the per-frequency axis, fp32 angles, one rotation of the whole packed tensor.
  * ``hf``      -- transformers-5.x style on the packed tensor: materialise (T, D) cos/sin in x's dtype
                   (``cat(freqs, freqs)``), ``x * cos + rotate_half(x) * sin``.
  * ``slice``   -- the per-modality path: slice the packed tensor into text and vision runs, build
                   1-D cos/sin for text runs and 3-D M-RoPE cos/sin for vision runs (HF style), rotate
                   each run, ``torch.cat`` the runs back.
  Reports median time (forward, and forward + backward) and bytes allocated per call (sum of the
  storages of every tensor the ops create, counted with a TorchDispatchMode), plus ratios.

GPU part (only when CUDA is available): the Triton kernel vs the eager reference vs the slice path vs
Liger-Kernel's Qwen2-VL M-RoPE (if ``liger_kernel`` imports; chunked layout only), forward and
forward + backward, as achieved GB/s (q/k read + write, positions read) against a measured
device-to-device copy bandwidth.

    python scripts/bench_rope.py                      # CPU part, plus GPU part if CUDA is present
    python scripts/bench_rope.py --tokens 4096 --repeats 15 --dtype bf16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Callable

import torch
from harness import environment_line, measure
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from collate import apply_mrope
from collate.ops.rope.reference import apply_mrope_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- workload


def packed_batch(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, int, bool]]]:
    """Qwen2-VL-like packed positions (3, T) and the (start, end, is_vision) runs that make them up.

    Samples: text, one image of a random LLM grid (1, h, w), text; positions restart per sample;
    text after an image continues at start + max(h, w) (transformers 5.x).
    """
    g = torch.Generator().manual_seed(seed)
    cols, runs, total = [], [], 0
    while total < num_tokens:
        a = int(torch.randint(16, 200, (1,), generator=g))
        h = int(torch.randint(8, 33, (1,), generator=g))
        w = int(torch.randint(8, 33, (1,), generator=g))
        b = int(torch.randint(16, 400, (1,), generator=g))
        text_a = torch.arange(a).expand(3, -1)
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        vis = torch.stack([torch.zeros(h * w, dtype=torch.long), hh.flatten(), ww.flatten()]) + a
        text_b = torch.arange(b).expand(3, -1) + a + max(h, w)
        for part, is_vis in ((text_a, False), (vis, True), (text_b, False)):
            n = part.shape[1]
            runs.append((total, total + n, is_vis))
            cols.append(part)
            total += n
    pos = torch.cat(cols, dim=1)[:, :num_tokens].contiguous()
    clipped = []
    for s, e, v in runs:
        if s < num_tokens:
            clipped.append((s, min(e, num_tokens), v))
    return pos, clipped


def inv_freq(rotary_dim: int, theta: float = 1e6, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))


# ---------------------------------------------------------------- baselines (HF / framework style)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_cos_sin(pos3: torch.Tensor, inv: torch.Tensor, section, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 5.x Qwen2VLRotaryEmbedding: (3, L, D/2) freqs, chunked recomposition, cat -> (L, D)."""
    freqs = pos3[..., None].float() * inv.float()
    cos, sin = freqs.cos(), freqs.sin()

    def recompose(f: torch.Tensor) -> torch.Tensor:
        f = torch.cat([m[i % 3] for i, m in enumerate(f.split(list(section), dim=-1))], dim=-1)
        return torch.cat((f, f), dim=-1)

    return recompose(cos).to(dtype), recompose(sin).to(dtype)


def _hf_1d_cos_sin(pos1: torch.Tensor, inv: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos1[:, None].float() * inv.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hf_packed(q, k, pos, inv, section, runs=None):
    cos, sin = _hf_cos_sin(pos, inv, section, q.dtype)
    c, s = cos[:, None, :], sin[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def slice_rotate_concat(q, k, pos, inv, section, runs):
    q_parts, k_parts = [], []
    for start, end, is_vision in runs:
        if is_vision:
            cos, sin = _hf_cos_sin(pos[:, start:end], inv, section, q.dtype)
        else:
            cos, sin = _hf_1d_cos_sin(pos[0, start:end], inv, q.dtype)
        c, s = cos[:, None, :], sin[:, None, :]
        qs, ks = q[start:end], k[start:end]
        q_parts.append(qs * c + _rotate_half(qs) * s)
        k_parts.append(ks * c + _rotate_half(ks) * s)
    return torch.cat(q_parts, dim=0), torch.cat(k_parts, dim=0)


def fused(q, k, pos, inv, section, runs=None):
    return apply_mrope(q, k, pos, inv, section)  # rope_cpu on CPU


def reference(q, k, pos, inv, section, runs=None):
    return apply_mrope_reference(q, k, pos, inv, section)


# ---------------------------------------------------------------- measurement


class AllocCounter(TorchDispatchMode):
    """Bytes of the new storages ops create: cumulative ``bytes`` and ``peak`` live at op boundaries.

    Views of inputs or of live intermediates are not counted; frees are seen through storage weakrefs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.peak = 0
        self.tensors = 0
        self._live: list[tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = [*args, *(kwargs or {}).values()]  # out= tensors arrive as kwargs
        inputs = set()
        for a in given:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    inputs.add(t.untyped_storage().data_ptr())
        self._live = [entry for entry in self._live if not entry[0].expired()]
        live_ptrs = {ptr for _, ptr, _ in self._live}
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in inputs and ptr not in live_ptrs:
                    live_ptrs.add(ptr)
                    self._live.append((StorageWeakRef(storage), ptr, storage.nbytes()))
                    self.bytes += storage.nbytes()
                    self.tensors += 1
        self.peak = max(self.peak, sum(n for ref, _, n in self._live if not ref.expired()))
        return out


def _fwd_bwd(fn, q0, k0, pos, inv, section, runs):
    q, k = q0.detach().requires_grad_(), k0.detach().requires_grad_()
    qo, ko = fn(q, k, pos, inv, section, runs)
    torch.autograd.backward([qo, ko], [torch.ones_like(qo), torch.ones_like(ko)])


def cpu_times(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Round-robin over the paths (one warm-up each) so load changes on a shared machine hit all alike."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(measure(call, repeats=1, warmup=0).wall[0])
    return times


CPU_PATHS = (("fused", fused), ("reference", reference), ("hf", hf_packed), ("slice", slice_rotate_concat))


def cpu_bench(tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    pos, runs = packed_batch(tokens)
    section = (16, 24, 24)
    inv = inv_freq(d)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, hq, d, generator=g).to(dtype)
    k = torch.randn(tokens, hk, d, generator=g).to(dtype)
    # Same math first: every path agrees with the fp32 reference.
    ref_q, _ = apply_mrope_reference(q.float(), k.float(), pos, inv, section)
    fwd = cpu_times({n: (lambda fn=fn: fn(q, k, pos, inv, section, runs)) for n, fn in CPU_PATHS}, repeats)
    fb = cpu_times(
        {n: (lambda fn=fn: _fwd_bwd(fn, q, k, pos, inv, section, runs)) for n, fn in CPU_PATHS}, repeats
    )
    rows = []
    for name, fn in CPU_PATHS:
        out_q, _ = fn(q, k, pos, inv, section, runs)
        err = ((out_q.float() - ref_q).norm() / ref_q.norm()).item()
        del out_q
        with torch.no_grad(), AllocCounter() as counter:
            out = fn(q, k, pos, inv, section, runs)
        del out
        rows.append(
            {
                "path": name,
                "fwd_ms": statistics.median(fwd[name]) * 1e3,
                "fwd_min_ms": min(fwd[name]) * 1e3,
                "fwd_bwd_ms": statistics.median(fb[name]) * 1e3,
                "alloc_MB": counter.bytes / 2**20,
                "peak_MB": counter.peak / 2**20,
                "alloc_tensors": counter.tensors,
                "rel_err_vs_fp32": err,
            }
        )
    base = rows[0]
    for row in rows:
        row["fwd_x"] = row["fwd_ms"] / base["fwd_ms"]
        row["fwd_bwd_x"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        row["alloc_x"] = row["alloc_MB"] / base["alloc_MB"]
        row["peak_x"] = row["peak_MB"] / base["peak_MB"]
    return rows


# ---------------------------------------------------------------- GPU part


def gpu_time(call: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = gpu_time(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / t  # read + write


def _liger_fn():
    try:
        from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb
    except Exception:
        return None
    return liger_multimodal_rotary_pos_emb


def _gpu_path(fn, q, k, repeats: int, io_bytes: int, copy_gbps: float) -> dict:
    fwd = gpu_time(lambda: fn(q, k), repeats)

    def fwd_bwd():
        qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
        qo, ko = fn(qq, kk)
        torch.autograd.backward([qo, ko], [torch.ones_like(qo), torch.ones_like(ko)])

    fb = gpu_time(fwd_bwd, repeats)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    fn(q, k)
    peak = torch.cuda.max_memory_allocated() - base_mem
    gbps = io_bytes / fwd / 1e9
    return {
        "fwd_ms": fwd * 1e3,
        "fwd_bwd_ms": fb * 1e3,
        "fwd_GBps": gbps,
        "fwd_pct_of_copy": 100 * gbps / copy_gbps,
        "peak_extra_MB": peak / 2**20,
    }


def gpu_bench(tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, repeats: int) -> dict:
    from collate.ops.rope.triton import apply_mrope_triton

    dev = torch.device("cuda")
    pos_cpu, runs = packed_batch(tokens)
    pos = pos_cpu.to(dev)
    inv = inv_freq(d, device=dev)
    results: dict = {"copy_GBps": copy_bandwidth() / 1e9, "device": torch.cuda.get_device_name(), "rows": []}
    elem = torch.finfo(dtype).bits // 8
    io_bytes = 2 * tokens * (hq + hk) * d * elem + pos.numel() * pos.element_size()
    for interleaved, section in ((False, (16, 24, 24)), (True, (24, 20, 20))):
        q = torch.randn(tokens, hq, d, device=dev, dtype=dtype)
        k = torch.randn(tokens, hk, d, device=dev, dtype=dtype)
        paths: dict[str, Callable] = {
            "triton": lambda q, k, il=interleaved, s=section: apply_mrope_triton(q, k, pos, inv, s, il),
            "eager_ref": lambda q, k, il=interleaved, s=section: apply_mrope_reference(q, k, pos, inv, s, il),
        }
        if not interleaved:
            paths["slice"] = lambda q, k, s=section: slice_rotate_concat(q, k, pos, inv, s, runs)
            liger = _liger_fn()
            if liger is not None:
                # Liger wants HF 4.x (3, 1, T, D) cos/sin (built once per model forward: not timed) and
                # (1, H, T, D) views of (1, T, H, D) storage.
                freqs = pos[..., None].float() * inv.float()
                emb = torch.cat((freqs, freqs), dim=-1)[:, None]
                cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

                def liger_call(q, k, cos=cos, sin=sin, s=section, liger=liger):
                    qv, kv = q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2)
                    return liger(qv, kv, cos, sin, list(s))

                paths["liger"] = liger_call
        for name, fn in paths.items():
            row = _gpu_path(fn, q, k, repeats, io_bytes, results["copy_GBps"])
            row.update(layout="interleaved" if interleaved else "chunked", path=name)
            results["rows"].append(row)
    return results


# ---------------------------------------------------------------- main


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--q-heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--gpu-tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": f"Hq={args.q_heads} Hk={args.kv_heads} D={args.head_dim}, section (16, 24, 24)",
        "environment": environment_line(),
    }
    print(json.dumps(info))
    out: dict = {"info": info, "cpu": [], "gpu": []}
    if not args.skip_cpu:
        for tokens in args.tokens:
            for dt in args.dtype:
                rows = cpu_bench(tokens, args.q_heads, args.kv_heads, args.head_dim, DTYPES[dt], args.repeats)
                for r in rows:
                    r.update(tokens=tokens, dtype=dt)
                out["cpu"].extend(rows)
                print(f"\nCPU, T={tokens}, {dt} (medians of {args.repeats} round-robin runs; x = vs fused)")
                cols = ["path", "fwd_ms", "fwd_min_ms", "fwd_bwd_ms", "alloc_MB", "peak_MB", "alloc_tensors"]
                cols += ["fwd_x", "fwd_bwd_x", "alloc_x", "peak_x", "rel_err_vs_fp32"]
                print(_table(rows, cols))
    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401
        except ImportError:
            print("\nGPU part skipped: triton is not importable")
        else:
            for tokens in args.gpu_tokens:
                for dt in ("bf16", "fp32"):
                    res = gpu_bench(tokens, args.q_heads, args.kv_heads, args.head_dim, DTYPES[dt], 50)
                    for r in res["rows"]:
                        r.update(tokens=tokens, dtype=dt)
                    out["gpu"].extend(res["rows"])
                    print(
                        f"\nGPU {res['device']}, T={tokens}, {dt}; copy bandwidth {res['copy_GBps']:.0f} GB/s"
                    )
                    cols = [
                        "layout",
                        "path",
                        "fwd_ms",
                        "fwd_bwd_ms",
                        "fwd_GBps",
                        "fwd_pct_of_copy",
                        "peak_extra_MB",
                    ]
                    print(_table(res["rows"], cols))
    else:
        print("\nGPU part skipped: no CUDA device")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
