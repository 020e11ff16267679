"""Fuzz edgeq's readers of user files: mutated .tflite, .npz, inventory, JSON and release files.

Each case mutates a valid seed file (bit flips, truncations, 32-bit offset/length fields set
to edge values, float fields such as quantization scales set to NaN/inf/0/huge, small
enum-like bytes such as op codes, duplicated or deleted chunks) and runs the readers a user
reaches with it:

- .tflite: ``edgeq inspect``'s reader, ``edgeq profile`` (one run), and eval's loader
  (TFLiteModel plus one prediction);
- .npz: ``profile --data``'s and training/eval's loaders;
- inventory (TOML and Ansible YAML): ``edgeq devices``' loader;
- .npz with several arrays (``x_<input>``, ``y_<output>``) and a detector's ground truth
  (``gt_boxes``, ``gt_classes``): ``profile --data``'s and training/eval's loaders;
- task files (``--task FILE.json``) and plan files (``--plan``, ``--layer-config``);
- the records ``edgeq report`` reads (eval, profile, manifest, run, history JSON);
- COCO annotation JSON (beside its images) and TF Object Detection API TFRecords: the data
  loader a detector's ``--data coco:`` / ``tfrecord:`` reaches;
- ``release.json`` served by a store to ``edgeq pull`` (a real pull, from a file:// store): a
  refusal must change nothing, and no ``.part-`` file may be left behind (a PARTIAL line).

JSON files get structure-aware mutations half the time (a value replaced by another type or an
edge value, a key deleted or renamed, a list emptied, a deep nesting), byte mutations otherwise.

A reader may refuse a file only with an EdgeqError (what the CLI prints as one `error:`
line). Any other exception is a traceback; a worker that dies by a signal is a crash. Cases
run in worker subprocesses, each announcing a case before it runs it, so a crash names its
case and the next worker goes on after it. Case i is reproducible: its mutation comes from
``--seed`` and i.

    python tools/fuzz.py --cases 5000             # the benchmark (BENCHMARKS.md)
    python tools/fuzz.py --cases 300 --json r.json  # what the default suite runs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TFLITE_SEEDS = ("tiny_int8.tflite", "tiny_uint8.tflite", "tiny_fp32.tflite", "tiny_edgetpu.tflite")
NPZ_SEED = "tiny_digits.npz"
INVENTORY_SEEDS = {
    "devices.toml": (
        '[devices.pi]\nhost = "10.0.0.7"\nuser = "pi"\nport = 22\npython = "python3"\n'
        'tags = ["arm64", "lab"]\n\n[devices.x86]\nhost = "127.0.0.1"\nport = 2222\n'
    ),
    "hosts.yml": (
        "all:\n  hosts:\n    pi:\n      ansible_host: 10.0.0.7\n      ansible_user: pi\n"
        "      ansible_port: 22\n    nuc:\n      ansible_host: 10.0.0.8\n"
    ),
}
FUZZ_DATA = DATA / "fuzz"
REPORT_SEEDS = ("eval.json", "profile.json", "digits_int8.manifest.json", "run.json", "history.json")
TASK_SEED = '{"head0": "regression", "head1": "classification"}'
DETECTION_TASK_SEED = (
    '{"detection": {"layout": "ssd", "boxes": "head0", "scores": "head1", "classes": 1, "anchors": {"input_size": '
    '128, "num_layers": 4, "min_scale": 0.1484375, "max_scale": 0.75, "strides": [8, 16, 16, 16], '
    '"fixed_anchor_size": true}, "coder": {"order": "xywh", "scales": [128, 128, 128, 128], "exponential": false}}}'
)
PLAN_SEED = (
    '{"kind": "edgeq.plan", "model": "m.keras", "met": true, "ranges": "mse", "fallback": "float", '
    '"layers": {"conv1": "float", "dense": {"weight_bits": 4}, "re:block_.*": {"activation_bits": 16}}, '
    '"ranking": ["conv1", "dense"], "metric": "accuracy", "budget": 1.0}'
)
PLAN_LAYERS = ["conv1", "block_1", "block_2", "dense"]
RELEASE_FILE = b"model bytes of release 1"
KINDS = ("tflite", "npz", "inventory", "npz-multi", "task", "plan", "report", "release", "coco", "tfrecord")
EDGE_VALUES = (None, True, -1, 0, 2**63, 1e308, float("nan"), "", "x" * 300, [], {}, [[[[]]]], {"a": {"b": {}}})
EDGE_INTS = (0, 1, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFF0)
EDGE_FLOATS = (np.nan, np.inf, -np.inf, 0.0, -1.0, 1e38, 1e-45)


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """One to three mutations of ``data``."""
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        if not b:
            break
        kind = int(rng.integers(0, 7))
        if kind == 0:  # bit flips
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(0, len(b)))
                b[i] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:  # truncation
            b = b[: int(rng.integers(0, len(b)))]
        elif kind == 2 and len(b) >= 4:  # an offset / length / count field set to an edge value
            i = int(rng.integers(0, len(b) // 4)) * 4
            b[i : i + 4] = int(EDGE_INTS[int(rng.integers(0, len(EDGE_INTS)))]).to_bytes(4, "little")
        elif kind == 3 and len(b) >= 4:  # a float field (scale, zero point, min/max) set to an edge value
            i = int(rng.integers(0, len(b) // 4)) * 4
            b[i : i + 4] = np.float32(EDGE_FLOATS[int(rng.integers(0, len(EDGE_FLOATS)))]).tobytes()
        elif kind == 4:  # an enum-like byte (op code, tensor type, builtin options type)
            b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        elif kind == 5:  # a chunk duplicated in place
            i = int(rng.integers(0, len(b)))
            j = min(len(b), i + int(rng.integers(1, 64)))
            b[i:i] = b[i:j]
        else:  # a chunk deleted
            i = int(rng.integers(0, len(b)))
            del b[i : i + int(rng.integers(1, 64))]
    return bytes(b)


def mutate_npz(data: bytes, rng: np.random.Generator) -> bytes:
    """Half the cases: the zip's bytes; the other half: one member's .npy bytes (header: dtype,
    shape, order; or the values), re-zipped with valid checksums so the reader gets past the zip."""
    import io
    import zipfile

    if rng.integers(0, 2) == 0:
        return mutate(data, rng)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = {name: z.read(name) for name in z.namelist()}
    name = sorted(members)[int(rng.integers(0, len(members)))]
    npy = bytearray(members[name])
    if rng.integers(0, 2) == 0 and len(npy) > 10:  # the header, where dtype and shape are written
        header_end = min(len(npy), 10 + int.from_bytes(npy[8:10], "little"))
        i = int(rng.integers(10, max(11, header_end)))
        npy[i] = int(rng.choice(list(b"0123456789(),'<>|fiubc ")))
        members[name] = bytes(npy)
    else:
        members[name] = mutate(bytes(npy), rng)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for member, content in members.items():
            z.writestr(member, content)
    return out.getvalue()


def mutate_json(data: bytes, rng: np.random.Generator) -> bytes:
    """Half the cases: bytes; the other half: one to three changes to the parsed document."""
    if rng.integers(0, 2) == 0:
        return mutate(data, rng)
    doc = json.loads(data)
    for _ in range(int(rng.integers(1, 4))):
        nodes = list(_nodes(doc))
        parent, key = nodes[int(rng.integers(0, len(nodes)))]
        if parent is None:
            doc = copy.deepcopy(EDGE_VALUES[int(rng.integers(0, len(EDGE_VALUES)))])
            continue
        action = int(rng.integers(0, 4))
        if action == 0:  # a value of another type or an edge value (a fresh copy: never one object twice)
            parent[key] = copy.deepcopy(EDGE_VALUES[int(rng.integers(0, len(EDGE_VALUES)))])
        elif action == 1 and isinstance(parent, dict):  # a key deleted
            del parent[key]
        elif action == 2 and isinstance(parent, dict):  # a key renamed
            parent[str(key) + "_"] = parent.pop(key)
        else:  # a container emptied or a value wrapped in a list
            value = parent[key]
            parent[key] = type(value)() if isinstance(value, (dict, list)) else [value]
    return json.dumps(doc, allow_nan=True).encode()


def _nodes(doc, parent=None, key=None):
    """(parent, key) of every value in ``doc``, the root as (None, None)."""
    yield parent, key
    if isinstance(doc, dict):
        for k, v in list(doc.items()):
            yield from _nodes(v, doc, k)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, doc, i)


def _multi_npz() -> list[tuple[str, bytes]]:
    """Seeds: a two-input two-output npz, and a detector's (images, gt_boxes, gt_classes)."""
    import io

    rng = np.random.default_rng(0)
    seeds = []
    for name, arrays in (
        ("multi.npz", {"x_image": rng.random((8, 8, 8, 1), np.float32), "x_meta": rng.random((8, 3), np.float32),
                       "y_cls": rng.integers(0, 3, 8), "y_age": rng.random((8, 1), np.float32)}),
        ("detection.npz", {"x": rng.random((6, 16, 16, 3), np.float32), "gt_boxes": rng.random((6, 4, 4), np.float32),
                           "gt_classes": rng.integers(-1, 3, (6, 4))}),
    ):  # fmt: skip
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        seeds.append((name, buffer.getvalue()))
    return seeds


def _release_seed() -> bytes:
    import hashlib

    return json.dumps({
        "kind": "edgeq.release", "version": "1", "number": 1, "created": "2026-12-06T00:00:00Z",
        "expires": "2099-01-01T00:00:00Z",
        "files": {"m.tflite": {"sha256": hashlib.sha256(RELEASE_FILE).hexdigest(), "size": len(RELEASE_FILE)}},
    }, indent=2).encode()  # fmt: skip


def _png(seed: int) -> bytes:
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _coco_seed() -> bytes:
    images = [{"id": 10 + i, "file_name": f"{i}.png", "width": 16, "height": 16} for i in range(3)]
    annotations = [
        {"id": 1, "image_id": 10, "category_id": 7, "bbox": [1.0, 2.0, 8.0, 6.0], "iscrowd": 0, "area": 48.0},
        {"id": 2, "image_id": 11, "category_id": 8, "bbox": [0.0, 0.0, 16.0, 16.0], "iscrowd": 0, "area": 256.0},
        {"id": 3, "image_id": 12, "category_id": 7, "bbox": [4.0, 4.0, 2.0, 2.0], "iscrowd": 1, "area": 4.0},
    ]
    categories = [{"id": 7, "name": "cat"}, {"id": 8, "name": "dog"}]
    return json.dumps({"images": images, "annotations": annotations, "categories": categories}).encode()


def _example(tf, seed: int) -> bytes:
    feature = {
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[_png(seed)])),
        "image/object/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1, 2])),
    }
    for k, key in enumerate(("ymin", "xmin", "ymax", "xmax")):
        values = [0.1 + 0.1 * k, 0.2 + 0.1 * k]
        feature[f"image/object/bbox/{key}"] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _framed(records: list[bytes]) -> bytes:
    """TFRecord framing (length, its CRC, data, its CRC) written by TensorFlow's own writer."""
    from edgeq.models.compat import tf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for record in records:
                writer.write(record)
        return path.read_bytes()


def _tfrecord_seed() -> bytes:
    from edgeq.models.compat import tf

    return _framed([_example(tf, i) for i in range(3)])


def mutate_tfrecord(data: bytes, rng: np.random.Generator) -> bytes:
    """Half the cases: the file's bytes (its CRCs then refuse most); the other half: one record's
    tf.train.Example bytes mutated and framed again with valid CRCs, so the parser gets them."""
    if rng.integers(0, 2) == 0:
        return mutate(data, rng)
    from edgeq.models.compat import tf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.tfrecord"
        path.write_bytes(data)
        records = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
    i = int(rng.integers(0, len(records)))
    if rng.integers(0, 2) == 0:
        records[i] = mutate(records[i], rng)
    else:  # a feature of the parsed Example: dropped, emptied, given an extra or an edge value
        example = tf.train.Example.FromString(records[i])
        features = example.features.feature
        key = sorted(features)[int(rng.integers(0, len(features)))]
        kind = features[key].WhichOneof("kind")
        values = getattr(features[key], kind).value
        action = int(rng.integers(0, 4))
        if action == 0:
            del features[key]
        elif action == 1:
            del values[:]
        elif kind == "bytes_list":
            values.append(b"\x89PNG not an image" if action == 2 else b"")
        elif not len(values):
            del features[key]
        elif kind == "int64_list":  # one value replaced: the lists keep their lengths
            values[int(rng.integers(0, len(values)))] = [0, -1, 2**62, 1000][int(rng.integers(0, 4))]
        else:
            values[int(rng.integers(0, len(values)))] = float([np.nan, np.inf, -1.0, 1e30][int(rng.integers(0, 4))])
        records[i] = example.SerializeToString()
    return _framed(records)


def _seed_files(kinds: tuple[str, ...] = KINDS) -> dict[str, list[tuple[str, bytes]]]:
    """The valid files each kind's cases mutate; made only for ``kinds`` (the TFRecord seed needs
    TensorFlow, which a worker of the other kinds should not import)."""
    makers = {
        "tflite": lambda: [(name, (DATA / name).read_bytes()) for name in TFLITE_SEEDS],
        "npz": lambda: [(NPZ_SEED, (DATA / NPZ_SEED).read_bytes())],
        "inventory": lambda: [(name, text.encode()) for name, text in INVENTORY_SEEDS.items()],
        "npz-multi": _multi_npz,
        "task": lambda: [("tasks.json", TASK_SEED.encode()), ("detector.json", DETECTION_TASK_SEED.encode())],
        "plan": lambda: [("plan.json", PLAN_SEED.encode())],
        "report": lambda: [(name, (FUZZ_DATA / name).read_bytes()) for name in REPORT_SEEDS],
        "release": lambda: [("release.json", _release_seed())],
        "coco": lambda: [("ann.json", _coco_seed())],
        "tfrecord": lambda: [("od.tfrecord", _tfrecord_seed())],
    }
    return {kind: makers[kind]() for kind in kinds}


def _mutated(kind: str, data: bytes, rng: np.random.Generator) -> bytes:
    if kind in ("npz", "npz-multi"):
        return mutate_npz(data, rng)
    if kind in ("task", "plan", "report", "release", "coco"):
        return mutate_json(data, rng)
    if kind == "tfrecord":
        return mutate_tfrecord(data, rng)
    return mutate(data, rng)


def _targets(kind: str, path: Path):
    """[(name, callable)] that read ``path`` as a user's command would."""
    if kind == "tflite":
        from edgeq.profile.run import profile_model
        from edgeq.runtime.inspect import inspect_tflite, inspect_to_dict
        from edgeq.runtime.interpreter import TFLiteModel

        def eval_loader():
            model = TFLiteModel(path)
            shape = tuple(max(1, d) for d in model.input.shape[1:])
            model.predict(np.zeros((1, *shape), np.float32))

        from edgeq.quantize.float_model import prepared_float_model

        return [
            ("inspect", lambda: inspect_to_dict(inspect_tflite(path))),
            ("convert-float", lambda: prepared_float_model(path.read_bytes(), str(path))),
            ("profile", lambda: profile_model(path, runs=1, warmup=0, progress=False)),
            ("eval-loader", eval_loader),
        ]
    if kind == "npz":
        from edgeq.data.files import load_npz as training_npz
        from edgeq.profile.samples import load_npz as profile_npz
        from edgeq.runtime.interpreter import TFLiteModel

        model_input = TFLiteModel(DATA / "tiny_int8.tflite").input
        return [
            ("profile --data", lambda: profile_npz(path, model_input)),
            ("train/eval data", lambda: training_npz(path)),
        ]
    if kind == "npz-multi":
        from edgeq.data.files import load_npz as training_npz
        from edgeq.profile.samples import load_npz as profile_npz

        def profile_reader():
            from edgeq.runtime.interpreter import TFLiteModel

            profile_npz(path, TFLiteModel(DATA / "tiny_int8.tflite").input)

        return [("profile --data", profile_reader), ("train/eval data", lambda: training_npz(path))]
    if kind == "task":
        from edgeq.tasks.detection import declared_detection
        from edgeq.tasks.table import load_task_spec

        return [
            ("--task FILE", lambda: load_task_spec(str(path), ["head0", "head1"])),
            ("--task FILE (detector)", lambda: declared_detection(str(path))),
        ]
    if kind == "plan":
        from edgeq.quantize.plan_file import LayerConfig, LayerPrecision

        return [("--plan / --layer-config", lambda: LayerConfig.load(path).resolve(PLAN_LAYERS, LayerPrecision()))]
    if kind == "report":

        def report():
            from edgeq.report.build import render
            from edgeq.report.sources import collect

            render(collect([path.parent]))

        return [("report", report)]
    if kind == "release":
        return [("pull", lambda: _pull(path))]
    if kind in ("coco", "tfrecord"):
        from edgeq.data.sources import load_dataset

        if kind == "coco":
            for i in range(3):
                (path.parent / f"{i}.png").write_bytes(_png(i))
        return [("detection data", lambda: load_dataset(f"{kind}:{path}", input_shape=(16, 16, 3)))]
    from edgeq.fleet.inventory import load_inventory

    return [("devices", lambda: load_inventory(path))]


def _pull(release: Path) -> None:
    """``edgeq pull`` of a store (a file:// URL) serving ``release`` beside the file it names;
    raises PartialWrite when the device is left with a part file or a half-applied model."""
    from edgeq.fleet.release import pull

    store = release.parent
    (store / "m.tflite").write_bytes(RELEASE_FILE)
    device = store / "device"
    models = device / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / "m.tflite").write_bytes(b"what the device ran before")
    try:
        pull(store.as_uri() + "/", device, None, timeout=5)
    finally:
        left = [p.name for p in models.iterdir() if ".part-" in p.name]
        live = (models / "m.tflite").read_bytes()
        if left or live not in (RELEASE_FILE, b"what the device ran before"):
            raise PartialWrite(f"left {left}, live {live[:40]!r}")


class PartialWrite(Exception):
    """A refused or failed pull left something half-written on the device."""


def worker(seed: int, start: int, end: int, kinds: tuple[str, ...]) -> None:
    """Run cases [start, end); print CASE i before each, TRACEBACK lines for failures, DONE at the end."""
    import logging
    import traceback

    logging.disable(logging.CRITICAL)
    from edgeq.errors import EdgeqError

    seeds = _seed_files(kinds)
    with tempfile.TemporaryDirectory(prefix="edgeq-fuzz-") as tmp:
        for i in range(start, end):
            rng = np.random.default_rng([seed, i])
            kind = kinds[i % len(kinds)]
            name, data = seeds[kind][int(rng.integers(0, len(seeds[kind])))]
            folder = Path(tmp) / f"case{i}"
            folder.mkdir()
            path = folder / (name if kind in ("report", "release", "coco") else f"case{i}{Path(name).suffix}")
            path.write_bytes(_mutated(kind, data, rng))
            print(f"CASE {i} {kind} {name}", flush=True)
            for target, run in _targets(kind, path):
                try:
                    run()
                    print(f"READ {i} {target}", flush=True)
                except EdgeqError as exc:
                    if "\n" in str(exc).strip():
                        print(f"MULTILINE {i} {target} {str(exc)[:200]!r}", flush=True)
                except PartialWrite as exc:
                    print(f"PARTIAL {i} {target} {exc}", flush=True)
                except Exception as exc:  # noqa: BLE001 - what the fuzzer is looking for
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    print(
                        f"TRACEBACK {i} {target} {type(exc).__name__}: {str(exc)[:160]!r} "
                        f"at {Path(where.filename).name}:{where.lineno}",
                        flush=True,
                    )
            shutil.rmtree(folder)
    print("DONE", flush=True)


def fuzz(cases: int, seed: int = 0, kinds: tuple[str, ...] = KINDS, per_worker: int = 500) -> dict:
    """Run ``cases`` cases in worker subprocesses; count crashes (signal deaths) and tracebacks."""
    started = time.perf_counter()
    crashes, tracebacks, multiline, partial, done, read = [], [], [], [], 0, 0
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    next_case = 0
    while next_case < cases:
        end = min(cases, next_case + per_worker)
        argv = [sys.executable, __file__, "--worker", str(next_case), str(end), "--seed", str(seed)]
        argv += ["--kinds", ",".join(kinds)]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
        last = None
        for line in proc.stdout.splitlines():
            if line.startswith("CASE "):
                last = int(line.split()[1])
                done = max(done, last + 1)
            elif line.startswith("TRACEBACK "):
                tracebacks.append(line)
            elif line.startswith("MULTILINE "):
                multiline.append(line)
            elif line.startswith("PARTIAL "):
                partial.append(line)
            elif line.startswith("READ "):
                read += 1
        if proc.returncode == 0 and proc.stdout.rstrip().endswith("DONE"):
            next_case = end
            continue
        if last is None:
            raise SystemExit(f"the fuzz worker failed before its first case: {proc.stderr[-2000:]}")
        crashes.append(f"case {last}: worker exit {proc.returncode} {proc.stderr.strip()[-300:]!r}")
        next_case = last + 1
    return {
        "cases": done,
        "seed": seed,
        "kinds": list(kinds),
        "crashes": crashes,
        "tracebacks": tracebacks,
        "multiline_errors": multiline,
        "partial_writes": partial,
        "reads_accepted": read,  # reader calls that took the mutated file (the rest refused it)
        "seconds": round(time.perf_counter() - started, 1),
    }


def run() -> str:
    """The BENCHMARKS.md section: 5,000 cases per kind of file (1,000 for the slower JSON and pull kinds)."""
    lines = [
        "## Fuzzing the readers of user files",
        "",
        "`python tools/fuzz.py --cases N --kinds K`: mutated copies of valid files (bit flips, truncations, 32-bit "
        "offset/length fields and float fields such as quantization scales set to edge values, op-code bytes, "
        "chunks duplicated or deleted; for JSON, half the cases change the parsed document instead: a value of "
        "another type or an edge value, a key deleted or renamed, a container emptied), each read by every reader "
        "a command reaches with it, in worker subprocesses. A refusal must be an edgeq error (one `error:` line); "
        "anything else is a traceback, a signal death a crash; a pull that leaves a part file or a half-applied "
        "model is a partial write. Seed 0.",
        "",
        "| files | readers | cases | crashes | tracebacks | multi-line errors | partial writes | reads that took the "
        "file | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    readers = {
        "tflite": "inspect, profile, eval's loader, convert's float .tflite reader",
        "npz": "profile --data, train/eval data",
        "inventory": "devices (TOML, Ansible YAML)",
        "npz-multi": "profile --data, train/eval data (x_/y_ arrays, gt_boxes/gt_classes)",
        "task": "--task FILE.json (output kinds, a detector's layout and anchors)",
        "plan": "--plan / --layer-config",
        "report": "report (eval, profile, manifest, run, history JSON)",
        "release": "pull (release.json from a store)",
        "coco": "coco: detection data (annotations beside 3 images)",
        "tfrecord": "tfrecord: detection data (TF Object Detection API layout)",
    }
    for kind in KINDS:
        r = fuzz(5000 if kind in ("tflite", "npz", "inventory") else 1000, seed=0, kinds=(kind,))
        lines.append(
            f"| {kind} | {readers[kind]} | {r['cases']} | {len(r['crashes'])} | {len(r['tracebacks'])} | "
            f"{len(r['multiline_errors'])} | {len(r['partial_writes'])} | {r['reads_accepted']} | {r['seconds']:.0f} |"
        )
        for line in (r["crashes"] + r["tracebacks"] + r["partial_writes"])[:5]:
            lines.append(f"\n    {line}")
    lines += [
        "",
        "Found by the kinds added on 2026-12-06 (before their fixes; seed 1, 400 cases of the JSON kinds, 300 of "
        "COCO and TFRecords), each fixed: a plan file that is not UTF-8 (25 tracebacks); `edgeq report` on a record "
        "edgeq did not write as it is (12: a `KeyError`, `TypeError` or Jinja2 error deep in a section; now the file "
        "is named in one line); COCO entries with a missing or mistyped field (97); TFRecords TensorFlow cannot read "
        "(166, its own error message not UTF-8 in 107 of them). And one refusal of valid data: a COCO set whose "
        "images hold at most one object, one of them none, was refused as 'labels must be class indices'. The "
        "TFRecord cases reach the reader's checks but few get past them (12 of 1,000): most mutations of an "
        "Example leave a box without its label, which is refused.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("START", "END"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if args.worker:
        worker(args.seed, args.worker[0], args.worker[1], kinds)
        return
    result = fuzz(args.cases, args.seed, kinds)
    text = json.dumps(result, indent=2)
    if args.json_path:
        Path(args.json_path).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
