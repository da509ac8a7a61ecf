# EdgeSplit: the two commands a user needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
APT_PACKAGES := mosquitto mosquitto-clients dataset-fashion-mnist
# What only the tests need: shell-script linting, and a headless browser for the status page
# (its test skips, saying why, where chromium cannot be installed).
TEST_APT_PACKAGES := shellcheck
TEST_APT_OPTIONAL := chromium
# torch/torchvision pinned to the pair that lies on disk on the dev machine;
# override on other machines (e.g. TORCH_SPEC="torch torchvision").
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# The suite runs in parallel processes (pytest-xdist), a test file per process at a time: many
# tests wait on brokers, subprocesses and deadlines, so even 2 cores run more than 2 workers well.
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 3

.PHONY: all venv system-deps test test-fast demo bench bench-micro bench-methods bench-kd bench-quick clean

all: test

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

system-deps:
	@bash deploy/ensure_system_deps.sh $(APT_PACKAGES)

test: venv system-deps
	@bash deploy/ensure_system_deps.sh $(TEST_APT_PACKAGES)
	@bash deploy/ensure_system_deps.sh $(TEST_APT_OPTIONAL) || echo "$(TEST_APT_OPTIONAL) not installed: the tests that need it skip and say why"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

demo: venv system-deps
	$(VENV)/bin/edgesplit local --method fedgkt --agents 4 --rounds 6 --train-samples 3000 --test-samples 1000 --dataset fashion-mnist --partition dirichlet:0.5 --run-id demo --out runs/demo

# The benchmarks behind docs/results.md, on 2 idle cores; each experiment resumes where it stopped
# and skips the runs it has recorded. Table 1 with Table 2 and the other methods on its setting
# (bench/experiments/table1.toml), Table 3 (sync vs async on make demo's
# setting) and the communication cost.
bench: venv system-deps
	$(MAKE) bench-micro
	$(VENV)/bin/edgesplit bench run bench/experiments/table1.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/fedgkt_async.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/comm_cost.toml
	$(PY) bench/render_results.py

# The micro-benchmarks (bench/micro/: pytest-benchmark), one JSON each in bench/results/, one thread:
# codecs (about 2 min on 2 loaded cores), edge_cost (about 1), transport (about 1), server_loop
# (about 15: a cold torch.compile and 5 repeats of two training loops), step_memory (about 3).
# Named only when asked: footprint (hours: its long runs; MICRO_ARGS='-k "not long_run"' leaves them out), scale
# (about 15), metrics_overhead (about 30: six demo runs). `make bench-micro MICRO=codecs` runs
# one; MICRO_ARGS=--quick runs them at small sizes.
MICRO ?= codecs edge_cost transport server_loop step_memory
MICRO_ARGS ?=
bench-micro: venv
	for name in $(MICRO); do OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider bench/micro/test_$$name.py \
		$(MICRO_ARGS) --benchmark-json=bench/results/$$name.json || exit 1; done
	$(PY) bench/render_results.py

# FedGKT's server epochs per round, the one-factor-at-a-time ablation, and what --low-memory's
# micro-batches cost in accuracy.
bench-methods: venv system-deps
	$(VENV)/bin/edgesplit bench run bench/experiments/gkt_server_epochs.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/fedgkt_ablation.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/low_memory.toml
	$(PY) bench/render_results.py

# The knowledge-distillation methods against their papers' claims (about 150 minutes on 2 idle
# cores), then their ablations and searches: FedKD one factor at a time (about 65), FedDistill's
# loss weights (about 90), FedBE's unlabeled set (about 60), the grid's regime (about 20) and
# FedKD's bytes (about 5). Cells already recorded are skipped.
bench-kd: venv system-deps
	$(VENV)/bin/edgesplit bench run bench/experiments/kd_methods.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/fedkd_ablation.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/feddistill_weights.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/fedbe_unlabeled.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/kd_regime.toml
	$(VENV)/bin/edgesplit bench run bench/experiments/fedkd_bytes.toml
	$(PY) bench/render_results.py

# The pipeline check: one small run through the runner, audit included (under a minute).
bench-quick: venv system-deps
	$(VENV)/bin/edgesplit bench run bench/experiments/smoke.toml --results runs/bench-quick/smoke.json --runs-dir runs/bench-quick/runs

clean:
	rm -rf $(VENV) runs .pytest_cache
