"""Shared fixtures: one real digits-cnn training run (FP32 + QAT) for the whole session.

Everything is real: TensorFlow, TF-MOT, the TFLite converter and the LiteRT interpreter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1"

ROOT = Path(__file__).resolve().parents[1]


# What a test needs, by the fixtures it uses: `-m "not fleet"` and the like select by it.
NEEDS = {
    "fleet": {"fleet_env", "fleet"},
    "venv": {"edgeq_wheel", "base_venv", "tflite_runtime_venv", "bare_venv", "tflite_runtime_python"},
}


def pytest_collection_modifyitems(config, items):
    """Markers by need (pyproject declares them); and one gate: a test marked slow runs with
    EDGEQ_SLOW=1 (make test-all), else it is skipped."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in NEEDS.items():
            if used & fixtures or (marker == "fleet" and "tests/fleet/" in item.nodeid):
                item.add_marker(marker)
    if os.environ.get("EDGEQ_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with EDGEQ_SLOW=1 (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """digits-cnn trained as the recipe says: FP32 then 8-bit QAT."""
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    out = tmp_path_factory.mktemp("digits") / "run"
    return train(TrainConfig(model="digits-cnn", out_dir=str(out), data="digits"))


@pytest.fixture(scope="session")
def digits_int8(digits_run):
    """The QAT model converted with --int8-only."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    return convert(digits_run.qat_model, digits_run.out_dir / "digits_int8.tflite", ConvertOptions(mode="int8-only"))


@pytest.fixture(scope="session")
def detector(tmp_path_factory):
    """The zoo detector, briefly trained (FP32 then QAT) on 300 built-in images at 64x64, converted
    integer-only from QAT; the test split exported for the device."""
    from click.testing import CliRunner

    from edgeq.cli import cli

    folder = tmp_path_factory.mktemp("detector")
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result

    data = "shapes:64:300"
    run("train", "shapes-detector", "--data", data, "--epochs", "2", "--qat-epochs", "1", "--out", folder / "run")
    run("convert", folder / "run" / "qat.h5", "--int8-only", "--out", folder / "det_int8.tflite")
    run("data", "export", data, "--split", "test", "--out", folder / "test.npz")
    return folder, data


@pytest.fixture
def finetune(digits_run):
    """QAT (no FP32 epochs) from the trained digits FP32 model, with the given options."""
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    def run(out_dir, **options):
        return train(
            TrainConfig(model=str(digits_run.fp32_model), data="digits", out_dir=str(out_dir), epochs=0, **options)
        )

    return run


@pytest.fixture
def cli():
    """Invoke `edgeq ...` in-process; returns click's Result (exit_code, stdout, stderr)."""
    from click.testing import CliRunner

    from edgeq.cli import cli as group

    runner = CliRunner()

    def invoke(*args):
        args = [str(a) for a in args]
        if args[:1] == ["train"] and "--compare-int8" not in args:
            args.append("--no-compare-int8")  # two more conversions per run: tests/test_distill.py asks for them
        return runner.invoke(group, args, catch_exceptions=False)

    return invoke


def assert_one_line_error(result, *fragments):
    """A user error: non-zero exit, one `error:` line naming what is wrong, no traceback."""
    assert result.exit_code != 0, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def python():
    return sys.executable
