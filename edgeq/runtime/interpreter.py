"""One table of TFLite interpreter backends and one loader over them.

The loader hides int8/uint8 I/O: ``predict`` takes and returns float arrays and
quantizes inputs / dequantizes outputs with the model's own parameters.
Never imports TensorFlow unless the ``tensorflow`` backend is asked for or is the
only one left.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.errors import ModelLoadError, RuntimeBackendError
from edgeq.runtime.flatbuffer import EDGETPU_CUSTOM_OP, ModelDesc, verify_tflite
from edgeq.runtime.inputs import dequantize_input, quantize_input
from edgeq.shims.litert import ops_details

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # module that holds Interpreter and load_delegate
    distribution: str  # pip distribution, for the version and the install hint


# In order of preference; the first importable one is used unless one is forced.
BACKENDS: tuple[Backend, ...] = (
    Backend("ai_edge_litert", "ai_edge_litert.interpreter", "ai-edge-litert"),
    Backend("tflite_runtime", "tflite_runtime.interpreter", "tflite-runtime"),
    Backend("tensorflow", "tensorflow.lite.python.interpreter", "tensorflow"),
)


def backend_names() -> list[str]:
    return [b.name for b in BACKENDS]


def _import_backend(backend: Backend):
    try:
        return importlib.import_module(backend.module)
    except (ImportError, AttributeError) as exc:
        # tflite-runtime is built against NumPy 1.x: under numpy 2 its import fails
        # ("_ARRAY_API not found"), which is a reason to fall through to the next backend.
        hint = " (it needs numpy<2)" if backend.name == "tflite_runtime" and np.__version__[0] != "1" else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeBackendError(
            f"runtime {backend.name!r} cannot be imported ({first}); install it: pip install {backend.distribution}"
            + hint
        ) from exc


def select_backend(name: str | None = None) -> tuple[Backend, Any]:
    """Return (backend, module) for ``name``, or the first importable backend."""
    if name:
        for backend in BACKENDS:
            if backend.name == name:
                return backend, _import_backend(backend)
        raise RuntimeBackendError(f"unknown runtime {name!r}; choose one of: {', '.join(backend_names())}")
    errors = []
    for backend in BACKENDS:
        try:
            return backend, _import_backend(backend)
        except RuntimeBackendError as exc:
            errors.append(str(exc))
    raise RuntimeBackendError(
        'no TFLite interpreter is installed: pip install "edgeq[litert]" '
        '(or "edgeq[tflite-runtime]" on a numpy 1.x device such as a Coral board)'
    )


def backend_version(backend: Backend) -> str:
    try:
        return importlib.metadata.version(backend.distribution)
    except importlib.metadata.PackageNotFoundError:
        if backend.name == "tensorflow":
            try:
                return importlib.metadata.version("tensorflow-cpu")
            except importlib.metadata.PackageNotFoundError:
                pass
        return "unknown"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    index: int
    shape: tuple[int, ...]
    dtype: str
    scale: float
    zero_point: int

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "uint8", "int16") and self.scale != 0.0


@dataclass(frozen=True)
class OpInfo:
    index: int
    op_name: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]


def _signature_names(interpreter) -> tuple[dict[int, str], dict[int, str]]:
    """{tensor index: name} of the inputs and outputs of the model's one signature ({} without one).

    A Keras model converted by edgeq has one signature whose names are the Keras input and
    output names; a .tflite without signatures keeps its tensor names.
    """
    try:
        signatures = interpreter.get_signature_list()
        if len(signatures) != 1:
            return {}, {}
        runner = interpreter.get_signature_runner(next(iter(signatures)))
        inputs = {int(d["index"]): name for name, d in runner.get_input_details().items()}
        outputs = {int(d["index"]): name for name, d in runner.get_output_details().items()}
    except (AttributeError, ValueError, RuntimeError, KeyError):
        return {}, {}
    return inputs, outputs


def _tensor_info(detail: dict) -> TensorInfo:
    scale, zero_point = detail.get("quantization", (0.0, 0))
    return TensorInfo(
        name=detail["name"],
        index=int(detail["index"]),
        shape=tuple(int(d) for d in detail["shape"]),
        dtype=np.dtype(detail["dtype"]).name,
        scale=float(scale),
        zero_point=int(zero_point),
    )


def quantize(x: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Float -> the tensor's integer dtype with its scale and zero point (edgeq.runtime.inputs: as TFLite rounds)."""
    if not info.quantized:
        return np.asarray(x, dtype=np.dtype(info.dtype))
    return quantize_input(x, info.dtype, info.scale, info.zero_point)


def dequantize(q: np.ndarray, info: TensorInfo) -> np.ndarray:
    if not info.quantized:
        return np.asarray(q, dtype=np.float32)
    return dequantize_input(q, info.scale, info.zero_point)


@contextlib.contextmanager
def native_stderr_to_log():
    """Route what native code writes to fd 2 (e.g. "INFO: Created TensorFlow Lite XNNPACK
    delegate") into logging, so that the CLI prints only its own lines.

    On success, lines that are not INFO go back to stderr; on an exception they are
    logged only, because the exception already carries the message.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (embedded interpreters)
        yield
        return
    failed = False
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", errors="replace")
            for line in text.splitlines():
                if not line.strip():
                    continue
                if failed or line.startswith("INFO:"):
                    log.info("runtime: %s", line)
                else:
                    sys.stderr.write(line + "\n")


class TFLiteModel:
    """A loaded .tflite model with float-in, float-out prediction."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        model_content: bytes | None = None,
        runtime: str | None = None,
        num_threads: int | None = None,
        delegates: list | None = None,
        use_default_delegates: bool = True,
        delegate: str | None = None,
        verify: bool = True,
    ) -> None:
        """Load a model.

        Args:
            delegate: a ``--delegate`` value (``xnnpack``, ``none``, ``edgetpu`` or a
                library path), loaded with this backend; adds to ``delegates``.
            verify: check the flatbuffer in Python first, so that a truncated or
                corrupted file is an error, never a crash in native code.
        """
        self.path = Path(path) if path is not None else None
        self.backend, module = select_backend(runtime)
        self.backend_version = backend_version(self.backend)
        if model_content is None:
            if self.path is None:
                raise ModelLoadError("no model given: pass a .tflite path")
            if not self.path.is_file():
                raise ModelLoadError(f"{self.path}: no such .tflite file")
            try:
                model_content = self.path.read_bytes()
            except OSError as exc:
                raise ModelLoadError(f"{self.path}: cannot read it ({exc.strerror})") from exc
        self.model_content = model_content
        where = str(self.path) if self.path else "model"
        self.description: ModelDesc | None = verify_tflite(model_content, where) if verify else None
        delegates = list(delegates or [])
        self.delegate_name = "xnnpack" if use_default_delegates else "none"
        if delegate is not None:
            from edgeq.runtime.delegates import load_delegate

            choice = load_delegate(delegate, module)
            delegates.extend(choice.delegates)
            use_default_delegates = use_default_delegates and choice.use_default_delegates
            self.delegate_name = choice.name
        elif delegates:
            self.delegate_name = "custom"
        if self.description is not None:
            self._check_custom_ops(self.description, where)
            if self.delegate_name == "edgetpu" and not self.description.edgetpu_compiled:
                log.warning(
                    "%s is not compiled for the Edge TPU (no edgetpu-custom-op): it runs on the CPU; "
                    "compile it with edgetpu_compiler first (deploy/CORAL.md)",
                    where,
                )
        kwargs: dict[str, Any] = {"model_content": model_content}
        if num_threads:
            kwargs["num_threads"] = int(num_threads)
        if delegates:
            kwargs["experimental_delegates"] = delegates
        if not use_default_delegates:
            kwargs["experimental_op_resolver_type"] = module.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        try:
            with native_stderr_to_log():
                self.interpreter = module.Interpreter(**kwargs)
                self.interpreter.allocate_tensors()
            self._read_details()
            self._names = _signature_names(self.interpreter)
        except (ValueError, RuntimeError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"{where}: the interpreter cannot load it: {first}") from exc
        self._where = where

    def _read_details(self) -> None:
        self.inputs = [_tensor_info(d) for d in self.interpreter.get_input_details()]
        self.outputs = [_tensor_info(d) for d in self.interpreter.get_output_details()]

    @property
    def input_names(self) -> list[str]:
        """Each input's name, as ``inputs`` orders them: its signature name (the Keras input's)."""
        return [self._names[0].get(t.index, t.name) for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """Each output's name, as ``outputs`` orders them: its signature name (the Keras output's).

        The converter orders a .tflite's output tensors as it likes (not as the Keras model
        did), so outputs are matched by these names, never by position.
        """
        return [self._names[1].get(t.index, t.name) for t in self.outputs]

    def output_named(self, name: str) -> TensorInfo:
        for info, key in zip(self.outputs, self.output_names):
            if key == name:
                return info
        raise ModelLoadError(f"{self._where}: no output named {name!r} (it has {', '.join(self.output_names)})")

    def input_named(self, name: str) -> TensorInfo:
        for info, key in zip(self.inputs, self.input_names):
            if key == name:
                return info
        raise ModelLoadError(f"{self._where}: no input named {name!r} (it has {', '.join(self.input_names)})")

    def _check_custom_ops(self, desc: ModelDesc, where: str) -> None:
        """Name the custom ops this runtime lacks before the interpreter fails on them."""
        custom = desc.custom_ops()
        if EDGETPU_CUSTOM_OP in custom and self.delegate_name in ("xnnpack", "none"):
            raise ModelLoadError(
                f"{where}: compiled for the Coral Edge TPU ({EDGETPU_CUSTOM_OP}); "
                "run it with --delegate edgetpu on a device with an Edge TPU, or profile the uncompiled model"
            )
        others = [name for name in custom if name != EDGETPU_CUSTOM_OP]
        if others and self.delegate_name in ("xnnpack", "none"):
            raise ModelLoadError(
                f"{where}: needs custom op(s) {', '.join(others)} that the {self.backend.name} runtime does not "
                "have; convert without custom ops (TFLITE_BUILTINS_INT8) or load a delegate that provides them"
            )

    @property
    def input(self) -> TensorInfo:
        return self.inputs[0]

    @property
    def output(self) -> TensorInfo:
        return self.outputs[0]

    def _resize_for_batch(self, batch: int) -> None:
        resized = False
        for info in self.inputs:
            shape = list(info.shape)
            if shape and shape[0] != batch:
                shape[0] = batch
                self.interpreter.resize_tensor_input(info.index, shape)
                resized = True
        if resized:
            self.interpreter.allocate_tensors()
            self._read_details()

    def _failed(self, exc: Exception) -> ModelLoadError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ModelLoadError(f"{getattr(self, '_where', 'model')}: the interpreter cannot run it: {first}")

    def invoke_raw(self, x_quantized: np.ndarray) -> np.ndarray:
        """Run one batch already in the input's dtype; return the raw first output."""
        try:
            self.interpreter.set_tensor(self.input.index, x_quantized)
            self.interpreter.invoke()
            return self.interpreter.get_tensor(self.output.index)
        except (ValueError, RuntimeError) as exc:
            raise self._failed(exc) from exc

    def invoke_raw_outputs(self, x_quantized: Mapping[str, np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
        """Run one batch already in the inputs' dtypes (by input name); every raw output by name."""
        feeds = self._by_input_name(x_quantized)
        try:
            for info, name in zip(self.inputs, self.input_names):
                self.interpreter.set_tensor(info.index, feeds[name])
            self.interpreter.invoke()
            return {
                name: np.array(self.interpreter.get_tensor(info.index), copy=True)
                for info, name in zip(self.outputs, self.output_names)
            }
        except (ValueError, RuntimeError) as exc:
            raise self._failed(exc) from exc

    def _by_input_name(self, x: Mapping[str, np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
        names = self.input_names
        if not isinstance(x, Mapping):
            if len(names) != 1:
                raise ModelLoadError(
                    f"{self._where} has {len(names)} inputs ({', '.join(names)}): give one array per input name"
                )
            return {names[0]: x}
        missing = [n for n in names if n not in x]
        if missing:
            raise ModelLoadError(f"{self._where}: no data for input(s) {', '.join(missing)} (given: {', '.join(x)})")
        return {n: x[n] for n in names}

    def predict_outputs(self, x: Mapping[str, np.ndarray] | np.ndarray, batch_size: int = 1) -> dict[str, np.ndarray]:
        """Float inputs (one array, or one per input name) -> every dequantized output, by name."""
        feeds = {name: np.asarray(v, dtype=np.float32) for name, v in self._by_input_name(x).items()}
        count = len(next(iter(feeds.values())))
        for info, name in zip(self.inputs, self.input_names):
            expected = tuple(info.shape[1:])
            if tuple(feeds[name].shape[1:]) != expected or len(feeds[name]) != count:
                raise ModelLoadError(
                    f"input {name!r}: shape {tuple(feeds[name].shape[1:])} does not fit the model input {expected}"
                    + (f" of {self.path}" if self.path else "")
                )
        results: dict[str, list[np.ndarray]] = {name: [] for name in self.output_names}
        for start in range(0, count, batch_size):
            chunk = {name: v[start : start + batch_size] for name, v in feeds.items()}
            self._resize_for_batch(len(next(iter(chunk.values()))))
            quantized = {name: quantize(chunk[name], info) for info, name in zip(self.inputs, self.input_names)}
            raw = self.invoke_raw_outputs(quantized)
            for info, name in zip(self.outputs, self.output_names):
                results[name].append(dequantize(raw[name], info))
        return {
            name: np.concatenate(parts, axis=0)
            if parts
            else np.zeros((0, *self.output_named(name).shape[1:]), dtype=np.float32)
            for name, parts in results.items()
        }

    def predict(self, x: np.ndarray, batch_size: int = 1) -> np.ndarray:
        """Float inputs (N, ...) -> the dequantized float output (N, ...) of a one-output model."""
        if len(self.outputs) != 1:
            raise ModelLoadError(
                f"{self._where} has {len(self.outputs)} outputs ({', '.join(self.output_names)}); "
                "they are read by name (predict_outputs)"
            )
        return self.predict_outputs(x, batch_size)[self.output_names[0]]

    def ops(self) -> list[OpInfo]:
        """The ops of the graph with the dtypes of their inputs and outputs."""
        tensors = {d["index"]: np.dtype(d["dtype"]).name for d in self.interpreter.get_tensor_details()}
        result = []
        for op in ops_details(self.interpreter):
            result.append(
                OpInfo(
                    index=int(op["index"]),
                    op_name=str(op["op_name"]),
                    input_dtypes=tuple(tensors.get(i, "none") for i in op["inputs"] if i >= 0),
                    output_dtypes=tuple(tensors.get(i, "none") for i in op["outputs"] if i >= 0),
                )
            )
        return result


class JoinedOutputs:
    """A model whose outputs ``edgeq convert`` split (each part of a concatenated output its own int8 scale)
    read as the file's own outputs: each part dequantized with its scale, then concatenated back.

    ``joins``: the manifest's ``joined_outputs`` records (``output``, ``parts``, ``axis``: the axis of the
    float file's output). Raw tensors (``invoke_raw_outputs``, ``verify``) stay the parts; everything
    that reads dequantized outputs by name (eval, profile, convert's verification) sees the joined ones.
    """

    def __init__(self, model: TFLiteModel, joins: list[dict]) -> None:
        self._model = model
        self._joins = [(str(j["output"]), [str(p) for p in j["parts"]], int(j["axis"])) for j in joins]
        names = model.output_names
        missing = [p for _, parts, _ in self._joins for p in parts if p not in names]
        if missing:
            raise ModelLoadError(
                f"{model._where}: its manifest joins outputs it does not have ({', '.join(missing[:3])}): the "
                "manifest is not this model's; convert it again"
            )
        infos = dict(zip(names, model.outputs))
        part_of = {p: j for j in self._joins for p in j[1]}
        self._names: list[str] = []
        self._infos: list[TensorInfo] = []
        for name in names:
            join = part_of.get(name)
            if join is None:
                self._names.append(name)
                self._infos.append(infos[name])
            elif join[1][0] == name:  # a joined output stands where its first part stood
                first = infos[name]
                shape = list(first.shape)
                shape[join[2]] = sum(infos[p].shape[join[2]] for p in join[1])
                self._names.append(join[0])
                # no one scale for the whole: each part has its own (scale 0 says so)
                self._infos.append(TensorInfo(join[0], -1, tuple(shape), first.dtype, 0.0, 0))

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    @property
    def output_names(self) -> list[str]:
        return list(self._names)

    @property
    def outputs(self) -> list[TensorInfo]:
        return list(self._infos)

    @property
    def output(self) -> TensorInfo:
        return self._infos[0]

    def output_named(self, name: str) -> TensorInfo:
        for info, key in zip(self._infos, self._names):
            if key == name:
                return info
        raise ModelLoadError(f"{self._model._where}: no output named {name!r} (it has {', '.join(self._names)})")

    def predict_outputs(self, x: Mapping[str, np.ndarray] | np.ndarray, batch_size: int = 1) -> dict[str, np.ndarray]:
        parts = self._model.predict_outputs(x, batch_size)
        joined = {}
        for name, members, axis in self._joins:
            joined[name] = np.concatenate([parts.pop(p) for p in members], axis=axis)
        parts.update(joined)
        return {name: parts[name] for name in self._names}

    def predict(self, x: np.ndarray, batch_size: int = 1) -> np.ndarray:
        if len(self._names) != 1:
            raise ModelLoadError(f"{self._model._where} has {len(self._names)} outputs; read them by name")
        return self.predict_outputs(x, batch_size)[self._names[0]]


def with_joins(model: TFLiteModel, joins: list[dict] | None = None):
    """``model`` with its split outputs joined (``JoinedOutputs``) as its manifest records them, or as given."""
    if joins is None and model.path is not None:
        from edgeq.runtime.inputs import recorded_beside

        joins = recorded_beside(model.path, "joined_outputs")
    return JoinedOutputs(model, joins) if joins else model
