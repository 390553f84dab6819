"""A request's routing key: the engine's block hashes of its prompt's first full blocks.

The ingress renders a chat request with the model's chat template (``sdk.chat_template``) and
tokenizes a completion prompt as the engine does, then chains the hashes of the first
``max_blocks`` full blocks with ``engine.core.block_hash``: for a request without a cache salt
they are the hashes under which the replica's engine caches those blocks, so a replica can tell
which of them it still holds.

A chat with images (a model with an ``ImageLayout``) is rendered with the image placeholder and each
placeholder expanded to the image's run of tokens, as the engine lays the prompt out; the blocks
holding an image's tokens take the image's key as the engine's do (``block_image_keys``). That key is
a digest of the ``image_url`` part's URL, not the engine's ``image_hash`` of the pixels: decoding
every image in the ingress (8 ms for a 336x336 PNG, over 100 ms for a 2048x1536 JPEG on one core;
the ingress has a quarter of a CPU) would cost what the replica spends again. So the same image sent again (the same data URL, or
the same remote URL) routes where it went before, by the router's memory of what it sent where; the
text before the first image still matches the blocks replicas report cached, the blocks from the
image on never do (the engine hashes them by pixels).

NOTE: the key is a hint, never a correctness input. A body that does not parse, a conversation the
template rejects, or tools (rendered into the prompt by the SDK, left out here) give an empty or
different key; the request is still served, only routed by load or by a key that does not match
the engine's blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

from engine.core.block_hash import BlockHash, MultiModalSpan, extend_block_hashes
from engine.errors import RequestRejected
from engine.processor import tokenize
from engine.multimodal.inputs import expand_image_runs
from engine.multimodal.layout import ImageLayout
from sdk.chat_template import render_chat
from sdk.errors import PagedError
from sdk.types import ImagePart
from sdk.wire import message_from_wire

DEFAULT_MAX_BLOCKS = 32  # hashes per request: 512 tokens of prefix at the default block size

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class PrefixHasher:
    """Turns an OpenAI request body into the block hashes of its prompt's first blocks.

    Args:
        tokenizer: the served model's Hugging Face tokenizer (with its chat template).
        block_size: the engine's ``block_size``.
        max_blocks: how many leading full blocks to hash.
        images: the model's image layout (``engine.multimodal.layout.image_layout``); None for a text-only
            model, whose requests with images get no key.
    """

    def __init__(
        self, tokenizer: Any, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS, images: ImageLayout | None = None
    ) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.images = images

    def hashes(self, path: str, body: bytes) -> list[BlockHash]:
        """The leading block hashes of the request's prompt; empty when it has none to route by."""
        if path not in (CHAT_PATH, COMPLETIONS_PATH):
            return []
        try:
            data = json.loads(body)
            if path == CHAT_PATH:
                return self.block_hashes(*self._chat_ids(data))
            return self.block_hashes(self._prompt_ids(data))
        except (ValueError, TypeError, KeyError, AttributeError, PagedError, RequestRejected):
            return []  # the replica answers the malformed request with the server's own error

    def block_hashes(self, token_ids: Sequence[int], mm_spans: Sequence[MultiModalSpan] = ()) -> list[BlockHash]:
        """The hashes of the first ``max_blocks`` full blocks of ``token_ids``, each image (``mm_spans``: first
        position, tokens, key) in the hashes of the blocks holding its tokens."""
        hashes: list[BlockHash] = []
        num_tokens = min(len(token_ids), self.max_blocks * self.block_size)
        extend_block_hashes(hashes, token_ids, num_tokens, self.block_size, None, mm_spans)
        return hashes

    def _chat_ids(self, data: dict[str, Any]) -> tuple[list[int], list[MultiModalSpan]]:
        """The chat's token ids as the engine lays them out (image runs expanded) and its images' spans."""
        messages = [message_from_wire(m) for m in data["messages"]]
        layout = self.images
        token_ids = render_chat(self.tokenizer, messages, image_placeholder=None if layout is None else layout.placeholder)
        parts = [part for m in messages for _, part in m.image_parts]
        if layout is None or not parts:
            return token_ids, []
        token_ids, offsets = expand_image_runs(token_ids, layout.image_token_id, len(parts), layout.tokens_per_image)
        window = self.max_blocks * self.block_size
        # NOTE: an image past the hashed blocks is in no key: its URL is not hashed
        return token_ids, [
            (offset, layout.tokens_per_image, image_key(part)) for offset, part in zip(offsets, parts) if offset < window
        ]

    def _prompt_ids(self, data: dict[str, Any]) -> list[int]:
        prompt = data["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first one routes the request
        if isinstance(prompt, str):
            return tokenize(self.tokenizer, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []


def image_key(part: ImagePart) -> str:
    """An image part's routing key: a digest of its URL (a data URL holds the image's bytes)."""
    return blake2b(part.image_url.url.encode(), digest_size=16, person=b"paged.route.img").hexdigest()
