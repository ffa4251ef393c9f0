"""Varlen attention on the CPU: ``collate.varlen_attention`` vs the ways a packed row is usually
attended to, forward + backward, in the same process.

Baselines, on the same packed ``(T, H, D)`` q/k/v and the same segments:

* ``sdpa-3d``: one SDPA per segment on 3-D ``(H, L, D)`` views, what varlen_attention did before
  (torch's CPU SDPA runs its unfused math path on 3-D inputs);
* ``mask``: one SDPA over the whole row with a block-diagonal (causal) boolean mask, the
  padding-free-with-a-mask approach (T x T mask, cost quadratic in the row, not the segments).

    python scripts/bench_attention.py [--repeats 5] [--threads 1]

Prints milliseconds (median) and each baseline's time / varlen_attention's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import environment_line, measure

from collate.ops import varlen_attention

# (name, segment lengths, query heads, kv heads, head dim, causal)
CASES = [
    ("LLM row: 8 samples, GQA", [900, 2400, 300, 1700, 120, 640, 2000, 60], 4, 2, 64, True),
    ("vision: 3 images (frames)", [5120, 1024, 256], 2, 2, 40, False),
    ("vision: 8-frame video", [1024] * 8, 2, 2, 40, False),
]


def sdpa_3d(q, k, v, ends, causal):
    outs, start = [], 0
    for end in ends:
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1), is_causal=causal,
                                           enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o.transpose(0, 1))
        start = end
    return torch.cat(outs)


def masked(q, k, v, ends, causal):
    seg = torch.repeat_interleave(torch.arange(len(ends)), torch.diff(torch.tensor([0, *ends])))
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*heads_first, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def ours(q, k, v, ends, causal):
    return varlen_attention(q, k, v, {"cu_seqlens_list": ends}, causal=causal)


def time_it(fn, q, k, v, ends, causal, repeats):
    """Median wall seconds of forward + backward (one warm-up call first)."""
    def once():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, ends, causal).sum().backward()

    return measure(once, repeats=repeats, warmup=1).wall_median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (training ranks use 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(environment_line(threads=args.threads))
    print(f"fp32, forward + backward, median of {args.repeats}")
    for name, lengths, hq, hk, d, causal in CASES:
        g = torch.Generator().manual_seed(0)
        total = sum(lengths)
        q, k, v = (torch.randn(total, h, d, generator=g, requires_grad=True) for h in (hq, hk, hk))
        ends = torch.tensor(lengths).cumsum(0).tolist()
        ref = ours(q, k, v, ends, causal)
        for fn in (sdpa_3d, masked):
            torch.testing.assert_close(fn(q, k, v, ends, causal), ref, rtol=1e-4, atol=1e-5)
        t_ours = time_it(ours, q, k, v, ends, causal, args.repeats)
        t_3d = time_it(sdpa_3d, q, k, v, ends, causal, args.repeats)
        t_mask = time_it(masked, q, k, v, ends, causal, args.repeats)
        print(f"{name:28s} T={total:6d}  varlen_attention {t_ours * 1e3:8.1f} ms   "
              f"sdpa-3d {t_3d * 1e3:8.1f} ms ({t_3d / t_ours:.1f}x)   mask {t_mask * 1e3:8.1f} ms "
              f"({t_mask / t_ours:.1f}x)")


if __name__ == "__main__":
    main()
