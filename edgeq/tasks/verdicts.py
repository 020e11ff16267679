"""Verdicts: a quantized model against its reference on one output's task metric, with the evidence.

Every gate and every comparison a user reads (``eval --max-drop``, convert's verification, ``analyze
plan``'s budget, ``train``'s PTQ-vs-QAT line) states the metric, both values, how much worse in the
metric's change unit, n, and a paired bootstrap 95% interval; and refuses (NothingJudged) where the
data cannot score the output, rather than pass.

numpy only, as ``edgeq.tasks.table``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgeq.errors import DataError
from edgeq.tasks.metrics import metric
from edgeq.tasks.table import OutputSpec, score, task

RESAMPLES = 1000  # paired bootstrap resamples behind every interval edgeq prints


def paired_interval(change, n: int, resamples: int = RESAMPLES, seed: int = 0) -> tuple[tuple[float, float], int]:
    """95% percentile interval of ``change(indices)`` over ``resamples`` paired bootstrap resamples of
    ``n`` samples, and how many resamples left it undefined (an AUC of a one-class resample).

    Both models are scored on the same resampled indices, so the interval is of their difference.
    The interval is (nan, nan) when more than 5% of the resamples are undefined: it is not hidden
    by narrowing it to the resamples that happened to work.
    """
    rng = np.random.default_rng(seed)
    values = np.array([change(rng.integers(0, n, n)) for _ in range(resamples)], dtype=np.float64)
    finite = values[np.isfinite(values)]
    undefined = int(len(values) - len(finite))
    if len(finite) == 0 or undefined > 0.05 * resamples:
        return (float("nan"), float("nan")), undefined
    low, high = np.percentile(finite, [2.5, 97.5])
    return (float(low), float(high)), undefined


@dataclass(frozen=True)
class Verdict:
    """One output's primary metric, both models on the same n samples, the change with its paired
    95% interval, and (with a budget) whether it passed and whether n was enough to tell."""

    output: str
    metric: str
    unit: str  # of reference and value: "%" for a share (stored as a fraction), "" otherwise
    reference: float
    value: float
    worse_by: float  # in change_unit; negative: the quantized model is better
    change_unit: str
    n: int
    interval95: tuple[float, float]  # of worse_by, paired bootstrap
    undefined_resamples: int = 0
    budget: float | None = None  # the most worse_by may be, in change_unit
    passed: bool | None = None

    @property
    def resolved(self) -> bool | None:
        """Whether the interval lies wholly on one side of the budget (None: no budget or no interval)."""
        low, high = self.interval95
        if self.budget is None or not (math.isfinite(low) and math.isfinite(high)):
            return None
        return high <= self.budget or low > self.budget

    def line(self) -> str:
        """One line: what, both values, the change with n and interval, and the verdict."""
        row = metric(self.metric)
        low, high = self.interval95
        interval = f"95% CI {low:+.2f}..{high:+.2f}" if math.isfinite(low) else "95% CI undefined"
        text = (
            f"{self.output}: {row.label} {row.show(self.reference)} -> {row.show(self.value)}, "
            f"{row.show_change(self.worse_by)} (n={self.n}, {interval} {row.change_label} worse)"
        )
        if self.budget is None:
            return text
        text += f"; budget {self.budget:g} {row.change_label}: {'pass' if self.passed else 'FAIL'}"
        if self.resolved is False:
            text += " (the interval spans the budget: too few samples to resolve it)"
        return text

    @classmethod
    def from_dict(cls, record: dict) -> Verdict:
        """Back from ``to_dict`` (or its JSON, where an undefined bound is null)."""
        low, high = (math.nan if v is None else float(v) for v in record["interval95"])
        keys = ("output", "metric", "unit", "reference", "value", "worse_by", "change_unit", "n")
        return cls(
            **{k: record[k] for k in keys},
            interval95=(low, high),
            undefined_resamples=int(record.get("undefined_resamples", 0)),
            budget=record.get("budget"),
            passed=record.get("passed"),
        )

    def to_dict(self) -> dict:
        row = metric(self.metric)
        return {
            "output": self.output,
            "metric": self.metric,
            "label": row.label,
            "unit": self.unit,
            "reference": self.reference,
            "value": self.value,
            "worse_by": self.worse_by,
            "change_unit": self.change_unit,
            "higher_is_better": row.higher_is_better,
            "n": self.n,
            "interval95": list(self.interval95),
            "undefined_resamples": self.undefined_resamples,
            "budget": self.budget,
            "passed": self.passed,
            "resolved": self.resolved,
        }


class NothingJudged(DataError):
    """A gate was asked to judge an output its data cannot score: it refuses rather than pass."""


def judge(
    spec: OutputSpec,
    reference: np.ndarray,
    quantized: np.ndarray,
    targets: np.ndarray | None,
    inputs: np.ndarray | None = None,
    budget: float | None = None,
    metric_name: str | None = None,
    seed: int = 0,
) -> Verdict:
    """The Verdict of ``quantized`` against ``reference`` on ``spec``'s primary metric (or ``metric_name``).

    Raises NothingJudged, naming what is missing, when the metric cannot be scored: no targets, a
    task with no metric, or a value that is undefined (an AUC on one class).
    """
    name = metric_name or task(spec.kind).primary
    if not name:
        raise NothingJudged(
            f"output {spec.name!r} is {spec.kind}: it has no task metric to judge; declare its task with --task, "
            "or judge it by output error (SQNR) with --min-sqnr"
        )
    if targets is None and not (spec.kind == "reconstruction" and inputs is not None and name == "reconstruction_mse"):
        raise NothingJudged(
            f"output {spec.name!r} ({spec.kind}) has no targets in the data, so its {metric(name).label} cannot be "
            f"judged; give them ({task(spec.kind).targets}) as 'y' (one output) or 'y_{spec.name}'"
        )
    targets_ = None if targets is None else np.asarray(targets)
    n = len(quantized)

    def value(out, idx=None):
        if idx is None:
            return score(spec, out, targets_, inputs).get(name, float("nan"))
        t = None if targets_ is None else targets_[idx]
        return score(spec, out[idx], t, None if inputs is None else inputs[idx]).get(name, float("nan"))

    ref_value, got_value = float(value(reference)), float(value(quantized))
    row = metric(name)
    worse = row.worse_by(ref_value, got_value)
    if worse is None:
        raise NothingJudged(
            f"output {spec.name!r}: its {row.label} is undefined on these {n} samples (FP32 {ref_value}, "
            f"quantized {got_value}; an AUC needs both classes): give a split that holds both"
        )
    reference_, quantized_ = np.asarray(reference), np.asarray(quantized)
    return verdict_of(
        spec.name, name, lambda idx: value(reference_, idx), lambda idx: value(quantized_, idx), n, budget, seed,
        (ref_value, got_value),
    )  # fmt: skip


def verdict_of(
    output: str, name: str, reference_on, quantized_on, n: int, budget: float | None = None, seed: int = 0,
    values: tuple[float, float] | None = None,
) -> Verdict:  # fmt: skip
    """The Verdict of two models on metric ``name`` over n paired samples (images, rows), where
    ``reference_on(idx)`` and ``quantized_on(idx)`` score each model on the samples at ``idx`` (with
    repeats), and on all of them once when ``idx`` is None (``values``, when already scored)."""
    row = metric(name)
    ref_value, got_value = values if values is not None else (float(reference_on(None)), float(quantized_on(None)))
    worse = row.worse_by(ref_value, got_value)
    if worse is None:
        raise NothingJudged(f"output {output!r}: its {row.label} is undefined on these {n} samples")

    def change(idx):
        got = row.worse_by(reference_on(idx), quantized_on(idx))
        return float("nan") if got is None else got

    interval, undefined = paired_interval(change, n, seed=seed)
    return Verdict(
        output, name, row.unit, ref_value, got_value, worse, row.change, n, interval, undefined, budget,
        None if budget is None else bool(worse <= budget),
    )  # fmt: skip
