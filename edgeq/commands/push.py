"""``edgeq push MODEL... --to NAME|tag:X|all``: bootstrap devices once, then upload models."""

from __future__ import annotations

import click

from edgeq.commands import ui


@click.command("push")
@click.argument("files", nargs=-1, required=True, metavar="MODEL...")
@click.option("--to", "targets", multiple=True, required=True, help="NAME, tag:X or all (repeat or comma-separate).")
@ui.inventory_option
@ui.host_key_option
@ui.rollout_options
@click.option("--wheel", metavar="WHEEL", help="edgeq wheel to install (default: built from this checkout).")
@click.option(
    "--wheels", "wheels_dir", metavar="DIR", help="Dependency wheels for offline devices (default: pip download)."
)
def push(files, targets, inventory_path, accept_new_host_keys, rollout, wheel, wheels_dir) -> None:
    """Upload MODEL... (any files) to each device's work directory, checked by sha256."""
    from edgeq.fleet.remote import for_each_device, push_to

    chosen = ui.select_devices(inventory_path, targets, accept_new_host_keys)
    outcomes = for_each_device(
        chosen,
        lambda device, on_event: push_to(device, files, on_event, wheel=wheel, wheels_dir=wheels_dir),
        rollout=rollout,
        on_event=ui.progress_printer(),
    )
    rows = []
    for o in outcomes:
        if o.result is None:
            rows.append([o.device, o.status, "-", "-", "-", f"{o.seconds:.1f}", o.error or ""])
            continue
        up = sum(1 for f in o.result.files if f.status == "uploaded")
        same = sum(1 for f in o.result.files if f.status == "unchanged")
        rt = o.result.runtime
        rows.append([o.device, "ok", str(up), str(same), f"{rt.mode}, {rt.installed}", f"{o.seconds:.1f}", ""])
    headers = ["device", "status", "uploaded", "unchanged", "edgeq runtime", "seconds", "error"]
    click.echo(ui.table(headers, rows, numbers=True))
    ui.failed_exit(outcomes)
