"""``faces[:SIZE[:N]]``: face detection on real images with exact boxes, and nothing downloaded.

A real face, Grace Hopper's portrait that ships with matplotlib (``mpl-data/sample_data``), is cut
out around its face (the face box was marked by hand once: FACE_BOX), feathered at its edges, and
pasted at a known position and scale, mirrored or not, brighter or darker, onto crops of the real
photos that ship with scikit-learn. The pasted face box is the ground truth, exactly, in the same
``gt_boxes``/``gt_classes`` form as every detection source. For trying pretrained face detectors
(MediaPipe's short-range detector takes 128x128 images with faces of 20% to 60% of the side).
"""

from __future__ import annotations

import numpy as np

from edgeq.data.photos import background, generated, portrait, sample_photos

FACE_CLASSES = ("face",)
# In grace_hopper.jpg (512 x 600): the face from the forehead below the cap to the chin, cheek to
# cheek, as (ymin, xmin, ymax, xmax) pixels; and the region cut out around it (hair, ears, collar).
FACE_BOX = (145, 170, 345, 365)
HEAD = (105, 135, 385, 400)
MAX_FACES = 2


def _feathered(height: int, width: int) -> np.ndarray:
    """An elliptical alpha mask (0..1) whose edge fades over the outer fifth: no rectangle is pasted."""
    y = (np.arange(height) + 0.5) / height * 2 - 1
    x = (np.arange(width) + 0.5) / width * 2 - 1
    radius = np.sqrt(y[:, None] ** 2 + x[None, :] ** 2)
    return np.clip((1.0 - radius) / 0.2, 0.0, 1.0)


def paste_faces(size: int, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` images of size x size with one or two faces each (face side 20% to 60% of the image)."""

    photos, face = sample_photos(), portrait()
    head = face[HEAD[0] : HEAD[2], HEAD[1] : HEAD[3]]
    # the face box inside the head cut-out, as fractions of the cut-out
    inner = np.array([FACE_BOX[0] - HEAD[0], FACE_BOX[1] - HEAD[1], FACE_BOX[2] - HEAD[0], FACE_BOX[3] - HEAD[1]])
    inner = inner / np.array([head.shape[0], head.shape[1], head.shape[0], head.shape[1]], dtype=np.float64)
    images = np.empty((count, size, size, 3), np.uint8)
    boxes = np.zeros((count, MAX_FACES, 4), np.float32)
    classes = np.full((count, MAX_FACES), -1, np.int64)
    for i in range(count):
        canvas = np.asarray(background(photos, size, rng)).astype(np.float32)
        placed: list[np.ndarray] = []
        for _ in range(1 if rng.uniform() < 0.7 else 2):
            box = _paste_one(canvas, head, inner, placed, size, rng)
            if box is not None:
                boxes[i, len(placed)], classes[i, len(placed)] = box, 0
                placed.append(box)
        images[i] = np.clip(canvas, 0, 255).astype(np.uint8)
    return images, boxes, classes


def _paste_one(canvas, head, inner, placed, size: int, rng) -> np.ndarray | None:
    """Paste one face where it overlaps no other; its normalised face box, or None when none fits."""
    from PIL import Image

    for _attempt in range(20):
        face_side = float(rng.uniform(0.20, 0.60)) * size  # the face box's height
        scale = face_side / ((inner[2] - inner[0]) * head.shape[0])
        h, w = max(4, round(head.shape[0] * scale)), max(4, round(head.shape[1] * scale))
        if h > size or w > size:
            continue
        y0, x0 = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        mirrored = bool(rng.integers(0, 2))
        fy0, fx0, fy1, fx1 = inner
        if mirrored:
            fx0, fx1 = 1 - fx1, 1 - fx0
        box = np.array([y0 + fy0 * h, x0 + fx0 * w, y0 + fy1 * h, x0 + fx1 * w]) / size
        if any(_overlap(box, other) > 0.0 for other in placed):
            continue
        patch = np.asarray(Image.fromarray(head).resize((w, h), Image.BILINEAR)).astype(np.float32)
        if mirrored:
            patch = patch[:, ::-1]
        patch = patch * float(rng.uniform(0.75, 1.25))
        alpha = _feathered(h, w)[..., None]
        region = canvas[y0 : y0 + h, x0 : x0 + w]
        canvas[y0 : y0 + h, x0 : x0 + w] = alpha * patch + (1 - alpha) * region
        return box.astype(np.float32)
    return None


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    top, left = max(a[0], b[0]), max(a[1], b[1])
    bottom, right = min(a[2], b[2]), min(a[3], b[3])
    return max(0.0, bottom - top) * max(0.0, right - left)


def load_faces(spec: str = "faces", normalization=None):
    """``faces[:SIZE[:N]]``: N (1500) images of SIZE (128) pixels, faces pasted on real photos, exact boxes;
    in ``normalization``'s units when a model records one (0..1 otherwise)."""
    from edgeq.data.splits import _make
    from edgeq.runtime.inputs import UINT8_IMAGES

    size, n, rng = generated(spec, "faces", 128, 1500)
    images, boxes, classes = paste_faces(size, n, rng)
    y = {"gt_boxes": boxes, "gt_classes": classes}
    return _make(spec, images, y, normalization or UINT8_IMAGES, num_classes=1, class_names=FACE_CLASSES)
