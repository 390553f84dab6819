"""A LangChain agent with real tools on PagedChat: several sessions at once on one shared system prompt.

    python examples/agent_tools.py [--max-tokens 48]

``langchain.agents.create_agent`` runs the ReAct loop: the model calls tools (a calculator
and a timetable lookup), reads their results and answers. A small model does not reach for
a tool by itself, so a middleware sets ``tool_choice="required"`` on each session's first
step (the engine then allows only valid calls) and ``"auto"`` after it: the loop ends when the
model answers in text. The sessions run concurrently (``asyncio.gather``); all start with the
same long system prompt and tool list, whose KV the engine computes once.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import operator
from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool

from sdk.integrations.langchain import PagedChat

TIMETABLE = {
    "lyon": {"departs": "09:42", "platform": 7, "fare_eur": 38},
    "geneva": {"departs": "10:15", "platform": 3, "fare_eur": 54},
    "marseille": {"departs": "11:05", "platform": 12, "fare_eur": 61},
    "lille": {"departs": "08:50", "platform": 1, "fare_eur": 29},
}

SYSTEM = (
    "You are the travel desk assistant of Northwind Trains, which runs direct trains from Paris "
    "to Lyon, Geneva, Marseille and Lille. Passengers ask about departures, platforms, fares and "
    "the cost of several tickets. Never guess a time, a platform or a fare: look it up with the "
    "timetable tool, which knows today's first departure to each city. For arithmetic, use the "
    "calculator tool with the whole expression, and never compute in your head. When a tool has "
    "answered, reply to the passenger in one short, friendly sentence that repeats the figures "
    "the tool gave. Tickets are sold at the counter and in the app; children under four travel "
    "free; bicycles need a reservation.\n\n"
    "Examples of the right tool for a question:\n"
    'Question: When is the train to Lille? Call: timetable {"city": "Lille"}\n'
    'Question: What does a ticket to Marseille cost? Call: timetable {"city": "Marseille"}\n'
    'Question: What is 2 * 29 + 5? Call: calculator {"expression": "2 * 29 + 5"}\n'
    'Question: How much is 4 times 54? Call: calculator {"expression": "4 * 54"}'
)

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def _evaluate(node: ast.AST) -> float:
    """Numbers and arithmetic operators only: names, calls and attributes are refused."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        if isinstance(node.op, ast.Pow) and abs(_evaluate(node.right)) > 100:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as "3 * 38" or "(54 + 29) / 2"."""
    try:
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


@tool
def timetable(city: str) -> str:
    """Today's first direct train from Paris to a city: departure time, platform and fare."""
    row = TIMETABLE.get(city.strip().lower())
    if row is None:
        return f"no direct train to {city}; the destinations are {', '.join(c.title() for c in TIMETABLE)}"
    return f"to {city.title()}: departs {row['departs']} from platform {row['platform']}, fare {row['fare_eur']} EUR"


@wrap_model_call
async def call_a_tool_first(
    request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
) -> ModelResponse:
    """A session's first step must call a tool; once a tool has answered, the model may answer."""
    answered = any(isinstance(m, ToolMessage) for m in request.messages)
    return await handler(request.override(tool_choice="auto" if answered else "required"))


QUESTIONS = [
    "When does the first train to Lyon leave, and from which platform?",
    "What is 17 * 23 + 4?",
    "What does a ticket to Geneva cost?",
    "What is 3 * 61?",
]


async def run_sessions(chat: PagedChat) -> list[dict[str, Any]]:
    agent = create_agent(chat, [calculator, timetable], system_prompt=SYSTEM, middleware=[call_a_tool_first])
    # NOTE: recursion_limit bounds each loop (a model step and a tool step per call round).
    config = {"recursion_limit": 8}
    return await asyncio.gather(*(agent.ainvoke({"messages": [("user", q)]}, config) for q in QUESTIONS))


def main(max_tokens: int) -> None:
    chat = PagedChat(temperature=0, max_tokens=max_tokens)
    results = asyncio.run(run_sessions(chat))
    num_calls, num_finished = 0, 0
    for question, result in zip(QUESTIONS, results, strict=True):
        print(f"user:   {question}")
        for message in result["messages"]:
            if isinstance(message, AIMessage):
                for call in message.tool_calls:
                    print(f"call:   {call['name']}({call['args']})")
                num_calls += len(message.tool_calls)
            elif isinstance(message, ToolMessage):
                print(f"result: {message.content}")
        last = result["messages"][-1]
        finished = isinstance(last, AIMessage) and not last.tool_calls
        num_finished += finished
        print(f"agent:  {last.content.strip() if finished else '(no answer)'}\n")

    stats = chat.client.stats()
    hit_rate = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
    print(f"prefix cache: {stats['prefix_cache_hits']} of {stats['prefix_cache_queries']} prompt tokens hit "
          f"({hit_rate:.1%}); {stats['prompt_tokens_computed']} prompt tokens computed")  # fmt: skip
    print(f"{num_finished} of {len(QUESTIONS)} sessions finished; {num_calls} tool calls made")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    main(parser.parse_args().max_tokens)
