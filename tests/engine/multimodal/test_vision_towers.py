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
