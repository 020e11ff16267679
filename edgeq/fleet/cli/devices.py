"""``edgeq devices list|check``: the inventory, and what each device has (over SSH)."""

from __future__ import annotations

import click

from edgeq.ui import (
    failed_exit,
    host_key_option,
    human_bytes,
    inventory_option,
    progress_printer,
    rollout_options,
    select_devices,
    table,
)


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
    click.echo(table(["device", "address", "tags", "python", "workdir", "key"], rows, numbers=True))


@devices.command("check")
@click.argument("targets", nargs=-1, metavar="[NAME|tag:X|all]...")
@inventory_option
@host_key_option
@rollout_options
def check(targets, inventory_path, accept_new_host_keys, rollout) -> None:
    """Connect to each device; report arch, OS, Python, runtime, numpy, free disk, Edge TPU."""
    from edgeq.fleet.remote import check_device, for_each_device

    chosen = select_devices(inventory_path, targets, accept_new_host_keys)
    outcomes = for_each_device(chosen, check_device, rollout=rollout, on_event=progress_printer())
    from edgeq.fleet.probe import host_versions

    host = host_versions()
    rows = []
    for o in outcomes:
        p = o.result
        if p is None:
            rows.append([o.device, o.status, "-", "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        runtime = f"{p.runtime} {p.runtime_version}" if p.runtime else "none"
        free = human_bytes(p.free_bytes) if p.free_bytes is not None else "?"
        drift = p.drift(host)
        rows.append(
            [o.device, "ok", p.machine, p.os, p.python, runtime, p.numpy or "none", p.edgeq or "none", free, p.edgetpu,
             "same" if not drift else "DRIFT: " + "; ".join(drift)]
        )  # fmt: skip
    headers = ["device", "status", "arch", "os", "python", "runtime", "numpy", "edgeq", "free disk", "edge tpu"]
    headers += [f"vs host (edgeq {host['edgeq']}, numpy {host['numpy']}, {host['runtime']})"]
    click.echo(table(headers, rows, numbers=True))
    for o in outcomes:
        if o.error:
            click.echo(f"{o.device}: {o.error}", err=True)
    failed_exit(outcomes)
