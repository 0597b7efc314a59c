"""octlm.safetensors against the reference `safetensors` package, every validation rule, and a fuzz test."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

import octlm.safetensors as st
from octlm.safetensors import SafetensorsFile, write_safetensors

ALL_DTYPES = sorted(st.DTYPES.values(), key=str)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as dtype (every bit pattern, NaNs included), bools as 0/1."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * itemsize,), generator=generator)
    return raw.to(torch.uint8).view(dtype)[: torch.Size(shape).numel()].reshape(shape)


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t.{str(dtype).removeprefix('torch.')}": random_tensor(dtype, (3, 5), generator)
        for dtype in ALL_DTYPES
    }
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.float32)
    tensors["ünïcode name"] = random_tensor(torch.bfloat16, (7,), generator)
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def raw_file(path: Path, header: dict | bytes, payload: bytes = b"", length: int | None = None) -> Path:
    """Write a hand-made safetensors file: length prefix (default: the true one), header, payload."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + payload)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---- agreement with the reference package ---------------------------------------------------------


def test_package_reads_our_files_bit_for_bit(tmp_path):
    tensors = sample_tensors()
    path = write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "pt", "note": "ü"})
    loaded = safetensors.torch.load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name
    with open(path, "rb") as file:
        header_len = struct.unpack("<Q", file.read(8))[0]
    assert (8 + header_len) % 8 == 0


def test_we_read_package_files_bit_for_bit(tmp_path):
    tensors = sample_tensors(1)
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    with SafetensorsFile(path) as file:
        assert file.metadata == {"format": "pt"}
        assert set(file.entries) == set(tensors)
        for name, tensor in file:
            assert same_bits(tensor, tensors[name]), name


def test_writer_is_deterministic_and_matches_the_package_byte_for_byte(tmp_path):
    tensors = sample_tensors(2)
    reversed_order = dict(reversed(list(tensors.items())))
    ours = write_safetensors(tmp_path / "a.safetensors", tensors, {"k": "v"}).read_bytes()
    again = write_safetensors(tmp_path / "b.safetensors", reversed_order, {"k": "v"}).read_bytes()
    safetensors.torch.save_file(tensors, tmp_path / "c.safetensors", metadata={"k": "v"})
    assert ours == again == (tmp_path / "c.safetensors").read_bytes()


def test_writer_stores_views_and_non_contiguous_tensors_by_value(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"transposed": base.t(), "slice": base[1:3, ::2], "tied_a": base, "tied_b": base}
    path = write_safetensors(tmp_path / "views.safetensors", tensors)
    with SafetensorsFile(path) as file:
        for name, tensor in tensors.items():
            assert torch.equal(file.get(name), tensor), name


# ---- reading API --------------------------------------------------------------------------------


def test_get_returns_a_fresh_tensor_each_time(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"w": torch.arange(6.0).reshape(2, 3)})
    with SafetensorsFile(path) as file:
        first = file.get("w")
        first.zero_()
        assert torch.equal(file.get("w"), torch.arange(6.0).reshape(2, 3))
        assert file.entries["w"] == st.TensorEntry("w", torch.float32, (2, 3), 0, 24)


@pytest.mark.parametrize("chunk_bytes", [2, 6, 64 * 1024 * 1024])
def test_read_into_converts_dtype_in_chunks(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(st, "CHUNK_BYTES", chunk_bytes)
    source = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)).bfloat16()
    path = write_safetensors(tmp_path / "x.safetensors", {"w": source})
    out = torch.full((7, 5), float("nan"), dtype=torch.float32)
    with SafetensorsFile(path) as file:
        assert file.read_into("w", out) is out
        assert torch.equal(out, source.float())
        strided = torch.zeros(5, 7).t()  # not contiguous: still filled correctly
        file.read_into("w", strided)
        assert torch.equal(strided, source.float())


def test_read_into_reads_bounded_chunks(tmp_path, monkeypatch):
    """A 1,000-element F32 tensor read with a 400-byte budget is read as 10 pieces of <= 400 bytes."""
    monkeypatch.setattr(st, "CHUNK_BYTES", 400)
    path = write_safetensors(tmp_path / "x.safetensors", {"w": torch.arange(1000.0)})
    sizes = []
    original = SafetensorsFile._read_exact

    def spy(self, offset, out):
        sizes.append(out.numel())
        return original(self, offset, out)

    monkeypatch.setattr(SafetensorsFile, "_read_exact", spy)
    out = torch.empty(1000, dtype=torch.float64)
    with SafetensorsFile(path) as file:
        file.read_into("w", out)
    assert sizes == [400] * 10
    assert torch.equal(out, torch.arange(1000.0, dtype=torch.float64))


def test_read_into_rejects_a_wrong_shape_naming_the_tensor(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(2, 3)})
    with SafetensorsFile(path) as file, pytest.raises(ValueError, match=r"'w' has shape \[2, 3\]"):
        file.read_into("w", torch.zeros(3, 2))


def test_unknown_name_is_a_value_error_naming_it(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(1)})
    with SafetensorsFile(path) as file, pytest.raises(ValueError, match="no tensor named 'nope'"):
        file.get("nope")


def test_iteration_yields_in_file_order_and_close_releases_the_file(tmp_path):
    tensors = {"b": torch.ones(2), "a": torch.zeros(3), "c": torch.full((1,), 7.0)}
    path = write_safetensors(tmp_path / "x.safetensors", tensors)
    with SafetensorsFile(path) as file:
        names = [name for name, _ in file.tensors()]
        assert names == ["a", "b", "c"] and len(file) == 3 and "a" in file
    assert file._file.closed


def test_zero_size_and_scalar_tensors(tmp_path):
    tensors = {"empty": torch.empty(0, 3, dtype=torch.bfloat16), "scalar": torch.tensor(5, dtype=torch.int16)}
    path = write_safetensors(tmp_path / "x.safetensors", tensors)
    with SafetensorsFile(path) as file:
        assert file.get("empty").shape == (0, 3)
        assert file.get("scalar").item() == 5
        file.read_into("empty", torch.empty(0, 3))


def test_file_shrinking_after_open_is_a_clean_error(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(100)})
    with SafetensorsFile(path) as file:
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size - 40)
        with pytest.raises(ValueError, match="ended early"):
            file.get("w")


# ---- writer safety ------------------------------------------------------------------------------


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_safetensors(tmp_path / "x.safetensors", {"w": torch.ones(3)})
    before = path.read_bytes()
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(path, {"w": torch.ones(3), "z": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="__metadata__"):
        write_safetensors(path, {"__metadata__": torch.ones(1)})
    with pytest.raises(ValueError, match="metadata"):
        write_safetensors(path, {"w": torch.ones(1)}, {"k": 3})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_interrupted_write_removes_its_temporary(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(st.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors(tmp_path / "x.safetensors", {"w": torch.ones(3)})
    assert list(tmp_path.iterdir()) == []


# ---- validation ---------------------------------------------------------------------------------

F32_4 = entry("F32", [4], 0, 16)
PAYLOAD = bytes(range(16))

BAD_FILES = {
    "file shorter than 8 bytes": (b"\x01\x00", None, None, "too short"),
    "header length 1": (b"{", b"", 1, "too small"),
    "header length above 100 MB": ({"w": F32_4}, PAYLOAD, 100_000_001, "100,000,000 byte limit"),
    "header length beyond the file": ({"w": F32_4}, PAYLOAD, 10_000, "runs past the end"),
    "invalid UTF-8": (b'{"\xff":1}', b"", None, "not valid UTF-8"),
    "invalid JSON": (b'{"w": ', b"", None, "not valid JSON"),
    "leading whitespace": (b' {"w":1}', b"", None, "does not start with"),
    "duplicate keys": (
        b'{"w":' + json.dumps(F32_4).encode() + b',"w":' + json.dumps(F32_4).encode() + b"}",
        PAYLOAD,
        None,
        "duplicate key 'w'",
    ),
    "integer with 5,000 digits": (
        b'{"w":{"dtype":"F32","shape":[1' + b"0" * 5000 + b'],"data_offsets":[0,4]}}',
        b"\0" * 4,
        None,
        "Exceeds the limit",
    ),
    "NaN constant": (b'{"w":NaN}', b"", None, "NaN"),
    "header is a list": (b"[1, 2]", b"", None, "does not start with"),
    "deep nesting": (
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"",
        None,
        "nested too deeply",
    ),
    "metadata not an object": (
        {"__metadata__": ["x"], "w": F32_4},
        PAYLOAD,
        None,
        "__metadata__ must be an object",
    ),
    "metadata value not a string": (
        {"__metadata__": {"k": 1}, "w": F32_4},
        PAYLOAD,
        None,
        r"__metadata__\['k'\]",
    ),
    "metadata null": ({"__metadata__": None, "w": F32_4}, PAYLOAD, None, "__metadata__ must be an object"),
    "entry not an object": ({"w": [1, 2]}, PAYLOAD, None, "entry must be an object"),
    "entry missing a key": (
        {"w": {"dtype": "F32", "shape": [4]}},
        PAYLOAD,
        None,
        r"missing \['data_offsets'\]",
    ),
    "entry with an extra key": ({"w": {**F32_4, "x": 1}}, PAYLOAD, None, r"extra \['x'\]"),
    "unknown dtype": ({"w": entry("F128", [1], 0, 16)}, PAYLOAD, None, "unknown dtype 'F128'"),
    "dtype not a string": ({"w": entry(4, [4], 0, 16)}, PAYLOAD, None, "unknown dtype 4"),
    "negative dimension": ({"w": entry("F32", [-4], 0, 16)}, PAYLOAD, None, "non-negative integers"),
    "float dimension": ({"w": entry("F32", [4.0], 0, 16)}, PAYLOAD, None, "non-negative integers"),
    "bool dimension": ({"w": entry("U8", [True], 0, 1)}, b"\x00", None, "non-negative integers"),
    "shape not a list": ({"w": entry("F32", 4, 0, 16)}, PAYLOAD, None, "shape must be a list"),
    "three offsets": (
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}},
        PAYLOAD,
        None,
        "two non-negative",
    ),
    "begin after end": ({"w": entry("F32", [0], 16, 0)}, PAYLOAD, None, "after end"),
    "byte count mismatch": ({"w": entry("F32", [3], 0, 16)}, PAYLOAD, None, "needs 12 bytes"),
    "huge shape": ({"w": entry("F32", [2**62, 2**62], 0, 16)}, PAYLOAD, None, "data_offsets span 16"),
    "overlap": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [3], 4, 16)}, PAYLOAD, None, "overlaps"),
    "gap": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [2], 8, 16)}, PAYLOAD, None, "gap"),
    "payload not covered": ({"w": entry("F32", [2], 0, 8)}, PAYLOAD, None, "belong to no tensor"),
    "truncated payload": ({"w": F32_4}, PAYLOAD[:10], None, r"file holds 10 \(truncated\?\)"),
    "zero-size tensor inside another": (
        {"a": F32_4, "z": entry("F32", [0], 8, 8)},
        PAYLOAD,
        None,
        "overlaps",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_a_value_error_naming_file_and_problem(tmp_path, case):
    header, payload, length, message = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    if payload is None:
        path.write_bytes(header)
    else:
        raw_file(path, header, payload, length)
    with pytest.raises(ValueError, match=message) as caught:
        SafetensorsFile(path)
    assert str(path) in str(caught.value)


def test_bool_bytes_other_than_zero_and_one_are_rejected(tmp_path):
    path = raw_file(tmp_path / "b.safetensors", {"b": entry("BOOL", [3], 0, 3)}, b"\x00\x01\x02")
    with SafetensorsFile(path) as file:
        with pytest.raises(ValueError, match="BOOL tensor 'b'"):
            file.get("b")
        with pytest.raises(ValueError, match="BOOL tensor 'b'"):
            file.read_into("b", torch.empty(3))


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot open"):
        SafetensorsFile(tmp_path / "absent.safetensors")


def test_hand_made_valid_file_with_padding_is_accepted(tmp_path):
    header = json.dumps({"w": F32_4, "__metadata__": {"a": "b"}}).encode() + b"     "
    with SafetensorsFile(raw_file(tmp_path / "ok.safetensors", header, PAYLOAD)) as file:
        assert file.get("w").view(torch.uint8).tolist() == list(PAYLOAD)


# ---- fuzz ---------------------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random corruption of a valid file: byte edits, truncation, insertion, or a header field edit."""
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    kind = rng.randrange(8)
    if kind == 0:  # flip bits in the length prefix or header
        position = rng.randrange(header_end)
        return data[:position] + bytes([data[position] ^ (1 << rng.randrange(8))]) + data[position + 1 :]
    if kind == 1:  # overwrite a header byte with a JSON-significant one
        position = rng.randrange(8, header_end)
        return (
            data[:position] + rng.choice(b'{}[],:"0123456789- ').to_bytes(1, "little") + data[position + 1 :]
        )
    if kind == 2:
        return data[: rng.randrange(len(data))]
    if kind == 3:
        position = rng.randrange(len(data) + 1)
        return data[:position] + rng.randbytes(rng.randrange(1, 9)) + data[position:]
    if kind == 4:
        start = rng.randrange(len(data))
        return data[:start] + data[start + rng.randrange(1, 9) :]
    if kind == 5:  # change the declared header length
        new_length = max(0, header_end - 8 + rng.choice([-9, -1, 1, 8, 2**20, 2**40]))
        return struct.pack("<Q", new_length) + data[8:]
    if kind == 6 and header_end < len(data):  # tensor bytes: always valid, must read back identically
        position = rng.randrange(header_end, len(data))
        return data[:position] + bytes([rng.randrange(256)]) + data[position + 1 :]
    return edit_header_field(data, header_end, rng)


def edit_header_field(data: bytes, header_end: int, rng: random.Random) -> bytes:
    """Parse the header, change one shape, offset or dtype, and re-encode it (payload unchanged)."""
    header = json.loads(data[8:header_end])
    name = rng.choice([key for key in header if key != "__metadata__"])
    field = rng.choice(["shape", "data_offsets", "dtype"])
    if field == "dtype":
        header[name]["dtype"] = rng.choice([*st.DTYPES, "F128", 7, None])
    else:
        values = header[name][field]
        if values and rng.random() < 0.8:
            values[rng.randrange(len(values))] += rng.choice([-1, 1, 2, -(2**31), 2**62])
        else:
            values.append(rng.choice([0, 1, 3]))
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data[header_end:]


def test_fuzzed_files_give_a_clean_error_or_the_reference_result(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a": random_tensor(torch.float32, (3, 2), generator),
        "b": random_tensor(torch.bfloat16, (5,), generator),
        "c": random_tensor(torch.uint8, (2, 2), generator),
        "d": random_tensor(torch.int64, (1,), generator),
        "e": torch.empty(0, dtype=torch.float16),
    }
    original = write_safetensors(tmp_path / "valid.safetensors", tensors, {"m": "x"}).read_bytes()
    rng = random.Random(1234)
    outcomes = {"rejected": 0, "accepted": 0}
    for trial in range(3000):
        data = mutate(original, rng)
        path = tmp_path / f"fuzz{trial}.safetensors"  # a new file each time: rewriting one forces flushes
        path.write_bytes(data)
        try:
            with SafetensorsFile(path) as file:
                ours = dict(file.tensors())
        except ValueError as error:
            assert str(path) in str(error), f"trial {trial}: {error}"
            outcomes["rejected"] += 1
            continue
        finally:
            path.unlink()
        reference = safetensors.torch.load(data)  # we accepted: the reference must agree on every bit
        assert set(ours) == set(reference), f"trial {trial}"
        for name in ours:
            assert same_bits(ours[name], reference[name]), f"trial {trial}: {name}"
        outcomes["accepted"] += 1
    assert outcomes["rejected"] > 1000 and outcomes["accepted"] > 200, outcomes
