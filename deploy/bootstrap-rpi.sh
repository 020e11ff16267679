#!/usr/bin/env bash
# Prepare a Raspberry Pi (Raspberry Pi OS 64-bit / Debian arm64) for edgeq. Run ON the Pi:
#
#   curl -fsSL .../bootstrap-rpi.sh | bash          # or: scp it over, then bash bootstrap-rpi.sh
#   bash bootstrap-rpi.sh [VENV] [WHEEL_OR_DIR]
#
# VENV         virtualenv to create (default ~/edgeq/venv); put the same path in devices.toml
# WHEEL_OR_DIR optional: an edgeq wheel, or a folder of wheels (edgeq + numpy + click +
#              ai-edge-litert for aarch64) for a Pi without internet; else pip uses PyPI.
#
# After this, `edgeq push` from the host finds the venv and only updates edgeq in it.
# Also add the host's public key to ~/.ssh/authorized_keys on the Pi (ssh-copy-id), and
# record the Pi's host key on the host (ssh once, or ssh-keyscan >> ~/.ssh/known_hosts).
set -euo pipefail
VENV=${1:-$HOME/edgeq/venv}
SOURCE=${2:-}

arch=$(uname -m)
if [ "$arch" != aarch64 ]; then
  echo "bootstrap-rpi: this is $arch; ai-edge-litert has wheels for aarch64 (64-bit Raspberry Pi OS) only." >&2
  echo "  On a 32-bit (armv7l) OS, install the 64-bit Raspberry Pi OS, or use tflite-runtime with numpy<2." >&2
  exit 1
fi

if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  echo "bootstrap-rpi: installing python3-venv (needs sudo)" >&2
  sudo apt-get update -qq
  sudo apt-get install -y -qq python3-venv python3-pip
fi

mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

if [ -z "$SOURCE" ]; then
  "${PIP[@]}" --upgrade "edgeq[litert]"
elif [ -d "$SOURCE" ]; then
  "${PIP[@]}" --no-index --find-links "$SOURCE" "edgeq[litert]"
else
  "${PIP[@]}" "$SOURCE[litert]"
fi

# Performance settings that make latency numbers comparable (optional, needs sudo):
if [ -w /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor ]; then
  echo performance | tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor >/dev/null || true
else
  echo "bootstrap-rpi: tip: 'echo performance | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor'" \
    "keeps the clock fixed while profiling" >&2
fi

"$VENV/bin/python" -m edgeq --version
"$VENV/bin/python" - <<'PY'
import platform, numpy
from ai_edge_litert.interpreter import Interpreter  # noqa: F401
print(f"edgeq ready on {platform.machine()}, numpy {numpy.__version__}")
PY
echo "devices.toml:  python = \"/usr/bin/python3\"  venv = \"$VENV\"" >&2
