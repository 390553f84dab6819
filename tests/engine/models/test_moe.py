"""The sparse mixture-of-experts block, and the MoE models in the weight formats dense linears have."""

from __future__ import annotations

import random

import pytest
import torch
from runner_driver import PagedDriver

from engine import Engine, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.layers.moe import SparseMoeBlock
from engine.layers.quantization import quantize_int8
from engine.worker.model_runner import ModelRunner, resolve_dtypes
from tests.support.bf16_paths import bf16_path
from tests.support.hf_reference import hf_greedy

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 4, 2
_WIDENED_BF16 = pytest.mark.skipif(
    resolve_dtypes("bfloat16", torch.device("cpu")) != (torch.float32, torch.bfloat16),
    reason="without the C kernels bfloat16 computes in bfloat16",
)
UNCHOSEN = 3  # the expert the test router never picks


def _block(renormalize: bool) -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, renormalize)
    for param in block.parameters():
        param.data.normal_(0, 0.2)
    block.gate.weight.data[UNCHOSEN] = -1.0  # with x > 0 its logit is the least of every token's
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: softmax, top-k (renormalized as the block says), the chosen experts' weighted sum."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ block.gate.weight.T, dim=-1)
        weights, experts = probs.topk(TOP_K)
        if block.gate.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            expert = block.experts[int(e)]
            gate, up = (x[t] @ expert.gate_up_proj.weight.T).chunk(2)
            out[t] += w * ((torch.nn.functional.silu(gate) * up) @ expert.down_proj.weight.T)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_block_matches_a_per_token_loop_and_skips_unchosen_experts(renormalize: bool, tokens: int) -> None:
    block = _block(renormalize)
    x = torch.rand(tokens, HIDDEN) + 0.1
    block.experts[UNCHOSEN].forward = lambda _: pytest.fail("an expert with no tokens ran")
    with torch.no_grad():
        got = block(x)
        assert UNCHOSEN not in block.gate(x).experts
    torch.testing.assert_close(got, _reference(block, x), atol=1e-5, rtol=1e-5)


def test_router_rejects_more_experts_per_token_than_experts() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be in \\[1, num_experts=4\\]"):
        SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, 5, renormalize=True)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="the decoder plan is the C kernels'")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_layers_run_on_the_decoder_plan(tiny_model_factory, arch: str) -> None:
    runner = ModelRunner(EngineConfig(num_blocks=40), tiny_model_factory(arch))
    assert runner.decoder_plan is not None and runner.layers == "one C call a step"
    mlps = [type(layer.mlp).__name__ for layer in runner.model.model.layers]
    assert mlps == (["SparseMoeBlock", "SparseMoeBlock"] if arch == "mixtral" else ["SparseMoeBlock", "LlamaMLP"])
    eager = ModelRunner(EngineConfig(num_blocks=40, enforce_eager=True), tiny_model_factory(arch))
    assert eager.decoder_plan is None and eager.layers == "modules"


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def _is_router(name: str) -> bool:
    return name.endswith(".gate.weight")  # mlp.gate / block_sparse_moe.gate: kept in float32 by the engine


def _drive(runner: ModelRunner) -> tuple[PagedDriver, list[tuple[str, int, torch.Tensor]]]:
    """A prefill of two requests, a prefill over a cached prefix and decode steps: each request's tokens, and the
    logits the runner gave (request, position, logits)."""
    rng = random.Random(5)
    driver = PagedDriver(runner, seed=6)
    expected: list[tuple[str, int, torch.Tensor]] = []

    def record(out: dict[str, torch.Tensor]) -> None:
        for req_id, logits in out.items():
            expected.append((req_id, len(driver.tokens[req_id]) - 1, logits))

    driver.add("a", _prompt(rng, 19))
    driver.add("b", _prompt(rng, 4))
    record(driver.step({"a": None, "b": None}))
    driver.fork("c", "a", 4, _prompt(rng, 6))
    for step in range(3):
        for req_id in "ab":
            driver.append(req_id, rng.randrange(3, 49152))
        record(driver.step({"a": 1, "b": 1} | ({"c": None} if step == 0 else {})))
    assert len(expected) == 2 + 3 * 2 + 1
    return driver, expected


def _check_against(runner: ModelRunner, hf, atol: float) -> None:
    """The runner's logits over ``_drive``'s steps are ``hf``'s within ``atol``."""
    driver, expected = _drive(runner)
    with torch.inference_mode():
        reference = {r: hf(torch.tensor([t])).logits[0].float() for r, t in driver.tokens.items()}
    for req_id, position, logits in expected:
        torch.testing.assert_close(logits, reference[req_id][position], atol=atol, rtol=0)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="int8 runs on the CPU kernels")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_int8_experts_give_the_logits_of_their_dequantized_weights(tiny_model_factory, arch: str) -> None:
    """Every expert quantized to int8 blocks (the router and the output head not): the logits are those of HF's
    model with the same weights replaced by their blocks' values."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    runner = ModelRunner(EngineConfig(block_size=4, num_blocks=40, quantization="int8"), path)
    experts = [m for n, m in runner.model.named_modules() if ".experts." in n and isinstance(m, Linear)]
    assert experts and all(m.quantized is not None and m.quantized.kind == "q8" for m in experts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() >= 2 and not _is_router(name) and not name.startswith("lm_head"):
                matrices = param.view(-1, param.shape[-1])  # a 3D expert tensor: its experts' rows in turn
                matrices.copy_(quantize_int8(matrices).dequantize())
    _check_against(runner, hf, atol=1e-4)


@_WIDENED_BF16
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_experts_give_the_logits_of_their_rounded_weights(tiny_model_factory, arch: str) -> None:
    """bfloat16 weights widened exactly, float32 router: HF's float32 logits of the same checkpoint with every
    matrix but the router rounded to bfloat16, up to the bfloat16 KV cache's rounding."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    with bf16_path("widened"):
        runner = ModelRunner(EngineConfig(dtype="bfloat16", block_size=4, num_blocks=40), path)
        assert runner.kv_cache.dtype == torch.bfloat16
        assert runner.model.model.layers[0].mlp.gate.weight.dtype == torch.float32
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if param.dim() >= 2 and not _is_router(name):
                    param.copy_(param.bfloat16())
        _check_against(runner, hf, atol=5e-3)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="the decoder plan is the C kernels'")
@pytest.mark.parametrize(
    ("fmt", "threads"),
    [("float32", None), ("float32", 8), ("float32:int8", None), pytest.param("bfloat16", None, marks=_WIDENED_BF16)],
)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_decoder_plan_gives_the_modules_logits(tiny_model_factory, arch: str, fmt: str, threads: int | None) -> None:
    """The same steps on the decoder plan and on the modules (``enforce_eager``), experts in float32, int8 blocks
    or bfloat16: the logits agree within float32 rounding (the router's matmul is the only kernel that differs).
    8 threads, more than the 4 experts: the plan runs the chosen experts in turn, each on every thread, rather
    than a thread an expert."""
    dtype, _, quantization = fmt.partition(":")
    logits = []
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        for eager in (False, True):
            config = EngineConfig(dtype=dtype, block_size=4, num_blocks=40, quantization=quantization or None,
                                  enforce_eager=eager)  # fmt: skip
            runner = ModelRunner(config, tiny_model_factory(arch))
            assert (runner.decoder_plan is None) == eager
            logits.append(_drive(runner)[1])
    finally:
        torch.set_num_threads(before)
    for (req_id, position, plan), (_, _, modules) in zip(*logits, strict=True):
        torch.testing.assert_close(plan, modules, atol=2e-6, rtol=0, msg=f"{req_id} at {position}")


@pytest.mark.skipif(cpu_kernels.library() is None, reason="the decoder plan is the C kernels'")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_engine_on_the_plan_gives_transformers_greedy_tokens(tiny_model_factory, arch: str) -> None:
    """Prompts sharing a prefix, on the decoder plan: transformers' greedy tokens alone and batched, with prefix
    caching on and off, and every block comes back."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shared = list(range(300, 318))
    prompts = [shared + [500 + i] * (i + 1) for i in range(3)] + [list(range(700, 709))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    for caching in (True, False):
        engine = Engine(str(path), num_blocks=64, block_size=4, enable_prefix_caching=caching)
        assert engine.runner.decoder_plan is not None
        alone = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        together = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert alone == expected and together == expected
        assert (engine.stats()["prefix_cache_hits"] > 0) == caching
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.skipif(cpu_kernels.library() is None, reason="the decoder plan is the C kernels'")
def test_decoder_plan_runs_only_the_chosen_experts(tiny_model_factory) -> None:
    """A one-token step on the plan: with every expert its token did not choose (as the modules route it) poisoned
    with NaN the logits are unchanged; poisoning a chosen one makes them NaN."""
    path = tiny_model_factory("mixtral")
    modules = ModelRunner(EngineConfig(block_size=4, num_blocks=40, enforce_eager=True), path)
    chosen: dict[int, set[int]] = {}
    for index, layer in enumerate(modules.model.model.layers):

        def record(_module, _args, routing, index: int = index) -> None:
            chosen.setdefault(index, set()).update(routing.experts.flatten().tolist())

        layer.mlp.gate.register_forward_hook(record)
    driver = PagedDriver(modules, seed=1)
    driver.add("a", [77])
    driver.step({"a": None})
    assert all(len(experts) == TOP_K for experts in chosen.values())

    plan = ModelRunner(EngineConfig(block_size=4, num_blocks=40), path)

    def logits() -> torch.Tensor:
        driver = PagedDriver(plan, seed=1)
        driver.add("a", [77])
        return driver.step({"a": None})["a"]

    def poison(layer: int, expert: int) -> None:
        for linear in (plan.model.model.layers[layer].mlp.experts[expert].gate_up_proj,
                       plan.model.model.layers[layer].mlp.experts[expert].down_proj):  # fmt: skip
            linear.packed.fill_(float("nan"))

    expected = logits()
    for layer, experts in chosen.items():
        for expert in set(range(len(plan.model.model.layers[layer].mlp.experts))) - experts:
            poison(layer, expert)
    assert torch.equal(logits(), expected)
    poison(0, min(chosen[0]))
    assert logits().isnan().all()
