"""File types: which GGML type each tensor of a Q4_K_M / Q8_0 / F16 ... file gets, as llama-quantize chooses."""

from __future__ import annotations

import pytest

from engine.model_files.gguf_file_types import FILE_TYPES, tensor_types, use_more_bits


def _llama_tensors(num_layers: int, hidden: int, inter: int, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    vocab = 1000
    tensors = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    if not tied:
        tensors.append(("output.weight", (vocab, hidden)))
    for i in range(num_layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.attn_q.weight", (hidden, hidden)),
            (f"blk.{i}.attn_k.weight", (hidden // 4, hidden)), (f"blk.{i}.attn_v.weight", (hidden // 4, hidden)),
            (f"blk.{i}.attn_output.weight", (hidden, hidden)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
            (f"blk.{i}.ffn_gate.weight", (inter, hidden)), (f"blk.{i}.ffn_up.weight", (inter, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, inter)),
        ]  # fmt: skip
    return tensors


def test_more_bits_layers_of_a_24_layer_model() -> None:
    """llama.cpp's use_more_bits: the first and last eighth and every third layer between."""
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]


def test_q4_k_m_mix_of_a_tied_model() -> None:
    """Q4_K_M on SmolLM2-1.7B's layout: the tied embedding in Q6_K, attn_v and ffn_down of the more-bits layers
    in Q6_K, every other matrix Q4_K, norms F32."""
    types = tensor_types(_llama_tensors(24, 2048, 8192, tied=True), "Q4_K_M", 24)
    more = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
    assert types["token_embd.weight"] == "Q6_K" and types["output_norm.weight"] == "F32"
    for i in range(24):
        expect = "Q6_K" if i in more else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == expect and types[f"blk.{i}.ffn_down.weight"] == expect
        assert {types[f"blk.{i}.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {
            "Q4_K"
        }
        assert types[f"blk.{i}.attn_norm.weight"] == types[f"blk.{i}.ffn_norm.weight"] == "F32"


def test_untied_model_keeps_the_embedding_in_the_default_type() -> None:
    """With an output head of its own, output.weight is Q6_K and token_embd.weight the file's default."""
    types = tensor_types(_llama_tensors(8, 256, 512, tied=False), "Q4_K_M", 8)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    types = tensor_types(_llama_tensors(8, 256, 512, tied=False), "Q4_0", 8)
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_0"
    assert types["blk.0.ffn_down.weight"] == types["blk.0.attn_v.weight"] == "Q4_0"


def test_rows_not_a_multiple_of_256_fall_back_like_llama_quantize() -> None:
    """SmolLM2-135M's width 576: Q4_K -> Q5_0, Q6_K -> Q8_0; ffn_down's rows of 1536 keep their K-quant."""
    types = tensor_types(_llama_tensors(30, 576, 1536, tied=True), "Q4_K_M", 30)
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.attn_v.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.3.ffn_down.weight"] == "Q4_K"
    types = tensor_types(_llama_tensors(2, 576, 1536, tied=True), "Q5_K_M", 2)
    assert types["blk.0.ffn_gate.weight"] == "Q5_1"


def test_rows_no_32_block_divides_are_f16_for_k_quants_and_refused_otherwise() -> None:
    """A width of 40 leaves no block type: a K-quant falls back to F16, Q8_0 is refused naming the tensor."""
    assert tensor_types([("blk.0.ffn_up.weight", (64, 40))], "Q4_K_M", 1) == {"blk.0.ffn_up.weight": "F16"}
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight': rows of 40 are not a whole number of Q8_0 blocks"):
        tensor_types([("blk.0.ffn_up.weight", (64, 40))], "Q8_0", 1)


@pytest.mark.parametrize("file_type", ["F32", "F16", "BF16", "Q8_0"])
def test_uniform_file_types(file_type: str) -> None:
    """F32 / F16 / BF16 / Q8_0: every matrix in that type (the output head too), vectors F32."""
    types = tensor_types(_llama_tensors(4, 256, 512, tied=False), file_type, 4)
    assert {t for n, t in types.items() if "norm" not in n} == {file_type}
    assert {t for n, t in types.items() if "norm" in n} == {"F32"}


def test_every_file_type_has_llamas_number() -> None:
    """general.file_type values are llama.cpp's LLAMA_FTYPE_* numbers."""
    assert {name: number for name, (number, _) in FILE_TYPES.items()} == {
        "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_M": 15, "Q5_K_M": 17,
        "Q6_K": 18, "BF16": 32,
    }  # fmt: skip
    with pytest.raises(ValueError, match="file type must be one of"):
        tensor_types([], "Q3_K_S", 1)
