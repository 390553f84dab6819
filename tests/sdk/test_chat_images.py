"""Images in chats through the SDK: rendering with placeholders, the in-process client, hooks and audit."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from engine.multimodal import image_hash
from sdk.chat_template import reads_content_parts, render_chat
from sdk.errors import ContentBlocked, InvalidRequestError
from sdk.hooks import AuditLog, Hook, RegexFilter
from sdk.images import ImageLimits
from sdk.types import ChatMessage
from tests.support.images import data_url, image_bytes, image_part

# NOTE: the shape of llava-1.5's processor template: images first, then text, per message
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
PNG = image_bytes("PNG", (24, 16))
URL = data_url(PNG)


def _ask(*parts: Any) -> ChatMessage:
    return ChatMessage(role="user", content=[p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts])


@pytest.fixture
def llava_tokenizer(tokenizer: Any) -> Any:
    parts = copy.deepcopy(tokenizer)
    parts.chat_template = LLAVA_TEMPLATE
    return parts


def test_parts_templates_get_image_parts_and_one_placeholder_per_image(llava_tokenizer: Any) -> None:
    messages = [_ask("What is this?", image_part(URL)), ChatMessage(role="assistant", content="A cat."), _ask(image_part(URL), image_part(URL), "And these?")]
    text = llava_tokenizer.decode(render_chat(llava_tokenizer, messages, image_placeholder="<image>"))
    assert text == "USER: <image>\nWhat is this? ASSISTANT: A cat. USER: <image>\n<image>\nAnd these? ASSISTANT:"
    assert reads_content_parts(LLAVA_TEMPLATE)


def test_string_templates_get_each_placeholder_before_the_text(tokenizer: Any) -> None:
    assert not reads_content_parts(tokenizer.chat_template)
    text = tokenizer.decode(render_chat(tokenizer, [_ask("What is this?", image_part(URL))], image_placeholder="<image>"))
    assert "<|im_start|>user\n<image>\nWhat is this?<|im_end|>" in text


def test_text_only_chats_render_as_before(tokenizer: Any) -> None:
    """A text model's prompt is the same with or without a placeholder known, and text parts equal a string."""
    plain = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    parts = [plain[0], _ask("H", "i")]
    assert render_chat(tokenizer, plain) == render_chat(tokenizer, plain, image_placeholder="<image>") == render_chat(tokenizer, parts)


def test_a_text_model_refuses_images_naming_the_part(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match="takes no images") as info:
        render_chat(tokenizer, [ChatMessage(role="user", content="hi"), _ask("look", image_part(URL))])
    assert info.value.param == "messages.1.content.1"


def test_text_that_spells_the_placeholder_is_refused(llava_tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match="2 image placeholders .* for 1 images") as info:
        render_chat(llava_tokenizer, [_ask("<image>", image_part(URL))], image_placeholder="<image>")
    assert info.value.param == "messages"


class _Seen(Hook):
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def on_request(self, ctx) -> None:  # noqa: ANN001
        self.texts = [m.text for m in ctx.messages]


async def test_in_process_client_sends_ids_and_images_and_audits_hashes(make_client, fake_engine, tmp_path: Path) -> None:
    fake_engine.accepts_images = True
    seen = _Seen()
    audit = AuditLog(tmp_path / "audit.jsonl", include_text=True)
    client = make_client(hooks=[seen, RegexFilter("secret", action="redact"), audit])
    jpeg = image_bytes("JPEG", (40, 30))
    result = await client.chat([_ask("the secret is", image_part(URL), image_part(data_url(jpeg, "image/jpeg")))], max_tokens=3)
    assert result.usage.completion_tokens == 3
    [images] = fake_engine.images_seen
    assert [i.size for i in images] == [(24, 16), (40, 30)] and all(i.mode == "RGB" for i in images)
    assert seen.texts == ["the secret is"]  # the filters read the text parts only
    record = json.loads((tmp_path / "audit.jsonl").read_text())
    assert record["images"] == [
        {"hash": image_hash(images[0]), "num_bytes": len(PNG), "width": 24, "height": 16, "mime_type": "image/png"},
        {"hash": image_hash(images[1]), "num_bytes": len(jpeg), "width": 40, "height": 30, "mime_type": "image/jpeg"},
    ]
    raw = (tmp_path / "audit.jsonl").read_text()
    assert URL.split(",")[1][:40] not in raw and "data:(omitted)" in raw  # never the bytes
    assert record["messages"][0]["content"][0]["text"] == "the [REDACTED] is"
    await client.aclose()


async def test_bad_images_and_text_models_fail_typed_and_the_engine_serves_on(make_client, fake_engine) -> None:
    client = make_client(image_limits=ImageLimits(max_images=1, max_image_pixels=1000))
    with pytest.raises(InvalidRequestError, match="takes no images") as info:
        await client.chat([_ask("look", image_part(URL))], max_tokens=2)
    assert info.value.param == "messages.0.content.1"
    fake_engine.accepts_images = True
    cases = [
        ([_ask(image_part(URL), image_part(URL))], "messages.0.content.1", "max_images"),
        ([_ask(image_part(data_url(image_bytes("PNG", (50, 50)))))], "messages.0.content.0.image_url", "max_image_pixels"),
        ([_ask(image_part(data_url(PNG, "image/webp")))], "messages.0.content.0.image_url", "declares image/webp"),
        ([_ask(image_part("https://example.com/cat.png"))], "messages.0.content.0.image_url", "remote image URLs are off"),
    ]
    for messages, param, match in cases:
        with pytest.raises(InvalidRequestError, match=match) as info:
            await client.chat(messages, max_tokens=2)
        assert info.value.param == param
    assert fake_engine.images_seen == []  # nothing reached the engine
    assert (await client.chat([_ask("ok", image_part(URL))], max_tokens=2)).usage.completion_tokens == 2
    with pytest.raises(InvalidRequestError, match="prefix is text only"):
        await client.prefix([_ask("sys", image_part(URL))])
    await client.aclose()


async def test_a_filter_blocks_on_text_not_image_bytes(make_client, fake_engine) -> None:
    fake_engine.accepts_images = True
    payload = URL.split(",")[1][10:30]
    client = make_client(hooks=[RegexFilter(payload.replace("+", r"\+"))])
    assert (await client.chat([_ask("hi", image_part(URL))], max_tokens=1)).usage.completion_tokens == 1
    with pytest.raises(ContentBlocked):
        await client.chat([_ask(f"hi {payload}", image_part(URL))], max_tokens=1)
    await client.aclose()
