"""A safetensors reader and writer in plain Python and torch that validates everything it reads.

Format: an 8-byte little-endian header length N, N bytes of JSON (an object mapping tensor names to
{"dtype", "shape", "data_offsets"} plus an optional "__metadata__" of strings), then the tensor bytes,
packed, with offsets relative to the start of that data section.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from octlm.files import atomic_writer

MAX_HEADER_BYTES = 100_000_000  # the limit the reference implementation enforces
CHUNK_BYTES = 16 * 1024 * 1024  # most file bytes read_into holds in memory at once

# In the reference writer's order: a file lists larger dtypes first, ties by name, so every tensor
# starts at an offset aligned to its item size and our files equal the `safetensors` package's byte
# for byte.
DTYPES: dict[str, torch.dtype] = {
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "F32": torch.float32,
    "U32": torch.uint32,
    "I32": torch.int32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
WRITE_RANK = {dtype: rank for rank, dtype in enumerate(DTYPES.values())}
ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

if sys.byteorder != "little":  # safetensors is little-endian and this module does not byte-swap
    raise ImportError("octlm.safetensors needs a little-endian machine")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; start and end are byte offsets into the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """An open, fully validated safetensors file whose tensors are read one at a time on demand.

    Reads are positioned reads of just the bytes asked for (no mmap of the whole file), so loading
    a large file tensor by tensor keeps only the current tensor resident.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        except OSError as error:
            raise ValueError(f"{self.path}: cannot open safetensors file: {error}") from error
        try:
            self._data_start, self.metadata, self.entries = _read_header(self._file, self.path)
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying file; tensors already returned stay valid."""
        self._file.close()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self.entries)

    def entry(self, name: str) -> TensorEntry:
        """The header entry of one tensor; a ValueError names an unknown one."""
        try:
            return self.entries[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor named {name!r}") from None

    def get(self, name: str) -> torch.Tensor:
        """A new CPU tensor of the entry's dtype and shape holding the stored values."""
        entry = self.entry(name)
        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._read_exact(self._data_start + entry.start, raw)
        _check_bool_bytes(self.path, entry, raw)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return raw.view(entry.dtype).reshape(entry.shape)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Copy tensor `name` into `out` (same shape, any dtype/device) in chunks of <= CHUNK_BYTES."""
        entry = self.entry(name)
        if tuple(out.shape) != entry.shape:
            raise ValueError(
                f"{self.path}: tensor {name!r} has shape {list(entry.shape)}, target has {list(out.shape)}"
            )
        if not out.is_contiguous():
            with torch.no_grad():
                out.copy_(self.get(name))
            return out
        itemsize = _itemsize(entry.dtype)
        step = max(1, CHUNK_BYTES // itemsize)
        flat = out.view(-1)
        buffer = torch.empty(min(entry.numel, step) * itemsize, dtype=torch.uint8)
        with torch.no_grad():
            for first in range(0, entry.numel, step):
                count = min(step, entry.numel - first)
                raw = buffer[: count * itemsize]
                self._read_exact(self._data_start + entry.start + first * itemsize, raw)
                _check_bool_bytes(self.path, entry, raw)
                flat[first : first + count].copy_(raw.view(entry.dtype))
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time in file order."""
        for name in self.entries:
            yield name, self.get(name)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors()

    def _read_exact(self, offset: int, out: torch.Tensor) -> None:
        """Fill the uint8 CPU tensor `out` with file bytes from `offset` on."""
        view = _byte_view(out)
        done = 0
        self._file.seek(offset)
        while done < len(view):
            got = self._file.readinto(view[done:])
            if not got:
                raise ValueError(f"{self.path}: file ended early while reading; it changed after opening")
            done += got


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write tensors atomically (temp file beside path, fsync, rename) in a deterministic layout.

    Tensors are packed largest dtype first, then by name (see DTYPES), the order the `safetensors`
    package uses, so each starts aligned to its item size.
    """
    path = Path(path)
    _check_metadata(path, metadata)
    prepared = {name: _prepare_for_write(path, name, tensor) for name, tensor in tensors.items()}
    prepared = dict(sorted(prepared.items(), key=lambda item: (WRITE_RANK[item[1].dtype], item[0])))
    header = _encode_header(prepared, metadata)
    with atomic_writer(path) as file:
        file.write(len(header).to_bytes(8, "little"))
        file.write(header)
        for tensor in prepared.values():
            if tensor.numel():
                file.write(_byte_view(tensor.view(-1).view(torch.uint8)))
    return path


def _read_header(file, path: Path) -> tuple[int, dict[str, str], dict[str, TensorEntry]]:
    """Read and validate the header; return (data start offset, metadata, entries in file order)."""
    file_size = os.fstat(file.fileno()).st_size
    if file_size < 8:
        raise ValueError(f"{path}: file is {file_size} bytes, too short for the 8-byte header length")
    file.seek(0)
    header_len = int.from_bytes(file.read(8), "little")
    if header_len < 2:
        raise ValueError(f"{path}: header length {header_len} is too small for a JSON object")
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header length {header_len:,} is above the {MAX_HEADER_BYTES:,} byte limit")
    if 8 + header_len > file_size:
        raise ValueError(
            f"{path}: header length {header_len:,} runs past the end of the {file_size:,} byte file"
        )
    raw = file.read(header_len)
    if len(raw) != header_len:
        raise ValueError(f"{path}: file ended inside the header")
    header = _parse_json(path, raw)
    metadata = _parse_metadata(path, header.pop("__metadata__", {}))
    entries = [_parse_entry(path, name, value) for name, value in header.items()]
    entries.sort(key=lambda entry: (entry.start, entry.end))
    _check_layout(path, entries, payload_size=file_size - 8 - header_len)
    return 8 + header_len, metadata, {entry.name: entry for entry in entries}


def _parse_json(path: Path, raw: bytes) -> dict:
    """Decode the header bytes as one JSON object with unique keys and no NaN/Infinity."""
    if not raw.startswith(b"{"):
        raise ValueError(f"{path}: header does not start with '{{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path}: header is not valid UTF-8 ({error.reason} at byte {error.start})"
        ) from None
    try:
        header = json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant)
    except _HeaderError as error:
        raise ValueError(f"{path}: {error}") from None
    except RecursionError:
        raise ValueError(f"{path}: header JSON is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, or an integer with thousands of digits
        raise ValueError(f"{path}: header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    return header


class _HeaderError(Exception):
    """A JSON-level problem found by a decoder hook."""


def _unique_object(pairs: list[tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise _HeaderError(f"header has duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> None:
    raise _HeaderError(f"header contains {name}, which is not JSON")


def _parse_metadata(path: Path, value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: __metadata__ must be an object of strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise ValueError(f"{path}: __metadata__[{key!r}] must be a string, got {type(item).__name__}")
    return value


def _parse_entry(path: Path, name: str, value: object) -> TensorEntry:
    """Validate one header entry's keys, dtype, shape, offsets and byte count."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(value, dict):
        raise ValueError(f"{where}: entry must be an object, got {type(value).__name__}")
    if set(value) != ENTRY_KEYS:
        missing, extra = sorted(ENTRY_KEYS - set(value)), sorted(set(value) - ENTRY_KEYS)
        raise ValueError(
            f"{where}: entry keys must be {sorted(ENTRY_KEYS)} (missing {missing}, extra {extra})"
        )
    dtype_name, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ValueError(f"{where}: unknown dtype {dtype_name!r} (known: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_natural(size) for size in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_natural(x) for x in offsets):
        raise ValueError(f"{where}: data_offsets must be two non-negative integers, got {offsets!r}")
    start, end = offsets
    if start > end:
        raise ValueError(f"{where}: data_offsets begin {start} is after end {end}")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * _itemsize(dtype)  # Python ints: no overflow, nothing allocated
    if expected != end - start:
        raise ValueError(
            f"{where}: shape {shape} of {dtype_name} needs {expected:,} bytes, "
            f"data_offsets span {end - start:,}"
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), start=start, end=end)


def _is_natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: Path, entries: list[TensorEntry], payload_size: int) -> None:
    """Entries sorted by start must tile [0, payload_size) exactly: no overlap, gap or excess."""
    position = 0
    for entry in entries:
        if entry.start < position:
            raise ValueError(
                f"{path}: tensor {entry.name!r} at bytes {entry.start}..{entry.end} overlaps another"
            )
        if entry.start > position:
            raise ValueError(
                f"{path}: gap of unclaimed bytes {position}..{entry.start} before {entry.name!r}"
            )
        position = entry.end
    if position > payload_size:
        raise ValueError(
            f"{path}: tensors need {position:,} data bytes but the file holds {payload_size:,} (truncated?)"
        )
    if position < payload_size:
        raise ValueError(
            f"{path}: {payload_size - position:,} bytes after the last tensor belong to no tensor"
        )


def _check_bool_bytes(path: Path, entry: TensorEntry, raw: torch.Tensor) -> None:
    if entry.dtype == torch.bool and raw.numel() and bool((raw > 1).any()):
        raise ValueError(f"{path}: BOOL tensor {entry.name!r} holds bytes other than 0 and 1")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor's bytes (no numpy needed)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    buffer = (ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


def _check_metadata(path: Path, metadata: Mapping[str, str] | None) -> None:
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"{path}: metadata must map strings to strings, got {key!r}: {value!r}")


def _prepare_for_write(path: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy-or-view of `tensor`, after checking its name and dtype are writable."""
    if not isinstance(name, str) or name == "__metadata__":
        raise ValueError(f"{path}: invalid tensor name {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{path}: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"{path}: {name!r} has dtype {tensor.dtype}, which safetensors cannot store here")
    return tensor.detach().to("cpu").contiguous()


def _encode_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    """Compact JSON header, space-padded so the data section starts 8-byte aligned."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    position = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return encoded + b" " * (-len(encoded) % 8)
