"""Datasets from user files: .npz, image folders, TFRecords (classification and detection), COCO JSON."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgeq.data.splits import Dataset, _make, _Splits, stratified_split
from edgeq.errors import DataError
from edgeq.runtime.inputs import UINT8_IMAGES, Normalization, class_labels, holds_class_ids, read_npz, samples
from edgeq.tasks.detection import GROUND_TRUTH

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


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
