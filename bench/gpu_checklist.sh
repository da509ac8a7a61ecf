#!/usr/bin/env bash
# The GPU measurements (the CUDA tests, the server step's speed, FedGKT at full scale, every method
# on CUDA) as one call on a GPU machine, inside a fixed time budget.
#
# Run on the GPU machine from the project root, with an ignored `.gpu/` folder beside it that holds
# what the machine cannot download (paho-mqtt / zstandard wheels, mosquitto, the dataset) and a
# `.gpu/setup.sh` that installs them:
#     device run, carry [".gpu"]:  bash bench/gpu_checklist.sh
# Every step has its own deadline (the whole script ends by BUDGET_S, default 560 s, so one
# 600 s call returns everything); what each step wrote lands in $OUT/gpu.tgz, with the log in
# $OUT/checklist.log. Here, `python3 bench/gpu_collect.py <unpacked folder>` turns it into
# bench/results/server_gpu.json, fedgkt_fullscale.json and gpu_methods.json.
#
# Steps, in the checklist's order (the cheap, decisive ones first):
#   1. the CUDA tests of tests/test_server_step.py
#   2. bench/server_gpu.py: ResNet-55 at batch 64 and 256, fp32 and bf16: bare, eager, graph
#   3. full scale: 16 agent processes, full Fashion-MNIST, IID, FedGKT with preset paper-iid,
#      as many rounds of 10 as the budget leaves (stopped with SIGINT: report.json holds every
#      closed round)
#   4. every method, 2 agents x 2 rounds, all at once (centralized too; ~150 s)
#   5. bench/server_gpu.py compiled mode (compilation takes minutes), then ResNet-109
# SKIP="tests server55 methods compiled server109" leaves steps out (a later session that has
# their figures spends the call on the full-scale run); FULLSCALE_UNTIL (default 380) is the
# second of the budget the full-scale run must end by, FULLSCALE_ARGS adds launcher flags.
# The paper-iid preset trains the server 20 epochs a round: ~165 s a round on an H200
# (5.2 s an epoch at batch 256, bench/results/server_gpu.json, plus ~65 s of agents and
# evaluation), so one 600 s call holds about 3 rounds of it.
# nvidia-smi samples utilisation and memory every 0.5 s throughout (smi.csv), and each step's
# start and end are stamped in steps.csv, so the samples can be cut per step.
set -u
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s)
R=/tmp/gpu-res; rm -rf "$R"; mkdir -p "$R"
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
exec > >(tee "$OUT/checklist.log") 2>&1
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# until T: seconds from now until T seconds after the start, less a margin for packing up
until_t() { local t=$(( $1 - ($(date +%s) - START) )); [ "$t" -lt 5 ] && t=5; echo "$t"; }
skip() { case " ${SKIP:-} " in *" $1 "*) echo "== skipped: $1"; return 0;; esac; return 1; }
stamp() { echo "$1,$2,$(date +%s.%N)" >> "$R/steps.csv"; echo "== $(date +%T) [$(( $(date +%s) - START )) s] $1 $2"; }

source .gpu/setup.sh
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv,noheader -lms 500 > "$R/smi.csv" 2>&1 &
SMI=$!
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" > "$R/torch.txt" 2>&1

if ! skip tests; then
stamp tests start
# -k cuda: the CPU tests of the file run in CI; compiling the step takes ~40 s here
timeout "$(until_t 100)" python3 -m pytest -q -p no:cacheprovider tests/test_server_step.py -k cuda -rs --durations=5 > "$R/tests.log" 2>&1
echo "tests rc=$?" >> "$R/tests.log"; tail -3 "$R/tests.log"
stamp tests end
fi

if ! skip server55; then
stamp server55 start
timeout "$(until_t 170)" python3 bench/server_gpu.py --models resnet55_server --batches 64,256 --precisions fp32,bf16 \
  --modes bare,eager,graph --steps 40 --warmup 5 --repeats 2 --out "$R/server_gpu_55.json" > "$R/server55.log" 2>&1
echo "server55 rc=$?" >> "$R/server55.log"; cat "$R/server55.log"
stamp server55 end
fi

stamp fullscale start
timeout -s INT -k 20 "$(until_t "${FULLSCALE_UNTIL:-380}")" python3 -m cloud_server.launcher local --method fedgkt --agents 16 --rounds 10 \
  --train-samples 0 --test-samples 0 --partition iid --set fedgkt.preset=paper-iid --run-id fedgkt-fullscale ${FULLSCALE_ARGS:-} \
  --out "$R/fullscale" > "$R/fullscale.log" 2>&1
echo "fullscale rc=$?" >> "$R/fullscale.log"; grep -E "^round|rc=" "$R/fullscale.log" | tail -12
stamp fullscale end

if ! skip methods; then
stamp methods start
m_to=$(until_t $(( ${FULLSCALE_UNTIL:-380} + 150 )))  # 8 servers starting at once take ~40 s to connect
pids=()
for m in $(python3 -c "from shared_protocol.registry import registered_methods; print(' '.join(registered_methods()))"); do
  timeout -s INT -k 10 "$m_to" python3 -m cloud_server.launcher local --method "$m" --agents 2 --rounds 2 \
    --train-samples 1000 --test-samples 500 --partition iid --run-id "gpu-$m" --out "$R/methods/$m" > "$R/method-$m.log" 2>&1 &
  pids+=($!)
done
timeout -s INT -k 10 "$m_to" python3 -m cloud_server.launcher centralized --rounds 2 --train-samples 1000 --test-samples 500 \
  --device cuda --out "$R/methods/centralized" > "$R/method-centralized.log" 2>&1 &
pids+=($!)
for p in "${pids[@]}"; do wait "$p"; echo "method pid $p rc=$?" >> "$R/methods-rc.txt"; done
cat "$R/methods-rc.txt"
stamp methods end
fi

if ! skip compiled; then
stamp compiled start
timeout "$(until_t 550)" python3 bench/server_gpu.py --models resnet55_server --batches 256,64 --precisions fp32 \
  --modes eager,compiled --steps 40 --warmup 5 --repeats 2 --out "$R/server_gpu_55_compiled.json" > "$R/compiled.log" 2>&1
echo "compiled rc=$?" >> "$R/compiled.log"; cat "$R/compiled.log"
stamp compiled end
fi
if ! skip server109 && [ "$(left)" -gt 40 ]; then
  stamp server109 start
  timeout "$(until_t $((BUDGET_S - 10)))" python3 bench/server_gpu.py --models resnet109_server --batches 64,256 --precisions fp32 \
    --modes bare,eager,graph --steps 30 --warmup 5 --repeats 2 --out "$R/server_gpu_109.json" > "$R/server109.log" 2>&1
  echo "server109 rc=$?" >> "$R/server109.log"; cat "$R/server109.log"
  stamp server109 end
fi

kill "$SMI" 2>/dev/null
# the run folders' checkpoints and broker state are large and not needed here
rm -rf "$R"/fullscale/checkpoint "$R"/fullscale/agent-state "$R"/methods/*/checkpoint "$R"/methods/*/agent-state
tar -C "$R" -czf "$OUT/gpu.tgz" . && ls -la "$OUT"
echo "done in $(( $(date +%s) - START )) s"
