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
        step = _stepper(hf)
        return torch.stack([step(token) for token in tokens])


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens transformers picks greedily after ``prompt``."""
    tokens = list(prompt)
    with torch.inference_mode():
        if not _longrope(hf):
            for _ in range(n):
                tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
        else:
            step = _stepper(hf)
            logits = [step(token) for token in prompt][-1]
            for _ in range(n):
                tokens.append(int(logits.argmax()))
                logits = step(tokens[-1])
    return tokens[len(prompt) :]


def _stepper(hf):
    """A function of the next token giving its logits, the model run a token at a time over its cache."""
    from transformers import DynamicCache

    cache, position = DynamicCache(config=hf.config), [0]

    def step(token: int) -> torch.Tensor:
        out = hf(torch.tensor([[token]]), position_ids=torch.tensor([[position[0]]]), cache=cache, use_cache=True)
        position[0] += 1
        return out.logits[0, -1].float()

    return step


def assert_engine_greedy_matches(model_dir, hf, prompts: list[list[int]], max_tokens: int) -> list:
    """The engine's greedy tokens are transformers' for each prompt alone and all batched, with prefix caching on
    and off, and every block comes back; returns the two engines (cached, uncached) for further checks."""
    from engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, p, max_tokens) for p in prompts]
    engines = []
    for caching in (True, False):
        engine = Engine(str(model_dir), num_blocks=64, block_size=4, enable_prefix_caching=caching)
        alone = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert alone == expected and together == expected
        assert (engine.stats()["prefix_cache_hits"] > 0) == caching
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        engines.append(engine)
    return engines
