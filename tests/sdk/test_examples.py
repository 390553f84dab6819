"""Every example runs to completion (as a user would run it), with short replies to keep it quick."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "quickstart.py": "prefix-cache hit rate",
    "async_app.py": "hash chain intact",
    "langchain_agent.py": "prompt tokens from the cache",
    "llamaindex_rag.py": "source (",
    "langchain_rag.py": "source (",
    "shared_runtime.py": "one engine for both clients: True",
    "llamaindex_agent.py": "agent finished",
    "agent_tools.py": "4 of 4 sessions finished",
}
# NOTE: a tool call needs more than 4 tokens: the agents' replies get room for whole calls.
ARGS = {"llamaindex_agent.py": ["--max-tokens", "48"], "agent_tools.py": ["--max-tokens", "48"]}


def test_examples_run_to_completion(tmp_path):
    """Each example exits 0 and prints its closing figures; they run side by side to overlap model loads."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    procs = {}
    for name in EXAMPLES:
        log = (tmp_path / f"{name}.log").open("w")
        procs[name] = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / name), *ARGS.get(name, ["--max-tokens", "4"])],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 600
    for proc in procs.values():
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    for name, marker in EXAMPLES.items():
        output = (tmp_path / f"{name}.log").read_text()
        assert procs[name].returncode == 0, f"{name} failed:\n{output[-3000:]}"
        assert marker in output, f"{name} did not print {marker!r}:\n{output[-3000:]}"
    for rag in ("llamaindex_rag.py", "langchain_rag.py"):  # retrieval and reranking on the engine find each answer's source
        output = (tmp_path / f"{rag}.log").read_text()
        assert re.search(r"battery last\?\nA: .*\n   source \([\d.]+\): The Sparrow's battery", output), output
        assert re.search(r"Lyon office\?\nA: .*\n   source \([\d.]+\): The Lyon office", output), output
    agent = (tmp_path / "llamaindex_agent.py.log").read_text()
    calls = re.search(r"agent finished: (\d+) tool calls", agent)
    assert calls and int(calls.group(1)) >= 2 and "-> error" not in agent, agent  # a good call per question
    calls = re.search(r"(\d+) tool calls made", (tmp_path / "agent_tools.py.log").read_text())
    assert calls and int(calls.group(1)) >= 4, "each of the 4 agent sessions calls a tool on its first step"
