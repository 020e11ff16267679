"""Read and verify a .tflite flatbuffer without TensorFlow and without an interpreter.

Uses the schema that ships with ai-edge-litert (``ai_edge_litert.schema_py_generated``,
which needs only the ``flatbuffers`` package). Every read is a bounds-checked Python
read, so a truncated or corrupted file becomes a ModelLoadError here instead of
reaching native code; ``verify_tflite`` is run before a file is handed to an interpreter.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
import struct
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from edgeq.errors import ModelLoadError

log = logging.getLogger(__name__)

FILE_IDENTIFIER = b"TFL3"
EDGETPU_CUSTOM_OP = "edgetpu-custom-op"

# TensorType -> numpy-style dtype name; "float32"/"float16"/... count as float.
FLOAT_DTYPES = frozenset({"float32", "float16", "float64", "bfloat16"})
QUANT8_DTYPES = frozenset({"int8", "uint8"})
_DTYPE_NAMES = {
    "FLOAT32": "float32",
    "FLOAT16": "float16",
    "FLOAT64": "float64",
    "BFLOAT16": "bfloat16",
    "INT32": "int32",
    "UINT8": "uint8",
    "INT64": "int64",
    "STRING": "string",
    "BOOL": "bool",
    "INT16": "int16",
    "COMPLEX64": "complex64",
    "INT8": "int8",
    "COMPLEX128": "complex128",
    "UINT64": "uint64",
    "RESOURCE": "resource",
    "VARIANT": "variant",
    "UINT32": "uint32",
    "UINT16": "uint16",
    "INT4": "int4",
    "INT2": "int2",
    "UINT4": "uint4",
}


class _SchemaMissing(ModelLoadError):
    pass


@lru_cache(maxsize=1)
def schema():
    """The flatbuffer schema module of ai-edge-litert; on a tflite-runtime device (which ships
    none), the copy of it that ``edgeq push`` puts beside edgeq (``edgeq_tflite_schema``), or
    the ``tflite`` package that ``pip install "edgeq[tflite-runtime]"`` brings."""
    names = (
        "ai_edge_litert.schema_py_generated",
        "tflite_runtime.schema_py_generated",
        "edgeq_tflite_schema",
        "tflite",
    )
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise _SchemaMissing(
        'the .tflite schema is not installed: pip install "edgeq[litert]" (or "edgeq[tflite-runtime]")'
    )


@lru_cache(maxsize=1)
def _enum_names(enum_name: str) -> dict[int, str]:
    enum = getattr(schema(), enum_name)
    names = {}
    for key, value in vars(enum).items():
        if not key.startswith("_") and isinstance(value, int):
            names.setdefault(value, key)
    return names


def builtin_op_name(code: int) -> str:
    return _enum_names("BuiltinOperator").get(code, f"BUILTIN_{code}")


def dtype_name(tensor_type: int) -> str:
    raw = _enum_names("TensorType").get(tensor_type, f"TYPE_{tensor_type}")
    return _DTYPE_NAMES.get(raw, raw.lower())


@dataclass(frozen=True)
class TensorDesc:
    """One tensor of a subgraph, as the file describes it."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    shape_signature: tuple[int, ...]  # -1 marks a dynamic dimension
    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    quantized_dimension: int
    buffer: int
    constant_bytes: int  # size of the constant data in the file (0 for activations)
    is_variable: bool

    @property
    def is_constant(self) -> bool:
        return self.constant_bytes > 0

    @property
    def dynamic(self) -> bool:
        return any(d < 0 for d in self.shape_signature) or any(d < 0 for d in self.shape)

    @property
    def per_channel(self) -> bool:
        return len(self.scale) > 1


@dataclass(frozen=True)
class OperatorDesc:
    """One op of a subgraph: its type, tensors and fused activation."""

    index: int
    op_type: str  # builtin name such as CONV_2D, or the custom code of a custom op
    custom: bool
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    fused_activation: str  # NONE when the op has none (or no such option)
    version: int = 1  # the operator code's version: kernels older than the file may not have it


@dataclass(frozen=True)
class SubgraphDesc:
    index: int
    name: str
    tensors: tuple[TensorDesc, ...]
    operators: tuple[OperatorDesc, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class SignatureDesc:
    key: str
    subgraph: int
    inputs: dict[str, int]  # signature name -> tensor index
    outputs: dict[str, int]


@dataclass(frozen=True)
class ModelDesc:
    """A verified .tflite file: everything inspect and profile need, no interpreter."""

    path: str | None
    size_bytes: int
    sha256: str
    schema_version: int
    description: str
    subgraphs: tuple[SubgraphDesc, ...]
    signatures: tuple[SignatureDesc, ...]

    @property
    def main(self) -> SubgraphDesc:
        return self.subgraphs[0]

    def op_dtypes(self, op: OperatorDesc, subgraph: SubgraphDesc | None = None) -> tuple[list[str], list[str]]:
        sg = subgraph or self.main
        return [sg.tensors[i].dtype for i in op.inputs if i >= 0], [sg.tensors[i].dtype for i in op.outputs if i >= 0]

    def custom_ops(self) -> list[str]:
        return sorted({op.op_type for sg in self.subgraphs for op in sg.operators if op.custom})

    @property
    def edgetpu_compiled(self) -> bool:
        return EDGETPU_CUSTOM_OP in self.custom_ops()


def _ints(obj, field: str) -> tuple[int, ...]:
    if getattr(obj, f"{field}IsNone")():
        return ()
    return tuple(int(v) for v in getattr(obj, f"{field}AsNumpy")().tolist())


def _floats(obj, field: str) -> tuple[float, ...]:
    if getattr(obj, f"{field}IsNone")():
        return ()
    return tuple(float(v) for v in getattr(obj, f"{field}AsNumpy")().tolist())


def _text(raw) -> str:
    """A flatbuffer string; invalid UTF-8 (a corrupted file) raises UnicodeDecodeError."""
    if raw is None:
        return ""
    return raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else str(raw)


def _fused_activation(s, op) -> str:
    options_type = op.BuiltinOptionsType()
    table = op.BuiltinOptions()
    if not options_type or table is None:
        return "NONE"
    # the options table read through its class (BuiltinOptions' name for the type): the plain
    # flatbuffer API that every generated schema has, LiteRT's and the `tflite` package's
    options_class = getattr(s, _enum_names("BuiltinOptions").get(options_type, ""), None)
    if options_class is None or not hasattr(options_class, "FusedActivationFunction"):
        return "NONE"
    options = options_class()
    options.Init(table.Bytes, table.Pos)
    code = options.FusedActivationFunction()
    return _enum_names("ActivationFunctionType").get(int(code), str(code))


def _buffer_bytes(buffer, content_len: int, where: str, index: int) -> int:
    """Bytes of constant data that buffer ``index`` holds, checked against the file size."""
    offset = int(buffer.Offset()) if hasattr(buffer, "Offset") else 0
    size = int(buffer.Size()) if hasattr(buffer, "Size") else 0
    if offset > 1:  # data stored after the flatbuffer (models over 2 GB)
        if offset + size > content_len:
            raise ModelLoadError(f"{where}: buffer {index} points past the end of the file (truncated?)")
        return size
    if buffer.DataIsNone():
        return 0
    return int(buffer.DataAsNumpy().size)  # bounds-checked by numpy


def _length(n: int, content: bytes, where: str, what: str) -> int:
    """A vector length that fits the file (4 bytes per entry at least), else an error.

    Without it a corrupted length would make the reader loop over garbage for long.
    """
    if n < 0 or 4 * n > len(content):
        raise ModelLoadError(f"{where}: corrupted or truncated .tflite file ({what}: {n} entries)")
    return n


_FIXED_BYTES = {
    "float32": 4,
    "float16": 2,
    "float64": 8,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "int16": 2,
    "uint16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
_ZERO_POINT_RANGE = {"int8": (-128, 127), "uint8": (0, 255), "int16": (0, 0)}


def _check_tensor(t: TensorDesc, has_sparsity: bool, where: str) -> None:
    """Semantic checks whose violation crashes native kernels instead of raising.

    A corrupted scale (negative, NaN), a zero point out of its dtype's range, per-channel
    parameters that do not fit the shape, or constant data shorter than the shape needs
    make LiteRT read out of bounds or crash in allocate_tensors.
    """
    label = f"{where}: tensor {t.index} ({t.name or 'unnamed'})"
    if any(d < 0 for d in t.shape):
        raise ModelLoadError(f"{label} has a negative dimension {list(t.shape)}")
    if t.scale:
        if not all(math.isfinite(v) and v >= 0 for v in t.scale):
            raise ModelLoadError(f"{label} has an invalid quantization scale {t.scale[:4]}")
        if t.dtype in _ZERO_POINT_RANGE and any(v == 0 for v in t.scale):
            raise ModelLoadError(f"{label} is quantized with a zero scale")
        if t.zero_point and len(t.zero_point) != len(t.scale):
            raise ModelLoadError(f"{label} has {len(t.scale)} scales but {len(t.zero_point)} zero points")
        if len(t.scale) > 1 and not (
            0 <= t.quantized_dimension < len(t.shape) and t.shape[t.quantized_dimension] == len(t.scale)
        ):
            raise ModelLoadError(f"{label}: {len(t.scale)} per-channel scales do not fit shape {list(t.shape)}")
    low, high = _ZERO_POINT_RANGE.get(t.dtype, (None, None))
    if low is not None and t.zero_point and not all(low <= z <= high for z in t.zero_point):
        raise ModelLoadError(f"{label} has a zero point outside the {t.dtype} range: {t.zero_point[:4]}")
    if t.constant_bytes and not has_sparsity and t.dtype in _FIXED_BYTES:
        expected = _FIXED_BYTES[t.dtype] * math.prod(t.shape)
        if t.constant_bytes != expected:
            raise ModelLoadError(
                f"{label} holds {t.constant_bytes} bytes of data but its shape {list(t.shape)} needs {expected}"
            )


def _parse_tensors(sg, content: bytes, where: str, buffer_bytes: list[int]) -> list[TensorDesc]:
    """A subgraph's tensors, each checked against the buffers it refers to."""
    n_buffers = len(buffer_bytes)
    tensors = []
    for t in range(_length(sg.TensorsLength(), content, where, "tensors")):
        tensor = sg.Tensors(t)
        quant = tensor.Quantization()
        scale = _floats(quant, "Scale") if quant is not None else ()
        zero_point = _ints(quant, "ZeroPoint") if quant is not None else ()
        buffer = int(tensor.Buffer())
        if not 0 <= buffer < max(n_buffers, 1):
            raise ModelLoadError(f"{where}: tensor {t} refers to buffer {buffer} of {n_buffers}")
        shape = _ints(tensor, "Shape")
        desc_tensor = TensorDesc(
            index=t,
            name=_text(tensor.Name()),
            dtype=dtype_name(int(tensor.Type())),
            shape=shape,
            shape_signature=_ints(tensor, "ShapeSignature") or shape,
            scale=scale,
            zero_point=zero_point,
            quantized_dimension=int(quant.QuantizedDimension()) if quant is not None else 0,
            buffer=buffer,
            constant_bytes=buffer_bytes[buffer] if buffer < len(buffer_bytes) else 0,
            is_variable=bool(tensor.IsVariable()),
        )
        _check_tensor(desc_tensor, has_sparsity=tensor.Sparsity() is not None, where=where)
        tensors.append(desc_tensor)
    return tensors


def _parse_operators(s, sg, content: bytes, where: str, opcodes: list, n_tensors: int) -> list[OperatorDesc]:
    """A subgraph's operators, each checked against the operator codes and tensors it refers to."""
    operators = []
    for o in range(_length(sg.OperatorsLength(), content, where, "operators")):
        op = sg.Operators(o)
        opcode_index = int(op.OpcodeIndex())
        if not 0 <= opcode_index < len(opcodes):
            raise ModelLoadError(f"{where}: op {o} refers to operator code {opcode_index} of {len(opcodes)}")
        inputs, outputs = _ints(op, "Inputs"), _ints(op, "Outputs")
        for i in inputs + outputs:
            if not -1 <= i < n_tensors:
                raise ModelLoadError(f"{where}: op {o} refers to tensor {i} of {n_tensors}")
        op_type, custom, version = opcodes[opcode_index]
        operators.append(
            OperatorDesc(
                index=o,
                op_type=op_type,
                custom=custom,
                inputs=inputs,
                outputs=outputs,
                fused_activation=_fused_activation(s, op),
                version=version,
            )
        )
    return operators


def _parse(content: bytes, where: str) -> ModelDesc:
    s = schema()
    model = s.Model.GetRootAs(content, 0)
    n_buffers = _length(model.BuffersLength(), content, where, "buffers")
    buffer_bytes = [_buffer_bytes(model.Buffers(i), len(content), where, i) for i in range(n_buffers)]

    opcodes = []
    for i in range(_length(model.OperatorCodesLength(), content, where, "operator codes")):
        code = model.OperatorCodes(i)
        builtin = max(int(code.BuiltinCode()), int(code.DeprecatedBuiltinCode()))
        version = int(code.Version())
        if builtin == s.BuiltinOperator.CUSTOM:
            opcodes.append((_text(code.CustomCode()) or "CUSTOM", True, version))
        else:
            opcodes.append((builtin_op_name(builtin), False, version))

    subgraphs = []
    for g in range(_length(model.SubgraphsLength(), content, where, "subgraphs")):
        sg = model.Subgraphs(g)
        tensors = _parse_tensors(sg, content, where, buffer_bytes)
        n_tensors = len(tensors)
        operators = _parse_operators(s, sg, content, where, opcodes, n_tensors)
        io_in, io_out = _ints(sg, "Inputs"), _ints(sg, "Outputs")
        for i in io_in + io_out:
            if not 0 <= i < n_tensors:
                raise ModelLoadError(f"{where}: subgraph {g} input/output refers to tensor {i} of {n_tensors}")
        subgraphs.append(
            SubgraphDesc(
                index=g,
                name=_text(sg.Name()),
                tensors=tuple(tensors),
                operators=tuple(operators),
                inputs=io_in,
                outputs=io_out,
            )
        )
    if not subgraphs:
        raise ModelLoadError(f"{where}: the model has no subgraph")

    signatures = []
    for i in range(_length(model.SignatureDefsLength(), content, where, "signatures")):
        sig = model.SignatureDefs(i)
        inputs = {_text(sig.Inputs(j).Name()): int(sig.Inputs(j).TensorIndex()) for j in range(sig.InputsLength())}
        outputs = {_text(sig.Outputs(j).Name()): int(sig.Outputs(j).TensorIndex()) for j in range(sig.OutputsLength())}
        signatures.append(
            SignatureDesc(
                key=_text(sig.SignatureKey()), subgraph=int(sig.SubgraphIndex()), inputs=inputs, outputs=outputs
            )
        )

    return ModelDesc(
        path=None,
        size_bytes=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        schema_version=int(model.Version()),
        description=_text(model.Description()),
        subgraphs=tuple(subgraphs),
        signatures=tuple(signatures),
    )


def verify_tflite(content: bytes, where: str = "model") -> ModelDesc:
    """Check that ``content`` is a complete, consistent .tflite flatbuffer and describe it.

    Raises:
        ModelLoadError: naming ``where`` and what is wrong (not a .tflite file,
            truncated, an index out of range, ...).
    """
    if len(content) < 8:
        raise ModelLoadError(f"{where}: {len(content)} bytes is too short to be a .tflite file")
    if content[4:8] != FILE_IDENTIFIER:
        raise ModelLoadError(f"{where}: not a .tflite file (no TFL3 identifier); is it another format or corrupted?")
    root = struct.unpack_from("<I", content, 0)[0]
    if root + 4 > len(content):
        raise ModelLoadError(f"{where}: the file is truncated (root table at {root} of {len(content)} bytes)")
    try:
        return _parse(content, where)
    except ModelLoadError:
        raise
    except (struct.error, IndexError, ValueError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        kind = "struct.error" if isinstance(exc, struct.error) else type(exc).__name__
        raise ModelLoadError(f"{where}: corrupted or truncated .tflite file ({kind}: {exc})") from exc


def read_tflite(path: str | Path) -> ModelDesc:
    """Read and verify the .tflite file at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such .tflite file")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read it ({exc.strerror})") from exc
    desc = verify_tflite(content, str(path))
    return _with_path(desc, str(path))


def _with_path(desc: ModelDesc, path: str) -> ModelDesc:
    from dataclasses import replace

    return replace(desc, path=path)


def op_precision(desc: ModelDesc, op: OperatorDesc, subgraph: SubgraphDesc | None = None) -> str:
    """Classify an op as "int8", "int16", "float" or "other" by its activation tensors.

    Constant inputs (int32 bias, shape tensors, float weights of dynamic-range ops) do not
    decide it: an op computes in float if any non-constant input or output is float.
    """
    sg = subgraph or desc.main
    tensors = [sg.tensors[i] for i in op.inputs + op.outputs if i >= 0]
    activations = [t for t in tensors if not t.is_constant] or tensors
    dtypes = {t.dtype for t in activations}
    if dtypes & FLOAT_DTYPES:
        return "float"
    if dtypes & QUANT8_DTYPES and dtypes <= QUANT8_DTYPES | {"int32", "bool"}:
        return "int8"
    if "int16" in dtypes:
        return "int16"
    return "other"


@dataclass(frozen=True)
class OpSummary:
    """Ops by type and the share computed in int8 vs float."""

    total: int
    by_type: dict[str, int]
    int8_ops: int
    float_ops: int
    other_ops: int
    int8_share: float
    float_share: float
    int16_ops: int = 0  # 16-bit activations, 8-bit weights (16x8): integer, but not int8
    int16_share: float = 0.0


def precision_counts(desc: ModelDesc) -> dict[str, int]:
    """How many ops of the main subgraph compute in each precision: int8, int16 (16x8), float, other."""
    return dict(Counter(op_precision(desc, op) for op in desc.main.operators))


def op_summary(desc: ModelDesc) -> OpSummary:
    sg = desc.main
    counts = Counter(op.op_type for op in sg.operators)
    kinds = precision_counts(desc)
    total = len(sg.operators)
    int8, floats, int16 = kinds.get("int8", 0), kinds.get("float", 0), kinds.get("int16", 0)
    return OpSummary(
        total=total,
        by_type=dict(counts.most_common()),
        int8_ops=int8,
        float_ops=floats,
        other_ops=total - int8 - floats,
        int8_share=round(int8 / total, 4) if total else 0.0,
        float_share=round(floats / total, 4) if total else 0.0,
        int16_ops=int16,
        int16_share=round(int16 / total, 4) if total else 0.0,
    )


def tensors_by_dtype(desc: ModelDesc) -> dict[str, int]:
    return dict(Counter(t.dtype for t in desc.main.tensors).most_common())


def bytes_by_dtype(desc: ModelDesc) -> dict[str, int]:
    """Bytes of constant data (weights, biases, tables) per dtype over all subgraphs."""
    seen: set[int] = set()
    totals: Counter[str] = Counter()
    for sg in desc.subgraphs:
        for t in sg.tensors:
            if t.is_constant and t.buffer not in seen:
                seen.add(t.buffer)
                totals[t.dtype] += t.constant_bytes
    return dict(totals.most_common())


def is_integer_only(desc: ModelDesc) -> bool:
    """True when no tensor of any subgraph is a float: inputs, outputs, weights, activations."""
    return not any(t.dtype in FLOAT_DTYPES for sg in desc.subgraphs for t in sg.tensors)
