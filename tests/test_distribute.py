"""edgeq train under tf.distribute: 2 real worker processes on 127.0.0.1, and 2 logical CPUs.

The same short digits-cnn schedule (FP32 + QAT) runs on 1 worker (in this process), on 2
workers (MultiWorkerMirroredStrategy, TF_CONFIG per process) and on 2 replicas in one
process (MirroredStrategy). Same global batch, same seed: the QAT models must reach test
accuracies within 0.5 pp, their int8 TFLite models must agree on >= 99% of the test
samples, every worker must end with the same quantizer ranges, and only the chief writes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from edgeq.errors import UsageError
from edgeq.train.distribute import cluster_config, setup

SCHEDULE = ["--epochs", "4", "--qat-epochs", "1", "--batch-size", "32", "--seed", "0", "--no-compare-int8"]
OUTPUTS = {"fp32.keras", "qat.h5", "qat_float.keras", "history.json", "run.json"}
HANG_GUARD_S = 900  # only to end a hung collective: a run takes about a minute


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return {**env, "TF_CPP_MIN_LOG_LEVEL": "3", **extra}


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _edgeq(*args, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "edgeq", "train", "digits-cnn", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=HANG_GUARD_S)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """The reference: the same schedule on one process, default strategy."""
    out = tmp_path_factory.mktemp("dist") / "one"
    (rc, stdout, stderr) = _finish([_edgeq("--out", str(out), *SCHEDULE, env=_env())])[0]
    assert rc == 0, stderr
    return out


def _int8(run_dir):
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    return convert(run_dir / "qat.h5", run_dir / "int8.tflite", ConvertOptions(mode="int8-only")).path


def _same_model(run_dir, reference_dir):
    """The run's int8 model against the reference run's: accuracy and agreement on the test split."""
    from edgeq.evaluate.run import evaluate

    return evaluate(_int8(run_dir), reference_dir / "int8.tflite", "digits")


def _check_against_one_worker(run_dir, one_worker, replicas: int, workers: int):
    record = json.loads((run_dir / "run.json").read_text())
    one = json.loads((one_worker / "run.json").read_text())
    dist = record["distribution"]
    assert (dist["replicas"], dist["workers"], dist["global_batch_size"]) == (replicas, workers, 32)
    assert one["distribution"]["replicas"] == 1
    qat, qat_one = record["results"][-1], one["results"][-1]
    assert qat["kind"] == "qat"
    assert abs(qat["test_value"] - qat_one["test_value"]) * 100 <= 0.5
    if not (one_worker / "int8.tflite").exists():
        _int8(one_worker)
    same = _same_model(run_dir, one_worker)
    assert same.agreement >= 0.99, same
    assert abs(same.value - same.reference_value) * 100 <= 0.5
    fp32 = record["results"][0]["test_value"]
    assert fp32 - same.value <= 0.005, (fp32, same.value)  # int8-only within 0.5 pp of FP32
    assert record["quantization"]["final_ranges"]["equal_across_local_replicas"] is True
    return record


@pytest.mark.slow  # a minute of two TensorFlow processes; make test keeps 2-replica ranges and the cluster spec
def test_two_worker_processes_train_what_one_does(tmp_path, one_worker):
    out = tmp_path / "two"
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = [
        _edgeq(
            "--out",
            str(out),
            *SCHEDULE,
            "--strategy",
            "multi-worker",
            env=_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})),
        )
        for i in range(2)
    ]
    (rc0, out0, err0), (rc1, out1, err1) = _finish(procs)
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert "worker done" in out1 and "worker done" not in out0
    record = _check_against_one_worker(out, one_worker, replicas=2, workers=2)
    # every worker ended with the chief's quantizer ranges
    assert record["quantization"]["final_ranges"]["sha256"] in out1
    # only the chief wrote, and nothing of the run is left behind
    assert {p.name for p in out.iterdir()} == OUTPUTS | {"int8.tflite", "int8.manifest.json"}
    for stderr in (err0, err1):
        assert "Traceback" not in stderr and "E0000" not in stderr


@pytest.mark.slow  # the default suite checks mirrored 2-replica ranges below
def test_two_logical_cpus_under_mirrored_train_what_one_does(tmp_path, one_worker):
    out = tmp_path / "mirrored"
    (rc, stdout, stderr) = _finish(
        [_edgeq("--out", str(out), *SCHEDULE, "--strategy", "mirrored", "--replicas", "2", env=_env())]
    )[0]
    assert rc == 0, stderr
    record = _check_against_one_worker(out, one_worker, replicas=2, workers=1)
    assert record["distribution"]["batchnorm"].startswith("statistics over the global batch")


def test_the_cluster_comes_from_tf_config_or_the_options(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(UsageError, match="TF_CONFIG"):
        cluster_config(None, None)
    config = cluster_config("10.0.0.1:2222,10.0.0.2:2222", 1)
    assert config == {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(UsageError, match="--worker-index, 0 to 1"):
        cluster_config("10.0.0.1:2222,10.0.0.2:2222", 2)
    with pytest.raises(UsageError, match="host:port"):
        cluster_config("10.0.0.1", 0)
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(UsageError, match="not a cluster spec"):
        cluster_config(None, None)
    three = {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(three))
    with pytest.raises(UsageError, match="task index 3"):
        cluster_config(None, None)


def test_a_strategy_after_tensorflow_started_is_one_clear_error():
    """In a process whose TensorFlow already runs (this one), logical devices cannot be added."""
    from edgeq.models.compat import tf

    tf.constant(1.0)
    with pytest.raises(UsageError, match="before TensorFlow starts.*own process"):
        setup("mirrored", replicas=2)
    with pytest.raises(UsageError, match="--replicas is for --strategy mirrored"):
        setup("default", replicas=2)
    with pytest.raises(UsageError, match="--workers and --worker-index are for"):
        setup("mirrored", workers="a:1")


@pytest.mark.slow
def test_a_killed_multi_worker_run_resumes_on_every_worker(tmp_path):
    """Both workers die (SIGKILL) after the chief checkpointed epoch 2; --resume on both finishes the run."""
    out = tmp_path / "run"
    hosts = [f"127.0.0.1:{p}" for p in _free_ports(2)]

    def worker(i, *extra, **env):
        return _edgeq(
            "--out", str(out), "--strategy", "multi-worker", "--workers", ",".join(hosts), "--worker-index", str(i),
            *extra, env=_env(**env),
        )  # fmt: skip

    procs = [worker(i, "--epochs", "4", "--qat-epochs", "1", EDGEQ_TEST_PAUSE_AFTER_EPOCH="2") for i in range(2)]
    try:
        for line in procs[0].stderr:  # the chief says when it has paused: no timer involved
            if "paused after epoch 2" in line:
                break
        else:
            pytest.fail(f"the chief ended before epoch 2: {procs[0].wait()}")
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert not (out / "run.json").exists()
    hosts[:] = [f"127.0.0.1:{p}" for p in _free_ports(2)]  # fresh ports: the killed ones may linger
    (rc0, out0, err0), (rc1, out1, err1) = _finish([worker(i, "--resume") for i in range(2)])
    assert rc0 == 0 and rc1 == 0, err0 + err1
    record = json.loads((out / "run.json").read_text())
    assert record["resumed_from"] == [0, 2]
    assert [len(s["epochs"]) for s in json.loads((out / "history.json").read_text())["stages"]] == [4, 1]
    assert record["quantization"]["final_ranges"]["sha256"] in out1
    assert {p.name for p in out.iterdir()} == OUTPUTS


RANGES_CHECK = r"""
import json, os, sys
os.environ["EDGEQ_DEFER_RUNTIME"] = "1"
from edgeq.train.distribute import setup

two = setup("mirrored", replicas=2).strategy
import numpy as np
from edgeq.models.compat import keras, tf
from edgeq.shims.tfmot import global_batch_ranges
from edgeq.train import schemes
from edgeq.train.stages import _compile, quantizer_ranges

rng = np.random.default_rng(0)
x = (rng.normal(size=(96, 8, 8, 1)) * rng.uniform(0.5, 3.0, size=(96, 1, 1, 1))).astype("float32")
y = rng.integers(0, 3, 96)
keras.utils.set_random_seed(0)
inputs = keras.Input((8, 8, 1))
h = keras.layers.ReLU()(keras.layers.Conv2D(4, 3)(inputs))
start = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))).get_weights()
out = {}
runs = [("one", tf.distribute.get_strategy(), True), ("two", two, True), ("two-unfixed", two, False)]
for name, strategy, fixed in runs:
    global_batch_ranges(fixed)
    with strategy.scope():
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.ReLU()(keras.layers.Conv2D(4, 3)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h)))
        model.set_weights(start)
        qat = schemes.build_qat_model(model, schemes.QuantSettings())
        _compile(qat, 1e-3)
    qat.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2, verbose=0)
    ranges = [w for w in qat.weights if w.name.endswith(("_min:0", "_max:0"))]
    values = [[w.name, np.asarray(w.numpy()).ravel().tolist()] for w in ranges]  # names differ: compare in order
    out[name] = {"summary": quantizer_ranges(qat), "values": values}
print(json.dumps(out))
"""


def test_two_replicas_update_ranges_from_the_global_batch():
    """TF-MOT alone: the 2 replicas end with different input ranges (each saw its half of every
    batch). With edgeq's shim: every replica holds the ranges a 1-replica run of the same batches
    reaches (the input range exactly, the moving averages to float rounding)."""
    run = subprocess.run(
        [sys.executable, "-c", RANGES_CHECK], capture_output=True, text=True, env=_env(), timeout=HANG_GUARD_S
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    one, two, unfixed = out["one"], out["two"], out["two-unfixed"]
    assert unfixed["summary"]["equal_across_local_replicas"] is False  # what TF-MOT does on its own
    assert two["summary"]["equal_across_local_replicas"] is True
    assert len(one["values"]) == len(two["values"]) > 2
    for (name, value), (_, other) in zip(one["values"], two["values"]):
        assert np.allclose(other, value, atol=1e-4), (name, value, other)
        if name.startswith("quantize_layer"):  # the input range: min/max over the same samples
            assert other == value, (name, value, other)
