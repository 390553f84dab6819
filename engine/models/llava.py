"""LLaVA-style models: a vision tower (CLIP or SigLIP), a projector (linear, gelu, linear) into the language model's
embedding space, and a Llama-family language model whose prompt rows at the image token take the projected
image features instead of the token's embedding.

The engine reads it through ``engine.models.vision.SupportsImages``. Idefics3/SmolVLM (pixel shuffle) and
Qwen2-VL (rows per image size, M-RoPE) would each bring their own tower and projector behind the same interface.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.models.registry import get_model_class
from engine.models.vision import ACTIVATIONS, vision_tower
from engine.multimodal.layout import llava_tokens_per_image


def feature_layers(config) -> list[int]:
    """The tower's hidden states the projector reads (``vision_feature_layer``: one index, or several joined)."""
    layer = config.vision_feature_layer
    return [layer] if isinstance(layer, int) else list(layer)


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(features)))``: the tower's features (several layers' side by side) to text rows."""

    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        text_size = config.text_config.hidden_size
        in_size = config.vision_config.hidden_size * len(feature_layers(config))
        if config.projector_hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"projector activation {config.projector_hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        self.linear_1 = nn.Linear(in_size, text_size, bias=bias)
        self.act = ACTIVATIONS[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_size, text_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module):
    """LLaVA 1.5-style (``SupportsImages``): every image is one tile of the tower's size, ``image_token_count``
    rows."""

    def __init__(self, config) -> None:
        super().__init__()
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not 'default' or 'full'")
        self.drop_first = strategy == "default"  # the class token (CLIP), or the first patch (as HF does)
        self.image_token_id: int = config.image_token_id
        self.feature_layers = feature_layers(config)
        vision = config.vision_config
        deepest = max(layer + vision.num_hidden_layers + 1 if layer < 0 else layer for layer in self.feature_layers)
        self.vision_tower = vision_tower(vision, deepest)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.image_token_count: int = llava_tokens_per_image(config)
        self.language_model = get_model_class(config.text_config)(config.text_config)

    @property
    def lm_head(self) -> nn.Module:
        """The output head (the loader keeps it unquantized)."""
        return self.language_model.lm_head

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, tokens, text hidden]
        states = self.vision_tower.hidden_states(pixel_values, self.feature_layers)
        if self.drop_first:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        image_embeds: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        body = self.language_model.model
        x = body.embed(input_ids)  # [T, hidden]
        if image_rows is not None and image_rows.numel():
            x = x.index_copy(0, image_rows, image_embeds.to(x.dtype))
        return body(input_ids, positions, inputs_embeds=x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def checkpoint_renames(self, checkpoint) -> tuple[tuple[str, str], ...]:
        """Our names -> the checkpoint's: LLaVA's own layout (``language_model.model.*``, ``vision_tower.*``, what
        transformers 5 saves), with the tower under ``vision_model.`` (the Hub's llava-hf checkpoints), or
        transformers 4's (``model.language_model.*``, ``model.vision_tower.*``, ``lm_head``)."""
        renames: list[tuple[str, str]] = []
        probe = "vision_tower.encoder.layers.0.layer_norm1.weight"
        if probe not in checkpoint and f"model.{probe}" not in checkpoint:
            renames.append(("vision_tower.", "vision_tower.vision_model."))
        if "model.multi_modal_projector.linear_1.weight" in checkpoint:
            renames += [
                ("language_model.model.", "model.language_model."),
                ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower."),
                ("multi_modal_projector.", "model.multi_modal_projector."),
            ]
        return tuple(renames)
