#!/usr/bin/env bash
# The Python packages neorec needs beyond torch, numpy, pyarrow and pyyaml, unpacked into .whl/site
# for a machine without network whose Python may differ from this one's (a GPU machine that has a
# CUDA build of torch and Triton and nothing else):
#
#   bash scripts/gpu-wheels.sh 3.12     # here, with network; then copy .whl/site along with the tree
#
# scripts/gpu-check.sh puts .whl/site on PYTHONPATH when it is there. pydantic-core is compiled, so
# the wheels are for the other machine's Python version (x86_64 Linux).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
ABI=cp${PYVER/./}
rm -rf .whl/wheels .whl/site
mkdir -p .whl/wheels .whl/site
pip download --quiet --only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl/wheels pydantic tqdm
for wheel in .whl/wheels/*.whl; do
    python -m zipfile -e "$wheel" .whl/site
done
echo "$(ls .whl/wheels | wc -l) wheels for Python $PYVER in .whl/site ($(du -sh .whl/site | cut -f1))"
