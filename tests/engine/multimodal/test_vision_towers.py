"""Our CLIP and SigLIP towers give transformers' hidden states, layer by layer."""

from __future__ import annotations

import pytest
import torch

from engine.models.vision import vision_tower

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=24, patch_size=6)


@pytest.mark.parametrize("kind", ["CLIPVision", "SiglipVision"])
def test_tower_hidden_states_equal_transformers(kind: str) -> None:
    import transformers

    config = getattr(transformers, f"{kind}Config")(**SMALL)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{kind}Model")(config).eval()
    ours = vision_tower(config, num_layers=config.num_hidden_layers).eval()
    state = {name.removeprefix("vision_model."): t for name, t in hf.state_dict().items()}
    missing, _ = ours.load_state_dict({k: v for k, v in state.items() if k in ours.state_dict()}, strict=False)
    assert not missing
    pixels = torch.randn(2, 3, SMALL["image_size"], SMALL["image_size"])
    with torch.no_grad():
        expected = hf(pixel_values=pixels, output_hidden_states=True).hidden_states
        got = ours.hidden_states(pixels, [0, 1, -2, -1])
    for layer, states in zip([0, 1, -2, -1], got):
        torch.testing.assert_close(states, expected[layer], atol=1e-5, rtol=0)
    assert got[0].shape[1] == ours.num_positions


@pytest.mark.parametrize("kind", ["CLIPVision", "SiglipVision"])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_image_layout_from_the_config_is_the_rows_the_model_gives(kind: str, strategy: str) -> None:
    """``image_layout`` (what the Ray router lays prompts out by, from the config alone) says the rows
    ``encode_images`` gives, for both towers and both feature strategies."""
    import transformers

    from engine.models.llava import LlavaForConditionalGeneration
    from engine.multimodal.layout import image_layout

    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    vision = getattr(transformers, f"{kind}Config")(**SMALL)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=63, vision_feature_select_strategy=strategy
    )
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        rows = model.encode_images(torch.zeros(1, 3, SMALL["image_size"], SMALL["image_size"])).shape[1]

    class Tokens:
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return f"<tok{token_id}>"

    assert image_layout(config, Tokens()) == (63, "<tok63>", rows)
    assert model.image_token_count == rows == (SMALL["image_size"] // SMALL["patch_size"]) ** 2 + (
        kind == "CLIPVision" and strategy == "full"
    ) - (kind == "SiglipVision" and strategy == "default")
    assert image_layout(text, Tokens()) is None  # a text model takes no images
