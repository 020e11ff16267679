"""`edgeq eval`: a quantized .tflite against its FP32 reference on a test split."""

from __future__ import annotations

import click

from edgeq.tasks.metrics import metric
from edgeq.ui import table


@click.command("eval")
@click.argument("model", type=click.Path())
@click.option("--reference", required=True, type=click.Path(), help="FP32 model: .keras/.h5/SavedModel or .tflite.")
@click.option("--data", required=True, help="digits | synthetic:... | npz:PATH | images:DIR")
@click.option("--split", type=click.Choice(["test", "val", "train"]), default="test", show_default=True)
@click.option(
    "--max-drop",
    "max_drop",
    type=float,
    help="Exit 4 if any output's main metric gets worse by more than this: points of accuracy or AUC, "
    "percent of RMSE for regression.",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Also write the result as JSON ('-': stdout)."
)
@click.option(
    "--task",
    metavar="KIND|NAME=KIND,...|FILE.json",
    help="What each output is (default: the conversion manifest's record, else inferred).",
)
def eval_command(model, reference, data, split, max_drop, json_path, task):
    """Each output of MODEL and REFERENCE scored by its task (accuracy, AUC, MAE/RMSE...), the drop,
    agreement, MAE, MSE, SQNR, cosine and size."""
    import json

    from edgeq.artifacts import write_json_atomic
    from edgeq.evaluate.run import check_gate, evaluate
    from edgeq.tasks.verdicts import Verdict

    r = evaluate(model, reference, data, split, max_drop, task)
    if json_path == "-":
        click.echo(json.dumps(r.to_dict(), indent=2))
    else:
        click.echo(f"{r.data}: {r.samples} samples" + ("" if r.labelled else " (no labels: outputs compared only)"))
        if r.matching:  # a .tflite converted by hand names its outputs as its converter did
            click.echo(f"note: {r.matching}")
        click.echo(table(["metric", "FP32 reference", f"{r.model_dtype} model"], _rows(r)))
        for verdict in r.verdicts:  # each judged output: the change with its n and paired interval
            click.echo(Verdict.from_dict(verdict).line())
        if json_path:
            write_json_atomic(json_path, r.to_dict())
    check_gate(r)


def _value(name: str, value) -> str:
    return metric(name).show(value)


def _rows(r) -> list[tuple]:
    """One block of rows per output (a one-output model: no name prefix), then the size."""
    rows = []
    several = len(r.outputs) > 1
    for o in r.outputs:
        prefix = f"{o['name']} ({o['task']}): " if several else ""
        for key in sorted(set(o["reference_metrics"]) | set(o["metrics"]), key=_metric_order):
            rows.append(
                (prefix + key, _value(key, o["reference_metrics"].get(key)), _value(key, o["metrics"].get(key)))
            )
        if o["worse_by"] is not None:
            row = metric(o["primary"])
            rows.append((f"{prefix}{row.label} change", "", row.show_change(o["worse_by"])))
        c = o["comparison"]
        if c["agreement"] is not None:
            rows.append((f"{prefix}top-1 agreement", "", f"{c['agreement']:.2%}"))
        rows.append((f"{prefix}MAE / MSE", "", f"{c['mae']:.4g} / {c['mse']:.4g}"))
        rows.append((f"{prefix}SQNR (dB) / cosine", "", f"{c['sqnr_db']:.1f} / {c['cosine']:.4f}"))
    if r.detection is not None:  # both heads decoded and NMS'd by edgeq, scored by pycocotools
        d = r.detection
        rows.append(("detection mAP@0.5", f"{d['reference_map50']:.4f}", f"{d['map50']:.4f}"))
        rows.append(("detection mAP@0.5:0.95", f"{d['reference_map']:.4f}", f"{d['map']:.4f}"))
        rows.append(("mAP@0.5 change", "", metric("map50").show_change(d["worse_by"])))
    rows.append(
        ("size", f"{r.reference_size_bytes / 1024:.1f} KiB", f"{r.size_bytes / 1024:.1f} KiB ({r.size_ratio:.1%})")
    )
    return rows


_ORDER = ("accuracy", "top5", "exact_match", "auc", "pauc", "mae", "rmse", "max_error", "r2", "reconstruction_mse")


def _metric_order(name: str) -> int:
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)
