"""Training past one device: TensorFlow's own tf.distribute, nothing home-made.

``default``       one process, TensorFlow's default strategy (what edgeq always did)
``mirrored``      MirroredStrategy: every local GPU, or with none, ``--replicas N`` logical
                  CPU devices (how the suite checks it on a laptop)
``multi-worker``  MultiWorkerMirroredStrategy: one process per worker, cluster from
                  ``TF_CONFIG`` or ``--workers host:port,... --worker-index I``

TF-MOT's activation ranges need a fix: each replica would update them from its own share
of the global batch, so replicas end with other ranges than a 1-replica run (and the input
range differs between replicas: TF-MOT #1068). ``edgeq.shims.tfmot`` makes every replica
update them from the global batch's min/max; run.json says so. Weight ranges come from the
mirrored weights and agree anyway. ``tests/test_distribute.py`` compares the ranges across
replicas and workers.

A strategy must be set up before TensorFlow's runtime starts (logical devices and
collective ops cannot change after), so ``edgeq train --strategy`` sets
``EDGEQ_DEFER_RUNTIME`` before it imports edgeq.models.compat; ``setup`` then starts it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from edgeq.errors import UsageError

STRATEGIES = ("default", "mirrored", "multi-worker")


@dataclass(frozen=True)
class Distribution:
    name: str
    strategy: Any
    replicas: int  # replicas in sync: the global batch is split this many ways
    workers: int
    worker_index: int
    chief: bool  # the one process that writes checkpoints' state, run.json and the models

    def describe(self) -> dict:
        return {
            "strategy": self.name,
            "replicas": self.replicas,
            "workers": self.workers,
            "cross_replica_ranges": _ranges_fix() if self.replicas > 1 else None,
        }


def _ranges_fix() -> str:
    from edgeq.shims.tfmot import DESCRIPTION

    return DESCRIPTION


def cluster_config(workers: str | None, worker_index: int | None) -> dict:
    """The TF_CONFIG of this worker: built from ``--workers``/``--worker-index``, else read from the environment."""
    if workers:
        hosts = [h.strip() for h in workers.split(",") if h.strip()]
        bad = [h for h in hosts if h.rpartition(":")[2] == "" or not h.rpartition(":")[2].isdigit()]
        if not hosts or bad:
            raise UsageError(f"--workers {workers!r}: write host:port,host:port (bad: {', '.join(bad) or 'empty'})")
        if worker_index is None or not 0 <= worker_index < len(hosts):
            raise UsageError(
                f"--workers names {len(hosts)} workers: give this one's --worker-index, 0 to {len(hosts) - 1}"
            )
        return {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": int(worker_index)}}
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise UsageError(
            "--strategy multi-worker needs the cluster: set TF_CONFIG in each worker's environment, "
            "or give --workers host:port,... and --worker-index I"
        )
    try:
        config = json.loads(raw)
        cluster, task = config["cluster"], config["task"]
        members = cluster[task["type"]]
        index = int(task["index"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f'TF_CONFIG is not a cluster spec ({exc!r}): write {{"cluster": {{"worker": ["host:port", ...]}}, '
            '"task": {"type": "worker", "index": 0}}'
        ) from exc
    if not 0 <= index < len(members):
        raise UsageError(f"TF_CONFIG: task index {index} but the cluster has {len(members)} {task['type']}(s)")
    if worker_index is not None and worker_index != index:
        raise UsageError(f"--worker-index {worker_index} contradicts TF_CONFIG's task index {index}: give one")
    return config


def _is_chief(config: dict) -> bool:
    task = config["task"]
    if "chief" in config["cluster"]:
        return task["type"] == "chief"
    return task["type"] == "worker" and int(task["index"]) == 0


def setup(name: str = "default", replicas: int | None = None, workers: str | None = None, worker_index=None):
    """The strategy for this process, with TensorFlow's runtime started after it."""
    if name not in STRATEGIES:
        raise UsageError(f"--strategy {name!r}: choose {', '.join(STRATEGIES)}")
    if name != "multi-worker" and (workers or worker_index is not None):
        raise UsageError("--workers and --worker-index are for --strategy multi-worker")
    if replicas is not None and name != "mirrored":
        raise UsageError("--replicas is for --strategy mirrored (multi-worker uses one device per worker)")
    config = cluster_config(workers, worker_index) if name == "multi-worker" else None
    if config is not None:
        os.environ["TF_CONFIG"] = json.dumps(config)
    from edgeq.models import compat

    tf = compat.tf
    try:
        if name == "default":
            strategy = tf.distribute.get_strategy()
        elif name == "mirrored":
            gpus = tf.config.list_physical_devices("GPU")
            if gpus:
                devices = [f"/gpu:{i}" for i in range(len(gpus))][: replicas or len(gpus)]
            else:
                cpus = tf.config.list_physical_devices("CPU")
                count = replicas or 1
                if count > 1:
                    tf.config.set_logical_device_configuration(
                        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
                    )
                devices = [f"/cpu:{i}" for i in range(count)]
            strategy = tf.distribute.MirroredStrategy(devices)
        else:
            options = tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING
            )
            strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except RuntimeError as exc:  # devices or collectives after the runtime started
        raise UsageError(
            f"--strategy {name} must be set up before TensorFlow starts in this process ({exc}); "
            "run edgeq train --strategy from the command line, in its own process"
        ) from exc
    compat.start_runtime()
    if config is None:
        return Distribution(name, strategy, int(strategy.num_replicas_in_sync), 1, 0, True)
    task = config["task"]
    count = sum(len(v) for v in config["cluster"].values())
    return Distribution(
        name, strategy, int(strategy.num_replicas_in_sync), count, int(task["index"]), _is_chief(config)
    )
