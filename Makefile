# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs the pinned environment first (constraints.txt pins torch to
# the CPU build here; see README for GPU clusters).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
export CPU_ADAM_BUILD = from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)

.PHONY: demo test test-e2e test-matrix test-kernels test-all test-fast install bench clean

# torch through pip (the machine's pip configuration finds the local CPU wheel); everything else
# through uv (same pins, ~10x faster than pip here). Bytecode is compiled once, at install, for
# everything (pip compiles torch and its dependencies, uv the rest): this environment sets
# PYTHONDONTWRITEBYTECODE, so a module without a .pyc is compiled again in every process that
# imports it (torch and sympy uncompiled: +1.5 CPU-s for every `import torch`, in every Ray worker).
# torchtitan without its dependencies (its pins would downgrade huggingface-hub under transformers;
# only its config parser is used, to check the winner's torchtitan export). The last line: the GPU image's transformers (bench/gpu_image.txt) beside the venv, not in it, for
# the test that runs the GPU acceptance script as that image would (tests/test_gpu_acceptance.py).
# DeepSpeed's CPU Adam (ZeRO offload's optimizer step) is a C++ op torch JIT-builds at first use,
# ~125 CPU-s, again for every new venv path (the include paths are in torch's build key): built here,
# once per venv, like DeepSpeed's own DS_BUILD_CPU_ADAM install, not inside the first test that needs it.
$(STAMP): pyproject.toml constraints.txt bench/gpu_image.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt uv torch==2.13.0
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -c constraints.txt -e '.[all,test]'
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode --no-deps -c constraints.txt torchtitan
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode --target $(VENV)/gpu-image-site -r bench/gpu_image.txt
	$(BIN)/python -c "$$CPU_ADAM_BUILD" >/dev/null 2>&1 && touch $(VENV)/.cpu_adam_built \
	  || echo "note: DeepSpeed's CPU Adam did not build (a C++ compiler?); ZeRO offload's test builds it at first use"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/paratune tune search_spaces/local_cpu.yaml --out paratune_runs/demo-$$(date +%Y%m%d-%H%M%S)

# One test process by default. TEST_WORKERS=2: two (pytest-xdist), one module at a time in each, the
# Ray modules first (tests/conftest.py). On 2 cores the suite is bound by its CPU work (~3,000 CPU-s):
# two processes kept the cores 93% busy and took 26 min 11 s from a fresh clone, one process 27 min
# 55 s (bench/results/test_suite_time.md, 2026-12-07): not enough gain for two processes' timing
# noise in every test, so not the default.
# Three tiers (pyproject.toml's markers), each test in one; CI (.ci/run) runs all three, in this order.
# `make test`: every unit test, every strategy and lever on gloo and DeepSpeed, and each layer end to
# end on real Ray: a fresh trial and reused worker groups with their failures (test_session), a Ray Tune
# + Optuna sweep into MLflow (test_sweep), a training run (test_ray_range). Within 15 minutes here.
# `make test-e2e`: the tests marked `e2e`, each capability's whole flow as a user runs it (the
# multi-node `ray job submit` cluster and its faults, the README's fine-tune, the wheel, the MLflow
# server, the user loop's and the MoE sweeps, the GPU acceptance script); each names the kept test
# that runs its layer. `make test-matrix`: the tests marked `matrix`, further parameter values of code
# paths kept tests run (every family x strategy, every layout x option). `make test-all`: everything.
TEST_WORKERS ?= 0
test: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not matrix and not e2e" --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "e2e and not matrix" --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-matrix: $(STAMP)
	$(BIN)/python -m pytest -q -x -m matrix --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The modules whose verdicts rest on rounding (loss parity: the proxy, every family, every layout on gloo;
# the exported weights; float8; expert parallelism and the MoE families) again under two other CPU kernel
# sets. torch picks its kernels by the CPU (avx512 on one machine, avx2 on another), and so does MKL's
# sgemm (on AMD and Intel alike): other summation orders, the same tests. ATEN_CPU_CAPABILITY and
# MKL_CBWR, read at start and inherited by the gloo and Ray workers, make this machine run another's
# (avx2 + MKL's AVX2 path; torch's default + MKL's compatible path), so a kernel-dependent result shows
# here first. The suite is proven under the machine's own and these two (docs/DESIGN.md, "Kernels").
# torch.compile's CPU code is generated for the same instruction set, and Inductor's cache does not key
# it: kernels cached under avx512 and reused under avx2 gave NaN (torch 2.13, 2026-12-07), so each kernel
# set compiles into a cache of its own.
KERNEL_MODULES = tests/test_proxy.py tests/test_families.py tests/test_parity_gloo.py tests/test_hf_export.py \
                 tests/test_float8.py tests/test_expert_parallel.py tests/test_moe_families.py \
                 tests/test_recompute_compile.py
test-kernels: $(STAMP)
	for cap in avx2:AVX2 default:COMPATIBLE; do \
	  echo "ATEN_CPU_CAPABILITY=$${cap%%:*} MKL_CBWR=$${cap##*:}"; \
	  ATEN_CPU_CAPABILITY=$${cap%%:*} MKL_CBWR=$${cap##*:} TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/paratune-inductor-$${cap%%:*} \
	    $(BIN)/python -m pytest -q -x -m "not matrix and not e2e" $(KERNEL_MODULES) || exit 1; \
	done

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The edit-run loop: unit tests only (pure planning, estimates, parsing, configs; no Ray workers).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not integration" --durations=5

bench: $(STAMP)
	$(BIN)/python bench/strategies_cpu.py

clean:
	rm -rf $(VENV) paratune_runs
