#!/usr/bin/env bash
# Install the EdgeSplit edge agent on Raspberry Pi OS 64-bit, Debian or Ubuntu
# (aarch64 or x86_64): a venv in /opt/edgesplit, the right torch CPU wheel for
# this CPU (or no torch at all with --backend ort), the agent, an unprivileged
# `edgesplit` user and the systemd unit edge-agent.service, which reads its
# config and credentials from /etc/edgesplit/.
#
#   sudo deploy/edge/install.sh                         # torch backend
#   sudo deploy/edge/install.sh --backend ort           # torch-free (x86_64 only)
#   deploy/edge/install.sh --dry-run                    # print the plan, change nothing
#   sudo deploy/edge/install.sh --bundle pi-1/          # the device bundle from `edgesplit keys init`
#   sudo deploy/edge/install.sh --config agent.toml --password-file pi-1.password --ca-file ca.crt
#   sudo deploy/edge/install.sh --torch-build cuda      # x86_64: PyPI's CUDA torch instead of the CPU-only one
#
# torch on aarch64: the pair pinned below is one known to run on a Raspberry Pi 4
# (Cortex-A72, ARMv8.0 without LSE atomics). torch 2.4.0's aarch64 wheel dies with
# SIGILL on import there (an LSE `ldaddal` in the bundled Arm Compute Library,
# pytorch/pytorch#132032), and 2.10.0 again (pytorch/pytorch#176993, fixed in 2.11);
# 2.3.1 works on Pi 4 with Raspberry Pi OS 12 and Python 3.11. torch 2.3 was built
# against numpy 1.x, hence numpy<2. Override with --torch-spec after testing
# another pair on your device (`edge-agent doctor` checks that torch computes).
set -euo pipefail

readonly PI_TORCH_SPEC="torch==2.3.1 torchvision==0.18.1 numpy<2"
readonly X86_TORCH_SPEC="torch torchvision"
readonly TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
readonly ORT_SPEC="onnxruntime-training-cpu==1.19.2"

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SOURCE="$(cd "${SCRIPT_DIR}/../.." && pwd)"
PREFIX="/opt/edgesplit"
CONF_DIR="/etc/edgesplit"
STATE_DIR="/var/lib/edgesplit"
SERVICE_USER="edgesplit"
BACKEND="torch"
ARCH="$(uname -m)"
PYTHON="python3"
TORCH_SPEC=""
TORCH_BUILD="cpu"
DRY_RUN=0
INSTALL_SERVICE=1
REINSTALL_TORCH=0
CONFIG_FILE=""
PASSWORD_FILE=""
CA_FILE=""
ROOT=""
CONFIG_ONLY=0

usage() {
  sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<USAGE
options:
  --dry-run              print what would be done, change nothing
  --backend torch|ort    local training backend (default: torch)
  --source PATH          EdgeSplit source tree or wheel to install (default: ${SOURCE})
  --prefix DIR           where the venv goes (default: ${PREFIX})
  --user NAME            service user (default: ${SERVICE_USER})
  --python EXE           interpreter for the venv (default: python3, >= 3.10)
  --torch-spec SPEC      pip requirements for torch (default: by architecture, see above)
  --torch-build cpu|cuda x86_64: cpu (default) takes torch from PyTorch's CPU wheel index
                         (no CUDA libraries: about 0.8 GB less on disk, 400 MB less RSS on
                         import); cuda takes PyPI's default CUDA build. aarch64: cpu only
  --arch ARCH            plan for another architecture (aarch64|x86_64), with --dry-run
  --reinstall-torch      reinstall torch even if it imports
  --config FILE          agent TOML to install as ${CONF_DIR}/agent.toml
  --password-file FILE   the agent's broker password, installed as ${CONF_DIR}/agent.password
  --ca-file FILE         the deployment's CA certificate, installed as ${CONF_DIR}/ca.crt
  --bundle DIR           a device bundle from \`edgesplit keys init\` (bundles/<id>/): its agent.toml,
                         agent.password and ca.crt, installed as they are (same as the three options above)
  --root DIR             install config, credentials and state directories under DIR instead of /
                         (DIR/etc/edgesplit, DIR/var/lib/edgesplit; DIR is created): for trying a bundle
                         out, and for tests. The installed config's /var/lib/edgesplit paths are rewritten
                         to DIR/var/lib/edgesplit, so doctor and edge-agent run use it as it is
  --config-only          only the config, credentials and directories (steps 3 and 7): no apt, venv or unit
  --no-service           do not install or start the systemd unit
USAGE
}

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "==> $*"; }

# Run a command, or only show it with --dry-run.
run() {
  if [ "${DRY_RUN}" -eq 1 ]; then
    printf '   '; printf ' %q' "$@"; echo
  else
    "$@"
  fi
}

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --backend) BACKEND="${2:?--backend needs a value}"; shift ;;
    --source) SOURCE="${2:?--source needs a path}"; shift ;;
    --prefix) PREFIX="${2:?--prefix needs a directory}"; shift ;;
    --user) SERVICE_USER="${2:?--user needs a name}"; shift ;;
    --python) PYTHON="${2:?--python needs an interpreter}"; shift ;;
    --torch-spec) TORCH_SPEC="${2:?--torch-spec needs a value}"; shift ;;
    --torch-build) TORCH_BUILD="${2:?--torch-build needs cpu or cuda}"; shift ;;
    --arch) ARCH="${2:?--arch needs a value}"; shift ;;
    --reinstall-torch) REINSTALL_TORCH=1 ;;
    --config) CONFIG_FILE="${2:?--config needs a file}"; shift ;;
    --password-file) PASSWORD_FILE="${2:?--password-file needs a file}"; shift ;;
    --ca-file) CA_FILE="${2:?--ca-file needs a file}"; shift ;;
    --bundle)
      BUNDLE="${2:?--bundle needs a directory}"; shift
      for f in agent.toml agent.password ca.crt; do
        [ -f "${BUNDLE}/${f}" ] || die "--bundle ${BUNDLE}: ${f} is missing; a bundle is bundles/<id>/ from edgesplit keys init (agent.toml, agent.password, ca.crt)"
      done
      CONFIG_FILE="${BUNDLE}/agent.toml"; PASSWORD_FILE="${BUNDLE}/agent.password"; CA_FILE="${BUNDLE}/ca.crt" ;;
    --root) ROOT="${2:?--root needs a directory}"; shift ;;
    --config-only) CONFIG_ONLY=1; INSTALL_SERVICE=0 ;;
    --no-service) INSTALL_SERVICE=0 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done

case "${BACKEND}" in torch|ort) ;; *) die "--backend must be torch or ort, got '${BACKEND}'" ;; esac
case "${TORCH_BUILD}" in cpu|cuda) ;; *) die "--torch-build must be cpu or cuda, got '${TORCH_BUILD}'" ;; esac
case "${ARCH}" in
  aarch64|arm64) ARCH="aarch64" ;;
  x86_64|amd64) ARCH="x86_64" ;;
  armv7l|armv6l) die "32-bit ARM (${ARCH}) has no torch or onnxruntime wheels: install Raspberry Pi OS 64-bit" ;;
  *) die "unsupported architecture ${ARCH}; supported: aarch64, x86_64" ;;
esac
if [ "${BACKEND}" = "ort" ] && [ "${ARCH}" = "aarch64" ]; then
  die "onnxruntime-training has no Linux aarch64 build (its last release, 1.19.2, ships x86_64 only): use --backend torch on a Pi"
fi
if [ "${TORCH_BUILD}" = "cuda" ] && [ "${ARCH}" = "aarch64" ]; then
  die "--torch-build cuda is for x86_64: a Pi has no CUDA, and PyPI's aarch64 torch wheels are the CPU build"
fi
if [ -z "${TORCH_SPEC}" ]; then
  if [ "${ARCH}" = "aarch64" ]; then TORCH_SPEC="${PI_TORCH_SPEC}"; else TORCH_SPEC="${X86_TORCH_SPEC}"; fi
fi
if [ -n "${ROOT}" ] && [ "${CONFIG_ONLY}" -eq 0 ]; then
  die "--root DIR goes with --config-only (the venv and the systemd unit are the machine's, not DIR's)"
fi
if [ -n "${ROOT}" ]; then
  given_root="${ROOT}"
  if [ "${DRY_RUN}" -eq 0 ]; then
    mkdir -p -- "${given_root}" || die "--root ${given_root}: cannot create it"
  fi
  if [ -d "${given_root}" ]; then
    ROOT="$(cd "${given_root}" && pwd)"
  else
    case "${given_root}" in /*) ROOT="${given_root}" ;; *) ROOT="$(pwd)/${given_root}" ;; esac
  fi
  case "${ROOT}" in *[\#\&\\\"]*) die "--root ${given_root}: the path may not hold #, &, a backslash or a double quote (it goes into the installed config)" ;; esac
  CONF_DIR="${ROOT}${CONF_DIR}"
  STATE_DIR="${ROOT}${STATE_DIR}"
fi
if [ "${DRY_RUN}" -eq 0 ] && [ "$(id -u)" -ne 0 ] && { [ "${CONFIG_ONLY}" -eq 0 ] || [ -z "${ROOT}" ]; }; then
  die "run as root (sudo), or with --dry-run to see the plan (--config-only --root DIR needs no root)"
fi
# Owner flags for what step 7 installs: the service user's group reads the config and password.
# Without root (--config-only --root) or without that user yet, the files stay the caller's.
OWN_CONF=(-o root -g "${SERVICE_USER}")
OWN_STATE=(-o "${SERVICE_USER}" -g "${SERVICE_USER}")
if [ "${DRY_RUN}" -eq 0 ] && { [ "$(id -u)" -ne 0 ] || { [ "${CONFIG_ONLY}" -eq 1 ] && ! id -u "${SERVICE_USER}" >/dev/null 2>&1; }; }; then
  OWN_CONF=()
  OWN_STATE=()
fi

VENV="${PREFIX}/venv"
PIP="${VENV}/bin/pip"
EXTRA="edge"

say "EdgeSplit edge agent: backend ${BACKEND}, ${ARCH}, venv ${VENV}, source ${SOURCE}"
if [ -r /etc/os-release ]; then
  # shellcheck disable=SC1091
  . /etc/os-release
  case "${ID:-}:${ID_LIKE:-}" in
    debian*|raspbian*|ubuntu*|*:*debian*) say "OS: ${PRETTY_NAME:-${ID}}" ;;
    *) echo "warning: ${PRETTY_NAME:-this OS} is not Debian-based; continuing, but apt steps may fail" >&2 ;;
  esac
fi

if [ "${CONFIG_ONLY}" -eq 1 ]; then
  say "--config-only: config, credentials and directories under ${ROOT:-/} only"
else
say "1. system packages (python3-venv, ca-certificates; mosquitto-clients for debugging)"
run apt-get update -qq
run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip ca-certificates mosquitto-clients

say "2. Python >= 3.10"
if [ "${DRY_RUN}" -eq 0 ]; then
  "${PYTHON}" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || die "$(${PYTHON} -V 2>&1) is too old: EdgeSplit needs Python 3.10+ (Raspberry Pi OS / Debian 12, Ubuntu 22.04 or newer)"
else
  echo "    ${PYTHON} -c 'assert sys.version_info >= (3, 10)'"
fi

fi

say "3. service user ${SERVICE_USER} and directories"
if [ "${CONFIG_ONLY}" -eq 0 ]; then
  if [ "${DRY_RUN}" -eq 1 ] || ! id -u "${SERVICE_USER}" >/dev/null 2>&1; then
    run useradd --system --home-dir "${STATE_DIR}" --shell /usr/sbin/nologin "${SERVICE_USER}"
  fi
  run install -d -m 0755 "${PREFIX}"
fi
run install -d -m 0750 "${OWN_CONF[@]}" "${CONF_DIR}"
run install -d -m 0750 "${OWN_STATE[@]}" "${STATE_DIR}" "${STATE_DIR}/data" "${STATE_DIR}/state"

if [ "${CONFIG_ONLY}" -eq 0 ]; then
say "4. venv ${VENV}"
run "${PYTHON}" -m venv "${VENV}"
run "${PIP}" install -q --upgrade pip setuptools wheel

if [ "${BACKEND}" = "torch" ]; then
  say "5. torch (${TORCH_BUILD} build) for ${ARCH}: ${TORCH_SPEC}"
  read -r -a torch_args <<< "${TORCH_SPEC}"
  if [ "${DRY_RUN}" -eq 0 ] && [ "${REINSTALL_TORCH}" -eq 0 ] && "${VENV}/bin/python" -c 'import torch' 2>/dev/null; then
    echo "    torch already imports in ${VENV}; keeping it (--reinstall-torch to replace)"
  elif [ "${ARCH}" = "x86_64" ] && [ "${TORCH_BUILD}" = "cpu" ]; then
    # The CPU-only build: ~200 MB instead of the ~900 MB CUDA wheel PyPI serves on x86_64,
    # and `import torch` about 230 MB of RSS instead of 630 MB (bench/results/footprint.json).
    run "${PIP}" install -q --index-url "${TORCH_CPU_INDEX}" --extra-index-url https://pypi.org/simple "${torch_args[@]}"
  elif [ "${ARCH}" = "x86_64" ]; then
    # --torch-build cuda: PyPI's default x86_64 wheel, with the CUDA libraries.
    run "${PIP}" install -q "${torch_args[@]}"
  else
    # PyPI's aarch64 wheels are CPU-only already.
    run "${PIP}" install -q "${torch_args[@]}"
  fi
else
  say "5. no torch: onnxruntime-training (${ORT_SPEC}) and numpy only"
fi

if [ "${BACKEND}" = "torch" ]; then
  say "6. the agent (${SOURCE}[${EXTRA}])"
  run "${PIP}" install -q "${SOURCE}[${EXTRA}]"
else
  # Lean: onnxruntime-training-cpu declares onnx, sympy, h5py, protobuf, cerberus and
  # flatbuffers, which only generating artifacts (the server's job) uses; the
  # on-device API needs the native library and numpy. Measured: 176 MB instead of
  # 325 MB of site-packages (bench/results/footprint.json). `edge-agent doctor`
  # checks that the training API loads.
  say "6. the agent, lean: ${ORT_SPEC} without its artifact-generation dependencies"
  run "${PIP}" install -q --no-deps "${ORT_SPEC}"
  run "${PIP}" install -q "numpy>=1.24" "zstandard>=0.21" "paho-mqtt>=2.0,<3" "xxhash>=3.0" "pillow>=9"
  run "${PIP}" install -q --no-deps "${SOURCE}"
fi

fi

# The config names its password and CA relative to itself (agent.password, ca.crt: a bundle
# from edgesplit keys init) or as absolute /etc/edgesplit paths: both find the files installed here.
say "7. config and credentials in ${CONF_DIR} (readable by ${SERVICE_USER}, not by others)"
if [ -n "${CONFIG_FILE}" ]; then
  run install -m 0640 "${OWN_CONF[@]}" "${CONFIG_FILE}" "${CONF_DIR}/agent.toml"
elif [ "${DRY_RUN}" -eq 1 ] || [ ! -e "${CONF_DIR}/agent.toml" ]; then
  run install -m 0640 "${OWN_CONF[@]}" "${SCRIPT_DIR}/agent.toml.example" "${CONF_DIR}/agent.toml"
  echo "    edit ${CONF_DIR}/agent.toml: agent_id, broker_url, [data]"
fi
if [ -n "${PASSWORD_FILE}" ]; then
  # Group-readable for the service user; the caller's alone where there is none (--config-only --root).
  if [ "${#OWN_CONF[@]}" -gt 0 ]; then pw_mode=0640; else pw_mode=0600; fi
  run install -m "${pw_mode}" "${OWN_CONF[@]}" "${PASSWORD_FILE}" "${CONF_DIR}/agent.password"
fi
if [ -n "${CA_FILE}" ]; then
  if [ "${#OWN_CONF[@]}" -gt 0 ]; then
    run install -m 0644 -o root -g root "${CA_FILE}" "${CONF_DIR}/ca.crt"
  else
    run install -m 0644 "${CA_FILE}" "${CONF_DIR}/ca.crt"
  fi
fi
if [ -n "${ROOT}" ]; then
  # A trial root: the config's data and state directories (/var/lib/edgesplit/...) are the ones
  # made under ROOT above, so that doctor and edge-agent run use the installed config as it is.
  say "--root: the installed config's /var/lib/edgesplit paths point under ${ROOT} (data, state)"
  run sed -i "s#\"/var/lib/edgesplit/#\"${STATE_DIR}/#g" "${CONF_DIR}/agent.toml"
fi
if [ "${CONFIG_ONLY}" -eq 1 ]; then
  say "installed: ${CONF_DIR}/agent.toml; check it with: edge-agent doctor --config ${CONF_DIR}/agent.toml"
  exit 0
fi

if [ "${INSTALL_SERVICE}" -eq 1 ]; then
  say "8. systemd unit edge-agent.service"
  run install -m 0644 "${SCRIPT_DIR}/edge-agent.service" /etc/systemd/system/edge-agent.service
  if [ "${BACKEND}" = "ort" ] || [ "${PREFIX}" != "/opt/edgesplit" ] || [ "${SERVICE_USER}" != "edgesplit" ]; then
    run install -d -m 0755 /etc/systemd/system/edge-agent.service.d
    if [ "${DRY_RUN}" -eq 1 ]; then
      echo "    write /etc/systemd/system/edge-agent.service.d/local.conf (User=${SERVICE_USER}, ${VENV}/bin/edge-agent --backend ${BACKEND})"
    else
      cat > /etc/systemd/system/edge-agent.service.d/local.conf <<UNIT
[Service]
User=${SERVICE_USER}
Group=${SERVICE_USER}
ExecStart=
ExecStart=${VENV}/bin/edge-agent run --config ${CONF_DIR}/agent.toml --no-progress --backend ${BACKEND}
UNIT
    fi
  fi
  run systemctl daemon-reload
  run systemctl enable edge-agent.service
fi

say "9. check: edge-agent doctor"
if [ "${DRY_RUN}" -eq 1 ]; then
  echo "    runuser -u ${SERVICE_USER} -- ${VENV}/bin/edge-agent doctor --config ${CONF_DIR}/agent.toml --backend ${BACKEND}"
elif runuser -u "${SERVICE_USER}" -- "${VENV}/bin/edge-agent" doctor --config "${CONF_DIR}/agent.toml" --backend "${BACKEND}"; then
  if [ "${INSTALL_SERVICE}" -eq 1 ]; then
    systemctl restart edge-agent.service
    say "edge-agent.service started: journalctl -u edge-agent -f"
  fi
else
  echo "install.sh: the agent is installed, but doctor found problems (above); fix them, then: sudo systemctl start edge-agent" >&2
  exit 2
fi
