"""Object detection outside the int8 graph: decoding, non-maximum suppression, mAP.

A detector's .tflite ends at its heads (a box tensor and a class-score tensor, kept apart so
each gets its own int8 scale); edgeq turns them into boxes here, in numpy, on the host and on
the device alike. Two layouts:

- ``centre`` (edgeq's zoo detector): on an S x S grid, ``scores`` (S, S, K) are per-class
  sigmoid centre probabilities and ``boxes`` (S, S, 4) are sigmoid (dy, dx, h, w): the object's
  centre within its cell and its size as a fraction of the image;
- ``plain``: ``boxes`` (A, 4) as (ymin, xmin, ymax, xmax) in [0, 1] and ``scores`` (A, K);
- ``ssd`` and ``yolo``, the detectors people download (``edgeq.tasks.detectors``), declared with
  their anchors or format in the task file (``--task spec.json``: ``{"detection": {...}}``).

Ground truth is ``gt_boxes`` (N, M, 4) in the same normalised (ymin, xmin, ymax, xmax) and
``gt_classes`` (N, M), -1 where a row is padding. mAP comes from pycocotools (host side).
numpy only apart from that: the device decodes with it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgeq.errors import DataError, MissingExtraError, UsageError

# A detector's ground truth in data files: normalised corners (N, M, 4) and classes (N, M), -1 unused.
GROUND_TRUTH = ("gt_boxes", "gt_classes")

LAYOUTS = ("centre", "plain", "ssd", "yolo")
SCORE_THRESHOLD = 0.05  # detections below this are not kept (COCO evaluation takes the top 100 per image)
IOU_THRESHOLD = 0.5
MAX_DETECTIONS = 100


@dataclass(frozen=True)
class DetectionSpec:
    """Which outputs are a detector's box and score heads, in which layout, with how many classes."""

    boxes: str = "boxes"
    scores: str = "scores"
    layout: str = "centre"
    classes: int = 0
    class_names: tuple[str, ...] = field(default_factory=tuple)
    # ssd: {"anchors": SsdAnchors, "coder": SsdCoder} as dicts; yolo: YoloFormat's dict (edgeq.tasks.detectors)
    decoder: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        found = {
            "boxes": self.boxes,
            "scores": self.scores,
            "layout": self.layout,
            "classes": self.classes,
            "class_names": list(self.class_names),
        }
        return {**found, "decoder": self.decoder} if self.decoder else found

    @classmethod
    def from_dict(cls, d: dict, where: str = "the detection spec") -> DetectionSpec:
        layout = str(d.get("layout", "centre"))
        if layout not in LAYOUTS:
            raise UsageError(f"{where}: unknown detection layout {layout!r}; edgeq decodes: {', '.join(LAYOUTS)}")
        decoder = d.get("decoder") or {k: d[k] for k in ("anchors", "coder", "yolo") if k in d}
        try:
            spec = cls(
                str(d.get("boxes", "boxes")),
                str(d.get("scores", d.get("boxes", "scores") if layout == "yolo" else "scores")),
                layout,
                int(d.get("classes", 0)),
                tuple(str(n) for n in d.get("class_names") or ()),
                dict(decoder) if isinstance(decoder, dict) else {},
            )
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{where}: classes is a whole number, class_names a list ({str(exc)[:80]})") from None
        spec.checked(where)
        return spec

    def checked(self, where: str) -> None:
        """An ssd spec has its anchors and coder, a yolo spec its format: refused here, in one line, if not."""
        from edgeq.tasks.detectors import SsdAnchors, SsdCoder, YoloFormat

        if self.layout == "ssd":
            if "anchors" not in self.decoder:
                raise UsageError(f'{where}: an ssd detector needs its anchor config: "anchors": {{...}}')
            SsdAnchors.from_dict(self.decoder["anchors"], where)
            SsdCoder.from_dict(self.decoder.get("coder") or {}, where)
        elif self.layout == "yolo":
            YoloFormat.from_dict({"classes": self.classes, **(self.decoder.get("yolo") or {})}, where)


def declared_detection(task_spec: str | None) -> DetectionSpec | None:
    """The detector a task file declares (``{"detection": {"layout": "ssd", ...}}``); None if none."""
    from edgeq.tasks.table import task_file

    data = task_file(task_spec)
    if data is None or "detection" not in data:
        return None
    if not isinstance(data["detection"], dict):
        raise UsageError(f'{task_spec}: "detection" is an object: boxes, scores, layout, classes, anchors ...')
    return DetectionSpec.from_dict(data["detection"], str(task_spec))


def detection_spec_of(specs, declared: DetectionSpec | None = None) -> DetectionSpec | None:
    """The DetectionSpec of outputs (edgeq.tasks.table.OutputSpec) that include a box and a score head; else None.

    A declared one (the task file's) wins. A box head of (S, S, 4) is the ``centre`` layout, one of
    (A, 4) the ``plain`` one.
    """
    if declared is not None:
        return declared
    boxes_heads = [s for s in specs if s.kind == "detection_boxes"]
    score_heads = [s for s in specs if s.kind == "detection_scores"]
    if not boxes_heads or not score_heads:
        return None
    if len(boxes_heads) > 1 or len(score_heads) > 1:  # which box goes with which score is not edgeq's to guess
        raise UsageError(
            f"the model has {len(boxes_heads)} box head(s) ({', '.join(s.name for s in boxes_heads)}) and "
            f"{len(score_heads)} score head(s) ({', '.join(s.name for s in score_heads)}): edgeq decodes one pair; "
            "declare the pair to judge with --task BOXES=detection_boxes,SCORES=detection_scores and the rest as "
            "other"
        )
    boxes, scores = boxes_heads[0], score_heads[0]
    layout = "centre" if len(boxes.shape) == 3 else "plain"
    return DetectionSpec(boxes.name, scores.name, layout, int(scores.shape[-1]))


@dataclass(frozen=True)
class Detections:
    """One image's detections: boxes (D, 4) normalised (ymin, xmin, ymax, xmax), scores (D,), classes (D,)."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


def iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Intersection over union of one (ymin, xmin, ymax, xmax) box with each of ``others``."""
    top = np.maximum(box[0], others[:, 0])
    left = np.maximum(box[1], others[:, 1])
    bottom = np.minimum(box[2], others[:, 2])
    right = np.minimum(box[3], others[:, 3])
    inter = np.clip(bottom - top, 0, None) * np.clip(right - left, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float = IOU_THRESHOLD) -> np.ndarray:
    """Indices of the boxes greedy non-maximum suppression keeps, highest score first."""
    order = np.argsort(-scores, kind="stable")
    keep = []
    while len(order):
        best = order[0]
        keep.append(int(best))
        if len(order) == 1:
            break
        rest = order[1:]
        order = rest[iou(boxes[best], boxes[rest]) <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def _per_class_nms(boxes, scores, classes, iou_threshold, max_detections) -> Detections:
    kept = []
    for cls in np.unique(classes):
        at = np.flatnonzero(classes == cls)
        kept.extend(at[nms(boxes[at], scores[at], iou_threshold)])
    kept = np.asarray(kept, dtype=np.int64)
    if len(kept):
        kept = kept[np.argsort(-scores[kept], kind="stable")][:max_detections]
    return Detections(boxes[kept].astype(np.float32), scores[kept].astype(np.float32), classes[kept].astype(np.int64))


def decode_centre(
    boxes: np.ndarray,
    scores: np.ndarray,
    score_threshold: float = SCORE_THRESHOLD,
    iou_threshold: float = IOU_THRESHOLD,
    max_detections: int = MAX_DETECTIONS,
) -> Detections:
    """One image of the ``centre`` layout: boxes (S, S, 4) = (dy, dx, h, w), scores (S, S, K)."""
    grid_h, grid_w, _ = scores.shape
    cell_y, cell_x, cls = np.nonzero(scores >= score_threshold)
    values = scores[cell_y, cell_x, cls]
    dy, dx, h, w = (boxes[cell_y, cell_x, k] for k in range(4))
    cy, cx = (cell_y + dy) / grid_h, (cell_x + dx) / grid_w
    decoded = np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], axis=1).clip(0.0, 1.0)
    return _per_class_nms(decoded, values, cls, iou_threshold, max_detections)


def decode_plain(
    boxes: np.ndarray,
    scores: np.ndarray,
    score_threshold: float = SCORE_THRESHOLD,
    iou_threshold: float = IOU_THRESHOLD,
    max_detections: int = MAX_DETECTIONS,
) -> Detections:
    """One image of the ``plain`` layout: boxes (A, 4) normalised corners, scores (A, K)."""
    anchor, cls = np.nonzero(scores >= score_threshold)
    return _per_class_nms(boxes[anchor].clip(0.0, 1.0), scores[anchor, cls], cls, iou_threshold, max_detections)


def decode(spec: DetectionSpec, outputs: dict[str, np.ndarray], **kwargs) -> list[Detections]:
    """Every image's detections from a batch of the detector's outputs (by name)."""
    if spec.layout not in LAYOUTS:
        raise DataError(f"unknown detection layout {spec.layout!r}; edgeq decodes: {', '.join(LAYOUTS)}")
    for name in (spec.boxes, spec.scores):
        if name not in outputs:
            raise DataError(f"the detector has no output {name!r} (it has {', '.join(outputs)})")
    boxes, scores = np.asarray(outputs[spec.boxes]), np.asarray(outputs[spec.scores])
    if spec.layout in ("ssd", "yolo"):
        return _decode_downloaded(spec, boxes, scores, **kwargs)
    one = decode_centre if spec.layout == "centre" else decode_plain
    return [one(boxes[i], scores[i], **kwargs) for i in range(len(boxes))]


def _decode_downloaded(spec: DetectionSpec, boxes: np.ndarray, scores: np.ndarray, **kwargs) -> list[Detections]:
    """An ssd or yolo detector's batch: boxes against the anchors (or the YOLO tensor), then as ``plain``."""
    from edgeq.tasks.detectors import SsdAnchors, SsdCoder, YoloFormat, ssd_anchors, ssd_boxes, ssd_scores, yolo_decoded

    found = []
    if spec.layout == "ssd":
        anchors = ssd_anchors(SsdAnchors.from_dict(spec.decoder["anchors"]))
        coder = SsdCoder.from_dict(spec.decoder.get("coder") or {})
        for i in range(len(boxes)):
            decoded = ssd_boxes(boxes[i].reshape(len(anchors), -1), anchors, coder)
            found.append(decode_plain(decoded, ssd_scores(scores[i].reshape(len(anchors), -1), coder), **kwargs))
        return found
    fmt = YoloFormat.from_dict({"classes": spec.classes, **(spec.decoder.get("yolo") or {})})
    for i in range(len(boxes)):
        tensor = boxes[i]
        if spec.scores != spec.boxes:  # split apart (convert --split-outputs): (4, N) + (K, N), or (N, 4) + (N, K)
            axis = 0 if boxes[i].shape[0] == 4 and boxes[i].shape[-1] != 4 else -1  # the box part is 4 wide
            tensor = np.concatenate([boxes[i], scores[i]], axis=axis)
        decoded, class_scores = yolo_decoded(tensor, fmt)
        found.append(decode_plain(decoded, class_scores, **kwargs))
    return found


def encode_centre(
    gt_boxes: np.ndarray, gt_classes: np.ndarray, grid: tuple[int, int], classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Training targets of the ``centre`` layout: scores (N, S, S, K) with 1 at each object's centre
    cell, and boxes (N, S, S, 5) = (dy, dx, h, w, mask), mask 1 where a box is to be learnt."""
    n = len(gt_boxes)
    gh, gw = grid
    heat = np.zeros((n, gh, gw, classes), np.float32)
    target = np.zeros((n, gh, gw, 5), np.float32)
    for i in range(n):
        for box, cls in zip(gt_boxes[i], gt_classes[i]):
            if cls < 0:
                continue
            cy, cx = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
            row, col = min(int(cy * gh), gh - 1), min(int(cx * gw), gw - 1)
            heat[i, row, col, int(cls)] = 1.0
            target[i, row, col] = (cy * gh - row, cx * gw - col, box[2] - box[0], box[3] - box[1], 1.0)
    return heat, target


# ------------------------------------------------------------------------------------- mAP


def _coco():
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError as exc:
        raise MissingExtraError('mAP needs pycocotools: pip install "edgeq[train]"') from exc
    return COCO, COCOeval


def coco_ground_truth(gt_boxes: np.ndarray, gt_classes: np.ndarray, size: tuple[int, int], classes: int) -> dict:
    """The ground truth as a COCO dataset dict (pixel [x, y, w, h] boxes on images of ``size``)."""
    height, width = size
    images, annotations = [], []
    for i in range(len(gt_boxes)):
        images.append({"id": i + 1, "height": height, "width": width})
        for box, cls in zip(gt_boxes[i], gt_classes[i]):
            if cls < 0:
                continue
            x, y = float(box[1]) * width, float(box[0]) * height
            w, h = float(box[3] - box[1]) * width, float(box[2] - box[0]) * height
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i + 1,
                    "category_id": int(cls) + 1,
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
    categories = [{"id": k + 1, "name": str(k)} for k in range(classes)]
    return {"images": images, "annotations": annotations, "categories": categories}


def coco_detections(detections: list[Detections], size: tuple[int, int]) -> list[dict]:
    """Detections as COCO results (pixel [x, y, w, h], 1-based category ids, one image id per image)."""
    height, width = size
    results = []
    for i, d in enumerate(detections):
        for box, score, cls in zip(d.boxes, d.scores, d.classes):
            results.append(
                {
                    "image_id": i + 1,
                    "category_id": int(cls) + 1,
                    "bbox": [
                        float(box[1]) * width,
                        float(box[0]) * height,
                        float(box[3] - box[1]) * width,
                        float(box[2] - box[0]) * height,
                    ],
                    "score": float(score),
                }
            )
    return results


def mean_average_precision(
    detections: list[Detections], gt_boxes: np.ndarray, gt_classes: np.ndarray, size: tuple[int, int], classes: int
) -> dict[str, float]:
    """COCO mAP@0.5:0.95 and mAP@0.5 of ``detections`` against the ground truth, by pycocotools."""
    import contextlib
    import io

    coco_class, coco_eval = _coco()
    truth = coco_class()
    truth.dataset = coco_ground_truth(gt_boxes, gt_classes, size, classes)
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        truth.createIndex()
        results = coco_detections(detections, size)
        if not results:
            return {"map": 0.0, "map50": 0.0, "detections": 0}
        found = truth.loadRes(results)
        evaluation = coco_eval(truth, found, "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    stats = evaluation.stats
    return {"map": max(float(stats[0]), 0.0), "map50": max(float(stats[1]), 0.0), "detections": len(results)}


class ResampledMap50:
    """mAP@0.5 of one model's detections on any bootstrap resample of the images, without re-matching.

    pycocotools matches each image's detections to its ground truth once (IoU 0.5, all areas, 100
    detections); a resample, given as how many times each image was drawn, then only reweights those
    matches: each class's detections stay in pycocotools' score order, repeated as their image was
    drawn, and precision is read at COCO's 101 recall points. On the images as given (each once) it is
    pycocotools' own mAP@0.5.
    """

    def __init__(
        self, detections: list[Detections], gt_boxes: np.ndarray, gt_classes: np.ndarray, size: tuple[int, int],
        classes: int,
    ) -> None:  # fmt: skip
        import contextlib
        import io

        coco_class, coco_eval = _coco()
        self.images = len(gt_boxes)
        self.recall_points = np.linspace(0.0, 1.0, 101)
        self.classes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per class: image, true positive, gts
        truth = coco_class()
        truth.dataset = coco_ground_truth(gt_boxes, gt_classes, size, classes)
        results = coco_detections(detections, size)
        with contextlib.redirect_stdout(io.StringIO()):
            truth.createIndex()
            found = truth.loadRes(results) if results else None
            if found is None:
                evaluated = None
            else:
                evaluated = coco_eval(truth, found, "bbox")
                evaluated.params.iouThrs = np.array([0.5])
                evaluated.params.areaRng, evaluated.params.areaRngLbl = [[0, 1e10]], ["all"]
                evaluated.params.maxDets = [100]
                evaluated.evaluate()
        image_ids = sorted(truth.getImgIds())
        position = {image: k for k, image in enumerate(image_ids)}
        for c, category in enumerate(sorted(truth.getCatIds())):
            gts = np.zeros(self.images, dtype=np.int64)
            for a in truth.loadAnns(truth.getAnnIds(catIds=[category])):
                gts[position[a["image_id"]]] += 1
            scores, image, hit = [], [], []
            if evaluated is not None:
                for k in range(self.images):
                    e = evaluated.evalImgs[c * self.images + k]
                    if e is None or not len(e["dtScores"]):
                        continue
                    keep = ~np.asarray(e["dtIgnore"][0], dtype=bool)
                    scores.append(np.asarray(e["dtScores"])[keep])
                    hit.append(np.asarray(e["dtMatches"][0])[keep] > 0)
                    image.append(np.full(int(keep.sum()), k))
            if scores:
                order = np.argsort(-np.concatenate(scores), kind="mergesort")  # pycocotools' order
                self.classes.append((np.concatenate(image)[order], np.concatenate(hit)[order], gts))
            else:
                self.classes.append((np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), gts))

    def __call__(self, drawn: np.ndarray | None = None) -> float:
        """mAP@0.5 on the images at indices ``drawn`` (with repeats), all images once when None."""
        counts = np.ones(self.images, dtype=np.int64) if drawn is None else np.bincount(drawn, minlength=self.images)
        precisions = []
        for image, hit, gts in self.classes:
            positives = int(np.sum(counts * gts))
            if positives == 0:
                continue  # pycocotools leaves a class with no ground truth out of the mean
            repeated = np.repeat(np.arange(len(image)), counts[image])
            tp = np.cumsum(hit[repeated])
            fp = np.cumsum(~hit[repeated])
            if len(tp) == 0:
                precisions.append(0.0)
                continue
            recall = tp / positives
            precision = np.maximum.accumulate((tp / np.maximum(tp + fp, np.finfo(np.float64).eps))[::-1])[::-1]
            at = np.searchsorted(recall, self.recall_points, side="left")
            read = np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0)
            precisions.append(float(np.mean(read)))
        return float(np.mean(precisions)) if precisions else float("nan")
