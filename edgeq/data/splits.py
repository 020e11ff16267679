"""Datasets and their splits: train/val/test/calibration, stratified and grouped, held out by content."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeq.errors import DataError
from edgeq.runtime.inputs import Normalization, class_labels, holds_class_ids
from edgeq.tasks.detection import GROUND_TRUTH

SPLIT_FRACTIONS = (0.7, 0.1, 0.2)  # train, val, test


DEFAULT_CALIBRATION_SAMPLES = 200


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
