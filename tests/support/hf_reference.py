"""transformers' logits and greedy tokens for a token sequence: the reference our model code is held to.

A forward over the whole sequence, except for LongRoPE (Phi-3): transformers rotates every position of a sequence
longer than ``original_max_position_embeddings`` by the long factors in such a forward, but a position at a time
over its cache (the engine's rule: each position by its own factors) when run a token at a time, as here."""

from __future__ import annotations

import torch


def _longrope(hf) -> bool:
    params = getattr(hf.config, "rope_parameters", None) or {}
    return params.get("rope_type") == "longrope"


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` float32: the logits after each prefix of ``tokens``."""
    with torch.inference_mode():
        if not _longrope(hf):
            return hf(torch.tensor([tokens])).logits[0].float()
        from transformers import DynamicCache

        cache, rows = DynamicCache(config=hf.config), []
        for position, token in enumerate(tokens):
            out = hf(torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache,
                     use_cache=True)  # fmt: skip
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens transformers picks greedily after ``prompt``."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
