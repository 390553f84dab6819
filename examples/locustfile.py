"""A locust load test of an OpenAI-compatible server with the shared-prefix chat workload.

    PAGED_API_KEY=sk-... locust -f examples/locustfile.py --host http://127.0.0.1:8000 \\
        --headless --users 16 --spawn-rate 4 --run-time 2m

Each simulated user sends the workload's support questions (one ~290-token system prompt,
distinct questions) as streaming chat completions, greedy, EOS ignored, one after another.
Locust's own row for the request times its response headers; three custom rows (type SSE,
in ms) time the stream: "time to first token", "inter-token" (the mean gap between content
events of a request) and "end to end".
Settings from the environment: ``PAGED_API_KEY``, ``PAGED_MODEL`` (default: the first model
``/v1/models`` lists) and ``PAGED_MAX_TOKENS`` (default 128). ``paged bench --base-url``
runs the same workload with seeded arrivals and SLO figures, without locust.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from locust import HttpUser, constant, task

from integrations.bench.workloads import load_turns

TURNS = load_turns("shared-prefix")
MAX_TOKENS = int(os.environ.get("PAGED_MAX_TOKENS", "128"))


class SharedPrefixChatUser(HttpUser):
    """Streams one shared-prefix chat after another and reports TTFT and inter-token time as custom metrics."""

    wait_time = constant(0)

    def on_start(self) -> None:
        key = os.environ.get("PAGED_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = os.environ.get("PAGED_MODEL")
        if self.model is None:
            resp = self.client.get("/v1/models", headers=self.headers, name="/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        self.turns = itertools.cycle(TURNS)

    @task
    def chat(self) -> None:
        turn = next(self.turns)
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": turn["system"]}, {"role": "user", "content": turn["user"]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        stamps: list[float] = []
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, stream=True, catch_response=True,
            name="chat (stream)",
        ) as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    resp.failure(str(event["error"])[:200])
                    return
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    stamps.append(time.perf_counter())
            if not stamps:
                resp.failure("the stream ended without content")
                return
            resp.success()
        self._report("end to end", time.perf_counter() - start)
        self._report("time to first token", stamps[0] - start)
        if len(stamps) > 1:
            self._report("inter-token", (stamps[-1] - stamps[0]) / (len(stamps) - 1))

    def _report(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="SSE", name=name, response_time=seconds * 1e3, response_length=0, exception=None, context={}
        )
