"""End to end on the bundled SmolLM2-135M-Instruct: `paged serve`'s app answers a real question over HTTP."""

from __future__ import annotations

import openai

from integrations.openai_server.app import create_app


def test_bundled_model_answers_over_http(live_server):
    """A greedy chat through the official client gets a sensible answer, with usage and cached-token details."""
    server = live_server(create_app(api_key="sk-e2e", num_blocks=256, max_num_seqs=8))
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-e2e", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in first.choices[0].message.content
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the shared prompt's full blocks were reused
