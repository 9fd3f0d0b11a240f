#!/usr/bin/env bash
# Installs everything the test suite needs: neorec itself (editable) with its `test` extra, Triton
# for tests/test_triton_kernels.py and test_triton_engine.py (they run the GPU kernels through
# Triton's interpreter where there is no GPU), then TorchRec for tests/test_torchrec_interop.py.
# TorchRec goes in with --no-deps because its declared dependency on the CUDA build of fbgemm-gpu
# would replace the CPU torch; the CPU build fbgemm-gpu-cpu, matched to torch 2.13, and TorchRec's
# few pure-Python dependencies are installed explicitly instead.
# Safe to rerun: when the pinned versions are already there it only refreshes the editable install.
set -euo pipefail
cd "$(dirname "$0")/.."

PIP=(python3 -m pip install -q -c constraints.txt)
"${PIP[@]}" -e ".[test]"

have() {  # have NAME [VERSION]...: every named distribution installed (at that version when given)
    python3 - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        got = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if want and got != want:
        sys.exit(1)
PY
}

# The version constraints.txt pins (the one CUDA builds of torch 2.13 require); a Triton already
# there, such as the one a CUDA build of torch brought, is kept.
if ! have triton; then
    "${PIP[@]}" "$(grep '^triton==' constraints.txt)"
fi
python3 -c "import triton" || { echo "install-test-deps: triton does not import" >&2; exit 1; }
if ! have fbgemm-gpu-cpu==1.8.0; then
    "${PIP[@]}" fbgemm-gpu-cpu==1.8.0
fi
if ! have torchrec==1.8.0; then
    python3 -m pip install -q --no-deps torchrec==1.8.0
    echo "install-test-deps: pip may print an ERROR that torchrec requires fbgemm-gpu: expected, since" \
         "torchrec is installed without its dependencies and fbgemm-gpu-cpu stands in for fbgemm-gpu"
fi
if ! have tensordict torchmetrics==1.0.3 tqdm pyre-extensions; then
    "${PIP[@]}" tensordict torchmetrics==1.0.3 tqdm pyre-extensions
fi
python3 -c "import torchrec" || { echo "install-test-deps: torchrec does not import" >&2; exit 1; }
