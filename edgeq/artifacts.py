"""Writing results so that a crash never leaves a half-written file that looks valid.

Every file goes to a temporary name in the same folder and is renamed into place only
once it is complete. Manifests and run records carry a sha256 and what made them.
TF-free: the device side uses it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgeq import __version__


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 of a file, or of every file below a folder (SavedModel dirs)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it into place on success only.

    The suffix of ``final`` is kept on the temporary name, because some writers (Keras)
    pick the format from it.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{final.name}.", suffix=suffix if suffix is not None else "".join(final.suffixes), dir=final.parent
    )
    os.close(fd)
    tmp_path = Path(tmp)
    tmp_path.unlink()  # writers create it themselves; some refuse an existing file
    try:
        yield tmp_path
        _fsync(tmp_path)  # the data is on disk before the name points at it
        os.replace(tmp_path, final)
        _fsync_entries(final.parent)  # and the rename itself survives a power cut
    finally:
        if tmp_path.exists():
            if tmp_path.is_dir():
                import shutil

                shutil.rmtree(tmp_path, ignore_errors=True)
            else:
                tmp_path.unlink()


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (a ``.lock`` file beside it) across processes: two
    ``edgeq push`` runs, or two test workers, that fill one cache folder take turns. Blocks until
    the other is done; where the OS has no ``fcntl`` it only orders this process's threads."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the callers' thread locks still hold
        yield
        return
    lock = Path(f"{os.fspath(folder).rstrip(os.sep)}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a folder's own entries (POSIX: a rename in it survives a power cut)."""
    path = Path(path)
    if path.is_dir():
        _fsync_entries(path)
    else:
        _fsync(path)


def _fsync_entries(path: Path) -> None:
    """fsync one file, or a folder itself (its list of names), not the files in it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a directory on Windows: nothing to sync there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    """fsync a file, or a folder written by Keras file by file and then itself."""
    paths = [path] if not path.is_dir() else [*sorted(p for p in path.rglob("*") if p.is_file()), path]
    for p in paths:
        _fsync_entries(p)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(extra_dists: tuple[str, ...] = ()) -> dict[str, Any]:
    """What made an artifact: edgeq, Python, platform and library versions."""
    dists = ("numpy", "tensorflow", "tf-keras", "tensorflow-model-optimization", "ai-edge-litert") + extra_dists
    return {
        "edgeq": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "versions": {d: v for d in dists if (v := _version(d)) is not None},
        "command": command_line(),
    }


def command_line() -> str | None:
    """The edgeq command that is running (None when edgeq is used as a library)."""
    if not sys.argv or Path(sys.argv[0]).name not in ("edgeq", "__main__.py"):
        return None
    return shlex.join(["edgeq", *sys.argv[1:]])
