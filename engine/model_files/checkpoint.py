"""Checkpoints read tensor by tensor, by Hugging Face name, in the types their files store.

- ``SafetensorsCheckpoint``: a Hugging Face directory's ``*.safetensors``; a tensor comes back in its stored
  dtype (bfloat16 stays bfloat16), read with plain file reads into its own buffer.
- ``GGUFCheckpoint``: a GGUF file under Hugging Face names (``model.layers.3.self_attn.q_proj.weight`` is
  ``blk.3.attn_q.weight``, by ``gguf_arch``'s names; expert E's weight is expert E's rows of the layer's 3-D
  ``ffn_*_exps`` tensor, or in older files its own ``ffn_*.E``); ``blocks`` gives a tensor's rows as the file
  stores them (ggml's types, llama.cpp's reordering of query and key rows undone), ``tensor`` its float values
  (Gemma's norm weights with the 1 llama.cpp adds taken off).

Neither maps the file, so loading a model costs the memory of what is kept, not of the file as well.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.model_files.gguf import GGUFFile, TensorInfo
from engine.model_files.gguf_arch import TOP_NAMES, expert_tensor, layer_names, norms_stored_plus_one

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TOP = re.compile(r"(.+)\.(weight|bias)")
# llama.cpp reorders the rows of these for its rotary layout in the architectures it converts with LlamaModel
_PERMUTED_ARCHITECTURES = ("llama",)


class Checkpoint(Protocol):
    """A model's tensors by Hugging Face name."""

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor's values: its stored dtype where that is a float dtype torch has, else float32."""
        ...


class SafetensorsCheckpoint:
    """The ``*.safetensors`` files of a Hugging Face directory.

    Raises:
        ValueError: a file whose header cannot be read.
    """

    def __init__(self, model_dir: Path) -> None:
        self._where: dict[str, tuple[Path, int, int, torch.dtype, tuple[int, ...]]] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                try:
                    header = json.loads(f.read(size))
                except ValueError as e:
                    raise ValueError(f"{file.name}: unreadable safetensors header: {e}") from None
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                start, end = entry["data_offsets"]
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"{file.name}: tensor {name!r} has dtype {entry['dtype']}, which is not read here")
                self._where[name] = (file, 8 + size + start, end - start, dtype, tuple(entry["shape"]))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][4]

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name][3]

    def tensor(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor in its stored dtype, read into ``out`` when given (a contiguous CPU tensor of that dtype and
        shape, e.g. the rows of a fused weight that this shard fills)."""
        file, offset, nbytes, dtype, shape = self._where[name]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"a buffer of {out.dtype} {list(out.shape)} for {name!r} of {dtype} {list(shape)}")
        _read_into(file, offset, out.view(-1).view(torch.uint8).numpy(), nbytes)
        return out


class GGUFCheckpoint:
    """A GGUF file's tensors under Hugging Face names; ``num_heads`` and ``num_kv_heads`` undo the reordering
    of the query and key rows. An expert's weight (``model.layers.L.mlp.experts.E.gate_proj.weight``, Mixtral's
    ``block_sparse_moe.experts.E.w1``) is expert E's rows of the layer's 3-D tensor (``blk.L.ffn_gate_exps``),
    read alone, in the file's type; in a file that stores each expert alone, its own tensor (``blk.L.ffn_gate.E``)."""

    def __init__(self, gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> None:
        self.file = gguf
        self._heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
        self._permuted = gguf.architecture in _PERMUTED_ARCHITECTURES
        self._layer_names = layer_names(gguf.architecture)
        self._norms_plus_one = norms_stored_plus_one(gguf.architecture)

    def gguf_name(self, name: str) -> str:
        """The GGUF name of a Hugging Face tensor name (itself where no rule maps it); an expert's is its 3-D
        tensor's, or its own in a file that stores each expert alone."""
        if expert := expert_tensor(name):
            return expert.single if expert.single in self.file.tensors else expert.stacked
        if match := _LAYER.fullmatch(name):
            return f"blk.{match[1]}.{self._layer_names.get(match[2], match[2])}.{match[3]}"
        if match := _TOP.fullmatch(name):
            return f"{TOP_NAMES.get(match[1], match[1])}.{match[2]}"
        return name

    def __contains__(self, name: str) -> bool:
        try:
            self._locate(name)
        except KeyError:
            return False
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self._locate(name)[2]

    def type_name(self, name: str) -> str:
        return self._locate(name)[0].type_name

    def blocks(self, name: str) -> np.ndarray:
        """The tensor's rows as the file stores them, ``uint8 [rows, row bytes]``, in Hugging Face's row order (a
        1-D tensor is one row)."""
        info, rows, shape = self._locate(name)
        stored = self.file.read(info.name, rows=rows)
        order = self._row_order(name, shape)
        return stored if order is None or len(shape) == 1 else stored[order]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor's values: F32, F16 and BF16 as stored, any other type dequantized to float32 (gguf-py); a Gemma
        norm's weight w where the file stores 1 + w.

        Raises:
            ValueError: a type that holds no weights gguf-py can read (integers, F64, the activations' Q8_1/Q8_K).
        """
        info, rows, shape = self._locate(name)
        raw = self.file.read(info.name, rows=rows)
        if info.type_name in ("F32", "F16"):
            values = torch.from_numpy(raw.view(np.float32 if info.type_name == "F32" else np.float16))
        elif info.type_name == "BF16":
            values = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            try:
                values = dequantize(raw, GGMLQuantizationType(info.type_id))
                values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            except NotImplementedError:
                raise ValueError(
                    f"tensor {info.name!r} is {info.type_name}, which holds no weights this engine reads; "
                    f"weights are float (F32, F16, BF16) or a ggml quantized type (Q4_K, Q8_0, ...)"
                ) from None
        values = values.reshape(shape)
        if self._norms_plus_one and name.endswith("norm.weight"):
            values = values - 1  # exact where 1 + w is in [0.5, 2], as a norm weight is
        order = self._row_order(name, shape)
        return values if order is None else values[torch.from_numpy(order)]

    def _locate(self, name: str) -> tuple[TensorInfo, range | None, tuple[int, ...]]:
        """The file's tensor holding ``name``, the rows of it that are ``name``'s (None: all), and ``name``'s shape.

        Raises:
            KeyError: no tensor of the file holds ``name``.
        """
        expert = expert_tensor(name)
        if expert is not None and expert.single not in self.file.tensors:
            info = self.file.tensors.get(expert.stacked)
            if info is None or len(info.shape) != 3 or not 0 <= expert.index < info.shape[0]:
                raise KeyError(name)
            rows = info.shape[1]
            return info, range(expert.index * rows, (expert.index + 1) * rows), info.shape[1:]
        info = self.file.tensors[self.gguf_name(name)]
        return info, None, info.shape

    def _row_order(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """Which stored row each Hugging Face row is, where llama.cpp reordered them (else None): it interleaves
        the two rotary halves of each query and key head, rows (head, i, half) stored as (head, half, i)."""
        kind = name.rsplit(".", 2)[-2]
        if not self._permuted or kind not in self._heads:
            return None
        rows, heads = shape[0], self._heads[kind]
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def _read_into(file: Path, offset: int, out: np.ndarray, nbytes: int) -> None:
    if out.nbytes != nbytes:
        raise ValueError(f"a buffer of {out.nbytes} bytes for {nbytes} at {file.name}:{offset}")
    with file.open("rb", buffering=0) as f:
        f.seek(offset)
        view, done = memoryview(out), 0
        while done < nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{file.name} is truncated")
            done += got

