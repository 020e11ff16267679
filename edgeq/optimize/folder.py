"""The folder ``edgeq optimize`` leaves: the chosen .tflite with its manifest, optimize.json, the QAT run (if
any), the plan, and a report.html of the ladder and the frontier."""

from __future__ import annotations

from pathlib import Path

from edgeq.artifacts import write_json_atomic
from edgeq.optimize.ladder import optimize


def optimize_folder(model, data: str, target: str, max_drop_pp: float, out: str | Path, **options) -> dict:
    """Climb the ladder (edgeq.optimize.ladder.optimize), write optimize.json and report.html in ``out``,
    and return the record (``gate(record)`` raises QualityGateError for a ladder that found nothing)."""
    from edgeq.report.build import build_report

    out = Path(out)
    record = optimize(model, data, target, max_drop_pp, out, **options)
    write_json_atomic(out / "optimize.json", record)
    record["report"] = str(build_report([out], out / "report.html").path)
    return record
