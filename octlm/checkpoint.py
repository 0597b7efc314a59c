"""Atomic, verifiable checkpoint directories: tensors in safetensors, everything else in JSON.

A checkpoint is a directory `step_000100/` holding safetensors files, JSON files, copied files (the
tokenizer) and, written last, `manifest.json` with every file's size and SHA-256. The directory is
built under a temporary name, each file fsynced, then renamed into place, so a reader sees either a
complete checkpoint or none. Nothing on the load path unpickles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from octlm.files import fsync_dir, write_synced
from octlm.safetensors import SafetensorsFile, write_safetensors

FORMAT = "octlm-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
TEMP_PREFIX = ".tmp_"

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, verified or read; the message names the file and the problem."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint belongs to another model config, tokenizer or data set."""


@dataclass
class Checkpoint:
    """A verified checkpoint directory: its step, manifest and the parsed JSON files."""

    path: Path
    step: int
    manifest: dict

    def json(self, name: str) -> dict:
        """One JSON file of the checkpoint, parsed (no pickle anywhere)."""
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{self.path / name}: cannot read JSON: {error}") from error

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Every tensor of one safetensors file of the checkpoint, on the CPU."""
        try:
            with SafetensorsFile(self.path / name) as file:
                return dict(file.tensors())
        except ValueError as error:
            raise CheckpointError(str(error)) from error


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    json_files: Mapping[str, dict],
    copies: Mapping[str, str | os.PathLike] | None = None,
    keep: int = 3,
) -> Path:
    """Write root/step_NNNNNN atomically and keep only the newest `keep` step directories.

    `tensors` maps a file name to the tensors it holds, `json_files` a file name to its content,
    `copies` a file name to a file copied in. On any failure (a full disk included) the temporary
    directory is removed, earlier checkpoints are untouched, and a CheckpointError says what failed.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    temp = root / f"{TEMP_PREFIX}{final.name}_{os.getpid()}"
    try:
        _write_contents(temp, step, tensors, json_files, copies or {})
        _replace_dir(temp, final)
    except OSError as error:
        shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointError(
            f"writing checkpoint {final} failed ({error}); the partial directory was removed and "
            f"earlier checkpoints are intact"
        ) from error
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def _write_contents(temp: Path, step: int, tensors, json_files, copies) -> None:
    """Fill `temp` with every file, each fsynced, then the manifest last."""
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    for name, named_tensors in tensors.items():
        write_safetensors(temp / name, named_tensors, {"format": FORMAT})
    for name, content in json_files.items():
        write_synced(temp / name, json.dumps(content, indent=1, sort_keys=True).encode())
    for name, source in copies.items():
        write_synced(temp / name, Path(source).read_bytes())
    files = {path.name: _describe(path) for path in sorted(temp.iterdir())}
    manifest = {"format": FORMAT, "step": step, "files": files}
    write_synced(temp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(temp)


def _replace_dir(temp: Path, final: Path) -> None:
    """Rename temp to final; an existing final (the same step saved again) is swapped out first."""
    if final.exists():
        old = final.with_name(f"{TEMP_PREFIX}old_{final.name}_{os.getpid()}")
        os.replace(final, old)
        os.replace(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temp, final)
    fsync_dir(final.parent)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` step directories."""
    for old in list_checkpoints(root)[: -max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)


def clean_temporaries(root: str | os.PathLike) -> None:
    """Remove temporary directories a killed writer left behind (never a finished step directory)."""
    root = Path(root)
    if root.is_dir():
        for path in root.glob(f"{TEMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Step directories under root, oldest first (unverified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.is_dir() and STEP_DIR.match(path.name)]
    return sorted(found, key=lambda path: int(STEP_DIR.match(path.name).group(1)))


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Verify every file of a checkpoint directory against its manifest; raise CheckpointError naming
    the first missing, truncated or altered file."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (not a finished checkpoint)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: format is not {FORMAT!r}")
    for name, expected in manifest["files"].items():
        _verify_file(path / name, expected)
    return Checkpoint(path=path, step=int(manifest["step"]), manifest=manifest)


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint under root (a checkpoints folder, or a run folder holding one) that
    verifies, warning about each newer one that does not.

    None when root holds no step directory at all; a CheckpointError when there are some and none
    verifies (resuming from scratch then would silently throw the run away).
    """
    root = Path(root)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    candidates = list_checkpoints(root)
    problems = []
    for path in reversed(candidates):
        try:
            return open_checkpoint(path)
        except CheckpointError as error:
            log.warning("skipping checkpoint %s: %s; falling back to the previous one", path.name, error)
            problems.append(str(error))
    if candidates:
        raise CheckpointError(f"no checkpoint under {root} verifies: " + "; ".join(problems))
    return None


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_file(path: Path, expected: dict) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: listed in the manifest but missing")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path}: {size:,} bytes, manifest says {expected['bytes']:,} (truncated?)")
    if file_sha256(path) != expected["sha256"]:
        raise CheckpointError(f"{path}: SHA-256 differs from the manifest (corrupt)")


def _describe(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
