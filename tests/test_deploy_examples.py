"""deploy/distributed/: the examples' shell logic runs, and the `edgeq train` options it ends with
are ones edgeq's own parser accepts (a renamed option would fail here, not on a user's cluster)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from edgeq.train.cli import train
from edgeq.train.distribute import cluster_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "distributed"


def _accepted(args: list[str]) -> dict:
    """edgeq train's click parser on these arguments (no training): the parsed options."""
    assert args[0] == "train"
    with train.make_context("train", args[1:]) as ctx:
        return ctx.params


def _args_of(script: str, env: dict, tmp_path: Path) -> list[str]:
    """What the script passes to edgeq: a stand-in `edgeq` on PATH prints its arguments, one per line."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "edgeq").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (bindir / "edgeq").chmod(0o755)
    out = subprocess.run(
        ["sh", "-c", script, "example"] + env.pop("_argv", []),
        env={"PATH": f"{bindir}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def test_kubernetes_job_gives_each_pod_a_tf_config_edgeq_accepts(tmp_path, monkeypatch):
    service, job = yaml.safe_load_all((DEPLOY / "k8s-workers.yaml").read_text())
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    workers = int(next(e["value"] for e in container["env"] if e["name"] == "WORKERS"))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == workers
    assert spec["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    script = container["args"][0].replace('[ -f /shared/runs/model/checkpoint/state.json ] && RESUME="--resume"', "")
    script = script.replace("exec edgeq", 'printf "%s\\n" "$TF_CONFIG"; exec edgeq')
    for index in range(workers):
        lines = _args_of(script, {"WORKERS": str(workers), "JOB_COMPLETION_INDEX": str(index)}, tmp_path)
        config = json.loads(lines[0])
        monkeypatch.setenv("TF_CONFIG", lines[0])
        assert cluster_config(None, None) == config
        assert config["task"]["index"] == index
        assert config["cluster"]["worker"] == [f"edgeq-train-{i}.edgeq-train:2222" for i in range(workers)]
        params = _accepted(lines[1:])
        assert params["strategy"] == "multi-worker" and params["data"].startswith("tfrecord:")


def test_multi_gpu_script_resumes_a_crashed_run(tmp_path):
    script = (DEPLOY / "multi-gpu.sh").read_text()
    out = tmp_path / "run"
    fresh = _accepted(_args_of(script, {"_argv": ["m.keras", "/data", str(out)]}, tmp_path))
    assert fresh["strategy"] == "mirrored" and not fresh["resume"] and fresh["augment"] == "flip,crop"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text("{}")
    again = _accepted(_args_of(script, {"_argv": ["m.keras", "/data", str(out)]}, tmp_path))
    assert again["resume"]
