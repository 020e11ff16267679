"""What a device has (``Probe``: Python, platform, runtime, wheels it can take) and what edgeq pins."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import edgeq
from edgeq.errors import DeviceError
from edgeq.fleet.transport import Transport

PROBE_SCRIPT = Path(__file__).with_name("_probe.py")


BASE_REQUIREMENTS = ("numpy", "click", "ai-edge-litert")


VENV_REQUIREMENTS = (*BASE_REQUIREMENTS, "pip")  # offline venvs: pip's wheel too (see ensure_runtime)


@dataclass(frozen=True)
class Probe:
    """What ``edgeq devices check`` reports about a device."""

    machine: str
    system: str
    os: str
    python: str
    python_tag: str
    executable: str
    glibc: str
    numpy: str | None
    click: str | None
    runtime: str | None
    runtime_version: str | None
    edgeq: str | None
    free_bytes: int | None
    edgetpu_library: str | None
    edgetpu_devices: tuple[str, ...]
    pip: bool
    venv: bool
    listed: dict = field(default_factory=dict)  # {folder: {file name: size}} of the folders it was asked to list

    @property
    def edgetpu(self) -> str:
        if self.edgetpu_devices and self.edgetpu_library:
            return "yes"
        if self.edgetpu_devices:
            return "device, no libedgetpu"
        if self.edgetpu_library:
            return "libedgetpu, no device"
        return "no"

    def drift(self, host: dict[str, str | None]) -> list[str]:
        """Where the device's edgeq, numpy and LiteRT differ from ``host`` (host_versions())."""
        found = []
        for name, mine in (("edgeq", self.edgeq), ("numpy", self.numpy)):
            if mine != host.get(name):
                found.append(f"{name} {mine or 'none'} (host {host.get(name) or 'none'})")
        runtime = f"{self.runtime} {self.runtime_version}" if self.runtime else "none"
        if runtime != host.get("runtime"):
            found.append(f"runtime {runtime} (host {host.get('runtime') or 'none'})")
        return found

    @property
    def missing(self) -> list[str]:
        return [
            name
            for name, have in (("numpy", self.numpy), ("click", self.click), ("ai-edge-litert", self.runtime))
            if not have
        ]


@dataclass(frozen=True)
class DeviceRuntime:
    """How to run edgeq on a device after the bootstrap."""

    python: str
    env: dict[str, str] = field(default_factory=dict)
    mode: str = "site"  # "site" | "venv"
    installed: str = "unchanged"  # "installed" | "unchanged"
    workdir: str = ""

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "edgeq", *args]


def host_versions() -> dict[str, str | None]:
    """This host's edgeq, numpy and LiteRT, as a device should have them (devices check compares)."""
    from importlib.metadata import PackageNotFoundError, version

    def dist(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    litert = dist("ai-edge-litert")
    runtime = f"ai_edge_litert {litert}" if litert else None
    return {"edgeq": edgeq.__version__, "numpy": dist("numpy"), "runtime": runtime}


def pinned(requirements) -> list[str]:
    """``requirements`` at this host's versions where it has them (numpy==2.4.6, ...): a device
    then runs what the host verified against."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in requirements:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def probe(
    transport: Transport, python: str | None = None, env: dict[str, str] | None = None, prepare: tuple = ()
) -> Probe:
    """Run the stand-alone probe with the device's python and parse its JSON. ``prepare``:
    the probe's --remove/--mkdir/--list arguments, done in the same start-up."""
    device = transport.device
    python = python or device.python
    source = PROBE_SCRIPT.read_text(encoding="utf-8")
    result = transport.run([python, "-c", source, device.workdir, *prepare], env=env, timeout=120)
    if not result.ok:
        raise DeviceError(f"{device.name}: {python} does not run: {result.last_error_line()}")
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DeviceError(f"{device.name}: the probe printed no JSON: {result.stdout[:200]!r}") from exc
    tpu = data.pop("edgetpu", {}) or {}
    return Probe(edgetpu_library=tpu.get("library"), edgetpu_devices=tuple(tpu.get("devices") or ()), **data)
