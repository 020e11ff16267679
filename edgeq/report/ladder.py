"""The report's ladder section: what `edgeq optimize` tried, rung by rung, and every candidate's latency
against its change on val (the frontier), FP32 and the chosen one marked."""

from __future__ import annotations

from edgeq.report import figures
from edgeq.report.format import Check, _num
from edgeq.report.sources import Sources
from edgeq.tasks.verdicts import Verdict


def ladders(sources: Sources) -> tuple[list[dict], list[Check]]:
    out, checks = [], []
    for doc in sources.of("ladder"):
        d = doc.data
        rungs = []
        for r in d["rungs"]:
            rungs.append(
                {
                    **{k: r.get(k) for k in ("number", "name", "outcome", "why", "way", "seconds", "file")},
                    "latency_ms": r.get("latency_ms"),
                    "size_bytes": r.get("size_bytes"),
                    "val": Verdict.from_dict(r["val"]).line() if r.get("val") else None,
                    "test": Verdict.from_dict(r["test"]).line() if r.get("test") else None,
                }
            )
        out.append(
            {
                "path": str(doc.path),
                "line": d["line"],
                "passed": bool(d["passed"]),
                "splits": d["splits"],
                "target": d["target"]["name"],
                "latency_on": d.get("latency_on"),
                "fp32": d["fp32"],
                "rungs": rungs,
                "figure": _frontier(d),
            }
        )
        checks.append(Check(bool(d["passed"]), f"optimize {doc.path.parent.name}: {d['line']}"))
    return out, checks


def _frontier(d: dict) -> str | None:
    """Every timed candidate of every rung: a plan's points by their val change, a QAT model by its val verdict."""
    points = []
    for r in d["rungs"]:
        for p in r.get("candidates") or []:
            if _num(p.get("latency_ms")) is not None and _num(p.get("worse_by")) is not None:
                points.append({"way": p.get("way"), "latency_ms": p["latency_ms"], "worse_by": p["worse_by"]})
        if r.get("val") and _num(r.get("latency_ms")) is not None:
            points.append({"way": r["way"], "latency_ms": r["latency_ms"], "worse_by": r["val"]["worse_by"]})
    chosen = next((r for r in d["rungs"] if r["outcome"] == "chosen"), None)
    if not points or _num(d["fp32"].get("latency_ms")) is None:
        return None
    if chosen is not None and chosen.get("test"):  # ringed where test put it
        mark = {"latency_ms": chosen["latency_ms"], "worse_by": chosen["test"]["worse_by"]}
    else:  # nothing chosen: the most accurate candidate is ringed
        mark = min(points, key=lambda p: p["worse_by"])
    return figures.speed_frontier(points, float(d["budget"]), mark, d["fp32"])
