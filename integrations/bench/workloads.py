"""Benchmark workloads: lists of prompts as token ids, built the same way for every contender.

- ``shared-prefix``: 64 support questions behind one ~290-token system prompt (the shared W1 file).
- ``distinct``: 64 requests, each with its own system prompt of similar length (W2); nothing to share.
- ``rag``: a few long documents built deterministically here, many questions over each.
- ``structured``: short extraction messages behind one instruction, decoded with and without the
  extraction JSON schema (``integrations.bench.extraction``).
- ``poisson`` and ``sweep`` reuse the shared-prefix prompts with a different arrival pattern.
- ``batch1`` has no prompts of its own: one request at a time, random token ids (``integrations.bench.batch1``).

Every prompt goes through the model's chat template once, here, so the engine and the
Hugging Face baselines see the same token ids.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any

WORKLOADS = ("shared-prefix", "distinct", "rag", "structured", "poisson", "sweep", "batch1", "embed")
_FILES = {"shared-prefix": "shared_prefix.json", "distinct": "distinct.json"}


@dataclass(frozen=True)
class Workload:
    """The prompts of one benchmark run."""

    name: str
    prompts: list[list[int]]  # chat-templated token ids, one list per request
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def load_turns(name: str) -> list[dict[str, str]]:
    """The ``{"system", "user"}`` chat turns of a packaged workload file."""
    text = resources.files("integrations.bench").joinpath("workloads", _FILES[name]).read_text()
    return json.loads(text)


def build_workload(name: str, tokenizer: Any, num_requests: int) -> Workload:
    """Workload ``name`` with ``num_requests`` prompts, templated with ``tokenizer``.

    Raises:
        ValueError: an unknown workload name or a non-positive request count.
    """
    turns, description = workload_turns(name, num_requests)
    prompts = [apply_chat_template(tokenizer, t["system"], t["user"]) for t in turns]
    return Workload(name=name, prompts=prompts, description=description)


def workload_turns(name: str, num_requests: int) -> tuple[list[dict[str, str]], str]:
    """The ``{"system", "user"}`` turns of workload ``name`` (``num_requests`` of them) and its description.

    Turns are cycled when more requests than the file holds are asked for (the sweep needs 128).
    Over HTTP these are sent as chat messages and the server applies its own template.

    Raises:
        ValueError: an unknown workload name or a non-positive request count.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if name == "batch1":
        return [], "batch1: one request at a time, decode and prefill as llama-bench times them"
    if name == "rag":
        turns = rag_turns(num_requests)
        description = "RAG: 4 shared ~600-token documents, distinct questions over them"
    elif name == "structured":
        from integrations.bench import extraction  # pydantic: only for this workload

        turns = [{"system": extraction.SYSTEM, "user": u} for u in extraction.extraction_prompts(num_requests)]
        description = "structured: extraction messages, with and without a nested JSON schema"
    elif name == "distinct":
        turns = load_turns("distinct")
        description = "distinct: one system prompt per request, nothing shared"
    else:
        turns = load_turns("shared-prefix")
        description = "shared-prefix: one ~290-token system prompt, distinct questions"
    return [turns[i % len(turns)] for i in range(num_requests)], description


def apply_chat_template(tokenizer: Any, system: str, user: str) -> list[int]:
    """Token ids of one system+user turn with the generation prompt appended."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


_TOPICS = ("solar inverter", "heat pump", "water softener", "e-bike battery")
_PARTS = ("the controller", "the main fuse", "the sensor cable", "the display", "the pump", "the filter")
_ACTIONS = ("reset", "inspect", "replace", "clean", "recalibrate", "update")
_SYMPTOMS = ("blinks red", "stays dark", "reports error E4", "beeps twice", "shuts down after a minute")


def rag_turns(num_requests: int, num_documents: int = 4, seed: int = 0) -> list[dict[str, str]]:
    """Deterministic RAG turns: each request quotes one of ``num_documents`` long manuals verbatim.

    Requests are assigned round-robin, so each document is shared by about
    ``num_requests / num_documents`` requests and its KV can be computed once.
    """
    rng = random.Random(seed)
    documents = [_manual(topic, rng) for topic in _TOPICS[:num_documents]]
    turns = []
    for i in range(num_requests):
        doc = i % len(documents)
        question = (
            f"Question {i}: my {_TOPICS[doc]} {rng.choice(_SYMPTOMS)} after I {rng.choice(_ACTIONS)} "
            f"{rng.choice(_PARTS)}. What should I do next?"
        )
        system = "Answer using only the manual below. Be brief.\n\n" + documents[doc]
        turns.append({"system": system, "user": question})
    return turns


def _manual(topic: str, rng: random.Random, num_sections: int = 12) -> str:
    sections = [f"Service manual for the {topic}."]
    for s in range(1, num_sections + 1):
        part, action, symptom = rng.choice(_PARTS), rng.choice(_ACTIONS), rng.choice(_SYMPTOMS)
        sections.append(
            f"Section {s}. If the unit {symptom}, first {action} {part}. Wait {rng.randint(2, 30)} "
            f"seconds, then check that the status light is green. If it is not, switch the {topic} off "
            f"at the isolator, {rng.choice(_ACTIONS)} {rng.choice(_PARTS)} and try again. Record the "
            f"serial number and the time in the service log before you call support."
        )
    return "\n".join(sections)
