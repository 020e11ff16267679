"""The layouts of the detectors people deploy, decoded outside the int8 graph: SSD and YOLO.

- ``ssd``: a box regressor head (A, 4 + 2L) relative to A fixed anchors, and a score head (A, K)
  or (A, K + 1) with a background column. The anchors come from a declared config, the generator
  of MediaPipe's SsdAnchorsCalculator and of TF Object Detection API's SSD anchor generator (one
  algorithm: layers of strides or feature-map sizes, scales from ``min_scale`` to ``max_scale``,
  aspect ratios, the interpolated scale, anchor offsets, a fixed anchor size). A box is decoded with
  the box coder's scales, in y/x/h/w order (TF OD API) or x/y/w/h (MediaPipe), its size linear or
  exponential (``exp(t / scale)``: TF OD API's Faster R-CNN coder); keypoints after the box are not
  scored. Scores go through sigmoid, softmax or nothing.
- ``yolo``: one tensor (1, 4 + K, N) (ultralytics v8/11) or (1, N, 4 + K), or v5's (1, N, 5 + K)
  with an objectness column: centre-size boxes in pixels of the input or normalised, class scores.

Every layout ends in the same ``Detections`` (normalised corners) and per-class NMS as the others
(``edgeq.tasks.detection``). numpy only: the device decodes with it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgeq.errors import DataError, UsageError

ORDERS = ("yxhw", "xywh")
MAX_ANCHORS = 1_000_000
SCORE_ACTIVATIONS = ("sigmoid", "softmax", "none")


@dataclass(frozen=True)
class SsdAnchors:
    """An SSD anchor config (the options of MediaPipe's SsdAnchorsCalculator, TF OD API's SSD generator)."""

    input_size: tuple[int, int]  # (height, width)
    num_layers: int
    min_scale: float
    max_scale: float
    strides: tuple[int, ...] = ()  # one per layer; or feature_map_sizes
    feature_map_sizes: tuple[tuple[int, int], ...] = ()
    aspect_ratios: tuple[float, ...] = (1.0,)
    interpolated_scale_aspect_ratio: float = 1.0  # 0: none
    anchor_offset: tuple[float, float] = (0.5, 0.5)  # (y, x), in cells
    fixed_anchor_size: bool = False  # every anchor 1 x 1 (MediaPipe's face, palm and pose detectors)
    reduce_boxes_in_lowest_layer: bool = False

    @classmethod
    def from_dict(cls, d: dict, where: str = "the anchor config") -> SsdAnchors:
        try:
            size = d["input_size"]
            size = (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))
            anchors = cls(
                input_size=size,
                num_layers=int(d["num_layers"]),
                min_scale=float(d["min_scale"]),
                max_scale=float(d["max_scale"]),
                strides=tuple(int(s) for s in d.get("strides", ())),
                feature_map_sizes=tuple((int(h), int(w)) for h, w in d.get("feature_map_sizes", ())),
                aspect_ratios=tuple(float(a) for a in d.get("aspect_ratios", (1.0,))),
                interpolated_scale_aspect_ratio=float(d.get("interpolated_scale_aspect_ratio", 1.0)),
                anchor_offset=_pair(d.get("anchor_offset", 0.5)),
                fixed_anchor_size=bool(d.get("fixed_anchor_size", False)),
                reduce_boxes_in_lowest_layer=bool(d.get("reduce_boxes_in_lowest_layer", False)),
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(
                f"{where}: an SSD anchor config needs input_size, num_layers, min_scale, max_scale and strides "
                f"(or feature_map_sizes) ({type(exc).__name__}: {str(exc)[:80]})"
            ) from None
        anchors.check(where)
        return anchors

    def check(self, where: str) -> None:
        """Numbers an anchor generator can use, and no more than MAX_ANCHORS anchors."""
        layers = len(self.strides) or len(self.feature_map_sizes)
        if layers != self.num_layers or not 1 <= self.num_layers <= 16:
            raise UsageError(f"{where}: num_layers is {self.num_layers} but {layers} strides or map sizes are given")
        sizes = (*self.input_size, *self.strides, *(d for s in self.feature_map_sizes for d in s))
        ratios = (self.min_scale, self.max_scale, *self.aspect_ratios)
        if min(sizes) < 1 or max(sizes) > 8192 or not all(math.isfinite(r) and r > 0 for r in ratios):
            raise UsageError(f"{where}: sizes and strides are whole numbers 1..8192, scales and aspect ratios > 0")
        cells = sum(h * w for h, w in self.feature_map_sizes) or sum(
            math.ceil(self.input_size[0] / s) * math.ceil(self.input_size[1] / s) for s in self.strides
        )
        if cells * (len(self.aspect_ratios) + 3) > MAX_ANCHORS:
            raise UsageError(f"{where}: this config makes over {MAX_ANCHORS} anchors: check input_size and strides")

    def to_dict(self) -> dict:
        return {
            "input_size": list(self.input_size),
            "num_layers": self.num_layers,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "strides": list(self.strides),
            "feature_map_sizes": [list(s) for s in self.feature_map_sizes],
            "aspect_ratios": list(self.aspect_ratios),
            "interpolated_scale_aspect_ratio": self.interpolated_scale_aspect_ratio,
            "anchor_offset": list(self.anchor_offset),
            "fixed_anchor_size": self.fixed_anchor_size,
            "reduce_boxes_in_lowest_layer": self.reduce_boxes_in_lowest_layer,
        }


def _pair(value) -> tuple[float, float]:
    if isinstance(value, (int, float)):
        return float(value), float(value)
    return float(value[0]), float(value[1])


def _scale(min_scale: float, max_scale: float, index: int, layers: int) -> float:
    return (min_scale + max_scale) / 2 if layers == 1 else min_scale + (max_scale - min_scale) * index / (layers - 1)


def _layer_boxes(config: SsdAnchors, first: int, last: int) -> list[tuple[float, float]]:
    """(height, width) of the anchors of each cell of the layers ``first`` .. ``last`` - 1 (same stride)."""
    ratios, scales = [], []
    for index in range(first, last):
        scale = _scale(config.min_scale, config.max_scale, index, config.num_layers)
        if index == 0 and config.reduce_boxes_in_lowest_layer:
            ratios += [1.0, 2.0, 0.5]
            scales += [0.1, scale, scale]
            continue
        ratios += list(config.aspect_ratios)
        scales += [scale] * len(config.aspect_ratios)
        if config.interpolated_scale_aspect_ratio > 0:
            following = 1.0 if index == config.num_layers - 1 else _scale(
                config.min_scale, config.max_scale, index + 1, config.num_layers
            )  # fmt: skip
            scales.append(math.sqrt(scale * following))
            ratios.append(config.interpolated_scale_aspect_ratio)
    return [(s / math.sqrt(r), s * math.sqrt(r)) for s, r in zip(scales, ratios)]


def ssd_anchors(config: SsdAnchors) -> np.ndarray:
    """The anchors (A, 4) as (y_centre, x_centre, height, width), normalised, in the heads' order."""
    sizes = list(config.feature_map_sizes)
    if not sizes:
        height, width = config.input_size
        sizes = [(math.ceil(height / s), math.ceil(width / s)) for s in config.strides]
    keys = list(config.strides) or sizes
    anchors = []
    layer = 0
    while layer < config.num_layers:
        last = layer
        while last < config.num_layers and keys[last] == keys[layer]:
            last += 1
        boxes = _layer_boxes(config, layer, last)
        rows, cols = sizes[layer]
        for y in range(rows):
            for x in range(cols):
                for box_h, box_w in boxes:
                    cy, cx = (y + config.anchor_offset[0]) / rows, (x + config.anchor_offset[1]) / cols
                    anchors.append((cy, cx, 1.0, 1.0) if config.fixed_anchor_size else (cy, cx, box_h, box_w))
        layer = last
    return np.asarray(anchors, dtype=np.float64)


@dataclass(frozen=True)
class SsdCoder:
    """How an SSD box regressor reads against its anchor."""

    order: str = "yxhw"  # yxhw: TF OD API; xywh: MediaPipe (reverse_output_order)
    scales: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0)  # y, x, h, w
    exponential: bool = True  # size = exp(t / scale) * anchor (TF OD API); else t / scale * anchor (MediaPipe)
    score: str = "sigmoid"
    background: bool = False  # the score head's first column is the background class

    @classmethod
    def from_dict(cls, d: dict, where: str = "the box coder") -> SsdCoder:
        try:
            coder = cls(
                str(d.get("order", "yxhw")),
                tuple(float(v) for v in d.get("scales", (10.0, 10.0, 5.0, 5.0))),
                bool(d.get("exponential", True)),
                str(d.get("score", "sigmoid")),
                bool(d.get("background", False)),
            )
        except (TypeError, ValueError, AttributeError):
            coder = cls(order="")  # refused below, with what a coder is
        scales_ok = len(coder.scales) == 4 and all(math.isfinite(v) and v != 0 for v in coder.scales)
        if coder.order not in ORDERS or not scales_ok or coder.score not in SCORE_ACTIVATIONS:
            raise UsageError(
                f"{where}: order is one of {', '.join(ORDERS)}, scales four numbers (y, x, h, w), score one of "
                f"{', '.join(SCORE_ACTIVATIONS)}"
            )
        return coder

    def to_dict(self) -> dict:
        return {
            "order": self.order,
            "scales": list(self.scales),
            "exponential": self.exponential,
            "score": self.score,
            "background": self.background,
        }


def _activated(scores: np.ndarray, how: str) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if how == "sigmoid":
        return 1.0 / (1.0 + np.exp(-np.clip(scores, -100.0, 100.0)))
    if how == "softmax":
        shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)
    return scores


def ssd_boxes(regressors: np.ndarray, anchors: np.ndarray, coder: SsdCoder) -> np.ndarray:
    """One image's boxes (A, 4) as normalised (ymin, xmin, ymax, xmax) from regressors (A, >= 4)."""
    raw = np.asarray(regressors, dtype=np.float64)
    if raw.ndim != 2 or raw.shape[-1] < 4 or len(raw) != len(anchors):
        raise DataError(
            f"SSD box head of shape {raw.shape} does not fit {len(anchors)} anchors of 4 or more values each: "
            "check the anchor config (input_size, strides, aspect_ratios) against the model"
        )
    if coder.order == "xywh":
        tx, ty, tw, th = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
    else:
        ty, tx, th, tw = raw[:, 0], raw[:, 1], raw[:, 2], raw[:, 3]
    sy, sx, sh, sw = coder.scales
    ay, ax, ah, aw = anchors[:, 0], anchors[:, 1], anchors[:, 2], anchors[:, 3]
    cy, cx = ty / sy * ah + ay, tx / sx * aw + ax
    if coder.exponential:
        h, w = np.exp(th / sh) * ah, np.exp(tw / sw) * aw
    else:
        h, w = th / sh * ah, tw / sw * aw
    return np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], axis=1)


def ssd_scores(scores: np.ndarray, coder: SsdCoder) -> np.ndarray:
    """One image's class scores (A, K), the background column dropped."""
    activated = _activated(scores, coder.score)
    if activated.ndim == 1:
        activated = activated[:, None]
    return activated[:, 1:] if coder.background else activated


@dataclass(frozen=True)
class YoloFormat:
    """How a YOLO tensor reads: its classes, objectness column, box units."""

    classes: int
    objectness: bool = False  # v5: (cx, cy, w, h, obj, classes...)
    normalized: bool = False  # boxes in [0, 1]; else pixels of input_size
    input_size: tuple[int, int] = (640, 640)  # (height, width)

    @classmethod
    def from_dict(cls, d: dict, where: str = "the YOLO config") -> YoloFormat:
        try:
            size = d.get("input_size", (640, 640))
            size = (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))
            fmt = cls(int(d["classes"]), bool(d.get("objectness", False)), bool(d.get("normalized", False)), size)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            needs = "a YOLO config needs classes (and input_size unless normalized)"
            raise UsageError(f"{where}: {needs}: {str(exc)[:80]}") from None
        if not 1 <= fmt.classes <= 100_000 or min(fmt.input_size) < 1:
            raise UsageError(f"{where}: a YOLO config's classes and input_size are positive whole numbers")
        return fmt

    def to_dict(self) -> dict:
        return {
            "classes": self.classes,
            "objectness": self.objectness,
            "normalized": self.normalized,
            "input_size": list(self.input_size),
        }


def yolo_rows(tensor: np.ndarray, fmt: YoloFormat) -> np.ndarray:
    """One image's YOLO tensor as rows (N, 4 [+1] + K): (4 + K, N) is transposed, (N, 4 + K) kept."""
    width = 4 + int(fmt.objectness) + fmt.classes
    t = np.asarray(tensor, dtype=np.float64)
    if t.ndim != 2 or width not in t.shape:
        raise DataError(
            f"a YOLO output of shape {t.shape} has no axis of {width} (4 box values"
            f"{', objectness' if fmt.objectness else ''} and {fmt.classes} classes): check classes and objectness"
        )
    return t.T if t.shape[0] == width and t.shape[1] != width else t


def yolo_decoded(tensor: np.ndarray, fmt: YoloFormat) -> tuple[np.ndarray, np.ndarray]:
    """One image's boxes (N, 4) as normalised corners and class scores (N, K) from a YOLO tensor."""
    rows = yolo_rows(tensor, fmt)
    cx, cy, w, h = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    if not fmt.normalized:
        height, width = fmt.input_size
        cx, w, cy, h = cx / width, w / width, cy / height, h / height
    boxes = np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], axis=1)
    scores = rows[:, 4 + int(fmt.objectness) :]
    if fmt.objectness:
        scores = scores * rows[:, 4:5]
    return boxes, scores
