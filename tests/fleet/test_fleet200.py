"""The fleet at 200 devices, over real SSH (EDGEQ_SLOW=1; about 10 minutes on 2 cores).

200 OpenSSH sshds on loopback ports, one per device (own host key, own work folder): 20
virtualenv devices, 180 site devices, one wheelhouse, no package index. What it shows:

1. a cold ``push`` and ``profile --on all``: all 200 ok;
2. a second ``push`` of the same files: nothing uploaded or installed, one remote command each;
3. 12 devices die (their sshd and sessions killed), then a retrained model rolls out with
   ``--batch 10% --max-fail 5%``: batches of 20, the budget is 10 failures; the 11th dead device
   falls in the 9th batch, so the rollout stops there: 11 failed and named, the last batch's 20
   skipped and untouched, 169 updated (exit 6);
4. the host stays bounded: each command runs under a soft limit of 128 open descriptors (a
   connection kept per device would need 200), and after every batch the process's open
   descriptors and threads are counted (edgeq.fleet.remote's ``wait`` wrapped, so at fixed
   points, not by sampling a clock): they do not grow from batch to batch, and no thread is
   left per device. Peak RSS by wait4.
"""

from __future__ import annotations

import json
import resource

import pytest

from .conftest import DIGITS, HOST_CPU, INT8, host_python, loopback_fleet
from .conftest import run_edgeq as _edgeq
from .conftest import summary_rows as _rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleet_env")]

N = 200
PARALLEL = 8
DEAD = tuple(f"dev{i:03d}" for i in range(5, N, 16))[:12]  # dev005, dev021, ... dev181
FD_LIMIT = 128

# edgeq's CLI with each batch's end counted: after concurrent.futures.wait returns in
# for_each_device, the open descriptors and live threads are appended to EDGEQ_BATCH_PROBE.
PROBED_MAIN = """
import json, os, sys, threading
import edgeq.fleet.remote as remote
_wait = remote.wait
def counted(futures, *args, **kwargs):
    done = _wait(futures, *args, **kwargs)
    with open(os.environ["EDGEQ_BATCH_PROBE"], "a") as out:
        out.write(json.dumps({"devices": len(futures), "fds": len(os.listdir("/proc/self/fd")) - 1,
                              "threads": threading.active_count()}) + "\\n")
    return done
remote.wait = counted
from edgeq.cli import main
sys.argv[0] = "edgeq"
main()
"""


def _limited():  # in the child before it runs edgeq: its own soft limit on descriptors
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))


def _probed(*args, cwd, log, probe):
    """edgeq ARGS with at most FD_LIMIT descriptors, its batches counted into ``probe``."""
    env = {"EDGEQ_BATCH_PROBE": str(probe)}
    result = _edgeq(*args, cwd=cwd, log=log, main=PROBED_MAIN, env=env, preexec_fn=_limited)
    batches = [json.loads(line) for line in probe.read_text().splitlines()] if probe.exists() else []
    return (*result, batches)


@pytest.fixture(scope="module")
def two_hundred(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet200")
    names = [f"dev{i:03d}" for i in range(N)]
    python = host_python()
    with loopback_fleet(root, names, lambda name: python, venvs=names[::10]) as (inventory, servers):
        yield root, inventory, servers


def test_two_hundred_devices_cold_push_profile_rollout_with_dead_devices(two_hundred, tmp_path):
    root, inventory, servers = two_hundred
    work = tmp_path / "host"
    work.mkdir()
    common = ["--inventory", inventory, "--parallel", str(PARALLEL)]
    numbers, batches = {}, {}

    # 1. cold start
    code, push_s, push_rss, out, batches["push"] = _probed(
        "push", INT8, DIGITS, "--to", "all", *common, cwd=work, log=root / "1.log", probe=root / "1.jsonl"
    )
    assert code == 0, out[-3000:]
    rows = _rows(out, "device")
    assert len(rows) == N and all(r[1] == "ok" for r in rows.values()), out[-3000:]
    code, profile_s, profile_rss, out, batches["profile"] = _probed(
        "profile", INT8, "--data", DIGITS, "--runs", "20", "--on", "all", *common,
        cwd=work, log=root / "2.log", probe=root / "2.jsonl",
    )  # fmt: skip
    assert code == 0, out[-3000:]
    for name in servers:
        report = json.loads((work / "results" / name / "tiny_int8.profile.json").read_text())
        assert report["model"]["scores"]["value"] > 0.9, name
    numbers |= {"cold_push_s": push_s, "profile_s": profile_s, "push_peak_rss_mib": push_rss}
    numbers |= {"profile_peak_rss_mib": profile_rss, "push_host_cpu_s": HOST_CPU["1"]}

    # 2. the same files again: one remote command per device, nothing sent
    code, again_s, again_rss, out, batches["again"] = _probed(
        "push", INT8, DIGITS, "--to", "all", *common, cwd=work, log=root / "3.log", probe=root / "3.jsonl"
    )
    assert code == 0, out[-3000:]
    for row in _rows(out, "device").values():
        assert row[1:4] == ["ok", "0", "2"] and row[5] == "unchanged", row
    numbers |= {"second_push_s": again_s, "second_push_peak_rss_mib": again_rss}

    # 3. 12 devices die; a retrained model rolls out 10% at a time with a 5% failure budget
    for name in DEAD:
        servers[name].kill()
    retrained = tmp_path / "new" / INT8.name
    retrained.parent.mkdir()
    retrained.write_bytes(INT8.read_bytes() + b"retrained")
    code, rollout_s, rollout_rss, out, batches["rollout"] = _probed(
        "push", retrained, "--to", "all", *common, "--batch", "10%", "--max-fail", "5%",
        cwd=work, log=root / "4.log", probe=root / "4.jsonl",
    )  # fmt: skip
    assert code == 6, out[-3000:]
    rows = _rows(out, "device")
    by_status = {}
    for name, row in rows.items():
        by_status.setdefault(row[1], []).append(name)
    assert sorted(by_status["failed"]) == sorted(DEAD[:11]), out[-3000:]
    assert sorted(by_status["skipped"]) == [f"dev{i:03d}" for i in range(180, 200)]
    assert len(by_status["ok"]) == 169
    new = retrained.read_bytes()
    for name in by_status["skipped"]:  # untouched: the retrained model never reached them
        assert (root / name / "home" / "edgeq" / "models" / INT8.name).read_bytes() != new, name
    for name in by_status["ok"]:
        assert (root / name / "home" / "edgeq" / "models" / INT8.name).read_bytes() == new, name
    numbers |= {"rollout_s": rollout_s, "rollout_peak_rss_mib": rollout_rss}

    # 4. bounded: every command ran under FD_LIMIT descriptors; per batch, nothing grows
    assert [b["devices"] for b in batches["rollout"]] == [N // 10] * 9, batches["rollout"]
    for step, counted in batches.items():
        assert counted, step
        for b in counted:
            assert b["threads"] <= PARALLEL + 1, (step, b)  # the pool's workers and the main thread: none per device
            assert b["fds"] < FD_LIMIT, (step, b)
    fds = [b["fds"] for b in batches["rollout"]]
    assert max(fds) - fds[0] <= 2, fds  # no descriptor kept per device after its batch
    assert max(push_rss, profile_rss, again_rss, rollout_rss) < 300, numbers
    numbers |= {f"{step}_fds": max(b["fds"] for b in c) for step, c in batches.items()}
    numbers |= {f"{step}_threads": max(b["threads"] for b in c) for step, c in batches.items()}
    print("\nFLEET200 " + json.dumps({k: round(v, 1) for k, v in numbers.items()}))
