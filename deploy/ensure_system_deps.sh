#!/usr/bin/env bash
# Install the Debian packages EdgeSplit needs (broker, clients, offline dataset; for the tests
# shellcheck and headless chromium, which opens the status page)
# when they are missing. As root we install them; otherwise we say exactly what to run.
set -euo pipefail
missing=()
for pkg in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
  # Debian starts a system mosquitto on port 1883; tests start their own on free ports.
else
  echo "missing system packages: ${missing[*]}" >&2
  echo "install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
