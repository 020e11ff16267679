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
def edgeq_wheel(tmp_path_factory) -> Path:
    """The edgeq wheel built from a copy of the checkout (the build leaves nothing in the
    working tree): what `pip install edgeq` takes from an index."""
    root = tmp_path_factory.mktemp("edgeq-wheel")
    source = root / "src"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        assert (ROOT / name).is_file(), f"{name} is missing: the package cannot be built"
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("edgeq",):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps"]
    proc = subprocess.run([*pip, "-w", str(root / "dist"), str(source)], capture_output=True, text=True,
                          timeout=600, cwd=root)  # fmt: skip
    assert proc.returncode == 0, f"pip wheel edgeq failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = (root / "dist").glob("edgeq-*.whl")
    return wheel


def install_venv(root: Path, *requirements: str) -> tuple[Path, subprocess.CompletedProcess]:
    """A fresh virtualenv with ``pip install REQUIREMENTS`` in it, pip run from this Python
    (``--python``): ensurepip's own install of pip would cost more than edgeq's. pip takes
    the dependencies from its cache when it can."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet"]
    pip += ["--disable-pip-version-check", "--no-compile", *requirements]
    return venv, subprocess.run(pip, capture_output=True, text=True, timeout=1200, env=env, cwd=root)


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory, edgeq_wheel) -> Path:
    """A fresh virtualenv with only ``pip install "edgeq[litert]"``: the device install."""
    venv, proc = install_venv(tmp_path_factory.mktemp("base-install"), f"{edgeq_wheel}[litert]")
    assert proc.returncode == 0, f"pip install edgeq[litert] failed:\n{proc.stdout}\n{proc.stderr}"
    return venv


@pytest.fixture(scope="session")
def tflite_runtime_venv(tmp_path_factory, edgeq_wheel) -> Path:
    """``pip install "edgeq[tflite-runtime]"``: numpy 1.x, tflite-runtime and no LiteRT, as on
    a Coral board or an older Raspberry Pi OS image."""
    venv, proc = install_venv(tmp_path_factory.mktemp("tflite-runtime-install"), f"{edgeq_wheel}[tflite-runtime]")
    if proc.returncode != 0 and "No matching distribution found for tflite-runtime" in proc.stderr:
        pytest.skip(f"tflite-runtime has no wheel for Python {sys.version_info[0]}.{sys.version_info[1]} here")
    assert proc.returncode == 0, f"pip install edgeq[tflite-runtime] failed:\n{proc.stdout}\n{proc.stderr}"
    return venv


@pytest.fixture(scope="session")
def bare_venv(tmp_path_factory, edgeq_wheel) -> Path:
    """``pip install edgeq`` without an extra: numpy and click, no interpreter."""
    venv, proc = install_venv(tmp_path_factory.mktemp("bare-install"), str(edgeq_wheel))
    assert proc.returncode == 0, f"pip install edgeq failed:\n{proc.stdout}\n{proc.stderr}"
    return venv
