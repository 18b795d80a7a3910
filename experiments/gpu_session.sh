#!/usr/bin/env bash
# The GPU checks of issues 60 and 61 in one device call (about 9 minutes on an H100; random weights
# of the default model's shape, so nothing is carried but the working tree):
#   graphs.py's replayed step against eager and transformers' compiled generate (gpu_check.py),
#   exact.py's cost against the fast path (exact_cost.py), and the CUDA-only tests of both.
#     bash experiments/gpu_session.sh OUT          # OUT: a folder for the two markdown tables
#     bash experiments/gpu_session.sh OUT --tiny   # the same on a CPU in about a minute (a check)
set -u
out=${1:?a folder for the tables}
tiny=${2:-}
mkdir -p "$out"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
python experiments/gpu_check.py $tiny --out "$out/gpu-check.md" || echo "gpu_check.py failed"
if [ -n "$tiny" ]; then export TRITON_INTERPRET=1; fi
python experiments/exact_cost.py $tiny --out "$out/exact-cost.md" || echo "exact_cost.py failed"
if [ -z "$tiny" ]; then
    python -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_exact.py -k cuda
fi
