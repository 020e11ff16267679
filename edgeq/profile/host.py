"""The machine a profile runs on: CPU, environment, temperature and throttling, memory."""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from edgeq import __version__
from edgeq.profile.results import Environment, ThermalState


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return None


def cpu_model() -> str:
    """A human name for the CPU: x86 'model name', a Raspberry Pi's board model, or the arch."""
    board = _read("/sys/firmware/devicetree/base/model")
    info = _read("/proc/cpuinfo") or ""
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    for key in ("model name", "model", "hardware", "cpu model", "processor"):
        value = fields.get(key)
        if value and not value.isdigit():
            return f"{value} ({board.rstrip(chr(0))})" if board and key != "model" else value
    if board:
        return board.rstrip("\x00")
    part = fields.get("cpu part")
    return f"{platform.machine()} CPU part {part}" if part else (platform.processor() or platform.machine())


def collect_environment(runtime: str, runtime_version: str) -> Environment:
    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        available = os.cpu_count() or 1
    temp = _read("/sys/class/thermal/thermal_zone0/temp")
    return Environment(
        cpu_model=cpu_model(),
        machine=platform.machine(),
        cores=os.cpu_count() or 1,
        cores_available=available,
        governor=_read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
        temperature_c=round(int(temp) / 1000, 1) if temp and temp.lstrip("-").isdigit() else None,
        os=platform.platform(),
        python=platform.python_version(),
        numpy_version=np.__version__,
        runtime=runtime,
        runtime_version=runtime_version,
        edgeq_version=__version__,
        hostname=platform.node(),
    )


def _sysfs() -> Path:
    return Path(os.environ.get("EDGEQ_SYSFS", "/sys"))


def thermal_state() -> ThermalState:
    """Temperature (hottest zone), cpu0 frequency and, on a Raspberry Pi, the firmware's throttle flags."""
    temps = []
    for zone in sorted((_sysfs() / "class" / "thermal").glob("thermal_zone*/temp")):
        text = _read(str(zone))
        if text and text.lstrip("-").isdigit():
            temps.append(int(text) / 1000)
    freq = _read(str(_sysfs() / "devices" / "system" / "cpu" / "cpu0" / "cpufreq" / "scaling_cur_freq"))
    throttled = None
    vcgencmd = shutil.which("vcgencmd")
    if vcgencmd:
        try:
            out = subprocess.run([vcgencmd, "get_throttled"], capture_output=True, text=True, timeout=10).stdout
            throttled = out.strip().partition("=")[2] or None  # "throttled=0x50005"
        except (OSError, subprocess.SubprocessError):
            throttled = None
    return ThermalState(
        temperature_c=round(max(temps), 1) if temps else None,
        cpu_mhz=round(int(freq) / 1000, 1) if freq and freq.isdigit() else None,
        throttled=throttled,
    )


# vcgencmd get_throttled: bit 1 ARM frequency capped, bit 2 throttled, bit 3 soft temperature limit
# (now); bits 17, 18, 19 the same "has occurred since boot".
_THROTTLE_NOW, _THROTTLE_SINCE_BOOT = 0b1110, 0b1110 << 16


def throttled_between(before: ThermalState, after: ThermalState) -> bool | None:
    """True when the firmware capped or throttled the CPU between the two readings."""
    if before.throttled is None or after.throttled is None:
        return None
    try:
        first, last = int(before.throttled, 16), int(after.throttled, 16)
    except ValueError:
        return None
    new_since_boot = (last & _THROTTLE_SINCE_BOOT) & ~(first & _THROTTLE_SINCE_BOOT)
    return bool(last & _THROTTLE_NOW or new_since_boot)


def _status_mb(key: str) -> float | None:
    status = _read("/proc/self/status")
    if status:
        for line in status.splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    return None


def current_rss_mb() -> float:
    value = _status_mb("VmRSS")
    return round(value, 1) if value is not None else peak_rss_mb()


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM, else getrusage) in MiB."""
    value = _status_mb("VmHWM")
    if value is None:
        raw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        value = raw / (1024 * 1024) if sys.platform == "darwin" else raw / 1024
    return round(value, 1)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False
