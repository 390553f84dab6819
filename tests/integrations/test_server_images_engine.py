"""Images over HTTP on the real engine (a tiny random-weight LLaVA): the official openai client and the SDK's
clients get the in-process engine's greedy tokens, bad images are 400s and the engine serves on."""

from __future__ import annotations

import io
import json
from pathlib import Path

import openai
import pytest
from PIL import Image

from engine import Engine, SamplingParams
from integrations.openai_server.app import create_app
from integrations.openai_server.state import STATE
from sdk import AsyncClient
from sdk.hooks import AuditLog
from sdk.images import ImageLimits
from tests.support.images import data_url, image_part, noise_png, png_declaring

MAX_TOKENS = 8
ENGINE_CONFIG = dict(dtype="float32", device="cpu", block_size=4, num_blocks=256, max_num_seqs=8, max_model_len=512)
CAT, DOG = noise_png((50, 40), seed=1), noise_png((30, 70), seed=2)
QUESTION = [
    {"role": "system", "content": "Describe images."},
    {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(data_url(CAT)), {"type": "text", "text": "with"}, image_part(data_url(DOG))]},
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llava")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[int]:
    """The in-process engine's greedy tokens for QUESTION, its prompt from the model's own processor."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"}]},
    ]  # fmt: skip
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in (CAT, DOG)]
    engine = Engine(str(model_dir), **ENGINE_CONFIG)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([{"prompt": text, "multi_modal_data": {"image": images}}], greedy)
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory):
    from tests.integrations.conftest import LiveServer

    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    limits = ImageLimits(max_images=2, max_image_bytes=64 << 10, max_image_pixels=100 * 100)
    app = create_app(str(model_dir), image_limits=limits, hooks=[AuditLog(audit)], **ENGINE_CONFIG)
    live = LiveServer(app).start()
    live.audit = audit
    yield live
    live.stop()


def _greedy(**extra) -> dict:
    return dict(max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


def test_openai_client_gets_the_engines_greedy_tokens(server, expected: list[int]) -> None:
    client = server.openai("none")
    out = client.chat.completions.create(model=server.model_name, messages=QUESTION, **_greedy())
    assert out.choices[0].token_ids == expected
    chunks = client.chat.completions.create(model=server.model_name, messages=QUESTION, stream=True, **_greedy())
    assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or ())] == expected
    assert out.usage.prompt_tokens > 2 * 25  # each image's 25 tokens are in the prompt
    record = json.loads(server.audit.read_text().splitlines()[0])
    assert [(i["width"], i["height"], i["mime_type"], i["num_bytes"]) for i in record["images"]] == [
        (50, 40, "image/png", len(CAT)), (30, 70, "image/png", len(DOG)),
    ]  # fmt: skip
    assert data_url(CAT)[40:80] not in server.audit.read_text()


@pytest.mark.parametrize(
    ("part", "param", "match"),
    [
        (image_part("https://example.com/cat.png"), "messages.1.content.1.image_url", "remote image URLs are off"),
        (image_part(data_url(noise_png((160, 160)))), "messages.1.content.1.image_url", "max_image_bytes"),
        (image_part(data_url(png_declaring(60000, 60000))), "messages.1.content.1.image_url", "max_image_pixels"),
        (image_part(data_url(CAT, "image/webp")), "messages.1.content.1.image_url", "declares image/webp"),
        (image_part(data_url(CAT[:-50])), "messages.1.content.1.image_url", "corrupt"),
    ],
    ids=["remote-url", "bytes", "bomb", "mime", "corrupt"],
)
def test_bad_images_are_400s_and_the_engine_serves_on(server, expected: list[int], part, param: str, match: str) -> None:
    client = server.openai("none")
    messages = [QUESTION[0], {"role": "user", "content": [{"type": "text", "text": "Compare"}, part]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model_name, messages=messages, **_greedy())
    assert info.value.body["param"] == param and match in info.value.body["message"]
    out = client.chat.completions.create(model=server.model_name, messages=QUESTION, **_greedy())
    assert out.choices[0].token_ids == expected
    assert server.app[STATE].serving.stats()["num_requests_running"] == 0


def test_too_many_images_are_a_400(server) -> None:
    messages = [{"role": "user", "content": [image_part(data_url(CAT))] * 3}]
    with pytest.raises(openai.BadRequestError, match="max_images") as info:
        server.openai("none").chat.completions.create(model=server.model_name, messages=messages, **_greedy())
    assert info.value.body["param"] == "messages.0.content.2"


async def test_sdk_clients_in_process_and_remote_agree(server, model_dir: Path, expected: list[int]) -> None:
    options = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncClient(base_url=server.base_url) as remote:
        assert (await remote.chat(QUESTION, **options)).token_ids == expected
    async with AsyncClient(str(model_dir), **ENGINE_CONFIG) as local:
        assert (await local.chat(QUESTION, **options)).token_ids == expected
        again = await local.chat(QUESTION, **options)
        assert again.token_ids == expected and again.usage.cached_tokens > 50  # the images' blocks came from the cache
