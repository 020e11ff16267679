"""Real photos that installed packages ship: backgrounds and objects for detection data, offline."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from edgeq.errors import DataError


def sample_photos() -> list[np.ndarray]:
    """scikit-learn's two sample photos (china.jpg, flower.jpg), uint8 RGB: real backgrounds offline."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError as exc:
        raise DataError('the shapes and faces sources need scikit-learn: pip install "edgeq[train]"') from exc
    return [np.asarray(img, dtype=np.uint8) for img in load_sample_images().images]


def portrait() -> np.ndarray:
    """Grace Hopper's portrait from matplotlib's sample data, uint8 RGB."""
    try:
        import matplotlib
        from PIL import Image
    except ImportError as exc:
        raise DataError('the faces source needs matplotlib and Pillow: pip install "edgeq[train,report]"') from exc
    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    if not path.is_file():
        raise DataError(f"the faces source needs matplotlib's sample image {path}, which this install lacks")
    return np.asarray(Image.open(path).convert("RGB"))


def generated(spec: str, name: str, size: int, count: int) -> tuple[int, int, np.random.Generator]:
    """``NAME[:SIZE[:N]]`` of an image set edgeq draws: its size, count and the generator seeded by the
    spec itself (the same spec gives the same images anywhere)."""
    m = re.match(rf"^{re.escape(name)}(?::(\d+))?(?::(\d+))?$", spec)
    if not m:
        raise DataError(f"bad source {spec!r}: write {name}, {name}:SIZE or {name}:SIZE:N (e.g. {name}:{size}:{count})")
    size, count = int(m.group(1) or size), int(m.group(2) or count)
    if size < 32 or count < 10:
        raise DataError(f"bad source {spec!r}: SIZE must be at least 32 and N at least 10")
    return size, count, np.random.default_rng(int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "little"))


def background(photos: list[np.ndarray], size: int, rng: np.random.Generator):
    """A square crop of one of ``photos`` (120 pixels to its short side), resized to size x size (PIL image)."""
    from PIL import Image

    photo = photos[int(rng.integers(len(photos)))]
    side = int(rng.integers(120, min(photo.shape[:2])))
    top, left = int(rng.integers(0, photo.shape[0] - side)), int(rng.integers(0, photo.shape[1] - side))
    return Image.fromarray(photo[top : top + side, left : left + side]).resize((size, size))
