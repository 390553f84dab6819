"""PoolingRunner: a pooling model on the device, one packed batch of inputs -> embeddings or scores.

It holds no KV cache: a pooling model reads each input once, whole (``num_blocks`` is the one null
block the engine's block pool needs, with no tensor behind it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.errors import ModelLoadError, ParameterError
from engine.layers.linear import Linear
from engine.loader import gguf_source
from engine.model_types import ENCODER_MODEL_TYPES
from engine.pooling.decoder import Decoder, decoder_state_dict
from engine.pooling.encoder import BatchLayout, Encoder, encoder_state_dict, is_kernel_served
from engine.pooling.gguf_encoder import load_gguf_encoder
from engine.pooling.model_config import PoolingConfig
from engine.pooling.params import PoolingParams
from engine.pooling.tokens import PoolingInput
from engine.worker.model_runner import model_dtypes, resolve_device
from engine.worker.weight_formats import WeightsSummary


DECODER_TYPES = ("qwen2", "qwen3")  # decoders served as embedding models (last-token pooling)


class PoolingRunner:
    """Runs a pooling model's batches: ``embed`` (pooled, truncated, normalized) and ``score`` (logits, activated).

    Attributes:
        vocab_size, max_model_len, hf_config, device: as ``ModelRunner``'s.
        num_blocks: 1 (the null block); kv_cache_windows: (None,); no KV tensor exists.
    """

    kv_cache_windows = (None,)
    num_blocks = 1
    attention = "torch sdpa over packed inputs (bidirectional, no KV cache)"
    layers = "modules"

    def __init__(self, config: EngineConfig, model_dir: Path, pooling: PoolingConfig) -> None:
        from transformers import AutoConfig

        if config.quantization is not None:
            raise ParameterError("quantization", f"quantization={config.quantization!r} is not served for pooling models")
        if config.tensor_parallel_size != 1:
            raise ParameterError("tensor_parallel_size", "pooling models run in one process (tensor_parallel_size=1)")
        self.pooling = pooling
        self.hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        model_type = self.hf_config.model_type
        encoder = model_type in ENCODER_MODEL_TYPES
        if not encoder and model_type not in DECODER_TYPES:
            raise ModelLoadError(
                f"{str(model_dir)!r}: {model_type!r} is not served as a pooling model; served: "
                f"{', '.join(ENCODER_MODEL_TYPES + DECODER_TYPES)}"
            )
        self.device = resolve_device(config.device)
        # NOTE: every tensor in the weights' dtype (bfloat16 matmuls run on AVX512-BF16 / AMX through oneDNN)
        compute_dtype, self.dtype = model_dtypes(config.dtype, self.device, model_dir, self.hf_config)
        gguf = gguf_source(model_dir)
        if gguf is not None and config.dtype == "auto":  # a GGUF's quantized blocks multiply float32 x, as a decoder's
            self.dtype = compute_dtype
        self.vocab_size: int = self.hf_config.vocab_size
        self.max_model_len = pooling.max_length
        num_labels = pooling.num_labels if pooling.task == "classify" else None
        if num_labels not in (None, 1):
            raise ModelLoadError(f"{str(model_dir)!r}: a cross-encoder scores with one label; this one has {num_labels}")
        with torch.device("meta"):
            model = Encoder(self.hf_config, num_labels) if encoder else Decoder(self.hf_config, num_labels is not None)
        # NOTE: float32 linears on CPU run the engine's own kernels (packed panels), 2.3x oneDNN's float32
        # matmul at 2048 rows on a Zen 5; bfloat16 ones stay on oneDNN, which all-bfloat16 layers outran
        # the panels' float32 inputs with (MiniLM: 0.58 against 0.64-1.0 s for 64 chunks)
        packed = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.library() is not None
        if gguf is not None and num_labels is not None:
            raise ModelLoadError(f"{str(gguf)!r}: a GGUF BERT embedder has no classification head; it cannot score")
        if gguf is not None:  # a BERT GGUF (engine.model_files.gguf_bert): its tensors in the file's types
            loaded = load_gguf_encoder(
                model, gguf, self.hf_config.num_hidden_layers, self.hf_config.num_attention_heads, self.dtype,
                self.device, native_blocks=packed,
            )  # fmt: skip
            state, nbytes = loaded.state, loaded.nbytes
        else:
            state = self._safetensors_state(model_dir, encoder, num_labels)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
        model.load_state_dict(state, strict=True, assign=True)
        if packed:
            for linear in (m for m in model.modules() if isinstance(m, Linear) and m.quantized is None):
                linear.pack()
        self.model = model.eval()
        head_dim = self.hf_config.hidden_size // self.hf_config.num_attention_heads
        if is_kernel_served(self.device, model.causal) and cpu_kernels.encoder_supports(head_dim, self.dtype):
            self.attention = "CPU kernel over packed inputs (bidirectional, no KV cache, no padding)"
        dtype_name = str(self.dtype).removeprefix("torch.")
        kinds = Counter(m.quantized.kind if m.quantized is not None else dtype_name for m in model.modules()
                        if isinstance(m, Linear))  # fmt: skip
        products = "float32 (packed panels)" if packed else dtype_name
        if any(kind != dtype_name for kind in kinds):  # a GGUF's quantized blocks, served as they are
            products = f"int8 blocks of x ({cpu_kernels.ggml_linear_path()}); {products} for float weights"
        self.weights = WeightsSummary("gguf" if gguf is not None else None, kinds, nbytes, products)
        self.num_pooled_batches = 0  # what it ran, for Engine.stats()
        self.num_pooled_requests = 0
        self.num_pooled_tokens = 0

    def _safetensors_state(self, model_dir: Path, encoder: bool, num_labels: int | None) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(file))
        try:
            to_state = encoder_state_dict if encoder else decoder_state_dict
            state = to_state(weights, self.hf_config.num_hidden_layers)
            if not encoder and num_labels is not None:
                state["score_weight"] = yes_no_weight(weights, model_dir)
        except KeyError as e:
            raise ModelLoadError(f"{str(model_dir)!r}: tensor {e.args[0]!r} missing from the checkpoint") from None
        if encoder and num_labels is not None and "head_out.weight" not in state:
            raise ModelLoadError(f"{str(model_dir)!r}: no sequence-classification head in the checkpoint")
        return {k: v.to(self.device, self.dtype) for k, v in state.items()}

    def close(self) -> None:
        """Nothing to release beyond the tensors."""

    def start(self, kind: str, inputs: list[PoolingInput], params: list[PoolingParams]) -> PoolingBatchRun:
        """A batch of ``kind`` (``"embed"`` / ``"score"``) set up to run a layer at a time (``PoolingBatchRun``)."""
        return PoolingBatchRun(self, kind, inputs, params)

    def embed(self, inputs: list[PoolingInput], params: list[PoolingParams]) -> list[list[float]]:
        """Each input's embedding, pooled as the model says, cut to ``dimensions``, normalized as asked."""
        return self.start("embed", inputs, params).run_to_end()

    def score(self, inputs: list[PoolingInput], params: list[PoolingParams]) -> list[float]:
        """Each pair's score: the one-label logit, its sigmoid where ``use_activation`` (vLLM's default).

        An encoder reads its first token's state, a decoder (Qwen3-Reranker) its last one's."""
        return self.start("score", inputs, params).run_to_end()

    @torch.inference_mode()
    def _begin(self, inputs: list[PoolingInput]) -> tuple[torch.Tensor, object, BatchLayout]:
        lengths = [len(i.token_ids) for i in inputs]
        self.num_pooled_batches += 1
        self.num_pooled_requests += len(inputs)
        self.num_pooled_tokens += sum(lengths)
        layout = BatchLayout(lengths, self.device, causal=self.model.causal)
        ids = torch.tensor([t for i in inputs for t in i.token_ids], device=self.device)
        # NOTE: a model of one segment type (RoBERTa) reads every token as type 0, whatever the tokenizer says
        segmented = getattr(self.hf_config, "type_vocab_size", 1) > 1
        types = torch.tensor(
            [t for i in inputs for t in (i.token_type_ids if segmented and i.token_type_ids else [0] * len(i.token_ids))],
            device=self.device,
        )
        x, extra = self.model.begin(ids, types, layout)
        return x, extra, layout

    @torch.inference_mode()
    def _embeddings(self, hidden: torch.Tensor, layout: BatchLayout, params: list[PoolingParams]) -> list[list[float]]:
        pooled = pool(hidden.float(), layout.lengths, self.pooling.pooling)  # [B, hidden]
        out = []
        for row, p in zip(pooled, params):
            if p.dimensions is not None:
                row = row[: p.dimensions]
            if self.pooling.normalize if p.normalize is None else p.normalize:
                row = F.normalize(row, dim=-1)
            out.append(row.tolist())
        return out

    @torch.inference_mode()
    def _scores(self, hidden: torch.Tensor, layout: BatchLayout, params: list[PoolingParams]) -> list[float]:
        states = pool(hidden, layout.lengths, "last" if self.model.causal else "cls")
        logits = self.model.classify(states).float()[:, 0]  # [B]: the first label's logit
        return [float(torch.sigmoid(x)) if p.use_activation else float(x) for x, p in zip(logits, params)]


class PoolingBatchRun:
    """One packed batch through the model a layer at a time: ``advance()`` runs the next layer, ``values()`` pools
    once ``done``. Between two layers it holds only the batch's hidden states, so it can wait for another engine's
    step (``PoolingQueue``: a pooling batch beside a chat model spreads its layers over the chat's steps).

    Attributes:
        num_stages: the model's layers; done: every layer ran.
    """

    def __init__(self, runner: PoolingRunner, kind: str, inputs: list[PoolingInput], params: list[PoolingParams]) -> None:
        self._runner, self._kind, self._params = runner, kind, params
        self._hidden, self._extra, self._layout = runner._begin(inputs)  # [T, hidden]
        self.num_stages = len(runner.model.layers)
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next >= self.num_stages

    @torch.inference_mode()
    def advance(self) -> None:
        """Runs the next layer."""
        self._hidden = self._runner.model.run_layer(self._next, self._hidden, self._extra, self._layout)
        self._next += 1

    def values(self) -> list:
        """Each input's embedding (``embed``) or score (``score``), in the batch's order; once ``done``."""
        assert self.done, "values() of a batch whose layers have not all run"
        runner = self._runner
        with torch.inference_mode():
            hidden = runner.model.end(self._hidden)
        if self._kind == "embed":
            return runner._embeddings(hidden, self._layout, self._params)
        return runner._scores(hidden, self._layout, self._params)

    def run_to_end(self) -> list:
        while not self.done:
            self.advance()
        return self.values()


def yes_no_weight(weights: dict[str, torch.Tensor], model_dir: Path) -> torch.Tensor:
    """Qwen3-Reranker's recipe as vLLM converts it: the output rows of "yes" minus "no", so that the one logit
    is ``logit(yes) - logit(no)`` and its sigmoid the softmax probability of "yes" over the two."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight", weights.get("embed_tokens.weight")))
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    if head is None or tokenizer.unk_token_id in (yes, no) or yes is None or no is None:
        raise ModelLoadError(f"{str(model_dir)!r}: a decoder scores by its \"yes\" and \"no\" tokens' logits; not found")
    return head[yes] - head[no]


def pool(hidden: torch.Tensor, lengths: list[int], mode: str) -> torch.Tensor:
    """``[T, D]`` token states of inputs laid end to end -> ``[B, D]``: their mean, elementwise max, first (CLS)
    or last token."""
    counts = torch.tensor(lengths, device=hidden.device)
    ends = counts.cumsum(0)
    if mode == "cls":
        return hidden[ends - counts]
    if mode == "last":
        return hidden[ends - 1]
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), counts)  # [T]
    if mode == "max":
        lowest = hidden.new_full((len(lengths), hidden.shape[1]), float("-inf"))
        return lowest.scatter_reduce_(0, segments[:, None].expand_as(hidden), hidden, "amax")
    sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, segments, hidden)
    return sums / counts.to(hidden.dtype)[:, None]
