"""A request's routing key: the engine's block hashes of its prompt's first full blocks.

The ingress renders a chat request with the model's chat template (``sdk.chat_template``) and
tokenizes a completion prompt as the engine does, then chains the hashes of the first
``max_blocks`` full blocks with ``engine.core.block_hash``: for a request without a cache salt
they are the hashes under which the replica's engine caches those blocks, so a replica can tell
which of them it still holds.

NOTE: the key is a hint, never a correctness input. A body that does not parse, a conversation the
template rejects, or tools (rendered into the prompt by the SDK, left out here) give an empty or
different key; the request is still served, only routed by load or by a key that does not match
the engine's blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.core.block_hash import BlockHash, extend_block_hashes
from engine.llm_engine import tokenize
from sdk.chat_template import render_chat
from sdk.errors import PagedError
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
    """

    def __init__(self, tokenizer: Any, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    def hashes(self, path: str, body: bytes) -> list[BlockHash]:
        """The leading block hashes of the request's prompt; empty when it has none to route by."""
        if path not in (CHAT_PATH, COMPLETIONS_PATH):
            return []
        try:
            data = json.loads(body)
            token_ids = self._chat_ids(data) if path == CHAT_PATH else self._prompt_ids(data)
        except (ValueError, TypeError, KeyError, AttributeError, PagedError):
            return []  # the replica answers the malformed request with the server's own error
        return self.block_hashes(token_ids)

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of the first ``max_blocks`` full blocks of ``token_ids``."""
        hashes: list[BlockHash] = []
        num_tokens = min(len(token_ids), self.max_blocks * self.block_size)
        extend_block_hashes(hashes, token_ids, num_tokens, self.block_size)
        return hashes

    def _chat_ids(self, data: dict[str, Any]) -> list[int]:
        messages = [message_from_wire(m) for m in data["messages"]]
        return render_chat(self.tokenizer, messages)

    def _prompt_ids(self, data: dict[str, Any]) -> list[int]:
        prompt = data["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first one routes the request
        if isinstance(prompt, str):
            return tokenize(self.tokenizer, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []
