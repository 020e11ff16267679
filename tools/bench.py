"""Benchmarks (not tests): measure ratios in one run and write BENCHMARKS.md.

python tools/bench.py                 # everything
python tools/bench.py --only host     # training / conversion ratios
python tools/bench.py --only device   # profile vs litert-benchmark, speedup, install size, RSS
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

MARK = "<!-- section: {} -->"
SECTIONS = (
    "host",
    "keras",
    "engines",
    "ptq",
    "mixed",
    "speed",
    "optimize",
    "tasks",
    "detection",
    "pretrained",
    "fleet",
    "precision",
    "analyze",
    "distribute",
    "fuzz",
    "report",
    "verdicts",
    "device",
)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _sections(text: str) -> dict[str, str]:
    found = {}
    for name in SECTIONS:
        start = text.find(MARK.format(name))
        if start < 0:
            continue
        end = text.find("<!-- section:", start + 1)
        found[name] = text[start : end if end >= 0 else len(text)].split("\n", 1)[1].rstrip() + "\n"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(SECTIONS))
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    out = Path(args.out)
    sections = _sections(out.read_text()) if out.exists() else {}
    for name in SECTIONS:  # each section is tools/bench_<name>.py's run()
        if args.only in (None, name):
            text = importlib.import_module(f"bench_{name}").run()
            if text is not None:  # None: it could not measure here, the last numbers stay
                sections[name] = text
    header = (
        "# Benchmarks\n\n"
        "Written by `python tools/bench.py` (`make bench`); numbers are from the last run on the machine "
        "below, as ratios measured in one run. Rerun to refresh.\n\n"
        f"- updated: {datetime.date.today().isoformat()}; CPU: {_cpu()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}\n"
    )
    body = "".join(f"\n{MARK.format(name)}\n{sections[name]}" for name in SECTIONS if name in sections)
    from edgeq.artifacts import write_bytes_atomic

    write_bytes_atomic(out, (header + body).encode())
    print(out.read_text())


if __name__ == "__main__":
    main()
