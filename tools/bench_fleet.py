"""The fleet at 50 and 200 devices over SSH: tests/fleet/test_fleet50.py's and test_fleet200.py's
numbers (EDGEQ_SLOW=1).

Each test builds its fleet (an sshd per device on the loopback, venv and site devices, one
wheelhouse, no package index), checks its behaviour and prints one FLEET50 / FLEET200 line
of numbers; this runs them and writes them as the BENCHMARKS.md section. Needs root and
sshd (deploy/test-env.sh), as the fleet tests do; without them it keeps the section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(test: str = "tests/fleet/test_fleet50.py", tag: str = "FLEET50") -> dict | None:
    env = {**os.environ, "EDGEQ_SLOW": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(f"{tag} ")]
    if proc.returncode != 0 or not lines:
        print(f"fleet: {test} did not pass, section kept:\n{proc.stdout[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1].split(" ", 1)[1])


def section_200(n: dict) -> list[str]:
    rows = [
        ("`push` from a cold start (all 200 bootstrapped)", n["cold_push_s"], n["push_peak_rss_mib"], n["push_fds"],
         n["push_threads"]),
        ("`profile --on all` (20 runs each, accuracy on the test data)", n["profile_s"], n["profile_peak_rss_mib"],
         n["profile_fds"], n["profile_threads"]),
        ("second `push` of the same files (one remote command per device)", n["second_push_s"],
         n["second_push_peak_rss_mib"], n["again_fds"], n["again_threads"]),
        ("12 devices killed, then a retrained model with `--batch 10% --max-fail 5%`", n["rollout_s"],
         n["rollout_peak_rss_mib"], n["rollout_fds"], n["rollout_threads"]),
    ]  # fmt: skip
    return [
        "",
        "### 200 devices",
        "",
        "`EDGEQ_SLOW=1 pytest -s tests/fleet/test_fleet200.py`: 200 devices, each an sshd of its own on a loopback "
        "port, 20 virtualenv devices and 180 site devices, one wheelhouse, no package index, `--parallel 8`. Each "
        "host command runs with a soft limit of 128 open descriptors (`RLIMIT_NOFILE`), and after every batch the "
        "test counts the host process's open descriptors and live threads (it wraps `concurrent.futures.wait` in "
        "`edgeq.fleet.remote`: counted at fixed points, not sampled on a timer).",
        "",
        "| step | wall | host peak RSS | open descriptors after a batch (most) | threads after a batch (most) |",
        "|---|---|---|---|---|",
        *[f"| {what} | {wall:.0f} s | {rss:.0f} MiB | {fds} | {threads} |" for what, wall, rss, fds, threads in rows],
        "",
        "- The rollout stopped where its budget says: batches of 20, a budget of 10 failures, the 11th dead device "
        "in the 9th batch; 11 failed and named, the last batch's 20 skipped and untouched, 169 updated (exit 6).",
        "- Bounded host: the same descriptors and threads (the pool's 8 workers and the main thread) after every "
        "batch, at 200 devices as after 20: none stays per device.",
    ]


def section(n: dict, n200: dict | None = None) -> str:
    met = {True: "met", False: "not met"}
    rss = max(n["push_peak_rss_mib"], n["profile_peak_rss_mib"])
    rows = [
        ("`push` from a cold start (25 venvs created, 25 sites unpacked, the dependency wheels uploaded once)",
         n["cold_push_s"], n["push_host_cpu_s"], f"{n['push_peak_rss_mib']:.0f} MiB"),
        ("`profile --on all` (20 runs each, accuracy on the test data)",
         n["profile_s"], n["profile_host_cpu_s"], f"{n['profile_peak_rss_mib']:.0f} MiB"),
        ("second `push` of the same files (nothing uploaded, nothing installed)",
         n["second_push_s"], n["second_push_host_cpu_s"], ""),
        ("rollout to the warm fleet: `push` of a retrained model + `profile --on all`",
         n["rollout_s"], None, ""),
    ]  # fmt: skip
    lines = [
        "## Fleet: 50 and 200 devices over SSH",
        "",
        "`EDGEQ_SLOW=1 pytest -s tests/fleet/test_fleet50.py` (`python tools/bench.py --only fleet`): 50 devices "
        "on this machine, each an OpenSSH sshd of its own on a loopback port (own host key, own work folder), "
        "25 virtualenv devices and 25 site devices (edgeq from unpacked wheels), none able to reach a package "
        "index (the sshd sets `PIP_INDEX_URL` to a dead address), all naming one `wheelhouse`; `--parallel 8`. "
        "The sshd also sets `SHLVL=1`, so the devices' bash does not read this host's root `~/.bashrc` "
        "(its `pyenv init` cost 0.17 s per remote command here: a cost of the host's account, not of a device).",
        "",
        "| step | wall | host process CPU | host peak RSS |",
        "|---|---|---|---|",
        *[
            f"| {what} | {wall:.0f} s | {'-' if cpu is None else f'{cpu:.0f} s'} | {peak} |"
            for what, wall, cpu, peak in rows
        ],
        "",
        f"- Cold push + profile: {n['cold_total_s']:.0f} s; target < 180 s on 2 cores: {met[n['cold_total_s'] < 180]}.",
        f"- Second push: {n['second_push_s']:.0f} s; target < 30 s: {met[n['second_push_s'] < 30]}.",
        f"- Rollout to the warm fleet: push {n['update_push_s']:.0f} s + profile {n['warm_profile_s']:.0f} s = "
        f"{n['rollout_s']:.0f} s; target < 100 s: {met[n['rollout_s'] < 100]}.",
        "- Remote commands per device (`tests/fleet/test_local_fleet.py`, counted by the transport): a push that "
        "changes nothing 1 (one `sh` reads health, edgeq build, sha256s and the live record); a push of a new model "
        "2 (that read, the upload by SFTP, one command that checks, keeps, renames and records); `profile --on` a "
        "device whose model is there 2 (one Python start-up); a cold push that installs edgeq on a site device 4 "
        "(that read; the probe, which also prepares the folders and lists the wheelhouse; the uploads by SFTP; "
        "one Python start-up that checks every sha256, unpacks, switches and records; the models' commit); "
        "a cold push to a new virtualenv device 5 (`tests/fleet/test_fleet.py`, over sshd: the read, the probe, "
        "the venv made, one pip command that first checks every wheel's sha256 and writes the marker, the commit).",
        f"- Host peak RSS: {rss:.0f} MiB; target < 150 MiB: {met[rss < 150]}.",
        f"- One device's cold push at 8 in parallel: {n['venv_device_push_mean_s']:.0f} s for a venv device "
        "(create the venv without ensurepip, then pip, run from its wheel in the wheelhouse, installs ten wheels), "
        f"{n['site_device_push_mean_s']:.0f} s "
        "for a site device (unpack the wheels its Python lacks). Devices and host share the 2 cores; the "
        "host's own CPU time is in the table.",
        "",
        "The same test checks behaviour: `devices check` finds the host's edgeq, numpy and LiteRT on all 50; "
        "`--batch 10 --max-fail 10%` with 8 unreachable devices in the first batch stops the rollout (exit 6, "
        "the 40 others listed as skipped, the file never reached them); 5 devices killed while they profile "
        "(their sshd and every session) fail and are named, the other 45 finish (exit 5).",
        *(section_200(n200) if n200 else []),
    ]
    return "\n".join(lines) + "\n"


def run() -> str | None:
    numbers = measure()
    if not numbers:
        return None
    return section(numbers, measure("tests/fleet/test_fleet200.py", "FLEET200"))
