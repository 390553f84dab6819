"""Vision towers: ViT encoders that turn a batch of preprocessed images into per-patch hidden states.

A tower is picked by its config's ``model_type`` (``vision_tower``); CLIP's and SigLIP's share the encoder layer
(pre-norm attention and MLP, LayerNorms, biased projections) and differ in their embeddings: CLIP prepends a class
embedding and norms the embeddings (``pre_layrnorm``), SigLIP has no class token and a biased patch projection.
Module names follow the checkpoints' (``embeddings.patch_embedding``, ``encoder.layers.N.self_attn.q_proj``, ...).
The towers run on plain ``torch.nn`` layers in the compute dtype (never quantized): an image is encoded once
(the encoder cache keeps its embeddings), so they are a small share of the work.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError

@runtime_checkable
class SupportsImages(Protocol):
    """A model that takes images: what the engine reads of it besides a causal LM's ``forward``/``compute_logits``.

    ``forward(input_ids, positions, image_embeds, image_rows)`` gives rows ``image_rows`` of the flat batch
    ``image_embeds``' rows, in order, instead of their tokens' embeddings.
    """

    image_token_id: int  # the placeholder token each of an image's rows holds

    @property
    def image_token_count(self) -> int:
        """The rows (tokens) one image takes."""
        ...

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` preprocessed images -> ``[B, image_token_count, hidden]`` rows for the language model."""
        ...


ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention over one image's patches."""

    def __init__(self, config) -> None:
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(size, size) for _ in range(3))
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, P, hidden]
        batch, patches, size = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, P, hidden] -> [B, H, P, D]
            return t.view(batch, patches, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(batch, patches, size))


class VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"vision tower activation {config.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))


class VisionTower(nn.Module):
    """``hidden_states(pixel_values [B, C, H, W], layers) -> [B, P, hidden]`` per layer asked for.

    Index 0 is the encoder's input (the embeddings, normed where the tower norms them), index i the output of
    layer i; negative indices count from the end of the config's layers, as Hugging Face's ``hidden_states``
    tuple does. Only the layers up to the deepest one asked for (``num_layers``) are built and run.

    Args:
        config: the tower's Hugging Face vision config.
        num_layers: the encoder layers to build (the deepest layer a model reads).
    """

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.num_config_layers = config.num_hidden_layers
        self.patch_size = config.patch_size
        self.image_size = config.image_size
        self.encoder = VisionEncoder(config, num_layers)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """The tokens the encoder sees per image: the patches, and a class token where the tower has one."""
        raise NotImplementedError

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, num_positions, hidden]
        raise NotImplementedError

    def layer_index(self, layer: int) -> int:
        """A Hugging Face ``hidden_states`` index as an index ``0 .. num_config_layers``."""
        return layer + self.num_config_layers + 1 if layer < 0 else layer

    def hidden_states(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        wanted = [self.layer_index(layer) for layer in layers]
        x = self.embed(pixel_values)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = states[i] = layer(x)
        return [states[i] for i in wanted]


class CLIPVisionTower(VisionTower):
    """CLIP's ViT: a class embedding before the patches, learned positions, ``pre_layrnorm`` on the embeddings."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__(config, num_layers)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @property
    def num_positions(self) -> int:
        return self.num_patches + 1

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.pre_layrnorm(self.embeddings(pixel_values))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size, patch = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(size))
        self.patch_embedding = nn.Conv2d(config.num_channels, size, kernel_size=patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2 + 1, size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # [B, P, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class SiglipVisionTower(VisionTower):
    """SigLIP's ViT: patches only (a biased projection), learned positions, no norm before the encoder."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__(config, num_layers)
        self.embeddings = SiglipVisionEmbeddings(config)

    @property
    def num_positions(self) -> int:
        return self.num_patches

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.embeddings(pixel_values)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, size, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # [B, P, hidden]
        return patches + self.position_embedding.weight


VISION_TOWERS: dict[str, type[VisionTower]] = {
    "clip_vision_model": CLIPVisionTower,
    "siglip_vision_model": SiglipVisionTower,
}


def vision_tower(config, num_layers: int) -> VisionTower:
    """The tower of a Hugging Face vision config, its first ``num_layers`` encoder layers built.

    Raises:
        ModelLoadError: a tower we do not implement.
    """
    kind = getattr(config, "model_type", None)
    if kind not in VISION_TOWERS:
        raise ModelLoadError(f"unsupported vision tower {kind!r}; supported: {', '.join(VISION_TOWERS)}")
    return VISION_TOWERS[kind](config, num_layers)
