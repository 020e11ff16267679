"""Built-in data (digits, diabetes, machine sounds, shapes, synthetic) and ``load_dataset`` for any --data."""

from __future__ import annotations

import hashlib
import re

import numpy as np

from edgeq.data.files import (
    _resize_nearest,
    is_detection_tfrecord,
    load_coco,
    load_detection_tfrecord,
    load_images,
    load_npz,
    load_tfrecord,
)
from edgeq.data.photos import background, generated, sample_photos
from edgeq.data.splits import Dataset, _make
from edgeq.errors import DataError
from edgeq.runtime.inputs import UINT8_IMAGES, Normalization


def load_digits_dataset() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError('the digits dataset needs scikit-learn: pip install "edgeq[train]"') from exc
    bunch = load_digits()
    x = bunch.images.astype(np.float32)[..., None]  # (1797, 8, 8, 1), values 0..16
    return _make("digits", x, bunch.target, Normalization(scale=1.0 / 16.0, raw_max=16.0), num_classes=10)


def load_diabetes_dataset() -> Dataset:
    """scikit-learn's diabetes data: 442 real patients, 10 standardised features, a float target
    (disease progression after one year, 25..346): a regression task that ships offline."""
    try:
        from sklearn.datasets import load_diabetes
    except ImportError as exc:
        raise DataError('the diabetes dataset needs scikit-learn: pip install "edgeq[train]"') from exc
    bunch = load_diabetes()
    x = bunch.data.astype(np.float32)
    y = bunch.target.astype(np.float32)[:, None]  # float targets (N, 1): regression
    return _make("diabetes", x, y, Normalization(), normalized=True)


# Generated machine sounds: 16 kHz, 1024-point frames, hop 512, 128 mel bands; a sample is 5 frames.
SOUND_RATE, SOUND_FFT, SOUND_HOP, SOUND_MELS, SOUND_FRAMES = 16_000, 1024, 512, 128, 5


_MACHINE = re.compile(r"^machine-sound(?::(\d+))?$")


def _mel_filterbank(rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular mel filters (HTK mel scale) over the rfft bins: (n_mels, n_fft // 2 + 1)."""

    def mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def hz(m):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    edges = hz(np.linspace(mel(0.0), mel(rate / 2), n_mels + 2))
    freqs = np.linspace(0.0, rate / 2, n_fft // 2 + 1)
    bank = np.zeros((n_mels, len(freqs)), dtype=np.float64)
    for m in range(n_mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        rising = (freqs - lo) / max(mid - lo, 1e-9)
        falling = (hi - freqs) / max(hi - mid, 1e-9)
        bank[m] = np.clip(np.minimum(rising, falling), 0.0, None)
    return bank


def machine_sounds(count: int, anomalous: bool, rng: np.random.Generator) -> np.ndarray:
    """Log-mel spectrograms (count, 5 * 128) of generated machine sounds: a motor's hum (a
    fundamental near 120 Hz and its decaying harmonics, slowly wandering in pitch and load) in
    broadband noise. An anomalous machine has one fault: a bearing's non-harmonic whine, a
    loose part's rattle (clicks), or an imbalance that shifts power to one harmonic."""
    length = SOUND_FFT + SOUND_HOP * (SOUND_FRAMES - 1)
    t = np.arange(length) / SOUND_RATE
    bank = _mel_filterbank(SOUND_RATE, SOUND_FFT, SOUND_MELS)
    window = np.hanning(SOUND_FFT)
    out = np.empty((count, SOUND_FRAMES * SOUND_MELS), dtype=np.float32)
    for i in range(count):
        f0 = rng.uniform(110.0, 130.0) * (1.0 + 0.004 * np.sin(2 * np.pi * rng.uniform(0.5, 2.0) * t))
        phase = 2 * np.pi * np.cumsum(f0) / SOUND_RATE
        decay = rng.uniform(0.55, 0.75)
        gains = decay ** np.arange(12) * rng.uniform(0.8, 1.2, 12)
        kind = int(rng.integers(3)) if anomalous else -1
        if kind == 2:  # imbalance: one harmonic carries several times its share
            gains[int(rng.integers(1, 6))] *= rng.uniform(2.0, 3.5)
        signal = sum(g * np.sin((k + 1) * phase + rng.uniform(0, 2 * np.pi)) for k, g in enumerate(gains))
        signal = signal + rng.normal(0.0, rng.uniform(0.05, 0.12), length)
        if kind == 0:  # bearing fault: a non-harmonic whine
            signal = signal + rng.uniform(0.08, 0.2) * np.sin(2 * np.pi * rng.uniform(2500, 5500) * t)
        elif kind == 1:  # rattle: short clicks at random moments
            for start in rng.integers(0, length - 64, int(rng.integers(2, 5))):
                signal[start : start + 64] += rng.normal(0.0, rng.uniform(0.4, 0.9), 64) * np.hanning(64)
        frames = np.stack([signal[f * SOUND_HOP : f * SOUND_HOP + SOUND_FFT] * window for f in range(SOUND_FRAMES)])
        power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
        out[i] = np.log10(power @ bank.T + 1e-6).reshape(-1).astype(np.float32)
    return out


def load_machine_sound(spec: str = "machine-sound") -> Dataset:
    """``machine-sound[:N]``: generated machine sounds for anomaly detection (MLPerf Tiny's AD task,
    without a download): N log-mel samples, 5 of every 6 normal; labels 0 normal, 1 anomalous.

    Training an autoencoder uses the normal samples of train and val only; test keeps both,
    for the AUC. Values are standardised with the normal samples' mean and spread.
    """
    m = _MACHINE.match(spec)
    if not m:
        raise DataError(f"bad source {spec!r}: write machine-sound or machine-sound:N (N samples, N >= 60)")
    n = int(m.group(1) or 2400)
    if n < 60:
        raise DataError(f"bad source {spec!r}: N must be at least 60")
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "little"))
    anomalies = n // 6
    normal, odd = machine_sounds(n - anomalies, False, rng), machine_sounds(anomalies, True, rng)
    mean, std = float(normal.mean()), float(normal.std())
    x = (np.concatenate([normal, odd]) - mean) / std
    y = np.concatenate([np.zeros(len(normal), np.int64), np.ones(len(odd), np.int64)])
    order = rng.permutation(n)
    return _make(spec, x[order].astype(np.float32), y[order], Normalization(), num_classes=2, normalized=True)


SHAPE_CLASSES = ("circle", "square", "triangle")


MAX_OBJECTS = 8  # ground-truth rows per image (gt_classes -1 where unused)


def draw_shapes(size: int, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` images of size x size: crops of real photos with 1 to 4 circles, squares and
    triangles each (10% to 40% of the side, overlapping little), and their exact boxes."""
    from PIL import ImageDraw

    photos = sample_photos()
    images = np.empty((count, size, size, 3), np.uint8)
    boxes = np.zeros((count, MAX_OBJECTS, 4), np.float32)
    classes = np.full((count, MAX_OBJECTS), -1, np.int64)
    for i in range(count):
        canvas = background(photos, size, rng)
        draw = ImageDraw.Draw(canvas)
        placed: list[np.ndarray] = []
        for _ in range(int(rng.integers(1, 5))):
            for _attempt in range(20):
                extent = float(rng.uniform(0.10, 0.40)) * size
                y0, x0 = float(rng.uniform(0, size - extent)), float(rng.uniform(0, size - extent))
                box = np.array([y0, x0, y0 + extent, x0 + extent]) / size
                if all(_overlap(box, other) < 0.2 for other in placed):
                    break
            else:
                continue
            kind = int(rng.integers(len(SHAPE_CLASSES)))
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            corners = [x0, y0, x0 + extent, y0 + extent]
            if kind == 0:
                draw.ellipse(corners, fill=colour, outline=(0, 0, 0))
            elif kind == 1:
                draw.rectangle(corners, fill=colour, outline=(0, 0, 0))
            else:
                draw.polygon([(x0 + extent / 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=colour)
            row = len(placed)
            boxes[i, row], classes[i, row] = box, kind
            placed.append(box)
        images[i] = np.asarray(canvas)
    return images, boxes, classes


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    from edgeq.tasks.detection import iou

    return float(iou(a, b[None])[0])


def load_shapes(spec: str = "shapes", normalization: Normalization | None = None) -> Dataset:
    """``shapes[:SIZE[:N]]``: object detection without a download: N (2400) images of SIZE (96) pixels,
    crops of scikit-learn's real photos with circles, squares and triangles drawn on, exact boxes.

    Ground truth: ``gt_boxes`` (N, 8, 4) normalised (ymin, xmin, ymax, xmax), ``gt_classes`` (N, 8), -1 unused.
    """
    size, n, rng = generated(spec, "shapes", 96, 2400)
    images, boxes, classes = draw_shapes(size, n, rng)
    y = {"gt_boxes": boxes, "gt_classes": classes}
    norm = normalization or UINT8_IMAGES  # a model's own units where it records them
    return _make(spec, images, y, norm, num_classes=len(SHAPE_CLASSES), class_names=SHAPE_CLASSES)


_SYNTH = re.compile(r"^synthetic:(\d+)x(\d+)x(\d+):(\d+)(?::(\d+))?$")


def load_synthetic(spec: str) -> Dataset:
    """Deterministic images with learnable structure: one smooth template per class.

    Each sample is its class template, shifted by up to a pixel, mixed with noise.
    """
    m = _SYNTH.match(spec)
    if not m:
        raise DataError(f"bad synthetic source {spec!r}: write synthetic:HxWxC:K[:N], e.g. synthetic:32x32x3:10")
    h, w, c, k = (int(v) for v in m.groups()[:4])
    n = int(m.group(5)) if m.group(5) else max(60 * k, 600)
    if min(h, w, c) < 1 or k < 2 or n < 3 * k:
        raise DataError(f"bad synthetic source {spec!r}: need H,W,C >= 1, K >= 2 and N >= 3*K")
    seed = int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "little")
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0.0, 1.0, size=(k, max(2, h // 4), max(2, w // 4), c)).astype(np.float32)
    templates = np.stack([_resize_nearest(t, h, w) for t in coarse])
    y = np.arange(n) % k
    rng.shuffle(y)
    mix = rng.uniform(0.55, 0.85, size=(n, 1, 1, 1)).astype(np.float32)
    noise = rng.uniform(0.0, 1.0, size=(n, h, w, c)).astype(np.float32)
    x = mix * templates[y] + (1.0 - mix) * noise
    shifts = rng.integers(-1, 2, size=(n, 2))
    for i in range(n):
        x[i] = np.roll(x[i], tuple(shifts[i]), axis=(0, 1))
    return _make(spec, x, y, Normalization(), num_classes=k)


def load_dataset(
    source: str,
    input_shape: tuple | None = None,
    labels_required: bool = True,
    normalization: Normalization | None = None,
    int8_input: tuple[float, int] | None = None,
) -> Dataset:
    """Resolve a source string to a Dataset. ``input_shape`` (H, W, C) sizes image folders.

    ``normalization``: the model's recorded one, when the data feeds a known model (eval,
    analyze of a converted run): raw files are read in its units and checked against it.
    ``int8_input``: (scale, zero point) of an int8 model input, whose codes int8 arrays are.
    """
    source = str(source).strip()
    if isinstance(input_shape, dict) and len(input_shape) == 1:
        input_shape = next(iter(input_shape.values()))
    if not source:
        raise DataError("no data source given: use digits, synthetic:HxWxC:K, npz:PATH, images:DIR or tfrecord:GLOB")
    if source == "digits":
        return load_digits_dataset()
    if source == "diabetes":
        return load_diabetes_dataset()
    if source == "machine-sound" or source.startswith("machine-sound:"):
        return load_machine_sound(source)
    if source == "faces" or source.startswith("faces:"):
        from edgeq.data.faces import load_faces

        return load_faces(source, normalization)
    if source == "shapes" or source.startswith("shapes:"):
        return load_shapes(source, normalization)
    if source.startswith("synthetic:"):
        return load_synthetic(source)
    if source.startswith("npz:") or source.endswith(".npz"):
        path = source[4:] if source.startswith("npz:") else source
        return load_npz(path, labels_required, normalization, input_shape, int8_input)
    if source.startswith(("images:", "tfrecord:", "coco:")):
        size = tuple(input_shape[:2]) if input_shape else None
        channels = int(input_shape[2]) if input_shape and len(input_shape) > 2 else 3
        if source.startswith("images:"):
            return load_images(source[7:], size, channels, normalization)
        if source.startswith("coco:"):
            return load_coco(source[5:], size, channels, normalization)
        if is_detection_tfrecord(source[9:]):
            return load_detection_tfrecord(source[9:], size, channels, normalization)
        return load_tfrecord(source[9:], size, channels, normalization)
    raise DataError(
        f"unknown data source {source!r}: use digits, diabetes, machine-sound[:N], synthetic:HxWxC:K, npz:PATH, "
        "images:DIR or tfrecord:GLOB"
    )
