"""A minimal, fast GGUF reader: metadata and tensor descriptors without parsing everything up front.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every metadata field (tens of thousands of
tokenizer strings and merges), which takes seconds. The KV-cache calculator only needs a handful of numbers,
so we parse the header ourselves, skip the big arrays cheaply, and memory-map the tensor data. Dequantizing
still goes through `gguf.quants.dequantize`, the same routine transformers uses, so weights are bit-identical.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from pagedllm.errors import ModelLoadError
from pagedllm.model.families.base import GGUFHeader

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    """Where a tensor lies in the file: its name, numpy shape (slowest dim first), GGML type and byte offset."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute offset in the file


class _Buf:
    """Cursor over a bytes-like object (an mmap) with little-endian primitive readers."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.data[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.pos += n

    def value(self, vtype: int, keep_arrays: bool) -> Any:
        if vtype in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype in _SCALAR_FMT:
                size = struct.calcsize(_SCALAR_FMT[etype])
                if keep_arrays or count <= 64:
                    arr = np.frombuffer(self.data, dtype=np.dtype(_SCALAR_FMT[etype]), count=count, offset=self.pos)
                    self.pos += size * count
                    return arr.tolist()
                self.pos += size * count
                return None
            if etype == _STRING:
                if keep_arrays or count <= 64:
                    return [self.string() for _ in range(count)]
                for _ in range(count):
                    self.skip_string()
                return None
            if keep_arrays or count <= 64:
                return [self.value(etype, keep_arrays) for _ in range(count)]
            for _ in range(count):
                self.value(etype, False)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")


class GGUFFile:
    """An open GGUF file: `metadata` (large arrays left as None unless `keep_arrays`) and `tensors` by name."""

    def __init__(self, path: str, keep_arrays: bool = False) -> None:
        self.path = path
        try:
            self._fh: BinaryIO = open(path, "rb")
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
        try:
            self._parse(keep_arrays)
        except ModelLoadError:
            raise
        except Exception as e:  # struct.error, UnicodeDecodeError, IndexError, ...
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {e}") from e

    def _parse(self, keep_arrays: bool) -> None:
        b = _Buf(self._mm)
        if bytes(self._mm[:4]) != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic)")
        b.pos = 4
        version = b.unpack("<I")
        if version < 2:
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported")
        n_tensors = b.unpack("<Q")
        n_kv = b.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = b.string()
            vtype = b.unpack("<I")
            self.metadata[key] = b.value(vtype, keep_arrays)
        infos = []
        for _ in range(n_tensors):
            name = b.string()
            n_dims = b.unpack("<I")
            dims = [b.unpack("<Q") for _ in range(n_dims)]
            ggml_type = b.unpack("<I")
            offset = b.unpack("<Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = (b.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {
            name: GGUFTensorInfo(name, shape, t, data_start + off) for name, shape, t, off in infos
        }
        self._done_with(0, min(data_start, len(self._mm)))  # the header: a real tokenizer's arrays are MBs

    def _raw(self, name: str) -> tuple[np.ndarray, Any, list[int]]:  # Any: gguf.GGMLQuantizationType, imported late
        """The stored bytes of one tensor, uint8 [rows..., bytes per row], with its GGML type and logical shape."""
        import gguf

        info = self.tensors[name]
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = list(info.shape)
        if shape[-1] % block:
            raise ModelLoadError(f"{self.path}: tensor {name} has a row length not divisible by its block size")
        raw_shape = shape[:-1] + [shape[-1] // block * type_size]
        nbytes = int(np.prod(raw_shape))
        if info.offset + nbytes > len(self._mm):
            raise ModelLoadError(f"corrupt or truncated GGUF file {self.path}: tensor {name} runs past the end")
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=info.offset).reshape(raw_shape)
        return raw, qtype, shape

    def _done_with(self, start: int, nbytes: int) -> None:
        """Drop the mapping's pages over [start, start + nbytes) from this process (they stay in the page cache,
        and a later read maps them again): the loader copies each tensor out once, and the pages it touched
        would otherwise count as resident until the file is closed, as if the file were a second copy."""
        if hasattr(mmap, "MADV_DONTNEED") and nbytes > 0:
            first = start // mmap.PAGESIZE * mmap.PAGESIZE
            self._mm.madvise(mmap.MADV_DONTNEED, first, start + nbytes - first)

    def load_raw(self, name: str, convert: Callable[[np.ndarray], Any] = np.copy) -> Any:
        """One tensor's stored blocks (uint8 [rows..., bytes per row]) through `convert`, read straight from the
        mapping (default: copied out). `convert` returns arrays of its own, never a view of the mapping: its
        pages leave the process as soon as it returns (a view would read them from the file again, and close()
        refuses while one lives)."""
        raw = self._raw(name)[0]
        out = convert(raw)
        self._done_with(self.tensors[name].offset, raw.nbytes)
        return out

    def load_array(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Dequantize one tensor (or the rows `rows`, a slice with step 1, of a matrix: each row is whole blocks)
        to a new float32 numpy array of its logical shape (slowest dim first)."""
        import gguf

        raw, qtype, shape = self._raw(name)
        start = self.tensors[name].offset
        if rows is not None:
            first, stop, _ = rows.indices(raw.shape[0])
            start += first * raw.strides[0]
            raw = raw[first:stop]
            shape = [raw.shape[0], *shape[1:]]
        if qtype == gguf.GGMLQuantizationType.F32:
            out = raw.view(np.float32).reshape(shape).copy()
        elif qtype == gguf.GGMLQuantizationType.F16:
            out = raw.view(np.float16).reshape(shape).astype(np.float32)
        else:
            try:
                out = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
            except NotImplementedError as e:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} uses GGML type {qtype.name}, which cannot be dequantized"
                ) from e
        self._done_with(start, raw.nbytes)
        return out

    def header(self) -> GGUFHeader:
        """What a model family reads to build its config: metadata, tensor shapes, small float tensors."""
        arch = str(self.metadata.get("general.architecture"))
        shapes = {name: info.shape for name, info in self.tensors.items()}
        return GGUFHeader(self.metadata, arch + ".", shapes, lambda name: self.load_array(name).reshape(-1).tolist())

    def close(self) -> None:
        try:
            self._mm.close()
        finally:
            self._fh.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
