"""Real photos that installed packages ship: backgrounds and objects for detection data, offline."""

from __future__ import annotations

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
