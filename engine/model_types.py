"""The model types the engine serves, without torch: the loader checks a model directory or GGUF file against
them before anything loads, and ``engine.models.registry`` imports each type's class from here."""

from __future__ import annotations

# Hugging Face model_type -> "module:class" of our model
MODEL_CLASSES: dict[str, str] = {
    "llama": "engine.models.llama:LlamaForCausalLM",  # Llama 2/3 and SmolLM2
    "mistral": "engine.models.llama:LlamaForCausalLM",
    "qwen2": "engine.models.qwen:Qwen2ForCausalLM",
    "qwen3": "engine.models.qwen:Qwen3ForCausalLM",
    "mixtral": "engine.models.mixtral:MixtralForCausalLM",
    "qwen3_moe": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "gemma2": "engine.models.gemma:Gemma2ForCausalLM",
    "gemma3_text": "engine.models.gemma:Gemma3ForCausalLM",
    "phi3": "engine.models.phi3:Phi3ForCausalLM",  # Phi-3, Phi-3.5, Phi-4-mini
    "llava": "engine.models.llava:LlavaForConditionalGeneration",  # a vision tower, projector and Llama-family LM
}
# encoder models served as pooling models (embedders, cross-encoders): ``engine.pooling.encoder``
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta")
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES) + ENCODER_MODEL_TYPES

# a GGUF file's general.architecture (llama.cpp's name) -> the model_type its metadata becomes
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",  # Llama, Mistral, SmolLM2; Mixtral (with llama.expert_count)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",  # Phi-3, Phi-3.5, Phi-4-mini
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "bert": "bert",  # BERT embedders (all-MiniLM, bge, e5) with their WordPiece vocab: engine.model_files.gguf_bert
}
# llama.cpp's other embedding architectures: refused by name (their Hugging Face directories say what is served)
GGUF_UNSERVED_EMBEDDERS = (
    "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert", "eurobert",
)
