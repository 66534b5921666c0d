#!/usr/bin/env bash
# The one-command GPU check (`make gpu-check`): on a CUDA machine, build what is needed and run
# every CUDA-only test (Model Runner V2 vs the reference loop, sync and async scheduling; TRL
# GRPO on the GPU; the Triton kernel against the torch path), the sampler benchmark on the GPU
# (the Triton kernel vs the torch path vs vLLM's CUDA sampling op, logits on the device), and the
# end-to-end throughput with the plugin on vs off under the V1 runner and under MRV2; then print
# one summary table. Each step has a time limit so the whole check stays under 8 minutes.
# Without a CUDA device it prints one line and exits 0 (CI has none).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no CUDA device on this machine; skipped (nothing was run)"
  exit 0
fi
VENV=${QMC_GPU_VENV:-.venv-gpu}
OUT=${QMC_GPU_OUT:-gpu-check}
mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q --upgrade pip setuptools wheel \
    && "$VENV/bin/pip" install -q -e '.[gpu,eval,dev]' || { echo "gpu-check: installing vllm (CUDA) failed"; exit 1; }
fi
PY="$VENV/bin/python"
nvidia-smi -L | tee "$OUT/device.txt"
declare -a rows=()
step() {  # step NAME LIMIT_S COMMAND...: run, keep the log, record status, seconds and the last line
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local status=pass; [ $rc -eq 124 ] && status=timeout; [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="fail($rc)"
  rows+=("$(printf '%-22s %-9s %5ss  %s' "$name" "$status" $((SECONDS - start)) "$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-90)")")
}
step cuda-tests 300 "$PY" -m pytest -q -n 0 -m cuda tests/core/test_triton_kernel.py tests/core/test_processing.py \
  tests/core/test_sample_group.py tests/vllm_plugin/test_mrv2_cuda.py tests/integrations/test_grpo_gpu.py
step sampler-bench 60 "$PY" benchmarks/sampler_bench.py --device cuda --quick --repeats 3
step e2e-v1 60 env VLLM_USE_V2_MODEL_RUNNER=0 "$PY" benchmarks/e2e_overhead.py --rounds 2
step e2e-mrv2-async 60 env VLLM_USE_V2_MODEL_RUNNER=1 "$PY" benchmarks/e2e_overhead.py --rounds 2
echo
printf '%-22s %-9s %6s  %s\n' step status time "last line of its log ($OUT/STEP.log)"
printf '%s\n' "${rows[@]}"
for row in "${rows[@]}"; do [[ $row == *" pass "* ]] || exit 1; done
