"""Device-side benchmarks (TensorFlow-free): returns Markdown for BENCHMARKS.md.

What it measures, each in a fresh process so that memory and imports are its own:

1. ``edgeq profile`` median latency vs ``litert-benchmark`` (ships with ai-edge-litert)
   on the same model and thread count; the two should agree within 10%.
2. MobileNetV2 (alpha 1.0, 224x224) int8 vs FP32 speedup at 1 thread.
3. The size of a device install (``pip install "edgeq[litert]"``) in a fresh virtualenv.
4. Peak RSS of the ``edgeq profile`` process (and what it reports for the model).

The MobileNetV2 files come from ``tools/make_tiny_models.py --mobilenetv2 DIR`` (host, with
TensorFlow); without them those rows say how to make them. Usage::

    python tools/bench_device.py [--models runs/bench] [--threads 1] [--runs 50] [--no-venv]

From tools/bench.py: ``from bench_device import run; markdown = run()``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny_int8.tflite"
DIGITS = ROOT / "tests" / "data" / "tiny_digits.npz"
DEFAULT_MODELS = ROOT / "runs" / "bench"
AGREEMENT = 0.10  # edgeq profile and litert-benchmark medians within 10%


@dataclass(frozen=True)
class ProcessRun:
    returncode: int
    stdout: str
    stderr: str
    max_rss_mb: float
    wall_s: float


def _run(cmd: list[str], timeout: float = 900) -> ProcessRun:
    """Run ``cmd`` and return its output with the child's own peak RSS (wait4)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, text=True)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        rss = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
        return ProcessRun(proc.returncode, out.read(), err.read(), round(rss, 1), time.perf_counter() - start)


def _python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _litert_benchmark() -> list[str]:
    exe = Path(_python()).with_name("litert-benchmark")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("litert-benchmark")
    return [found] if found else [_python(), "-m", "ai_edge_litert.tools.benchmark_litert_model"]


def litert_benchmark_median(model: Path, threads: int, runs: int, warmup: int) -> float:
    """Median ms from litert-benchmark (stdout, 2 decimals; JSON as a fallback)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lb.json"
        cmd = _litert_benchmark() + [
            "--model",
            str(model),
            "--num_threads",
            str(threads),
            "--num_runs",
            str(runs),
            "--warmup_runs",
            str(warmup),
            "--result_json",
            str(out),
        ]
        result = _run(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"litert-benchmark failed: {result.stderr.strip().splitlines()[-1:]}")
        match = re.search(r"Inference \(median\):\s*([\d.]+)\s*ms", result.stdout + result.stderr)
        if match:
            return float(match.group(1))
        return float(json.loads(out.read_text())["latency"]["median_ms"])


def edgeq_profile(model: Path, *extra: str, threads: int = 1, runs: int = 50, warmup: int = 5) -> tuple[dict, float]:
    """Run ``edgeq profile`` in its own process; return (its JSON, the process's peak RSS MiB)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [_python(), "-m", "edgeq", "profile", str(model), "--threads", str(threads)]
        cmd += ["--runs", str(runs), "--warmup", str(warmup), "--no-progress", "--json", str(out), *extra]
        result = _run(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"edgeq profile failed: {result.stderr.strip()}")
        return json.loads(out.read_text()), result.max_rss_mb


def base_install_size() -> tuple[float, float, float]:
    """(venv MiB, installed packages MiB without pip/setuptools, seconds) of ``pip install "edgeq[litert]"``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("setup.py", "pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        for name in ("edgeq", "models"):
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        venv = Path(tmp) / "venv"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                f"{src}[litert]",
            ],
            check=True,
            cwd=tmp,
            capture_output=True,
        )
        seconds = time.perf_counter() - start
        site = next((venv / "lib").glob("python*/site-packages"))
        tooling = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "distutils-precedence.pth")
        packages = sum(_size_mb(p) for p in site.iterdir() if p.is_dir() and not p.name.startswith(tooling))
        return _size_mb(venv), round(packages, 1), seconds


def _size_mb(path: Path) -> float:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return round(total / 2**20, 1)


def _ensure_mobilenet(models: Path) -> tuple[Path, Path] | None:
    int8, fp32 = models / "mobilenetv2_int8.tflite", models / "mobilenetv2_fp32.tflite"
    if int8.exists() and fp32.exists():
        return int8, fp32
    return None


def run(
    report: object | None = None,
    *,
    models: Path = DEFAULT_MODELS,
    threads: int = 1,
    runs: int = 50,
    warmup: int = 5,
    venv: bool = True,
) -> str:
    """Measure everything and return a Markdown section. ``report`` is accepted for
    tools/bench.py's calling convention and not used."""
    del report
    lines = ["## Device side: `edgeq profile` (TensorFlow-free)", ""]
    env_line = None
    rows = []
    mobilenet = _ensure_mobilenet(Path(models))
    targets = [("tiny int8 CNN (8x8)", TINY)]
    if mobilenet:
        targets += [("MobileNetV2 1.0 224 int8", mobilenet[0]), ("MobileNetV2 1.0 224 FP32", mobilenet[1])]
    for label, model in targets:
        lb, ours, rss = [], [], 0.0
        for _ in range(2):  # alternate the two tools; keep each one's best median
            lb.append(litert_benchmark_median(model, threads, runs, warmup))
            data, rss = edgeq_profile(model, threads=threads, runs=runs, warmup=warmup)
            ours.append(data["model"]["runs"][0]["latency"]["median_ms"])
        env = data["environment"]
        env_line = (
            f"{env['cpu_model']}, {env['cores']} cores, governor {env['governor'] or 'n/a'}, "
            f"{env['runtime']} {env['runtime_version']}, numpy {env['numpy_version']}, Python {env['python']}"
        )
        mem = data["model"]["runs"][0]["memory"]
        lb_ms, our_ms = min(lb), min(ours)
        diff = (our_ms - lb_ms) / lb_ms if lb_ms > 0 else float("nan")
        meaningful = lb_ms >= 0.5  # litert-benchmark prints 2 decimals: sub-ms medians cannot be compared
        verdict = ("PASS" if abs(diff) <= AGREEMENT else "FAIL") if meaningful else "n/a (too fast to compare)"
        rows.append(
            f"| {label} | {threads} | {our_ms:.3f} | {lb_ms:.2f} | "
            f"{'' if not meaningful else f'{100 * diff:+.1f}%'} | {verdict} | "
            f"{mem['peak_rss_run_mb']:.0f} | {rss:.0f} |"
        )
    lines += [
        f"Machine: {env_line}. Best of 2 alternating runs of {runs} timed inferences after {warmup} warm-up.",
        "",
        "| model | threads | edgeq median ms | litert-benchmark median ms | difference | within 10% "
        "| peak RSS during runs MiB (reported) | peak RSS of the process MiB |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if mobilenet:
        data, _ = edgeq_profile(mobilenet[0], "--compare", str(mobilenet[1]), threads=1, runs=runs, warmup=warmup)
        c = data["comparison"][0]
        m, r = data["model"]["runs"][0]["latency"], data["reference"]["runs"][0]["latency"]
        lines += [
            "MobileNetV2 (alpha 1.0, 224x224, random weights) int8 vs FP32 at 1 thread:",
            "",
            "| model | size MiB | median ms | p90 ms | speedup | size ratio |",
            "|---|---|---|---|---|---|",
            f"| FP32 | {data['reference']['model']['size_bytes'] / 2**20:.1f} | {r['median_ms']:.2f} "
            f"| {r['p90_ms']:.2f} | 1.00x | 1.00 |",
            f"| int8 | {data['model']['model']['size_bytes'] / 2**20:.1f} | {m['median_ms']:.2f} "
            f"| {m['p90_ms']:.2f} | {c['speedup']:.2f}x | {c['size_ratio']:.2f} |",
            "",
        ]
    else:
        lines += [
            f"MobileNetV2 rows skipped: no models in {models}; make them on the host with "
            f"`python tools/make_tiny_models.py --skip-tiny --mobilenetv2 {models}`.",
            "",
        ]
    if venv:
        total, site, seconds = base_install_size()
        lines += [
            f'Device install (`pip install "edgeq[litert]"`, fresh virtualenv): {total:.0f} MiB in all, '
            f"{site:.0f} MiB for edgeq and its dependencies (numpy, click, ai-edge-litert, ...; pip itself excluded); "
            f"{seconds:.0f} s with a warm pip cache. No TensorFlow.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=DEFAULT_MODELS, help="folder with the MobileNetV2 .tflite")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-venv", action="store_true", help="skip the base-install size (builds a venv)")
    args = parser.parse_args()
    print(run(models=args.models, threads=args.threads, runs=args.runs, warmup=args.warmup, venv=not args.no_venv))


if __name__ == "__main__":
    main()
