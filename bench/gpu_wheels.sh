#!/usr/bin/env bash
# Fetch the wheels bench/gpu_single.py and bench/gpu_acceptance.py need beyond the GPU image
# (pydantic and its parts; DeepSpeed, which PyPI ships as source only, built here into a pure-Python
# wheel with no prebuilt ops, and hjson; torchao 0.18 for the float8 family, 3.3 MB: its float8
# training is Python over torch's _scaled_mm, its optional C++ ops are built for torch >= 2.11,
# the image's) into .whl/ (git-ignored), for carrying to a device machine
# with Python 3.12. The image's own transformers (5.17) serves: the acceptance smoke runs against it
# in the tests (bench/gpu_image.txt). At most 64 MiB travel with a run, the working tree included:
# this checks the total.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl hjson==3.1.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl torchao==0.18.0
# DeepSpeed's setup.py imports torch: build with the project's venv (make install), no isolation.
DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -l .whl
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s+=$1} END {print s}')
echo "wheels $((wheels / 1024)) KiB + working tree $((tree / 1024)) KiB of the 64 MiB a run carries"
test $((wheels + tree)) -lt $((64 * 1024 * 1024)) || { echo "over the 64 MiB limit" >&2; exit 1; }
