"""The wheels a device installs from: edgeq built from this checkout, dependencies downloaded once."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import edgeq
from edgeq.artifacts import atomic_path, folder_lock
from edgeq.errors import DeviceError
from edgeq.fleet.probe import Probe, pinned

log = logging.getLogger(__name__)


WHEEL_CACHE = Path(os.environ.get("EDGEQ_WHEEL_CACHE", "~/.cache/edgeq/wheels")).expanduser()


def _source_root() -> Path:
    root = Path(edgeq.__file__).resolve().parents[1]
    if not (root / "setup.py").is_file():
        raise DeviceError(
            f"edgeq runs from {root}, not from a checkout with setup.py: build a wheel "
            "(pip wheel --no-deps .) and pass it with --wheel PATH"
        )
    return root


def _source_hash(root: Path) -> str:
    digest = hashlib.sha256()
    names = ["setup.py", "pyproject.toml", "README.md"]
    files = [root / n for n in names if (root / n).is_file()]
    for folder in ("edgeq",):
        files += sorted(
            p for p in (root / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


_BUILD_LOCK = threading.Lock()


def build_wheel(root: Path | None = None) -> Path:
    """The edgeq wheel of this checkout, built once per source state and cached.

    Devices bootstrap in parallel threads: one builds, the others wait for it; the cached
    file appears atomically, so no reader ever sees half a wheel.
    """
    root = root or _source_root()
    with _BUILD_LOCK, folder_lock(WHEEL_CACHE / ".build"):  # and another process building it
        return _build_wheel(root)


KEEP_SOURCE_BUILDS = 4  # edgeq-src-* folders kept in the wheel cache, most recently used first


def _build_wheel(root: Path) -> Path:
    out = WHEEL_CACHE / f"edgeq-src-{_source_hash(root)}"
    found = sorted(out.glob("edgeq-*.whl"))
    if found:
        os.utime(out)  # used now: the pruning below keeps the most recently used builds
        return found[0]
    with tempfile.TemporaryDirectory(prefix="edgeq-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("setup.py", "pyproject.toml", "README.md"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in ("edgeq",):
            if (root / name).is_dir():
                shutil.copytree(root / name, src / name, ignore=ignore)
        dist = Path(tmp) / "dist"
        base = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist)]
        proc = subprocess.run([*base, "--no-build-isolation", str(src)], capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:  # no setuptools/wheel here: let pip fetch a build backend
            proc = subprocess.run([*base, str(src)], capture_output=True, text=True, cwd=tmp)
        wheels = sorted(dist.glob("edgeq-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DeviceError(f"cannot build the edgeq wheel from {root}: {(proc.stderr or proc.stdout)[-400:]}")
        final = out / wheels[0].name
        with atomic_path(final) as part:
            shutil.copy2(wheels[0], part)
    log.info("built %s", final)
    _prune_source_builds(out)
    return final


def _prune_source_builds(current: Path) -> None:
    """One wheel per source state would pile up with every edit of a checkout: only the
    KEEP_SOURCE_BUILDS most recently used stay (the one just built among them)."""
    builds = [p for p in WHEEL_CACHE.glob("edgeq-src-*") if p.is_dir() and p != current]
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[KEEP_SOURCE_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _platform_tags(info: Probe) -> list[str]:
    arch = info.machine
    tags = []
    glibc = info.glibc.split("-")[-1] if info.glibc.startswith("glibc") else ""
    try:
        major, minor = (int(p) for p in glibc.split(".")[:2])
    except ValueError:
        major, minor = 2, 17
    for m in range(17, minor + 1) if major == 2 else [17]:
        tags.append(f"manylinux_2_{m}_{arch}")
    tags.append(f"manylinux2014_{arch}")
    return tags


_COMPLETE = ".complete"  # in a wheel cache folder: the wheels one pip download left there


_DOWNLOAD_LOCKS: dict[str, threading.Lock] = {}


def _keyed_lock(locks: dict[str, threading.Lock], key: str) -> threading.Lock:
    """The one lock of ``key`` in ``locks``, made on first use (device threads share it)."""
    with _BUILD_LOCK:
        return locks.setdefault(key, threading.Lock())


def download_wheels(info: Probe, requirements: list[str], dest: Path) -> list[Path]:
    """Wheels of ``requirements`` for the device's platform and Python, fetched here once.

    A folder a download completed is reused without running pip again (one pip per
    platform and version set, not one per device of a fleet); devices in parallel threads
    wait for the one that downloads.
    """
    with _keyed_lock(_DOWNLOAD_LOCKS, str(dest)), folder_lock(dest):
        done = dest / _COMPLETE
        if done.is_file():
            found = [dest / name for name in done.read_text(encoding="utf-8").split()]
            if found and all(p.is_file() for p in found):
                return found
        wheels = _download_wheels(info, requirements, dest)
        with atomic_path(done) as part:
            part.write_text("\n".join(p.name for p in wheels) + "\n", encoding="utf-8")
        return wheels


def _download_wheels(info: Probe, requirements: list[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(dest)]
    args += ["--python-version", info.python_tag, "--implementation", "cp"]
    for tag in _platform_tags(info):
        args += ["--platform", tag]
    proc = subprocess.run([*args, *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DeviceError(
            f"cannot download wheels of {', '.join(requirements)} for {info.machine} / Python {info.python_tag}: "
            f"{(proc.stderr or proc.stdout).strip()[-300:]}"
        )
    return sorted(dest.glob("*.whl"))


def _dependency_wheels(info: Probe, requirements, wheels_dir: str | Path | None) -> list[Path]:
    """Wheels for a device without internet: from --wheels DIR, else downloaded here."""
    if wheels_dir:
        found = sorted(Path(wheels_dir).glob("*.whl"))
        if not found:
            raise DeviceError(f"{wheels_dir}: no .whl files in it")
        return found
    tag = f"{info.machine}-cp{info.python_tag.replace('.', '')}"
    pins = pinned(requirements)
    key = hashlib.sha256(" ".join(sorted(pins)).encode()).hexdigest()[:10]
    try:  # the host's versions, each set in its own cache folder so that only those are pushed
        return download_wheels(info, pins, WHEEL_CACHE / f"deps-{tag}-{key}")
    except DeviceError as exc:  # e.g. an older Python with no wheel of the host's numpy
        log.warning("%s; taking the newest versions that fit (devices check shows the drift)", exc)
        return download_wheels(info, list(requirements), WHEEL_CACHE / f"deps-{tag}")
