"""The bundled SmolLM2 (a Q4_1 GGUF with a Q8_0 embedding) served in its own blocks, int8-quantized, and with
int8 products (w8a8), against the dequantized float32 model (transformers' reading of the same file): weights,
logits and greedy decoding on the eight prompts of test_bundled_greedy."""

from __future__ import annotations

import pytest
import torch
from runner_driver import PagedDriver
from test_bundled_greedy import prompt_ids

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.errors import ParameterError
from engine.layers.linear import Linear
from engine.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the CPU kernels")

MAX_NEW_TOKENS = 64


def _runner(model_dir, quantization: str | None, **settings) -> ModelRunner:
    return ModelRunner(EngineConfig(dtype="float32", num_blocks=400, quantization=quantization, **settings), model_dir)


@pytest.fixture(scope="module")
def runners(bundled_model_dir, bundled_gguf_dir) -> dict[str | None, ModelRunner]:
    """float32 (None), the GGUF file's own blocks alone ("gguf") and as it loads by default, with the dense layout
    for batches ("batched"), and the two quantizations of the float32 weights."""
    built = {method: _runner(bundled_model_dir, method) for method in (None, "int8", "w8a8")}
    return built | {"gguf": _runner(bundled_gguf_dir, None, batched_weights_memory=0),
                    "batched": _runner(bundled_gguf_dir, None)}


@pytest.fixture(scope="module")
def prompts(bundled_model_dir) -> list[list[int]]:
    return prompt_ids(bundled_model_dir)


def _decode(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens ``[prompt][step]`` of every prompt decoded together, and each step's logits ``[steps, vocab]``."""
    driver = PagedDriver(runner, seed=3)
    names = [str(i) for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        driver.add(name, prompt)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    chunks: dict[str, int | None] = {name: None for name in names}
    for _ in range(MAX_NEW_TOKENS):
        for name, row in driver.step(chunks).items():
            tokens[int(name)].append(int(row.argmax()))
            logits[int(name)].append(row)
            driver.append(name, tokens[int(name)][-1])
        chunks = {name: 1 for name in names}
    return tokens, [torch.stack(rows) for rows in logits]


def _compare(reference, got) -> tuple[int, float, float]:
    """Prompts whose greedy tokens all agree; over the steps whose inputs agree (up to and including the first
    differing token), the largest logit difference and the largest difference of the log-probability of the
    reference's token."""
    agree, worst_logit, worst_logprob = 0, 0.0, 0.0
    for ref_tokens, ref_logits, tokens, logits in zip(*reference, *got):
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        agree += same is None
        steps = MAX_NEW_TOKENS if same is None else same + 1
        ref_logits, logits = ref_logits[:steps], logits[:steps]
        worst_logit = max(worst_logit, (ref_logits - logits).abs().max().item())
        chosen = torch.tensor(ref_tokens[:steps]).unsqueeze(1)
        logprobs = [t.log_softmax(-1).gather(1, chosen) for t in (ref_logits, logits)]
        worst_logprob = max(worst_logprob, (logprobs[0] - logprobs[1]).abs().max().item())
    return agree, worst_logit, worst_logprob


@pytest.fixture(scope="module")
def reference(runners, prompts):
    return _decode(runners[None], prompts)


def test_gguf_blocks_are_the_dequantized_weights(runners) -> None:
    """By default a GGUF model runs from the file's blocks (120 Q4_1, one Q8_0), which dequantize to exactly the
    float32 weights transformers reads from the same file (llama.cpp's order of query and key rows undone); they
    take under a fourth of the memory."""
    gguf, dense = runners["gguf"], dict(runners[None].model.named_modules())
    assert gguf.weights.modules == {"Q4_1": 120, "Q8_0": 1}
    assert gguf.weights.products == f"int8 blocks of x ({cpu_kernels.ggml_linear_path()})"
    for name, module in gguf.model.named_modules():
        if isinstance(module, Linear):
            rows = torch.arange(module.out_features)
            assert torch.equal(module.quantized.rows(rows), cpu_kernels.packed_rows(dense[name].packed, rows, dense[name].in_features)), name
    assert gguf.weights.nbytes < runners[None].weights.nbytes / 4


def _steps_kept(reference, got) -> int:
    """The greedy steps, over all prompts, before each prompt's first token that differs from the reference's."""
    return sum(
        next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), MAX_NEW_TOKENS)
        for ref, ours in zip(reference[0], got[0])
    )


def _prefill_gap(reference, got) -> float:
    """The largest difference of any prompt's prefill logits from the reference's."""
    return max((ref[0] - ours[0]).abs().max().item() for ref, ours in zip(reference[1], got[1]))


def test_gguf_blocks_stay_near_float32(runners, prompts, reference) -> None:
    """The file's blocks times int8 blocks of x (as llama.cpp multiplies them) against the dequantized float32
    model: over prefill and 64 greedy steps of the 8 prompts, the tokens agree for an eighth of the steps or more,
    prefill's logits stay within 1.5 of float32's, and while the inputs agree the log-probability of float32's token
    moves by less than 0.6 (measured on an AVX2 CPU: 222 of 512 steps, 1 prompt whole, prefill's logits 0.87 apart,
    log-probabilities 0.36; with the output head in float32 too, 159 steps and 0.37: the layers' activations, not
    the head, set the error; on an AVX-512 VNNI CPU 116 steps, 0.88 and 0.32: the logits are as close, but where
    a greedy run first parts from float32's moves with the kernels' summation order)."""
    got = _decode(runners["gguf"], prompts)
    _, _, worst_logprob = _compare(reference, got)
    kept, prefill_logit = _steps_kept(reference, got), _prefill_gap(reference, got)
    assert kept >= len(prompts) * MAX_NEW_TOKENS // 8
    assert prefill_logit < 1.5 and worst_logprob < 0.6


def test_batched_layout_stays_near_float32(runners, prompts, reference) -> None:
    """The bundled model as it loads by default: 8 prompts decoded together run the dense layout made from the
    file's blocks (int8 products, the output head in bfloat16), which stays as near float32 (the same weights
    dequantized) as w8a8 of them: the prompts keep float32's greedy tokens for half the 8 x 64 steps or more,
    prefill's logits within 1.0, the log-probability of float32's token within 0.3 while the inputs agree."""
    batched = runners["batched"].weights.batched
    assert batched is not None and batched["min_rows"] <= len(prompts)
    got = _decode(runners["batched"], prompts)
    _, _, worst_logprob = _compare(reference, got)
    kept, prefill_logit = _steps_kept(reference, got), _prefill_gap(reference, got)
    assert kept >= len(prompts) * MAX_NEW_TOKENS // 2
    assert prefill_logit < 1.0 and worst_logprob < 0.3


def _small_steps(runner: ModelRunner, prompt: list[int], rows: int) -> list[torch.Tensor]:
    """The logits of ``prompt`` prefilled in chunks of ``rows`` tokens, then of 8 greedy steps."""
    driver = PagedDriver(runner, seed=5)
    driver.add("a", prompt)
    logits = []
    for start in range(0, len(prompt), rows):
        row = driver.step({"a": min(rows, len(prompt) - start)})
    for _ in range(8):
        logits.append(row["a"])
        driver.append("a", int(row["a"].argmax()))
        row = driver.step({"a": 1})
    return logits


def test_batched_layout_takes_the_blocks_below_its_rows(runners, prompts) -> None:
    """A step of fewer than ``min_rows`` rows reads the blocks: a prompt in chunks of ``min_rows - 1`` tokens and
    its decode steps give the blocks' logits bit for bit with the dense layout held."""
    rows = runners["batched"].weights.batched["min_rows"] - 1
    assert rows >= 1
    for got, want in zip(_small_steps(runners["batched"], prompts[0], rows), _small_steps(runners["gguf"], prompts[0], rows)):
        assert torch.equal(got, want)


def test_int8_agrees_with_float32(runners, prompts, reference) -> None:
    """int8 blocks of the float32 weights, the output head (the tied embedding) kept in float32: at least 6 of the
    8 prompts give float32's 64 greedy tokens, and while the inputs agree, the log-probability of float32's token
    moves by less than 0.01 (measured: 8 of 8, 2e-5; with the head quantized too, 5 of 8 and 0.08)."""
    agree, _, worst_logprob = _compare(reference, _decode(runners["int8"], prompts))
    assert agree >= 6
    assert worst_logprob < 0.01
    assert runners["int8"].weights.modules == {"q8": 120, "float32": 1}


def test_w8a8_stays_near_float32(runners, prompts, reference) -> None:
    """int8 weights times int8 activations (their blocks rotated) cost accuracy that int8 weights alone do not: the
    prompts keep float32's greedy tokens for half the 8 x 64 steps or more, prefill's logits stay within 1.0 of
    float32's, and while the inputs agree the log-probability of float32's token moves by less than 0.3 (measured
    with symmetric weight blocks: 311 of 512 steps, 3 prompts of 8 whole, the first divergence at step 3; prefill's
    logits 0.69 apart, log-probabilities 0.16; with min/max weight blocks on two CPUs 351-412 steps, 4-5 prompts
    whole, 0.64-0.68, 0.17-0.19; without the rotation 225 steps, 1 prompt whole, 0.39)."""
    got = _decode(runners["w8a8"], prompts)
    _, worst_logit, worst_logprob = _compare(reference, got)
    kept, prefill_logit = _steps_kept(reference, got), _prefill_gap(reference, got)
    assert kept >= len(prompts) * MAX_NEW_TOKENS // 2
    assert prefill_logit < 1.0 and worst_logprob < 0.3
    assert runners["w8a8"].weights.modules == {"q8": 120, "float32": 1}
    assert runners["w8a8"].weights.products == f"int8 ({cpu_kernels.int8_linear_path()}); output head float32"


def test_gguf_needs_a_gguf_model_and_float32_compute(tiny_model_factory) -> None:
    """quantization='gguf' on a Hugging Face directory, or with a compute dtype the kernels do not take, is a
    ParameterError naming the field."""
    path = tiny_model_factory("llama")
    with pytest.raises(ParameterError, match="not a GGUF file") as err:
        ModelRunner(EngineConfig(num_blocks=8, quantization="gguf"), path)
    assert err.value.param == "quantization"
    with pytest.raises(ParameterError, match="float32") as err:
        ModelRunner(EngineConfig(num_blocks=8, quantization="int8", dtype="float16"), path)
    assert err.value.param == "quantization"


def test_w8a8_without_vnni_says_it_is_slow(tiny_model_factory, caplog: pytest.LogCaptureFixture) -> None:
    """Where the int8 products run in plain C (no AVX512-VNNI, here by the cap), the start-up log warns that
    'int8' is the faster choice, and the weights' summary names the path."""
    limit = cpu_kernels.library().linear_int8_limit
    limit(cpu_kernels.INT8_LINEAR_PATHS.index("generic"))
    try:
        with caplog.at_level("WARNING", logger="engine.worker.model_runner"):
            runner = ModelRunner(EngineConfig(num_blocks=8, quantization="w8a8"), tiny_model_factory("llama"))
    finally:
        limit(len(cpu_kernels.INT8_LINEAR_PATHS) - 1)
    assert runner.weights.products == "int8 (generic); output head float32"
    assert "without AVX512-VNNI" in caplog.text and "quantization='int8'" in caplog.text
