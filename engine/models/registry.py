"""Which model class serves an HF config."""

from __future__ import annotations

from torch import nn

from engine.errors import ModelLoadError
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,  # Llama 2/3 and SmolLM2
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def get_model_class(hf_config) -> type[nn.Module]:
    """The model class for ``hf_config.model_type``.

    Raises:
        ModelLoadError: the architecture is not one we implement.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise ModelLoadError(f"unsupported architecture {model_type!r}; supported: {', '.join(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]
