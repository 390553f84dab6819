"""What a KV cache's element type (and the weights' dtype) costs in output, against the float32 cache.

Runs one model greedily under several settings and compares each with the reference setting (the first):
how many prompts' tokens all agree, the first differing token of each prompt, and the largest difference of
the chosen tokens' log-probabilities before it. Two prompt sets: English instructions in the chat template,
and random token ids of 50 to 2,000 tokens.

    python benchmarks/kv_cache_accuracy.py                       # the bundled model: float32, bfloat16, int8
    python benchmarks/kv_cache_accuracy.py --settings float32 bfloat16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import random

from engine import Engine, SamplingParams

INSTRUCTIONS = (
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "What is the capital of France, and why is it famous?",
    "Summarize the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
)

# name -> Engine keyword arguments
SETTINGS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "auto": {},
}


def run(model: str | None, setting: str, prompts: list, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log-probabilities under ``setting``."""
    engine = Engine(model, **SETTINGS[setting])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        outputs = engine.generate(prompts, params)
        result = []
        for output in outputs:
            completion = output.outputs[0]
            chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
            result.append((list(completion.token_ids), chosen))
        return result
    finally:
        engine.close()


def compare(reference: list, other: list) -> tuple[int, list[str], float]:
    """Prompts whose tokens all agree, each prompt's first differing token ("-": none), and the largest
    difference of the chosen tokens' log-probabilities before it."""
    agree, firsts, largest = 0, [], 0.0
    for (ref_tokens, ref_lp), (tokens, lp) in zip(reference, other):
        first = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        agree += first is None
        firsts.append("-" if first is None else str(first))
        shared = len(ref_tokens) if first is None else first
        largest = max([largest] + [abs(a - b) for a, b in zip(ref_lp[:shared], lp[:shared])])
    return agree, firsts, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory or .gguf file (default: the bundled one)")
    parser.add_argument("--settings", nargs="+", default=["float32", "bfloat16", "int8"], choices=sorted(SETTINGS))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    probe = Engine(args.model, dtype="float32", num_blocks=64)
    tokenizer, vocab = probe.tokenizer, probe.vocab_size
    probe.close()
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        for text in INSTRUCTIONS
    ]
    rng = random.Random(0)
    lengths = (50, 200, 400, 700, 1000, 1300, 1600, 2000)
    ids = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]} for n in lengths]
    sets = {"instructions": chats, "random ids": ids}

    results = {name: {kind: run(args.model, name, prompts, args.max_tokens) for kind, prompts in sets.items()}
               for name in args.settings}
    reference = args.settings[0]
    print(f"| setting, against {reference} | prompts | all tokens agree | first differing token, each prompt | "
          "largest chosen log-prob difference before it |")
    print("| --- | --- | ---: | --- | ---: |")
    for name in args.settings[1:]:
        for kind in sets:
            agree, firsts, largest = compare(results[reference][kind], results[name][kind])
            print(f"| {name} | {kind} | {agree} of {len(firsts)} | {', '.join(firsts)} | {largest:.3f} |")


if __name__ == "__main__":
    main()
