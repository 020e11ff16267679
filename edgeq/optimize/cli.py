"""`edgeq optimize`: PTQ, the target plan, then QAT, until a model is faster than FP32 within the budget on test."""

from __future__ import annotations

from pathlib import Path

import click

from edgeq.quantize.ranges import ACTIVATION_METHODS
from edgeq.ui import Heartbeat, host_key_option, inventory_option


@click.command("optimize")
@click.argument("model", type=click.Path())
@click.option("--data", required=True, help="digits | npz:PATH | images:DIR | ...: val chooses, test confirms.")
@click.option(
    "--max-drop",
    "max_drop",
    type=float,
    required=True,
    help="Budget vs FP32 in the task metric's change unit, met by the paired 95% interval's upper end.",
)
@click.option("--target", default="cpu", show_default=True, metavar="cpu|edgetpu|npu16x8|FILE.toml")
@click.option("--out", type=click.Path(file_okay=False), help="Folder to write (new). Default: MODEL_optimized.")
@click.option("--on", "on_device", metavar="DEVICE", help="Time every rung's candidates on this device (SSH).")
@inventory_option(help="Device inventory (with --on).")
@host_key_option
@click.option("--max-size", type=click.IntRange(min=1), metavar="KIB", help="Only models this small.")
@click.option(
    "--ranges",
    type=click.Choice(list(ACTIVATION_METHODS)),
    default=None,
    help="The activation range method PTQ tries (default: every one).",
)
@click.option("--calib-samples", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--qat-epochs", type=click.IntRange(min=1), default=None, help="QAT's epochs (default: 3).")
@click.option("--runs", type=click.IntRange(min=1), default=50, show_default=True, help="Timed runs per candidate.")
@click.option("--task", metavar="KIND|FILE.json", help="What the output is, when inference from it is wrong.")
def optimize(model, data, max_drop, target, out, on_device, inventory_path, accept_new_host_keys, max_size, ranges,
             calib_samples, qat_epochs, runs, task):  # fmt: skip
    """The fastest verified model of MODEL (Keras, FP32) for --target: PTQ with each range method, then the
    target's plan (float or int16 islands), then QAT (label-free where the data has no labels), then QAT with
    the plan's islands, stopping at the first rung whose model is faster than FP32 and within --max-drop.

    Each candidate is chosen on the val split and confirmed once on test, which no choice saw: the verdict
    printed last is the test verdict, with n and the paired 95% interval."""
    from edgeq.analyze.cli import device_timer
    from edgeq.analyze.speed import QAT_EPOCHS, host_timer
    from edgeq.optimize.folder import optimize_folder
    from edgeq.optimize.ladder import gate

    out = Path(out) if out else Path(model).with_name(f"{Path(model).stem}_optimized")
    if on_device:
        timer = device_timer(on_device, inventory_path, accept_new_host_keys, runs, out / "device")
    else:
        timer = host_timer(runs=runs)
    with Heartbeat("optimize (candidates measured)") as progress:
        record = optimize_folder(
            model, data, target, max_drop, out, max_size=max_size * 1024 if max_size else None, ranges=ranges,
            calib_samples=calib_samples, timer=timer, task=task, qat_epochs=qat_epochs or QAT_EPOCHS,
            say=click.echo, progress=progress,
        )  # fmt: skip
    if record["file"]:
        click.echo(f"chosen: {out / record['file']} (with its manifest)")
    click.echo(f"record: {out / 'optimize.json'}\nreport: {record['report']}\n{record['line']}")
    gate(record)
