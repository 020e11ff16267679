"""`edgeq analyze`: weight statistics, per-layer sensitivity, accuracy-budgeted plans."""

from __future__ import annotations

import click

from edgeq.quantize.ranges import ACTIVATION_METHODS
from edgeq.tasks.metrics import metric
from edgeq.ui import Heartbeat, host_key_option, inventory_option, table

_ranges_option = click.option(
    "--ranges",
    type=click.Choice(list(ACTIVATION_METHODS)),
    default="minmax",
    show_default=True,
    help="How activation ranges are set from the calibration data (minmax: the converter's own).",
)


@click.group("analyze")
def analyze():
    """Which layers are hard to quantize, why, and a layer-wise plan that meets a budget."""


@analyze.command("weights")
@click.argument("model", type=click.Path())
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every figure as JSON.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Write one row per layer as CSV.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), help="Write a histogram PNG per layer here.")
@click.option(
    "--data",
    default=None,
    help="Calibration data (digits | synthetic:... | npz:PATH | images:DIR): adds INT8 rounding by "
    "nearest, stochastic and AdaRound, with each layer's output error on it.",
)
@click.option("--calib-samples", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of stochastic rounding and AdaRound.")
def weights(model, json_path, csv_path, plots_dir, data, calib_samples, seed):
    """Per-layer weight statistics of MODEL (Keras or .tflite) and the error of each
    quantization choice: INT8/INT4, per-tensor/per-channel, symmetric/asymmetric,
    nearest/stochastic rounding (and AdaRound with --data). Most outlier-heavy layer first."""
    from edgeq.analyze.weights import (
        analyze_weights,
        rounding_errors,
        save_histograms,
        weights_document,
        write_weights_csv,
    )
    from edgeq.artifacts import write_json_atomic

    reports = analyze_weights(model, seed)
    rounding = rounding_errors(model, data, calib_samples, seed) if data else []
    click.echo(_weights_table(reports))
    if rounding:
        click.echo(f"\nINT8 per-channel rounding on {calib_samples} samples of {data} (seed {seed}): output MSE")
        click.echo(_rounding_table(rounding))
    if json_path:
        document = weights_document(model, reports, plots_dir, rounding, data, calib_samples, seed)
        write_json_atomic(json_path, document)
    if csv_path:
        write_weights_csv(reports, csv_path)
    if plots_dir:
        files = save_histograms(model, plots_dir)
        click.echo(f"{len(files)} histograms in {plots_dir}")


def _weights_table(reports) -> str:
    header = ["layer", "kind", "shape", "std", "kurtosis", "outliers", "ch. spread"]
    header += ["int8 t dB", "int8 ch dB", "int4 ch dB", "int4 ch sr dB", "recommendation"]
    rows = [
        (
            r.name,
            r.kind,
            "x".join(map(str, r.shape)),
            f"{r.std:.3g}",
            f"{r.kurtosis:.1f}",
            f"{r.outlier_fraction:.2%}",
            f"{r.channel_range_spread:.1f}x",
            f"{r.error(8, 'per-tensor').sqnr_db:.1f}",
            f"{r.error(8, 'per-channel').sqnr_db:.1f}",
            f"{r.error(4, 'per-channel').sqnr_db:.1f}",
            f"{r.error(4, 'per-channel', rounding='stochastic').sqnr_db:.1f}",
            r.recommendation,
        )
        for r in reports
    ]
    return table(header, rows)


def _rounding_table(rounding) -> str:
    by_layer: dict[str, dict] = {}
    for e in rounding:
        by_layer.setdefault(e.layer, {})[e.method] = e
    rows = []
    for name, m in by_layer.items():
        nearest = m["nearest"].output_mse
        ratio = f"{m['adaround'].output_mse / nearest:.2f}x" if nearest > 0 else "-"
        rows.append(
            (name, f"{nearest:.3g}", f"{m['stochastic'].output_mse:.3g}", f"{m['adaround'].output_mse:.3g}",
             f"{m['adaround'].flipped:.1%}", ratio)
        )  # fmt: skip
    return table(["layer", "nearest", "stochastic", "adaround", "adaround flipped", "adaround vs nearest"], rows)


_task_option = click.option(
    "--task",
    metavar="KIND|FILE.json",
    help="What the output is, when inference from its activation and the data is wrong (e.g. reconstruction).",
)


@analyze.command("sensitivity")
@click.argument("model", type=click.Path())
@click.option("--data", required=True, help="digits | synthetic:... | npz:PATH | images:DIR")
@click.option("--method", type=click.Choice(["fast", "exact", "both"]), default="both", show_default=True)
@click.option("--calib-samples", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--split", type=click.Choice(["val", "test"]), default="test", show_default=True)
@click.option(
    "--granularity", type=click.Choice(["per-channel", "per-tensor"]), default="per-channel", show_default=True
)
@_ranges_option
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Bar chart PNG of the ranking.")
@_task_option
def sensitivity(model, data, method, calib_samples, split, granularity, ranges, json_path, plot_path, task):
    """Rank the layers of FP32 MODEL by how much INT8 quantization of each one costs."""
    from edgeq.analyze.from_tflite import analyze_tflite_sensitivity
    from edgeq.analyze.sensitivity import analyze_sensitivity, save_bar_chart
    from edgeq.artifacts import write_json_atomic

    tflite = str(model).endswith(".tflite")  # a .tflite's ops, each at 16-bit activations or alone int8
    with Heartbeat("analyze sensitivity (layers measured)") as progress:
        report = (analyze_tflite_sensitivity if tflite else analyze_sensitivity)(
            model, data, method, calib_samples, split, granularity == "per-tensor", progress=progress, ranges=ranges,
            task_spec=task,
        )  # fmt: skip
    row = metric(report.metric)
    click.echo(
        f"{report.data}, {report.samples} samples: {row.label} FP32 {row.show(report.fp32_value)}, "
        f"full INT8 {row.show(report.int8_value)}, "
        f"{row.show_change(row.worse_by(report.fp32_value, report.int8_value))} ({ranges} ranges)"
    )
    if report.fast:
        click.echo(f"\nfast (QuantizationDebugger, {report.seconds_fast:.1f} s): lowest channel SQNR first")
        click.echo(
            table(
                ["layer", "channel SQNR dB (median)", "mean", "worst channel", "MSE", "RMSE/scale", "max abs err"],
                [
                    (
                        f.layer,
                        f"{f.channel_sqnr_db:.1f}",
                        f"{f.mean_channel_sqnr_db:.1f}",
                        f"{f.worst_channel_sqnr_db:.1f}",
                        f"{f.mean_squared_error:.3g}",
                        f"{f.rmse_over_scale:.3g}",
                        f"{f.max_abs_error:.3g}",
                    )
                    for f in report.fast
                ],
            )
        )
    if report.exact:
        unit = row.change_label
        how = "16-bit activations on the op (the rest int8)" if tflite else "keeping the layer float"
        click.echo(f"\nexact ({report.seconds_exact:.1f} s): {row.label} regained by {how}, most output error first")
        click.echo(
            table(
                [
                    "layer",
                    f"{row.label} all but this",
                    "only this",
                    f"gain ({unit})",
                    f"loss ({unit})",
                    "MSE only this",
                ],
                [
                    (
                        e.layer,
                        row.show(e.value_all_but_this),
                        row.show(e.value_only_this),
                        f"{e.gain:+.2f}",
                        f"{e.loss:+.2f}",
                        f"{e.mse_only_this:.3g}",
                    )
                    for e in report.exact
                ],
            )
        )
    if json_path:
        write_json_atomic(json_path, report.to_dict())
    if plot_path:
        save_bar_chart(report, plot_path)


@analyze.command("plan")
@click.argument("model", type=click.Path())
@click.option("--data", required=True, help="digits | synthetic:... | npz:PATH | images:DIR")
@click.option(
    "--max-drop",
    "max_drop",
    type=float,
    required=True,
    help="Budget vs FP32 in the task metric's change unit: points of accuracy or AUC, % of RMSE.",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Plan file (JSON) to write.")
@click.option("--calib-samples", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--split",
    type=click.Choice(["val", "test"]),
    default="val",
    show_default=True,
    help="Split the plans are measured on (keep test for the final eval).",
)
@click.option(
    "--granularity", type=click.Choice(["per-channel", "per-tensor"]), default="per-channel", show_default=True
)
@click.option("--int4", is_flag=True, help="Then INT4 weights on the least sensitive layers, within the budget.")
@click.option(
    "--fallback",
    type=click.Choice(["float", "int16"]),
    default="float",
    show_default=True,
    help="What a layer int8 hurts becomes: float, or 16-bit activations (16x8), which keeps the model "
    "integer-only (convert it with --int8-only --plan PLAN).",
)
@click.option(
    "--ranges",
    type=click.Choice(list(ACTIVATION_METHODS)),
    default=None,
    help="How activation ranges are set from the calibration data (minmax, the converter's own, by default; "
    "with --target every method is tried unless one is named).",
)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Size/task-metric frontier PNG.")
@_task_option
@click.option(
    "--target",
    metavar="cpu|edgetpu|npu16x8|FILE.toml",
    help="Weigh speed: try every way back from int8 the target runs (range methods, float and int16 islands), "
    "time each candidate, keep the fastest that meets --max-drop.",
)
@click.option("--on", "on_device", metavar="DEVICE", help="With --target: time the candidates on this device (SSH).")
@inventory_option(help="Device inventory (with --on).")
@host_key_option
@click.option("--max-size", type=click.IntRange(min=1), metavar="KIB", help="With --target: only models this small.")
@click.option("--runs", type=click.IntRange(min=1), default=50, show_default=True, help="Timed runs per candidate.")
def plan(model, data, max_drop, out, calib_samples, split, granularity, int4, fallback, ranges, plot_path, task,
         **speed):  # fmt: skip
    """Start from full INT8 and move the most sensitive layers off int8 (float, or with
    --fallback int16 16-bit activations) until the accuracy drop is within --max-drop.
    The best plan is always saved; use it with `edgeq convert MODEL --int8 --plan PLAN`
    (--int8-only for an int16 plan) or `edgeq train --layer-config PLAN`.

    With --target, the plan weighs speed: every candidate the target can run is timed (on this
    host, or --on DEVICE), and the fastest one within --max-drop (and --max-size) is kept."""
    if speed["target"]:
        speed["fallback_given"] = fallback if _given("fallback") else None
        _target_plan(model, data, max_drop, out, calib_samples, split, granularity, int4, ranges, plot_path, task,
                     speed)  # fmt: skip
        return
    for name, flag in (("on_device", "--on"), ("max_size", "--max-size")):
        if speed[name]:
            from edgeq.errors import UsageError

            raise UsageError(f"{flag} weighs a plan's speed on a target: add --target cpu|edgetpu|npu16x8")
    ranges = ranges or "minmax"
    from edgeq.analyze.from_tflite import make_tflite_plan
    from edgeq.analyze.plan import make_plan, save_frontier_chart
    from edgeq.errors import QualityGateError
    from edgeq.tasks.verdicts import Verdict

    planner = make_tflite_plan if str(model).endswith(".tflite") else make_plan  # a .tflite's plan: its ops
    with Heartbeat("analyze plan (layers ranked)") as progress:
        result = planner(
            model,
            data,
            max_drop,
            out,
            calib_samples,
            split,
            granularity == "per-tensor",
            progress=progress,
            int4=int4,
            ranges=ranges,
            fallback=fallback,
            task_spec=task,
        )
    moved = "layers at 16-bit" if fallback == "int16" else "layers kept float"
    row = metric(result.metric)
    unit = row.change_label
    click.echo(
        f"{result.data}, {result.samples} samples: {row.label} FP32 {row.show(result.fp32_value)}, "
        f"full INT8 {row.show(result.int8_value)}, budget {max_drop:g} {unit} worse"
        + (" (no labels: accuracy is top-1 agreement with FP32)" if result.label_free else "")
    )
    click.echo(
        table(
            [moved, "INT4 weights", row.label, f"worse by ({unit})", "size KiB"],
            [
                (
                    _names(p.changed) or "(none: full INT8)",
                    ", ".join(p.int4_layers) or "-",
                    row.show(p.value),
                    f"{p.worse_by:+.2f}",
                    f"{p.size_bytes / 1024:.1f}",
                )
                for p in result.frontier
            ],
        )
    )
    if plot_path:
        save_frontier_chart(result, plot_path)
    if result.verdict is not None:  # the chosen plan: its change with n and the paired interval
        click.echo(f"chosen plan: {Verdict.from_dict(result.verdict).line()}")
    click.echo(f"plan: {result.path}")
    if not result.met:
        raise QualityGateError(
            f"no plan meets --max-drop {max_drop:g} {unit}: the best ({len(result.best.changed)} {moved}) "
            f"is {result.best.worse_by:.2f} {unit} worse; it is saved in {result.path}"
        )


def _names(layers, shown: int = 4) -> str:
    """A few layer names and how many more: a plan of a big model can move hundreds."""
    more = f" (+{len(layers) - shown} more)" if len(layers) > shown else ""
    return ", ".join(layers[:shown]) + more


def device_timer(name: str, inventory_path, accept_new: bool, runs: int, results_dir):
    """``timer(model_bytes) -> ms`` on one device of the inventory: the fleet's remote profile of each candidate."""
    import itertools
    from pathlib import Path

    from edgeq.errors import UsageError
    from edgeq.fleet.remote import ProfileOptions, profile_on
    from edgeq.ui import select_devices

    devices = select_devices(inventory_path, [name], accept_new)
    if len(devices) != 1:
        raise UsageError(f"--on {name}: names {len(devices)} devices; a plan is timed on one (give its name)")
    device, counter = devices[0], itertools.count(1)
    folder = Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)

    def timed(model_bytes: bytes) -> float:
        path = folder / f"candidate{next(counter):03d}.tflite"
        path.write_bytes(model_bytes)
        return profile_on(device, path, ProfileOptions(threads="1", runs=runs), folder / "profiles").median_ms

    timed.where = f"{device.name}, 1 thread"  # type: ignore[attr-defined]
    return timed


def _target_plan(model, data, max_drop, out, calib_samples, split, granularity, int4, ranges, plot_path, task, speed):
    """``analyze plan --target``: the candidates, timed; the fastest that meets the budget."""
    import json
    from pathlib import Path

    from edgeq.analyze.speed import SAME_SPEED, host_timer, make_target_plan
    from edgeq.errors import QualityGateError, UsageError
    from edgeq.tasks.verdicts import Verdict

    if str(model).endswith(".tflite") or int4 or granularity == "per-tensor":
        raise UsageError("--target plans a Keras model's per-channel int8, float and int16 layers: drop --int4 and "
                         "--granularity per-tensor (a .tflite: plan it without --target)")  # fmt: skip
    if speed["on_device"]:
        candidates = Path(out).with_name(Path(out).stem + ".candidates")
        timer = device_timer(speed["on_device"], speed["inventory_path"], speed["accept_new_host_keys"],
                              speed["runs"], candidates)  # fmt: skip
    else:
        timer = host_timer(runs=speed["runs"])
    max_size = speed["max_size"] * 1024 if speed["max_size"] else None
    fallback = speed.get("fallback_given")
    with Heartbeat("analyze plan (candidates timed)") as progress:
        result = make_target_plan(
            model, data, max_drop, out, speed["target"], calib_samples, split, progress, ranges, task,
            fallback, timer, max_size,
        )  # fmt: skip
    record = json.loads(Path(result.path).read_text())  # what the plan weighed: FP32, the commands, its verdicts
    click.echo(_target_table(result, record))
    if plot_path:
        from edgeq.analyze.plan import save_frontier_chart

        save_frontier_chart(result, plot_path, fp32=record["fp32"])
    click.echo(f"chosen plan: {Verdict.from_dict(result.verdict).line()}")
    fp32 = record["fp32"]
    if record["slower_than_fp32"]:
        qat = record["commands"].get("qat")
        click.echo(
            f"on {record['latency_on']} FP32 ({fp32['latency_ms']:.3g} ms) is faster than every quantized model that "
            f"meets the budget (the chosen: {result.best.latency_ms:.3g} ms): "
            + (f"faster ones miss the budget; QAT may reach both: {qat}" if qat else "int8 buys size here, not speed")
        )
    if record.get("in_disguise"):
        qat = record["commands"].get("qat")
        click.echo(
            f"no real gain: the chosen is the FP32 model in disguise ({record['in_disguise']}); QAT may reach "
            f"int8 within the budget: {qat}"
        )
    if record.get("as_fast"):
        p = result.frontier[min(record["as_fast"], key=lambda i: result.frontier[i].latency_ms)]
        click.echo(
            f"as fast, within a median's noise ({SAME_SPEED:.0%}): {p.way} ({p.ranges} ranges) at {p.latency_ms:.3g} "
            f"ms, at most {p.worse_by_high:+.2f} {metric(result.metric).change_label}, also within the budget; "
            "the plan keeps the most accurate of them"
        )
    if record.get("unresolved_faster") is not None:
        p = result.frontier[record["unresolved_faster"]]
        click.echo(
            f"faster, and within the budget by its point estimate only: {p.way} ({p.ranges} ranges) at "
            f"{p.latency_ms:.3g} ms, {p.worse_by:+.2f} {metric(result.metric).change_label} but at most "
            f"{p.worse_by_high:+.2f} on {result.samples} samples: more samples would show whether it meets the budget"
        )
    click.echo(f"plan: {result.path}\nconvert: {record['commands']['convert']}")
    if record["too_big"]:
        raise QualityGateError(
            f"no candidate within --max-drop {max_drop:g} is under --max-size {speed['max_size']} KiB: the smallest "
            f"({result.best.way}) is {result.best.size_bytes / 1024:.1f} KiB; it is saved in {result.path}"
        )
    if not result.met:
        row = metric(result.metric)
        raise QualityGateError(
            f"QAT needed: no PTQ candidate {record['target']['name']} runs meets --max-drop {max_drop:g} "
            f"{row.change_label} with 95% confidence; the best ({result.best.way}, {result.best.ranges} ranges) is "
            f"{result.best.worse_by:.2f} {row.change_label} worse (at most {result.best.worse_by_high:.2f}) on "
            f"{result.samples} samples; run: {record['commands']['qat']}"
        )


def _target_table(result, record) -> str:
    row = metric(result.metric)
    unit = row.change_label
    fp32 = record["fp32"]
    head = (
        f"{result.data}, {result.samples} samples, target {record['target']['name']}, latency on "
        f"{record['latency_on']}: {row.label} FP32 {row.show(result.fp32_value)}, budget {result.budget:g} {unit} "
        "worse" + (" (no labels: accuracy is top-1 agreement with FP32)" if result.label_free else "")
    )
    rows = [("", "FP32", "-", "(none)", row.show(fp32["value"]), "+0.00", "+0.00", f"{fp32['latency_ms']:.3g}",
             "-", f"{fp32['size_bytes'] / 1024:.1f}")]  # fmt: skip
    for p in result.frontier:
        mark = "*" if p is result.best else ""
        rows.append(
            (mark, p.way, p.ranges, _names(p.changed) or "(none)", row.show(p.value), f"{p.worse_by:+.2f}",
             f"{p.worse_by_high:+.2f}", f"{p.latency_ms:.3g}", "-" if p.partitions is None else str(p.partitions),
             f"{p.size_bytes / 1024:.1f}")
        )  # fmt: skip
    header = ["", "way", "ranges", "layers moved", row.label, f"worse by ({unit})", "at most (95%)", "latency ms",
              "XNNPACK partitions", "size KiB"]  # fmt: skip
    if record["target"]["name"] != "cpu" and record["latency_on"].startswith("this host"):
        name = record["target"]["name"]
        head += f"\n(this host's CPU times the candidates, not a {name}: time them there with --on DEVICE)"
    note = "(* the chosen: the fastest whose paired 95% interval lies within the budget: 'at most' <= budget)"
    return head + "\n" + table(header, rows) + "\n" + note


def _given(name: str) -> bool:
    """Whether the user named option ``name`` (not its default)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE
