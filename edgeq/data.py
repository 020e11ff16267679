"""Named datasets with fixed splits and representative-dataset generators.

A source is a string: ``digits``, ``synthetic:HxWxC:K[:N]``, ``npz:PATH`` (or a path
ending in .npz), ``images:DIR`` and ``tfrecord:GLOB``. Image sources are decoded lazily
(``EncodedImages``); tfrecord needs TensorFlow. Every source yields float32 inputs already
normalised for the model, and records that normalisation (``raw * scale + offset``) so
that eval and profile feed the quantized model exactly what training saw.
Host side only needs numpy; scikit-learn and Pillow are imported only by the sources
that use them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeq.errors import DataError
from edgeq.runtime.inputs import UINT8_IMAGES, Normalization, class_labels, read_npz, samples

SPLIT_FRACTIONS = (0.7, 0.1, 0.2)  # train, val, test
DEFAULT_CALIBRATION_SAMPLES = 200
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


def _class_ids(labels) -> np.ndarray | None:
    """``labels`` as class ids (N,), or None when they are not (float targets, several columns)."""
    y = np.asarray(labels)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        return None
    return y


def spread_order(labels, seed: int = 0) -> np.ndarray:
    """A seeded order of ``range(len(labels))`` whose every prefix holds each class in proportion.

    Each class is shuffled and its k-th sample placed at (k + u) / n_class; sorting by that
    position interleaves the classes. Splits are sorted by file or label order (an image folder
    lists class by class), so the first N samples of a split may hold one or two classes only.
    Labels that are not class ids give a plain seeded permutation.
    """
    rng = np.random.default_rng(seed)
    y = _class_ids(labels)
    n = len(labels)
    if y is None:
        return rng.permutation(n)
    position = np.empty(n, dtype=np.float64)
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        position[idx] = (np.arange(len(idx)) + rng.random(len(idx))) / len(idx)
    return np.argsort(position, kind="stable")


def alternate_halves(labels, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``order`` (from ``spread_order``) dealt into two disjoint halves, each class's samples
    alternately to one and the other, so both halves stay stratified, in that order."""
    y = _class_ids(labels)
    if y is None:
        return order[0::2], order[1::2]
    rank = np.empty(len(order), dtype=np.int64)
    ordered = y[order]
    for cls in np.unique(ordered):
        at = np.flatnonzero(ordered == cls)
        rank[at] = np.arange(len(at))
    return order[rank % 2 == 0], order[rank % 2 == 1]


def classes_covered(labels, indices) -> int | None:
    """How many classes the samples at ``indices`` hold (None for labels that are not class ids)."""
    y = _class_ids(labels)
    return None if y is None else len(np.unique(y[np.asarray(indices, dtype=np.int64)]))


@dataclass(frozen=True)
class HeldOut:
    """Held-out samples: ``x`` to verify on, and ``x_select`` (disjoint) to choose candidates on."""

    split: str
    x: np.ndarray
    x_select: np.ndarray | None
    classes: int | None  # classes among x (None: no class labels)
    classes_select: int | None
    classes_in_split: int | None


class _Splits:
    """What every dataset offers, on top of its x_/y_ train, val and test splits."""

    source: str
    num_classes: int
    normalization: Normalization

    def count(self, split: str) -> int:
        return len(getattr(self, f"y_{split}"))

    def take(self, split: str, indices: np.ndarray) -> np.ndarray:
        """The samples of ``split`` at ``indices`` (sorted), without reading the rest."""
        return getattr(self, f"x_{split}")[indices]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x_train.shape[1:])

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in ("train", "val", "test"):
            raise DataError(f"unknown split {name!r}; choose train, val or test")
        return getattr(self, f"x_{name}"), getattr(self, f"y_{name}")

    def labels(self, split: str) -> np.ndarray:
        return getattr(self, f"y_{split}")

    def spread(self, split: str, seed: int = 0) -> np.ndarray:
        """Every index of ``split`` in a seeded order whose every prefix is stratified by class."""
        return spread_order(self.labels(split), seed)

    def calibration_indices(self, n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0) -> np.ndarray:
        """Which train samples calibration takes: N, stratified by class, seeded (sorted)."""
        if n <= 0:
            raise DataError(f"--calib-samples must be positive, got {n}")
        return np.sort(self.spread("train", seed)[:n])

    def calibration_samples(self, n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0) -> np.ndarray:
        """N samples for calibration, drawn from train (never from test), stratified by class."""
        return self.take("train", self.calibration_indices(n, seed))

    def held_out(self, n: int = 200, select: int = 0) -> HeldOut:
        """Samples disjoint from calibration (which draws from train): val, else test.

        ``select`` > 0 sets aside that many others, disjoint from the first, for choosing
        between candidates (``--ptq auto``): a choice and its verification on the same
        samples would favour the candidate that got lucky there. Both are stratified by class.
        """
        split = next((name for name in ("val", "test") if self.count(name)), None)
        if split is None:  # no held-out split: the train samples calibration does not draw
            split = "train"
            order = self.spread("train", 1)
            order = order[~np.isin(order, self.calibration_indices())]
        else:
            order = self.spread(split, 1)
        if select > 0:
            order, chosen = alternate_halves(self.labels(split), order)
            chosen = np.sort(chosen[:select])
        else:
            chosen = np.zeros(0, dtype=np.int64)
        verify = np.sort(order[:n])
        labels = self.labels(split)
        return HeldOut(
            split,
            self.take(split, verify),
            self.take(split, chosen) if len(chosen) else None,
            classes_covered(labels, verify),
            classes_covered(labels, chosen) if len(chosen) else None,
            classes_covered(labels, np.arange(len(labels))),
        )

    def verification_samples(self, n: int = 200) -> tuple[np.ndarray, str]:
        """Up to N held-out samples (``held_out``) and the split they come from."""
        part = self.held_out(n)
        return part.x, part.split

    def representative_dataset(self, n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0) -> Callable[[], Iterator]:
        """A TFLiteConverter.representative_dataset: one sample per step, from train."""
        samples = self.calibration_samples(n, seed)

        def generator():
            for i in range(len(samples)):
                yield [samples[i : i + 1]]

        return generator

    def x_chunks(self, split: str, size: int = 512) -> Iterator[np.ndarray]:
        """The inputs of ``split`` in order, ``size`` samples at a time."""
        x = getattr(self, f"x_{split}")
        for start in range(0, len(x), size):
            yield x[start : start + size]

    def fingerprint(self) -> str:
        """sha256 of the source name and every split's inputs and labels, read in chunks."""
        digest = hashlib.sha256(self.source.encode())
        for split in ("train", "val", "test"):
            for chunk in self.x_chunks(split):
                digest.update(np.ascontiguousarray(chunk, dtype=np.float32).tobytes())
            digest.update(np.ascontiguousarray(getattr(self, f"y_{split}")).tobytes())
        return digest.hexdigest()

    def describe(self) -> dict:
        return {
            "source": self.source,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "train": self.count("train"),
            "val": self.count("val"),
            "test": self.count("test"),
            "normalization": self.normalization.to_dict(),
            "sha256": self.fingerprint(),
        }

    def check_fits(self, model_input_shape: tuple, where: str = "the model") -> None:
        """Raise DataError unless samples fit the model input (batch dim excluded)."""
        expected = tuple(model_input_shape)
        if len(expected) != len(self.input_shape) or any(
            e is not None and int(e) != int(g) for e, g in zip(expected, self.input_shape)
        ):
            raise DataError(
                f"data {self.source!r} has samples of shape {self.input_shape} but {where} expects "
                f"{tuple(expected)}: use data of that shape (e.g. synthetic:{_shape_str(expected)}:K)"
            )

    def check_finite(self) -> None:
        """Raise DataError naming the split and sample if any input holds NaN or infinity."""
        for split in ("train", "val", "test"):
            x = getattr(self, f"x_{split}")
            if not len(x) or not np.issubdtype(x.dtype, np.floating):
                continue
            bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            if bad.any():
                first = int(np.argmax(bad))
                raise DataError(
                    f"data {self.source!r}: {int(bad.sum())} sample(s) of the {split} split hold NaN or infinity "
                    f"(the first: sample {first} of that split): clean or drop them; quantization ranges and "
                    "training need finite inputs"
                )


@dataclass(frozen=True)
class Dataset(_Splits):
    """Samples held in memory, already normalised (digits, synthetic, npz)."""

    source: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    normalization: Normalization = field(default_factory=Normalization)
    class_names: tuple[str, ...] = ()


def _shape_str(shape: tuple) -> str:
    return "x".join(str(d if d is not None else 32) for d in shape)


def stratified_split(x: np.ndarray, y: np.ndarray, seed: int = 0):
    """Fixed stratified train/val/test split (70/10/20)."""
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[], [], []]
    for cls in np.unique(y):
        idx = np.flatnonzero(y == cls)
        rng.shuffle(idx)
        n_test = max(1, int(round(len(idx) * SPLIT_FRACTIONS[2]))) if len(idx) >= 3 else 0
        n_val = max(1, int(round(len(idx) * SPLIT_FRACTIONS[1]))) if len(idx) >= 3 else 0
        parts[2].extend(idx[:n_test])
        parts[1].extend(idx[n_test : n_test + n_val])
        parts[0].extend(idx[n_test + n_val :])
    out = []
    for p in parts:
        p = np.sort(np.asarray(p, dtype=np.int64))
        out.extend([x[p], y[p]])
    return tuple(out)


def _make(source, x, y, normalization, num_classes=None, class_names=(), seed=0, normalized=False) -> Dataset:
    """Split ``x`` (raw, or float samples already when ``normalized``) and ``y``; record ``normalization``."""
    if len(x) == 0:
        raise DataError(f"data {source!r} is empty: it has no samples")
    if len(x) != len(y):
        raise DataError(f"data {source!r}: {len(x)} inputs but {len(y)} labels")
    y = np.asarray(y).astype(np.int64).reshape(-1)
    if np.any(y < 0):
        raise DataError(f"data {source!r}: labels must be class indices >= 0")
    x_train, y_train, x_val, y_val, x_test, y_test = stratified_split(
        np.asarray(x, dtype=np.float32) if normalized else normalization.apply(x), y, seed
    )
    if len(x_train) == 0 or len(x_test) == 0:
        raise DataError(f"data {source!r} has too few samples per class to split into train and test")
    k = int(num_classes if num_classes is not None else y.max() + 1)
    return Dataset(source, x_train, y_train, x_val, y_val, x_test, y_test, k, normalization, tuple(class_names))


def load_digits_dataset() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError('the digits dataset needs scikit-learn: pip install "edgeq[train]"') from exc
    bunch = load_digits()
    x = bunch.images.astype(np.float32)[..., None]  # (1797, 8, 8, 1), values 0..16
    return _make("digits", x, bunch.target, Normalization(scale=1.0 / 16.0, raw_max=16.0), num_classes=10)


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


def _resize_nearest(img: np.ndarray, h: int, w: int) -> np.ndarray:
    rows = (np.arange(h) * img.shape[0] // h).clip(0, img.shape[0] - 1)
    cols = (np.arange(w) * img.shape[1] // w).clip(0, img.shape[1] - 1)
    return img[rows][:, cols]


def load_npz(
    path: str | Path,
    labels_required: bool = True,
    normalization: Normalization | None = None,
    input_shape: tuple | None = None,
    int8_input: tuple[float, int] | None = None,
) -> Dataset:
    """x (and y) from an .npz, read by the input contract (edgeq.runtime.inputs.samples).

    ``normalization`` is the model's recorded one when the data is for a known model:
    uint8 x is raw data it normalises, float x must lie in its float range; int8 x is the
    codes of an int8 model input (``int8_input`` = its scale and zero point). y: class ids,
    or one-hot rows. (N, H, W) arrays for a model that takes (H, W, 1) get the channel axis.
    """
    path = Path(path)
    source = f"npz:{path}"
    arrays = read_npz(path)
    if "x" not in arrays:
        raise DataError(
            f"{path}: no array named 'x' (found: {', '.join(arrays) or 'none'}); save with np.savez(x=..., y=...)"
        )
    x = arrays["x"]
    if x.ndim < 2:
        raise DataError(f"{path}: 'x' must be (N, ...) samples, got shape {x.shape}")
    if "y" not in arrays:
        if labels_required:
            raise DataError(f"{path}: no labels: save them as array 'y' (class indices)")
        y = np.zeros(len(x), dtype=np.int64)
    else:
        y = class_labels(arrays["y"], len(x), str(path))
    if x.dtype == np.uint8:
        recorded = normalization if normalization is not None and normalization.raw_max is not None else UINT8_IMAGES
    else:
        recorded = normalization if normalization is not None else Normalization()  # float samples already
    # finiteness is checked by the dataset, which names the split and the sample
    x = samples(x, normalization, str(path), int8_input=int8_input, check_finite=False)
    wants_channel = input_shape is not None and len(input_shape) == x.ndim and int(input_shape[-1] or 0) == 1
    if (input_shape is None and x.ndim == 3) or wants_channel:  # (N, H, W) grey images: add the channel axis
        x = x[..., None]
    return _make(source, x, y, recorded, normalized=True)


class EncodedImages(_Splits):
    """``images:DIR`` and ``tfrecord:GLOB``: encoded images, decoded only when read.

    The split is fixed from the file list and labels alone (the same stratified split as
    the in-memory sources), so nothing is decoded to make it. Training streams the
    images through tf.data (edgeq.train.pipeline); calibration decodes only the samples
    it draws; ``x_train`` etc. decode a whole split, once, for the commands that want it.
    Every decode goes through ``decode_image`` (Pillow), so train, eval and profile see the
    same pixels.
    """

    def __init__(self, source, kind, refs, labels, image_size, channels, normalization, class_names, num_classes):
        self.source = source
        self.kind = kind  # "files": refs are paths; "tfrecord": refs are (file, record index)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.channels = int(channels)
        self.normalization = normalization
        self.class_names = tuple(class_names)
        self.num_classes = int(num_classes)
        if len(refs) == 0:
            raise DataError(f"data {source!r} is empty: it has no samples")
        y = np.asarray(labels, dtype=np.int64)
        parts = stratified_split(np.arange(len(refs)), y)
        self._index = {"train": parts[0], "val": parts[2], "test": parts[4]}
        self._labels = {"train": parts[1], "val": parts[3], "test": parts[5]}
        self._refs = list(refs)
        self._decoded: dict[str, np.ndarray] = {}
        if len(parts[0]) == 0 or len(parts[4]) == 0:
            raise DataError(f"data {source!r} has too few samples per class to split into train and test")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (*self.image_size, self.channels)

    @property
    def total(self) -> int:
        return len(self._refs)

    @property
    def files(self) -> list[str]:
        """The files, in the order their samples are numbered."""
        return list(dict.fromkeys(r if self.kind == "files" else r[0] for r in self._refs))

    def indices(self, split: str) -> np.ndarray:
        """Which samples (numbered over all files, in order) make up ``split``."""
        return self._index[split]

    def refs(self, split: str) -> list:
        return [self._refs[i] for i in self._index[split]]

    def count(self, split: str) -> int:
        return len(self._index[split])

    def labels(self, split: str) -> np.ndarray:
        return self._labels[split]

    def decode(self, data: bytes, where: str = "") -> np.ndarray:
        """One encoded image as this source's float sample."""
        return self.normalization.apply(decode_image(data, self.image_size, self.channels, where))

    def _encoded(self, refs: list) -> Iterator[bytes]:
        if self.kind == "files":
            for path in refs:
                yield Path(path).read_bytes()
        else:
            yield from read_tfrecord_images(refs, self.source)

    def take(self, split: str, indices: np.ndarray) -> np.ndarray:
        refs = self.refs(split)
        chosen = [refs[int(i)] for i in indices]
        out = np.empty((len(chosen), *self.input_shape), np.float32)
        for k, (ref, data) in enumerate(zip(chosen, self._encoded(chosen))):
            out[k] = self.decode(data, str(ref))
        return out

    def x_chunks(self, split: str, size: int = 512) -> Iterator[np.ndarray]:
        if self.kind == "tfrecord":  # one pass over the records, not one per chunk
            wanted = set(self.indices(split).tolist())
            chunk = []
            for index, data in enumerate(iter_tfrecord_images(self.files)):
                if index in wanted:
                    chunk.append(self.decode(data, f"{self.source} record {index}"))
                    if len(chunk) == size:
                        yield np.stack(chunk)
                        chunk = []
            if chunk:
                yield np.stack(chunk)
            return
        n = self.count(split)
        for start in range(0, n, size):
            yield self.take(split, np.arange(start, min(n, start + size)))

    def _split_x(self, split: str) -> np.ndarray:
        if split not in self._decoded:
            self._decoded[split] = self.take(split, np.arange(self.count(split)))
        return self._decoded[split]

    x_train = property(lambda self: self._split_x("train"))
    x_val = property(lambda self: self._split_x("val"))
    x_test = property(lambda self: self._split_x("test"))
    y_train = property(lambda self: self._labels["train"])
    y_val = property(lambda self: self._labels["val"])
    y_test = property(lambda self: self._labels["test"])

    def check_finite(self) -> None:
        """Decoded 8-bit pixels are always finite."""


def decode_image(data: bytes, size: tuple[int, int], channels: int, where: str = "") -> np.ndarray:
    """Encoded bytes (PNG, JPEG, ...) to a uint8 (H, W, C) array of ``size``, with Pillow."""
    import io

    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError('image data needs Pillow: pip install "edgeq[train]"') from exc
    mode = "L" if channels == 1 else "RGB"
    try:
        with Image.open(io.BytesIO(data)) as img:
            arr = np.asarray(img.convert(mode).resize((size[1], size[0])), dtype=np.uint8)
    except OSError as exc:
        raise DataError(f"{where or 'an image'}: not a readable image ({exc}); remove it or replace it") from exc
    return arr.reshape(size[0], size[1], channels)


def _image_normalization(normalization: Normalization | None) -> Normalization:
    return normalization if normalization is not None and normalization.raw_max == 255 else UINT8_IMAGES


def load_images(
    directory: str | Path,
    image_size: tuple[int, int] | None,
    channels: int = 3,
    normalization: Normalization | None = None,
) -> EncodedImages:
    """``images:DIR``: one sub-folder per class; listed now, decoded when read."""
    directory = Path(directory)
    source = f"images:{directory}"
    if not directory.is_dir():
        raise DataError(f"{directory}: no such folder (images:DIR wants one sub-folder per class)")
    classes = sorted(p.name for p in directory.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{directory}: no class sub-folders; put each class's images in DIR/<class>/")
    if image_size is None:
        raise DataError(f"{source}: the image size is unknown: give a model whose input fixes it")
    files, labels = [], []
    for label, cls in enumerate(classes):
        for file in sorted((directory / cls).iterdir()):
            if file.suffix.lower() in IMAGE_SUFFIXES:
                files.append(str(file))
                labels.append(label)
    if not files:
        raise DataError(f"{directory}: the class folders hold no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    _check_headers(files)
    return EncodedImages(
        source, "files", files, labels, image_size, channels, _image_normalization(normalization), classes, len(classes)
    )


def _check_headers(files: list[str]) -> None:
    """A file that is no image fails now, by name, not in the middle of training (headers only)."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError('images:DIR needs Pillow: pip install "edgeq[train]"') from exc
    for file in files:
        try:
            with Image.open(file):
                pass
        except OSError as exc:
            raise DataError(f"{file}: not a readable image ({exc}); remove it or replace it") from exc


TFRECORD_IMAGE = "image/encoded"
TFRECORD_LABEL = "image/class/label"


def _tfrecord_files(pattern: str) -> list[str]:
    import glob

    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"tfrecord:{pattern}: no file matches; give a glob such as tfrecord:data/train-*.tfrecord")
    return files


def _tf():
    try:
        from edgeq.compat import tf
    except Exception as exc:
        raise DataError(f'tfrecord data needs TensorFlow: pip install "edgeq[train]" ({exc})') from exc
    return tf


def _parse_tfrecord(tf, serialized):
    features = {
        TFRECORD_IMAGE: tf.io.FixedLenFeature([], tf.string),
        TFRECORD_LABEL: tf.io.FixedLenFeature([], tf.int64),
    }
    return tf.io.parse_single_example(serialized, features)


def load_tfrecord(
    pattern: str,
    image_size: tuple[int, int] | None,
    channels: int = 3,
    normalization: Normalization | None = None,
) -> EncodedImages:
    """``tfrecord:GLOB``: tf.train.Example records with ``image/encoded`` and ``image/class/label``.

    Listing reads every record's label once (streamed); the images are decoded when read.
    """
    source = f"tfrecord:{pattern}"
    if image_size is None:
        raise DataError(f"{source}: the image size is unknown: give a model whose input fixes it")
    tf = _tf()
    files = _tfrecord_files(pattern)
    refs, labels = [], []
    for file in files:
        try:
            for index, record in enumerate(tf.data.TFRecordDataset(file)):
                parsed = _parse_tfrecord(tf, record)
                refs.append((file, index))
                labels.append(int(parsed[TFRECORD_LABEL]))
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as exc:
            raise DataError(
                f"{file}: not a TFRecord of tf.train.Example with {TFRECORD_IMAGE!r} (bytes) and "
                f"{TFRECORD_LABEL!r} (int64): {str(exc).splitlines()[0]}"
            ) from exc
    if labels and min(labels) < 0:
        raise DataError(f"{source}: labels must be class indices >= 0")
    k = max(labels) + 1 if labels else 0
    data = EncodedImages(
        source, "tfrecord", refs, labels, image_size, channels, _image_normalization(normalization), (), k
    )
    data.take("train", np.arange(1))
    return data


def iter_tfrecord_images(files: list[str]) -> Iterator[bytes]:
    """Every record's encoded image, file after file, in order."""
    tf = _tf()
    for record in tf.data.TFRecordDataset(files):
        yield _parse_tfrecord(tf, record)[TFRECORD_IMAGE].numpy()


def read_tfrecord_images(refs: list, source: str = "") -> Iterator[bytes]:
    """The encoded images of (file, record index) refs, in the order given, reading each file once."""
    tf = _tf()
    wanted: dict[str, dict[int, list[int]]] = {}
    for k, (file, index) in enumerate(refs):
        wanted.setdefault(file, {}).setdefault(int(index), []).append(k)
    out: list[bytes | None] = [None] * len(refs)
    for file, indices in wanted.items():
        last = max(indices)
        for index, record in enumerate(tf.data.TFRecordDataset(file).take(last + 1)):
            if index in indices:
                data = _parse_tfrecord(tf, record)[TFRECORD_IMAGE].numpy()
                for k in indices[index]:
                    out[k] = data
    yield from out


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
    if not source:
        raise DataError("no data source given: use digits, synthetic:HxWxC:K, npz:PATH, images:DIR or tfrecord:GLOB")
    if source == "digits":
        return load_digits_dataset()
    if source.startswith("synthetic:"):
        return load_synthetic(source)
    if source.startswith("npz:") or source.endswith(".npz"):
        path = source[4:] if source.startswith("npz:") else source
        return load_npz(path, labels_required, normalization, input_shape, int8_input)
    if source.startswith(("images:", "tfrecord:")):
        size = tuple(input_shape[:2]) if input_shape else None
        channels = int(input_shape[2]) if input_shape and len(input_shape) > 2 else 3
        if source.startswith("images:"):
            return load_images(source[7:], size, channels, normalization)
        return load_tfrecord(source[9:], size, channels, normalization)
    raise DataError(
        f"unknown data source {source!r}: use digits, synthetic:HxWxC:K, npz:PATH, images:DIR or tfrecord:GLOB"
    )


def export_split(dataset: Dataset, split: str, path: str | Path) -> Path:
    """Write one split as .npz (x: normalised float32, y) for `edgeq profile --data`."""
    from edgeq.artifacts import atomic_path

    x, y = dataset.split(split)
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, x=x, y=y)
    return path
