"""Mixture-of-experts GGUF files (llama.cpp's layout: each projection's experts stacked in one 3-D ``ffn_*_exps``
tensor, an F32 ``ffn_gate_inp`` router; Mixtral as architecture llama with ``llama.expert_count``, Qwen3-MoE as
``qwen3moe``) run in the engine: each expert is its own row range of the file in the file's type, only the routed
experts run, and the logits are the source model's (F32) or its dequantized weights' (Q8_0)."""

from __future__ import annotations

import copy

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine import Engine, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.moe import SparseMoeBlock, TopKRouter
from engine.loader import resolve_model
from engine.model_files.gguf import GGUFFile
from engine.model_files.gguf_writer import write_gguf
from engine.worker.model_runner import ModelRunner
from tests.support.gguf_runs import last_logits, load_gguf_weights
from tests.support.hf_reference import hf_greedy, hf_logits

# Qwen3-MoE as llama.cpp runs a qwen3moe file: every layer sparse, the top-k weights renormalized
OVERRIDES = {"mixtral": {}, "qwen3_moe": dict(mlp_only_layers=None, norm_topk_prob=True)}
EXPERTS = {"mixtral": 4, "qwen3_moe": 4}
PROMPT = [5, 9, 77, 120, 3, 200, 31, 64, 500, 17, 2, 900, 13, 14, 15]
native = pytest.mark.skipif(cpu_kernels.library() is None, reason="GGUF types run natively on the CPU kernels")


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def moe(request, tiny_model_factory, small_tokenizer_dir: Path):
    from transformers import AutoModelForCausalLM

    source = tiny_model_factory(request.param, tokenizer_dir=small_tokenizer_dir, **OVERRIDES[request.param])
    return request.param, source, AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def _runner(path: Path, **config) -> ModelRunner:
    return ModelRunner(EngineConfig(dtype="float32", num_blocks=64, block_size=4, **config), resolve_model(path))


def test_file_stacks_each_projection_s_experts_as_llama_cpp_does(moe, tmp_path: Path) -> None:
    """One [experts, rows, K] tensor per projection (expert e's rows the source's expert e), the router F32 in a
    quantized file too, and the expert counts in the metadata."""
    arch, source, hf = moe
    path = write_gguf(source, tmp_path / "moe-Q8_0.gguf", "Q8_0")
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    prefix = "llama" if arch == "mixtral" else "qwen3moe"
    assert reader.fields["general.architecture"].contents() == prefix
    assert reader.fields[f"{prefix}.expert_count"].contents() == EXPERTS[arch]
    assert reader.fields[f"{prefix}.expert_used_count"].contents() == 2
    if arch == "qwen3_moe":
        assert reader.fields["qwen3moe.expert_feed_forward_length"].contents() == hf.config.moe_intermediate_size
    gate, down = tensors["blk.1.ffn_gate_exps.weight"], tensors["blk.1.ffn_down_exps.weight"]
    width = hf.config.intermediate_size if arch == "mixtral" else hf.config.moe_intermediate_size
    assert [int(d) for d in gate.shape] == [hf.config.hidden_size, width, EXPERTS[arch]]  # ggml's order
    assert [int(d) for d in down.shape] == [width, hf.config.hidden_size, EXPERTS[arch]]
    assert gate.tensor_type.name == "Q8_0" and tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    f32 = GGUFReader(write_gguf(source, tmp_path / "moe-F32.gguf", "F32"))
    stored = {t.name: t for t in f32.tensors}["blk.1.ffn_up_exps.weight"].data  # [experts, rows, K]
    prefix = "model.layers.1.block_sparse_moe.experts" if arch == "mixtral" else "model.layers.1.mlp.experts"
    from safetensors.numpy import load_file

    weights = load_file(source / "model.safetensors")
    for e in range(EXPERTS[arch]):
        up = weights[f"{prefix}.{e}.w3.weight" if arch == "mixtral" else f"{prefix}.{e}.up_proj.weight"]
        assert np.array_equal(stored[e], up)


def test_f32_file_runs_to_the_source_logits_and_greedy_tokens(moe, private_cache: Path, tmp_path: Path) -> None:
    arch, source, hf = moe
    path = write_gguf(source, tmp_path / "moe-F32.gguf", "F32")
    runner = _runner(path)
    assert runner.hf_config.model_type == arch
    keys = ["num_local_experts"] if arch == "mixtral" else ["num_experts", "moe_intermediate_size", "norm_topk_prob",
                                                            "mlp_only_layers", "decoder_sparse_step", "head_dim"]
    for key in ("num_experts_per_tok", *keys):
        assert getattr(runner.hf_config, key) == getattr(hf.config, key), key
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers)
    torch.testing.assert_close(last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1], atol=1e-4, rtol=0)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = Engine(str(path), num_blocks=128, block_size=4)
    assert engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 10)


@native
def test_q8_0_experts_are_their_row_ranges_of_the_file_and_run_only_when_routed(
    moe, private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each expert's projections hold the file's Q8_0 blocks of its rows (not dequantized, in the kernels' layout); a
    decode step runs
    exactly the experts its token is routed to; the logits are those of the source's weights rounded to Q8_0."""
    arch, source, hf = moe
    path = write_gguf(source, tmp_path / "moe-Q8_0.gguf", "Q8_0")
    runner = _runner(path, enforce_eager=True)
    gguf = GGUFFile(path)
    experts: dict[int, tuple[int, int]] = {}  # id of a projection's weight -> (layer, expert)
    for index, layer in enumerate(runner.model.model.layers):
        for e, expert in enumerate(layer.mlp.experts):
            down = expert.down_proj.quantized
            assert isinstance(down, GGMLWeight) and down.kind == "Q8_0"
            info = gguf.tensors[f"blk.{index}.ffn_down_exps.weight"]
            rows = info.shape[1]
            expected = gguf.read(info.name, rows=range(e * rows, (e + 1) * rows))
            laid_out = GGMLWeight.from_numpy([("Q8_0", expected)], down.in_features)  # as the kernels lay blocks out
            assert torch.equal(down.parts[0].data, laid_out.parts[0].data)
            assert expert.gate_up_proj.quantized.kind == "Q8_0"
            experts[id(down)] = experts[id(expert.gate_up_proj.quantized)] = (index, e)
    assert not runner.weights.dequantized

    ran: set[tuple[int, int]] = set()
    matmul = GGMLWeight.matmul

    def counted(self, x, bias):
        if id(self) in experts:
            ran.add(experts[id(self)])
        return matmul(self, x, bias)

    routed: set[tuple[int, int]] = set()
    for index, layer in enumerate(runner.model.model.layers):
        def record(module: TopKRouter, inputs, out, index=index) -> None:
            routed.update((index, int(e)) for e in out.experts.flatten())

        layer.mlp.gate.register_forward_hook(record)
    monkeypatch.setattr(GGMLWeight, "matmul", counted)
    from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

    runner.execute_model(SchedulerOutput(scheduled=[ScheduledRequest("r", PROMPT[:4], 0, ([0],), True)]))
    ran.clear(), routed.clear()
    runner.execute_model(SchedulerOutput(scheduled=[ScheduledRequest("r", [PROMPT[4]], 4, ([0, 1],), False)]))
    assert ran == routed and len(ran) == 2 * len(runner.model.model.layers)  # top-2 of 4 in each layer
    monkeypatch.setattr(GGMLWeight, "matmul", matmul)

    hf = copy.deepcopy(hf)  # the module's source model stays as it is
    load_gguf_weights(hf, path)
    got, want = last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1]
    err = float((got - want).abs().max() / want.abs().max())
    # measured 0.0065 (mixtral), 0.0076 (qwen3_moe): the inputs' int8 blocks; from the unrounded source's 0.012, 0.014
    # measured 0.016 (mixtral), 0.030 (qwen3_moe): the inputs' int8 blocks of 256; from the source's 0.17, 0.16
    assert err <= 0.045


# rows of 256 for the K-quants
WIDE = {"mixtral": dict(hidden_size=256, intermediate_size=256),
        "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, head_dim=64)}  # fmt: skip


@native
@pytest.mark.parametrize("arch", sorted(WIDE))
def test_q4_k_m_experts_run_in_their_k_quant_blocks(arch: str, tiny_model_factory, small_tokenizer_dir: Path,
                                                    private_cache: Path, tmp_path: Path) -> None:  # fmt: skip
    """Q4_K_M: experts in Q4_K, the down projections of llama.cpp's "more bits" layers in Q6_K, all served in their
    blocks; the logits are those of the file's dequantized weights."""
    from transformers import AutoModelForCausalLM

    source = tiny_model_factory(arch, tokenizer_dir=small_tokenizer_dir, **OVERRIDES[arch], **WIDE[arch])
    path = write_gguf(source, tmp_path / "moe-Q4_K_M.gguf", "Q4_K_M")
    types = {name: info.type_name for name, info in GGUFFile(path).tensors.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    runner = _runner(path)
    down = runner.model.model.layers[1].mlp.experts[3].down_proj.quantized
    assert isinstance(down, GGMLWeight) and down.kind == "Q6_K" and not runner.weights.dequantized
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    load_gguf_weights(hf, path)
    got, want = last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1]
    err = float((got - want).abs().max() / want.abs().max())
    # measured 0.016 (mixtral), 0.030 (qwen3_moe): the inputs' int8 blocks of 256; from the source's 0.17, 0.16
    assert err <= 0.045


def _split_experts(stacked: Path, out: Path) -> Path:
    """``stacked`` rewritten as llama.cpp wrote Mixtral files before April 2024: each expert a 2-D tensor of its
    own (``blk.L.ffn_gate.E.weight``), the rest as it is."""
    reader = GGUFReader(stacked)
    writer = GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        raw = {} if tensor.tensor_type.name == "F32" else {"raw_dtype": tensor.tensor_type}
        if tensor.name.endswith("_exps.weight"):
            for e, rows in enumerate(tensor.data):
                name = tensor.name.replace("_exps.weight", f".{e}.weight")
                writer.add_tensor(name, np.ascontiguousarray(rows), **raw)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(tensor.data), **raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@native
def test_a_file_of_one_tensor_per_expert_runs_as_the_stacked_one(moe, private_cache: Path, tmp_path: Path) -> None:
    """llama.cpp's earlier Mixtral files (``blk.L.ffn_gate.E.weight``, ...) load each expert from its own tensor, in
    its type, to the stacked file's logits exactly."""
    _, source, _ = moe
    stacked = write_gguf(source, tmp_path / "moe-Q8_0.gguf", "Q8_0")
    single = _split_experts(stacked, tmp_path / "moe-single-Q8_0.gguf")
    tensors = GGUFFile(single).tensors
    assert "blk.0.ffn_up.3.weight" in tensors and "blk.0.ffn_up_exps.weight" not in tensors
    runner = _runner(single)
    assert runner.model.model.layers[0].mlp.experts[3].gate_up_proj.quantized.kind == "Q8_0"
    assert torch.equal(last_logits(runner, PROMPT), last_logits(_runner(stacked), PROMPT))


def _set_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrites tensor ``name``'s ggml type id in the file's header (a type of the same bytes per value)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
    dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * dims
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


@native
def test_experts_of_a_type_not_served_natively_are_dequantized_and_named_once(
    moe, private_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """IQ4_NL gate experts (as many bytes as Q4_0's blocks, so a Q4_0 file relabelled) load dequantized with the up
    experts they are fused with, each 3-D tensor named once in the summary and the warning; the other layer's
    experts stay Q4_0; the logits are those of the file's dequantized weights."""
    _, source, hf = moe
    path = write_gguf(source, tmp_path / "moe-Q4_0.gguf", "Q4_0")
    _set_tensor_type(path, "blk.0.ffn_gate_exps.weight", 20)  # IQ4_NL
    runner = _runner(path)
    assert runner.weights.dequantized == ["blk.0.ffn_gate_exps.weight (IQ4_NL)", "blk.0.ffn_up_exps.weight (Q4_0)"]
    assert "2 GGUF tensors dequantized" in caplog.text
    assert runner.model.model.layers[1].mlp.experts[0].gate_up_proj.quantized.kind == "Q4_0"
    hf = copy.deepcopy(hf)
    load_gguf_weights(hf, path)
    got, want = last_logits(runner, PROMPT), hf_logits(hf, PROMPT)[-1]
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 0.015  # measured 0.010 (mixtral), 0.0086 (qwen3_moe): the Q4_0 experts' int8 blocks of x


def test_experts_of_a_type_that_holds_no_weights_are_refused_by_name(
    moe, private_cache: Path, tmp_path: Path
) -> None:
    _, source, _ = moe
    path = write_gguf(source, tmp_path / "moe-F32.gguf", "F32")
    _set_tensor_type(path, "blk.0.ffn_up_exps.weight", 26)  # I32: as many bytes as F32
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_up_exps.weight' is I32, which holds no weights"):
        _runner(path)


def test_qwen3_moe_that_llama_cpp_would_run_otherwise_is_not_written(tiny_model_factory, small_tokenizer_dir: Path,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\].* every qwen3moe layer"):
        write_gguf(tiny_model_factory("qwen3_moe", tokenizer_dir=small_tokenizer_dir), tmp_path / "a.gguf", "F32")
    dense_free = tiny_model_factory("qwen3_moe", tokenizer_dir=small_tokenizer_dir, mlp_only_layers=None)
    with pytest.raises(ValueError, match="norm_topk_prob=False cannot be written"):
        write_gguf(dense_free, tmp_path / "b.gguf", "F32")
