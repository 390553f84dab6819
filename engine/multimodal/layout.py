"""Where a multimodal model's images sit in its prompts, from its Hugging Face config alone (no weights, no torch).

The model reads its own rows per image from here, and so can whoever lays out prompts without the model (the Ray
fleet's router, which hashes prompts as the engine caches them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

CLASS_TOKEN_TOWERS = frozenset({"clip_vision_model"})  # vision towers that put a class token before the patches


class ImageLayout(NamedTuple):
    """How one image appears in a prompt: its placeholder token, that token's text, and the run of tokens it becomes."""

    image_token_id: int
    placeholder: str
    tokens_per_image: int


def llava_tokens_per_image(config: Any) -> int:
    """The rows one image takes in a LLaVA-style model: the tower's patches, its class token where it has one, less
    the first row under ``vision_feature_select_strategy`` ``default``."""
    vision = config.vision_config
    positions = (vision.image_size // vision.patch_size) ** 2 + (vision.model_type in CLASS_TOKEN_TOWERS)
    return positions - (config.vision_feature_select_strategy == "default")


def image_layout(config: Any, tokenizer: Any) -> ImageLayout | None:
    """The image layout of a model's config (a ``transformers`` config); None for a model that takes no images."""
    if getattr(config, "model_type", None) != "llava":
        return None
    token_id = config.image_token_id
    return ImageLayout(token_id, tokenizer.convert_ids_to_tokens(token_id), llava_tokens_per_image(config))
