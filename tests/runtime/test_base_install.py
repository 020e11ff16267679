"""The device installs, each in a fresh virtualenv from the edgeq wheel: `pip install "edgeq[litert]"`
and `pip install "edgeq[tflite-runtime]"` run profile and inspect without TensorFlow; a bare
`pip install edgeq` says which of the two to add."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np

from .conftest import DIGITS, INT8, UINT8

MAX_BASE_INSTALL_MB = 400  # numpy + ai-edge-litert + click: about 135 MB in 2026
TENSORFLOW = {"tensorflow", "tensorflow-cpu", "tf-keras", "keras", "tensorflow-model-optimization"}


def _run(venv, *args, cwd, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _size_mb(path) -> float:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total / 2**20


def _installed(venv, cwd) -> dict[str, str]:
    """{distribution: version} in the venv (which has no pip of its own)."""
    code = "import importlib.metadata as m, json\n"
    code += "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"
    proc = _run(venv, venv / "bin" / "python", "-c", code, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_base_install_has_no_tensorflow(base_venv, tmp_path):
    installed = _installed(base_venv, tmp_path)
    assert {"edgeq", "numpy", "click", "ai-edge-litert"} <= installed.keys()
    assert not installed.keys() & TENSORFLOW
    assert _size_mb(base_venv) < MAX_BASE_INSTALL_MB


def test_base_install_profiles_and_inspects(base_venv, tmp_path):
    out = tmp_path / "profile.json"
    edgeq = base_venv / "bin" / "edgeq"
    proc = _run(base_venv, edgeq, "profile", INT8, "--data", DIGITS, "--runs", "20", "--json", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["runtime"] == "ai_edge_litert"
    assert data["model"]["scores"]["value"] > 0.9
    proc = _run(base_venv, edgeq, "inspect", INT8, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "integer-only   yes" in proc.stdout
    proc = _run(base_venv, edgeq, "profile", INT8.with_name("missing.tflite"), cwd=tmp_path)
    assert proc.returncode != 0 and proc.stderr.startswith("error: ")


def test_base_install_profile_leaves_tensorflow_unimported(base_venv, tmp_path):
    code = (
        "import sys\n"
        "from edgeq.cli import main\n"
        f"sys.argv = ['edgeq', 'profile', {str(INT8)!r}, '--runs', '5']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "import edgeq\n"
        "print('EDGEQ_AT', edgeq.__file__)\n"
        "print('TF_LOADED' if 'tensorflow' in sys.modules else 'TF_FREE')\n"
    )
    proc = _run(base_venv, base_venv / "bin" / "python", "-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "TF_FREE" in proc.stdout
    assert str(base_venv) in proc.stdout  # the installed package ran, not the checkout


def test_tflite_runtime_install_has_no_litert(tflite_runtime_venv, tmp_path):
    """`pip install "edgeq[tflite-runtime]"`: tflite-runtime on numpy 1.x, and no LiteRT."""
    installed = _installed(tflite_runtime_venv, tmp_path)
    assert {"edgeq", "click", "tflite-runtime", "tflite"} <= installed.keys()
    assert installed["numpy"].startswith("1."), installed["numpy"]
    assert "ai-edge-litert" not in installed and not installed.keys() & TENSORFLOW


def test_tflite_runtime_install_profiles_inspects_and_matches_litert(tflite_runtime_venv, tmp_path):
    """profile and inspect run through tflite_runtime (the `tflite` package reads the model), and the
    int8 and uint8 models' integer outputs equal this host's ai-edge-litert's, bit for bit."""
    edgeq = tflite_runtime_venv / "bin" / "edgeq"
    out = tmp_path / "profile.json"
    proc = _run(tflite_runtime_venv, edgeq, "profile", INT8, "--data", DIGITS, "--runs", "5", "--json", out,
                cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["runtime"] == "tflite_runtime"
    assert data["environment"]["numpy_version"].startswith("1.")
    assert data["model"]["scores"]["value"] > 0.9
    proc = _run(tflite_runtime_venv, edgeq, "inspect", INT8, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "integer-only   yes" in proc.stdout and "CONV_2D" in proc.stdout

    from edgeq.runtime.interpreter import TFLiteModel, quantize

    x = np.load(DIGITS)["x"][:50]
    np.save(tmp_path / "x.npy", x)
    for model in (INT8, UINT8):
        code = (
            "import sys, numpy as np\n"
            "from edgeq.runtime.interpreter import TFLiteModel, quantize\n"
            "m = TFLiteModel(sys.argv[1], delegate='none')\n"
            "x = np.load(sys.argv[2])\n"
            "raw = [m.invoke_raw(quantize(x[i : i + 1], m.input)) for i in range(len(x))]\n"
            "np.save(sys.argv[3], np.concatenate(raw))\n"
        )
        device_out = tmp_path / f"{model.stem}.npy"
        proc = _run(tflite_runtime_venv, tflite_runtime_venv / "bin" / "python", "-c", code, model, tmp_path / "x.npy",
                    device_out, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        host = TFLiteModel(model, runtime="ai_edge_litert", delegate="none")
        expected = np.concatenate([host.invoke_raw(quantize(x[i : i + 1], host.input)) for i in range(len(x))])
        got = np.load(device_out)
        assert got.dtype == expected.dtype and got.dtype in (np.int8, np.uint8)
        np.testing.assert_array_equal(got, expected)


def test_bare_install_names_the_extras(bare_venv, tmp_path):
    """`pip install edgeq` alone has no interpreter: profile exits with one line naming both extras."""
    installed = _installed(bare_venv, tmp_path)
    assert {"edgeq", "numpy", "click"} <= installed.keys()
    assert not installed.keys() & {"ai-edge-litert", "tflite-runtime", *TENSORFLOW}
    proc = _run(bare_venv, bare_venv / "bin" / "edgeq", "profile", INT8, "--runs", "1", cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "edgeq[litert]" in lines[0] and "edgeq[tflite-runtime]" in lines[0]
