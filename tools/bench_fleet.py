"""The fleet at 50 devices over SSH: tests/fleet/test_fleet50.py's numbers (EDGEQ_SLOW=1).

The test builds the fleet (50 sshd on the loopback, 25 venv and 25 site devices, one
wheelhouse, no package index), checks its behaviour and prints one FLEET50 line of
numbers; this runs it and writes them as the BENCHMARKS.md section. Needs root and
sshd (deploy/test-env.sh), as the fleet tests do; without them it keeps the section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure() -> dict | None:
    env = {**os.environ, "EDGEQ_SLOW": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/fleet/test_fleet50.py"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FLEET50 ")]
    if proc.returncode != 0 or not lines:
        print(f"fleet: the test did not pass, section kept:\n{proc.stdout[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1].split(" ", 1)[1])


def section(n: dict) -> str:
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
        "## Fleet: 50 devices over SSH",
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
        "device whose model is there 2 (one Python start-up); a cold push that installs edgeq 14.",
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
    ]
    return "\n".join(lines) + "\n"


def run() -> str | None:
    numbers = measure()
    return section(numbers) if numbers else None
