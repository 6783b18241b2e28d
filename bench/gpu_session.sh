#!/usr/bin/env bash
# The checks of issue 21 that need a GPU (items 3 and 4, and the loop overhead there), as one short
# script per device command (each under the device tool's 10-minute limit; a session has 15 minutes
# of device time in all):
#
#   bash bench/gpu_session.sh tests   # pytest tests/test_cuda.py (the CUDA path), then bench_gpu.py at
#                                     # 2 GB: floor, ours, ours_noyield, dcp_pinned, restore  (~6-7 min)
#   bash bench/gpu_session.sh 8gb     # bench_gpu.py at 8 GB: floor, ours, dcp_pinned, restore  (~6 min)
#
# It uses the machine's own python3 and torch (PY to use another), the package from this checkout
# (on PYTHONPATH: nothing is installed), and writes its logs and tables under $OUT (else bench/out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PY:-python3}"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
case "${1:-tests}" in
  tests)
    $py -m pytest tests/test_cuda.py -m cuda -q -p no:cacheprovider 2>&1 | tee "$out/cuda-tests.log"
    $py bench/bench_gpu.py --gb 2 --budget-s 150 --only floor,ours,ours_noyield,dcp_pinned \
        --md "$out/gpu-2gb.md" --json "$out/gpu-2gb.json" 2>&1 | tee "$out/gpu-2gb.log" | grep -v '^ *$' | tail -40
    ;;
  8gb)
    $py bench/bench_gpu.py --gb 8 --budget-s 240 --only floor,ours,dcp_pinned \
        --md "$out/gpu-8gb.md" --json "$out/gpu-8gb.json" 2>&1 | tee "$out/gpu-8gb.log" | grep -v '^ *$' | tail -40
    ;;
  *)
    echo "usage: bash bench/gpu_session.sh [tests|8gb]" >&2
    exit 2
    ;;
esac
