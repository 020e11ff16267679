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
from edgeq.runtime.inputs import UINT8_IMAGES, Normalization, class_labels, holds_class_ids, read_npz, samples
from edgeq.tasks.detection import GROUND_TRUTH

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
    alternately to one and the other, so both halves stay stratified, in that order.

    Each class starts on the half the classes before it left short, so a split of one sample per
    class (a small calibration set's val) still gives both halves samples."""
    y = _class_ids(labels) if labels is not None else None
    if y is None:
        return order[0::2], order[1::2]
    rank = np.empty(len(order), dtype=np.int64)
    ordered = y[order]
    dealt = 0
    for cls in np.unique(ordered):
        at = np.flatnonzero(ordered == cls)
        rank[at] = np.arange(len(at)) + dealt
        dealt += len(at)
    return order[rank % 2 == 0], order[rank % 2 == 1]


def classes_covered(labels, indices) -> int | None:
    """How many classes the samples at ``indices`` hold (None for labels that are not class ids)."""
    y = _class_ids(labels) if labels is not None else None
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
    indices: np.ndarray | None = None  # of x in its split
    indices_select: np.ndarray | None = None


def rows(x, indices):
    """The samples at ``indices`` of one input array or of a dict of them (one per input name)."""
    return {k: v[indices] for k, v in x.items()} if isinstance(x, dict) else x[indices]


def size(x) -> int:
    """How many samples one input array (or a dict of them) holds."""
    if isinstance(x, dict):
        return len(next(iter(x.values()))) if x else 0
    return len(x)


class _Splits:
    """What every dataset offers, on top of its x_/y_ train, val and test splits.

    ``x_*`` is an array (N, ...) or, for a model with several inputs, a dict of them by input
    name; ``y_*`` is class ids (N,), float targets (N, ...), a dict of targets by output name,
    or zeros where the data has no labels (``labelled`` False).
    """

    source: str
    num_classes: int
    normalization: Normalization
    labelled: bool = True

    def count(self, split: str) -> int:
        return size(getattr(self, f"x_{split}"))

    def take(self, split: str, indices: np.ndarray):
        """The samples of ``split`` at ``indices`` (sorted), without reading the rest."""
        return rows(getattr(self, f"x_{split}"), indices)

    @property
    def input_shape(self):
        """(H, W, C)-like shape of a sample; a dict {input name: shape} for several inputs."""
        if isinstance(self.x_train, dict):
            return {k: tuple(int(d) for d in v.shape[1:]) for k, v in self.x_train.items()}
        return tuple(int(d) for d in self.x_train.shape[1:])

    def split(self, name: str):
        if name not in ("train", "val", "test"):
            raise DataError(f"unknown split {name!r}; choose train, val or test")
        return getattr(self, f"x_{name}"), getattr(self, f"y_{name}")

    def labels(self, split: str):
        """The class ids of ``split`` (what sampling stratifies by); None without any."""
        y = getattr(self, f"y_{split}")
        if not self.labelled:
            return None
        if isinstance(y, dict):  # several outputs: the first that holds class ids
            return next((v for v in y.values() if _class_ids(v) is not None), None)
        return y

    def targets(self, split: str, output: str | None = None):
        """The targets of ``output`` (or the only ones) in ``split``; None where the data has none."""
        if not self.labelled:
            return None
        y = getattr(self, f"y_{split}")
        if isinstance(y, dict):
            return y.get(output) if output is not None else (next(iter(y.values())) if len(y) == 1 else None)
        return y if output is None else None  # one 'y' is the one output's: name each, y_<output>, for several

    def spread(self, split: str, seed: int = 0) -> np.ndarray:
        """Every index of ``split`` in a seeded order whose every prefix is stratified by class."""
        labels = self.labels(split)
        return spread_order(labels if labels is not None else np.zeros(self.count(split), np.float32), seed)

    def calibration_indices(self, n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0) -> np.ndarray:
        """Which train samples calibration takes: N, stratified by class, seeded (sorted)."""
        if n <= 0:
            raise DataError(f"--calib-samples must be positive, got {n}")
        return np.sort(self.spread("train", seed)[:n])

    def calibration_samples(self, n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0):
        """N samples for calibration, drawn from train (never from test), stratified by class."""
        return self.take("train", self.calibration_indices(n, seed))

    def held_out(self, n: int | None = 200, select: int = 0) -> HeldOut:
        """Samples disjoint from calibration (which draws from train): val, else test.

        ``select`` > 0 sets aside that many others, disjoint from the first, for choosing
        between candidates (``--ptq auto``): a choice and its verification on the same
        samples would favour the candidate that got lucky there. Both are stratified by class.
        ``n`` None: every sample the choice does not take.
        """
        split = next((name for name in ("val", "test") if self.count(name)), None)
        if split is None:  # no held-out split: the train samples calibration does not draw
            split = "train"
            order = self.spread("train", 1)
            order = order[~np.isin(order, self.calibration_indices())]
        else:
            order = self.spread(split, 1)
        labels = self.labels(split)
        if select > 0:
            order, chosen = alternate_halves(labels, order)
            chosen = np.sort(chosen[:select])
        else:
            chosen = np.zeros(0, dtype=np.int64)
        verify = np.sort(order[:n])  # n None: all of them
        return HeldOut(
            split,
            self.take(split, verify),
            self.take(split, chosen) if len(chosen) else None,
            classes_covered(labels, verify),
            classes_covered(labels, chosen) if len(chosen) else None,
            classes_covered(labels, np.arange(self.count(split))),
            verify,
            chosen if len(chosen) else None,
        )

    def verification_samples(self, n: int = 200):
        """Up to N held-out samples (``held_out``) and the split they come from."""
        part = self.held_out(n)
        return part.x, part.split

    def representative_dataset(
        self, n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0, order: list[str] | None = None
    ) -> Callable[[], Iterator]:
        """A TFLiteConverter.representative_dataset: one sample per step, from train.

        Several inputs are given as a dict by input name (``order``: which, the model's names).
        """
        samples = self.calibration_samples(n, seed)

        def generator():
            for i in range(size(samples)):
                if isinstance(samples, dict):  # by signature input name: the converter's input order is its own
                    yield {name: samples[name][i : i + 1] for name in (order or list(samples))}
                else:
                    yield [samples[i : i + 1]]

        return generator

    def x_chunks(self, split: str, size: int = 512) -> Iterator:
        """The inputs of ``split`` in order, ``size`` samples at a time."""
        x = getattr(self, f"x_{split}")
        for start in range(0, self.count(split), size):
            yield rows(x, slice(start, start + size))

    def fingerprint(self) -> str:
        """sha256 of the source name and every split's inputs and labels, read in chunks."""
        digest = hashlib.sha256(self.source.encode())
        for split in ("train", "val", "test"):
            for chunk in self.x_chunks(split):
                for part in _parts(chunk):
                    digest.update(np.ascontiguousarray(part, dtype=np.float32).tobytes())
            for part in _parts(getattr(self, f"y_{split}")):
                digest.update(np.ascontiguousarray(part).tobytes())
        return digest.hexdigest()

    def describe(self) -> dict:
        shape = self.input_shape
        y = self.y_train
        return {
            "source": self.source,
            "input_shape": {k: list(v) for k, v in shape.items()} if isinstance(shape, dict) else list(shape),
            "num_classes": self.num_classes,
            "labelled": self.labelled,
            "targets": {k: _target_kind(v) for k, v in y.items()} if isinstance(y, dict) else _target_kind(y),
            "split": split_method(
                {k: np.concatenate([self.targets(s, k) for s in ("train", "val", "test")]) for k in y}
                if isinstance(y, dict)
                else np.concatenate([self.y_train, self.y_val, self.y_test])
            )
            if self.labelled
            else "seeded permutation (no labels)",
            "train": self.count("train"),
            "val": self.count("val"),
            "test": self.count("test"),
            "normalization": self.normalization.to_dict(),
            "sha256": self.fingerprint(),
        }

    def check_fits(self, model_input_shape, where: str = "the model") -> None:
        """Raise DataError unless samples fit the model input(s) (batch dim excluded).

        ``model_input_shape``: one shape, or {input name: shape} for several inputs.
        """
        got = self.input_shape
        if isinstance(model_input_shape, dict) and len(model_input_shape) == 1 and not isinstance(got, dict):
            model_input_shape = next(iter(model_input_shape.values()))
        if isinstance(model_input_shape, dict):
            if not isinstance(got, dict) or set(got) != set(model_input_shape):
                have = ", ".join(got) if isinstance(got, dict) else "one array 'x'"
                raise DataError(
                    f"{where} takes inputs {', '.join(model_input_shape)}, but data {self.source!r} has {have}: "
                    "save one array per input, x_<input name>"
                )
            for name, expected in model_input_shape.items():
                _check_shape(tuple(expected), got[name], f"{self.source!r} input {name!r}", where)
            return
        if isinstance(got, dict):
            if len(got) != 1:
                raise DataError(f"{where} takes one input, but data {self.source!r} has {', '.join(got)}")
            got = next(iter(got.values()))
        _check_shape(tuple(model_input_shape), got, repr(self.source), where)

    def check_finite(self) -> None:
        """Raise DataError naming the split and sample if any input holds NaN or infinity."""
        for split in ("train", "val", "test"):
            for x in _parts(getattr(self, f"x_{split}")):
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


def _parts(x) -> list[np.ndarray]:
    return [x[k] for k in sorted(x)] if isinstance(x, dict) else [x]


def _target_kind(y) -> str:
    ids = _class_ids(y)
    if ids is not None:
        return (
            f"whole numbers ({len(np.unique(ids))} values, {int(ids.min())}..{int(ids.max())}): class ids for a "
            "classifier output (softmax, logits or sigmoid), values for a 1-unit linear output or --task regression"
        )
    return f"float targets {list(np.shape(y)[1:])}"


def _check_shape(expected: tuple, got: tuple, what: str, where: str) -> None:
    if len(expected) != len(got) or any(e is not None and int(e) != int(g) for e, g in zip(expected, got)):
        raise DataError(
            f"data {what} has samples of shape {got} but {where} expects {expected}: use data of that shape "
            f"(e.g. synthetic:{_shape_str(expected)}:K), or fix a fully convolutional model's input with "
            "--input-shape"
        )


@dataclass(frozen=True)
class Dataset(_Splits):
    """Samples held in memory, already normalised (digits, synthetic, npz)."""

    source: str
    x_train: np.ndarray | dict
    y_train: np.ndarray | dict
    x_val: np.ndarray | dict
    y_val: np.ndarray | dict
    x_test: np.ndarray | dict
    y_test: np.ndarray | dict
    num_classes: int
    normalization: Normalization = field(default_factory=Normalization)
    class_names: tuple[str, ...] = ()
    labelled: bool = True


def normal_samples_for_training(dataset):
    """An autoencoder learns what normal looks like: train and val keep only the samples labelled 0
    (normal) where 0/1 labels mark anomalies; test keeps both, for the AUC."""
    if not dataset.labelled or not isinstance(dataset, Dataset) or isinstance(dataset.y_train, dict):
        return dataset
    from dataclasses import replace

    ids = _class_ids(dataset.y_train)
    if ids is None or not np.all((ids == 0) | (ids == 1)) or not np.any(ids == 1):
        return dataset
    keep = {split: np.flatnonzero(_class_ids(getattr(dataset, f"y_{split}")) == 0) for split in ("train", "val")}
    return replace(
        dataset,
        x_train=rows(dataset.x_train, keep["train"]),
        y_train=dataset.y_train[keep["train"]],
        x_val=rows(dataset.x_val, keep["val"]),
        y_val=dataset.y_val[keep["val"]],
    )


def _shape_str(shape: tuple) -> str:
    return "x".join(str(d if d is not None else 32) for d in shape)


def _split_labels(y) -> np.ndarray | None:
    """The whole-numbered targets a split stratifies by (the first output's that has them), or None."""
    if not isinstance(y, dict):
        return _class_ids(y)
    return next((c for c in (_class_ids(v) for v in y.values()) if c is not None), None)


def split_groups(ids: np.ndarray | None, count: int) -> list[np.ndarray]:
    """The groups a split draws 70/10/20 from: one per value seen at least 3 times, and one pool of
    the values seen fewer times (rare ages, counts, or a class with two samples), so that every value
    can reach val and test; the whole data where there are no whole-numbered targets."""
    if ids is None:
        return [np.arange(count)]
    values, counts = np.unique(ids, return_counts=True)
    groups = [np.flatnonzero(ids == v) for v, c in zip(values, counts) if c >= 3]
    rare = np.flatnonzero(np.isin(ids, values[counts < 3]))
    return groups + ([rare] if len(rare) else [])


def split_method(y) -> str:
    """How ``stratified_split`` splits ``y``, in words (``data info`` says it)."""
    ids = _split_labels(y)
    if ids is None:
        return "seeded permutation (targets are not whole numbers)"
    values, counts = np.unique(ids, return_counts=True)
    rare = int(counts[counts < 3].sum())
    pooled = f"; {rare} samples of {int((counts < 3).sum())} values seen < 3 times split as one pool" if rare else ""
    return f"stratified by value ({len(values)} values){pooled}"


def stratified_split(x, y, seed: int = 0):
    """Fixed train/val/test split (70/10/20), stratified by value where ``y`` holds whole numbers.

    Values seen fewer than 3 times are split together (``split_groups``), never all kept in train.
    ``x`` and ``y`` may be dicts of arrays (several inputs, several outputs).
    """
    rng = np.random.default_rng(seed)
    groups = split_groups(_split_labels(y), size(x))
    parts: list[list[int]] = [[], [], []]
    for idx in groups:
        rng.shuffle(idx)
        n_test = max(1, int(round(len(idx) * SPLIT_FRACTIONS[2]))) if len(idx) >= 3 else 0
        n_val = max(1, int(round(len(idx) * SPLIT_FRACTIONS[1]))) if len(idx) >= 3 else 0
        parts[2].extend(idx[:n_test])
        parts[1].extend(idx[n_test : n_test + n_val])
        parts[0].extend(idx[n_test + n_val :])
    out = []
    for p in parts:
        p = np.sort(np.asarray(p, dtype=np.int64))
        out.extend([rows(x, p), rows(y, p)])
    return tuple(out)


def _targets(y, source: str):
    """Labels as class ids (int64, (N,)) where they are (runtime.inputs.holds_class_ids); other
    integer arrays (a detector's gt_classes) stay int64, anything else becomes float32 targets."""
    y = np.asarray(y)
    if holds_class_ids(y):
        return class_labels(y, len(y), f"data {source!r}")
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def _make(
    source, x, y, normalization, num_classes=None, class_names=(), seed=0, normalized=False, labelled=True
) -> Dataset:
    """Split ``x`` (raw, or float samples already when ``normalized``) and ``y``; record ``normalization``.

    ``x`` and ``y`` may be dicts by input and output name; ``y`` holds class ids or float targets.
    """
    if size(x) == 0:
        raise DataError(f"data {source!r} is empty: it has no samples")
    if isinstance(y, dict):  # a detector's gt_classes are padded with -1 per image, never class ids of samples
        y = {k: np.asarray(v, np.int64) if k == "gt_classes" else _targets(v, source) for k, v in y.items()}
    else:
        y = _targets(y, source)
    for part in _parts(y):
        if len(part) != size(x):
            raise DataError(f"data {source!r}: {size(x)} inputs but {len(part)} labels")
    if not normalized:
        x = {k: normalization.apply(v) for k, v in x.items()} if isinstance(x, dict) else normalization.apply(x)
    elif isinstance(x, dict):
        x = {k: np.asarray(v, dtype=np.float32) for k, v in x.items()}
    else:
        x = np.asarray(x, dtype=np.float32)
    x_train, y_train, x_val, y_val, x_test, y_test = stratified_split(x, y, seed)
    if size(x_train) == 0 or size(x_test) == 0:
        raise DataError(f"data {source!r} has too few samples per class to split into train and test")
    ids = _class_ids(y) if not isinstance(y, dict) else None
    if num_classes is not None:
        k = int(num_classes)
    else:
        k = int(ids.max() + 1) if ids is not None and labelled and len(ids) else 0
    return Dataset(
        source, x_train, y_train, x_val, y_val, x_test, y_test, k, normalization, tuple(class_names), labelled
    )


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


_SHAPES = re.compile(r"^shapes(?::(\d+))?(?::(\d+))?$")
SHAPE_CLASSES = ("circle", "square", "triangle")
MAX_OBJECTS = 8  # ground-truth rows per image (gt_classes -1 where unused)


def sample_photos() -> list[np.ndarray]:
    """scikit-learn's two sample photos (china.jpg, flower.jpg), uint8 RGB: real backgrounds offline."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError as exc:
        raise DataError('the shapes source needs scikit-learn: pip install "edgeq[train]"') from exc
    return [np.asarray(img, dtype=np.uint8) for img in load_sample_images().images]


def draw_shapes(size: int, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` images of size x size: crops of real photos with 1 to 4 circles, squares and
    triangles each (10% to 40% of the side, overlapping little), and their exact boxes."""
    from PIL import Image, ImageDraw

    photos = sample_photos()
    images = np.empty((count, size, size, 3), np.uint8)
    boxes = np.zeros((count, MAX_OBJECTS, 4), np.float32)
    classes = np.full((count, MAX_OBJECTS), -1, np.int64)
    for i in range(count):
        photo = photos[int(rng.integers(len(photos)))]
        side = int(rng.integers(120, min(photo.shape[:2])))
        top, left = int(rng.integers(0, photo.shape[0] - side)), int(rng.integers(0, photo.shape[1] - side))
        canvas = Image.fromarray(photo[top : top + side, left : left + side]).resize((size, size))
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


def load_shapes(spec: str = "shapes") -> Dataset:
    """``shapes[:SIZE[:N]]``: object detection without a download: N (2400) images of SIZE (96) pixels,
    crops of scikit-learn's real photos with circles, squares and triangles drawn on, exact boxes.

    Ground truth: ``gt_boxes`` (N, 8, 4) normalised (ymin, xmin, ymax, xmax), ``gt_classes`` (N, 8), -1 unused.
    """
    m = _SHAPES.match(spec)
    if not m:
        raise DataError(f"bad source {spec!r}: write shapes, shapes:SIZE or shapes:SIZE:N (e.g. shapes:96:2400)")
    size, n = int(m.group(1) or 96), int(m.group(2) or 2400)
    if size < 32 or n < 10:
        raise DataError(f"bad source {spec!r}: SIZE must be at least 32 and N at least 10")
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "little"))
    images, boxes, classes = draw_shapes(size, n, rng)
    y = {"gt_boxes": boxes, "gt_classes": classes}
    return _make(spec, images, y, UINT8_IMAGES, num_classes=len(SHAPE_CLASSES), class_names=SHAPE_CLASSES)


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
    input_shape=None,
    int8_input: tuple[float, int] | None = None,
) -> Dataset:
    """x (and y) from an .npz, read by the input contract (edgeq.runtime.inputs.samples).

    Inputs: ``x``, or ``x_<input name>`` for each input of a model with several. Targets:
    ``y``, or ``y_<output name>`` for each output: class ids (one-hot rows become ids) or
    float arrays (regression). ``normalization`` is the model's recorded one when the data is
    for a known model: uint8 x is raw data it normalises, float x must lie in its float range;
    int8 x is the codes of an int8 model input (``int8_input`` = its scale and zero point).
    (N, H, W) arrays for a model that takes (H, W, 1) get the channel axis.
    """
    path = Path(path)
    source = f"npz:{path}"
    arrays = read_npz(path)
    named_x = {k[2:]: v for k, v in arrays.items() if k.startswith("x_")}
    if "x" not in arrays and not named_x:
        raise DataError(
            f"{path}: no array named 'x' (found: {', '.join(arrays) or 'none'}); save with np.savez(x=..., y=...), "
            "or x_<input name>=... for each input of a model with several"
        )
    raw_x = {"": arrays["x"]} if "x" in arrays else named_x
    shapes = input_shape if isinstance(input_shape, dict) else {"": input_shape}
    x = {}
    for name, value in raw_x.items():
        where = f"{path} ({'x' if not name else 'x_' + name})"
        if value.ndim < 2:
            raise DataError(f"{where}: must be (N, ...) samples, got shape {value.shape}")
        value = samples(value, normalization, where, int8_input=int8_input, check_finite=False)
        shape = shapes.get(name) if name in shapes else (shapes.get("") if len(raw_x) == 1 else None)
        wants_channel = shape is not None and len(shape) == value.ndim and int(shape[-1] or 0) == 1
        if (shape is None and input_shape is None and value.ndim == 3) or wants_channel:
            value = value[..., None]  # (N, H, W) grey images: add the channel axis
        x[name] = value
    counts = {len(v) for v in x.values()}
    if len(counts) != 1:
        raise DataError(f"{path}: the input arrays hold different numbers of samples ({sorted(counts)})")
    n = counts.pop()
    named_y = {k[2:]: v for k, v in arrays.items() if k.startswith("y_")}
    named_y |= {k: arrays[k] for k in GROUND_TRUTH if k in arrays}  # a detector's boxes
    labelled = "y" in arrays or bool(named_y)
    if not labelled:
        if labels_required:
            raise DataError(f"{path}: no labels: save them as array 'y' (class indices or float targets)")
        y = np.zeros(n, dtype=np.int64)
    elif "y" in arrays:
        y = _npz_targets(arrays["y"], n, str(path), "y")
    else:
        y = {name: _npz_targets(v, n, str(path), f"y_{name}") for name, v in named_y.items()}
    recorded = normalization
    if any(v.dtype == np.uint8 for v in raw_x.values()):
        recorded = normalization if normalization is not None and normalization.raw_max is not None else UINT8_IMAGES
    recorded = recorded if recorded is not None else Normalization()  # float samples already
    inputs = x.get("", x)
    return _make(source, inputs, y, recorded, normalized=True, labelled=labelled)


def _npz_targets(y: np.ndarray, count: int, where: str, key: str) -> np.ndarray:
    """Class ids where ``y`` holds them (runtime.inputs.holds_class_ids), else float targets."""
    y = np.asarray(y)
    if len(y) != count:
        raise DataError(f"{where}: {len(y)} labels in {key!r} for {count} inputs")
    if holds_class_ids(y):
        return class_labels(y, count, where, key)
    if not np.issubdtype(y.dtype, np.number):
        raise DataError(f"{where}: {key!r} must hold class ids or float targets, got dtype {y.dtype}")
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


class EncodedImages(_Splits):
    """``images:DIR`` and ``tfrecord:GLOB``: encoded images, decoded only when read.

    The split is fixed from the file list and labels alone (the same stratified split as
    the in-memory sources), so nothing is decoded to make it. Training streams the
    images through tf.data (edgeq.training.pipeline); calibration decodes only the samples
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
        y = np.asarray(labels)
        y = y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)
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
TFRECORD_TARGET = "image/target"  # a float (list) target: regression, instead of a class label


def _first_line(exc: Exception) -> str:
    """The first line of a TensorFlow error, without its function-node prefix."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)[:200]


def _tfrecord_files(pattern: str) -> list[str]:
    import glob

    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"tfrecord:{pattern}: no file matches; give a glob such as tfrecord:data/train-*.tfrecord")
    return files


def _tf():
    try:
        from edgeq.models.compat import tf
    except Exception as exc:
        raise DataError(f'tfrecord data needs TensorFlow: pip install "edgeq[train]" ({exc})') from exc
    return tf


def _parse_tfrecord(tf, serialized):
    features = {
        TFRECORD_IMAGE: tf.io.FixedLenFeature([], tf.string),
        TFRECORD_LABEL: tf.io.FixedLenFeature([], tf.int64, default_value=-1),
        TFRECORD_TARGET: tf.io.VarLenFeature(tf.float32),
    }
    return tf.io.parse_single_example(serialized, features)


def load_tfrecord(
    pattern: str,
    image_size: tuple[int, int] | None,
    channels: int = 3,
    normalization: Normalization | None = None,
) -> EncodedImages:
    """``tfrecord:GLOB``: tf.train.Example records with ``image/encoded`` and ``image/class/label``
    (int64), or ``image/target`` (floats, one length for every record: regression).

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
                label, target = int(parsed[TFRECORD_LABEL]), parsed[TFRECORD_TARGET].values.numpy()
                if label < 0 and not len(target):
                    raise DataError(
                        f"{file}: record {index} has neither {TFRECORD_LABEL!r} (a class index >= 0) nor "
                        f"{TFRECORD_TARGET!r} (float targets)"
                    )
                labels.append(label if label >= 0 else target.astype(np.float32))
        except (tf.errors.OpError, UnicodeDecodeError) as exc:  # TF's message itself may not decode
            raise DataError(
                f"{file}: not a TFRecord of tf.train.Example with {TFRECORD_IMAGE!r} (bytes) and "
                f"{TFRECORD_LABEL!r} (int64): {_first_line(exc)}"
            ) from exc
    kinds = {isinstance(label, int) for label in labels}
    if len(kinds) > 1:
        raise DataError(f"{source}: some records have a class label, others a float target: give one kind")
    if labels and isinstance(labels[0], np.ndarray):
        if len({len(t) for t in labels}) > 1:
            raise DataError(f"{source}: the records' {TFRECORD_TARGET!r} have different lengths")
        labels = np.stack(labels)
    k = max(labels) + 1 if len(labels) and not isinstance(labels, np.ndarray) else 0
    data = EncodedImages(
        source, "tfrecord", refs, labels, image_size, channels, _image_normalization(normalization), (), k
    )
    data.take("train", np.arange(1))
    return data


# The TF Object Detection API's layout: normalised corner lists and 1-based class labels per image.
OD_BOX = ("image/object/bbox/ymin", "image/object/bbox/xmin", "image/object/bbox/ymax", "image/object/bbox/xmax")
OD_LABEL = "image/object/class/label"


def is_detection_tfrecord(pattern: str) -> bool:
    """Whether the first record of ``pattern`` is in the TF Object Detection API's layout."""
    tf = _tf()
    try:
        for record in tf.data.TFRecordDataset(_tfrecord_files(pattern)[:1]).take(1):
            return OD_BOX[0] in tf.train.Example.FromString(record.numpy()).features.feature
    except Exception:  # a broken file (DataLossError, DecodeError, ...): load_tfrecord names it
        return False
    return False


def _detection_dataset(source, images, boxes, classes, normalization, class_names) -> Dataset:
    """Images (N, H, W, C) uint8 and per-image boxes/classes lists as gt_boxes/gt_classes (padded)."""
    rows = max([len(c) for c in classes] + [1])
    gt_boxes = np.zeros((len(images), rows, 4), np.float32)
    gt_classes = np.full((len(images), rows), -1, np.int64)
    for i, (b, c) in enumerate(zip(boxes, classes)):
        gt_boxes[i, : len(c)] = np.asarray(b, np.float32).reshape(-1, 4)
        gt_classes[i, : len(c)] = c
    k = len(class_names) if class_names else int(gt_classes.max() + 1)
    y = {"gt_boxes": gt_boxes, "gt_classes": gt_classes}
    return _make(source, np.stack(images), y, normalization, num_classes=k, class_names=class_names)


def load_detection_tfrecord(
    pattern: str, image_size: tuple[int, int] | None, channels: int = 3, normalization: Normalization | None = None
) -> Dataset:
    """``tfrecord:GLOB`` in the TF Object Detection API's layout: ``image/encoded``, the box corners
    ``image/object/bbox/{ymin,xmin,ymax,xmax}`` (normalised) and ``image/object/class/label`` (1-based).

    Images are decoded at the model's size and held in memory (detection sets for a device are small).
    """
    source = f"tfrecord:{pattern}"
    if image_size is None:
        raise DataError(f"{source}: the image size is unknown: give a model whose input fixes it")
    tf = _tf()
    features = {TFRECORD_IMAGE: tf.io.FixedLenFeature([], tf.string), OD_LABEL: tf.io.VarLenFeature(tf.int64)}
    features |= {key: tf.io.VarLenFeature(tf.float32) for key in OD_BOX}
    images, boxes, classes = [], [], []
    for file in _tfrecord_files(pattern):
        try:
            for index, record in enumerate(tf.data.TFRecordDataset(file)):
                parsed = tf.io.parse_single_example(record, features)
                sides = [parsed[key].values.numpy() for key in OD_BOX]
                labels = parsed[OD_LABEL].values.numpy().astype(np.int64) - 1
                if len({len(side) for side in sides}) > 1 or len(labels) != len(sides[0]):
                    raise DataError(
                        f"{file}: record {index} has box corner lists of lengths {[len(v) for v in sides]} and "
                        f"{len(labels)} labels: each box needs ymin, xmin, ymax, xmax and one label"
                    )
                if len(labels) and labels.min() < 0:
                    raise DataError(
                        f"{file}: record {index}: {OD_LABEL} counts classes from 1, found {labels.min() + 1}"
                    )
                corners = np.stack(sides, axis=-1)
                if corners.size and not (np.isfinite(corners).all() and -0.5 <= corners.min() <= corners.max() <= 1.5):
                    raise DataError(
                        f"{file}: record {index} has box corners from {corners.min():g} to {corners.max():g}: the "
                        "Object Detection API's boxes are normalised to [0, 1]"
                    )
                images.append(decode_image(parsed[TFRECORD_IMAGE].numpy(), image_size, channels, f"{file}#{index}"))
                boxes.append(corners)
                classes.append(labels)
        except (tf.errors.OpError, UnicodeDecodeError) as exc:
            raise DataError(
                f"{file}: not a TFRecord of the Object Detection API's tf.train.Example: {_first_line(exc)}"
            ) from exc
    if not images:
        raise DataError(f"{source} is empty: it has no records")
    return _detection_dataset(source, images, boxes, classes, _image_normalization(normalization), ())


def load_coco(
    spec: str, image_size: tuple[int, int] | None, channels: int = 3, normalization: Normalization | None = None
) -> Dataset:
    """``coco:ANNOTATIONS.json[:IMAGES_DIR]``: a COCO-style JSON (images, annotations with pixel
    [x, y, w, h] boxes, categories) and its image folder (default: the JSON's folder).

    Categories are numbered in the order of their ids; crowd annotations are left out. Images
    are decoded at the model's size and held in memory.
    """
    import json

    path_text, _, folder_text = spec.partition(":") if not spec.endswith(".json") else (spec, "", "")
    path = Path(path_text)
    folder = Path(folder_text) if folder_text else path.parent
    source = f"coco:{spec}"
    if image_size is None:
        raise DataError(f"{source}: the image size is unknown: give a model whose input fixes it")
    try:
        coco = json.loads(path.read_text(encoding="utf-8"))
        categories = sorted(coco["categories"], key=lambda c: c["id"])
        entries, annotations = coco["images"], coco.get("annotations", [])
        index = {c["id"]: k for k, c in enumerate(categories)}
        per_image: dict = {e["id"]: ([], []) for e in entries}
        for a in annotations:
            if a.get("iscrowd") or a["image_id"] not in per_image:
                continue
            x, y, w, h = (float(v) for v in a["bbox"])
            if not all(np.isfinite([x, y, w, h])) or w < 0 or h < 0:
                raise ValueError(f"annotation {a.get('id')}: bbox {a['bbox']} is not [x, y, w, h] with w, h >= 0")
            if a["category_id"] not in index:
                raise ValueError(f"annotation {a.get('id')}: category_id {a['category_id']!r} is not a category")
            per_image[a["image_id"]][0].append([x, y, w, h])
            per_image[a["image_id"]][1].append(index[a["category_id"]])
        sizes = []
        for e in entries:
            w, h = float(e["width"]), float(e["height"])
            if not (np.isfinite([w, h]).all() and w > 0 and h > 0):
                raise ValueError(f"image {e['id']}: width {e['width']!r} and height {e['height']!r} must be > 0")
            name = e["file_name"]
            if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"image {e['id']}: file_name {name!r} is not a file under the image folder")
            sizes.append((folder / name, w, h))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(
            f"{path}: not a COCO annotation file ({type(exc).__name__}: {exc}); it needs images (id, file_name, "
            "width, height), annotations (image_id, category_id, bbox [x, y, w, h]) and categories (id, name)"
        ) from exc
    images, boxes, classes = [], [], []
    for e, (file, w, h) in zip(entries, sizes):
        try:
            encoded = file.read_bytes()
        except OSError as exc:
            raise DataError(
                f"{str(file)[:200]}: an image {path.name} lists cannot be read ({exc.strerror}); give its folder as "
                f"coco:{path}:DIR"
            ) from exc
        xywh = np.asarray(per_image[e["id"]][0], np.float32).reshape(-1, 4)
        boxes.append(np.stack([xywh[:, 1] / h, xywh[:, 0] / w, (xywh[:, 1] + xywh[:, 3]) / h,
                               (xywh[:, 0] + xywh[:, 2]) / w], axis=-1))  # fmt: skip
        classes.append(np.asarray(per_image[e["id"]][1], np.int64))
        images.append(decode_image(encoded, image_size, channels, str(file)))
    if not images:
        raise DataError(f"{path}: it lists no images")
    names = tuple(str(c.get("name", c["id"])) for c in categories)
    return _detection_dataset(source, images, boxes, classes, _image_normalization(normalization), names)


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
    if source == "shapes" or source.startswith("shapes:"):
        return load_shapes(source)
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


def export_split(dataset: Dataset, split: str, path: str | Path) -> Path:
    """Write one split as .npz (x or x_<input>: normalised float32; y or y_<output>) for `edgeq profile --data`."""
    from edgeq.artifacts import atomic_path

    x, y = dataset.split(split)
    arrays = {f"x_{k}": v for k, v in x.items()} if isinstance(x, dict) else {"x": x}
    if dataset.labelled and isinstance(y, dict):  # a detector's ground truth keeps its own names
        arrays |= {k if k in GROUND_TRUTH else f"y_{k}": v for k, v in y.items()}
    elif dataset.labelled:
        arrays["y"] = y
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    return path
