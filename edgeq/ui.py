"""What the commands show a person: tables, sizes, times, JSON files, device options and progress.

Device-side commands (``profile``, ``inspect``) use it too: it imports click only.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click


def fmt(value, digits: int = 4) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence], numbers: bool = False) -> str:
    """Aligned columns.

    Default: every column left-aligned under a rule of dashes (results of host commands).
    ``numbers=True``: the first column left-aligned, the rest right-aligned, no rule
    (measurements, device lists).
    """
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if numbers:
        lines = []
        for row in [list(headers), *cells]:
            aligned = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(aligned).rstrip())
        return "\n".join(lines)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def ms(value: float) -> str:
    if value < 1:
        return f"{value:.4f}"
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def write_json_output(data: dict[str, Any], path: str | Path) -> None:
    """A command's --json file, written atomically, and the line that says where."""
    from edgeq.artifacts import write_json_atomic

    write_json_atomic(path, data)
    click.echo(f"wrote {path}")


# Options and helpers of the commands that reach devices (devices, push, profile --on, verify).


_INVENTORY_HELP = "devices.toml or Ansible YAML (default: $EDGEQ_INVENTORY, else ./devices.toml)."


def inventory_option(f=None, help: str = _INVENTORY_HELP):
    option = click.option("--inventory", "-i", "inventory_path", metavar="PATH", help=help)
    return option(f) if f is not None else option


def host_key_option(
    f=None,
    help: str = "Record the host key of a device seen for the first time (like ssh accept-new); "
    "a changed key is still refused.",
):
    option = click.option("--accept-new-host-keys", is_flag=True, help=help)
    return option(f) if f is not None else option


def rollout_options(f):
    """--parallel, --batch and --max-fail, handed to the command as one ``rollout`` (fleet.rollout.Rollout)."""

    @functools.wraps(f)
    def command(*args, parallel, batch, max_fail, **kwargs):
        from edgeq.fleet.rollout import Rollout

        return f(*args, rollout=Rollout(parallel, batch, max_fail), **kwargs)

    options = [
        click.option(
            "--parallel", "-j", default=4, show_default=True, type=click.IntRange(1, 64), help="Devices at once."
        ),
        click.option("--batch", metavar="N|P%", help="Go through the devices in batches of this size (default: one)."),
        click.option(
            "--max-fail",
            metavar="N|P%",
            help="Stop the rollout once more devices than this have failed; the devices not started are not "
            "touched. Without --batch, no more devices run at once than this plus one.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def health_options(f):
    """--health-check/--no-health-check, --max-temp, --max-load, --min-free: handed to the command as
    one ``health`` (fleet.health.HealthLimits, or None when the check is off)."""

    @functools.wraps(f)
    def command(*args, health_check, max_temp, max_load, min_free, **kwargs):
        from edgeq.fleet.health import HealthLimits

        limits = HealthLimits(min_free_mib=min_free, max_temperature_c=max_temp, max_load_per_cpu=max_load)
        return f(*args, health=limits if health_check else None, **kwargs)

    options = [
        click.option(
            "--health-check/--no-health-check",
            default=True,
            show_default=True,
            help="Before anything is uploaded, skip (with the reason) devices short of disk, too hot or throttled.",
        ),
        click.option("--max-temp", default=80.0, show_default=True, type=float, help="Health: hottest zone, °C."),
        click.option("--max-load", type=float, help="Health: 1-minute load per CPU above which a device is skipped."),
        click.option(
            "--min-free", default=64.0, show_default=True, type=float, help="Health: MiB free in the work directory."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def select_devices(inventory_path: str | None, targets, accept_new: bool = False):
    """Devices named by NAME / tag:X / all (several allowed), with the host-key policy applied."""
    from edgeq.fleet.inventory import load_inventory, with_policy

    inventory = load_inventory(inventory_path)
    return with_policy(inventory.select(list(targets) or ["all"]), "accept-new" if accept_new else None)


_echo_lock = threading.Lock()


def progress_printer(enabled: bool = True):
    """An on_event callback: one line per device event on stderr, with elapsed seconds."""
    start = time.monotonic()

    def on_event(device: str, message: str) -> None:
        if enabled:
            with _echo_lock:
                click.echo(f"[{time.monotonic() - start:6.1f}s] {device}: {message}", err=True)

    return on_event


class Heartbeat:
    """A long step's progress on stderr: the last thing it reported, at least every ``every`` seconds,
    so that a log (CI, a file) shows where ``analyze plan`` or a ``--ptq`` search is. Use as a context
    manager; call it with what was just done (``progress(layer)``)."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every, self.done, self.last = what, every, 0, ""
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __call__(self, item: str = "") -> None:
        self.done, self.last = self.done + 1, str(item)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            last = f", last {self.last}" if self.last else ""
            with _echo_lock:
                click.echo(
                    f"[{time.monotonic() - self._start:6.0f}s] {self.what}: {self.done} step(s) done{last}", err=True
                )

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def failed_exit(outcomes) -> None:
    """Exit 6 when a rollout stopped at its failure budget, 5 when some devices failed (naming them)."""
    from edgeq.errors import DevicesFailed, RolloutStopped

    failed = [o.device for o in outcomes if o.status in ("failed", "unhealthy")]
    skipped = [o.device for o in outcomes if o.status == "skipped"]
    if skipped:
        raise RolloutStopped(
            f"rollout stopped: failed on {len(failed)} device(s) ({', '.join(failed)}), over the --max-fail budget; "
            f"{len(skipped)} of {len(outcomes)} not attempted"
        )
    if failed:
        raise DevicesFailed(f"failed on {len(failed)} of {len(outcomes)} device(s): {', '.join(failed)}")
