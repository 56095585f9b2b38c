#!/usr/bin/env bash
# Fetch the pure-Python wheels bench/gpu_single.py needs beyond the GPU image (pydantic and its
# parts) into .whl/ (git-ignored), for carrying to a device machine with Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
ls .whl
