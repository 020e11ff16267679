"""``edgeq verify --on NAME MODEL --data FILE.npz``: the device's outputs vs this host's, bit for bit."""

from __future__ import annotations

from dataclasses import asdict

import click

from edgeq import ui


@click.command("verify")
@click.argument("model", metavar="MODEL.tflite")
@click.option("--on", "targets", multiple=True, required=True, help="NAME, tag:X or all.")
@click.option("--data", required=True, metavar="FILE.npz", help="Inputs (array x) run on both sides.")
@click.option("--inputs", default="x", show_default=True, help="Name of the input array in --data.")
@click.option("--limit", default=100, show_default=True, type=int, help="At most this many samples (0: all).")
@click.option(
    "--tolerance",
    type=float,
    help="Largest accepted |device - host| in output units (default: 0 = bit-exact for integer outputs, "
    "1e-5 for float outputs, whose last bits may differ between CPUs).",
)
@click.option("--delegate", default="xnnpack", show_default=True, help="xnnpack | none (same on both sides).")
@click.option("--json", "json_out", metavar="OUT", help="Write every device's result as JSON here (for edgeq report).")
@ui.inventory_option
@ui.host_key_option
@ui.rollout_options
def verify(
    model, targets, data, inputs, limit, tolerance, delegate, json_out, inventory_path, accept_new_host_keys, rollout
):
    """Run the same inputs on each device and on this host's interpreter; report agreement."""
    from edgeq.fleet.remote import for_each_device, verify_on

    chosen = ui.select_devices(inventory_path, targets, accept_new_host_keys)
    outcomes = for_each_device(
        chosen,
        lambda device, on_event: verify_on(
            device, model, data, inputs=inputs, limit=limit or None, delegate=delegate, on_event=on_event
        ),
        rollout=rollout,
        on_event=ui.progress_printer(),
    )
    rows, mismatched, documents = [], [], []
    for o in outcomes:
        r = o.result
        if r is None:
            rows.append([o.device, o.status, "-", "-", "-", "-", "-", o.error or ""])
            documents.append({"device": o.device, "status": o.status, "seconds": o.seconds, "error": o.error})
            continue
        allowed = tolerance if tolerance is not None else (0.0 if r.output_dtype.startswith(("int", "uint")) else 1e-5)
        ok = r.bit_exact or r.max_abs_diff <= allowed
        if not ok:
            mismatched.append(o.device)
        documents.append(
            {"device": o.device, "status": "ok" if ok else "mismatch", "seconds": o.seconds, "tolerance": allowed}
            | asdict(r)
        )
        agreement = "bit-exact" if r.bit_exact else f"max |diff| {r.max_abs_diff:g} ({r.max_abs_diff_float:.4g} float)"
        if len(r.outputs) > 1:  # name each output: which head differs is the point
            agreement = ", ".join(
                f"{x['name']} " + ("bit-exact" if x["bit_exact"] else f"max |diff| {x['max_abs_diff']:g}")
                for x in r.outputs
            )
        rows.append(
            [
                o.device,
                "ok" if ok else "MISMATCH",
                r.device_machine,
                r.device_runtime,
                str(r.samples),
                agreement,
                "-" if r.top1_agreement is None else f"{100 * r.top1_agreement:.1f}%",
                "",
            ]
        )
    headers = ["device", "status", "arch", "device runtime", "samples", "outputs vs host", "top-1 agree", "error"]
    click.echo(ui.table(headers, rows, numbers=True))
    if json_out:  # before any exit: a failed or mismatched device is what the file is for
        document = {"kind": "edgeq.verify", "model": model, "data": data, "delegate": delegate, "devices": documents}
        ui.write_json_output(document, json_out)
    if mismatched:  # a mismatch is the answer verify exists for: it wins over a failed device (exit 4)
        from edgeq.errors import VerificationMismatch

        failed = [o.device for o in outcomes if o.status != "ok"]
        raise VerificationMismatch(
            f"{', '.join(mismatched)}: outputs differ from this host's interpreter beyond the tolerance "
            "(bit-exact for integer outputs; set one with --tolerance)"
            + (f"; also failed: {', '.join(failed)}" if failed else "")
        )
    ui.failed_exit(outcomes)
