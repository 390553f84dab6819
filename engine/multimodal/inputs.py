"""A prompt with images (vLLM's dict form) -> token ids with each image's placeholder expanded, and the images.

The prompt holds the model's image token once per image, in the images' order; each becomes the
``tokens_per_image`` tokens the model's Hugging Face processor gives it (LLaVA: the vision tower's patches,
its class token too under the "full" strategy). A token-id prompt whose image runs are expanded already is
taken as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from engine.errors import ModelLoadError, RequestRejected

IMAGE_FIELD = "multi_modal_data.image"


class ImageInput(NamedTuple):
    """One image of a prompt: the run of tokens it fills, its content hash and its preprocessed pixels."""

    offset: int  # the prompt position of its first token
    length: int  # its tokens (the embedding rows its encoder output has)
    hash: str  # ``image_hash``: the prefix cache's and the encoder cache's key
    pixel_values: Any  # the model's image processor's output for it, a numpy array [C, H, W]


class ProcessedPrompt(NamedTuple):
    """A prompt as the engine queues it: token ids (image runs expanded) and its images, by position."""

    prompt_token_ids: list[int]
    images: tuple[ImageInput, ...] = ()


def split_prompt(prompt: Any) -> tuple[str | list[int], list[Any]]:
    """The text or token ids of a prompt, and its images (none for a str or a token-id list).

    Raises:
        RequestRejected: a dict without exactly one of ``prompt``/``prompt_token_ids``, ``multi_modal_data``
            that is not a dict of ``image`` only, or an image that is not a PIL image (field
            ``multi_modal_data.image``).
    """
    if not isinstance(prompt, dict):
        return prompt, []
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise RequestRejected(f"prompt dict has unknown keys {sorted(unknown)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise RequestRejected("a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids'")
    text = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if "prompt" in prompt and not isinstance(text, str):
        raise RequestRejected(f"prompt must be a str; got {type(text).__name__}")
    if "prompt_token_ids" in prompt and not isinstance(text, (list, tuple)):
        raise RequestRejected(f"prompt_token_ids must be a list of token ids; got {type(text).__name__}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise RequestRejected("multi_modal_data must be a dict with an 'image' entry only", param="multi_modal_data")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if images:
        from PIL import Image  # NOTE: only where images are given: text prompts never need Pillow

        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise RequestRejected(
                    f"{IMAGE_FIELD}[{i}] must be a PIL.Image.Image; got {type(image).__name__}", param=IMAGE_FIELD
                )
    return (text if isinstance(text, str) else list(text)), images


def expand_image_runs(
    token_ids: Sequence[int], image_token_id: int, num_images: int, tokens_per_image: int
) -> tuple[list[int], list[int]]:
    """The token ids with each image placeholder made ``tokens_per_image`` image tokens, and each image's offset.

    Raises:
        RequestRejected: the image tokens are neither one per image nor ``tokens_per_image`` per image in runs
            of whole images (field ``multi_modal_data.image``).
    """
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) == num_images:
        expanded: list[int] = []
        offsets = []
        start = 0
        for position in positions:
            expanded += token_ids[start:position]
            offsets.append(len(expanded))
            expanded += [image_token_id] * tokens_per_image
            start = position + 1
        return expanded + list(token_ids[start:]), offsets
    if len(positions) == num_images * tokens_per_image and all(
        positions[i] == positions[i - 1] + 1 for i in range(1, len(positions)) if i % tokens_per_image
    ):
        return list(token_ids), positions[::tokens_per_image]
    raise RequestRejected(
        f"the prompt has {len(positions)} image tokens for {num_images} images: one placeholder per image "
        f"(or {tokens_per_image} image tokens per image, expanded)",
        param=IMAGE_FIELD,
    )


class ImagePrompts:
    """A multimodal model's image inputs: its placeholder, how many tokens an image takes, and its image processor.

    Args:
        model_dir: the model's directory (its Hugging Face image processor's config).
        image_token_id: the model's image token.
        placeholder: the image token's text.
        tokens_per_image: the embedding rows the model gives one image.

    Raises:
        ModelLoadError: the directory has no image processor config.
    """

    def __init__(self, model_dir: Any, image_token_id: int, placeholder: str, tokens_per_image: int) -> None:
        from transformers import AutoImageProcessor

        self.image_token_id = image_token_id
        self.placeholder = placeholder
        self.tokens_per_image = tokens_per_image
        try:
            self._image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{str(model_dir)!r} has no image processor a multimodal model needs: {e}") from None

    def process(self, token_ids: Sequence[int], images: list[Any]) -> ProcessedPrompt:
        """Expands the placeholders and preprocesses the images as the model's Hugging Face processor does.

        Raises:
            RequestRejected: placeholders and images do not match (field ``multi_modal_data.image``).
        """
        expanded, offsets = expand_image_runs(token_ids, self.image_token_id, len(images), self.tokens_per_image)
        if not images:
            return ProcessedPrompt(expanded)
        from engine.multimodal.hashing import image_hash

        pixels = self._image_processor(images=images, return_tensors="np")["pixel_values"]
        return ProcessedPrompt(expanded, tuple(
            ImageInput(offset, self.tokens_per_image, image_hash(image), pixel_values)
            for offset, image, pixel_values in zip(offsets, images, pixels)
        ))  # fmt: skip


def process_prompt(
    prompt: Any, tokenize: Callable[[str | list[int]], list[int]], images: ImagePrompts | None
) -> ProcessedPrompt:
    """A prompt (text, token ids, or a dict with images) as token ids and images.

    Args:
        prompt: what the caller gave.
        tokenize: text or ids -> ids (``engine.processor.tokenize`` with a tokenizer).
        images: the model's image inputs; None for a text-only model.

    Raises:
        RequestRejected: a malformed prompt dict; images for a text-only model; placeholders that do not match
            the images (the image errors name the field ``multi_modal_data.image``).
    """
    text, given = split_prompt(prompt)
    return attach_images(tokenize(text), given, images)


def attach_images(token_ids: list[int], given: list[Any], images: ImagePrompts | None) -> ProcessedPrompt:
    """A tokenized prompt and its images (``split_prompt``'s) as the engine queues them: the images' share of
    ``process_prompt``, which may run on another thread (it uses no tokenizer).

    Raises:
        RequestRejected: images for a text-only model, or placeholders that do not match the images.
    """
    if images is None:
        if given:
            raise RequestRejected(f"{IMAGE_FIELD}: this model takes no images (got {len(given)})", param=IMAGE_FIELD)
        return ProcessedPrompt(token_ids)
    return images.process(token_ids, given)


def image_prompts(runner: Any, tokenizer: Any, model_dir: Path) -> ImagePrompts | None:
    """A multimodal model's image inputs, from its runner's model; None for a text-only model."""
    if getattr(runner, "encoder_cache", None) is None:
        return None
    model = runner.model
    placeholder = tokenizer.convert_ids_to_tokens(model.image_token_id)
    return ImagePrompts(model_dir, model.image_token_id, placeholder, model.image_token_count)
