#!/usr/bin/env bash
# Build an emulated Raspberry Pi 4 on an x86-64 Linux host: an arm64 Debian bookworm
# userland (python3.11) run under qemu-user, with the aarch64 numpy / click / LiteRT
# wheels, and a wrapper script that is the device's "python".
#
#   deploy/make-emulated-pi4.sh [DIR]        (default: .cache/pi4; idempotent)
#
# Needs: qemu-user-static (apt-get install -y qemu-user-static), apt-get, dpkg, and a
# host python3 with pip (for the aarch64 wheels). No binfmt, no root for the rootfs
# itself, nothing in the system's apt state is touched (a private APT_CONFIG).
#
# Result:  DIR/rootfs/                  the arm64 userland
#          DIR/bin/python               wrapper: QEMU_CPU=cortex-a72 qemu-aarch64-static -L rootfs python3.11
#
# Two traps this script avoids (see shared/ENVIRONMENT.md):
#  1. LiteRT's XNNPACK parses /proc/cpuinfo and crashes on the host's x86 one: qemu -L
#     redirects the open to rootfs/proc/cpuinfo, so we write a Pi-4-like one.
#  2. qemu's default CPU model ("max") silently gives wrong int8 results: the wrapper
#     always sets QEMU_CPU to a real core (cortex-a72 = Pi 4; cortex-a76 for a Pi 5).
set -euo pipefail

DIR=${1:-.cache/pi4}
CPU=${EDGEQ_QEMU_CPU:-cortex-a72}
PY_HOST=${PYTHON:-python3}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
ROOTFS=$DIR/rootfs
STAMP=$DIR/.complete-v1

QEMU=$(command -v qemu-aarch64-static || true)
if [ -z "$QEMU" ]; then
  echo "make-emulated-pi4: qemu-aarch64-static is missing: apt-get install -y qemu-user-static" >&2
  exit 1
fi

if [ ! -f "$STAMP" ]; then
  rm -rf "$ROOTFS" "$DIR/apt"
  mkdir -p "$DIR/apt/lists/partial" "$DIR/apt/cache/archives/partial" "$DIR/apt/etc/preferences.d" \
    "$DIR/apt/etc/apt.conf.d" "$ROOTFS"
  : >"$DIR/apt/status"
  echo "deb [arch=arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" \
    >"$DIR/apt/sources.list"
  cat >"$DIR/apt/apt.conf" <<CONF
APT::Architecture "arm64";
APT::Architectures { "arm64"; };
Dir::State "$DIR/apt";
Dir::State::Lists "$DIR/apt/lists";
Dir::State::status "$DIR/apt/status";
Dir::Cache "$DIR/apt/cache";
Dir::Etc::SourceList "$DIR/apt/sources.list";
Dir::Etc::SourceParts "/nonexistent";
Dir::Etc::Preferences "$DIR/apt/etc/preferences";
Dir::Etc::PreferencesParts "$DIR/apt/etc/preferences.d";
Dir::Etc::Parts "$DIR/apt/etc/apt.conf.d";
APT::Install-Recommends "false";
CONF
  export APT_CONFIG=$DIR/apt/apt.conf
  apt-get -q update
  apt-get -q -y install --download-only python3.11 libstdc++6 libgcc-s1
  for deb in "$DIR"/apt/cache/archives/*.deb; do dpkg -x "$deb" "$ROOTFS"; done
  rm -rf "$DIR/apt/cache/archives"/*.deb

  # Pi-4-like /proc/cpuinfo (trap 1): four Cortex-A72 cores.
  mkdir -p "$ROOTFS/proc"
  : >"$ROOTFS/proc/cpuinfo"
  for i in 0 1 2 3; do
    cat >>"$ROOTFS/proc/cpuinfo" <<CPUINFO
processor	: $i
BogoMIPS	: 108.00
Features	: fp asimd evtstrm crc32 cpuid
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x0
CPU part	: 0xd08
CPU revision	: 3

CPUINFO
  done
  printf 'Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4 (emulated)\n' >>"$ROOTFS/proc/cpuinfo"
  mkdir -p "$ROOTFS/etc"
  printf 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm) arm64, emulated Raspberry Pi 4"\nNAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian\n' \
    >"$ROOTFS/etc/os-release"

  # The device's Python packages, as a Pi with `pip install numpy click ai-edge-litert` has them.
  "$PY_HOST" -m pip install --quiet --disable-pip-version-check --no-compile \
    --target "$ROOTFS/usr/local/lib/python3.11/dist-packages" \
    --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_27_aarch64 \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_34_aarch64 \
    "numpy>=2" click ai-edge-litert
  touch "$STAMP"
fi

mkdir -p "$DIR/bin"
cat >"$DIR/bin/python" <<WRAP
#!/bin/sh
# The emulated Raspberry Pi 4's python: aarch64 python3.11 under qemu-user.
# QEMU_CPU must name a real core: qemu's default "max" model gives wrong int8 results.
QEMU_CPU=$CPU
export QEMU_CPU
exec "$QEMU" -L "$ROOTFS" "$ROOTFS/usr/bin/python3.11" "\$@"
WRAP
chmod 755 "$DIR/bin/python"
"$DIR/bin/python" -c "import platform, numpy, ai_edge_litert; print('emulated pi4 ready:', platform.machine(), 'numpy', numpy.__version__)"
