#!/usr/bin/env bash
# CI, beside the main suite: paratune on the oldest Ray it supports, installed as a user installs it.
# The built wheel goes core-only (no extra) into a clean virtual environment in a temporary folder,
# with Ray $RAY_VERSION, and runs from a folder with no checkout around it:
#   paratune spaces; a ZeRO plan refused naming paratune[deepspeed]; one FSDP2 trial; a two-trial
#   sweep of the shipped local_cpu space (its ZeRO plans dropped by rule); then, with the same venv,
#   tests/test_ray_range.py (worker startup, deadline, failure, return value, training outcome).
# Needs the development venv (.venv: uv, and torch's build found through PIP_FIND_LINKS as
# `make install` finds it); 7 min 40 s on 2 shared cores (2026-12-06: venv 11 s with uv's cache, trial 89 s,
# sweep 195 s, tests 150 s). RAY_VERSION=2.60.0 .ci/oldest_ray.sh runs the
# same with the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RAY_VERSION=${RAY_VERSION:-2.49.2}  # paratune.launch.OLDEST_RAY (pyproject's floor), its last patch
UV=$ROOT/.venv/bin/uv
PY=$ROOT/.venv/bin/python
WORK=$(mktemp -d "${TMPDIR:-/tmp}/paratune-oldest-ray.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS
say() { printf '[ray %s %4ds] %s\n' "$RAY_VERSION" $((SECONDS - T0)) "$*"; }

say "wheel"
"$UV" build -q --out-dir "$WORK/dist" "$ROOT"  # the sdist, then the wheel from it
WHEEL=$(ls "$WORK"/dist/paratune-*.whl)
say "clean venv: $(basename "$WHEEL") core-only, ray $RAY_VERSION"
grep -v '^torch==\|^ray==' "$ROOT/constraints.txt" > "$WORK/constraints.txt"
TORCH="torch==$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
LINKS=()
# pip's find-links (where make install's pip finds torch's build), from the environment or pip's config
for link in ${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}; do LINKS+=(--find-links "$link"); done
"$UV" venv -q "$WORK/venv" --python "$("$PY" -c 'import sys; print(sys._base_executable)')"
# No --compile-bytecode (~2 min on 2 cores: all of torch and Ray): PYTHONDONTWRITEBYTECODE is unset below,
# so the first process to import a module writes its .pyc and the later ones (Ray's workers) read it.
"$UV" pip install -q --python "$WORK/venv/bin/python" "${LINKS[@]}" -c "$WORK/constraints.txt" \
    "$TORCH" "ray[default,train,tune]==$RAY_VERSION" "$WHEEL" pytest pytest-timeout

mkdir "$WORK/work"
cd "$WORK/work"
unset PYTHONPATH VIRTUAL_ENV RAY_ADDRESS MLFLOW_TRACKING_URI PYTHONDONTWRITEBYTECODE
export PATH="$WORK/venv/bin:$PATH" PARATUNE_HOME="$WORK/home"
python - "$RAY_VERSION" "$WORK/venv" <<'EOF'
import importlib.util, sys
import paratune, ray
assert ray.__version__ == sys.argv[1], ray.__version__
assert paratune.__file__.startswith(sys.argv[2]), paratune.__file__  # the wheel's, not a checkout's
missing = [m for m in ("deepspeed", "torchao", "peft", "accelerate") if importlib.util.find_spec(m)]
assert not missing, f"a core install has {missing}"
EOF
paratune spaces > spaces.txt
grep -q "local_cpu" spaces.txt

say "a ZeRO plan is refused naming the extra"
cat > plan.yaml <<'EOF'
model: tiny-llama
seq_len: 32
global_batch: 8
micro_batch: 2
num_workers: 2
strategy: fsdp
warmup_steps: 1
measure_steps: 3
profile_comm: false
EOF
sed 's/strategy: fsdp/strategy: zero/' plan.yaml > zero.yaml
if paratune validate zero.yaml > zero.txt 2>&1; then cat zero.txt; echo "a ZeRO plan passed without DeepSpeed"; exit 1; fi
tr -s ' \n' ' ' < zero.txt | grep -q "install it with pip install 'paratune\[deepspeed\]'" || { cat zero.txt; exit 1; }

say "one FSDP2 trial"
paratune trial plan.yaml --json trial.json
python -c "import json; [r] = json.load(open('trial.json')); assert r['status'] == 'ok', r"

say "a two-trial sweep of the shipped local_cpu space"
paratune tune local_cpu --trials 2 --search random --out "$WORK/sweep" | tee tune.txt
tr -s ' \n' ' ' < tune.txt | grep -q "24 x strategy: 'zero' needs DeepSpeed, which is not installed"
test -f "$WORK/sweep/winner/plan.yaml"

say "worker startup, deadline, failure, return value, training outcome (tests/test_ray_range.py)"
cd "$ROOT"
"$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_ray_range.py
say "done"
