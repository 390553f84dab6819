"""The C encoder attention kernel: packed variable-length batches against a float64 reference and torch's SDPA, on
every path this CPU has, and its generic builds (AVX2, plain x86-64) where the compiler can make them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.cpu_kernels.build import _cpu_flag_set
from tests.support.bf16_paths import encoder_attention_path

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

LENGTHS = [1, 7, 200, 512, 33, 2]  # one packed batch: the lengths the issue names, and short tails around them
# float32: the kernel's exp is within 2e-7 relative; bfloat16: the inputs are exact, the weights and the output
# are rounded to bfloat16 (2^-9 relative each), so an output of size ~3 is within ~2^-9 * 3 * 2
BOUND = {torch.float32: 5e-5, torch.bfloat16: 3e-2}


def _case(lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v [T, H, D] as views of one fused [T, 3, H, D] projection (its row stride), and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    qkv = (torch.randn(int(cu[-1]), 3, heads, head_dim, generator=gen) * 1.5).to(dtype)
    q, k, v = qkv.unbind(1)
    return q, k, v, cu


def _reference(q, k, v, cu) -> torch.Tensor:
    """float64 attention of each input over its own tokens: [T, H * D]."""
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = (t[start:end].double().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        p = torch.softmax(qq @ kk.transpose(1, 2) * q.shape[2] ** -0.5, -1)
        outs.append((p @ vv).transpose(0, 1).reshape(end - start, -1))
    return torch.cat(outs)


def _sdpa(q, k, v, cu) -> torch.Tensor:
    outs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
        outs.append(F.scaled_dot_product_attention(qq, kk, vv)[0].transpose(0, 1).reshape(end - start, -1))
    return torch.cat(outs)


def _paths(dtype: torch.dtype) -> list[str | None]:
    return [None] if dtype == torch.float32 else list(cpu_kernels.BF16_ENCODER_ATTENTION_PATHS)


@pytest.mark.parametrize("heads,head_dim", [(12, 32), (4, 64), (2, 128), (3, 16), (2, 48), (1, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_batch_equals_float64_reference_on_every_path(heads: int, head_dim: int, dtype: torch.dtype) -> None:
    q, k, v, cu = _case(LENGTHS, heads, head_dim, dtype)
    expected = _reference(q, k, v, cu)
    for path in _paths(dtype):
        # a head_dim off the dot path's multiples of 32 takes the widened path: tested there under both caps
        with encoder_attention_path(path, 32) if path else contextlib.nullcontext():
            out = cpu_kernels.encoder_attention(q, k, v, cu, head_dim**-0.5)
        assert out.dtype == dtype and out.shape == (int(cu[-1]), heads * head_dim)
        err = (out.double() - expected).abs().max().item()
        assert err <= BOUND[dtype], (path, err)
        sdpa_err = (out.double() - _sdpa(q, k, v, cu).double()).abs().max().item()
        assert sdpa_err <= 2 * BOUND[dtype], (path, sdpa_err)


@pytest.mark.parametrize("length", [1, 7, 200, 512])
def test_each_length_alone_equals_it_in_a_batch(length: int) -> None:
    """An input's output does not depend on its neighbours (no key of another input leaks in)."""
    q, k, v, cu = _case([5, length, 3], 4, 32, torch.float32, seed=length)
    batched = cpu_kernels.encoder_attention(q, k, v, cu, 32**-0.5)
    alone = cpu_kernels.encoder_attention(q[5 : 5 + length], k[5 : 5 + length], v[5 : 5 + length],
                                          torch.tensor([0, length]), 32**-0.5)  # fmt: skip
    torch.testing.assert_close(batched[5 : 5 + length], alone, rtol=0, atol=1e-6)


def test_threads_split_queries_and_agree() -> None:
    """One input and few heads: the kernel splits its queries across threads; the result is the one-thread one."""
    q, k, v, cu = _case([300], 2, 64, torch.bfloat16, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.encoder_attention(q, k, v, cu, 0.125)
        torch.set_num_threads(max(2, threads))
        many = cpu_kernels.encoder_attention(q, k, v, cu, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_rejects_bad_shapes() -> None:
    q, k, v, cu = _case([4, 4], 2, 24, torch.float32)
    with pytest.raises(ValueError, match="head_dim 24"):
        cpu_kernels.encoder_attention(q, k, v, cu, 1.0)
    q, k, v, cu = _case([4, 4], 2, 32, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cpu_kernels.encoder_attention(q, k, v, torch.tensor([0, 4, 7]), 1.0)
    with pytest.raises(ValueError, match="decrease"):
        cpu_kernels.encoder_attention(q, k, v, torch.tensor([0, 6, 5, 8]), 1.0)
    with pytest.raises(ValueError, match="match q"):
        cpu_kernels.encoder_attention(q, k.to(torch.bfloat16), v, cu, 1.0)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the generic builds are x86-64 targets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_generic_builds_equal_reference(march: str, tmp_path: Path) -> None:
    """encoder_attention.c built for AVX2 and for plain x86-64 (the paths of CPUs without AVX-512, which this one
    may have), loaded on their own, equal the reference in float32 and bfloat16."""
    flags = _cpu_flag_set()
    if march == "x86-64-v3" and (flags is None or not {"avx2", "fma", "f16c"} <= flags):
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    for name in ("encoder_attention.c", "bf16_kernels.h", "vec.h", "linear_layout.h"):
        (tmp_path / name).write_bytes(resources.files("engine.cpu_kernels").joinpath(name).read_bytes())
    lib_path = tmp_path / f"encoder-{march}.so"
    compiler = os.environ.get("CC", "cc")
    try:
        subprocess.run([compiler, "-O2", f"-march={march}", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi",
                        str(tmp_path / "encoder_attention.c"), "-o", str(lib_path)],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot build for {march}: {exc}")
    lib = ctypes.CDLL(str(lib_path))
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        q, k, v, cu = _case(LENGTHS, 3, 32, dtype, seed=7)
        out = torch.empty(int(cu[-1]), 3 * 32, dtype=dtype)
        fn = getattr(lib, f"encoder_attention_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                                                  ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
        status = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), cu.data_ptr(),
                    len(cu) - 1, 3, 32, 32**-0.5, out.data_ptr(), out.stride(0))  # fmt: skip
        assert status == 0
        assert (out.double() - _reference(q, k, v, cu)).abs().max().item() <= BOUND[dtype]
