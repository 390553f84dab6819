"""ModelRunner: owns the device side of the engine (weights, KV cache) and runs one step."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from engine import cpu_kernels
from engine.attention import CpuAttentionBackend, get_attention_backend
from engine.attention.forward_context import ForwardContext, set_forward_context
from engine.config import (
    DEFAULT_CPU_KV_CACHE_FRACTION,
    DEFAULT_CPU_KV_CACHE_MIN,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineConfig,
    step_token_budget,
)
from engine.core.kv_cache_groups import blocks_per_request
from engine.core.kv_layout import KVLayout, KVShard, model_fingerprint
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.errors import ModelLoadError, ParameterError
from engine.layers.attention import Attention
from engine.layers.ggml_weight import GGMLWeight
from engine.layers.linear import Linear
from engine.layers.rotary import RotaryEmbedding
from engine.loader import gguf_source
from engine.model_files.checkpoint import Checkpoint, GGUFCheckpoint, SafetensorsCheckpoint
from engine.model_files.gguf import GGUFError, GGUFFile
from engine.models.llama import MissingLayer
from engine.models.registry import get_model_class
from engine.models.vision import SupportsImages
from engine.multimodal.encoder_cache import EncoderCache
from engine.parallel_state import SINGLE, WHOLE, PipelineStage, TensorParallel, pipeline_stage, tensor_parallel
from engine.worker.batched_layout import add_batched_layout
from engine.worker.decoder_plan import DecoderPlan
from engine.worker.image_rows import ENCODER_CACHE_BYTES, image_rows
from engine.worker.input_batch import ModelInputs, prepare_inputs
from engine.worker.weight_formats import LoadPlan, WeightsSummary, load_weights

logger = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23  # linux/mman.h

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_GGML_TYPES = ("F32", "F16", "BF16")  # a GGUF file's tensors that are not quantized blocks


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtypes(
    name: str, device: torch.device, checkpoint_dtype: torch.dtype | None = None, quantized_gguf: bool = False
) -> tuple[torch.dtype, torch.dtype]:
    """The (compute, weight) dtypes of a ``dtype`` setting on ``device``.

    "auto" is bfloat16 on CUDA; on CPU it is the checkpoint's dtype where that is bfloat16 (``checkpoint_dtype``,
    a Hugging Face config's), else float32: a bfloat16 checkpoint keeps its size, a float32 or float16 one, and
    a GGUF file of float tensors, compute in float32. A GGUF file of quantized blocks (``quantized_gguf``) keeps
    its blocks whatever the setting; "auto" gives its other tensors and its KV cache bfloat16 where the CPU
    multiplies bfloat16 natively (``native_bf16``), else float32.

    On CPU with the C kernels built, "bfloat16" keeps the linear and embedding weights (and, with
    the CPU attention backend, the KV cache) in bfloat16 and the element-wise parts in float32: the
    memory and the bytes read are halved. The linear kernels take the CPU's fastest path
    (``cpu_kernels.bf16_linear_path``): AMX tiles or AVX512-BF16 dot products of x rounded to
    bfloat16 where the CPU has them, else every product the float32 one of the stored bfloat16
    values, widened as they load (docs/performance.md).
    """
    if name == "auto":
        bf16 = device.type == "cuda" or checkpoint_dtype == torch.bfloat16 or (quantized_gguf and native_bf16())
        dtype = torch.bfloat16 if bf16 else torch.float32
    else:
        dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.library() is not None:
        return torch.float32, torch.bfloat16
    return dtype, dtype


def model_dtypes(name: str, device: torch.device, model_dir: Path, hf_config) -> tuple[torch.dtype, torch.dtype]:
    """``resolve_dtypes`` for the model of ``model_dir``: its checkpoint's dtype, or whether a GGUF file holds
    quantized blocks."""
    gguf = gguf_source(model_dir)
    if gguf is None:
        return resolve_dtypes(name, device, checkpoint_dtype(hf_config))
    quantized = any(tensor.type_name not in FLOAT_GGML_TYPES for tensor in GGUFFile(gguf).tensors.values())
    return resolve_dtypes(name, device, quantized_gguf=quantized)


def native_bf16() -> bool:
    """Whether this CPU's C kernels multiply bfloat16 natively (AVX512-BF16 or AMX), not widened to float32."""
    return cpu_kernels.library() is not None and cpu_kernels.bf16_linear_path(1) != "widened"


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The dtype a Hugging Face config says its weights are stored in, or None."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = _DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


class ModelRunner:
    """Loads a Llama-family model and its paged KV cache on one device and executes steps.

    Args:
        config: the engine settings (dtype, device, block size, KV cache budget, backend).
        model_dir: a Hugging Face model directory (``engine.loader.resolve_model`` output).
        tp: the tensor-parallel rank this runner holds the shard of (``engine.distributed``); its KV cache
            holds that rank's KV heads.
        pp: the pipeline stage whose decoder layers (weights and KV cache) this runner holds.

    Raises:
        ModelLoadError: the directory's architecture or weights cannot be loaded.
        ValueError: the settings cannot be met (no CUDA, a cache too small for one block,
            a ``max_model_len`` beyond the model's positions); a ``ParameterError`` naming
            ``quantization`` where it cannot run.
    """

    def __init__(
        self, config: EngineConfig, model_dir: Path, tp: TensorParallel = SINGLE, pp: PipelineStage = WHOLE
    ) -> None:
        from transformers import AutoConfig

        self.config = config
        self.model_dir = Path(model_dir)
        self.tp, self.pp = tp, pp
        self.hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.text_config = self.hf_config.get_text_config()  # a multimodal model's language model's config
        self.device = resolve_device(config.device)
        self.gguf = gguf_source(model_dir)
        self.dtype, self.weight_dtype = model_dtypes(config.dtype, self.device, model_dir, self.hf_config)
        self.block_size = config.block_size
        self.vocab_size: int = self.text_config.vocab_size
        self.model = self._load_model(Path(model_dir))
        # a multimodal model's image embeddings by image hash (engine.multimodal); None for a text-only model
        self.encoder_cache = EncoderCache(ENCODER_CACHE_BYTES) if isinstance(self.model, SupportsImages) else None
        self.max_model_len = self._max_model_len()
        layer = self._attention_layers()[0]
        self.attn_backend = get_attention_backend(
            config.attention_backend, self.device, self.dtype, num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, block_size=self.block_size,
        )
        # bfloat16 weights computed in float32 keep a bfloat16 KV cache too where the C kernel reads it
        cpu_backend = isinstance(self.attn_backend, CpuAttentionBackend)
        self.kv_cache_dtype = self.weight_dtype if cpu_backend else self.dtype
        if config.kv_cache_dtype == "int8":
            if not cpu_backend:
                raise ParameterError(
                    "kv_cache_dtype",
                    "kv_cache_dtype='int8' runs on the CPU attention kernels; this engine's attention backend is "
                    f"{self.attn_backend.name}",
                )
            self.kv_cache_dtype = torch.int8
        self.attention: str = self.attn_backend.describe(self.kv_cache_dtype, layer.head_dim)  # what runs it
        # NOTE: every decoder layer's window, a pipeline stage's missing ones too: the groups (and the block tables
        # the scheduler keeps) are the model's on every stage; a stage's cache holds its own layers' K/V only
        self._kv_cache_groups = kv_cache_groups(self._layer_windows())
        # each KV cache group's sliding window (None: full attention), as KVCacheManager takes them
        self.kv_cache_windows = tuple(group[0].sliding_window for group in self._kv_cache_groups)
        # NOTE: every rank of a group allocates the same number of blocks: the scheduler addresses them all.
        group = pp.links or tp.comm  # every rank of every stage
        self.num_blocks = self._num_blocks() if group is None else group.all_reduce_min(self._num_blocks())
        self.kv_cache = self._allocate_kv_cache()
        # an int8 cache's scales of K and V per block and KV head: [layers of the largest group, 2, num_blocks, Hkv]
        self.kv_scales: torch.Tensor | None = None
        if self.kv_cache_dtype == torch.int8:
            self.kv_scales = torch.zeros(*self.kv_cache.shape[:3], self.kv_cache.shape[4])
        self._bind_kv_cache()
        # the decoder layers in one C call a step where the CPU kernels run them all (else None: the modules do,
        # also on a tensor-parallel rank, whose collectives sit between the kernels)
        self.decoder_plan = None
        # decoder.c: one process, no int8 cache
        if not config.enforce_eager and tp.comm is None and pp.size == 1 and self.kv_scales is None:
            self.decoder_plan = DecoderPlan.build(self.model, self.attn_backend, self.dtype)
        logger.info(
            "model %s on %s (%s, weights and KV cache in %s and %s; linear weights: %s; attention: %s; layers: %s): "
            "%d KV blocks of %d tokens",
            self.hf_config.model_type, self.device, self.dtype, self.weight_dtype, self.kv_cache_dtype,
            self.weights, self.attention, self.layers, self.num_blocks, self.block_size,
        )

    @property
    def layers(self) -> str:
        """What runs the decoder layers: "one C call a step" (``decoder_plan``) or "modules"."""
        return "modules" if self.decoder_plan is None else "one C call a step"

    @torch.inference_mode()
    def close(self) -> None:
        """Releases what the runner holds beyond its tensors (nothing here; rank processes under TP)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; returns float32 logits [num_logits, vocab] for the ``needs_logits`` requests, in batch order
        (None on a rank other than the driver: a tensor-parallel rank other than the first, a later pipeline stage).

        A pipeline stage runs its layers on the previous stage's hidden states and sends its own to the next; the
        last stage sends the logits to the driver."""
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if not self.pp.is_last:
            return self._pipeline_logits(self.run_stage(scheduler_output))
        inputs = prepare_inputs(scheduled, self.block_size, self.device)
        hidden = self._forward(scheduled, inputs)
        # NOTE: the LM head runs only on the rows whose next token is sampled.
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        if logits is None:
            return None
        if self.pp.size > 1:  # the last stage's first tensor-parallel rank: the driver samples
            if len(logits):
                self.pp.links.send_logits(logits.float())
            return None
        return logits.float()

    def run_stage(self, scheduler_output: SchedulerOutput) -> int:
        """On a pipeline stage before the last: runs this stage's layers on a step (of scheduled requests) and sends
        its hidden states to the next stage; returns the rows of logits the step brings back to the driver."""
        scheduled = scheduler_output.scheduled
        inputs = prepare_inputs(scheduled, self.block_size, self.device)
        self.pp.links.send_hidden(self._forward(scheduled, inputs))
        return len(inputs.logits_indices)

    def _forward(self, scheduled: list[ScheduledRequest], inputs: ModelInputs) -> torch.Tensor:
        """This rank's layers on the step's tokens: ``[T, hidden]`` (a stage before the last: ``[2, T, hidden]``,
        hidden states and residual)."""
        images = None if self.encoder_cache is None else image_rows(scheduled, self.model, self.encoder_cache, self.device)
        if self.decoder_plan is not None:
            return self.decoder_plan.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata[0])
        with set_forward_context(ForwardContext(inputs.attn_metadata)):
            # NOTE: a multimodal model's image rows take the image embeddings (the modules path only)
            extra = {} if images is None else {"image_embeds": images[0], "image_rows": images[1]}
            if not self.pp.is_first:
                shape = (2, len(inputs.input_ids), self.text_config.hidden_size)
                extra["intermediate"] = self.pp.links.recv_hidden(shape, self.dtype)
            return self.model(inputs.input_ids, inputs.positions, **extra)

    def _pipeline_logits(self, rows: int) -> torch.Tensor | None:
        """On the driver (the first stage's first rank), the last stage's logits; None on the other ranks."""
        if not (self.pp.is_first and self.tp.is_first):
            return None
        if rows == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.pp.links.recv_logits((rows, self.vocab_size))

    # ------------------------------------------------------------------------------------ persistence

    def kv_layout(self) -> KVLayout:
        """What this runner's KV blocks depend on besides their tokens (``engine.core.kv_persistence``)."""
        weights = [self.gguf] if self.gguf is not None else sorted(self.model_dir.glob("*.safetensors"))
        num_layers, _, _, block_size, num_kv_heads, head_dim = self.kv_cache.shape
        return KVLayout(
            model=model_fingerprint(self.model_dir / "config.json", weights),
            kv_dtype=str(self.kv_cache_dtype), compute_dtype=str(self.dtype), weight_dtype=str(self.weight_dtype),
            quantization=self.config.quantization, attention_backend=type(self.attn_backend).__name__,
            block_size=block_size, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype_bytes=self.kv_cache_dtype.itemsize, byteorder=sys.byteorder,
        )  # fmt: skip

    def stage_wait_seconds(self) -> float:
        """Time this rank spent waiting on the other pipeline stages so far (0 without a pipeline)."""
        return 0.0 if self.pp.links is None else self.pp.links.wait_seconds

    def kv_shard(self) -> KVShard:
        """This rank's part of every block: its tensor-parallel rank, stage, and the layers and KV heads it holds."""
        num_layers, _, _, _, num_kv_heads, _ = self.kv_cache.shape
        return KVShard(self.tp.rank, self.pp.rank, num_layers, num_kv_heads)

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's K and V of every layer as bytes, laid out [layer, k|v, slot, kv_head, dim]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        blocks = self.kv_cache.index_select(2, index).movedim(2, 0).contiguous().cpu()  # [N, L, 2, BS, Hkv, D]
        flat = blocks.view(torch.uint8).view(len(block_ids), -1).numpy()
        return [row.tobytes() for row in flat]

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], payloads: list[bytes | memoryview]) -> None:
        """Writes ``read_kv_blocks``' bytes back into blocks ``block_ids``."""
        if not block_ids:
            return
        shape = (len(block_ids), *self.kv_cache.shape[:2], *self.kv_cache.shape[3:])
        raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        blocks = raw.view(self.kv_cache_dtype).view(shape).to(self.device)  # [N, L, 2, BS, Hkv, D]
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, index, blocks.movedim(0, 2))

    # ------------------------------------------------------------------------------------ set-up

    def _max_model_len(self) -> int:
        max_positions = self.text_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the model's max_position_embeddings={max_positions}"
            )
        max_len = self.config.max_model_len or max_positions
        window = getattr(self.text_config, "sliding_window", None)
        windowed = any(layer.sliding_window is not None for layer in self._layer_windows())
        if window and window < max_len and not windowed:  # a model file without its window: exact up to it
            logger.info("max_model_len capped at the sliding window its layers do not apply: %d", window)
            max_len = window
        return max_len

    def _load_model(self, model_dir: Path) -> torch.nn.Module:
        model_class = get_model_class(self.hf_config)
        with torch.device("meta"), tensor_parallel(self.tp), pipeline_stage(self.pp):
            model = model_class(self.hf_config).to(dtype=self.dtype)
        cpu_kernels_serve = (
            self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.library() is not None
        )
        if self.config.quantization is not None and not cpu_kernels_serve:
            raise ParameterError(
                "quantization",
                f"quantization={self.config.quantization!r} runs on CPU computing in float32 with the C kernels built; "
                f"this engine computes in {self.dtype} on {self.device.type}"
                + ("" if cpu_kernels.library() is not None else " without the C kernels"),
            )
        if self.config.quantization == "gguf" and self.gguf is None:
            raise ParameterError(
                "quantization", "quantization='gguf' serves the blocks of a .gguf model; this model is not a GGUF file"
            )
        plan = LoadPlan(
            self.config.quantization, self.dtype, self.weight_dtype, self.device, packed=cpu_kernels_serve,
            bf16_products=self.weight_dtype == torch.bfloat16,
        )
        try:
            self.weights: WeightsSummary = load_weights(model, self._checkpoint(model_dir), plan)
        except (ValueError, KeyError, OSError) as e:
            raise ModelLoadError(f"cannot load weights from {str(self.gguf or model_dir)!r}: {e}") from None
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.materialize(self.device, self.dtype)
        if cpu_kernels_serve:
            if any(isinstance(m, Linear) and isinstance(m.quantized, GGMLWeight) for m in model.modules()):
                self.weights.products = f"int8 blocks of x ({cpu_kernels.ggml_linear_path()})"
                add_batched_layout(model, self.config.batched_weights_memory, self.weights)
            elif self.weight_dtype == torch.bfloat16:
                small, large = cpu_kernels.bf16_linear_path(1), cpu_kernels.bf16_linear_path(1 << 16)
                start = next(rows for rows in range(1, 1 << 16) if cpu_kernels.bf16_linear_path(rows) == large)
                paths = small if small == large else f"{small} below {start} rows, {large} from {start}"
                self.weights.products = f"bfloat16 ({paths})" if large != "widened" else "float32 (bfloat16 widened)"
            if self.config.quantization == "w8a8":
                head, path = self.weights.products, cpu_kernels.int8_linear_path()
                self.weights.products = f"int8 ({path}); output head {head}"
                if path == "generic":
                    logger.warning(
                        "quantization='w8a8' on a CPU without AVX512-VNNI multiplies int8 in plain C, slower than "
                        "quantization='int8' (int8 weights, float products) and than the weights in dtype"
                    )
        return model.eval()

    def _checkpoint(self, model_dir: Path) -> Checkpoint:
        """The weights' source: the GGUF file the metadata came from, else the directory's safetensors."""
        if self.gguf is None:
            if not any(model_dir.glob("*.safetensors")):
                raise ModelLoadError(f"{str(model_dir)!r} has no *.safetensors weights")
            return SafetensorsCheckpoint(model_dir)
        try:
            gguf = GGUFFile(self.gguf)
        except (GGUFError, OSError) as e:
            raise ModelLoadError(f"{str(self.gguf)!r} is not a readable GGUF file: {e}") from None
        num_heads = self.hf_config.num_attention_heads
        return GGUFCheckpoint(gguf, num_heads, getattr(self.hf_config, "num_key_value_heads", None) or num_heads)

    def _layer_windows(self) -> list[Attention | MissingLayer]:
        """Every decoder layer's attention, or the ``MissingLayer`` another pipeline stage holds, in order: each
        has its ``sliding_window``."""
        return [m for m in self.model.modules() if isinstance(m, (Attention, MissingLayer))]

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _num_blocks(self) -> int:
        attn = self._attention_layers()[0]
        scale_bytes = 4 if self.kv_cache_dtype == torch.int8 else 0  # a float32 scale per block and KV head
        bytes_per_block = (
            self._layers_per_block() * 2 * attn.num_kv_heads
            * (self.block_size * attn.head_dim * self.kv_cache_dtype.itemsize + scale_bytes)
        )  # fmt: skip
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * DEFAULT_GPU_MEMORY_UTILIZATION)
        else:
            budget = max(DEFAULT_CPU_KV_CACHE_MIN, int(available_cpu_memory() * DEFAULT_CPU_KV_CACHE_FRACTION))
            # no more blocks than max_num_seqs sequences of max_model_len fill
            chunk = step_token_budget(self.config.max_num_batched_tokens, self.device.type)
            per_request = blocks_per_request(self.kv_cache_windows, self.block_size, self.max_model_len, chunk)
            most = self.config.max_num_seqs * per_request
            budget = min(budget, most * bytes_per_block)
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes")
        return num_blocks

    def _allocate_kv_cache(self) -> torch.Tensor:
        """``[layers of the largest group, 2, num_blocks, block_size, Hkv, D]``: a block id belongs to one group at
        a time, so the i-th layers of all groups share one tensor (``_bind_kv_cache``)."""
        attn = self._attention_layers()[0]
        shape = (self._layers_per_block(), 2, self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        # calloc'd: the OS commits zero pages as blocks are first written, so a large default budget
        # costs memory only as far as it is used, unless kv_cache_prefault commits them all now
        storage = np.zeros(math.prod(shape) * self.kv_cache_dtype.itemsize, dtype=np.uint8)
        if self.config.kv_cache_prefault:
            start = time.perf_counter()
            commit_pages(storage, torch.get_num_threads())
            logger.info("KV cache of %.1f GiB committed in %.1f s", storage.nbytes / 2**30, time.perf_counter() - start)
        return torch.from_numpy(storage).view(self.kv_cache_dtype).view(shape)

    def _layers_per_block(self) -> int:
        """The layers one block id holds K/V for: this stage's of the largest KV cache group."""
        return max(sum(isinstance(attn, Attention) for attn in group) for group in self._kv_cache_groups)

    def _bind_kv_cache(self) -> None:
        """Gives the i-th attention layer this stage holds of each KV cache group its group, its backend and the
        cache's slice i."""
        for index, group in enumerate(self._kv_cache_groups):
            stage_layers = [a for a in group if isinstance(a, Attention)]
            for i, (attn, kv_cache) in enumerate(zip(stage_layers, self.kv_cache)):
                attn.kv_cache, attn.backend, attn.kv_cache_group = kv_cache, self.attn_backend, index
                attn.kv_scales = None if self.kv_scales is None else self.kv_scales[i]


def kv_cache_groups(layers: list[Attention | MissingLayer]) -> list[list[Attention | MissingLayer]]:
    """The attention layers (and those a pipeline stage lacks) as KV cache groups: the layers of one window (full attention first, then by window),
    split into groups of the smallest such set's size, or of the largest where it is under 1.25 times the smallest
    (as vLLM's hybrid allocator does). A block id holds K/V for one layer of each slice of the cache, so groups of
    equal size leave none of its memory unused; each group keeps its own block tables.
    """
    by_window: dict[int | None, list[Attention | MissingLayer]] = {}
    for attn in sorted(layers, key=lambda a: (a.sliding_window is not None, a.sliding_window or 0)):
        by_window.setdefault(attn.sliding_window, []).append(attn)
    sizes = [len(same) for same in by_window.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    return [same[i : i + size] for same in by_window.values() for i in range(0, len(same), size)]


def commit_pages(buffer: np.ndarray, threads: int) -> None:
    """Has the OS back every page of ``buffer`` (zero-filled, as it is) now rather than at its first write:
    ``madvise(MADV_POPULATE_WRITE)`` over ``threads`` slices at once on Linux 5.14+ (a VM that backs its memory
    on demand faults a page in per vCPU at a time), else a write of each page's first byte."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = -buffer.ctypes.data % page  # madvise takes page-aligned ranges; the slack before is written below
    pages = (buffer.nbytes - start) // page
    failed = not sys.platform.startswith("linux")
    if not failed:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        errors: list[int] = []

        def populate(first: int, count: int) -> None:
            if libc.madvise(buffer.ctypes.data + start + first * page, count * page, _MADV_POPULATE_WRITE) != 0:
                errors.append(ctypes.get_errno())

        bounds = [pages * i // max(1, threads) for i in range(max(1, threads) + 1)]
        workers = [threading.Thread(target=populate, args=(a, b - a)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        failed = bool(errors)  # EINVAL before Linux 5.14
    if failed:
        buffer[start::page] = 0
    buffer[:start] = 0
    buffer[start + pages * page :] = 0


def available_cpu_memory() -> int:
    """Bytes of memory this process can still take: the kernel's ``MemAvailable``, within the
    cgroup's limit when one is set (a container)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available

