"""Compile the Triton M-RoPE kernel for an NVIDIA target ahead of time, with no GPU.

The interpreter tests (test_triton.py) check the numbers; this checks that the same kernel
goes through Triton's real compiler down to PTX for sm_90 (front-end typing, constexpr use,
loop-carried pointers), and that ``tl.sin``/``tl.cos`` lower to libdevice's precise
``__nv_sinf``/``__nv_cosf``, not the ``sin.approx``/``cos.approx`` instructions, which lose accuracy
at the large angles long videos produce. Needs the ``ptxas`` that ships in the triton wheel.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiler")


def _compile(io: str, interleaved: bool, partial: bool, conjugate: bool, cc: int = 90):
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # pragma: no cover - layout of older triton versions
        pytest.skip(f"triton AOT API unavailable: {exc}")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton wheel without the NVIDIA backend")
    mod = importlib.import_module("collate.ops.rope.triton")
    fn = mod._mrope_kernel
    if type(fn).__name__ != "JITFunction":
        pytest.skip("rope/triton.py was imported in interpreter mode")
    const = dict(
        NUM_Q_HEADS=28, NUM_K_HEADS=4, INTERLEAVED=interleaved, CONJUGATE=conjugate, HAS_SCALE=conjugate,
        BLOCK_T=16,
    )  # fmt: skip
    if partial:
        const.update(S_T=8, S_H=12, S_W=12, HALF=32, HALF_PAD=32, PASS=64, PASS_PAD=64, COPY_PASS=True)
    else:
        const.update(S_T=16, S_H=24, S_W=24, HALF=64, HALF_PAD=64, PASS=0, PASS_PAD=1, COPY_PASS=False)
    if interleaved:
        const.update(
            S_T=const["HALF"] - 2 * (const["HALF"] // 3), S_H=const["HALF"] // 3, S_W=const["HALF"] // 3
        )
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr"):
            sig[name] = "*" + io
        elif name == "pos_ptr":
            sig[name] = "*i64"
        elif name == "inv_ptr":
            sig[name] = "*fp32"
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name == "num_tokens" else "i32"
    missing = {p.name for p in fn.params if p.is_constexpr} - set(const)
    assert not missing, missing
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items()}
    return triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", cc, 32)
    )


def _check(kernel) -> None:
    ptx = kernel.asm["ptx"]
    assert ".entry _mrope_kernel" in ptx or "_mrope_kernel" in ptx
    assert not re.search(r"\b(sin|cos)\.approx", ptx), "fast approximate trig in the PTX"
    llir = kernel.asm["llir"]
    assert "__nv_sinf" in llir and "__nv_cosf" in llir


def test_compiles_for_sm90_with_precise_trig():
    _check(_compile("bf16", interleaved=False, partial=True, conjugate=True))


@pytest.mark.slow
@pytest.mark.parametrize("io", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_compiles_all_variants(io, interleaved):
    _check(_compile(io, interleaved=interleaved, partial=False, conjugate=False))
    _check(_compile(io, interleaved=interleaved, partial=True, conjugate=True, cc=80))
