"""The fleet at 50 and 200 devices over SSH: tests/fleet/test_fleet50.py's and test_fleet200.py's
numbers (EDGEQ_SLOW=1); and 1,000 devices pulling a signed release from a static HTTP server.

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


def pull_bench(devices: int = 1000, threads: int = 32, stagger_s: float = 20.0) -> dict:
    """``devices`` work folders pull one signed release from a local static HTTP server (the standard
    library's), started over ``stagger_s`` seconds as a timer's RandomizedDelaySec spreads them, in
    ``threads`` threads; then all pull again. Counts the server's requests, bytes and peak open
    connections, and checks that an up-to-date device writes nothing."""
    import http.server
    import random
    import tempfile
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial

    from edgeq.fleet.release import make_release, pull

    with tempfile.TemporaryDirectory(prefix="edgeq-pull-bench-") as tmp:
        tmp = Path(tmp)
        key = tmp / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        allowed = tmp / "allowed_signers"
        allowed.write_text(f"edgeq-release {(tmp / 'key.pub').read_text().strip()}\n")
        model = ROOT / "tests" / "data" / "tiny_int8.tflite"
        store = tmp / "store"
        make_release([model, ROOT / "tests" / "data" / "tiny_fp32.tflite"], store, "1", key)
        stats = {"requests": 0, "bytes": 0, "open": 0, "peak": 0}
        lock = threading.Lock()

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def handle(self):
                with lock:
                    stats["open"] += 1
                    stats["peak"] = max(stats["peak"], stats["open"])
                try:
                    super().handle()
                finally:
                    with lock:
                        stats["open"] -= 1

            def copyfile(self, source, outputfile):
                data = source.read()
                outputfile.write(data)
                with lock:
                    stats["requests"] += 1
                    stats["bytes"] += len(data)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(store)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        rng = random.Random(0)
        starts = sorted(rng.uniform(0, stagger_s) for _ in range(devices))

        def one_round() -> tuple[float, list[float]]:
            t0 = time.perf_counter()

            def device(i: int) -> float:
                delay = starts[i] - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)  # the timer's spread, not a wait for anything
                began = time.perf_counter()
                pull(url, tmp / "devices" / str(i), allowed)
                return time.perf_counter() - began

            with ThreadPoolExecutor(threads) as pool:
                each = list(pool.map(device, range(devices)))
            return time.perf_counter() - t0, each

        def snapshot() -> dict:
            root = tmp / "devices"
            return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}

        cold_wall, cold_each = one_round()
        cold = dict(stats)
        before = snapshot()
        stats.update(requests=0, bytes=0, peak=0)
        warm_wall, warm_each = one_round()
        warm = dict(stats)
        writes = sum(1 for path, mtime in snapshot().items() if before.get(path) != mtime)
        server.shutdown()
        server.server_close()
    files_bytes = sum(p.stat().st_size for p in (model, ROOT / "tests" / "data" / "tiny_fp32.tflite"))
    return {
        "devices": devices, "threads": threads, "stagger_s": stagger_s,
        "cold_wall_s": round(cold_wall, 1), "warm_wall_s": round(warm_wall, 1),
        "cold_requests_per_device": cold["requests"] / devices, "warm_requests_per_device": warm["requests"] / devices,
        "cold_bytes_per_device": round(cold["bytes"] / devices),
        "warm_bytes_per_device": round(warm["bytes"] / devices),
        "release_bytes": files_bytes, "cold_peak_connections": cold["peak"], "warm_peak_connections": warm["peak"],
        "cold_pull_median_ms": round(1000 * sorted(cold_each)[devices // 2], 1),
        "warm_pull_median_ms": round(1000 * sorted(warm_each)[devices // 2], 1),
        "warm_writes": writes,
    }  # fmt: skip


def pull_section(n: dict) -> str:
    return "\n".join([
        f"### {n['devices']:,} devices pulling a release",
        "",
        f"`python tools/bench_fleet.py --pull {n['devices']}`: {n['devices']:,} device work folders on this machine "
        f"pull one signed release (two .tflite files, {n['release_bytes']:,} bytes) from the standard library's "
        f"threading HTTP server, each started at a random moment in {n['stagger_s']:.0f} s as a timer's "
        f"`RandomizedDelaySec` spreads them, {n['threads']} at a time; then all pull again. Each pull is the real "
        "`edgeq pull` (the signature checked by `ssh-keygen -Y verify`, every file by sha256).",
        "",
        "| round | wall | requests per device | bytes per device | server peak connections | one pull (median) |",
        "|---|---|---|---|---|---|",
        f"| cold | {n['cold_wall_s']:.0f} s | {n['cold_requests_per_device']:.2f} | {n['cold_bytes_per_device']:,} | "
        f"{n['cold_peak_connections']} | {n['cold_pull_median_ms']:.0f} ms |",
        f"| up to date | {n['warm_wall_s']:.0f} s | {n['warm_requests_per_device']:.2f} | "
        f"{n['warm_bytes_per_device']:,} | {n['warm_peak_connections']} | {n['warm_pull_median_ms']:.0f} ms |",
        "",
        f"- An up-to-date device costs exactly release.json and its signature, and writes nothing: "
        f"{n['warm_writes']} files of {n['devices']:,} devices changed in the second round.",
    ]) + "\n"  # fmt: skip


def run() -> str | None:
    pulled = pull_section(pull_bench())
    numbers = measure()
    if not numbers:
        return pulled
    return section(numbers, measure("tests/fleet/test_fleet200.py", "FLEET200")) + "\n" + pulled


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The fleet benchmarks (BENCHMARKS.md's fleet section).")
    parser.add_argument("--pull", type=int, metavar="DEVICES", help="only the pull bench, with this many devices")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.pull:
        result = pull_bench(args.pull)
        print(json.dumps(result, indent=2))
        print(pull_section(result))
    else:
        print(run())
