"""Durable writes: a file is either all there or not there at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or creation inside `directory` survive a crash."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def write_synced(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` to `path` and fsync it (no rename: for files inside a staging directory)."""
    with open(path, "wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` only once it is complete and fsynced.

    The temporary file sits beside `path` (same filesystem, so the rename is atomic) and is removed
    if anything fails on the way.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from other users
        with os.fdopen(handle, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace `path` with `data` (text is UTF-8) atomically."""
    with atomic_writer(path) as file:
        file.write(data.encode() if isinstance(data, str) else data)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
