"""SamplingParams validation: every limit names its field, and checks cost no allocation."""

from __future__ import annotations

import math
import time

import pytest

from engine.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SamplingParams


def test_defaults_are_valid() -> None:
    """The defaults build and mean: sample at temperature 1, no filters, 256 tokens."""
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n) == (1.0, 1.0, 0, 256, 1)
    assert not p.is_greedy and not p.has_penalties


def test_normalisation() -> None:
    """A single stop str becomes a 1-tuple, lists become tuples, top_k=-1 means off."""
    p = SamplingParams(stop="END", stop_token_ids=[5, 6], top_k=-1, temperature=0)
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6) and p.top_k == 0 and p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10**12), "max_tokens"),
        (dict(max_tokens=1.5), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(seed=-1), "seed"),
        (dict(n=0), "n"),
        (dict(n=MAX_N + 1), "n"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    """Each bad value raises ValueError whose message starts with the field name."""
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_absurd_sizes_are_rejected_in_microseconds() -> None:
    """A huge stop list or stop string is rejected by its size, without iterating or copying it."""
    huge_list = ["x"] * 1_000_000
    huge_str = "x" * 10_000_000
    huge_ids = [0] * 1_000_000
    start = time.perf_counter()
    for _ in range(100):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=huge_list)
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=huge_str)
        with pytest.raises(ValueError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=huge_ids)
    assert (time.perf_counter() - start) / 300 < 1e-3
