"""The interpreter loader: backends, int8/uint8 I/O, delegates, bad models."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeq.errors import ModelLoadError, RuntimeBackendError
from edgeq.runtime.interpreter import TensorInfo, TFLiteModel, dequantize, quantize, select_backend

from .conftest import CUSTOM_OP, DIGITS, EDGETPU, FP32, INT8, UINT8


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["int8", "uint8"]),
    st.floats(1e-3, 1.0),
    st.integers(-128, 255),
    st.lists(st.floats(-200, 200), min_size=1, max_size=32),
)
def test_quantize_dequantize_roundtrip(dtype, scale, zero_point, values):
    limits = np.iinfo(dtype)
    zero_point = int(np.clip(zero_point, limits.min, limits.max))
    info = TensorInfo("t", 0, (len(values),), dtype, scale, zero_point)
    x = np.asarray(values, dtype=np.float32)
    q = quantize(x, info)
    assert q.dtype == np.dtype(dtype)
    back = dequantize(q, info)
    lo, hi = (limits.min - zero_point) * scale, (limits.max - zero_point) * scale
    inside = (x >= lo) & (x <= hi)
    # Inside the representable range the error is at most half a step; outside it clips.
    assert np.all(np.abs(back[inside] - x[inside]) <= scale / 2 + 1e-4)  # float32 rounding
    assert np.all(back[~inside] >= lo - 1e-4) and np.all(back[~inside] <= hi + 1e-4)
    np.testing.assert_array_equal(quantize(back, info), q)


def test_int8_and_uint8_io_give_the_same_predictions():
    data = np.load(DIGITS)
    x, y = data["x"][:100], data["y"][:100]
    int8 = TFLiteModel(INT8)
    uint8 = TFLiteModel(UINT8)
    assert (int8.input.dtype, uint8.input.dtype) == ("int8", "uint8")
    p8, pu8 = int8.predict(x), uint8.predict(x)
    np.testing.assert_allclose(p8, pu8, atol=2 * int8.output.scale)
    assert np.mean(np.argmax(p8, 1) == y) > 0.9
    fp32 = TFLiteModel(FP32).predict(x)
    assert np.abs(fp32 - p8).max() < 0.2
    assert int8.backend.name == "ai_edge_litert" and int8.backend_version == "2.3.0"


def test_no_default_delegate_matches_xnnpack():
    x = np.load(DIGITS)["x"][:20]
    a = TFLiteModel(INT8, delegate="xnnpack").predict(x)
    b_model = TFLiteModel(INT8, delegate="none")
    assert b_model.delegate_name == "none"
    np.testing.assert_allclose(a, b_model.predict(x), atol=2 * b_model.output.scale)


def test_backends_by_name():
    backend, module = select_backend("ai_edge_litert")
    assert backend.name == "ai_edge_litert" and hasattr(module, "Interpreter")
    with pytest.raises(RuntimeBackendError, match="unknown runtime"):
        select_backend("onnx")
    try:
        import tflite_runtime.interpreter  # noqa: F401
    except Exception:  # not installed, or built for numpy 1 (the documented failure)
        with pytest.raises(RuntimeBackendError, match="pip install tflite-runtime"):
            select_backend("tflite_runtime")


def test_bad_models_are_errors_not_crashes(tmp_path):
    cut = tmp_path / "cut.tflite"
    cut.write_bytes(INT8.read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="truncated"):
        TFLiteModel(cut)
    with pytest.raises(ModelLoadError, match="EdgeqUnknownOp"):
        TFLiteModel(CUSTOM_OP)
    with pytest.raises(ModelLoadError, match="Edge TPU"):
        TFLiteModel(EDGETPU)
    # Without our own check the interpreter itself refuses it: our message is not the only guard.
    with pytest.raises(ModelLoadError, match="unresolved custom op"):
        TFLiteModel(CUSTOM_OP, delegates=[], use_default_delegates=True, delegate=None, verify=False)


def test_delegates_that_cannot_load(tmp_path):
    with pytest.raises(RuntimeBackendError, match=r"libedgetpu.*deploy/CORAL.md"):
        TFLiteModel(INT8, delegate="edgetpu")
    not_a_library = tmp_path / "libfake_delegate.so"
    not_a_library.write_bytes(b"\x7fELF-not-really")
    with pytest.raises(RuntimeBackendError, match="cannot be loaded"):
        TFLiteModel(INT8, delegate=str(not_a_library))
    with pytest.raises(RuntimeBackendError, match="no such delegate library"):
        TFLiteModel(INT8, delegate="gpu-please")


def test_corrupted_models_never_crash_the_process():
    """Byte-flipped models through load + predict in a child process: errors, never a segfault.

    (Without the scale/zero-point/shape checks in flatbuffer.py, seed 262 of the uint8 model makes
    LiteRT's allocate_tensors segfault.)
    """
    code = f"""
import random, sys
import numpy as np
from edgeq.errors import EdgeqError
from edgeq.runtime.interpreter import TFLiteModel
for path in ({str(INT8)!r}, {str(UINT8)!r}):
    data = open(path, "rb").read()
    for k in range(300):  # k=262 of the uint8 model segfaulted LiteRT before the checks
        rng = random.Random(k)
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            TFLiteModel(model_content=bytes(b)).predict(np.zeros((2, 8, 8, 1), np.float32))
        except EdgeqError:
            pass
print("DONE")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert "DONE" in proc.stdout
