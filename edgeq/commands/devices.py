"""``edgeq devices list|check``: the inventory, and what each device has (over SSH)."""

from __future__ import annotations

import threading
import time

import click

from edgeq.commands.profile import format_table, human_bytes

_echo_lock = threading.Lock()


def inventory_option(f):
    return click.option(
        "--inventory",
        "-i",
        "inventory_path",
        metavar="PATH",
        help="devices.toml or Ansible YAML (default: $EDGEQ_INVENTORY, else ./devices.toml).",
    )(f)


def host_key_option(f):
    return click.option(
        "--accept-new-host-keys",
        is_flag=True,
        help="Record the host key of a device seen for the first time (like ssh accept-new); "
        "a changed key is still refused.",
    )(f)


def parallel_option(f):
    return click.option(
        "--parallel", "-j", default=4, show_default=True, type=click.IntRange(1, 64), help="Devices at once."
    )(f)


def select_devices(inventory_path: str | None, targets, accept_new: bool = False):
    """Devices named by NAME / tag:X / all (several allowed), with the host-key policy applied."""
    from edgeq.fleet.inventory import load_inventory, with_policy

    inventory = load_inventory(inventory_path)
    return with_policy(inventory.select(list(targets) or ["all"]), "accept-new" if accept_new else None)


def progress_printer(enabled: bool = True):
    """An on_event callback: one line per device event on stderr, with elapsed seconds."""
    start = time.monotonic()

    def on_event(device: str, message: str) -> None:
        if enabled:
            with _echo_lock:
                click.echo(f"[{time.monotonic() - start:6.1f}s] {device}: {message}", err=True)

    return on_event


def failed_exit(outcomes) -> None:
    failed = [o.device for o in outcomes if o.status != "ok"]
    if failed:
        click.echo(f"failed on {len(failed)} of {len(outcomes)} device(s): {', '.join(failed)}", err=True)
        raise SystemExit(1)


@click.group("devices")
def devices() -> None:
    """The device inventory, and what each device has."""


@devices.command("list")
@inventory_option
def list_devices(inventory_path: str | None) -> None:
    """Devices in the inventory (no connection is made)."""
    from edgeq.fleet.inventory import load_inventory

    inventory = load_inventory(inventory_path)
    rows = [
        [d.name, d.address, ",".join(d.tags) or "-", d.venv or d.python, d.workdir, d.identity_file or "agent"]
        for d in inventory.devices
    ]
    click.echo(format_table(["device", "address", "tags", "python", "workdir", "key"], rows))


@devices.command("check")
@click.argument("targets", nargs=-1, metavar="[NAME|tag:X|all]...")
@inventory_option
@host_key_option
@parallel_option
def check(targets, inventory_path, accept_new_host_keys, parallel) -> None:
    """Connect to each device; report arch, OS, Python, runtime, numpy, free disk, Edge TPU."""
    from edgeq.fleet.remote import check_device, for_each_device

    chosen = select_devices(inventory_path, targets, accept_new_host_keys)
    outcomes = for_each_device(chosen, check_device, parallel=parallel, on_event=progress_printer())
    rows = []
    for o in outcomes:
        p = o.result
        if p is None:
            rows.append([o.device, "failed", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        runtime = f"{p.runtime} {p.runtime_version}" if p.runtime else "none"
        free = human_bytes(p.free_bytes) if p.free_bytes is not None else "?"
        rows.append(
            [o.device, "ok", p.machine, p.os, p.python, runtime, p.numpy or "none", p.edgeq or "none", free, p.edgetpu]
        )
    headers = ["device", "status", "arch", "os", "python", "runtime", "numpy", "edgeq", "free disk", "edge tpu"]
    click.echo(format_table(headers, rows))
    for o in outcomes:
        if o.error:
            click.echo(f"{o.device}: {o.error}", err=True)
    failed_exit(outcomes)
