"""safetensors files read and written one tensor at a time, with numpy alone (bfloat16 included).

The format is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` relative to the data after the header, and ``"__metadata__"``), then
the tensors' bytes. Reading maps the file; writing lays out the header first and streams each tensor
after it, so neither side ever holds more than one tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16 travels as raw 16-bit words


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype (``F32`` / ``F16`` / ``BF16``), shape and absolute byte offset."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEM_BYTES[self.dtype]


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The JSON header of a safetensors file and the absolute offset where its data begins.

    Raises:
        ValueError: the file is too short or its header is not JSON.
    """
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file: shorter than its 8-byte header length")
        (size,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ValueError(f"{str(path)!r} is not a safetensors file: its header is not JSON ({e})") from None
    return header, 8 + size


class SafetensorsReader:
    """Every tensor of a Hugging Face directory's ``*.safetensors`` files, by name, read on demand."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{str(model_dir)!r} has no *.safetensors weights")
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            header, data_start = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _ITEM_BYTES:
                    raise ValueError(
                        f"{str(path)!r}: tensor {name!r} has dtype {info['dtype']}; supported: "
                        f"{', '.join(_ITEM_BYTES)}"
                    )
                begin = info["data_offsets"][0]
                self.entries[name] = TensorEntry(path, info["dtype"], tuple(info["shape"]), data_start + begin)

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float32 array (a fresh copy; the file stays mapped only while reading)."""
        return _as_f32(self._mapped(name), self.entries[name].dtype)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of tensor ``name`` (first axis) as a float32 array."""
        return _as_f32(self._mapped(name)[start:stop], self.entries[name].dtype)

    def _mapped(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        if not entry.nbytes:
            return np.zeros(entry.shape, dtype=_NUMPY_DTYPES[entry.dtype])
        return np.memmap(entry.path, dtype=_NUMPY_DTYPES[entry.dtype], mode="r", offset=entry.offset, shape=entry.shape)


def _as_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_f32(raw) if dtype == "BF16" else np.array(raw, dtype=np.float32)


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bfloat16 values held as uint16 words, widened to float32 (exact)."""
    return (np.asarray(words, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as uint16 words; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, shape and dtype (``F32`` / ``F16`` / ``BF16``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def write_safetensors(
    path: Path, specs: Sequence[TensorSpec], produce: Callable[[TensorSpec], Iterator[np.ndarray]]
) -> None:
    """Write ``specs`` into one safetensors file, in order; ``produce(spec)`` yields each tensor's values as
    float32 arrays whose concatenation (flattened) is the tensor, so a large one can come in row chunks.

    Raises:
        ValueError: a produced tensor has the wrong number of elements, or a dtype is unsupported.
    """
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in _ITEM_BYTES:
            raise ValueError(f"tensor {spec.name!r}: dtype must be one of {', '.join(_ITEM_BYTES)}; got {spec.dtype!r}")
        size = int(np.prod(spec.shape, dtype=np.int64)) * _ITEM_BYTES[spec.dtype]
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for spec in specs:
            expected = int(np.prod(spec.shape, dtype=np.int64))
            written = 0
            for part in produce(spec):
                _encode(part, spec.dtype).tofile(f)
                written += part.size
            if written != expected:
                raise ValueError(f"tensor {spec.name!r}: produced {written} values for shape {spec.shape}")


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return f32_to_bf16(values)
    return np.ascontiguousarray(values, dtype=_NUMPY_DTYPES[dtype])
