"""The flatbuffer reader: what it reads matches the interpreter, and bad files are errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeq.errors import ModelLoadError
from edgeq.runtime.flatbuffer import (
    bytes_by_dtype,
    is_integer_only,
    op_summary,
    read_tflite,
    tensors_by_dtype,
    verify_tflite,
)
from edgeq.runtime.interpreter import TFLiteModel

from .conftest import CUSTOM_OP, EDGETPU, FP32, INT8, UINT8, edit_model


@pytest.mark.parametrize("path", [INT8, UINT8, FP32])
def test_reader_agrees_with_the_interpreter(path):
    desc = read_tflite(path)
    model = TFLiteModel(path)
    details = model.interpreter.get_tensor_details()
    # The interpreter may add tensors (e.g. for delegates); the file's tensors come first.
    for tensor in desc.main.tensors:
        d = details[tensor.index]
        assert d["name"] == tensor.name
        assert np.dtype(d["dtype"]).name == tensor.dtype
        assert tuple(d["shape"]) == tensor.shape
        scales = d["quantization_parameters"]["scales"]
        np.testing.assert_allclose(scales, tensor.scale, rtol=1e-6)
        np.testing.assert_array_equal(d["quantization_parameters"]["zero_points"], tensor.zero_point)
    assert desc.main.inputs == tuple(t.index for t in model.inputs)
    assert desc.main.outputs == tuple(t.index for t in model.outputs)
    builtin_ops = [op.op_name for op in model.ops() if op.op_name != "DELEGATE"]
    assert [op.op_type for op in desc.main.operators] == builtin_ops


def test_int8_model_facts():
    desc = read_tflite(INT8)
    assert is_integer_only(desc)
    assert desc.signatures[0].key == "serving_default"
    assert list(desc.signatures[0].inputs) == ["image"]
    summary = op_summary(desc)
    assert summary.total == 6 and summary.int8_ops == 6 and summary.float_share == 0.0
    assert summary.by_type["CONV_2D"] == 2
    assert set(tensors_by_dtype(desc)) == {"int8", "int32"}
    weights = bytes_by_dtype(desc)
    # conv 8*3*3*1 + conv 16*3*3*8 + dense 16*10 int8 weights; biases int32
    assert weights["int8"] == 8 * 9 + 16 * 9 * 8 + 16 * 10
    assert weights["int32"] == 4 * (8 + 16 + 10) + 4 * 2  # biases and the MEAN axes
    assert sum(weights.values()) < desc.size_bytes
    conv = desc.main.operators[0]
    assert conv.fused_activation == "RELU"


def test_fp32_model_is_not_integer_only():
    desc = read_tflite(FP32)
    assert not is_integer_only(desc)
    assert op_summary(desc).float_ops == 6


def test_custom_ops_are_recognised():
    assert read_tflite(CUSTOM_OP).custom_ops() == ["EdgeqUnknownOp"]
    edgetpu = read_tflite(EDGETPU)
    assert edgetpu.edgetpu_compiled
    assert not read_tflite(INT8).edgetpu_compiled


def test_every_truncation_is_an_error():
    content = INT8.read_bytes()
    for size in list(range(0, 64)) + list(range(64, len(content), 7)):
        with pytest.raises(ModelLoadError):
            verify_tflite(content[:size], "cut.tflite")


def test_random_bytes_and_other_formats_are_errors():
    rng = np.random.default_rng(1)
    with pytest.raises(ModelLoadError, match="not a .tflite file"):
        verify_tflite(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "random.tflite")
    with pytest.raises(ModelLoadError, match="too short"):
        verify_tflite(b"TFL3", "tiny")
    with pytest.raises(ModelLoadError, match="no such"):
        read_tflite(INT8.with_name("missing.tflite"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5495), st.integers(0, 255)), min_size=1, max_size=8))
def test_corrupted_bytes_never_crash_the_reader(edits):
    content = bytearray(INT8.read_bytes())
    for position, value in edits:
        content[position % len(content)] = value
    try:
        desc = verify_tflite(bytes(content), "corrupt.tflite")
    except ModelLoadError:
        return
    # What the reader accepts is consistent: every op's tensors exist.
    for op in desc.main.operators:
        assert all(-1 <= i < len(desc.main.tensors) for i in op.inputs + op.outputs)


def _set(tensor_index, **fields):
    def edit(model, schema):
        tensor = model.subgraphs[0].tensors[tensor_index]
        for name, value in fields.items():
            if name in ("scale", "zeroPoint", "quantizedDimension"):
                setattr(tensor.quantization, name, value)
            else:
                setattr(tensor, name, value)

    return edit


def _weight_index() -> int:
    desc = read_tflite(INT8)
    return next(t.index for t in desc.main.tensors if t.is_constant and t.dtype == "int8" and t.per_channel)


def _grown_weight_shape() -> list[int]:
    shape = list(read_tflite(INT8).main.tensors[_weight_index()].shape)
    return [shape[0], shape[1] + 1, *shape[2:]]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(0, scale=[float("nan")]), "invalid quantization scale"),
        (_set(0, scale=[0.0]), "zero scale"),
        (_set(0, zeroPoint=[300]), "outside the int8 range"),
        (_set(0, zeroPoint=[0, 0]), "zero points"),
        (_set(0, shape=[1, -8, 8, 1]), "negative dimension"),
        (lambda m, s: _set(_weight_index(), shape=_grown_weight_shape())(m, s), "bytes of data"),
        (lambda m, s: _set(_weight_index(), quantizedDimension=3)(m, s), "per-channel"),
    ],
)
def test_semantic_corruption_that_would_crash_the_interpreter(edit, message):
    with pytest.raises(ModelLoadError, match=message):
        verify_tflite(edit_model(INT8, edit), "edited.tflite")
