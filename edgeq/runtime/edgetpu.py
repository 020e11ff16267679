"""Coral Edge TPU: compatibility checks from the flatbuffer, and the edgetpu_compiler.

The checks follow Coral's model requirements (g.co/coral/model-reqs): int8/uint8
tensors, static shapes, supported ops, at most 3 dimensions larger than 1 (only the 3
innermost of a higher-rank tensor), no fused activation on Concatenation or pooling.
The compiler maps ops in order until the first one it cannot map; that op and every
op after it run on the CPU, so the first failing op is what a user has to fix.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from edgeq.errors import ConversionError, RuntimeBackendError
from edgeq.runtime.flatbuffer import EDGETPU_CUSTOM_OP, FLOAT_DTYPES, QUANT8_DTYPES, ModelDesc, OperatorDesc

log = logging.getLogger(__name__)

# Ops the Edge TPU compiler can map (Coral's "supported operations" table).
EDGETPU_SUPPORTED_OPS = frozenset(
    {
        "ADD",
        "AVERAGE_POOL_2D",
        "CONCATENATION",
        "CONV_2D",
        "DEPTHWISE_CONV_2D",
        "EXPAND_DIMS",
        "FULLY_CONNECTED",
        "L2_NORMALIZATION",
        "LOGISTIC",
        "LSTM",
        "MAXIMUM",
        "MAX_POOL_2D",
        "MEAN",
        "MINIMUM",
        "MUL",
        "PACK",
        "PAD",
        "PRELU",
        "QUANTIZE",
        "REDUCE_MAX",
        "REDUCE_MIN",
        "RELU",
        "RELU6",
        "RELU_N1_TO_1",
        "RESHAPE",
        "RESIZE_BILINEAR",
        "RESIZE_NEAREST_NEIGHBOR",
        "RSQRT",
        "SLICE",
        "SOFTMAX",
        "SPACE_TO_DEPTH",
        "SPLIT",
        "SQUARED_DIFFERENCE",
        "SQUEEZE",
        "STRIDED_SLICE",
        "SUB",
        "SUM",
        "TANH",
        "TRANSPOSE",
        "TRANSPOSE_CONV",
    }
)
NO_FUSED_ACTIVATION_OPS = frozenset({"CONCATENATION", "AVERAGE_POOL_2D", "MAX_POOL_2D"})
# The Edge TPU compiler is frozen at 16.0 (2022): it knows operator versions up to those of its
# TensorFlow Lite, and refuses a whole file ("Didn't find op for builtin opcode ... version ...",
# "Model could not be parsed") holding a newer one. The first version 16.0 is seen to refuse:
# CONV_2D 6 (google-coral/edgetpu#631), TRANSPOSE_CONV 4 (#845), QUANTIZE 3 (#879), EXP 2
# (google-coral/libedgetpu#71). Ops not listed here are not known to be refused by version.
COMPILER_VERSION = "16.0"
COMPILER_REFUSES_FROM = {"CONV_2D": 6, "TRANSPOSE_CONV": 4, "QUANTIZE": 3, "EXP": 2}
COMPILER = "edgetpu_compiler"
COMPILER_INSTALL_HINT = (
    "edgetpu_compiler is not on PATH; it runs only on x86-64 Debian/Ubuntu: "
    "sudo apt-get install edgetpu-compiler from the coral-edgetpu-stable repository (see deploy/CORAL.md)"
)


@dataclass(frozen=True)
class OpCheck:
    index: int
    op_type: str
    reasons: tuple[str, ...]  # empty when the op can run on the Edge TPU

    @property
    def ok(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class EdgeTPUReport:
    """Whether a model can be compiled for the Edge TPU, and where it would fall back."""

    compatible: bool
    compiled: bool  # the file already holds an edgetpu-custom-op (edgetpu_compiler output)
    compiled_ops: int
    ops_checked: int
    ops_mappable: int  # ops before the first failing one: what the compiler would map
    first_fallback: OpCheck | None
    failing: tuple[OpCheck, ...]
    # operator versions edgetpu_compiler 16.0 refuses: it rejects the whole file, mapping nothing
    refused_versions: tuple[str, ...] = ()

    @property
    def mapped_share(self) -> float:
        """The share of the ops the compiler would map (0 when it would refuse the file)."""
        if self.refused_versions or not self.ops_checked:
            return 0.0
        return self.ops_mappable / self.ops_checked


def _check_op(desc: ModelDesc, op: OperatorDesc) -> OpCheck:
    sg = desc.main
    reasons = []
    if op.op_type not in EDGETPU_SUPPORTED_OPS:
        reasons.append("custom op" if op.custom else "op not supported by the Edge TPU")
    tensors = [sg.tensors[i] for i in op.inputs + op.outputs if i >= 0]
    bad = sorted({t.dtype for t in tensors if t.dtype in FLOAT_DTYPES or t.dtype in ("int16", "int64")})
    bad_activations = sorted(
        {t.dtype for t in tensors if not t.is_constant and t.dtype not in QUANT8_DTYPES and t.dtype != "int32"}
    )
    if "int16" in bad_activations:
        reasons.append("16-bit activations (16x8): the Edge TPU maps int8 ops only")
    elif bad or bad_activations:
        reasons.append(f"not int8 ({', '.join(sorted(set(bad) | set(bad_activations)))} tensors)")
    if any(t.dynamic for t in tensors):
        reasons.append("dynamic shape")
    for t in tensors:
        if t.is_constant:  # weights are laid out by the compiler; the rule is about activations
            continue
        shape = t.shape
        if len(shape) > 3 and any(d != 1 for d in shape[:-3]):
            reasons.append(f"tensor {t.name or t.index} {list(shape)} has more than 3 dimensions larger than 1")
            break
    if op.op_type in NO_FUSED_ACTIVATION_OPS and op.fused_activation != "NONE":
        reasons.append(f"fused {op.fused_activation} activation on {op.op_type}")
    return OpCheck(op.index, op.op_type, tuple(reasons))


def check_edgetpu(desc: ModelDesc) -> EdgeTPUReport:
    """Check every op of the main subgraph against the Edge TPU requirements."""
    ops = desc.main.operators
    compiled_ops = sum(1 for op in ops if op.op_type == EDGETPU_CUSTOM_OP)
    checks = [_check_op(desc, op) for op in ops if op.op_type != EDGETPU_CUSTOM_OP]
    failing = tuple(c for c in checks if not c.ok)
    first = failing[0] if failing else None
    mappable = len(checks) if first is None else sum(1 for c in checks if c.index < first.index)
    refused = refused_versions(ops)
    return EdgeTPUReport(
        compatible=not failing and bool(ops) and not refused,
        compiled=compiled_ops > 0,
        compiled_ops=compiled_ops,
        ops_checked=len(checks),
        ops_mappable=mappable,
        first_fallback=first,
        failing=failing,
        refused_versions=refused,
    )


def refused_versions(ops) -> tuple[str, ...]:
    """Each operator version in ``ops`` that edgetpu_compiler 16.0 refuses, with the ops that have it."""
    found: dict[tuple[str, int], list[int]] = {}
    for op in ops:
        first_refused = COMPILER_REFUSES_FROM.get(op.op_type)
        if first_refused is not None and op.version >= first_refused:
            found.setdefault((op.op_type, op.version), []).append(op.index)
    lines = []
    for (op_type, version), idx in sorted(found.items()):
        ops_text = f"op{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx[:6]))}{' ...' if len(idx) > 6 else ''}"
        highest = COMPILER_REFUSES_FROM[op_type] - 1
        lines.append(f"{op_type} v{version} ({ops_text}; compiler {COMPILER_VERSION} takes up to v{highest})")
    return tuple(lines)


# ----------------------------------------------------------------------- compiler


@dataclass(frozen=True)
class CompilerOp:
    op_type: str
    count: int
    status: str

    @property
    def mapped(self) -> bool:
        return self.status.lower().startswith("mapped to edge tpu")


@dataclass(frozen=True)
class EdgeTPUCompileResult:
    """What edgetpu_compiler did: the file it wrote and which ops it mapped."""

    ok: bool
    returncode: int
    compiler: str
    compiler_version: str
    output_path: str | None
    log_path: str | None
    ops_mapped: int
    ops_not_mapped: int
    ops: tuple[CompilerOp, ...]
    subgraphs: int | None
    on_chip_memory: str | None
    off_chip_memory: str | None
    log: str


def find_edgetpu_compiler() -> str | None:
    """The path of edgetpu_compiler on PATH, or None."""
    return shutil.which(COMPILER)


_OP_ROW = re.compile(r"^(?P<op>[A-Z][A-Z0-9_]*|[a-z][\w-]*)\s+(?P<count>\d+)\s+(?P<status>\S.*)$")


def _search(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text, re.MULTILINE)
    return match.group(1).strip() if match else None


def parse_compiler_log(stdout: str, operation_log: str = "") -> dict:
    """Parse edgetpu_compiler's stdout and its operation log (the ``*_edgetpu.log`` table).

    Returns a dict of EdgeTPUCompileResult fields (without ok/returncode/compiler/log).
    """
    ops = []
    for line in operation_log.splitlines():
        match = _OP_ROW.match(line.strip())
        if match and match.group("op") != "Operator":
            ops.append(CompilerOp(match.group("op"), int(match.group("count")), match.group("status").strip()))
    mapped = sum(op.count for op in ops if op.mapped)
    not_mapped = sum(op.count for op in ops if not op.mapped)
    on_tpu = _search(r"Number of operations that will run on Edge TPU:\s*(\d+)", stdout)
    on_cpu = _search(r"Number of operations that will run on CPU:\s*(\d+)", stdout)
    total = _search(r"Total number of operations:\s*(\d+)", stdout)
    if not ops:  # no table: fall back to the summary lines
        if on_tpu is not None:
            mapped = int(on_tpu)
            not_mapped = int(on_cpu or 0)
        elif total is not None and "Compilation succeeded" in stdout and on_cpu is None:
            mapped = int(total)
    subgraphs = _search(r"Number of Edge TPU subgraphs:\s*(\d+)", stdout)
    return {
        "compiler_version": _search(r"Edge TPU Compiler version\s*(\S+)", stdout) or "unknown",
        "output_path": _search(r"^Output model:\s*(.+)$", stdout),
        "log_path": _search(r"^Operation log:\s*(.+)$", stdout),
        "ops_mapped": mapped,
        "ops_not_mapped": not_mapped,
        "ops": tuple(ops),
        "subgraphs": int(subgraphs) if subgraphs else None,
        "on_chip_memory": _search(r"On-chip memory used for caching model parameters:\s*(\S+)", stdout),
        "off_chip_memory": _search(r"Off-chip memory used for streaming uncached model parameters:\s*(\S+)", stdout),
    }


def run_edgetpu_compiler(
    path: str | Path, out_dir: str | Path, *, timeout_s: int = 600, extra_args: tuple[str, ...] = ()
) -> EdgeTPUCompileResult:
    """Run edgetpu_compiler on ``path``, writing into ``out_dir``, and parse what it says.

    Raises:
        RuntimeBackendError: the compiler is not on PATH (with the install hint).
        ConversionError: it ran but failed (its last line of output says why).
    """
    compiler = find_edgetpu_compiler()
    if compiler is None:
        raise RuntimeBackendError(COMPILER_INSTALL_HINT)
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [compiler, "--out_dir", str(out_dir), "--show_operations", *extra_args, str(path)]
    log.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ConversionError(f"edgetpu_compiler did not finish on {path} within {timeout_s} s") from exc
    stdout = proc.stdout + proc.stderr
    operation_log = ""
    log_file = out_dir / f"{path.stem}_edgetpu.log"
    if log_file.is_file():
        operation_log = log_file.read_text(errors="replace")
    elif "Operator" in stdout:  # --show_operations prints the table on stdout
        operation_log = stdout
    fields = parse_compiler_log(stdout, operation_log)
    output = out_dir / f"{path.stem}_edgetpu.tflite"
    fields["output_path"] = str(output) if output.is_file() else None
    fields["log_path"] = str(log_file) if log_file.is_file() else fields["log_path"]
    result = EdgeTPUCompileResult(
        ok=proc.returncode == 0 and output.is_file(),
        returncode=proc.returncode,
        compiler=compiler,
        log=stdout,
        **fields,
    )
    if not result.ok:
        last = next((line for line in reversed(stdout.strip().splitlines()) if line.strip()), "no output")
        raise ConversionError(f"edgetpu_compiler failed on {path} (exit {proc.returncode}): {last.strip()}")
    return result
