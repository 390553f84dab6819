"""The structured-output acceptance set: 100 extraction prompts and the nested schema their replies follow.

Every route (in process, ``PagedChat.with_structured_output``, ``paged serve`` with the
openai client) sends the same conversations and checks each reply with ``validate``:

    for prompt in PROMPTS:
        reply = ...  # route-specific, greedy, max_tokens=MAX_TOKENS, response_format=SCHEMA_MODEL
        validate(reply)  # JSON text, a dict, or a SCHEMA_MODEL instance

The schema and prompts are the ``paged bench --workload structured`` ones
(``integrations.bench.extraction``).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from pydantic import BaseModel

from integrations.bench.extraction import MAX_OUTPUT_TOKENS, SYSTEM, Extraction, extraction_prompts

__all__ = ["MAX_TOKENS", "PROMPTS", "SCHEMA", "SCHEMA_MODEL", "SYSTEM", "messages", "validate"]

SCHEMA_MODEL = Extraction
SCHEMA: dict[str, Any] = Extraction.model_json_schema()
PROMPTS: list[str] = extraction_prompts(100)
MAX_TOKENS = MAX_OUTPUT_TOKENS  # no reply of the set is cut short at this budget


def messages(prompt: str) -> list[dict[str, str]]:
    """The conversation of one prompt: ``SYSTEM`` then the prompt as the user's turn."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def validate(obj_or_text: str | dict[str, Any] | BaseModel) -> Extraction:
    """Checks a reply against ``SCHEMA`` (jsonschema) and ``SCHEMA_MODEL`` (pydantic, strict).

    Returns:
        The reply as a ``SCHEMA_MODEL`` instance.

    Raises:
        json.JSONDecodeError: text that is not JSON.
        jsonschema.ValidationError: JSON the schema refuses.
        pydantic.ValidationError: JSON the model refuses.
    """
    if isinstance(obj_or_text, BaseModel):
        obj_or_text = obj_or_text.model_dump(mode="json")
    value = json.loads(obj_or_text) if isinstance(obj_or_text, str) else obj_or_text
    jsonschema.validate(value, SCHEMA)
    return Extraction.model_validate(value, strict=True)
