"""The report's sections, each from the records it reads: models, outputs, training, plans, ops, fleet."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from edgeq.report import figures
from edgeq.report.format import Check, _metric, _name, _num, change_label, fixed, metric_change, metric_label
from edgeq.report.sources import Sources
from edgeq.tasks.verdicts import Verdict

log = logging.getLogger(__name__)


MODEL_FIELDS = (
    "reference", "mode", "dtype", "metric", "value", "worse_by", "agreement", "sqnr_db", "size_bytes", "size_ratio",
    "median_ms", "p90_ms", "speedup", "rss_mb", "threads", "integer_only", "verified", "data",
)  # fmt: skip


DEVICE_FIELDS = (
    "machine", "runtime", "model", "median_ms", "p90_ms", "value", "temperature_c", "throttled", "governor",
    "verify", "verify_ok", "top1_agreement", "metric",
)  # fmt: skip


def _models(sources: Sources) -> tuple[list[dict], list[Check]]:
    """One row per quantized model (and the FP32 reference): task metric, error, size, latency."""
    rows: dict[str, dict] = {}
    checks: list[Check] = []

    def row(key: str) -> dict:
        return rows.setdefault(key, {"model": key})

    for doc in sources.of("eval"):
        d = doc.data
        ref = row(_name(d["reference"]) + " (FP32 reference)")
        name = _eval_metric(d)
        ref.update(value=d["reference_value"], size_bytes=d["reference_size_bytes"], reference=True, metric=name)
        r = row(_name(d["model"]))
        r.update(
            metric=name,
            dtype=d.get("model_dtype"),
            value=d["value"],
            worse_by=d["worse_by"],
            agreement=d["agreement"],
            sqnr_db=d["sqnr_db"],
            size_bytes=d["size_bytes"],
            size_ratio=d.get("size_ratio"),
            data=d.get("data"),
        )
        checks += _eval_checks(d)
    for doc in sources.of("manifest"):
        d = doc.data
        r = row(_name(d["model"]))
        v = d.get("verification") or {}
        r.update(mode=d.get("mode"), integer_only=v.get("integer_only"), verified=v.get("passed"))
        r.setdefault("size_bytes", d.get("size_bytes"))
        r.setdefault("dtype", (d.get("input") or {}).get("dtype"))
        if d.get("mode") in ("int8-only", "edgetpu", "int16x8"):
            integer = bool(v.get("integer_only"))
            checks.append(
                Check(
                    integer,
                    f"{_name(d['model'])}: {'integer-only' if integer else 'NOT integer-only'} "
                    f"({d.get('mode')}; float ops: {', '.join(v.get('float_ops') or []) or 'none'})",
                )
            )
        if v and not v.get("passed", True):
            checks.append(
                Check(
                    False,
                    f"{_name(d['model'])}: failed verification after conversion (SQNR "
                    f"{fixed(v.get('sqnr_db'))} dB, minimum {fixed(v.get('min_sqnr_db'))} dB)",
                )
            )
    for doc in sources.of("profile"):
        if doc.device is not None:
            continue
        for profile, is_ref in ((doc.data.get("model"), False), (doc.data.get("reference"), True)):
            if not profile:
                continue
            facts = profile["model"]
            name = _name(facts["path"])
            key = next((k for k in rows if k == name or k.startswith(name + " ")), name)
            r = row(key)
            runs = profile.get("runs") or []
            if runs:
                first = runs[0]
                r.update(
                    median_ms=first["latency"]["median_ms"],
                    p90_ms=first["latency"].get("p90_ms"),
                    rss_mb=first["memory"].get("peak_rss_run_mb"),
                    threads=first.get("threads"),
                )
            r.setdefault("size_bytes", facts.get("size_bytes"))
            r.setdefault("integer_only", facts.get("integer_only"))
            if is_ref:
                r["reference"] = True
        # the speedup at the thread count the row's latency is from (the first one profiled)
        r = row(_name(doc.data["model"]["model"]["path"]))
        r["speedup"] = next(
            (c.get("speedup") for c in doc.data.get("comparison") or [] if c.get("threads") == r.get("threads")), None
        )
    ordered = sorted(rows.values(), key=lambda r: (not r.get("reference"), r["model"]))
    return [{**dict.fromkeys(MODEL_FIELDS), **r} for r in ordered], checks


def _eval_metric(d: dict) -> str:
    """What an eval record's ``value`` holds: its metric, else the first output's primary one."""
    if d.get("metric"):
        return d["metric"]
    if d.get("detection"):
        return "map50"
    return next((o["primary"] for o in d.get("outputs") or [] if o.get("primary")), "accuracy")


def _eval_checks(d: dict) -> list[Check]:
    """What an eval record says about its model: each output's verdict (n, change, interval), a
    detector's on its mAP@0.5 among them."""
    if d.get("verdicts"):
        return [Check(v.get("passed"), f"{_name(d['model'])}: {Verdict.from_dict(v).line()}") for v in d["verdicts"]]
    if d.get("labelled") is False:
        return [Check(None, f"{_name(d['model'])}: no labels, outputs compared only ({d.get('data')})")]
    return [Check(None, f"{_name(d['model'])}: no verdict in this record ({d.get('data')}): rerun edgeq eval on it")]


def _outputs(sources: Sources) -> list[dict]:
    """A row per output of each evaluated model and each device's profile, when a model has
    several outputs or its output is not a classifier's: each judged by its own task."""
    rows = []
    for doc in sources.of("eval"):
        d = doc.data
        outputs = d.get("outputs") or []
        if len(outputs) < 2 and all(o.get("task") == "classification" for o in outputs):
            continue
        det = d.get("detection")
        if det:
            rows.append(
                {
                    "where": _name(d["model"]),
                    "output": f"{det['boxes']} + {det['scores']}",
                    "task": f"detection ({det['layout']})",
                    "metrics": f"mAP@0.5 {det['reference_map50']:.4f} -> {det['map50']:.4f}, "
                    f"mAP@0.5:0.95 {det['reference_map']:.4f} -> {det['map']:.4f}",
                    "worse_by": det["worse_by"],
                    "unit": "points",
                    "sqnr_db": None,
                    "agreement": None,
                }
            )
        for o in outputs:
            c = o.get("comparison") or {}
            rows.append(
                {
                    "where": _name(d["model"]),
                    "output": o["name"],
                    "task": o["task"],
                    "metrics": ", ".join(
                        f"{k} {_metric(k, o['reference_metrics'].get(k))} -> {_metric(k, v)}"
                        for k, v in o["metrics"].items()
                    )
                    or "compared only",
                    "worse_by": o.get("worse_by"),
                    "unit": change_label(o["primary"]) if o.get("primary") else "",
                    "sqnr_db": c.get("sqnr_db"),
                    "agreement": c.get("agreement"),
                }
            )
    for doc in sources.of("profile"):
        if doc.device is None:
            continue
        det = ((doc.data.get("model") or {}).get("scores") or {}).get("detection")
        if det and det.get("map50") is not None:
            rows.append(
                {
                    "where": f"device {doc.device}",
                    "output": f"{det['boxes']} + {det['scores']}",
                    "task": f"detection ({det['layout']})",
                    "metrics": f"mAP@0.5 {det['map50']:.4f}, mAP@0.5:0.95 {det['map']:.4f} ({det.get('scored_by')})",
                    "worse_by": None,
                    "unit": "",
                    "sqnr_db": None,
                    "agreement": None,
                }
            )
        acc = ((doc.data.get("model") or {}).get("scores") or {}).get("outputs") or []
        agree = {o["name"]: o for o in ((doc.data.get("agreement") or {}).get("outputs") or [])}
        if len(acc) < 2 and all(o.get("task") == "classification" for o in acc):
            continue
        for o in acc:
            a = agree.get(o["name"], {})
            rows.append(
                {
                    "where": f"device {doc.device}",
                    "output": o["name"],
                    "task": o["task"],
                    "metrics": ", ".join(f"{k} {_metric(k, v)}" for k, v in o["metrics"].items()) or "compared only",
                    "worse_by": None,
                    "unit": "",
                    "sqnr_db": a.get("sqnr_db"),
                    "agreement": a.get("top1_agreement"),
                }
            )
    return rows


def _training(sources: Sources) -> list[dict]:
    runs = []
    histories = {doc.path.parent: doc for doc in sources.of("history")}
    for doc in sources.of("run"):
        d = doc.data
        history = histories.get(doc.path.parent)
        stages = history.data["stages"] if history else []
        runs.append(
            {
                "path": str(doc.path.parent),
                "model": (d.get("config") or {}).get("model"),
                "data": (d.get("config") or {}).get("data"),
                "results": d.get("results") or [],
                "seconds": d.get("train_seconds"),
                "float_layers": (d.get("quantization") or {}).get("float_layers") or [],
                "figure": figures.training_curves(stages) if stages else None,
            }
        )
    known = {Path(r["path"]) for r in runs}
    for parent, history in histories.items():  # a history without its run.json (an unfinished run)
        if parent not in known:
            runs.append(
                {
                    "path": str(parent),
                    "model": None,
                    "data": None,
                    "results": [],
                    "seconds": None,
                    "float_layers": [],
                    "figure": figures.training_curves(history.data["stages"]),
                }
            )
    return runs


def _sensitivity(sources: Sources) -> list[dict]:
    """The sensitivity sections, each in the order ``analyze sensitivity`` ranked and wrote its layers
    (fast: median channel SQNR, lowest first; exact: output MSE with only that layer int8, highest
    first): the page never ranks the layers a second, different way."""
    out = []
    for doc in sources.of("sensitivity"):
        d = doc.data
        fast = [f for f in d.get("fast") or [] if _num(f.get("channel_sqnr_db")) is not None]
        exact = d.get("exact") or []
        name = d.get("metric") or "accuracy"
        if any(_num(e.get("loss")) for e in exact):  # all zero: the SQNR bars say more
            figure = figures.sensitivity_bars(
                [e["layer"] for e in exact],
                [_num(e.get("loss")) or 0.0 for e in exact],
                f"{metric_label(name)} lost when only this layer is int8 ({change_label(name)}), "
                "most sensitive (by output error) first",
            )
        elif fast:
            figure = figures.sensitivity_bars(
                [f["layer"] for f in fast],
                [f["channel_sqnr_db"] for f in fast],
                "median channel SQNR of the layer's int8 output (dB; lower: more sensitive)",
            )
        else:
            continue
        out.append(
            {
                "path": str(doc.path),
                "model": d.get("model"),
                "data": d.get("data"),
                "metric": name,
                "fp32_value": d.get("fp32_value"),
                "int8_value": d.get("int8_value"),
                "figure": figure,
                "rows": [
                    {
                        "layer": f["layer"],
                        "sqnr": f.get("channel_sqnr_db"),
                        "worst": f.get("worst_channel_sqnr_db"),
                        "loss": next((e.get("loss") for e in exact if e["layer"] == f["layer"]), None),
                    }
                    for f in fast
                ],
            }
        )
    return out


def _plans(sources: Sources) -> tuple[list[dict], list[Check]]:
    out, checks = [], []
    for doc in sources.of("plan"):
        d = doc.data
        chosen = {"size_bytes": d.get("size_bytes"), "worse_by": d.get("worse_by")}
        points = [p for p in d.get("frontier") or [] if _num(p.get("size_bytes")) is not None]
        layers = d.get("layers") or {}
        out.append(
            {
                "path": str(doc.path),
                "metric": d.get("metric") or "accuracy",
                "verdict": Verdict.from_dict(d["verdict"]).line() if d.get("verdict") else None,
                "budget": d.get("budget"),
                "met": d.get("met"),
                "value": d.get("value"),
                "worse_by": d.get("worse_by"),
                "fp32_value": d.get("fp32_value"),
                "int8_value": d.get("int8_value"),
                "size_bytes": d.get("size_bytes"),
                "float_layers": [k for k, v in layers.items() if v == "float"],
                "int4_layers": [k for k, v in layers.items() if isinstance(v, dict) and v.get("weight_bits") == 4],
                "wide_layers": [k for k, v in layers.items() if isinstance(v, dict) and v.get("activation_bits") == 16],
                "figure": figures.plan_frontier(points, float(d.get("budget") or 0.0), chosen) if points else None,
                "target": _plan_target(d, points),
            }
        )
        if d.get("met") is not None:
            checks.append(
                Check(
                    bool(d["met"]),
                    f"plan {doc.path.name}: {'meets' if d['met'] else 'does not meet'} its "
                    f"{d.get('budget'):g} {change_label(d.get('metric'))} budget "
                    f"({metric_change(d.get('worse_by'), d.get('metric'))} on {d.get('samples', '?')} samples)",
                )
            )
    return out, checks


def _plan_target(d: dict, points: list[dict]) -> dict | None:
    """A plan for a --target: each candidate's latency, FP32's, and the chosen one (its frontier drawn
    as latency against the metric's change)."""
    target, fp32 = d.get("target"), d.get("fp32")
    if not isinstance(target, dict) or not isinstance(fp32, dict) or _num(fp32.get("latency_ms")) is None:
        return None
    timed = [p for p in points if _num(p.get("latency_ms")) is not None and _num(p.get("worse_by")) is not None]
    chosen = d.get("chosen") if isinstance(d.get("chosen"), int) else -1
    candidates = [
        {
            "way": p.get("way"),
            "ranges": p.get("ranges"),
            "moved": len(p.get("float_layers") or []) + len(p.get("wide_layers") or []),
            "value": p.get("value"),
            "worse_by": p.get("worse_by"),
            "latency_ms": p.get("latency_ms"),
            "size_bytes": p.get("size_bytes"),
            "chosen": i == chosen,
        }
        for i, p in enumerate(points)
        if p in timed
    ]
    best = next((c for c in candidates if c["chosen"]), None)
    if best is None:
        return None
    return {
        "name": target.get("name"),
        "on": d.get("latency_on") or "this host",
        "way": best["way"],
        "ranges": best["ranges"],
        "latency_ms": best["latency_ms"],
        "fp32_ms": fp32["latency_ms"],
        "fp32_size": fp32.get("size_bytes"),
        "faster": best["latency_ms"] < fp32["latency_ms"],
        "qat": (d.get("commands") or {}).get("qat"),
        "candidates": candidates,
        "figure": figures.speed_frontier(timed, float(d.get("budget") or 0.0), points[chosen], fp32),
    }


def _weights(sources: Sources) -> list[dict]:
    out = []
    for doc in sources.of("weights"):
        d = doc.data
        rows = []
        for layer in d.get("layers") or []:
            errors = {(e["bits"], e["granularity"], e["scheme"], e["rounding"]): e for e in layer.get("errors") or []}

            def db(bits, gran, rounding="nearest", errors=errors):
                e = errors.get((bits, gran, "symmetric", rounding))
                return e["sqnr_db"] if e else None

            rows.append(
                {
                    "name": layer["name"],
                    "kind": layer.get("kind"),
                    "std": layer.get("std"),
                    "kurtosis": layer.get("kurtosis"),
                    "outliers": layer.get("outlier_fraction"),
                    "spread": layer.get("channel_range_spread"),
                    "int8_tensor": db(8, "per-tensor"),
                    "int8_channel": db(8, "per-channel"),
                    "int4_channel": db(4, "per-channel"),
                    "recommendation": layer.get("recommendation"),
                }
            )
        rows.sort(key=lambda r: _num(r["int8_channel"]) if _num(r["int8_channel"]) is not None else math.inf)
        histograms = []
        if d.get("plots"):
            folder = Path(d["plots"])
            if not folder.is_absolute() and not folder.is_dir():
                folder = doc.path.parent / folder.name
            for r in rows[:3]:  # the worst layers
                png = folder / f"hist_{r['name'].replace('/', '_')}.png"
                if png.is_file():
                    histograms.append({"layer": r["name"], "uri": figures.png_uri(png)})
        out.append({"path": str(doc.path), "model": d.get("model"), "rows": rows, "histograms": histograms})
    return out


def _ops(sources: Sources) -> list[dict]:
    from edgeq.runtime.inspect import inspect_tflite

    out = []
    for path in sources.tflite:
        try:
            r = inspect_tflite(path)
        except Exception as exc:  # a file that is not a model gets a line, not a broken report
            log.warning("%s: cannot read as a TFLite model (%s)", path, exc)
            continue
        by_type: dict[tuple[str, str], int] = {}
        for op in r.ops:
            by_type[(op.op_type, op.precision)] = by_type.get((op.op_type, op.precision), 0) + 1
        tpu = r.edgetpu
        out.append(
            {
                "path": str(path),
                "name": path.name,
                "size_bytes": r.size_bytes,
                "integer_only": r.integer_only,
                "total": r.op_summary.total,
                "int8_share": r.op_summary.int8_share,
                "float_ops": r.op_summary.float_ops,
                "int16_ops": r.op_summary.int16_ops,
                "rows": [{"op": k[0], "precision": k[1], "count": n} for k, n in sorted(by_type.items())],
                "edgetpu": {
                    "compatible": tpu.compatible,
                    "compiled": tpu.compiled,
                    "mappable": tpu.ops_mappable,
                    "checked": tpu.ops_checked,
                    "first_fallback": (
                        f"op {tpu.first_fallback.index} {tpu.first_fallback.op_type}: "
                        + "; ".join(tpu.first_fallback.reasons)
                        if tpu.first_fallback is not None
                        else None
                    ),
                },
            }
        )
    return out


def _fleet(sources: Sources) -> tuple[list[dict], list[Check]]:
    devices: dict[str, dict] = {}
    checks: list[Check] = []
    for doc in sources.of("profile"):
        if doc.device is None:
            continue
        d = doc.data
        env = d.get("environment") or {}
        runs = (d.get("model") or {}).get("runs") or []
        acc = (d.get("model") or {}).get("scores") or {}
        devices.setdefault(doc.device, {"device": doc.device}).update(
            machine=env.get("machine"),
            runtime=f"{env.get('runtime')} {env.get('runtime_version')}",
            model=_name((d.get("model") or {}).get("model", {}).get("path", "")),
            median_ms=runs[0]["latency"]["median_ms"] if runs else None,
            p90_ms=runs[0]["latency"].get("p90_ms") if runs else None,
            value=acc.get("value"),
            metric=acc.get("metric") or "accuracy",
            temperature_c=env.get("temperature_c"),
            governor=env.get("governor"),
        )
        thermal = d.get("thermal") or {}
        if thermal:
            row = devices[doc.device]
            before, after = thermal.get("before") or {}, thermal.get("after") or {}
            if before.get("temperature_c") is not None:
                row["temperature_c"] = f"{before['temperature_c']:.1f} → {after.get('temperature_c', float('nan')):.1f}"
            row["throttled"] = {True: "THROTTLED", False: "no", None: "n/a"}[thermal.get("throttled_during")]
            if thermal.get("throttled_during"):
                text = f"device {doc.device} throttled during the timed runs: its latency is not its own"
                checks.append(Check(False, text))
    for doc in sources.of("verify"):
        for v in doc.data.get("devices") or []:
            row = devices.setdefault(v["device"], {"device": v["device"]})
            if v.get("status") == "failed":
                row["verify"] = "failed: " + str(v.get("error") or "")
                checks.append(Check(False, f"device {v['device']}: verify failed ({v.get('error')})"))
                continue
            row["verify"] = (
                "bit-exact"
                if v.get("bit_exact")
                else f"max |diff| {v.get('max_abs_diff'):g} (tolerance {v.get('tolerance'):g})"
            )
            if len(v.get("outputs") or []) > 1:  # which head differs is the point
                row["verify"] += (
                    " ("
                    + ", ".join(f"{o['name']} {'bit-exact' if o.get('bit_exact') else 'differs'}" for o in v["outputs"])
                    + ")"
                )
            row["verify_ok"] = v.get("status") == "ok"
            row["top1_agreement"] = v.get("top1_agreement")
            row.setdefault("machine", v.get("device_machine"))
            row.setdefault("runtime", v.get("device_runtime"))
            if v.get("status") != "ok":
                checks.append(Check(False, f"device {v['device']}: outputs differ from the host's ({row['verify']})"))
    if devices and not any(c.ok is False for c in checks) and sources.of("verify"):
        checks.append(Check(True, f"{len(devices)} device(s): outputs as the host's"))
    return [{**dict.fromkeys(DEVICE_FIELDS), **r} for r in sorted(devices.values(), key=lambda r: r["device"])], checks


def _provenance(sources: Sources) -> list[dict]:
    """Each file: what it is, its hashes, the command and versions that made it (where recorded)."""
    rows = []
    for doc in sources.documents:
        d = doc.data
        prov = d.get("provenance") or {}
        data = d.get("data") if isinstance(d.get("data"), dict) else {}
        profiled = ((d.get("model") or {}).get("model") or {}) if doc.kind == "profile" else {}
        env = d.get("environment") or {}
        versions = ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items())
        if not versions and env:
            versions = f"edgeq {d.get('edgeq_version')}, {env.get('runtime')} {env.get('runtime_version')}"
        hashes = {"model": d.get("sha256") or profiled.get("sha256")}
        if isinstance(d.get("source"), dict):
            hashes["source"] = d["source"].get("sha256")
        hashes["data"] = d.get("calibration_data_sha256") or data.get("sha256")
        hashes.update(d.get("artifacts") or {})
        rows.append(
            {
                "file": str(doc.path),
                "kind": doc.kind,
                "hashes": {k: v for k, v in hashes.items() if v},
                "command": prov.get("command"),
                "versions": versions,
            }
        )
    return rows
