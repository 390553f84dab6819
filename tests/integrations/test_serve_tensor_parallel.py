"""`paged serve --tensor-parallel-size 2` and `--pipeline-parallel-size 2`: a real server process whose engine runs
on two gloo ranks answers the openai client with transformers' greedy tokens, and exits cleanly (its rank process
with it) on SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.support.serve_process import serve_process

PROMPT = [500, 501, 502, 503, 504, 505, 506]
MAX_TOKENS = 8


def _rank_processes(pid: int) -> list[int]:
    """The processes ``pid``'s threads spawned with multiprocessing (its resource tracker aside)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_serve_with_two_ranks_answers_the_openai_client(flag, tiny_model_factory) -> None:
    """Completions (plain and streamed) carry transformers' greedy text; SIGTERM ends the server and its rank."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_factory("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected_ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(PROMPT):]
    expected = AutoTokenizer.from_pretrained(model_dir).decode(expected_ids)
    flags = ["--model", str(model_dir), "--num-blocks", "64", flag, "2", "--dtype", "float32",
             "--log-level", "WARNING"]  # fmt: skip
    with serve_process(*flags, timeout=120) as (proc, root):
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 1
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        options = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
        completion = client.completions.create(**options)
        assert completion.choices[0].text == expected
        assert completion.usage.completion_tokens == MAX_TOKENS
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**options, stream=True)
                           if chunk.choices)
        assert streamed == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in ranks:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
