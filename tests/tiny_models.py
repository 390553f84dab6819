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

# Architectures whose norms transformers initializes to weight 0 (Gemma scales by 1 + w): the factory draws their
# norm weights N(0, 0.3^2) instead, so that a norm loaded into another's place changes the logits.
RANDOM_NORMS = {"gemma2", "gemma3_text"}

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
    # Gemma 2: layers alternate sliding (window 8: 2 blocks of 4) and full; soft caps small enough to bite; the
    # query scale not head_dim's
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16, sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
            query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # Gemma 3: sliding, full, sliding (local rope base 10000, global 1e6 scaled linearly by 2); q/k norms
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    # Phi-3: fused qkv / gate_up; LongRoPE switching to its long factors at position 32, the attention factor
    # from max_position_embeddings / 32
    "phi3": (
        "Phi3Config",
        dict(
            tie_word_embeddings=False, pad_token_id=None, original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        ),
    ),
    # Phi-4-mini: rope over 3/4 of each head (6 of 8 frequencies), tied embeddings
    "phi4_mini": (
        "Phi3Config",
        dict(
            tie_word_embeddings=True, pad_token_id=None, original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
            },
        ),
    ),
}

# A tiny LLaVA: a CLIP tower of 30x30 images in 6x6 patches (25 patches and a class token; the "default" strategy
# drops the class token: 25 image tokens, not a multiple of the tests' blocks of 4), a Llama language model, and
# the processor: the bundled tokenizer plus an "<image>" token, CLIP's image processor, a chat template that
# renders {"type": "image"} content parts as "<image>".
TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=30, patch_size=6,
    projection_dim=32,
)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_llava(out, tokenizer_source, **overrides) -> None:
    """Saves a seeded random-weight ``LlavaForConditionalGeneration`` and its ``LlavaProcessor`` in ``out``.

    ``overrides`` set LlavaConfig fields (``vision_feature_layer``, ``vision_feature_select_strategy``, ...); a tuple
    is given as a list (the factory's arguments are hashable).
    """
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, **TINY,
    )
    vision = transformers.CLIPVisionConfig(**TINY_VISION)
    fields = {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
    fields.update((name, list(value) if isinstance(value, tuple) else value) for name, value in overrides.items())
    full = fields["vision_feature_select_strategy"] == "full"
    num_tokens = (TINY_VISION["image_size"] // TINY_VISION["patch_size"]) ** 2 + full
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id, image_seq_length=num_tokens, **fields
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # the projector's default init is tiny next to the embeddings: make images matter
        for param in model.model.multi_modal_projector.parameters():
            param.normal_(0.0, 0.5)
    model.save_pretrained(out)
    side = TINY_VISION["image_size"]
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=TINY_VISION["patch_size"],
        vision_feature_select_strategy=config.vision_feature_select_strategy, chat_template=LLAVA_CHAT_TEMPLATE,
        image_token="<image>", num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)


# multimodal architectures the tiny_model_factory builds with a saver of their own: arch -> saver(out, tokenizer dir)
TINY_MULTIMODAL = {"llava": save_tiny_llava}
