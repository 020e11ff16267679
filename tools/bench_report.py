"""`edgeq report` on the demo run, for BENCHMARKS.md: how long the page takes and how big it is.

The demo's files as `make demo` writes them (training, int8-only conversion, eval with a budget,
profile), plus `analyze weights --plots` and `analyze sensitivity`, so that every section but the
fleet is drawn. The report's time is set against one `edgeq eval` of the same model, measured in
the same run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _edgeq(*args) -> float:
    from click.testing import CliRunner

    from edgeq.cli import cli

    start = time.perf_counter()
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return time.perf_counter() - start


def run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp) / "demo"
        _edgeq("train", "digits-cnn", "--data", "digits", "--out", demo)
        tflite = demo / "digits_int8.tflite"
        _edgeq("convert", demo / "qat.h5", "--int8-only", "--out", tflite)
        eval_args = ("eval", tflite, "--reference", demo / "fp32.keras", "--data", "digits", "--max-drop", "1.0")
        _edgeq(*eval_args, "--json", demo / "eval.json")
        eval_s = statistics.median(_edgeq(*eval_args) for _ in range(3))
        _edgeq("profile", tflite, "--runs", "50", "--json", demo / "profile.json")
        _edgeq("analyze", "weights", demo / "fp32.keras", "--json", demo / "weights.json", "--plots", demo / "plots")
        _edgeq("analyze", "sensitivity", demo / "fp32.keras", "--data", "digits", "--json", demo / "sensitivity.json")
        out = Path(tmp) / "report.html"
        times = [_edgeq("report", demo, "--out", out) for _ in range(5)]
        size = out.stat().st_size
    report_s = statistics.median(times)
    return "\n".join(
        [
            "## `edgeq report` on the demo run",
            "",
            "`python tools/bench.py --only report`: the demo's files (train, `convert --int8-only`, `eval --max-drop "
            "1.0`, `profile`) plus `analyze weights --plots` and `analyze sensitivity`, so every section but the "
            "fleet is drawn; `edgeq report DEMO` run in-process 5 times (the first one imports matplotlib and "
            "Jinja2).",
            "",
            "| report time (median of 5) | first run | one `edgeq eval` of the same model (median of 3) | "
            "report / eval | HTML size |",
            "|---|---|---|---|---|",
            f"| {report_s:.2f} s | {times[0]:.2f} s | {eval_s:.2f} s | {report_s / eval_s:.2f}x | "
            f"{size / 1024:.0f} KiB |",
            "",
        ]
    )
