"""Time the Triton attention backend against the PyTorch one on a CUDA GPU.

    python benchmarks/bench_kernels.py                      # bf16, Llama-8B-like heads
    python benchmarks/bench_kernels.py --dtype float16 --num-q-heads 9 --num-kv-heads 3 --head-dim 64

Each case is one layer's attention call (store + attend) over a paged cache with scattered
blocks, timed with CUDA events after warm-up; the table gives the median per call, the
Triton/PyTorch speed-up, and for decode the KV bytes read per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend


def make_case(
    seqs: list[tuple[int, int]], args: argparse.Namespace, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata, float]:
    """Random q/k/v, a cache with a random block order, and the metadata for ``(seq_len, query_len)`` pairs."""
    dev, bs = "cuda", args.block_size
    blocks_needed = [-(-s // bs) for s, _ in seqs]
    num_blocks = sum(blocks_needed) + 1
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    max_blocks = max(blocks_needed)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32, device=dev)
    slots, used = [], 0
    for i, ((seq_len, query_len), n) in enumerate(zip(seqs, blocks_needed)):
        block_tables[i, :n] = perm[used : used + n]
        used += n
        pos = torch.arange(seq_len - query_len, seq_len, device=dev)
        slots.append(block_tables[i, pos // bs].long() * bs + pos % bs)
    query_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.nn.functional.pad(query_lens.cumsum(0), (1, 0)).to(torch.int32),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=dev),
        block_tables=block_tables,
        max_query_len=int(query_lens.max()),
        max_seq_len=max(s for s, _ in seqs),
    )
    num_tokens = int(query_lens.sum())
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    q = torch.randn(num_tokens, hq, d, dtype=dtype, device=dev)
    k = torch.randn(num_tokens, hkv, d, dtype=dtype, device=dev)
    v = torch.randn(num_tokens, hkv, d, dtype=dtype, device=dev)
    kv_cache = torch.randn(2, num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    return (q, k, v, kv_cache), meta, d**-0.5


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs, each timed with its own CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


CASES: dict[str, list[tuple[int, int]]] = {
    "decode b=1 ctx=8k": [(8192, 1)],
    "decode b=8 ctx=2k": [(2048, 1)] * 8,
    "decode b=64 ctx=1k": [(1024, 1)] * 64,
    "decode b=256 ctx=512": [(512, 1)] * 256,
    "prefill 1x2048": [(2048, 2048)],
    "prefill 8x512": [(512, 512)] * 8,
    "chunk 512 after 4k prefix": [(4608, 512)],
    "mixed 2x256 prefill + 62 decode@1k": [(256, 256)] * 2 + [(1024, 1)] * 62,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py times CUDA kernels; no CUDA device is available")
    from engine.attention.triton_backend import TritonAttentionBackend  # binds the kernels to the GPU

    dtype = getattr(torch, args.dtype)
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  Hq={args.num_q_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim} block={args.block_size}")
    print("| case | triton ms | torch ms | speed-up | triton KV GB/s |\n|---|---:|---:|---:|---:|")
    for name, seqs in CASES.items():
        tensors, meta, scale = make_case(seqs, args, dtype)
        t_triton = time_ms(lambda: triton_backend.forward(*tensors, meta, scale), args.warmup, args.iters)
        t_torch = time_ms(lambda: torch_backend.forward(*tensors, meta, scale), args.warmup, args.iters)
        kv_bytes = 2 * sum(s for s, _ in seqs) * args.num_kv_heads * args.head_dim * tensors[0].element_size()
        print(f"| {name} | {t_triton:.3f} | {t_torch:.3f} | {t_torch / t_triton:.2f}x | "
              f"{kv_bytes / t_triton / 1e6:.0f} |")


if __name__ == "__main__":
    main()
