"""Training data as tf.data: streamed, shuffled with a bounded buffer, batched, prefetched.

Every source becomes a ``tf.data.Dataset`` of (float sample, label) with the source's
fixed splits and recorded normalisation. In-memory sources (digits, synthetic, npz) are
sliced; image folders and TFRecords are decoded lazily, one image at a time, through the
same Pillow decoder as eval and profile (``EncodedImages.decode``), so memory does not
grow with the data set.

The batch is the global batch: under tf.distribute, Keras splits it across replicas and
the data is sharded per worker by element (``AutoShardPolicy.DATA``). Every worker shuffles
with the same seed, so the global batches of a 2-worker run are those of a 1-worker run.
"""

from __future__ import annotations

import math

import numpy as np

from edgeq.data.files import TFRECORD_IMAGE, EncodedImages, _parse_tfrecord
from edgeq.errors import UsageError
from edgeq.models.compat import tf

AUGMENTS = ("flip", "crop")
SHUFFLE_BUFFER = 10_000  # samples; image paths are shuffled whole (they are small)
PREFETCH_BATCHES = 2
# tf.data's autotuner may grow its buffers towards half the machine's RAM over a long epoch
# (peak RSS then grows with the data set); a fixed prefetch and this cap keep it flat.
AUTOTUNE_RAM_BUDGET = 256 * 1024 * 1024


def parse_augment(spec: str | None) -> tuple[str, ...]:
    """``flip,crop`` -> ("flip", "crop"); an unknown name is a one-line error."""
    if not spec:
        return ()
    names = tuple(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    unknown = [n for n in names if n not in AUGMENTS]
    if unknown:
        raise UsageError(f"--augment {spec!r}: unknown {', '.join(unknown)}; choose from {', '.join(AUGMENTS)}")
    return names


def _options() -> tf.data.Options:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    options.autotune.ram_budget = AUTOTUNE_RAM_BUDGET
    return options


def _decoder(data: EncodedImages):
    shape = data.input_shape

    def decode_bytes(encoded):
        return data.decode(bytes(encoded))

    def decode_file(path):
        with open(path.decode() if isinstance(path, bytes) else str(path), "rb") as fh:
            return data.decode(fh.read(), str(path))

    def run(fn, value):
        x = tf.numpy_function(fn, [value], tf.float32, stateful=False)
        return tf.ensure_shape(x, shape)

    return (lambda path: run(decode_file, path)), (lambda encoded: run(decode_bytes, encoded))


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle/augmentation seed of one epoch: a function of (--seed, epoch) alone, so a
    run resumed at epoch E sees epoch E's order, as the uninterrupted run did."""
    return (int(seed) * 1_000_003 + int(epoch)) % (2**63 - 1)


def _encoded_split(data: EncodedImages, split: str, shuffle_seed) -> tf.data.Dataset:
    labels = _y_array(data.labels(split))  # class ids, or float targets (image/target)
    from_path, from_bytes = _decoder(data)
    if data.kind == "files":
        ds = tf.data.Dataset.from_tensor_slices((np.asarray(data.refs(split), dtype=str), labels))
        if shuffle_seed is not None:  # the whole list of paths: a full shuffle at the cost of a few bytes per image
            ds = ds.shuffle(len(labels), seed=shuffle_seed)
        return ds.map(lambda p, y: (from_path(p), y), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    mask = np.zeros(data.total, dtype=bool)
    mask[data.indices(split)] = True
    ds = tf.data.TFRecordDataset(data.files)  # records in the order EncodedImages numbered them
    in_split = tf.constant(mask)
    ds = ds.enumerate().filter(lambda i, _: tf.gather(in_split, i)).map(lambda _, r: r)
    ds = tf.data.Dataset.zip((ds, tf.data.Dataset.from_tensor_slices(labels)))
    if shuffle_seed is not None:
        ds = ds.shuffle(min(len(labels), SHUFFLE_BUFFER), seed=shuffle_seed)
    return ds.map(
        lambda r, y: (from_bytes(_parse_tfrecord(tf, r)[TFRECORD_IMAGE]), y),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def _augment(ds: tf.data.Dataset, names: tuple[str, ...], shape: tuple[int, ...], seed) -> tf.data.Dataset:
    """Stateless random flips and crops, seeded per sample from a seeded stream: the same
    ``--seed`` gives the same augmentation, and each epoch another (its seed is the epoch's)."""
    seeds = tf.data.Dataset.random(seed=seed).batch(4)

    def apply(sample, key):
        (x, y), key = sample, tf.reshape(key, (2, 2))
        return _flip_crop(x, names, shape, key[0], key[1]), y

    return tf.data.Dataset.zip((ds, seeds)).map(apply, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _flip_crop(x, names: tuple[str, ...], shape: tuple[int, ...], flip_key, crop_key):
    """A flip and a crop (reflect-padded by 1/8 of each side), each from its own stateless seed."""
    h, w = int(shape[0]), int(shape[1])
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    if "flip" in names:
        x = tf.image.stateless_random_flip_left_right(x, seed=flip_key)
    if "crop" in names:
        padded = tf.pad(x, [[pad_h, pad_h], [pad_w, pad_w], [0, 0]], mode="REFLECT")
        x = tf.image.stateless_random_crop(padded, tf.shape(x), seed=crop_key)
    return x


def _random_access(data, split: str):
    """(count, fetch): fetch(index) -> (x, y) of a sample of an in-memory split or an image folder.

    The arrays are captured once, by the function; a dataset built per epoch around them would put
    one copy of them in tf.data's graph per epoch (17 GB for 30 epochs of 4,200 96x96 images).
    """
    if isinstance(data, EncodedImages):
        paths = tf.constant(np.asarray(data.refs(split), dtype=str))
        labels = tf.convert_to_tensor(_y_array(data.labels(split)))
        from_path, _ = _decoder(data)
        return data.count(split), lambda i: (from_path(tf.gather(paths, i)), tf.gather(labels, i))
    x, y = data.split(split)
    xs = tf.nest.map_structure(tf.convert_to_tensor, x)
    ys = tf.nest.map_structure(tf.convert_to_tensor, _y_array(y))

    def fetch(i):
        return tf.nest.map_structure(lambda t: tf.gather(t, i), xs), tf.nest.map_structure(
            lambda t: tf.gather(t, i), ys
        )

    return data.count(split), fetch


def steps_per_epoch(data, split: str, batch_size: int) -> int:
    return max(1, math.ceil(data.count(split) / batch_size))


def split_dataset(
    data,
    split: str,
    batch_size: int,
    *,
    training: bool = False,
    seed: int = 0,
    augment: tuple[str, ...] = (),
    epochs: tuple[int, int] | None = None,
    targets: list[str | None] | None = None,
) -> tf.data.Dataset:
    """One split as batches of ``batch_size`` (the global batch); shuffled and augmented when ``training``.

    ``training``: epochs ``epochs = (first, end)`` (default: epoch 0 alone) one after the
    other, ``steps_per_epoch`` batches each, every epoch shuffled and augmented with the
    seed of (``seed``, epoch). Not from a generator that runs on across epochs: a run
    resumed at epoch E then gets the order the uninterrupted run had at epoch E.

    ``targets`` (``edgeq.train.objectives.target_plan``): what each output learns from, in the
    model's output order: "input" (an autoencoder), an output name (``y_<name>``), None (``y``).
    """
    if not training:
        if isinstance(data, EncodedImages):
            ds = _targeted(_encoded_split(data, split, None), targets)
        else:
            ds = tf.data.Dataset.from_tensor_slices(_slices(data, split, targets))
        return ds.batch(batch_size).prefetch(PREFETCH_BATCHES).with_options(_options())
    first, end = epochs if epochs is not None else (0, 1)
    if isinstance(data, EncodedImages) and data.kind == "tfrecord":  # read in order: a shuffle buffer per epoch

        def one_epoch(epoch: int) -> tf.data.Dataset:
            key = epoch_seed(seed, epoch)
            ds = _encoded_split(data, split, key)
            if augment:
                ds = _augment(ds, augment, data.input_shape, key)
            return _targeted(ds, targets).batch(batch_size)

        # Python-int seeds (a seed tensor inside the pipeline trips TF's seed check when --seed is 0)
        parts = [one_epoch(e) for e in range(first, end)]
        return _one_after_another(parts).prefetch(PREFETCH_BATCHES).with_options(_options())

    # Random access: each epoch is a stateless permutation of the indices, keyed by (seed, epoch).
    count, fetch = _random_access(data, split)
    shape = tuple(data.input_shape) if not isinstance(data.input_shape, dict) else ()

    def per_epoch(epoch):
        key = tf.stack([tf.constant(int(seed), tf.int64), tf.cast(epoch, tf.int64)])

        def sample(i):
            x, y = fetch(tf.random.experimental.index_shuffle(i, key, count - 1))
            if augment:  # each sample's own flip and crop, from (seed, epoch, sample)
                stream = key[0] * 1_000_003 + key[1]
                x = _flip_crop(x, augment, shape, tf.stack([stream, 2 * i]), tf.stack([stream, 2 * i + 1]))
            return x, y

        ds = tf.data.Dataset.range(count).map(sample, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return _targeted(ds, targets).batch(batch_size)

    ds = tf.data.Dataset.range(first, end).flat_map(per_epoch)
    return ds.prefetch(PREFETCH_BATCHES).with_options(_options())


def _one_after_another(parts: list[tf.data.Dataset]) -> tf.data.Dataset:
    """``parts`` concatenated in order, as a balanced tree (depth log2 of their number).

    A concatenation opens its second input only when the first is done, so one epoch's shuffle
    buffer is alive at a time (choose_from_datasets opened every epoch's at once: 17 GB for 30
    epochs of 4,200 96x96 images); the tree keeps a 300-epoch run's graph shallow.
    """
    if len(parts) == 1:
        return parts[0]
    middle = len(parts) // 2
    return _one_after_another(parts[:middle]).concatenate(_one_after_another(parts[middle:]))


def _y_array(y):
    if isinstance(y, dict):
        return {k: _y_array(v) for k, v in y.items()}
    y = np.asarray(y)
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def _slices(data, split: str, targets: list[str | None] | None):
    """(x, y) of an in-memory split for from_tensor_slices; y as ``targets`` picks it (all of it: None)."""
    x, y = data.split(split)
    y = _y_array(y)
    if targets is None:
        return x, y
    return x, _pick(x, y, targets)


def _pick(x, y, targets: list[str | None]):
    picked = tuple(x if t == "input" else (y[t] if t is not None else y) for t in targets)
    return picked[0] if len(picked) == 1 else picked


def _targeted(ds: tf.data.Dataset, targets: list[str | None] | None) -> tf.data.Dataset:
    """Map (x, y) to (x, the targets of each output) when the targets are not ``y`` as it is."""
    if not targets or targets == [None]:
        return ds
    return ds.map(lambda x, y: (x, _pick(x, y, targets)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
