"""The measurement library: latency, memory, accuracy, comparison, data checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeq.errors import DataError, UsageError
from edgeq.profile.host import peak_rss_mb, reset_peak_rss
from edgeq.profile.results import report_to_dict
from edgeq.profile.run import latency_stats, profile_model
from edgeq.profile.samples import load_npz
from edgeq.runtime.interpreter import TFLiteModel

from .conftest import DIGITS, FP32, INT8, UINT8


@pytest.fixture(scope="module")
def compared():
    return profile_model(INT8, compare=FP32, threads=(1, 2), runs=30, warmup=2, data=DIGITS)


def test_latency_stats_are_ordered():
    stats = latency_stats([5.0, 1.0, 2.0, 3.0, 4.0, 100.0], warmup=2)
    assert stats.min_ms == 1.0 and stats.max_ms == 100.0 and stats.median_ms == 3.5
    assert stats.min_ms <= stats.median_ms <= stats.p90_ms <= stats.p99_ms <= stats.max_ms
    assert stats.throughput_per_s == pytest.approx(1000 / 3.5, rel=1e-3)


def test_profile_compare_reports_everything(compared):
    r = compared
    assert [run.threads for run in r.model.runs] == [1, 2]
    assert [run.threads for run in r.reference.runs] == [1, 2]
    for run in r.model.runs + r.reference.runs:
        lat = run.latency
        assert lat.runs == 30 and lat.warmup == 2
        assert 0 < lat.min_ms <= lat.median_ms <= lat.max_ms
        assert run.init_ms > 0 and run.first_inference_ms > 0
        assert run.memory.peak_rss_run_mb >= 10 and run.memory.peak_rss_load_mb >= 10
    assert r.model.scores.value > 0.9 and r.reference.scores.value > 0.9
    assert r.agreement.top1_agreement > 0.95 and 0 <= r.agreement.max_abs_error < 0.3
    assert len(r.comparison) == 2
    first = r.comparison[0]
    assert first.speedup == pytest.approx(
        r.reference.runs[0].latency.median_ms / r.model.runs[0].latency.median_ms, rel=1e-3
    )
    assert first.size_ratio == pytest.approx(INT8.stat().st_size / FP32.stat().st_size, rel=1e-3)
    assert first.worse_by == pytest.approx(r.reference.scores.value - r.model.scores.value, abs=1e-6)
    assert r.model.model.integer_only and not r.reference.model.integer_only
    assert r.model.model.ops.int8_share == 1.0 and r.reference.model.ops.float_share == 1.0
    env = r.environment
    assert env.runtime == "ai_edge_litert" and env.runtime_version == "2.3.0"
    assert env.cores >= 1 and env.cpu_model and env.numpy_version == np.__version__
    assert r.data.samples == 200 and r.data.labels == "y"


def test_report_is_json(compared):
    data = json.loads(json.dumps(report_to_dict(compared)))
    assert data["schema"] == "edgeq.profile/1"
    assert data["model"]["model"]["sha256"] == compared.model.model.sha256
    assert set(data["comparison"][0]) >= {"speedup", "size_ratio", "worse_by", "top1_agreement"}


def test_min_seconds_keeps_running():
    report = profile_model(INT8, runs=5, warmup=0, min_seconds=0.3)
    lat = report.model.runs[0].latency
    assert lat.runs > 5
    assert report.comparison == () and report.reference is None and report.model.scores is None


def test_accuracy_without_labels_and_uint8_model(tmp_path):
    x = np.load(DIGITS)["x"][:40]
    unlabelled = tmp_path / "x.npz"
    np.savez(unlabelled, x=x)
    report = profile_model(UINT8, runs=3, warmup=0, data=unlabelled, compare=INT8)
    assert report.model.scores.labelled is False and report.model.scores.value is None
    assert report.comparison[0].worse_by is None
    assert report.agreement.samples == 40


def test_peak_rss_reset_and_read():
    """A 256 MiB array touched and freed raises the peak; the reset brings the peak back to what
    the process holds now, so each profiled model's peak is its own."""
    block = np.ones(256 << 17, dtype=np.float64)  # 256 MiB, every page written
    del block
    before = peak_rss_mb()
    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert peak_rss_mb() < before - 200, (before, peak_rss_mb())


@pytest.fixture(scope="module")
def model_input():
    return TFLiteModel(INT8).input


def test_npz_checks(tmp_path, model_input):
    x = np.load(DIGITS)["x"][:10]
    y = np.load(DIGITS)["y"][:10]
    cases = {
        "shape": (dict(x=x[:, :4]), None, "has shape"),
        "dtype": (dict(x=x.astype(np.complex64)), None, "is complex64"),
        "no-x": (dict(images=x), None, "no array 'x'"),
        "labels-missing": (dict(x=x), "labels", "labels missing"),
        "label-count": (dict(x=x, y=y[:5]), None, "5 labels"),
        "nan": (dict(x=np.full_like(x, np.nan)), None, "NaN"),
    }
    for name, (arrays, labels, message) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(DataError, match=message):
            load_npz(path, model_input, labels=labels)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a readable"):
        load_npz(garbage, model_input)
    onehot = tmp_path / "onehot.npz"
    np.savez(onehot, x=x, labels=np.eye(10)[y])
    data = load_npz(onehot, model_input, labels="labels")
    np.testing.assert_array_equal(data.y, y)
    raw = tmp_path / "raw.npz"
    from edgeq.runtime.interpreter import quantize

    np.savez(raw, x=quantize(x, model_input))
    np.testing.assert_allclose(load_npz(raw, model_input).x, x, atol=model_input.scale)


def test_labels_outside_the_output_classes(tmp_path):
    path = tmp_path / "wide.npz"
    np.savez(path, x=np.load(DIGITS)["x"][:10], y=np.arange(10) + 5)
    with pytest.raises(DataError, match="output classes"):
        profile_model(INT8, runs=1, warmup=0, data=path)


def test_bad_options():
    with pytest.raises(UsageError):
        profile_model(INT8, threads=())
    with pytest.raises(UsageError):
        profile_model(INT8, runs=0)
    with pytest.raises(UsageError, match="--labels needs --data"):
        profile_model(INT8, labels="y")
