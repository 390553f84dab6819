"""On the real bundled SmolLM2, batched greedy decoding through the runner equals transformers' generate."""

from __future__ import annotations

import pytest
import torch
from runner_driver import PagedDriver

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner

MAX_NEW_TOKENS = 64

_LONG = " ".join(
    f"Paragraph {i}: the paged cache stores keys and values in fixed-size blocks, so memory grows with "
    f"the tokens in use and not with the longest possible request; block {i} holds sixteen tokens."
    for i in range(16)
)
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "人工智能是",
    _LONG + "\nSummary of the text above:",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
    [
        {"role": "system", "content": "You are a helpful assistant who answers in one sentence."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "请用一句话介绍北京。"}],
]


def prompt_ids(model_dir) -> list[list[int]]:
    """The eight prompts as token ids: the plain ones as they are, the chats through the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PLAIN_PROMPTS]
    for messages in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


@pytest.fixture(scope="module")
def prompts(bundled_model_dir) -> list[list[int]]:
    return prompt_ids(bundled_model_dir)


def test_batched_greedy_matches_transformers_generate(bundled_model_dir, prompts) -> None:
    """Eight varied prompts (English, Chinese, code, ~600 tokens, chat) decoded together give HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    assert 550 <= max(len(p) for p in prompts) <= 700
    runner = ModelRunner(EngineConfig(dtype="float32", device="cpu", num_blocks=160), bundled_model_dir)
    driver = PagedDriver(runner, seed=5)
    names = [str(i) for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        driver.add(name, prompt)
    ours: dict[str, list[int]] = {name: [] for name in names}
    chunks: dict[str, int | None] = {name: None for name in names}
    for _ in range(MAX_NEW_TOKENS):
        for name, logits in driver.step(chunks).items():
            token = int(logits.argmax())
            ours[name].append(token)
            driver.append(name, token)
        chunks = {name: 1 for name in names}

    hf = AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    for name, prompt in zip(names, prompts):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=eos
            )
        expected = out[0, len(prompt) :].tolist()
        assert ours[name][: len(expected)] == expected, f"prompt {name} diverges"
