"""The report's plots, drawn with matplotlib and returned as data URIs (the page needs no other file)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from edgeq.errors import MissingExtraError

COLORS = {"fp32": "#4c72b0", "qat": "#dd8452", "budget": "#c44e52", "point": "#55a868"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the report extra brings it
        raise MissingExtraError('edgeq report draws with matplotlib: pip install "edgeq[report]"') from exc
    plt.rcParams.update({"svg.hashsalt": "edgeq", "svg.fonttype": "none", "font.size": 9})
    return plt


def _svg_uri(fig) -> str:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def png_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def training_curves(stages: list[dict]) -> str | None:
    """Accuracy and loss per epoch over every stage (FP32, then each QAT stage), stages marked."""
    if not any(s.get("epochs") for s in stages):
        return None
    plt = _pyplot()
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(8, 3))
    # the first metric Keras logged beside the loss: accuracy for a classifier, mae for a regressor, ...
    first = next((e for s in stages for e in (s.get("epochs") or [])), {})
    metric = next((k for k in first if k not in ("epoch", "seconds", "loss") and not k.startswith("val_")
                   and not k.endswith("_loss")), "accuracy")  # fmt: skip
    start = 0
    for stage in stages:
        epochs = stage.get("epochs") or []
        if not epochs:
            continue
        x = [start + i + 1 for i in range(len(epochs))]
        color = COLORS["fp32"] if stage.get("kind") == "fp32" else COLORS["qat"]
        for key, ax in ((metric, acc_ax), ("loss", loss_ax)):
            if all(key in e for e in epochs):
                ax.plot(x, [e[key] for e in epochs], color=color, alpha=0.45, lw=1)
            if all(f"val_{key}" in e for e in epochs):
                ax.plot(x, [e[f"val_{key}"] for e in epochs], color=color, lw=1.8, label=f"{stage['name']} (val)")
        if start:
            for ax in (acc_ax, loss_ax):
                ax.axvline(start + 0.5, color="#888", ls=":", lw=1)
        start += len(epochs)
    acc_ax.set_title(f"{metric} (thin: train)")
    loss_ax.set_title("loss (thin: train)")
    loss_ax.set_yscale("log")
    for ax in (acc_ax, loss_ax):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    if acc_ax.get_legend_handles_labels()[0]:
        acc_ax.legend(fontsize=7, loc="lower right")
    return _svg_uri(fig)


def sensitivity_bars(layers: list[str], values: list[float], label: str) -> str:
    """One horizontal bar per layer, most sensitive at the top."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 0.28 * len(layers) + 0.9))
    y = list(range(len(layers)))[::-1]
    ax.barh(y, values, color=COLORS["fp32"])
    ax.set_yticks(y, layers, fontsize=7)
    ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)
    return _svg_uri(fig)


def plan_frontier(points: list[dict], budget_pp: float, chosen: dict | None) -> str:
    """Model size vs accuracy drop for each plan tried; the budget as a line, the chosen plan ringed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.scatter([p["size_bytes"] / 1024 for p in points], [p["worse_by"] for p in points], color=COLORS["point"], s=18)
    if chosen is not None:
        ax.scatter([chosen["size_bytes"] / 1024], [chosen["worse_by"]], s=120, facecolors="none", edgecolors="black")
    ax.axhline(budget_pp, color=COLORS["budget"], ls="--", lw=1, label=f"budget {budget_pp:g} pp")
    ax.set_xlabel("model size (KiB)")
    ax.set_ylabel("accuracy drop vs FP32 (pp)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _svg_uri(fig)


def speed_frontier(points: list[dict], budget: float, chosen: dict, fp32: dict) -> str:
    """A target plan's candidates: latency against the metric's change, by way; FP32 and the chosen one marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    for way in sorted({str(p.get("way")) for p in points}):
        mine = [p for p in points if str(p.get("way")) == way]
        ax.scatter([p["latency_ms"] for p in mine], [p["worse_by"] for p in mine], s=18, label=way)
    ax.scatter([fp32["latency_ms"]], [0.0], marker="*", s=120, color="black", label="FP32")
    ax.scatter([chosen["latency_ms"]], [chosen["worse_by"]], s=140, facecolors="none", edgecolors="black",
               label="chosen")  # fmt: skip
    ax.axhline(budget, color=COLORS["budget"], ls="--", lw=1, label=f"budget {budget:g}")
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms (log scale)")
    ax.set_ylabel("worse than FP32")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _svg_uri(fig)
