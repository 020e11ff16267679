"""Shared fixtures: one real digits-cnn training run (FP32 + QAT) for the whole session.

Everything is real: TensorFlow, TF-MOT, the TFLite converter and the LiteRT interpreter.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]


# What a test needs, by the fixtures it uses: `-m "not fleet"` and the like select by it.
NEEDS = {
    "fleet": {"fleet_env", "fleet"},
    "venv": {"edgeq_wheel", "base_venv", "tflite_runtime_venv", "bare_venv", "tflite_runtime_python"},
}


# The longest files of the default suite, longest first (from `pytest --durations`, 2026-12-07). pytest-xdist's
# loadfile hands files out in collection order, so a long file collected last keeps one worker busy while the
# other idles: the suite's wall time on 2 cores. Started first, they end beside the short ones.
LONGEST_FIRST = (
    "tests/test_train_options.py", "tests/test_optimize.py", "tests/test_detection.py", "tests/fleet/test_fleet.py",
    "tests/test_keras3_qat.py", "tests/test_ptq.py", "tests/test_convert.py", "tests/test_analyze.py",
)  # fmt: skip


def _started_first(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Markers by need (pyproject declares them); the longest files first (``LONGEST_FIRST``); and one gate:
    a test marked slow runs with EDGEQ_SLOW=1 (make test-all), else it is skipped."""
    items.sort(key=_started_first)  # stable: each file keeps its own order
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


def built_once(tmp_path_factory, name: str, build):
    """``build(folder)``'s result, built by one test process of the session and read back by the others.

    Under pytest-xdist each worker has its own session fixtures: a model that several files train was
    trained once per worker, each time the same. Here the first worker to ask builds it in a folder of the
    run's shared temp root, under an exclusive lock that the others block on (no polling, no timeout), and
    leaves the result pickled; the rest load it. The result must be picklable (paths, numbers), and tests
    write nothing into its folder (they copy it)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, record = root / f"built-{name}", root / f"built-{name}.pickle"
    with open(root / f"built-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until this process is done building or reading
        if record.is_file():
            return pickle.loads(record.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker: start clean
        folder.mkdir()
        value = build(folder)
        partial = record.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(value))
        partial.rename(record)
        return value


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """digits-cnn trained as the recipe says: FP32 then 8-bit QAT (once for all workers: built_once)."""
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    def build(folder):
        return train(TrainConfig(model="digits-cnn", out_dir=str(folder / "run"), data="digits"))

    return built_once(tmp_path_factory, "digits", build)


@pytest.fixture(scope="session")
def digits_int8(tmp_path_factory, digits_run):
    """The QAT model converted with --int8-only."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    def build(folder):
        return convert(digits_run.qat_model, folder / "digits_int8.tflite", ConvertOptions(mode="int8-only"))

    return built_once(tmp_path_factory, "digits_int8", build)


@pytest.fixture(scope="session")
def detector(tmp_path_factory):
    """The zoo detector, briefly trained (FP32 then QAT) on 300 built-in images at 64x64, converted
    integer-only from QAT; the test split exported for the device."""
    from click.testing import CliRunner

    from edgeq.cli import cli

    runner = CliRunner()
    data = "shapes:64:300"

    def run(*args):
        result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result

    def build(folder):
        run("train", "shapes-detector", "--data", data, "--epochs", "2", "--qat-epochs", "1", "--out", folder / "run")
        run("convert", folder / "run" / "qat.h5", "--int8-only", "--out", folder / "det_int8.tflite")
        run("data", "export", data, "--split", "test", "--out", folder / "test.npz")
        return folder, data

    return built_once(tmp_path_factory, "detector", build)


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


FACTOR = 1000.0


def _outlier_cnn(conv1_filters: int):
    from edgeq.models.compat import keras

    L = keras.layers
    inputs = L.Input((8, 8, 1), name="input")
    h = L.UpSampling2D(2, name="up")(inputs)
    h = L.Conv2D(conv1_filters, 3, padding="same", activation="relu", name="conv1")(h)
    h = L.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(h)
    h = L.MaxPooling2D(2, name="pool")(h)
    h = L.Conv2D(32, 3, padding="same", activation="relu", name="conv3")(h)
    return keras.Model(inputs, L.Dense(10, activation="softmax", name="head")(L.GlobalAveragePooling2D(name="gap")(h)))


@pytest.fixture(scope="session")
def outlier16(tmp_path_factory):
    """The outlier digits CNN (test_target_plans, test_optimize), trained once: with 16 conv1 filters, then
    given a 17th, filter 0 x1000, which conv2 reads with zero weights. The FP32 function is unchanged and
    every weight tensor keeps its scale; only conv1's activations span 1000x their useful range, which 16
    bits resolve and 8 do not."""
    import numpy as np

    from edgeq.data.sources import load_dataset
    from edgeq.models.compat import keras
    from edgeq.train.stages import _compile

    def build(folder):
        keras.utils.set_random_seed(0)
        d = load_dataset("digits")
        trained = _outlier_cnn(16)
        _compile(trained, 3e-3)
        trained.fit(d.x_train, d.y_train, epochs=12, batch_size=32, verbose=0)
        model = _outlier_cnn(17)
        for layer in trained.layers:
            if layer.name not in ("conv1", "conv2"):
                model.get_layer(layer.name).set_weights(layer.get_weights())
        w1, b1 = trained.get_layer("conv1").get_weights()
        model.get_layer("conv1").set_weights(
            [np.concatenate([w1, FACTOR * w1[..., :1]], -1), np.concatenate([b1, FACTOR * b1[:1]])]
        )
        w2, b2 = trained.get_layer("conv2").get_weights()
        model.get_layer("conv2").set_weights([np.concatenate([w2, np.zeros_like(w2[:, :, :1])], 2), b2])
        same = np.abs(model.predict(d.x_test, verbose=0) - trained.predict(d.x_test, verbose=0)).max()
        assert same < 1e-4, same
        path = folder / "outlier16.keras"
        model.save(path)
        return path

    return built_once(tmp_path_factory, "outlier16", build)
