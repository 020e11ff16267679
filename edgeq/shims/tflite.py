"""TFLite converter internals (host side)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings

from edgeq.models.compat import tf  # noqa: F401 - TensorFlow comes through compat, so the Keras flavour is set first


def disable_per_channel(converter) -> None:
    """Per-tensor weight quantization for post-training quantization.

    ``TFLiteConverter`` has no public option for it; ``_experimental_disable_per_channel``
    is the switch the converter itself reads.
    """
    converter._experimental_disable_per_channel = True  # noqa: SLF001


@contextlib.contextmanager
def native_output_silenced():
    """Silence what the converter prints for a moment: native code (fds 1 and 2), Python, warnings.

    The MLIR quantizer prints a line per call, the converter its settings and a
    "Statistics for quantized inputs" warning, and converting a Keras 3 model its export
    signature ("Saved artifact at ..."); none of it is edgeq's to show, and what goes wrong
    arrives as an exception. EDGEQ_VERBOSE=1 (edgeq -v) keeps stderr.
    """
    fds = (1,) if os.environ.get("EDGEQ_VERBOSE") else (1, 2)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in fds}
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def quantize_calibrated(calibrated: bytes, per_tensor: bool, denylisted_nodes: list[str] | None) -> bytes:
    """Quantize an already calibrated flatbuffer, leaving ``denylisted_nodes`` in float.

    ``tensorflow.lite.python.convert.mlir_quantize`` is private; it is what
    ``tf.lite.experimental.QuantizationDebugger`` calls for its selective quantization,
    and the only way to re-quantize one calibration with different float nodes without
    calibrating again.
    """
    from tensorflow.lite.python import convert as _convert

    with native_output_silenced():  # the quantizer prints a line per call on stdout
        return _convert.mlir_quantize(
            calibrated,
            disable_per_channel=per_tensor,
            fully_quantize=False,
            denylisted_nodes=denylisted_nodes or None,
        )


@contextlib.contextmanager
def calibration_replaced(replace):
    """While open, every TFLite converter calibration returns ``replace(run)`` instead of its own.

    ``run()`` performs the converter's calibration and returns the calibrated (float, min/max
    recorded) flatbuffer; ``replace`` returns the calibrated flatbuffer the converter goes on
    with, so what follows (quantization, integer I/O, the debugger's NumericVerify model) is
    the converter's own. ``Calibrator.calibrate`` is private; it is where both
    ``TFLiteConverter.convert`` and ``QuantizationDebugger`` calibrate.
    """
    from tensorflow.lite.python.optimize import calibrator

    original = calibrator.Calibrator.calibrate

    def calibrate(self, dataset_gen):
        return replace(lambda: original(self, dataset_gen))

    calibrator.Calibrator.calibrate = calibrate
    try:
        yield
    finally:
        calibrator.Calibrator.calibrate = original


def tensor_ranges(calibrated: bytes) -> dict[int, tuple[float, float]]:
    """The calibration min/max that a calibrated (not yet quantized) flatbuffer records, by tensor index.

    ``flatbuffer_utils`` is TensorFlow's private reader/writer of the TFLite schema.
    """
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(calibrated))
    ranges = {}
    for index, tensor in enumerate(model.subgraphs[0].tensors):
        q = tensor.quantization
        if q is not None and q.min is not None and q.max is not None and len(q.min) == 1 and len(q.max) == 1:
            ranges[index] = (float(q.min[0]), float(q.max[0]))
    return ranges


def with_tensor_ranges(calibrated: bytes, ranges: dict[int, tuple[float, float]]) -> bytes:
    """A copy of a calibrated flatbuffer whose recorded min/max are ``ranges`` where given."""
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(calibrated))
    tensors = model.subgraphs[0].tensors
    for index, (low, high) in ranges.items():
        tensors[index].quantization.min = [float(low)]
        tensors[index].quantization.max = [float(high)]
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def keras_converter(model, static_batch: bool = False, input_shapes: dict | None = None):
    """A TFLiteConverter for a Keras model (tf_keras or Keras 3), from one traced call.

    ``from_keras_model`` first saves the whole model as a SavedModel, and tf_keras's legacy
    serialization traces every layer's functions for it: on a QAT MobileNet (32x32) that is
    27 of the 38 seconds a conversion takes. The converter reads only the model's call and
    its variables, so those are all it is given; the .tflite is the same (same ops, same
    quantization, outputs bit-exact on the models in the tests).

    The call takes the inputs by name and returns a dict of the outputs by name, so the
    .tflite's signature names every input and output as the Keras model does (converting a
    Keras 3 model otherwise names them output_0, output_1, ..., and the output tensors come
    in the converter's order, not the model's). ``static_batch`` fixes the batch dimension at 1
    (the Edge TPU compiler wants every shape); ``input_shapes`` ({name: shape}) fixes the None
    dimensions of a fully convolutional model.
    """
    from edgeq.models.names import input_names, output_names

    names, outs = input_names(model), output_names(model)
    specs = []
    for name, tensor in zip(names, model.inputs):
        shape = list((input_shapes or {}).get(name) or tensor.shape[1:])
        specs.append(tf.TensorSpec([1 if static_batch else None, *shape], tensor.dtype, name=name))

    def call(*args):
        result = model(list(args) if len(args) > 1 else args[0], training=False)
        if isinstance(result, dict):
            return {str(k): v for k, v in result.items()}
        if isinstance(result, (list, tuple)):
            return dict(zip(outs, result))
        return {outs[0]: result}

    function = tf.function(call, input_signature=specs)
    holder = tf.Module()
    # a Keras 3 variable holds its tf.Variable as .value; a tf_keras one is a tf.Variable
    holder.variables_of_the_model = [v if isinstance(v, tf.Variable) else v.value for v in model.variables]
    return tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], holder)


def debugger_keeping_every_tensor(debugger) -> None:
    """Make ``tf.lite.experimental.QuantizationDebugger`` read each op's own output.

    Its per-layer metrics read every NumericVerify op's inputs and output after the
    whole model has run. Built from a converter (or after its options change), the
    debugger makes its interpreter without ``experimental_preserve_all_tensors``, so by
    then most of those tensors' memory holds what later ops wrote there: on an
    EfficientNetB0 the metrics read -309 dB and errors of 1e34 quantization steps. The
    interpreter is made again, from the same debug model, keeping every tensor.
    """
    with warnings.catch_warnings():  # tf.lite.Interpreter's deprecation notice
        warnings.simplefilter("ignore")
        debugger._quant_interpreter = tf.lite.Interpreter(  # noqa: SLF001
            model_content=debugger.quant_model, experimental_preserve_all_tensors=True
        )
    debugger._initialize_stats()  # noqa: SLF001 - its op and tensor lookups, from the new interpreter
