"""Images in the prefix-block hashes, the encoder cache's bound, and placeholder expansion, without a model."""

from __future__ import annotations

import pytest

from engine.core.block_hash import block_image_keys, extend_block_hashes
from engine.core.encoder_budget import EncoderBudget
from engine.core.kv_cache_manager import KVCacheManager
from engine.errors import RequestRejected
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import expand_image_runs
from tests.support.fresh_interpreter import run_fresh

IMG = 99
TOKENS = [1, 2, 3] + [IMG] * 6 + [4, 5, 6, 7]  # blocks of 4: [1 2 3 I] [I I I I] [I 4 5 6] [7]


def hashes(spans, tokens=TOKENS) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, len(tokens), 4, None, spans)
    return out


def test_an_image_keys_exactly_the_blocks_holding_its_tokens() -> None:
    text_only, a, b = hashes(()), hashes([(3, 6, "a")]), hashes([(3, 6, "b")])
    assert len(a) == 3
    assert block_image_keys([(3, 6, "a")], 0, 4) == ["a", 3] and block_image_keys([(3, 6, "a")], 4, 4) == ["a", -1]
    assert block_image_keys([(3, 6, "a")], 12, 4) == []
    assert a[0] != text_only[0] and a[0] != b[0]  # the image's first token is in block 0
    assert all(x != y for x, y in zip(a, b))  # and every later block chains over it
    # an image that starts later leaves the blocks before it as text-only requests hash them
    assert hashes([(4, 5, "a")], [1, 2, 3, 0] + [IMG] * 5 + [4, 5, 6, 7])[0] == hashes((), [1, 2, 3, 0])[0]


def test_the_same_tokens_with_another_image_hit_only_the_text_before_it() -> None:
    kv = KVCacheManager(32, 4, True, (None,))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] + [IMG] * 8 + [9, 10, 11]
    first = kv.get_computed_blocks("a", tokens, None, [(8, 8, "a")])
    assert kv.allocate_slots("a", tokens, 0, len(tokens), computed=first, mm_spans=[(8, 8, "a")]) is not None
    assert kv.get_computed_blocks("b", tokens, None, [(8, 8, "a")]).num_computed_tokens == 16
    assert kv.get_computed_blocks("c", tokens, None, [(8, 8, "other")]).num_computed_tokens == 8
    assert kv.get_computed_blocks("d", tokens, None, []).num_computed_tokens == 8
    kv.free("a")
    kv.check_integrity()


def test_encoder_cache_keeps_the_most_recently_used_within_its_bytes() -> None:
    cache = EncoderCache(max_bytes=100)
    cache.add("a", "A", 40)
    cache.add("b", "B", 40)
    assert cache.get("a") == "A"  # now "b" is the least recently used
    cache.add("c", "C", 40)
    assert "b" not in cache and cache.get("a") == "A" and cache.get("c") == "C"
    cache.add("huge", "H", 101)
    assert "huge" not in cache and cache.num_bytes == 80
    assert (cache.num_encoded, cache.num_hits, len(cache)) == (4, 3, 2)


def test_encoder_budget_cuts_chunks_before_the_image_past_the_steps_rows() -> None:
    cached = {"c"}
    budget = EncoderBudget(max_rows=10, is_cached=cached.__contains__)
    budget.start_step()
    assert budget.cut([(2, 8, "a")], 0, 5) == 5  # the first image always goes (8 rows of 10)
    assert budget.cut([(2, 8, "a"), (20, 8, "b")], 5, 30) == 15  # "a" counted already; "b" would make 16: cut before it
    assert budget.cut([(0, 8, "c")], 0, 10) == 10  # cached: costs nothing
    assert budget.cut([(0, 2, "d")], 0, 4) == 4  # 10 rows in all
    assert budget.cut([(3, 8, "e")], 5, 4) == 4  # a chunk starting inside an image encodes it whatever the budget
    budget.start_step()
    assert budget.cut([(20, 30, "b")], 0, 60) == 60  # a new step: one image larger than the budget goes alone
    assert budget.cut([(0, 1, "f")], 0, 3) == 0


def test_placeholders_expand_or_pass_when_expanded_already() -> None:
    assert expand_image_runs([1, IMG, 2, IMG], IMG, 2, 3) == ([1, IMG, IMG, IMG, 2, IMG, IMG, IMG], [1, 5])
    assert expand_image_runs([1, IMG, IMG, IMG, IMG, IMG, IMG], IMG, 2, 3) == ([1] + [IMG] * 6, [1, 4])
    assert expand_image_runs([1, 2], IMG, 0, 3) == ([1, 2], [])
    for ids, count in (([1, IMG, IMG], 1), ([1, IMG, IMG, 2, IMG, IMG], 2), ([IMG], 2)):
        with pytest.raises(RequestRejected) as info:
            expand_image_runs(ids, IMG, count, 3)
        assert info.value.param == "multi_modal_data.image"


def test_image_hash_and_prompt_checks_need_no_torch() -> None:
    """The SDK may hash images for audit records and check prompt dicts without importing torch."""
    result = run_fresh(
        """
import json, sys
from PIL import Image
from engine.multimodal import image_hash
from engine.multimodal.inputs import IMAGE_FIELD, split_prompt
digest = image_hash(Image.new("RGB", (3, 2), (1, 2, 3)))
text, images = split_prompt({"prompt": "a <image>", "multi_modal_data": {"image": Image.new("L", (2, 2))}})
print(json.dumps({"torch": "torch" in sys.modules, "digest": digest, "images": len(images), "field": IMAGE_FIELD}))
"""
    )
    assert result == {"torch": False, "digest": result["digest"], "images": 1, "field": "multi_modal_data.image"}
    assert len(result["digest"]) == 32
