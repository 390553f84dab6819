"""A LlamaIndex FunctionAgent on PagedLLM: the model calls a calculator or a city table, then answers.

    python examples/llamaindex_agent.py [--max-tokens 64]

The agent's first step must call a tool (``initial_tool_choice="required"``), and the engine
holds the call to the tool's schema, so even the bundled 135M model makes a valid one; after
the tool's result it answers (or calls again), within ``max_iterations`` steps. Every step
re-sends the conversation, so its earlier turns come from the engine's prefix cache.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import operator

from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from sdk.integrations.llamaindex import PagedLLM

SYSTEM = (
    "You are a helpful assistant. First call a tool to find the answer. "
    "When the tool response comes back, answer the question in one short sentence."
)

CITIES = {
    "paris": "Paris: population 2.1 million, country France, river Seine.",
    "tokyo": "Tokyo: population 14 million, country Japan, river Sumida.",
    "cairo": "Cairo: population 10 million, country Egypt, river Nile.",
    "lima": "Lima: population 10 million, country Peru, river Rimac.",
}

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.USub: operator.neg,
}  # fmt: skip


class Arithmetic(BaseModel):
    # NOTE: the pattern is part of the call's constraint: the model can only write arithmetic
    expression: str = Field(description="Numbers and + - * / ( ) only, e.g. 2 * (3 + 4)", pattern=r"^[0-9(][0-9+\-*/(). ]{0,39}$")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def city_facts(city: str) -> str:
    """Facts about a city: its population, country and river."""
    return CITIES.get(city.strip().lower(), f"No facts about {city}.")


TOOLS = [
    FunctionTool.from_defaults(fn=calculate, description="Calculate an arithmetic expression.", fn_schema=Arithmetic),
    FunctionTool.from_defaults(fn=city_facts, description="Facts about a city: its population, country and river."),
]


async def main(max_tokens: int) -> None:
    llm = PagedLLM(temperature=0, max_tokens=max_tokens)
    agent = FunctionAgent(tools=TOOLS, llm=llm, system_prompt=SYSTEM, initial_tool_choice="required")
    num_calls = 0
    for question in ["What is 17 * 23?", "Which river flows through Cairo?"]:
        handler = agent.run(question, max_iterations=4, early_stopping_method="generate")
        print(f"user:  {question}")
        async for event in handler.stream_events():
            if isinstance(event, ToolCallResult):
                num_calls += 1
                print(f"tool:  {event.tool_name}({event.tool_kwargs}) -> {event.tool_output.content}")
        answer = await handler
        print(f"agent: {str(answer).strip()}\n")

    stats = llm.client.stats()
    print(f"agent finished: {num_calls} tool calls")
    print(f"prefix cache: {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens hit "
          f"({stats['prefix_cache_hits'] / max(stats['prefix_cache_queries'], 1):.1%}); "
          f"{stats['prompt_tokens_computed']} prompt tokens computed")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main(parser.parse_args().max_tokens))
