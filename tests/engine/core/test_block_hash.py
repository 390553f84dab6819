"""Prefix-block hashes: chained, salted, unambiguous, and the same built incrementally or at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_hash import HASH_SIZE, encode_extra_keys, extend_block_hashes, hash_block_tokens


def test_hash_is_a_fixed_size_digest_and_deterministic() -> None:
    """A block hash is a 16-byte digest that depends only on its inputs."""
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == HASH_SIZE
    assert h == hash_block_tokens(None, [1, 2, 3, 4])


def test_hash_chains_over_the_parent() -> None:
    """The same tokens after different prefixes hash differently."""
    p1, p2 = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(p1, [5, 6]) != hash_block_tokens(p2, [5, 6])
    assert hash_block_tokens(p1, [5, 6]) != hash_block_tokens(None, [5, 6])


def test_hash_separates_token_order_and_large_ids() -> None:
    """Token order and ids beyond 16/32 bits all change the hash."""
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1 << 33]) != hash_block_tokens(None, [0])


def test_extra_keys_change_the_hash_and_are_unambiguous() -> None:
    """Salts isolate blocks; ("ab",) vs ("a", "b") and 1 vs "1" never pack alike."""
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("tenant-a",)) not in {base, hash_block_tokens(None, [1, 2], ("tenant-b",))}
    assert encode_extra_keys(("ab",)) != encode_extra_keys(("a", "b"))
    assert encode_extra_keys((1,)) != encode_extra_keys(("1",))
    assert encode_extra_keys(()) == encode_extra_keys(None) == b""
    with pytest.raises(TypeError):
        encode_extra_keys((1.5,))  # type: ignore[arg-type]


def test_extend_matches_the_chain_of_single_block_hashes() -> None:
    """extend_block_hashes == chaining hash_block_tokens by hand, salt in the first block only."""
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, len(tokens), 4, cache_salt="s")
    h0 = hash_block_tokens(None, tokens[0:4], ("s",))
    h1 = hash_block_tokens(h0, tokens[4:8])
    assert hashes == [h0, h1]  # the 2-token tail is not a full block


def test_extend_stops_at_num_tokens() -> None:
    """Only blocks fully inside the first num_tokens tokens are hashed."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(12)), 7, 4)
    assert len(hashes) == 1


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=5),
    salt=st.none() | st.text(max_size=3),
)
def test_incremental_hashing_equals_one_pass(tokens: list[int], cuts: list[int], salt: str | None) -> None:
    """Hashing a growing token list step by step gives the same chain as one pass."""
    one_pass: list[bytes] = []
    extend_block_hashes(one_pass, tokens, len(tokens), 3, salt)
    stepwise: list[bytes] = []
    for cut in sorted(cuts) + [len(tokens)]:
        extend_block_hashes(stepwise, tokens[:cut], cut, 3, salt)
    assert stepwise == one_pass
