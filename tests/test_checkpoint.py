"""Checkpoint directories: atomic write, manifest verification, fallback, pruning, full disk."""

import errno
import logging
import pickle
from pathlib import Path

import pytest
import torch

from octlm import checkpoint as ckpt


def save(root: Path, step: int, keep: int = 3) -> Path:
    tensors = {"model.safetensors": {"w": torch.full((4, 3), float(step)), "b": torch.arange(3.0)}}
    return ckpt.save_checkpoint(root, step, tensors, {"state.json": {"step": step}}, keep=keep)


def test_round_trip_and_manifest_lists_every_file(tmp_path):
    source = tmp_path / "tokenizer.json"
    source.write_text('{"vocab": 1}')
    path = ckpt.save_checkpoint(
        tmp_path / "ck",
        7,
        {"model.safetensors": {"w": torch.eye(3)}},
        {"state.json": {"step": 7, "rng": "abc"}},
        copies={"tokenizer.json": source},
    )
    assert path.name == "step_000007"
    found = ckpt.open_checkpoint(path)
    assert found.step == 7
    assert set(found.manifest["files"]) == {"model.safetensors", "state.json", "tokenizer.json"}
    assert torch.equal(found.tensors("model.safetensors")["w"], torch.eye(3))
    assert found.json("state.json") == {"step": 7, "rng": "abc"}
    assert (path / "tokenizer.json").read_text() == '{"vocab": 1}'


def test_keeps_only_the_newest_k(tmp_path):
    for step in (1, 2, 3, 10, 100):
        save(tmp_path, step, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000010", "step_000100"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save(tmp_path, 5)
    ckpt.save_checkpoint(tmp_path, 5, {"model.safetensors": {"w": torch.zeros(2)}}, {"state.json": {}})
    found = ckpt.open_checkpoint(tmp_path / "step_000005")
    assert list(found.tensors("model.safetensors")) == ["w"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-4]),
            "truncated",
        ),
        (lambda p: (p / "state.json").write_text('{"step": 2}'), "truncated|corrupt"),
        (lambda p: (p / "model.safetensors").unlink(), "missing"),
        (lambda p: (p / "manifest.json").unlink(), "not a finished checkpoint"),
        (lambda p: (p / "manifest.json").write_text("{"), "unreadable"),
    ],
)
def test_damaged_checkpoint_is_rejected_naming_the_file(tmp_path, damage, message):
    path = save(tmp_path, 2)
    damage(path)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.open_checkpoint(path)


def test_flipped_byte_is_caught(tmp_path):
    path = save(tmp_path, 2)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors: SHA-256 differs"):
        ckpt.open_checkpoint(path)


def test_latest_falls_back_to_the_previous_valid_one(tmp_path, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    newest = save(tmp_path, 3)
    (newest / "model.safetensors").write_bytes(b"\0" * 10)
    with caplog.at_level(logging.WARNING):
        found = ckpt.latest_checkpoint(tmp_path)
    assert found.step == 2
    assert "skipping checkpoint step_000003" in caplog.text


def test_latest_is_none_without_checkpoints_and_an_error_when_none_verifies(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path / "absent") is None
    path = save(tmp_path, 1)
    (path / "state.json").write_text("[]")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint .* verifies"):
        ckpt.latest_checkpoint(tmp_path)


def test_full_disk_leaves_no_partial_directory_and_earlier_checkpoints_intact(tmp_path, monkeypatch):
    earlier = save(tmp_path, 1)
    real_write = ckpt.write_safetensors

    def write_half_then_fail(path, tensors, metadata=None):
        real_write(path, tensors, metadata)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "write_safetensors", write_half_then_fail)
    with pytest.raises(ckpt.CheckpointError, match="No space left on device.*earlier checkpoints are intact"):
        save(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]
    assert ckpt.open_checkpoint(earlier).step == 1


def test_full_disk_while_writing_the_manifest(tmp_path, monkeypatch):
    save(tmp_path, 1)
    real_write = ckpt.write_synced

    def fail_on_manifest(path, data):
        if path.name == ckpt.MANIFEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(ckpt, "write_synced", fail_on_manifest)
    with pytest.raises(ckpt.CheckpointError, match="No space left"):
        save(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000001"]


def test_leftover_temporary_directories_are_ignored_and_cleaned(tmp_path):
    save(tmp_path, 1)
    stale = tmp_path / ".tmp_step_000002_999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000001"]
    ckpt.clean_temporaries(tmp_path)
    assert not stale.exists() and (tmp_path / "step_000001").exists()


def test_loading_never_unpickles(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint load path unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    found = ckpt.latest_checkpoint(tmp_path)
    assert found.json("state.json") == {"step": 1}
    assert torch.equal(found.tensors("model.safetensors")["w"], torch.full((4, 3), 1.0))
