"""Images in prompts (vLLM's input form) for the multimodal models the engine serves.

``Engine.generate``/``add_request`` and ``AsyncEngine.generate``/``stream`` take, besides text and token ids,
``{"prompt": text, "multi_modal_data": {"image": image or [images]}}`` and
``{"prompt_token_ids": ids, "multi_modal_data": {...}}`` (PIL images; the text holds the model's image
placeholder once per image, ``Engine.image_placeholder``). ``engine.multimodal.inputs`` turns one into token ids with
each placeholder expanded to the image's rows, and ``ImageInput``s; ``image_hash`` names an image by its content (the
prefix cache and the encoder cache key on it; audit records may carry it). Nothing here imports torch.
"""

from engine.multimodal.hashing import image_hash

__all__ = ["image_hash"]
