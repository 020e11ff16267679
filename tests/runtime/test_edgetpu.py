"""Edge TPU compatibility from the flatbuffer, and the edgetpu_compiler wrapper."""

from __future__ import annotations

import os
import stat
import textwrap

import pytest

from edgeq.errors import ConversionError, RuntimeBackendError
from edgeq.runtime.edgetpu import check_edgetpu, find_edgetpu_compiler, parse_compiler_log, run_edgetpu_compiler
from edgeq.runtime.flatbuffer import read_tflite, verify_tflite

from .conftest import CUSTOM_OP, EDGETPU, FP32, INT8, UINT8, edit_model


def test_int8_models_are_compatible():
    for path in (INT8, UINT8):
        report = check_edgetpu(read_tflite(path))
        assert report.compatible and report.first_fallback is None
        assert report.ops_mappable == report.ops_checked > 0


def test_float_model_falls_back_at_its_first_op():
    report = check_edgetpu(read_tflite(FP32))
    assert not report.compatible
    assert report.first_fallback.index == 0
    assert any("not int8" in r for r in report.first_fallback.reasons)
    assert report.ops_mappable == 0


def test_custom_op_is_the_first_fallback():
    report = check_edgetpu(read_tflite(CUSTOM_OP))
    assert report.first_fallback.op_type == "EdgeqUnknownOp"
    assert report.first_fallback.index == 1 and report.ops_mappable == 1


def test_compiled_model_is_recognised():
    report = check_edgetpu(read_tflite(EDGETPU))
    assert report.compiled and report.compiled_ops == 1


def test_fused_activation_on_pool_is_refused():
    def fuse_relu(model, schema):
        for op in model.subgraphs[0].operators:
            if isinstance(op.builtinOptions, schema.Pool2DOptionsT):
                op.builtinOptions.fusedActivationFunction = schema.ActivationFunctionType.RELU

    report = check_edgetpu(verify_tflite(edit_model(INT8, fuse_relu), "fused.tflite"))
    assert report.first_fallback.op_type == "MAX_POOL_2D"
    assert report.first_fallback.reasons == ("fused RELU activation on MAX_POOL_2D",)
    assert report.ops_mappable == 1


def test_more_than_three_large_dimensions_and_dynamic_shapes():
    def batch_of_two(model, schema):
        model.subgraphs[0].tensors[0].shape = [2, 8, 8, 1]

    report = check_edgetpu(verify_tflite(edit_model(INT8, batch_of_two), "batch2.tflite"))
    assert "more than 3 dimensions larger than 1" in " ".join(report.first_fallback.reasons)

    def dynamic_batch(model, schema):
        model.subgraphs[0].tensors[0].shapeSignature = [-1, 8, 8, 1]

    report = check_edgetpu(verify_tflite(edit_model(INT8, dynamic_batch), "dynamic.tflite"))
    assert report.first_fallback.index == 0 and "dynamic shape" in report.first_fallback.reasons


def test_operator_versions_the_frozen_compiler_refuses_are_named_and_map_nothing(tmp_path):
    """edgetpu_compiler 16.0 refuses a file with CONV_2D v6 (or QUANTIZE v3...) as a whole: inspect and
    convert --edgetpu name the op and version, and the mapped share is 0, not the share of int8 ops."""
    from click.testing import CliRunner

    from edgeq.cli import cli
    from edgeq.runtime.edgetpu import COMPILER_REFUSES_FROM

    desc = read_tflite(INT8)
    assert {op.op_type for op in desc.main.operators} & set(COMPILER_REFUSES_FROM)
    assert check_edgetpu(desc).refused_versions == () and check_edgetpu(desc).mapped_share == 1.0

    def newer_conv(model, schema):
        for code in model.operatorCodes:
            if max(code.builtinCode, code.deprecatedBuiltinCode) == schema.BuiltinOperator.CONV_2D:
                code.version = 6

    path = tmp_path / "conv_v6.tflite"
    path.write_bytes(edit_model(INT8, newer_conv))
    report = check_edgetpu(read_tflite(path))
    assert not report.compatible and report.mapped_share == 0.0
    (refused,) = report.refused_versions
    assert refused.startswith("CONV_2D v6 (op") and "takes up to v5" in refused
    result = CliRunner().invoke(cli, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "edgetpu_compiler 16.0 would refuse the file (nothing mapped): CONV_2D v6" in result.output


STDOUT = """Edge TPU Compiler version 16.0.384591198
Started a compilation timeout timer of 180 seconds.

Model compiled successfully in 1169 ms.

Input model: model.tflite
Input size: 3.41MiB
Output model: out/model_edgetpu.tflite
Output size: 3.88MiB
On-chip memory used for caching model parameters: 3.75MiB
On-chip memory remaining for caching model parameters: 4.22MiB
Off-chip memory used for streaming uncached model parameters: 0.00B
Number of Edge TPU subgraphs: 1
Total number of operations: 72
Operation log: out/model_edgetpu.log

Model successfully compiled but not all operations are supported by the Edge TPU.
Number of operations that will run on Edge TPU: 71
Number of operations that will run on CPU: 1
Compilation child process completed within timeout period.
Compilation succeeded!
"""

OPLOG = """Edge TPU Compiler version 16.0.384591198
Input: model.tflite
Output: out/model_edgetpu.tflite

Operator                       Count      Status

ADD                            10         Mapped to Edge TPU
CONV_2D                        36         Mapped to Edge TPU
DEPTHWISE_CONV_2D              17         Mapped to Edge TPU
MEAN                           1          Mapped to Edge TPU
FULLY_CONNECTED                1          Mapped to Edge TPU
QUANTIZE                       6          Mapped to Edge TPU
DEQUANTIZE                     1          Operation is working on an unsupported data type
"""


def test_parse_compiler_log():
    fields = parse_compiler_log(STDOUT, OPLOG)
    assert fields["compiler_version"] == "16.0.384591198"
    assert fields["ops_mapped"] == 71 and fields["ops_not_mapped"] == 1
    assert [op.op_type for op in fields["ops"] if not op.mapped] == ["DEQUANTIZE"]
    assert fields["on_chip_memory"] == "3.75MiB" and fields["subgraphs"] == 1
    only_summary = parse_compiler_log(STDOUT)
    assert (only_summary["ops_mapped"], only_summary["ops_not_mapped"]) == (71, 1)


def test_missing_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_edgetpu_compiler() is None
    with pytest.raises(RuntimeBackendError, match="edgetpu_compiler is not on PATH"):
        run_edgetpu_compiler(INT8, tmp_path / "out")


def _install_compiler(directory, body: str) -> None:
    # The real compiler exists only for x86-64 Debian from Coral's apt repository; this
    # stand-in writes what it writes so the wrapper's file handling is exercised end to end.
    script = directory / "edgetpu_compiler"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_compiler_run_is_parsed(monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "stdout.txt").write_text(STDOUT)
    (tmp_path / "oplog.txt").write_text(OPLOG)
    _install_compiler(
        bindir,
        f"""
        out="$2"; model="$4"; stem=$(basename "$model" .tflite)
        cp "$model" "$out/${{stem}}_edgetpu.tflite"
        cp {tmp_path}/oplog.txt "$out/${{stem}}_edgetpu.log"
        cat {tmp_path}/stdout.txt
        """,
    )
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    result = run_edgetpu_compiler(INT8, tmp_path / "out")
    assert result.ok and result.output_path.endswith("tiny_int8_edgetpu.tflite")
    assert result.ops_mapped == 71 and result.ops_not_mapped == 1
    assert result.log_path.endswith("tiny_int8_edgetpu.log")

    _install_compiler(
        bindir, 'echo "Edge TPU Compiler version 16.0"; echo "ERROR: Didn\'t find op for builtin"; exit 1\n'
    )
    with pytest.raises(ConversionError, match="Didn't find op"):
        run_edgetpu_compiler(INT8, tmp_path / "out2")
