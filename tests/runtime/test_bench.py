"""Benchmarks as tests (slow): edgeq profile agrees with litert-benchmark; int8 beats FP32.

They need the MobileNetV2 files that `python tools/make_tiny_models.py --skip-tiny
--mobilenetv2 runs/bench` writes on the host (TensorFlow); run with EDGEQ_SLOW=1.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from .conftest import ROOT

MODELS = ROOT / "runs" / "bench"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (MODELS / "mobilenetv2_int8.tflite").exists(),
        reason="no MobileNetV2 models: python tools/make_tiny_models.py --skip-tiny --mobilenetv2 runs/bench",
    ),
]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_device", ROOT / "tools" / "bench_device.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_profile_median_agrees_with_litert_benchmark(bench):
    # Alternate the two tools and keep each one's best median: on a shared machine a
    # single pair of runs can land on either side of a burst of background load.
    model = MODELS / "mobilenetv2_int8.tflite"
    reference, ours = [], []
    for _ in range(3):
        reference.append(bench.litert_benchmark_median(model, 1, 100, 10))
        ours.append(
            bench.edgeq_profile(model, threads=1, runs=100, warmup=10)[0]["model"]["runs"][0]["latency"]["median_ms"]
        )
    assert abs(min(ours) - min(reference)) / min(reference) <= bench.AGREEMENT, (ours, reference)


def test_int8_is_faster_and_smaller_than_fp32(bench):
    data, peak = bench.edgeq_profile(
        MODELS / "mobilenetv2_int8.tflite", "--compare", str(MODELS / "mobilenetv2_fp32.tflite"), runs=30
    )
    comparison = data["comparison"][0]
    assert comparison["speedup"] > 1.2 and comparison["size_ratio"] < 0.35
    assert peak < 400  # MiB for the whole `edgeq profile` process
