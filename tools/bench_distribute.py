"""Training past one machine, for BENCHMARKS.md: memory against data size, 1 vs 2 workers,
and the tf.data input pipeline against the training step.

- Peak RSS of `edgeq train` (one FP32 epoch of a small CNN) on an `images:DIR` of 2,000 and
  of 20,000 generated 64x64 PNGs: streamed through tf.data, it should not grow with the data.
- Samples/s of the same digits-cnn schedule on 1 worker and on 2 worker processes
  (MultiWorkerMirroredStrategy over 127.0.0.1), from the epochs' own timings.
- The input pipeline alone (decode + shuffle + batch of the 20,000-image folder) in
  samples/s, against the training step's samples/s on the same data.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
SIZE = 64


def _images(root: Path, n: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    classes = 10
    base = rng.integers(0, 256, (classes, 8, 8, 3), dtype=np.uint8)
    for i in range(n):
        label = i % classes
        folder = root / f"c{label}"
        folder.mkdir(parents=True, exist_ok=True)
        img = np.kron(base[label], np.ones((SIZE // 8, SIZE // 8, 1), np.uint8))
        noise = rng.integers(0, 64, img.shape, dtype=np.uint8)
        Image.fromarray(img // 2 + noise).save(folder / f"{i:05d}.png")
    return root


def _model(path: Path) -> Path:
    from edgeq.models.compat import keras

    L = keras.layers
    inputs = keras.Input((SIZE, SIZE, 3))
    h = L.Conv2D(16, 3, strides=2, activation="relu")(inputs)
    h = L.Conv2D(32, 3, strides=2, activation="relu")(h)
    h = L.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, L.Dense(10)(h))
    model.save(str(path))
    return path


def _train(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeq", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return proc, start


def _peak_rss_mib(args: list[str]) -> tuple[float, float]:
    """Peak RSS of one `edgeq train` child (ru_maxrss of a fresh waiting process)."""
    code = (
        "import resource, subprocess, sys; "
        f"r = subprocess.run([sys.executable, '-m', 'edgeq', 'train', *{args!r}], capture_output=True, text=True); "
        "assert r.returncode == 0, r.stderr; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024, time.perf_counter() - start


def _epoch_rate(run_dir: Path, samples: int) -> float:
    """Training samples per second over the FP32 epochs after the first (which traces)."""
    history = json.loads((run_dir / "history.json").read_text())["stages"][0]["epochs"]
    seconds = [e["seconds"] for e in history[1:]]
    return samples * len(seconds) / sum(seconds)


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _workers(tmp: Path, schedule: list[str]) -> dict:
    from edgeq.data.sources import load_dataset

    train_n = load_dataset("digits").count("train")
    rates = {}
    one = tmp / "one"
    proc, _ = _train(["digits-cnn", "--out", str(one), *schedule])
    assert proc.wait() == 0, proc.stderr.read()
    rates[1] = _epoch_rate(one, train_n)
    two = tmp / "two"
    hosts = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    procs = [
        _train(
            ["digits-cnn", "--out", str(two), *schedule, "--strategy", "multi-worker"],
            {"TF_CONFIG": json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})},
        )[0]
        for i in range(2)
    ]
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    rates[2] = _epoch_rate(two, train_n)
    return rates


def _pipeline_rate(folder: Path, batch: int = 64) -> tuple[float, int]:
    from edgeq.data.sources import load_dataset
    from edgeq.train.pipeline import split_dataset

    data = load_dataset(f"images:{folder}", input_shape=(SIZE, SIZE, 3))
    stream = split_dataset(data, "train", batch, training=True, seed=0)
    start, n = time.perf_counter(), 0
    for x, _ in stream:
        n += int(x.shape[0])
    return n / (time.perf_counter() - start), data.count("train")


def run() -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = _model(tmp / "cnn64.keras")
        peaks = {}
        train_rate = None
        for n in (2000, 20000):
            folder = _images(tmp / f"img{n}", n)
            out = tmp / f"run{n}"
            args = [str(model), "--data", f"images:{folder}", "--out", str(out), "--epochs", "1", "--qat-epochs", "0"]
            peaks[n] = _peak_rss_mib(args)
            if n == 20000:
                train_n = json.loads((out / "run.json").read_text())["data"]["train"]
                history = json.loads((out / "history.json").read_text())["stages"][0]["epochs"]
                train_rate = train_n / history[0]["seconds"]
                pipe_rate, _ = _pipeline_rate(folder)
        rows.append("| data | peak RSS of `edgeq train` | wall (listing, 1 epoch, eval, saves) |")
        rows.append("|---|---|---|")
        for n, (mib, wall) in peaks.items():
            rows.append(f"| `images:DIR`, {n:,} PNGs 64x64 | {mib:.0f} MiB | {wall:.0f} s |")
        growth = peaks[20000][0] / peaks[2000][0] - 1
        rates = _workers(tmp, ["--epochs", "4", "--qat-epochs", "0", "--batch-size", "32"])
    return (
        "## Training past one machine: streamed data and tf.distribute\n\n"
        "`python tools/bench.py --only distribute`. Peak RSS is `ru_maxrss` of the `edgeq train` process "
        "(one FP32 epoch of a 2-conv CNN, every image decoded by tf.data as it is needed).\n\n"
        + "\n".join(rows)
        + f"\n\n- 10x the images: peak RSS {growth:+.0%} (target: under 20%).\n"
        f"- Input pipeline alone (list, shuffle, decode, batch 64): {pipe_rate:,.0f} samples/s; the training "
        f"epoch on the same 20,000 images: {train_rate:,.0f} samples/s, so the input is "
        f"{pipe_rate / train_rate:.1f}x the step's rate"
        f"{' (not the bottleneck)' if pipe_rate > train_rate else ' (THE BOTTLENECK)'}.\n"
        f"- digits-cnn, global batch 32, 4 FP32 epochs: 1 worker {rates[1]:,.0f} samples/s, 2 worker processes "
        f"(MultiWorkerMirroredStrategy on 127.0.0.1) {rates[2]:,.0f} samples/s ({rates[2] / rates[1]:.2f}x). "
        f"This machine has {os.cpu_count()} cores, so the two workers share them and all-reduce every step over "
        "gRPC on top: this measures the overhead of the distribution, not scaling, which needs a device per "
        "worker (GPUs, or machines). The tests use 2 workers here to show the same model comes out.\n"
    )


if __name__ == "__main__":
    print(run())
