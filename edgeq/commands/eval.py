"""`edgeq eval`: a quantized .tflite against its FP32 reference on a test split."""

from __future__ import annotations

import click

from edgeq.commands.ui import table


@click.command("eval")
@click.argument("model", type=click.Path())
@click.option("--reference", required=True, type=click.Path(), help="FP32 model: .keras/.h5/SavedModel or .tflite.")
@click.option("--data", required=True, help="digits | synthetic:... | npz:PATH | images:DIR")
@click.option("--split", type=click.Choice(["test", "val", "train"]), default="test", show_default=True)
@click.option("--max-drop", "max_drop", type=float, help="Exit non-zero if accuracy drops by more than PP points.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Also write the result as JSON ('-': stdout)."
)
def eval_command(model, reference, data, split, max_drop, json_path):
    """Accuracy of MODEL and REFERENCE, drop, agreement, MAE, MSE, SQNR, cosine and size."""
    import json

    from edgeq.artifacts import write_json_atomic
    from edgeq.evaluate import check_gate, evaluate

    r = evaluate(model, reference, data, split, max_drop)
    if json_path == "-":
        click.echo(json.dumps(r.to_dict(), indent=2))
    else:
        rows = [
            ("accuracy", f"{r.reference_accuracy:.2%}", f"{r.accuracy:.2%}"),
            ("accuracy drop (pp)", "", f"{r.drop_pp:+.2f}"),
            ("top-1 agreement", "", f"{r.agreement:.2%}"),
            ("MAE / MSE", "", f"{r.mae:.4g} / {r.mse:.4g}"),
            ("SQNR (dB) / cosine", "", f"{r.sqnr_db:.1f} / {r.cosine:.4f}"),
            ("size", f"{r.reference_size_bytes / 1024:.1f} KiB", f"{r.size_bytes / 1024:.1f} KiB ({r.size_ratio:.1%})"),
        ]
        click.echo(f"{r.data}: {r.samples} samples")
        click.echo(table(["metric", "FP32 reference", f"{r.model_dtype} model"], rows))
        if json_path:
            write_json_atomic(json_path, r.to_dict())
    check_gate(r)
