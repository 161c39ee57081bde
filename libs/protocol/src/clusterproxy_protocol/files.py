"""Writing files so that a reader sees either the old content or the new, never a half-written one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_temp(path: Path, data: bytes, mode: int) -> str:
    """A synced temporary file beside ``path`` holding ``data`` with ``mode``, for the caller to
    ``os.replace`` onto ``path`` (several files can then be renamed one right after the other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` through a synced temporary file and ``os.replace``."""
    tmp = write_temp(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
