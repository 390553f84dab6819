"""Our own Llama-family model code; ``get_model_class`` picks one for an HF config."""

from engine.models.registry import get_model_class

__all__ = ["get_model_class"]
