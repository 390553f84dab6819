"""GGUF files read in place: the header's metadata and tensor table, and each tensor's bytes read on demand.

A tensor's data is never converted here: ``GGUFFile.read`` returns its rows as the file stores them (ggml's
blocks, ``uint8 [rows, row bytes]``), read with plain file reads into a fresh buffer, so a model loads in the
memory of its file and no page of the file stays mapped. numpy only: no torch.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml's type id -> (name, elements per block, bytes per block), for every type a file may hold
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}  # fmt: skip
TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}

# metadata value types: fixed sizes as struct formats; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


class GGUFError(ValueError):
    """A file that is not a GGUF file this reader takes, or a tensor it cannot give."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the file: its ggml type, its shape with the contiguous (input) dimension last, as torch
    and Hugging Face order it (``[rows, K]`` for a weight), and where its bytes are."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0] if self.type_id in GGML_TYPES else f"type {self.type_id}"

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows


class GGUFFile:
    """The header of a GGUF file (version 2 or 3): ``metadata`` (key -> value: str, int, float, bool, a list of
    str, or a numpy array of numbers), ``tensors`` (name -> ``TensorInfo``) in file order.

    Raises:
        GGUFError: not a GGUF file, a version not read here, a truncated header, or a tensor of an unknown type.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self.metadata, self.tensors = _read_header(f, self.path)
        size = self.path.stat().st_size
        for info in self.tensors.values():
            if info.offset + info.nbytes > size:
                raise GGUFError(f"{self.path}: tensor {info.name!r} extends past the end of the file (truncated?)")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def read(self, name: str, out: np.ndarray | None = None, rows: range | None = None) -> np.ndarray:
        """The rows of tensor ``name`` as stored, ``uint8 [rows, row bytes]``, read into ``out`` when given (a
        C-contiguous buffer of that many bytes, e.g. a view of a torch tensor) or into a new array. ``rows``: only
        these consecutive rows (of all the tensor's leading dimensions flattened: expert ``e`` of a 3-D
        ``[experts, R, K]`` tensor is ``range(e * R, (e + 1) * R)``), read alone.

        Raises:
            KeyError: no tensor of that name.
            ValueError: ``rows`` outside the tensor's, or an ``out`` of another size.
        """
        info = self.tensors[name]
        rows = range(info.rows) if rows is None else rows
        if rows.step != 1 or not 0 <= rows.start <= rows.stop <= info.rows:
            raise ValueError(f"rows {rows} of tensor {name!r}, which has {info.rows} rows")
        nbytes = len(rows) * info.row_bytes
        if out is None:
            out = np.empty((len(rows), info.row_bytes), dtype=np.uint8)
        view = out.reshape(-1).view(np.uint8)
        if view.nbytes != nbytes:
            raise ValueError(f"a buffer of {view.nbytes} bytes for {nbytes} bytes of tensor {name!r}")
        with self.path.open("rb", buffering=0) as f:
            f.seek(info.offset + rows.start * info.row_bytes)
            done = 0
            while done < nbytes:  # readinto may return less than asked for
                got = f.readinto(memoryview(view)[done:])
                if not got:
                    raise GGUFError(f"{self.path}: tensor {name!r} is truncated")
                done += got
        return out.reshape(len(rows), info.row_bytes) if out.ndim == 1 else out


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    reader = _HeaderReader(f, path)
    magic, version = reader.take("4s"), reader.take("I")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r})")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; this reader takes versions 2 and 3")
    num_tensors, num_fields = reader.take("Q"), reader.take("Q")
    metadata = {}
    for _ in range(num_fields):
        key = reader.string()
        metadata[key] = reader.value(reader.take("I"))
    infos = []
    for _ in range(num_tensors):
        name = reader.string()
        dims = [reader.take("Q") for _ in range(reader.take("I"))]
        infos.append((name, dims, reader.take("I"), reader.take("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-reader.position // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        if type_id not in GGML_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has an unknown ggml type {type_id}")
        _, block, block_bytes = GGML_TYPES[type_id]
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r}: {dims[0]} features is not a multiple of its blocks of {block}")
        count = int(np.prod(dims, dtype=np.int64))
        tensors[name] = TensorInfo(
            name, type_id, tuple(int(d) for d in reversed(dims)), data_start + offset, count // block * block_bytes
        )
    return metadata, tensors


class _HeaderReader:
    """Sequential reads of a header's little-endian fields through a growing buffer."""

    def __init__(self, f: BinaryIO, path: Path) -> None:
        self._f, self._path = f, path
        self._buf = bytearray(f.read(1 << 20))
        self.position = 0

    def _need(self, size: int) -> None:
        while self.position + size > len(self._buf):
            more = self._f.read(max(size, 1 << 20))
            if not more:
                raise GGUFError(f"{self._path}: truncated GGUF header")
            self._buf += more

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self._need(size)
        value = struct.unpack_from("<" + fmt, self._buf, self.position)
        self.position += size
        return value[0]

    def string(self) -> str:
        size = self.take("Q")
        self._need(size)
        self.position += size
        return bytes(self._buf[self.position - size : self.position]).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == 8:
            return self.string()
        if value_type == 9:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                self._need(count * dtype.itemsize)
                array = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self.position).copy()
                self.position += count * dtype.itemsize
                return array
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise GGUFError(f"{self._path}: unknown metadata value type {value_type}")
        return self.take(_SCALARS[value_type])
