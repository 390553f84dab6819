"""Configurations of the tiny random-weight models the tests build (see the tiny_model_factory fixture)."""

# Small enough to run in milliseconds, big enough to exercise GQA, several layers and blocks.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)

TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "mixtral": (
        "MixtralConfig",
        dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
    ),
    # a window of 6 blocks of 4: the equivalence tests' prompts and decodes run past it
    "mistral_sliding": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=24)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    # layers 0-1 full attention, 2-5 a window of 10 (2.5 blocks of 4): three KV cache groups of two layers
    "qwen2_sliding": (
        "Qwen2Config",
        dict(tie_word_embeddings=False, num_hidden_layers=6, use_sliding_window=True, sliding_window=10,
             max_window_layers=2),
    ),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16)),
    # layer 0 sparse, layer 1 dense (mlp_only_layers); the top-k weights not renormalized (norm_topk_prob)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
        ),
    ),
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True)),
}
