"""``edgeq profile``: latency, memory and accuracy of a .tflite model, without TensorFlow."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from edgeq.errors import UsageError
from edgeq.runtime.delegation import DelegateStructure
from edgeq.tasks.metrics import metric
from edgeq.ui import (
    failed_exit,
    health_options,
    host_key_option,
    human_bytes,
    inventory_option,
    ms,
    pct,
    progress_printer,
    rollout_options,
    select_devices,
    table,
    write_json_output,
)


def parse_threads(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise UsageError(f"--threads {text!r}: give thread counts separated by commas, e.g. 1,2,4") from None
    if not counts or any(c < 1 for c in counts):
        raise UsageError(f"--threads {text!r}: each count must be at least 1, e.g. 1,2,4")
    return counts


def render(report) -> str:
    """The report as text for people."""
    lines = _render_header(report)
    lines.append("")
    lines += _render_runs(report)
    lines += _render_scores(report)
    if report.agreement is not None:
        a = report.agreement
        for o in a.outputs or ({"name": "", **dataclasses.asdict(a)},):
            label = f"vs reference, {o['name']}:" if len(a.outputs) > 1 else "vs reference:"
            agreement = f"top-1 agreement {pct(o['top1_agreement'])}, " if o["top1_agreement"] is not None else ""
            sqnr = f", SQNR {o['sqnr_db']:.1f} dB" if o.get("sqnr_db") is not None else ""
            lines.append(
                f"{label} {agreement}max |error| {o['max_abs_error']:.4g}, "
                f"mean |error| {o['mean_abs_error']:.4g}, rmse {o['rmse']:.4g}{sqnr}"
            )
    if report.comparison:
        rows = []
        label = "task metric"
        for c in report.comparison:
            row = metric(c.metric) if c.metric else None
            label = row.label if row else label
            drop = "n/a" if row is None or c.worse_by is None else row.show_change(c.worse_by)
            rows.append([str(c.threads), f"{c.speedup:.2f}x", f"{c.size_ratio:.3f}", drop])
        lines += ["", table(["threads", "speedup", "size ratio", f"{label} vs reference"], rows, numbers=True)]
    return "\n".join(lines)


def _render_header(report) -> list[str]:
    """The model, runtime, CPU, ops and thermal lines: what the timings below were measured on."""
    env = report.environment
    m = report.model.model
    ops = m.ops
    by_type = ", ".join(f"{name} x{count}" for name, count in ops.by_type.items())
    lines = [
        f"model    {m.path}  {human_bytes(m.size_bytes)}  sha256 {m.sha256[:12]}  "
        f"integer-only {'yes' if m.integer_only else 'no'}",
        f"runtime  {env.runtime} {env.runtime_version}, delegate {report.settings.delegate}, numpy {env.numpy_version}",
        f"cpu      {env.cpu_model}, {env.cores} cores ({env.cores_available} available), "
        f"governor {env.governor or 'n/a'}",
        f"ops      {ops.total} (int8 {100 * ops.int8_share:.0f}%, float {100 * ops.float_share:.0f}%): {by_type}",
    ]
    t = report.thermal
    if t is not None and (t.before.temperature_c is not None or t.before.throttled is not None):
        temps = f"{t.before.temperature_c} -> {t.after.temperature_c} C" if t.before.temperature_c is not None else ""
        flags = f"throttle flags {t.before.throttled} -> {t.after.throttled}" if t.before.throttled else ""
        lines.append(f"thermal  {', '.join(x for x in (temps, flags) if x)}")
        if t.throttled_during:
            lines.append("WARNING  the device throttled during the timed runs: these latencies are not its normal ones")
    return lines


def _render_runs(report) -> list[str]:
    """The latency and memory table, one row per model and thread count, and how the latencies were taken."""
    m = report.model.model
    headers = ["model", "threads", "init ms", "first ms", "mean", "median", "p90", "p99", "std", "min", "max"]
    headers += ["inf/s", "RSS load MiB", "RSS run MiB"]
    rows = []
    profiles = [(Path(m.path).name, report.model)]
    if report.reference is not None:
        profiles.append((Path(report.reference.model.path).name + " (ref)", report.reference))
    for name, prof in profiles:
        for run in prof.runs:
            lat = run.latency
            rows.append(
                [
                    name,
                    str(run.threads),
                    ms(run.init_ms),
                    ms(run.first_inference_ms),
                    ms(lat.mean_ms),
                    ms(lat.median_ms),
                    ms(lat.p90_ms),
                    ms(lat.p99_ms),
                    ms(lat.std_ms),
                    ms(lat.min_ms),
                    ms(lat.max_ms),
                    f"{lat.throughput_per_s:.1f}",
                    f"{run.memory.peak_rss_load_mb:.1f}",
                    f"{run.memory.peak_rss_run_mb:.1f}",
                ]
            )
    lines = [table(headers, rows, numbers=True)]
    runs = report.model.runs[0].latency
    lines.append(f"(latency in ms over {runs.runs} runs after {runs.warmup} warm-up)")
    for name, prof in profiles:
        record = prof.runs[0].partitions if prof.runs else None
        if record is not None:
            lines.append(f"{name}: {DelegateStructure(**record).summary()}")
    return lines


def _render_scores(report) -> list[str]:
    """The task metric lines (per output, or one line), and detection mAP, each beside the reference's."""
    lines: list[str] = []
    if report.model.scores is not None:
        acc = report.model.scores
        reference = report.reference.scores if report.reference is not None else None
        if len(acc.outputs) > 1 or (acc.outputs and acc.outputs[0]["task"] not in ("classification", "binary")):
            theirs = {o["name"]: o["metrics"] for o in (reference.outputs if reference else ())}
            lines.append("")
            for o in acc.outputs:
                shown = ", ".join(_metric(k, v) for k, v in o["metrics"].items()) or "no metric (compared only)"
                ref = ", ".join(_metric(k, v) for k, v in theirs.get(o["name"], {}).items())
                lines.append(f"{o['name']} ({o['task']}): {shown}" + (f"; reference {ref}" if ref else ""))
        else:
            row = metric(acc.metric or "accuracy")
            text = (
                f"{row.label} {row.show(acc.value)} on {acc.samples} samples"
                if acc.labelled
                else f"{row.label} n/a (no labels)"
            )
            if reference is not None:
                text += f", reference {row.show(reference.value)}"
            lines += ["", text]
    if report.model.scores is not None and report.model.scores.detection:
        d = report.model.scores.detection
        ref = (report.reference.scores.detection or {}) if report.reference and report.reference.scores else {}
        if d.get("map50") is None:
            lines.append(f"detection: {d['detections']} detections on {d['images']} images, scored by {d['scored_by']}")
        else:
            text = f"detection: mAP@0.5 {d['map50']:.4f}, mAP@0.5:0.95 {d['map']:.4f} on {d['images']} images"
            if ref.get("map50") is not None:
                text += f"; reference {ref['map50']:.4f} / {ref['map']:.4f}"
            lines.append(text)
    return lines


def _metric(name: str, value) -> str:
    row = metric(name)
    return f"{row.label} n/a" if value is None else f"{row.label} {row.show(value)}"


@click.command("profile")
@click.argument("model", metavar="MODEL.tflite")
@click.option("--compare", metavar="FP32.tflite", help="Reference model: speedup, size ratio, task metric change.")
@click.option("--threads", "threads_text", default="1", show_default=True, help="Thread counts to sweep: 1,2,4.")
@click.option("--runs", default=50, show_default=True, type=int, help="Timed invocations (at least).")
@click.option("--warmup", default=5, show_default=True, type=int, help="Untimed invocations first.")
@click.option("--min-seconds", default=0.0, show_default=True, type=float, help="Keep timing at least this long.")
@click.option("--data", metavar="FILE.npz", help="Inputs x (and labels y) for accuracy; x[0] is the timed input.")
@click.option("--labels", metavar="NAME", help="Array of labels in --data (required then); default: y if present.")
@click.option("--delegate", default="xnnpack", show_default=True, help="xnnpack | none | edgetpu | PATH to a library.")
@click.option("--runtime", metavar="NAME", help="Force a backend: ai_edge_litert, tflite_runtime, tensorflow.")
@click.option("--json", "json_out", metavar="OUT", help="Write the full result as JSON here.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on long runs).")
@click.option("--on", "on_targets", multiple=True, metavar="NAME|tag:X|all", help="Run on these devices over SSH.")
@inventory_option(help="Device inventory (with --on).")
@rollout_options
@health_options
@click.option("--results", "results_dir", default="results", show_default=True, help="With --on: JSON to DIR/DEVICE/.")
@host_key_option(help="With --on: record unknown host keys (changed ones fail).")
def profile(
    model: str,
    compare: str | None,
    threads_text: str,
    runs: int,
    warmup: int,
    min_seconds: float,
    data: str | None,
    labels: str | None,
    delegate: str,
    runtime: str | None,
    json_out: str | None,
    progress: bool | None,
    on_targets: tuple[str, ...] = (),
    inventory_path: str | None = None,
    rollout=None,
    health=None,
    results_dir: str = "results",
    accept_new_host_keys: bool = False,
) -> None:
    """Latency, memory and accuracy of MODEL.tflite on this machine (no TensorFlow).

    With --on, on each device instead: the files are pushed, edgeq profile runs there and
    its JSON comes back to RESULTS/DEVICE/; one table with a status column per device.
    """
    if on_targets:
        from edgeq.fleet.remote import ProfileOptions

        if json_out:
            raise UsageError("--json writes a local run; with --on each device's JSON goes to --results DIR/DEVICE/")
        parse_threads(threads_text)
        options = ProfileOptions(
            threads=threads_text,
            runs=runs,
            warmup=warmup,
            min_seconds=min_seconds,
            data=data,
            labels=labels,
            delegate=delegate,
            runtime=runtime,
            compare=compare,
        )
        _profile_fleet(model, options, on_targets, inventory_path, rollout, results_dir, accept_new_host_keys, health)
        return
    from edgeq.profile.results import report_to_dict
    from edgeq.profile.run import profile_model, write_detections

    report = profile_model(
        model,
        compare=compare,
        threads=parse_threads(threads_text),
        runs=runs,
        warmup=warmup,
        min_seconds=min_seconds,
        data=data,
        labels=labels,
        delegate=delegate,
        runtime=runtime,
        progress=progress,
    )
    click.echo(render(report))
    if json_out:
        write_json_output(report_to_dict(report), json_out)
        write_detections(report.model, detections_beside(json_out))


def detections_beside(json_path: str | Path) -> Path:
    """Where a detector's decoded detections go beside its profile JSON: NAME.detections.npz."""
    path = Path(json_path)
    return path.with_name(path.name.removesuffix(".json") + ".detections.npz")


def _profile_fleet(model, options, targets, inventory_path, rollout, results_dir, accept_new, health=None) -> None:
    """``edgeq profile --on``: bounded parallelism, failures contained, non-zero exit if any failed."""
    from edgeq.errors import ModelLoadError
    from edgeq.fleet.remote import for_each_device, profile_on

    for path in [model, options.compare, options.data]:
        if path and not Path(path).is_file():
            raise ModelLoadError(f"{path}: no such file")
    chosen = select_devices(inventory_path, targets, accept_new)
    outcomes = for_each_device(
        chosen,
        lambda device, on_event: profile_on(device, model, options, results_dir, on_event, health),
        rollout=rollout,
        on_event=progress_printer(),
    )
    rows = []
    for o in outcomes:
        r = o.result
        if r is None:
            rows.append([o.device, o.status, "-", "-", "-", "-", "-", f"{o.seconds:.1f}", o.error or ""])
            continue
        rows.append(
            [
                o.device,
                "ok",
                r.machine,
                r.runtime,
                ms(r.mean_ms),
                ms(r.median_ms),
                "-" if r.value is None else f"{metric(r.metric).label} {metric(r.metric).show(r.value)}",
                f"{o.seconds:.1f}",
                str(r.local_json),
            ]
        )
    headers = [
        "device",
        "status",
        "arch",
        "runtime",
        "mean ms",
        "median ms",
        "task metric",
        "seconds",
        "result / error",
    ]
    click.echo(table(headers, rows, numbers=True))
    failed_exit(outcomes)
