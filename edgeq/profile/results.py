"""What `edgeq profile` reports: its JSON schema as dataclasses."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from edgeq.runtime.flatbuffer import OpSummary
from edgeq.runtime.interpreter import TensorInfo

SCHEMA = "edgeq.profile/1"


MAX_RUNS = 1_000_000  # a cap for --min-seconds on models that take microseconds


PROGRESS_AFTER_S = 2.0  # show a progress bar when a loop is expected to take longer


@dataclass(frozen=True)
class Environment:
    """Where the numbers were measured."""

    cpu_model: str
    machine: str
    cores: int
    cores_available: int
    governor: str | None
    temperature_c: float | None
    os: str
    python: str
    numpy_version: str
    runtime: str
    runtime_version: str
    edgeq_version: str
    hostname: str


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds per inference over ``runs`` timed invocations (after warm-up)."""

    runs: int
    warmup: int
    total_s: float
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    throughput_per_s: float  # samples per second at the median latency


@dataclass(frozen=True)
class MemoryStats:
    """Resident memory of this process in MiB (VmHWM is reset before load and before runs)."""

    rss_before_mb: float
    peak_rss_load_mb: float
    peak_rss_run_mb: float
    peak_reset: bool  # False where the high-water mark could not be reset (then it is process-wide)


@dataclass(frozen=True)
class RunResult:
    """One model at one thread count."""

    threads: int
    delegate: str
    init_ms: float
    first_inference_ms: float
    latency: LatencyStats
    memory: MemoryStats
    # XNNPACK's partitions and the ops it left out (edgeq.runtime.delegation); None with another delegate
    partitions: dict | None = None


@dataclass(frozen=True)
class ModelFacts:
    path: str
    sha256: str
    size_bytes: int
    integer_only: bool
    inputs: tuple[TensorInfo, ...]  # as the interpreter reports them (runtime.interpreter)
    outputs: tuple[TensorInfo, ...]
    ops: OpSummary


@dataclass(frozen=True)
class Scores:
    """Each output scored by its task on the data's labels; ``value``: the first output's primary metric."""

    samples: int
    labelled: bool
    value: float | None  # the first output's primary metric (``metric``); None without labels
    outputs: tuple[dict, ...] = ()  # each output: name, task, its task's metrics (edgeq.tasks.table.score)
    detection: dict | None = None  # a detector on data with boxes: decoded here; mAP here or by the host
    metric: str | None = None  # what ``value`` holds: accuracy, rmse, auc, map50 (edgeq.tasks.metrics.METRICS)


@dataclass(frozen=True)
class ModelProfile:
    model: ModelFacts
    runs: tuple[RunResult, ...]
    scores: Scores | None  # None without data
    detections: tuple | None = field(default=None, repr=False, compare=False)  # per image, not in the JSON


@dataclass(frozen=True)
class Agreement:
    """The model's outputs against the reference's on the same data (the first output; ``outputs``: each)."""

    samples: int
    top1_agreement: float | None  # None: the output is not classes
    max_abs_error: float
    mean_abs_error: float
    rmse: float
    sqnr_db: float | None = None
    outputs: tuple[dict, ...] = ()  # each output by name: agreement, SQNR, max abs error


@dataclass(frozen=True)
class Comparison:
    """Model vs reference at one thread count; speedup > 1 and size_ratio < 1 are wins."""

    threads: int
    speedup: float  # reference median / model median
    size_ratio: float  # model bytes / reference bytes
    worse_by: float | None  # how much worse the model's metric is, in change_unit (negative: better)
    top1_agreement: float | None
    max_abs_error: float | None
    metric: str | None = None  # what worse_by measures (the first output's task metric)
    change_unit: str | None = None  # of worse_by: "pp", "%" (of an error such as RMSE), "points"


@dataclass(frozen=True)
class DataInfo:
    path: str
    sha256: str
    samples: int
    labels: str | None


@dataclass(frozen=True)
class ProfileSettings:
    threads: tuple[int, ...]
    runs: int
    warmup: int
    min_seconds: float
    delegate: str
    runtime: str | None


@dataclass(frozen=True)
class ThermalState:
    """What the device's thermals say at one moment (None: not readable on this device)."""

    temperature_c: float | None  # the hottest thermal zone
    cpu_mhz: float | None  # cpu0's current frequency
    throttled: str | None  # Raspberry Pi firmware flags (`vcgencmd get_throttled`), e.g. "0x0"


@dataclass(frozen=True)
class Thermal:
    """Before and after the timed runs; whether the device throttled in between."""

    before: ThermalState
    after: ThermalState
    throttled_during: bool | None  # None: this device does not report throttling (no vcgencmd)


@dataclass(frozen=True)
class ProfileReport:
    schema: str
    edgeq_version: str
    created: str
    environment: Environment
    settings: ProfileSettings
    model: ModelProfile
    reference: ModelProfile | None
    agreement: Agreement | None
    comparison: tuple[Comparison, ...]
    data: DataInfo | None
    thermal: Thermal | None = None


def report_to_dict(report: ProfileReport) -> dict[str, Any]:
    """The report as JSON-ready dicts and lists (what ``--json`` writes)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return clean(dataclasses.asdict(report))
