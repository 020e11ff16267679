"""Health pre-checks before push and profile: a device that would fail or mislead is skipped
with the reason, before anything is uploaded or timed.

One ``sh`` command reads what the device has (no Python, no edgeq needed yet): free disk at
the work directory, the hottest thermal zone (``/sys/class/thermal``, or ``$EDGEQ_SYSFS`` as
profile reads it), the Raspberry Pi firmware's throttle flags (``vcgencmd get_throttled``
when present), the 1-minute load and the number of CPUs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edgeq.errors import DeviceError
from edgeq.fleet.transport import Transport

MIB = 1024 * 1024
# vcgencmd get_throttled, now: bit 0 under-voltage, 1 ARM frequency capped, 2 throttled, 3 soft temperature limit
THROTTLED_NOW = 0b1111

# The health values, as sh lines; ``$dir`` is the work directory (edgeq.fleet.state runs them too).
HEALTH_LINES = r"""
while [ ! -d "$dir" ] && [ "$dir" != / ] && [ -n "$dir" ]; do dir=$(dirname "$dir"); done
printf 'free_kb=%s\n' "$(df -Pk "$dir" 2>/dev/null | awk 'NR==2 {print $4}')"
root="${EDGEQ_SYSFS:-/sys}"
hottest=""
for zone in "$root"/class/thermal/thermal_zone*/temp; do
  [ -r "$zone" ] || continue
  value=$(cat "$zone" 2>/dev/null) || continue
  case "$value" in ''|*[!0-9-]*) continue ;; esac
  if [ -z "$hottest" ] || [ "$value" -gt "$hottest" ]; then hottest=$value; fi
done
printf 'temp_milli_c=%s\n' "$hottest"
if command -v vcgencmd >/dev/null 2>&1; then
  printf 'throttled=%s\n' "$(vcgencmd get_throttled 2>/dev/null | cut -d= -f2)"
fi
printf 'load1=%s\n' "$(cut -d' ' -f1 /proc/loadavg 2>/dev/null)"
printf 'cpus=%s\n' "$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc 2>/dev/null)"
"""
_SCRIPT = 'dir="$1"' + HEALTH_LINES


class DeviceUnhealthy(DeviceError):
    """A pre-check failed: the device is skipped, with the reason."""


@dataclass(frozen=True)
class HealthLimits:
    min_free_mib: float = 64.0  # and at least twice what the push uploads
    max_temperature_c: float = 80.0
    allow_throttled: bool = False
    max_load_per_cpu: float | None = None  # profile: a busy device times someone else's work


@dataclass(frozen=True)
class Health:
    free_mib: float | None
    temperature_c: float | None
    throttled: str | None
    load_per_cpu: float | None

    def to_dict(self) -> dict:
        return asdict(self)

    def problems(self, limits: HealthLimits, need_bytes: int = 0) -> list[str]:
        found = []
        need_mib = max(limits.min_free_mib, 2 * need_bytes / MIB)
        if self.free_mib is not None and self.free_mib < need_mib:
            found.append(f"{self.free_mib:.0f} MiB free in the work directory, needs {need_mib:.0f}")
        if self.temperature_c is not None and self.temperature_c > limits.max_temperature_c:
            found.append(f"{self.temperature_c:.1f} °C, over {limits.max_temperature_c:.0f} °C")
        if not limits.allow_throttled and self.throttled:
            try:
                flags = int(self.throttled, 16)
            except ValueError:
                flags = 0
            if flags & THROTTLED_NOW:
                found.append(f"throttled now (vcgencmd get_throttled: {self.throttled})")
        if (
            limits.max_load_per_cpu is not None
            and self.load_per_cpu is not None
            and self.load_per_cpu > limits.max_load_per_cpu
        ):
            found.append(f"load {self.load_per_cpu:.2f} per CPU, over {limits.max_load_per_cpu:g}")
        return found


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def read_health(transport: Transport, workdir: str) -> Health:
    result = transport.run(["sh", "-c", _SCRIPT, "edgeq-health", workdir], timeout=60)
    return health_from(dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line))


def health_from(values: dict[str, str]) -> Health:
    """Health from the ``key=value`` lines HEALTH_LINES prints."""
    free_kb, milli_c = _number(values.get("free_kb")), _number(values.get("temp_milli_c"))
    load, cpus = _number(values.get("load1")), _number(values.get("cpus"))
    return Health(
        free_mib=None if free_kb is None else round(free_kb / 1024, 1),
        temperature_c=None if milli_c is None else round(milli_c / 1000, 1),
        throttled=values.get("throttled") or None,
        load_per_cpu=None if load is None or not cpus else round(load / cpus, 2),
    )


def check_health(
    transport: Transport, workdir: str, limits: HealthLimits, need_bytes: int = 0, health: Health | None = None
) -> Health:
    """The device's health (read now, unless ``health`` was read already), or DeviceUnhealthy
    naming every limit it is over."""
    health = health or read_health(transport, workdir)
    problems = health.problems(limits, need_bytes)
    if problems:
        raise DeviceUnhealthy(f"{transport.device.name}: skipped by the health check: {'; '.join(problems)}")
    return health
