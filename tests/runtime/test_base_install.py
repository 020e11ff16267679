"""The device install: `pip install edgeq` alone, in a fresh virtualenv, runs profile and inspect."""

from __future__ import annotations

import json
import os
import subprocess

from .conftest import DIGITS, INT8

MAX_BASE_INSTALL_MB = 400  # numpy + ai-edge-litert + click (+ pip): about 165 MB in 2026


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


def test_base_install_has_no_tensorflow(base_venv, tmp_path):
    proc = _run(base_venv, base_venv / "bin" / "python", "-m", "pip", "list", "--format=json", cwd=tmp_path)
    installed = {p["name"].lower() for p in json.loads(proc.stdout)}
    assert {"edgeq", "numpy", "click", "ai-edge-litert"} <= installed
    assert not installed & {"tensorflow", "tensorflow-cpu", "tf-keras", "keras", "tensorflow-model-optimization"}
    assert _size_mb(base_venv) < MAX_BASE_INSTALL_MB


def test_base_install_profiles_and_inspects(base_venv, tmp_path):
    out = tmp_path / "profile.json"
    edgeq = base_venv / "bin" / "edgeq"
    proc = _run(base_venv, edgeq, "profile", INT8, "--data", DIGITS, "--runs", "20", "--json", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["runtime"] == "ai_edge_litert"
    assert data["model"]["accuracy"]["accuracy"] > 0.9
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
