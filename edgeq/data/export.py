"""A detection split written in the formats detection tools read: COCO JSON with its images, and
TFRecords of the TF Object Detection API's ``tf.train.Example``. Both read back with edgeq's own
``coco:`` and ``tfrecord:`` sources to the same boxes (tests/test_detectors.py checks the round trip).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from edgeq.data.files import OD_BOX, OD_LABEL, TFRECORD_IMAGE
from edgeq.data.splits import Dataset
from edgeq.errors import DataError, UsageError
from edgeq.tasks.detection import GROUND_TRUTH


def _detection_split(dataset: Dataset, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The split's images as raw uint8 (the normalisation undone) and its ground truth."""
    x, y = dataset.split(split)
    if not isinstance(y, dict) or any(k not in y for k in GROUND_TRUTH) or isinstance(x, dict):
        raise UsageError(f"{dataset.source}: COCO and TFRecord export write a detection split (gt_boxes, gt_classes)")
    norm = dataset.normalization
    raw = np.clip(np.rint((np.asarray(x, np.float64) - norm.offset) / norm.scale), 0, 255).astype(np.uint8)
    return raw, np.asarray(y["gt_boxes"]), np.asarray(y["gt_classes"])


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format="PNG")
    return buffer.getvalue()


def export_coco(dataset: Dataset, split: str, out: str | Path) -> Path:
    """``out``.json (images, annotations with pixel [x, y, w, h], categories) and its images in
    ``<out stem>_images/``; written in a hidden folder first, the JSON last."""
    out = Path(out)
    if out.suffix != ".json":
        raise UsageError(f"{out}: a COCO export is a .json file (its images go in a folder beside it)")
    images, boxes, classes = _detection_split(dataset, split)
    height, width = images.shape[1:3]
    folder_name = f"{out.stem}_images"
    names = tuple(dataset.class_names or (str(k) for k in range(dataset.num_classes)))
    doc: dict = {"images": [], "annotations": [], "categories": [{"id": k + 1, "name": n} for k, n in enumerate(names)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as stage:
        staged = Path(stage) / folder_name
        staged.mkdir()
        for i, image in enumerate(images):
            name = f"{i:06d}.png"
            (staged / name).write_bytes(_png(image))
            doc["images"].append({"id": i + 1, "file_name": f"{folder_name}/{name}", "height": height, "width": width})
            for box, cls in zip(boxes[i], classes[i]):
                if cls < 0:
                    continue
                x, y = float(box[1]) * width, float(box[0]) * height
                w, h = float(box[3] - box[1]) * width, float(box[2] - box[0]) * height
                doc["annotations"].append(
                    {"id": len(doc["annotations"]) + 1, "image_id": i + 1, "category_id": int(cls) + 1,
                     "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0}
                )  # fmt: skip
        (Path(stage) / out.name).write_text(json.dumps(doc), encoding="utf-8")
        if (out.parent / folder_name).exists():
            shutil.rmtree(out.parent / folder_name)
        os.replace(staged, out.parent / folder_name)
        os.replace(Path(stage) / out.name, out)
    return out


def export_tfrecord(dataset: Dataset, split: str, out: str | Path) -> Path:
    """One .tfrecord of the TF Object Detection API's examples: PNG images, normalised corners, 1-based labels."""
    from edgeq.artifacts import atomic_path
    from edgeq.models.compat import tf

    out = Path(out)
    images, boxes, classes = _detection_split(dataset, split)
    height, width = images.shape[1:3]

    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=[float(v) for v in values]))

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))

    with atomic_path(out) as part, tf.io.TFRecordWriter(str(part)) as writer:
        for i, image in enumerate(images):
            kept = classes[i] >= 0
            feature = {
                TFRECORD_IMAGE: tf.train.Feature(bytes_list=tf.train.BytesList(value=[_png(image)])),
                "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"png"])),
                "image/height": ints([height]),
                "image/width": ints([width]),
                OD_LABEL: ints(classes[i][kept] + 1),
            }
            feature |= {key: floats(boxes[i][kept][:, k]) for k, key in enumerate(OD_BOX)}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return out


def export_detection(dataset: Dataset, split: str, out: str | Path, fmt: str) -> Path:
    if fmt == "coco":
        return export_coco(dataset, split, out)
    if fmt == "tfrecord":
        return export_tfrecord(dataset, split, out)
    raise DataError(f"unknown export format {fmt!r}: npz, coco or tfrecord")
