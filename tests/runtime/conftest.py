"""Fixtures for the device-side tests: the tiny committed models and a CLI runner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
INT8 = DATA / "tiny_int8.tflite"
UINT8 = DATA / "tiny_uint8.tflite"
FP32 = DATA / "tiny_fp32.tflite"
CUSTOM_OP = DATA / "tiny_custom_op.tflite"
EDGETPU = DATA / "tiny_edgetpu.tflite"
DIGITS = DATA / "tiny_digits.npz"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def run_cli(runner):
    """Invoke ``edgeq ARGS`` in-process; returns click's Result (stdout and stderr apart)."""
    from edgeq.cli import cli

    def invoke(*args: str):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


def edit_model(path: Path, edit) -> bytes:
    """Apply ``edit(model_t, schema)`` to the object-API model of ``path``; return new bytes."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    edit(model, schema)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory) -> Path:
    """A fresh virtualenv with only ``pip install edgeq`` (no extras): the device install.

    The package is installed from a copy of the checkout (so the build leaves nothing in
    the working tree); pip takes ai-edge-litert and numpy from its cache when it can.
    """
    root = tmp_path_factory.mktemp("base-install")
    source = root / "src"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        assert (ROOT / name).is_file(), f"{name} is missing: the package cannot be built"
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("edgeq", "models"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(source)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, f"pip install edgeq failed:\n{proc.stdout}\n{proc.stderr}"
    return venv
