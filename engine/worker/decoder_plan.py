"""DecoderPlan: a Llama-family model's decoder layers as one C call a step (``cpu_kernels/decoder.c``).

The model's modules stay the definition of the forward pass; the plan is read from them once, after the
weights are packed and the KV cache bound: each layer's norms, projections and cache, as the pointers and
kinds the kernels take. A step then runs every layer in C, the same kernels with the same arguments as
the modules would call, so the hidden states and the cache are the same bits; the Python between the
kernels (a module call, the argument checks and a ctypes call per operator, about 100 us a layer) is
gone. ``EngineConfig.enforce_eager`` keeps the module path, as vLLM's flag of that name keeps eager mode.

A mixture-of-experts layer (Mixtral, Qwen3-MoE) runs in C too: its router (float32 panels packed from the
module's weight) picks each token's top-k experts, and every chosen expert runs its projections once on
all of its tokens' rows; the router's matmul is the packed kernel's, not ``F.linear``'s, so its logits, and
the step's, may differ from the modules' by float32 rounding.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine import cpu_kernels
from engine.cpu_kernels import abi
from engine.attention import AttentionBackend, AttentionMetadata, CpuAttentionBackend
from engine.layers.batched_weight import BatchedWeight, PackedWeight
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.activation import SiluAndMul
from engine.layers.linear import Linear
from engine.layers.moe import SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.models.llama import LlamaForCausalLM, LlamaMLP

# decoder.c's linear kinds
_LINEAR_F32, _LINEAR_BF16, _LINEAR_Q8, _LINEAR_W8A8, _LINEAR_GGML = range(5)
# decoder.c's FAILED_ values
_FAILED_LINEAR, _FAILED_ROTARY, _FAILED_STORE_KV, _FAILED_ATTENTION = range(1, 5)
_Linear, _Layer, _Plan, _Step = abi.LinearPlan, abi.LayerPlan, abi.DecoderPlan, abi.DecoderStep


def _linear(module: Linear, batched: bool) -> _Linear | None:
    """The kernels' view of a packed or quantized ``Linear`` (of a ``BatchedWeight``, its dense layout where
    ``batched``, else its blocks); None for one that is neither."""
    bias = module.bias.data_ptr() if module.bias is not None else None
    q = module.quantized
    if isinstance(q, BatchedWeight):
        q = q.dense if batched else q.blocks
    if isinstance(q, PackedWeight):
        kind = _LINEAR_F32 if q.packed.dtype == torch.float32 else _LINEAR_BF16
        return _Linear(q.packed.data_ptr(), None, bias, q.out_features, q.in_features, kind, 0)
    if isinstance(q, GGMLWeight):
        return _Linear(
            ctypes.addressof(q.c_parts), None, bias, q.out_features, q.in_features, _LINEAR_GGML, 0, len(q.c_parts)
        )
    if q is not None:
        kind = _LINEAR_W8A8 if q.int8_products else _LINEAR_Q8
        return _Linear(
            q.codes.data_ptr(), q.scales.data_ptr(), bias, q.out_features, q.in_features, kind, int(q.bf16_products)
        )
    if module.packed is None or not module.packed.is_contiguous():
        return None
    kind = _LINEAR_F32 if module.packed.dtype == torch.float32 else _LINEAR_BF16
    return _Linear(module.packed.data_ptr(), None, bias, module.out_features, module.in_features, kind, 0)


def _experts(block: SparseMoeBlock, batched: bool) -> ctypes.Array | None:
    """Each expert's gate_up and down plans in turn (decoder.c's ``experts``); None if one is not packed."""
    plans = [_linear(m, batched) for expert in block.experts for m in (expert.gate_up_proj, expert.down_proj)]
    if any(w is None for w in plans):
        return None
    return (_Linear * len(plans))(*plans)


def _layer_plans(body: nn.Module, batched: bool) -> tuple[ctypes.Array, list[object]] | None:
    """decoder.c's layers of a model's body, each weight in the layout of ``_linear(module, batched)``, and what
    they point at beyond the modules (the routers' panels, the experts' plans); None where one cannot run."""
    layers = (_Layer * len(body.layers))()
    keep: list[object] = []  # what the layers point at: the routers' panels, the experts' plans
    for entry, layer in zip(layers, body.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_linear(m, batched) for m in (attn.qkv_proj, attn.o_proj)]
        if isinstance(mlp, SparseMoeBlock):
            experts = _experts(mlp, batched)
            if experts is None or mlp.gate.weight.dtype != torch.float32:
                return None
            router = cpu_kernels.pack_linear_weight(mlp.gate.weight.data)
            entry.router, entry.experts = router.data_ptr(), ctypes.addressof(experts)
            keep += [router, experts]
            linears += [_Linear(), _Linear()]
        else:
            linears += [_linear(mlp.gate_up_proj, batched), _linear(mlp.down_proj, batched)]
        if any(w is None for w in linears):
            return None
        kv = attn.attn.kv_cache
        entry.input_norm = layer.input_layernorm.weight.data_ptr()
        entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        if attn.q_norm is not None:
            entry.q_norm, entry.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
        entry.k_cache, entry.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
        entry.qkv, entry.o, entry.gate_up, entry.down = linears
    return layers, keep


class DecoderPlan:
    """A loaded Llama-family model's decoder layers, ready to run a step in one C call.

    ``build`` returns None where the plan cannot run the model (not the CPU kernels' path: another
    device or attention backend, a weight left unpacked; an MLP that is not SiLU's, dense MLPs or mixtures of
    experts of different shapes; layers with different sliding windows, whose attention tiles differ, or
    scales, or soft-capped scores; Gemma's norms (``1 + weight``, one after each block too) or rope per layer
    type); the modules then run it.
    """

    def __init__(self, model: LlamaForCausalLM, plan: _Plan, keep: list[object], backend: CpuAttentionBackend,
                 k_cache: torch.Tensor, window: int | None, batched: tuple[int, _Plan] | None = None) -> None:
        self._model = model
        self._window = window  # every layer's: the step's tiles are the same for all of them
        # the layers arrays, the routers' panels and the experts' plans live as long as the plans point at them
        self._plan, self._keep = plan, keep
        # (min rows, the plan over the weights' dense layouts) where the model holds BatchedWeights
        self._batched = batched
        self._backend = backend
        self._k_cache = k_cache  # the first layer's: its shape and dtype size the attention tiles
        self._lib = cpu_kernels.library()

    @classmethod
    def build(cls, model: nn.Module, backend: AttentionBackend, dtype: torch.dtype) -> DecoderPlan | None:
        """The plan of ``model`` (its caches bound, weights packed), or None where it cannot run it."""
        if not isinstance(model, LlamaForCausalLM) or not isinstance(backend, CpuAttentionBackend):
            return None
        if dtype != torch.float32 or cpu_kernels.library() is None:
            return None
        body = model.model
        dense = [layer.mlp for layer in body.layers if not isinstance(layer.mlp, SparseMoeBlock)]
        sparse = [layer.mlp for layer in body.layers if isinstance(layer.mlp, SparseMoeBlock)]
        if not all(isinstance(mlp, LlamaMLP) and type(mlp.act) is SiluAndMul for mlp in dense):
            return None  # decoder.c runs SiLU MLPs only (gelu runs on the modules)
        if len({mlp.down_proj.in_features for mlp in dense}) > 1 or len(
            {(len(m.experts), m.gate.top_k, m.gate.renormalize, m.experts[0].down_proj.in_features) for m in sparse}
        ) > 1:
            return None  # one dense MLP shape and one mixture shape for every layer in decoder.c
        first = body.layers[0].self_attn
        attns = [layer.self_attn.attn for layer in body.layers]
        if len({(a.sliding_window, a.scale) for a in attns}) != 1 or any(a.logit_softcap is not None for a in attns):
            return None
        if any(layer.sandwich_norms or layer.self_attn.rotary is not body.rotary for layer in body.layers):
            return None  # Gemma's norms of each block's output; rope per layer type
        norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if first.q_norm is not None:
            norms += [n for layer in body.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
        if any(type(n) is not RMSNorm for n in norms):
            return None  # decoder.c scales by the weight itself (Gemma's norms by 1 + weight)
        tensors = [n.weight for n in norms] + [body.rotary.cos_sin_cache]
        if len({n.eps for n in norms}) != 1 or first.attn.kv_cache is None:
            return None  # one eps for every norm in decoder.c; the cache bound by the runner
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            return None
        built = _layer_plans(body, batched=False)
        if built is None:
            return None
        layers, keep = built
        k_cache = first.attn.kv_cache[0]  # [num_blocks, block_size, Hkv, D]
        rotary = body.rotary
        moe = sparse[0] if sparse else None
        plan = _Plan(
            ctypes.addressof(layers), body.norm.weight.data_ptr(), rotary.cos_sin_cache.data_ptr(),
            len(body.layers), body.norm.weight.shape[0], first.num_heads, first.num_kv_heads, first.head_dim,
            max((mlp.down_proj.in_features for mlp in dense), default=0), rotary.cos_sin_cache.shape[1],
            rotary.cos_sin_cache.shape[0], k_cache.shape[1], k_cache.shape[0], first.attn.sliding_window or 0,
            norms[0].eps, first.attn.scale, int(k_cache.dtype == torch.bfloat16),
            int(moe is not None and moe.gate.renormalize), len(moe.experts) if moe else 0, moe.gate.top_k if moe else 0,
            moe.experts[0].down_proj.in_features if moe else 0,
        )
        keep.append(layers)
        batched = None
        min_rows = {m.quantized.min_rows for m in model.modules() if isinstance(getattr(m, "quantized", None), BatchedWeight)}
        if min_rows:
            dense_layers, dense_keep = _layer_plans(body, batched=True)  # the same modules: it builds if the blocks' did
            batched = (min(min_rows), _Plan.from_buffer_copy(plan))
            batched[1].layers = ctypes.addressof(dense_layers)
            keep += [dense_layers, *dense_keep]
        return cls(model, plan, keep, backend, k_cache, first.attn.sliding_window, batched)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output ``[T, hidden]`` of the step's tokens, their keys and values written to the cache.

        Raises:
            IndexError: a position outside the rotary table, a slot or a block outside the cache.
            MemoryError: a kernel could not allocate its scratch.
        """
        tokens = input_ids.shape[0]
        plan = self._batched[1] if self._batched is not None and tokens >= self._batched[0] else self._plan
        x = self._model.model.embed(input_ids).contiguous()  # float32: build checked the norms' dtype
        rows = self._backend.row_plan(meta, self._k_cache, self._window)
        positions = positions.contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tiles = rows.tiles
        step = _Step(
            positions.data_ptr(), slots.data_ptr(), rows.block_tables.data_ptr(), rows.seq_lens.data_ptr(),
            tiles.rows.data_ptr(), tiles.starts.data_ptr(), tiles.shared.data_ptr(),
            tokens, rows.block_tables.shape[1], len(tiles.shared),
        )  # fmt: skip
        out = torch.empty(tokens, plan.hidden)
        scratch = torch.empty(self._lib.decoder_scratch(ctypes.byref(plan), tokens))
        failed = ctypes.c_int32(0)
        status = self._lib.decoder_forward(
            ctypes.byref(plan), ctypes.byref(step), x.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            ctypes.byref(failed),
        )
        if status:
            raise self._error(failed.value, status, rows.block_tables.shape[1], tokens)
        return out

    def _error(self, failed: int, status: int, table_width: int, tokens: int) -> Exception:
        plan = self._plan
        if failed == _FAILED_ROTARY:
            return cpu_kernels.position_error(plan.max_positions)
        if failed == _FAILED_STORE_KV:
            return cpu_kernels.slot_error(plan.num_blocks * plan.block_size)
        if failed == _FAILED_ATTENTION:
            group = plan.num_heads // plan.num_kv_heads
            return cpu_kernels.attention_error(status, tokens, group, plan.num_blocks, table_width)
        assert failed == _FAILED_LINEAR, failed
        return MemoryError("a linear kernel could not allocate its scratch")
