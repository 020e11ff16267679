"""``build_report``: the records in, one self-contained HTML page out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from edgeq import __version__
from edgeq.artifacts import atomic_path
from edgeq.errors import DataError, MissingExtraError
from edgeq.report.format import Check, change_label, fixed, metric_change, metric_label, metric_value, pct, signed, size
from edgeq.report.ladder import ladders
from edgeq.report.sections import (
    _fleet,
    _models,
    _ops,
    _outputs,
    _plans,
    _provenance,
    _sensitivity,
    _training,
    _weights,
)
from edgeq.report.sources import Sources, collect


@dataclass(frozen=True)
class ReportResult:
    path: Path
    size_bytes: int
    seconds: float
    verdict: str  # pass | fail | unknown
    sections: tuple[str, ...]


def _verdict(checks: list[Check]) -> dict:
    failed = [c for c in checks if c.ok is False]
    passed = [c for c in checks if c.ok is True]
    if failed:
        status, headline = "fail", f"FAILS: {failed[0].text}"
    elif passed:
        status, headline = "pass", f"PASSES: {len(passed)} check(s), none failed"
    else:
        status, headline = "unknown", "No pass/fail check in these files (no budget, manifest or verify result)"
    order = failed + passed + [c for c in checks if c.ok is None]
    return {"status": status, "headline": headline, "checks": order}


def render(sources: Sources, title: str | None = None) -> tuple[str, dict]:
    """The page's HTML and the context it was made from.

    A record edgeq did not write as it is (edited by hand, cut short, from a newer edgeq) is named
    in one DataError: when the page cannot be made, each document is tried alone to find it.
    """
    try:
        import jinja2
    except ImportError as exc:  # pragma: no cover - the report extra brings it
        raise MissingExtraError('edgeq report needs Jinja2: pip install "edgeq[report]"') from exc
    unreadable = (KeyError, TypeError, ValueError, AttributeError, IndexError, jinja2.TemplateError)
    try:
        return _render(sources, title, jinja2)
    except unreadable:
        for doc in sources.documents:
            try:
                _render(Sources([doc], []), title, jinja2)
            except unreadable as own:
                raise DataError(
                    f"{doc.path}: edgeq report cannot read this {doc.kind} record ({type(own).__name__}: "
                    f"{str(own)[:120]}); it is not as edgeq writes it: write it again with the command that made it"
                ) from own
        raise  # no one document is to blame: a fault of the report itself


def _render(sources: Sources, title: str | None, jinja2) -> tuple[str, dict]:
    models, model_checks = _models(sources)
    plans, plan_checks = _plans(sources)
    fleet, fleet_checks = _fleet(sources)
    ladder, ladder_checks = ladders(sources)
    context = {
        "title": title or "edgeq report",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "edgeq_version": __version__,
        "verdict": _verdict(ladder_checks + model_checks + plan_checks + fleet_checks),
        "ladders": ladder,
        "models": models,
        "outputs": _outputs(sources),
        "training": _training(sources),
        "sensitivity": _sensitivity(sources),
        "plans": plans,
        "weights": _weights(sources),
        "ops": _ops(sources),
        "fleet": fleet,
        "provenance": _provenance(sources),
    }
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("edgeq.report", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(pct=pct, signed=signed, fixed=fixed, size=size, metric_value=metric_value)
    env.filters.update(metric_change=metric_change, metric_label=metric_label, change_label=change_label)
    return env.get_template("report.html.j2").render(**context), context


def build_report(paths: list[str | Path], out: str | Path, title: str | None = None) -> ReportResult:
    """Collect what PATHS hold and write the report to OUT (atomically)."""
    start = time.perf_counter()
    sources = collect(paths)
    page, context = render(sources, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        Path(tmp).write_text(page, encoding="utf-8")
    names = ("ladders", "models", "training", "sensitivity", "plans", "weights", "ops", "fleet")
    sections = tuple(k for k in names if context[k])
    return ReportResult(out, out.stat().st_size, time.perf_counter() - start, context["verdict"]["status"], sections)
