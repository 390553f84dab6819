"""A tiny LLaVA end to end: transformers' processor's tokens and greedy tokens, the prefix cache and the encoder cache
keyed by image content, and typed errors for images the engine cannot take."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from PIL import Image

from engine import Engine, RequestRejected, SamplingParams
from engine.async_engine import AsyncEngine
from engine.multimodal import image_hash

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 4
FIELD = "multi_modal_data.image"


def picture(seed: int, size: tuple[int, int] = (50, 40), mode: str = "RGB") -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llava")


@pytest.fixture(scope="module")
def reference(model_dir):
    """``(processor, generate(text, images) -> greedy token ids)`` of transformers' LLaVA."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(text: str, images: list[Image.Image]) -> list[int]:
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, min_new_tokens=GREEDY.max_tokens)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return processor, generate


def make_engine(model_dir, **overrides) -> Engine:
    settings = dict(dtype="float32", device="cpu", block_size=BLOCK, num_blocks=128, max_num_seqs=8)
    return Engine(str(model_dir), **{**settings, **overrides})


def chat(processor, *parts: str | Image.Image) -> str:
    content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


PROMPTS = [  # (text parts and images, in order)
    ("What is in this picture?", picture(1)),
    (picture(2, (64, 30), "L"), "Compare it with", picture(3, (30, 70)), "please."),
    ("A question without images.",),
]


@pytest.fixture(scope="module")
def cases(reference):
    processor, generate = reference
    out = []
    for parts in PROMPTS:
        text = chat(processor, *parts)
        images = [p for p in parts if isinstance(p, Image.Image)]
        out.append((text, images, generate(text, images)))
    return out


def request(text: str, images: list[Image.Image]) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def test_placeholders_expand_as_the_hf_processor_does(model_dir, reference, cases) -> None:
    """A str prompt, its token ids, and its ids with the image runs expanded already give the processor's tokens."""
    processor, _ = reference
    engine = make_engine(model_dir)
    assert engine.accepts_images and engine.image_placeholder == "<image>"
    for text, images, _ in cases:
        expected = processor(text=text, images=images or None)["input_ids"][0]
        assert engine.tokenize(request(text, images)) == expected
        ids = engine.tokenizer.encode(text)
        assert engine.tokenize({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}) == expected
        assert engine.tokenize({"prompt_token_ids": expected, "multi_modal_data": {"image": images}}) == expected


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=11),  # chunks of 11 cut every image's run of 25 tokens
    ],
    ids=["prefix-caching", "no-prefix-caching", "chunks-cut-images"],
)
def test_greedy_tokens_equal_transformers(model_dir, cases, settings) -> None:
    """One image, two images and text only, each alone and all batched together, give transformers' tokens."""
    engine = make_engine(model_dir, **settings)
    for text, images, expected in cases:
        assert engine.generate(request(text, images), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    batched = engine.generate([request(t, i) for t, i, _ in cases], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [expected for *_, expected in cases]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def test_preempted_image_requests_recompute_their_images(model_dir, cases) -> None:
    """Two requests whose prompts fit the KV cache but whose completions do not: one is preempted, and its image
    rows computed again give the same tokens."""
    text, images, expected = cases[1]
    num_tokens = len(make_engine(model_dir, num_blocks=8).tokenize(request(text, images)))
    engine = make_engine(model_dir, num_blocks=2 * -(-(num_tokens + 1) // BLOCK) + 1, enable_prefix_caching=False)
    batched = engine.generate([request(text, images)] * 2, GREEDY, use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in batched] == [expected] * 2
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_and_encoder_cache_are_keyed_by_the_image(model_dir, reference) -> None:
    """The same image again hits every full block; another image with the same text recomputes from the first
    block holding image tokens; an image seen after other text is not encoded again."""
    processor, generate = reference
    engine = make_engine(model_dir)
    cache = engine.runner.encoder_cache
    a, b = picture(10), picture(11)
    text = chat(processor, "Look:", a, "What is it?")
    num_tokens = len(engine.tokenize(request(text, [a])))
    offset = engine.processor.process_prompt(request(text, [a])).images[0].offset

    def run(prompt_text: str, image: Image.Image) -> int:
        out = engine.generate(request(prompt_text, [image]), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == generate(prompt_text, [image])
        return out.num_cached_tokens

    assert run(text, a) == 0 and cache.num_encoded == 1
    assert run(text, a) == (num_tokens - 1) // BLOCK * BLOCK  # every full block but the last token's
    assert cache.num_encoded == 1  # its rows all came from the prefix cache
    assert run(text, b) == offset // BLOCK * BLOCK  # the text blocks before the image only
    assert cache.num_encoded == 2
    other = chat(processor, "See here:", a, "What is it?")
    hits = cache.num_hits
    run(other, a)  # its image blocks follow other text: computed again, from the cached embeddings
    assert cache.num_encoded == 2 and cache.num_hits == hits + 1
    stats = engine.stats()
    assert (stats["mm_encoder_runs"], stats["mm_encoder_cache_hits"]) == (2, hits + 1)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def test_a_step_encodes_images_within_its_token_budget(model_dir, reference) -> None:
    """Requests whose prefill chunks reach their images in one step: at 44 tokens a step two images' 50 rows do not
    fit, so the second image waits a step (vLLM's encoder budget); without the budget both encode in one step. The
    tokens are transformers' either way."""
    processor, generate = reference
    prompts = [(chat(processor, "Q" * (3 * i + 1), picture(30 + i), "what?"), [picture(30 + i)]) for i in range(3)]
    expected = [generate(text, images) for text, images in prompts]
    for budgeted, batches_expected in ((True, [1, 1, 1]), (False, [2, 1])):
        engine = make_engine(model_dir, max_num_batched_tokens=44)
        if not budgeted:
            engine.scheduler.encoder_budget = None
        batches: list[int] = []
        encode = engine.runner.model.encode_images
        engine.runner.model.encode_images = lambda pixels: (batches.append(len(pixels)), encode(pixels))[1]
        outs = engine.generate([request(text, images) for text, images in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert batches == batches_expected  # images encoded per step
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_image_hash_is_the_content(model_dir) -> None:
    assert image_hash(picture(5)) == image_hash(picture(5).copy())
    assert image_hash(picture(5)) != image_hash(picture(6))
    assert image_hash(picture(5)) != image_hash(picture(5, mode="L"))
    assert len(image_hash(picture(5))) == 32


def test_bad_images_are_refused_and_the_engine_keeps_serving(model_dir, tiny_model_factory, reference, cases) -> None:
    processor, _ = reference
    engine = make_engine(model_dir)
    text, images, expected = cases[0]
    bad = [
        (request(text + " <image>", images), "image tokens for 1 images"),  # two placeholders, one image
        (request(text, images * 2), "image tokens for 2 images"),
        (request(text, ["not an image"]), "must be a PIL.Image.Image"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": images}}, "0 image tokens for 1 images"),
    ]
    for prompt, message in bad:
        with pytest.raises(RequestRejected, match=message) as info:
            engine.add_request(None, prompt, GREEDY)
        assert info.value.param == FIELD
    with pytest.raises(RequestRejected) as info:
        engine.add_request(None, {"prompt": text, "multi_modal_data": {"video": images}}, GREEDY)
    assert info.value.param == "multi_modal_data"
    assert engine.stats()["requests_rejected"] == len(bad) + 1
    assert engine.generate(request(text, images), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected

    text_only = Engine(str(tiny_model_factory("llama")), num_blocks=32, block_size=BLOCK)
    assert not text_only.accepts_images and text_only.image_placeholder is None
    with pytest.raises(RequestRejected, match="takes no images") as info:
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": picture(1)}}, GREEDY, use_tqdm=False)
    assert info.value.param == FIELD
    assert text_only.generate({"prompt": "hi"}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_async_engine_streams_image_prompts(model_dir, cases) -> None:
    text, images, expected = cases[1]

    async def main() -> list[int]:
        engine = AsyncEngine(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK, num_blocks=64)
        try:
            assert engine.accepts_images and engine.image_placeholder == "<image>"
            with pytest.raises(RequestRejected) as info:
                async for _ in engine.stream(request(text, images[:1]), GREEDY):
                    pass
            assert info.value.param == FIELD
            tokens: list[int] = []
            async for delta in engine.stream(request(text, images), GREEDY):
                tokens += delta.token_ids
            return tokens
        finally:
            await engine.aclose()

    assert asyncio.run(main()) == expected


def test_full_strategy_and_several_feature_layers_equal_transformers(tiny_model_factory) -> None:
    """The "full" strategy keeps the class token's row (26 image tokens); several feature layers are joined."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model_dir = tiny_model_factory("llava", vision_feature_select_strategy="full", vision_feature_layer=(-1, -3))
    processor = AutoProcessor.from_pretrained(model_dir)
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    text, images = chat(processor, picture(7), "and", picture(8), "?"), [picture(7), picture(8)]
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, min_new_tokens=GREEDY.max_tokens)
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    assert engine.processor.process_prompt(request(text, images)).images[0].length == 26
    assert engine.tokenize(request(text, images)) == inputs["input_ids"][0].tolist()
    out = engine.generate(request(text, images), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("layout", ["hub", "transformers4"])
def test_checkpoint_layouts_load_alike(model_dir, cases, tmp_path, layout: str) -> None:
    """The Hub's llava-hf names (the tower under ``vision_model.``) and transformers 4's (``model.`` prefixes,
    ``lm_head``) load the same weights as the layout transformers 5 saves."""
    import shutil

    from safetensors.torch import load_file, save_file

    for path in model_dir.iterdir():
        shutil.copy(path, tmp_path / path.name)
    tensors = load_file(model_dir / "model.safetensors")

    def rename(name: str) -> str:
        name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if layout == "transformers4":
            name = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")
            for part in ("vision_tower.", "multi_modal_projector."):
                name = name.replace(part, f"model.{part}", 1) if name.startswith(part) else name
        return name

    save_file({rename(name): t for name, t in tensors.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text, images, expected = cases[1]
    engine = make_engine(tmp_path)
    assert engine.generate(request(text, images), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_kv_cache_dir_keeps_image_blocks_for_the_same_image_only(model_dir, reference, tmp_path) -> None:
    """A pinned image prompt saves every full block, its image's too (their files hold the image keys); a fresh engine
    given the same image prompt hits them all and never runs the encoder, one given another image with the same text
    hits the text before the image only; both give transformers' tokens."""
    processor, generate = reference
    image, other = picture(20), picture(21)
    text = chat(processor, "A long enough question before the picture:", image, "What is it?")
    processed = make_engine(model_dir, num_blocks=8).processor.process_prompt(request(text, [image]))
    offset, num_tokens = processed.images[0].offset, len(processed.prompt_token_ids)
    with make_engine(model_dir, kv_cache_dir=tmp_path, kv_cache_save_hot_blocks=0) as engine:
        engine.pin_prefix(request(text, [image]))
        while engine.has_unfinished_requests():
            engine.step()
    cases = ((image, (num_tokens - 1) // BLOCK * BLOCK, 0), (other, offset // BLOCK * BLOCK, 1))
    for given, num_cached, num_encoded in cases:
        with make_engine(model_dir, kv_cache_dir=tmp_path) as fresh:  # on close it saves what it used (hot blocks)
            out = fresh.generate(request(text, [given]), GREEDY, use_tqdm=False)[0]
            assert out.num_cached_tokens == num_cached
            assert out.outputs[0].token_ids == generate(text, [given])
            assert fresh.stats()["mm_encoder_runs"] == num_encoded  # 0: every image row came from the restored blocks
    assert (num_tokens - 1) // BLOCK * BLOCK > offset + processed.images[0].length and offset // BLOCK > 0
