#!/bin/bash
# TRL and the pure-Python packages it needs that a GPU host without network may lack (an image
# with torch, transformers, accelerate, pyarrow and pandas, as the device machine's), downloaded
# here as wheels into .whl/ (git-ignored) for Python 3.12, to travel with the checkout. There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (`benches/gpu/h100.sh trl` does it). About 1.7 MB.
set -euo pipefail
[ -f Cargo.toml ] || { echo "run from the project root" >&2; exit 2; }
mkdir -p .git/info; grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
ls .whl
