#!/usr/bin/env bash
# What the fleet tests (tests/fleet) need on a fresh Debian/Ubuntu x86-64 machine, as root:
# a real sshd (openssh-server), qemu-user-static, and the emulated Raspberry Pi 4 userland
# (cached under .cache/pi4, about 330 MB); and Chromium for the report test. Idempotent:
# a second run does nothing.
#
#   deploy/test-env.sh            # from the repository root; `make test` calls it
#
# Without root or apt-get it only says what is missing; the fleet tests then skip with
# that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PI4_DIR=${EDGEQ_PI4_DIR:-.cache/pi4}

need=()
[ -x /usr/sbin/sshd ] && [ -x /usr/lib/openssh/sftp-server ] || need+=(openssh-server)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v ssh-keygen >/dev/null || need+=(openssh-client)
# the report test loads edgeq's HTML page in headless Chromium (through playwright)
command -v chromium >/dev/null || need+=(chromium)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "test-env: missing ${need[*]} and cannot install them (needs root and apt-get); the fleet and browser tests will skip" >&2
    exit 0
  fi
  echo "test-env: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d: the package must not start a system sshd on port 22 (an existing
  # policy file is left as it is).
  made_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
fi
# sshd's privilege-separation folder (the package creates it at boot only).
if [ "$(id -u)" = 0 ]; then mkdir -p /run/sshd && chmod 755 /run/sshd; fi

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
PYTHON=$PYTHON deploy/make-emulated-pi4.sh "$PI4_DIR" >/dev/null
echo "test-env: sshd $(/usr/sbin/sshd -V 2>&1 | head -1 || true); emulated Pi 4 in $PI4_DIR" >&2
