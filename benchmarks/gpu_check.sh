#!/usr/bin/env bash
# The one script to run on a lent GPU (DESIGN.md: "Testing without a GPU"), inside ~8 minutes:
# build with what the machine has (it has no package registry), run the parity suite on CUDA, then
# print the kernel and end-to-end tables. Logs and JSON go to $OUT (the device tool brings it back).
#   usage: bash benchmarks/gpu_check.sh        (device tool: OUT is set; elsewhere benchmarks/out/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
step() { echo; echo "=== $1 ($(date +%T))"; }

step environment
$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/env.txt"

step "build fastbert._C (CPU kernels; CUDA kernels where the toolkit and a CUDA torch exist)"
$PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  && echo built || echo "build failed (see build.log): the cpu/cuda backends report why, triton still runs"
# Without an install, kernels/ is not yet fastbert.kernels: link it (untracked) so the triton backend imports.
$PY -c "import fastbert.kernels" 2>/dev/null || ln -sfn ../kernels fastbert/kernels
$PY -m fastbert info 2>&1 | tee "$OUT/info.txt"

step "parity on CUDA: every gpu backend vs the float64 reference, forward and backward, fp32/fp16/bf16"
# Every test of tests/ops/ named for triton or cuda (parametrized by backend or written for one), hypothesis
# property tests aside (the machine has no hypothesis; elsewhere they would outgrow the budget).
timeout 300 $PY -m pytest -q -p no:cacheprovider -k "(triton or cuda) and not properties" \
  tests/ops tests/test_model.py tests/test_build.py 2>&1 | tee "$OUT/parity.log" | tail -25

step "kernel benchmarks on CUDA (each backend beside torch's built-in and the reference)"
timeout 150 $PY -m pytest -q -p no:cacheprovider benchmarks --benchmark-columns=median,iqr,rounds \
  --benchmark-group-by=group --benchmark-sort=name --benchmark-json="$OUT/kernels.json" 2>&1 \
  | grep -E "^-+ benchmark|^test_|passed|failed|Error" | tee "$OUT/kernels.log"

step "end to end on CUDA: fastbert vs transformers eager/sdpa and torch's nested encoder"
timeout 150 $PY -m fastbert bench --device cuda --models base --dtypes bf16,fp16 --shapes 8x128,8x512,ragged32 \
  --competitors fastbert,hf-eager,hf-sdpa,nested --rounds 10 --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^\["
echo; echo "done $(date +%T); results in $OUT"
