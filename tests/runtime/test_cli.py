"""`edgeq profile` and `edgeq inspect` as a user runs them: output, JSON, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from .conftest import CUSTOM_OP, DIGITS, EDGETPU, FP32, INT8, UINT8, edit_model

ENVIRONMENT_FIELDS = {"cpu_model", "cores", "governor", "runtime", "runtime_version", "numpy_version"}
LATENCY_FIELDS = {"mean_ms", "median_ms", "p90_ms", "p99_ms", "std_ms", "min_ms", "max_ms", "throughput_per_s"}


def edgeq(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgeq", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_profile_json_has_every_field(run_cli, tmp_path):
    out = tmp_path / "profile.json"
    result = run_cli(
        "profile", INT8, "--compare", FP32, "--threads", "1,2", "--runs", "20", "--warmup", "2",
        "--data", DIGITS, "--json", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "speedup" in result.stdout and "accuracy" in result.stdout
    data = json.loads(out.read_text())
    assert set(data["environment"]) >= ENVIRONMENT_FIELDS
    assert data["settings"]["threads"] == [1, 2]
    model = data["model"]
    assert model["model"]["sha256"] and model["model"]["size_bytes"] == INT8.stat().st_size
    assert {"by_type", "int8_share", "float_share"} <= set(model["model"]["ops"])
    for run in model["runs"] + data["reference"]["runs"]:
        assert set(run["latency"]) >= LATENCY_FIELDS
        assert {"init_ms", "first_inference_ms", "threads"} <= set(run)
        assert {"peak_rss_load_mb", "peak_rss_run_mb"} <= set(run["memory"])
    assert model["scores"]["value"] > 0.9
    assert {"top1_agreement", "max_abs_error", "mean_abs_error"} <= set(data["agreement"])
    for row in data["comparison"]:
        assert row["speedup"] > 0 and 0 < row["size_ratio"] < 1 and row["worse_by"] is not None


def test_inspect_prints_and_writes_json(run_cli, tmp_path):
    out = tmp_path / "inspect.json"
    result = run_cli("inspect", INT8, "--json", out)
    assert result.exit_code == 0, result.output
    for text in ("serving_default", "CONV_2D", "integer-only   yes", "compatible", "scale 0.00392157 zp -128"):
        assert text in result.stdout
    data = json.loads(out.read_text())
    assert data["integer_only"] is True and data["edgetpu"]["compatible"] is True
    assert data["inputs"][0]["dtype"] == "int8" and data["inputs"][0]["zero_point"] == [-128]
    assert data["tensors_by_dtype"]["int8"] == 10 and data["bytes_by_dtype"]["int8"] > 0
    assert [op["op_type"] for op in data["ops"]][:2] == ["CONV_2D", "MAX_POOL_2D"]

    fp32 = run_cli("inspect", FP32, "--no-ops")
    assert "integer-only   no" in fp32.stdout
    assert "op 0 CONV_2D falls back to the CPU" in fp32.stdout
    compiled = run_cli("inspect", EDGETPU)
    assert "compiled for the Edge TPU" in compiled.stdout


def _bad_inputs(tmp_path):
    cut = tmp_path / "cut.tflite"
    cut.write_bytes(INT8.read_bytes()[:3000])
    noise = tmp_path / "noise.tflite"
    noise.write_bytes(np.random.default_rng(3).integers(0, 256, 6000, dtype=np.uint8).tobytes())
    wrong_shape = tmp_path / "shape.npz"
    np.savez(wrong_shape, x=np.zeros((4, 28, 28, 1), np.float32), y=np.zeros(4, np.int64))
    wrong_dtype = tmp_path / "dtype.npz"
    np.savez(wrong_dtype, x=np.zeros((4, 8, 8, 1), np.complex64))
    unlabelled = tmp_path / "unlabelled.npz"
    np.savez(unlabelled, x=np.zeros((4, 8, 8, 1), np.float32))
    bad_scale = tmp_path / "bad_scale.tflite"  # this one crashed LiteRT's allocate_tensors

    def negative_scale(model, schema):
        model.subgraphs[0].tensors[0].quantization.scale = [-7.4e19]

    bad_scale.write_bytes(edit_model(UINT8, negative_scale))
    fake_delegate = tmp_path / "libnot_a_delegate.so"
    fake_delegate.write_text("not a shared library")
    return {
        "truncated": (["profile", cut], "truncated"),
        "truncated-inspect": (["inspect", cut], "truncated"),
        "random-bytes": (["profile", noise], "not a .tflite file"),
        "random-bytes-inspect": (["inspect", noise], "not a .tflite file"),
        "missing-file": (["profile", tmp_path / "nope.tflite"], "no such"),
        "corrupt-scale": (["profile", bad_scale], "invalid quantization scale"),
        "custom-op": (["profile", CUSTOM_OP], "custom op(s) EdgeqUnknownOp"),
        "edgetpu-compiled": (["profile", EDGETPU], "compiled for the Coral Edge TPU"),
        "npz-shape": (["profile", INT8, "--data", wrong_shape], "has shape (4, 28, 28, 1)"),
        "npz-dtype": (["profile", INT8, "--data", wrong_dtype], "is complex64"),
        "labels-missing": (["profile", INT8, "--data", unlabelled, "--labels", "y"], "labels missing"),
        "edgetpu-delegate": (["profile", INT8, "--delegate", "edgetpu"], "deploy/CORAL.md"),
        "delegate-library": (["profile", INT8, "--delegate", fake_delegate], "cannot be loaded"),
        "unknown-runtime": (["profile", INT8, "--runtime", "onnx"], "unknown runtime"),
        "bad-threads": (["profile", INT8, "--threads", "1,x"], "--threads"),
    }


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    failures = []
    for name, (args, message) in _bad_inputs(tmp_path).items():
        proc = edgeq(*args)
        lines = proc.stderr.strip().splitlines()
        ok = proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
        if not ok:
            failures.append(f"{name}: rc={proc.returncode} stderr={proc.stderr!r}")
        if proc.returncode < 0:  # killed by a signal: a crash, never acceptable
            failures.append(f"{name}: crashed with signal {-proc.returncode}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("command", ["profile", "inspect"])
def test_device_commands_never_import_tensorflow(command):
    code = (
        "import sys\n"
        "from edgeq.cli import main\n"
        f"sys.argv = ['edgeq', {command!r}, {str(INT8)!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print('TF_LOADED' if 'tensorflow' in sys.modules else 'TF_FREE')\n"
        "print('TFLITE_RUNTIME' if 'tflite_runtime' in sys.modules else '')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TF_FREE" in proc.stdout and "TF_LOADED" not in proc.stdout


def _pi_like(tmp_path, flags: list[str]):
    """A Raspberry Pi's thermal interfaces as files: sysfs zones and cpufreq, and a `vcgencmd`
    that answers get_throttled with ``flags`` in turn (this machine has neither)."""
    sysfs = tmp_path / "sys"
    for zone, milli in (("thermal_zone0", "61234"), ("thermal_zone1", "55000")):
        (sysfs / "class" / "thermal" / zone).mkdir(parents=True)
        (sysfs / "class" / "thermal" / zone / "temp").write_text(milli + "\n")
    (sysfs / "devices/system/cpu/cpu0/cpufreq").mkdir(parents=True)
    (sysfs / "devices/system/cpu/cpu0/cpufreq/scaling_cur_freq").write_text("1500000\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answers = tmp_path / "answers"
    answers.write_text("\n".join(flags) + "\n")
    script = bin_dir / "vcgencmd"
    script.write_text(
        f'#!/bin/sh\n[ "$1" = get_throttled ] || exit 1\nhead -n 1 "{answers}" | sed "s/^/throttled=/"\n'
        f'sed -i 1d "{answers}"\n'
    )
    script.chmod(0o755)
    return sysfs, bin_dir


@pytest.mark.parametrize("flags, throttled", [(["0x0", "0x20002"], True), (["0x50000", "0x50000"], False)])
def test_profile_reads_thermals_before_and_after_and_flags_throttling(run_cli, tmp_path, monkeypatch, flags, throttled):
    import os

    sysfs, bin_dir = _pi_like(tmp_path, flags)
    monkeypatch.setenv("EDGEQ_SYSFS", str(sysfs))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "p.json"
    result = run_cli("profile", INT8, "--runs", "5", "--json", out)
    assert result.exit_code == 0, result.output
    thermal = json.loads(out.read_text())["thermal"]
    assert thermal["before"] == {"temperature_c": 61.2, "cpu_mhz": 1500.0, "throttled": flags[0]}
    assert thermal["after"]["throttled"] == flags[1]
    # 0x20002: capped now, and since boot; 0x50000: under-voltage and throttling before the run, not in it
    assert thermal["throttled_during"] is throttled
    assert ("WARNING  the device throttled" in result.stdout) is throttled
    assert "thermal  61.2 -> 61.2 C" in result.stdout


def test_profile_without_throttle_flags_says_it_cannot_tell(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no vcgencmd, as on this machine and most non-Pi boards
    out = tmp_path / "p.json"
    assert run_cli("profile", INT8, "--runs", "5", "--json", out).exit_code == 0
    assert json.loads(out.read_text())["thermal"]["throttled_during"] is None
