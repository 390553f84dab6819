"""Which model class serves an HF config (the types and classes: ``engine.model_types``)."""

from __future__ import annotations

import importlib

from torch import nn

from engine.errors import ModelLoadError
from engine.model_types import MODEL_CLASSES


def get_model_class(hf_config) -> type[nn.Module]:
    """The model class for ``hf_config.model_type``.

    Raises:
        ModelLoadError: the architecture is not one we implement.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        raise ModelLoadError(f"unsupported architecture {model_type!r}; supported: {', '.join(MODEL_CLASSES)}")
    module, _, name = MODEL_CLASSES[model_type].partition(":")
    return getattr(importlib.import_module(module), name)
