#!/usr/bin/env bash
# Prove the edge agent installs and trains on arm64, on an emulated board:
#
#   1. build a Debian bookworm arm64 root with debootstrap, run under qemu-user
#      through binfmt_misc (so `chroot ROOT` runs arm64 programs);
#   2. install the agent there with deploy/edge/install.sh itself, as on a Pi
#      (apt packages, a venv in /opt/edgesplit, PyPI's aarch64 torch CPU wheels,
#      the agent from this source tree, the edgesplit user; --no-service, as a
#      chroot has no systemd), which ends with `edge-agent doctor`;
#   3. start mosquitto and a FedGKT server (one round, one agent) on the host and
#      run the chroot's agent against them: a chroot shares the host's network,
#      so 127.0.0.1 is the host's loopback;
#   4. write bench/results/arm64.json: versions installed, install seconds, doctor
#      result, round seconds, the run's result. Every time in it is emulated
#      (qemu-user on an x86_64 host, tens of times slower than a Pi): it proves
#      the install works, not how fast a Pi is.
#
#   sudo deploy/edge/verify-arm64.sh                   # build (or reuse) the root, install, run
#   sudo deploy/edge/verify-arm64.sh --root DIR        # where the arm64 root lives (reused when complete)
#   sudo deploy/edge/verify-arm64.sh --fresh           # delete the root and start again
#
# Needs root, debootstrap, qemu-user-static with binfmt-support, mosquitto, network
# access to the Debian mirror and PyPI, and a host Python with the server installed
# (default: this tree's .venv). Not part of CI or the test suite: it takes tens of
# minutes and downloads a few hundred MB.
#
# binfmt: the script mounts /proc/sys/fs/binfmt_misc if needed and enables
# qemu-aarch64 (update-binfmts). Where a sandbox forbids binfmt_misc, `chroot`
# cannot start arm64 programs; qemu-aarch64-static -L ROOT can still run a single
# program, but not install.sh, whose apt, dpkg and pip start further programs, so
# the script stops and says so.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${SCRIPT_DIR}/../.." && pwd)"
ROOT_DIR="/var/tmp/edgesplit-arm64/root"
WORK=""
MIRROR="http://deb.debian.org/debian"
SUITE="bookworm"
HOST_PYTHON="${REPO}/.venv/bin/python"
SAMPLES=64
TEST_SAMPLES=32
OUT="${REPO}/bench/results/arm64.json"
FRESH=0
TIMEOUT_S=5400

usage() {
  sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<USAGE
options:
  --root DIR          the arm64 root (default: ${ROOT_DIR}); reused when complete
  --fresh             delete the root first
  --mirror URL        Debian mirror (default: ${MIRROR})
  --host-python EXE   Python with the server installed (default: ${HOST_PYTHON})
  --samples N         training samples of the agent's shard (default: ${SAMPLES})
  --out FILE          result JSON (default: ${OUT})
  --timeout S         give up on the federation after S seconds (default: ${TIMEOUT_S})
USAGE
}

die() { echo "verify-arm64.sh: error: $*" >&2; exit 1; }
say() { echo "==> $(date -u +%H:%M:%S) $*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT_DIR="${2:?--root needs a directory}"; shift ;;
    --fresh) FRESH=1 ;;
    --mirror) MIRROR="${2:?--mirror needs a URL}"; shift ;;
    --host-python) HOST_PYTHON="${2:?--host-python needs an interpreter}"; shift ;;
    --samples) SAMPLES="${2:?--samples needs a number}"; shift ;;
    --out) OUT="${2:?--out needs a file}"; shift ;;
    --timeout) TIMEOUT_S="${2:?--timeout needs seconds}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
  shift
done

[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap, chroot and mounts need it)"
for tool in debootstrap chroot mount; do
  command -v "${tool}" >/dev/null || die "${tool} not found (apt-get install debootstrap qemu-user-static binfmt-support)"
done
MOSQUITTO="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
[ -x "${MOSQUITTO}" ] || die "mosquitto not found on the host (apt-get install mosquitto)"
[ -x "${HOST_PYTHON}" ] || die "no host Python at ${HOST_PYTHON} (pass --host-python)"
"${HOST_PYTHON}" -c 'import cloud_server.cli' 2>/dev/null || die "${HOST_PYTHON} cannot import cloud_server (install the server: pip install -e '.[server]')"
DATASET_DIR="/usr/share/datasets/fashion-mnist"
[ -d "${DATASET_DIR}" ] || die "${DATASET_DIR} missing on the host: apt-get install dataset-fashion-mnist"

WORK="$(dirname "${ROOT_DIR}")/work"
mkdir -p "${WORK}"
LOGS="${WORK}/logs"
rm -rf "${LOGS}" "${WORK}/run"
mkdir -p "${LOGS}"

# --- 1. binfmt_misc: arm64 binaries run through qemu ------------------------ #
say "1. binfmt_misc for aarch64"
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
    || die "cannot mount binfmt_misc (a sandbox that forbids it cannot run install.sh in an arm64 chroot; see the header)"
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  command -v update-binfmts >/dev/null || die "update-binfmts not found (apt-get install binfmt-support qemu-user-static)"
  update-binfmts --enable qemu-aarch64 || die "update-binfmts could not register qemu-aarch64"
fi
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || die "qemu-aarch64 is registered but disabled in binfmt_misc"
# The F (fix binary) flag makes the kernel open the interpreter now, so it works inside the chroot too.
grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
  || echo "warning: qemu-aarch64 lacks the F flag; the chroot needs its own copy of the interpreter" >&2
QEMU_VERSION="$( (qemu-aarch64-static --version 2>/dev/null || qemu-aarch64 --version 2>/dev/null || echo unknown) | head -1)"

# --- 2. the arm64 root -------------------------------------------------------- #
unmount_all() {
  for m in dev/pts dev sys proc; do
    if mountpoint -q "${ROOT_DIR}/${m}"; then umount -l "${ROOT_DIR}/${m}" || true; fi
  done
}
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "${pid}" 2>/dev/null || true; done
  unmount_all
}
trap cleanup EXIT

if [ "${FRESH}" -eq 1 ]; then
  unmount_all
  rm -rf "${ROOT_DIR}"
fi
DEBOOTSTRAP_S=0
if [ ! -e "${ROOT_DIR}/.debootstrap-complete" ]; then
  say "2. debootstrap ${SUITE} arm64 into ${ROOT_DIR} (emulated second stage: slow)"
  rm -rf "${ROOT_DIR}"
  mkdir -p "${ROOT_DIR}"
  started=${SECONDS}
  # install.sh installs the rest (python3-venv, python3-pip, ...) itself, as on a Pi.
  debootstrap --arch=arm64 --variant=minbase --include=python3,ca-certificates,passwd \
    "${SUITE}" "${ROOT_DIR}" "${MIRROR}" > "${LOGS}/debootstrap.log" 2>&1 \
    || { tail -20 "${LOGS}/debootstrap.log" >&2; die "debootstrap failed (log: ${LOGS}/debootstrap.log)"; }
  DEBOOTSTRAP_S=$((SECONDS - started))
  touch "${ROOT_DIR}/.debootstrap-complete"
else
  say "2. reusing the arm64 root in ${ROOT_DIR}"
fi
[ "$(chroot "${ROOT_DIR}" uname -m)" = "aarch64" ] || die "the chroot does not run as aarch64"

mount -t proc proc "${ROOT_DIR}/proc"
mount -t sysfs sys "${ROOT_DIR}/sys"
mount --bind /dev "${ROOT_DIR}/dev"
mount --bind /dev/pts "${ROOT_DIR}/dev/pts"
cp -L /etc/resolv.conf "${ROOT_DIR}/etc/resolv.conf"
# The host's CA bundle, for pip inside the root: where the network intercepts TLS (a proxy
# with its own CA, as in some CI sandboxes), only the host trusts it, and a fresh root's
# ca-certificates would make every PyPI download fail with CERTIFICATE_VERIFY_FAILED.
HOST_CA="/etc/ssl/certs/ca-certificates.crt"
ROOT_CA="/etc/ssl/certs/host-ca-certificates.crt"
if [ -r "${HOST_CA}" ]; then
  cp -L "${HOST_CA}" "${ROOT_DIR}${ROOT_CA}"
else
  ROOT_CA="${HOST_CA}"
fi

# --- 3. broker on the host ----------------------------------------------------- #
PORT="$("${HOST_PYTHON}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
say "3. mosquitto on 127.0.0.1:${PORT} (host)"
cat > "${WORK}/mosquitto.conf" <<CONF
listener ${PORT} 127.0.0.1
allow_anonymous true
persistence false
log_dest stderr
CONF
# stderr, not a log file: run as root, mosquitto drops to its own user, which cannot write to ${LOGS}.
"${MOSQUITTO}" -c "${WORK}/mosquitto.conf" 2> "${LOGS}/mosquitto.log" &
PIDS+=("$!")
for _ in $(seq 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null && break
  sleep 0.2
done
RUN_ID="arm64-$(date -u +%Y%m%d-%H%M%S)"

# --- 4. the agent's files in the root: source, dataset, config --------------------- #
say "4. source tree, Fashion-MNIST and agent.toml into the root"
rm -rf "${ROOT_DIR}/opt/edgesplit-src"
mkdir -p "${ROOT_DIR}/opt/edgesplit-src" "${ROOT_DIR}/srv/datasets"
tar -C "${REPO}" --exclude=./.venv --exclude=./.git --exclude=./runs --exclude=./build \
  --exclude='*/__pycache__' --exclude='*.egg-info' -cf - . | tar -C "${ROOT_DIR}/opt/edgesplit-src" -xf -
rm -rf "${ROOT_DIR}/srv/datasets/fashion-mnist"
cp -r "${DATASET_DIR}" "${ROOT_DIR}/srv/datasets/fashion-mnist"
chmod -R a+rX "${ROOT_DIR}/srv/datasets"
cat > "${ROOT_DIR}/tmp/agent.toml" <<TOML
[agent]
agent_id = "pi-arm64"
run_id = "${RUN_ID}"
broker_url = "mqtt://127.0.0.1:${PORT}"
state_dir = "/var/lib/edgesplit/state"
threads = 1

[data]
dataset = "fashion-mnist"
root = "/srv/datasets/fashion-mnist"
partition = "none"
train_samples = ${SAMPLES}
test_samples = ${TEST_SAMPLES}
TOML

# --- 5. install.sh in the root, as on a Pi --------------------------------------- #
say "5. deploy/edge/install.sh --no-service inside the arm64 root (emulated)"
# A second run reuses the venv (install.sh keeps a torch that imports): its seconds are not a fresh install's.
VENV_EXISTED=false
if [ -x "${ROOT_DIR}/opt/edgesplit/venv/bin/python" ]; then VENV_EXISTED=true; fi
started=${SECONDS}
set +e
nice -n 19 chroot "${ROOT_DIR}" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root LANG=C.UTF-8 PIP_CERT="${ROOT_CA}" bash /opt/edgesplit-src/deploy/edge/install.sh --no-service \
  --source /opt/edgesplit-src --config /tmp/agent.toml > "${LOGS}/install.log" 2>&1
INSTALL_RC=$?
set -e
INSTALL_S=$((SECONDS - started))
echo "    install.sh exited ${INSTALL_RC} after ${INSTALL_S} s (log: ${LOGS}/install.log)"
[ -x "${ROOT_DIR}/opt/edgesplit/venv/bin/edge-agent" ] || { tail -30 "${LOGS}/install.log" >&2; die "install.sh did not install the agent"; }

# As the service would run it: the edgesplit user, the venv's agent, one thread.
IN_ROOT=(nice -n 19 chroot "${ROOT_DIR}" /usr/bin/env -i PATH=/opt/edgesplit/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/var/lib/edgesplit
         LANG=C.UTF-8 OMP_NUM_THREADS=1 runuser -u edgesplit --)

say "6. edge-agent doctor (emulated)"
set +e
"${IN_ROOT[@]}" /opt/edgesplit/venv/bin/edge-agent doctor --config /etc/edgesplit/agent.toml > "${LOGS}/doctor.log" 2>&1
DOCTOR_RC=$?
set -e
echo "    doctor exited ${DOCTOR_RC}"
chroot "${ROOT_DIR}" /opt/edgesplit/venv/bin/python -m pip list --format=json > "${WORK}/pip-list.json" 2>/dev/null || echo "[]" > "${WORK}/pip-list.json"
ROOT_PYTHON="$(chroot "${ROOT_DIR}" /opt/edgesplit/venv/bin/python -c 'import platform; print(platform.python_version())')"
ROOT_DEBIAN="$(cat "${ROOT_DIR}/etc/debian_version")"

# --- 7. server on the host, the agent in the root ---------------------------------- #
say "7. one FedGKT round: server on the host, the arm64 agent in the root"
cat > "${WORK}/server.toml" <<TOML
[server]
run_id = "${RUN_ID}"
method = "fedgkt"
broker_url = "mqtt://127.0.0.1:${PORT}"
out_dir = "${WORK}/run"
expected_agents = 1
rounds = 1
round_deadline_s = ${TIMEOUT_S}.0
registration_timeout_s = ${TIMEOUT_S}.0
offline_grace_s = ${TIMEOUT_S}.0
min_agents = 1
eval_every = 1
device = "cpu"
dataset = "fashion-mnist"
num_classes = 10
seed = 0

[fedgkt]
server_epochs = 1
edge_epochs = 1
TOML
(cd "${REPO}" && PYTHONPATH="${REPO}" OMP_NUM_THREADS=1 exec nice -n 10 "${HOST_PYTHON}" -m cloud_server.cli run \
  --config "${WORK}/server.toml" --no-progress) > "${LOGS}/server.stdout" 2> "${LOGS}/server.log" &
SERVER_PID=$!
PIDS+=("${SERVER_PID}")
started=${SECONDS}
set +e
timeout "${TIMEOUT_S}" "${IN_ROOT[@]}" /opt/edgesplit/venv/bin/edge-agent run --config /etc/edgesplit/agent.toml --no-progress \
  > "${LOGS}/agent.log" 2>&1
AGENT_RC=$?
AGENT_S=$((SECONDS - started))
timeout 120 tail --pid="${SERVER_PID}" -f /dev/null
kill "${SERVER_PID}" 2>/dev/null  # still running: the agent never joined, and the server would wait out its registration timeout
wait "${SERVER_PID}"
SERVER_RC=$?
set -e
echo "    agent exited ${AGENT_RC} after ${AGENT_S} s; server exited ${SERVER_RC}"

# --- 8. the result ------------------------------------------------------------------ #
say "8. ${OUT}"
"${HOST_PYTHON}" - "${OUT}" "${WORK}" <<PY
import json, platform, sys
from pathlib import Path

out, work = Path(sys.argv[1]), Path(sys.argv[2])
logs = work / "logs"
keep = ("torch", "torchvision", "numpy", "edgesplit", "paho-mqtt", "zstandard", "xxhash", "tqdm", "psutil", "pillow")
versions = {p["name"].lower(): p["version"] for p in json.loads((work / "pip-list.json").read_text() or "[]")}
report_path = work / "run" / "report.json"
report = json.loads(report_path.read_text()) if report_path.exists() else None


def tail(name: str, lines: int = 15) -> list[str]:
    path = logs / name
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


result = {
    "emulated": True,
    "note": "every time here ran under qemu-user (binfmt_misc) on an x86_64 host: it proves the install and the round work; a real Pi is far faster",
    "host": {"arch": platform.machine(), "qemu": "${QEMU_VERSION}", "cpu_cores": __import__("os").cpu_count()},
    "root": {"debian": "${ROOT_DEBIAN}", "suite": "${SUITE}", "arch": "aarch64", "python": "${ROOT_PYTHON}",
             "debootstrap_s": ${DEBOOTSTRAP_S} or None},
    "versions": {k: versions[k] for k in keep if k in versions},
    "install": {"script": "deploy/edge/install.sh --no-service", "exit_code": ${INSTALL_RC}, "seconds": ${INSTALL_S},
                "venv_existed_before": "${VENV_EXISTED}" == "true"},
    "doctor": {"exit_code": ${DOCTOR_RC}, "output": tail("doctor.log", 40)},
    "federation": {"method": "fedgkt", "rounds": 1, "agents": 1, "train_samples": ${SAMPLES}, "test_samples": ${TEST_SAMPLES},
                   "agent_exit_code": ${AGENT_RC}, "agent_process_s": ${AGENT_S}, "server_exit_code": ${SERVER_RC}},
    "agent_log_tail": tail("agent.log"),
}
if report is not None:
    rounds = report.get("rounds", [])
    result["federation"]["status"] = report.get("status")
    result["federation"]["rounds_completed"] = report.get("totals", {}).get("rounds_completed")
    result["federation"]["final_accuracy"] = report.get("totals", {}).get("final_accuracy")
    result["federation"]["round_records"] = rounds
else:
    result["federation"]["status"] = "no report"
    result["server_log_tail"] = tail("server.log", 30)
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: result[k] for k in ("versions", "install", "federation")}, indent=2)[:3000])
PY
if [ "${AGENT_RC}" -ne 0 ] || [ "${SERVER_RC}" -ne 0 ]; then
  die "the federation did not complete (logs in ${LOGS})"
fi
say "done: the arm64 agent installed, passed doctor (exit ${DOCTOR_RC}) and completed its round"
