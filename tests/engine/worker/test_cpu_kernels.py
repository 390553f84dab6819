"""The C attention kernel: float64 reference on paged layouts, the build cache, the fallback."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import cpu_kernels
from engine.cpu_kernels import abi
from tests.support.bf16_paths import attention_path

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no C compiler for the CPU kernel"
)


def _paged_case(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int,
                q_scale: float = 1.0, min_len: int = 1, shared_len: int = 48, max_len: int = 300):
    """Random contexts in shuffled blocks; the first rows share leading blocks (about shared_len tokens), as
    behind a system prompt."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = 4 + num_seqs * (max_len // block_size + 2)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_len // block_size)]
    seq_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    tables = []
    for i, n in enumerate(seq_lens):
        num = -(-n // block_size)
        own = shared[:num] if i < num_seqs // 2 else []
        tables.append(own + [free.pop() for _ in range(num - len(own))])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen) * q_scale
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), tables


def _reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    outs = []
    for i, (table, n) in enumerate(zip(tables, seq_lens.tolist())):
        pos = torch.arange(n)
        blocks = torch.tensor(table)[pos // block_size]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [n, Hq, D]
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double() * scale, k)
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("head_dim", [64, 128, 16, 24])  # the specialised sizes; the generic one, 16 lanes and 8
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (16, 2), (20, 5)])  # (20, 5): KV heads 4 + 1 to a row's items
@pytest.mark.parametrize("block_size", [16, 1, 32])
@pytest.mark.parametrize("num_seqs", [12, 1])  # one row: a KV head an item
def test_matches_float64_reference(head_dim: int, heads: tuple[int, int], block_size: int, num_seqs: int) -> None:
    """Every row's output equals softmax attention over its paged context, shared blocks included."""
    q, k_cache, v_cache, block_tables, seq_lens, tables = _paged_case(
        num_seqs, *heads, head_dim, block_size, seed=head_dim
    )
    scale = head_dim**-0.5
    out = cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    expected = _reference(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_peaked_scores_stay_exact() -> None:
    """Scores spread over hundreds of units (most weights far below float32's epsilon) still match."""
    q, k_cache, v_cache, block_tables, seq_lens, tables = _paged_case(8, 4, 2, 64, 16, seed=3, q_scale=20.0)
    out = cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    expected = _reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_rejects_what_it_cannot_serve() -> None:
    """Unsupported dtypes and shapes are named errors, not wrong answers."""
    q, k_cache, v_cache, block_tables, seq_lens, _ = _paged_case(2, 4, 2, 64, 16, seed=0)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        cpu_kernels.attention(q.bfloat16(), k_cache, v_cache, block_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="v_cache must be a contiguous float32"):
        cpu_kernels.attention(q, k_cache, v_cache.transpose(1, 2), block_tables, seq_lens, 1.0)
    bad_tables = block_tables.clone()
    bad_tables[1, 0] = k_cache.shape[0]
    with pytest.raises(IndexError, match=r"block id outside \[0, "):
        cpu_kernels.attention(q, k_cache, v_cache, bad_tables, seq_lens, 1.0)
    with pytest.raises(IndexError, match="past its table's"):  # a context longer than its table
        cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens + block_tables.shape[1] * 16, 1.0)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An empty kernel cache and a compiler wrapper that logs its invocations; the real library afterwards."""
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec cc "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PAGED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    cpu_kernels.library.cache_clear()
    yield tmp_path, log
    cpu_kernels.library.cache_clear()


def test_compiled_once_then_loaded(fresh_build) -> None:
    """The first use compiles into $PAGED_CACHE/cpu_kernels; a later process only asks the compiler's version."""
    tmp_path, log = fresh_build
    assert cpu_kernels.library() is not None
    built = list((tmp_path / "cache" / "cpu_kernels").glob("*.so"))
    assert len(built) == 1
    assert sum("-shared" in line for line in log.read_text().splitlines()) == 1
    cpu_kernels.library.cache_clear()  # as a new process would
    assert cpu_kernels.library() is not None
    assert sum("-shared" in line for line in log.read_text().splitlines()) == 1
    assert list((tmp_path / "cache" / "cpu_kernels").glob("*.so")) == built

    # A stale library under the same name (an older ABI): the next process rebuilds it, once, with one warning.
    _compile_stub(tmp_path, "int paged_abi_version(void) { return 0; }", built[0])
    run = subprocess.run(
        [sys.executable, "-c", "from engine import cpu_kernels; from engine.cpu_kernels import abi; "
         "lib = cpu_kernels.library(); assert lib is not None and abi.mismatch(lib, None) is None"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    assert f"ABI version 0, expected {abi.ABI_VERSION}); rebuilding it" in run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert sum("-shared" in line for line in log.read_text().splitlines()) == 2


def _compile_stub(tmp_path: Path, source: str, out: Path) -> ctypes.CDLL:
    c = tmp_path / "stub.c"
    c.write_text("#include <stdint.h>\n" + source + "\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(c), "-o", str(out)], check=True, capture_output=True)
    return ctypes.CDLL(str(out))


_STUB_LAYOUT = """
typedef struct { const char *name; int64_t value; } entry;
static const entry entries[] = {%s};
int paged_abi_version(void) { return %d; }
int64_t paged_abi_layout(const entry **out) { *out = entries; return sizeof entries / sizeof entries[0]; }
const char *paged_build_features(void) { return "%s"; }
"""


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"version": 7}, "ABI version 7, expected"),
        ({"layout": "linear_plan.num_parts"}, "struct layout differs at linear_plan.num_parts (library"),
        ({"features": " avx2 avx512f"}, "built for avx512f, which this CPU lacks"),
        ({}, None),
    ],
)
def test_a_library_is_checked_against_the_mirrors(tmp_path: Path, change: dict, why: str | None) -> None:
    """The loader compares the library's ABI version, every mirrored struct's size and offsets, and the
    instruction sets it was built for with its own: each difference is named."""
    layout = abi.expected_layout()
    if "layout" in change:
        layout[change["layout"]] += 8  # a field the C side moved
    entries = ", ".join(f'{{"{name}", {value}}}' for name, value in layout.items())
    source = _STUB_LAYOUT % (entries, change.get("version", abi.ABI_VERSION), change.get("features", " avx2"))
    lib = _compile_stub(tmp_path, source, tmp_path / "stub.so")
    found = abi.mismatch(lib, {"avx2", "fma"})
    assert found is None if why is None else why in found


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_fetching_into_l2_or_l1_changes_no_bit(kv_dtype: torch.dtype) -> None:
    """Where attention fetches ahead is the machine's choice (L2 under a 48 KiB L1 data cache) or
    PAGED_ATTENTION_FETCH's; tiles, own keys and both caches give the same bits either way."""
    from engine.attention.cpu_backend import plan_tiles

    lib, default = cpu_kernels.library(), cpu_kernels.attention_fetch()
    getconf = subprocess.run(["getconf", "LEVEL1_DCACHE_SIZE"], capture_output=True, text=True)
    if os.environ.get("PAGED_ATTENTION_FETCH", "auto") == "auto" and getconf.returncode == 0:
        l1 = int(getconf.stdout.strip()) if getconf.stdout.strip().isdigit() else 0  # or "undefined"
        assert default == ("l2" if 0 < l1 < 48 * 1024 else "l1")
    q, k_cache, v_cache, block_tables, seq_lens, _ = _paged_case(24, 9, 3, 64, 16, seed=11, min_len=48)
    tiles = plan_tiles(seq_lens.numpy(), block_tables.numpy(), 16, 3, cpu_kernels.tile_lanes(64, kv_dtype))
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    outs = {}
    try:
        for level, name in enumerate(cpu_kernels.ATTENTION_FETCH):
            lib.attention_fetch_into(level)
            outs[name] = cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, tiles)
            assert cpu_kernels.attention_fetch() == (default if name == "auto" else name)
    finally:
        lib.attention_fetch_into(cpu_kernels.ATTENTION_FETCH.index(default))
    assert torch.equal(outs["l1"], outs["l2"]) and torch.equal(outs["auto"], outs["l1"])


def test_an_unknown_fetch_level_is_named(fresh_build, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_ATTENTION_FETCH", "l3")
    with pytest.raises(ValueError, match="PAGED_ATTENTION_FETCH must be one of auto, l1, l2; got 'l3'"):
        cpu_kernels.library()


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_without_a_compiler_the_kernel_is_off(compiler: str, fresh_build, monkeypatch, caplog) -> None:
    """A missing or failing compiler gives None and a warning; the opt-out switch gives None without compiling."""
    tmp_path, log = fresh_build
    cc = tmp_path / "broken-cc"
    if compiler == "failing":
        cc.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
        cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level(logging.WARNING, logger="engine.cpu_kernels"):
        assert cpu_kernels.library() is None
    assert "using the PyTorch path" in caplog.text
    if compiler == "failing":
        assert "cc: internal error" in caplog.text
    with pytest.raises(RuntimeError, match="not available"):
        q, k_cache, v_cache, block_tables, seq_lens, _ = _paged_case(2, 4, 2, 64, 16, seed=0)
        cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 1.0)

    cpu_kernels.library.cache_clear()
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setenv("PAGED_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert not (tmp_path / "cache" / "cpu_kernels").exists()


@pytest.mark.parametrize("col_major", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_slots_index_copy_writes(col_major: bool, cache_dtype: torch.dtype) -> None:
    """Strided K/V land in their slots exactly (rounded to nearest even in a bfloat16 cache, as torch rounds);
    a slot outside the cache is an error that writes nothing."""
    gen = torch.Generator().manual_seed(8)
    kv = torch.randn(6 * 64, 5, generator=gen).t() if col_major else torch.randn(5, 6 * 64, generator=gen)
    k, v = kv[:, : 3 * 64].view(5, 3, 64), kv[:, 3 * 64 :].view(5, 3, 64)
    slots = torch.tensor([17, 3, 40, 41, 0])
    k_cache, v_cache = torch.zeros(2, 4, 16, 3, 64, dtype=cache_dtype)
    cpu_kernels.store_kv(k, v, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros(2, 64, 3, 64, dtype=cache_dtype)
    expected_k.index_copy_(0, slots, k.to(cache_dtype))
    expected_v.index_copy_(0, slots, v.to(cache_dtype))
    assert torch.equal(k_cache.view(64, 3, 64), expected_k) and torch.equal(v_cache.view(64, 3, 64), expected_v)
    with pytest.raises(IndexError, match="outside the cache's 64 slots"):
        cpu_kernels.store_kv(k + 1, v + 1, k_cache, v_cache, torch.tensor([1, 2, 3, 4, 64]))
    assert torch.equal(k_cache.view(64, 3, 64), expected_k), "nothing written"


@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (16, 2), (16, 1)])  # 8, 24, 3 and 1 rows a tile
@pytest.mark.parametrize("block_size", [16, 5])
def test_tiles_over_shared_blocks_match_float64_reference(heads: tuple[int, int], block_size: int) -> None:
    """Rows tiled over their shared leading blocks (queries as vector lanes, then each row's own keys)
    give the same attention as the reference; the tiles really hold several rows."""
    from engine.attention.cpu_backend import plan_tiles

    num_heads, num_kv_heads = heads
    q, k_cache, v_cache, block_tables, seq_lens, tables = _paged_case(
        40, num_heads, num_kv_heads, 64, block_size, seed=block_size + num_heads, min_len=48
    )
    lanes, group = cpu_kernels.tile_lanes(64, torch.float32), num_heads // num_kv_heads
    tiles = plan_tiles(seq_lens.numpy(), block_tables.numpy(), block_size, group, lanes)
    sizes = (tiles.starts[1:] - tiles.starts[:-1]).tolist()
    if lanes // group > 1:  # else every tile is one row
        assert max(sizes) > 1 and tiles.shared.max() >= block_size
    assert sorted(tiles.rows.tolist()) == list(range(40)) and max(sizes) * group <= lanes
    out = cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, tiles)
    expected = _reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 16, 24])  # a specialised size; the generic one, 16 lanes and 8
@pytest.mark.parametrize("heads", [(9, 3), (16, 1)])  # tiles of 8 rows, and single rows
def test_bfloat16_cache_reads_as_its_float32_widening(head_dim: int, heads: tuple[int, int]) -> None:
    """Over a bfloat16 cache the kernel computes what it computes over the widened float32 cache (to float32
    rounding: the compiler may contract the generic path's loops differently)."""
    from engine.attention.cpu_backend import plan_tiles

    num_heads, num_kv_heads = heads
    q, k_cache, v_cache, block_tables, seq_lens, _ = _paged_case(
        24, num_heads, num_kv_heads, head_dim, 16, seed=head_dim + num_heads, min_len=48
    )
    lanes = cpu_kernels.tile_lanes(head_dim, torch.float32)  # the widened path takes the largest tiles
    tiles = plan_tiles(seq_lens.numpy(), block_tables.numpy(), 16, num_heads // num_kv_heads, lanes)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    with attention_path("widened"):
        out = cpu_kernels.attention(q, k16, v16, block_tables, seq_lens, 0.125, tiles)
    widened = cpu_kernels.attention(q, k16.float(), v16.float(), block_tables, seq_lens, 0.125, tiles)
    torch.testing.assert_close(out, widened, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="must share a dtype"):
        cpu_kernels.attention(q, k16, v_cache, block_tables, seq_lens, 0.125)


@pytest.mark.parametrize("path", ["avx512-bf16", "amx"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])  # tiles of 8 rows (and a last one of 4), and of 3
@pytest.mark.parametrize(("block_size", "shared_len"), [(16, 48), (5, 300), (16, 304)])
def test_bf16_shared_keys_round_as_bfloat16_attention_does(
    path: str, head_dim: int, heads: tuple[int, int], block_size: int, shared_len: int
) -> None:
    """With VDPBF16PS or AMX, attention over a tile's shared keys in a bfloat16 cache (AMX's chunks of 256, blocks
    of an odd number of keys, key groups across blocks and past the prefix) matches the float64 reference within
    bfloat16's rounding of the scaled queries and of the softmax weights (2^-9 of the largest value; measured:
    under a third of it)."""
    from engine.attention.cpu_backend import plan_tiles

    num_heads, num_kv_heads = heads
    q, k_cache, v_cache, block_tables, seq_lens, tables = _paged_case(
        40, num_heads, num_kv_heads, head_dim, block_size, seed=head_dim + block_size, min_len=shared_len,
        shared_len=shared_len, max_len=shared_len + 60,
    )
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    lanes = cpu_kernels.tile_lanes(head_dim, torch.bfloat16)
    tiles = plan_tiles(seq_lens.numpy(), block_tables.numpy(), block_size, num_heads // num_kv_heads, lanes)
    assert tiles.shared.max() >= shared_len // block_size * block_size
    scale = head_dim**-0.5
    with attention_path(path, head_dim):
        out = cpu_kernels.attention(q, k16, v16, block_tables, seq_lens, scale, tiles)
    expected = _reference(q, k16.float(), v16.float(), tables, seq_lens, scale)
    bound = 2.0**-9 * v16.float().abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=bound, rtol=0)


def test_tiles_that_claim_too_much_are_rejected() -> None:
    """A tile whose rows do not all have its shared keys is a ValueError, not a wrong answer."""
    q, k_cache, v_cache, block_tables, seq_lens, _ = _paged_case(4, 9, 3, 64, 16, seed=9, min_len=48)
    # rows 0 and 3 in one tile: only rows 0 and 1 begin with the shared blocks
    tiles = cpu_kernels.AttentionTiles(torch.tensor([0, 3, 1, 2]), torch.tensor([0, 2, 3, 4]), torch.tensor([32, 0, 0]))
    with pytest.raises(ValueError, match="invalid tiles"):
        cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, tiles)


def test_tiles_hold_up_to_the_builds_lanes() -> None:
    """A tile of tile_lanes // G rows behind shared blocks is served (48 lanes with AVX-512, 24 without); one row
    more is a ValueError naming the limit."""
    lanes = cpu_kernels.tile_lanes(64, torch.float32)
    assert lanes in (24, 48)
    rows, num_seqs = lanes // 3, 2 * (lanes // 3 + 1)  # the first half (rows + 1) share 48 tokens of blocks
    q, k_cache, v_cache, block_tables, seq_lens, tables = _paged_case(num_seqs, 9, 3, 64, 16, seed=4, min_len=48)

    def first_tile_of(size: int) -> cpu_kernels.AttentionTiles:
        starts = [0, *range(size, num_seqs + 1)]
        return cpu_kernels.AttentionTiles(
            torch.arange(num_seqs), torch.tensor(starts), torch.tensor([48] + [0] * (len(starts) - 2))
        )

    out = cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, first_tile_of(rows))
    expected = _reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=f"a tile of more than {rows} rows"):
        cpu_kernels.attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, first_tile_of(rows + 1))


@pytest.mark.parametrize("vocab", [1000, 49152, 49157])
def test_token_bitmask_matches_its_definition(vocab: int) -> None:
    """Masked rows get -inf exactly where their bit is 0 (whole words, mixed words, a ragged last word); other rows are untouched."""
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
    bitmask[:, : words // 3] = 0
    bitmask[:, words // 3 : words // 2] = -1
    logits = torch.randn(6, vocab, generator=g)
    rows = [0, 2, 5]
    got = logits.clone()
    cpu_kernels.apply_token_bitmask(got, bitmask, rows)
    token = torch.arange(vocab)
    allowed = ((bitmask[:, token // 32] >> (token % 32)) & 1).bool()  # [6, vocab]
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~allowed[rows], float("-inf"))
    assert torch.equal(got, expected)
    with pytest.raises(IndexError):
        cpu_kernels.apply_token_bitmask(got, bitmask, [6])
