"""``edgeq push MODEL... --to NAME|tag:X|all``: bootstrap devices once, then upload models."""

from __future__ import annotations

import click

from edgeq import ui


@click.command("push")
@click.argument("files", nargs=-1, metavar="MODEL...")
@click.option("--to", "targets", multiple=True, required=True, help="NAME, tag:X or all (repeat or comma-separate).")
@ui.inventory_option
@ui.host_key_option
@ui.rollout_options
@ui.health_options
@click.option("--wheel", metavar="WHEEL", help="edgeq wheel to install (default: built from this checkout).")
@click.option(
    "--wheels", "wheels_dir", metavar="DIR", help="Dependency wheels for offline devices (default: pip download)."
)
@click.option(
    "--rollback",
    is_flag=True,
    help="Make the previous version of each named MODEL live again on the devices (push keeps one).",
)
@click.option(
    "--runtime",
    "runtime_too",
    is_flag=True,
    help="With --rollback: make the previous edgeq runtime live again (push keeps the one it replaces).",
)
def push(
    files, targets, inventory_path, accept_new_host_keys, rollout, health, wheel, wheels_dir, rollback, runtime_too
) -> None:
    """Upload MODEL... (any files) to each device's work directory, checked by sha256.

    A file that replaces another keeps the replaced version on the device; --rollback swaps
    them back. WORKDIR/models/.edgeq-live.json says which version of each file is live, and
    WORKDIR/.edgeq-runtime.json which edgeq runtime (--rollback --runtime swaps that back).
    """
    from edgeq.errors import UsageError
    from edgeq.fleet.remote import for_each_device, push_to, rollback_on

    if runtime_too and not rollback:
        raise UsageError("--runtime goes with --rollback (a push installs this checkout's edgeq by itself)")
    if not files and not runtime_too:
        raise UsageError("give the MODEL files to push (or --rollback --runtime to restore the previous edgeq)")
    chosen = ui.select_devices(inventory_path, targets, accept_new_host_keys)
    if rollback:
        outcomes = for_each_device(
            chosen, lambda device, on_event: rollback_on(device, files, on_event, runtime=runtime_too),
            rollout=rollout, on_event=ui.progress_printer(),
        )  # fmt: skip
        rows = [
            [o.device, o.status, ", ".join(r.name for r in o.result or []) or "-",
             ", ".join((r.live_sha256 or "?")[:12] for r in o.result or []) or "-", f"{o.seconds:.1f}", o.error or ""]
            for o in outcomes
        ]  # fmt: skip
        click.echo(ui.table(["device", "status", "rolled back", "live sha256", "seconds", "error"], rows, numbers=True))
        ui.failed_exit(outcomes)
        return
    outcomes = for_each_device(
        chosen,
        lambda device, on_event: push_to(device, files, on_event, health, wheel=wheel, wheels_dir=wheels_dir),
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
