#!/usr/bin/env bash
# The one-command GPU check (`make gpu-check`), made for a CUDA machine with no network: it uses the
# `python3` it finds (or $QMC_GPU_PYTHON) when that Python has torch with CUDA, installs and builds
# nothing, downloads nothing, and runs the package from this checkout. Steps, each time-limited so
# that the whole check stays under 8 minutes:
#   cuda-tests       every CUDA test that needs no vLLM (pytest -m cuda): the Triton kernel vs the torch
#                    path on tie-heavy/flat/peaked rows, per-member chi-square of the core on the GPU,
#                    transformers' generate on the GPU with QMCGenerate, the core's filters on the GPU;
#   no-host-syncs    the kernel step, the plugin's device carry and the HF forcer, each over a whole
#                    group, under torch.cuda.set_sync_debug_mode("error") (tests/core/test_cuda_syncs.py);
#   sampler-bench    the Triton kernel vs the torch path vs transformers' sort-based top-k/top-p sampling
#                    (vs vLLM's op where vLLM is installed) vs the bandwidth floor, batch 1/32/256;
#   hf-throughput    transformers on the GPU: a random Llama-3.2-1B (bf16), QMCGenerate("lattice") vs
#                    plain sampling, tokens/s ratio over three alternating rounds;
#   vLLM steps       Model Runner V2 and TRL GRPO tests and the end-to-end throughput (V1, MRV2): run
#                    only where the Python has vLLM (and TRL); otherwise one "skipped" line each.
# One summary table goes to $OUT/summary.txt (and the terminal); each step's log to $OUT/STEP.log.
# Exit status: 0 when every step passed or was skipped, 1 otherwise.
#
# Without a CUDA device it prints one line and exits 0 (CI has none).
# QMC_GPU_CHECK_DRY_RUN=1: the same script on a machine without a GPU, every CUDA step swapped for its
# CPU stand-in: the tests run on the CPU (QMC_GPU_CHECK_DEVICE=cpu), the Triton kernel through
# Triton's interpreter (TRITON_INTERPRET=1) where that works, the sizes shrink, and the sync checks
# only record host reads. It checks the plumbing (imports, arguments, the table), not the GPU.
# Settings: QMC_GPU_PYTHON (default python3), QMC_GPU_OUT (default gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${QMC_GPU_CHECK_DRY_RUN:-0}
if [ "$DRY" != 1 ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }; then
  echo "gpu-check: no CUDA device on this machine; skipped (nothing was run)"
  exit 0
fi
PY=${QMC_GPU_PYTHON:-python3}
OUT=${QMC_GPU_OUT:-gpu-check}
BEGIN=$SECONDS

# The Python as it is: torch (with CUDA unless this is a dry run), nothing installed here.
if ! versions=$("$PY" -P -c "
import importlib.util as u, torch
have = lambda m: u.find_spec(m) is not None
def version(m):
    if not have(m):
        return 'absent'
    from importlib.metadata import PackageNotFoundError, version as v
    try:
        return v(m)
    except PackageNotFoundError:
        return 'present'
print(f'python {__import__(\"platform\").python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, '
      f'available: {torch.cuda.is_available()}), ' + ', '.join(f'{m} {version(m)}' for m in
      ('triton', 'transformers', 'numpy', 'scipy', 'pytest', 'vllm', 'trl')))
" 2>&1); then
  echo "gpu-check: $PY cannot import torch: ${versions##*$'\n'}"
  exit 1
fi
if [ "$DRY" != 1 ] && [[ $versions != *"available: True"* ]]; then
  echo "gpu-check: $PY has no torch with CUDA ($versions); set QMC_GPU_PYTHON to one that has"
  exit 1
fi
has() { [[ $versions != *"$1 absent"* ]]; }
mkdir -p "$OUT"

# The package from this checkout, as setup.py lays it out (its SUBPACKAGES: hf/, server/, … become
# qmc_sampler.hf, …): a temporary folder of links on PYTHONPATH, nothing built or installed (the C++
# CPU kernel is left out, as on a fresh checkout: CPU logits take the torch path). Python runs with
# -P, so the checkout's own qmc_sampler/ (without those subpackages) does not shadow it. The import
# check takes vllm_engine too: the vLLM steps need it, and the dry run skips them.
PKG=$(mktemp -d)
trap 'rm -rf "$PKG"' EXIT
mkdir "$PKG/qmc_sampler"
for entry in "$PWD"/qmc_sampler/*; do
  case $entry in *.so | */__pycache__) ;; *) ln -s "$entry" "$PKG/qmc_sampler/" ;; esac
done
if ! "$PY" -P tests/package_layout.py >"$PKG/layout" 2>"$PKG/layout.err"; then
  echo "gpu-check: cannot read setup.py's SUBPACKAGES: $(tail -1 "$PKG/layout.err")"
  exit 1
fi
while IFS='=' read -r name folder; do
  ln -sn "$PWD/$folder" "$PKG/qmc_sampler/$name" || exit 1
done <"$PKG/layout"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! where=$("$PY" -P -c "import qmc_sampler.hf, qmc_sampler.kernels, qmc_sampler.vllm_engine.compat; print(qmc_sampler.__file__)" 2>&1); then
  echo "gpu-check: the package does not import from this checkout: ${where##*$'\n'}"
  exit 1
fi

if [ "$DRY" = 1 ]; then
  MODE="dry run (QMC_GPU_CHECK_DRY_RUN=1): CPU stand-ins, small sizes"
  DEVICE=cpu
  export QMC_GPU_CHECK_DEVICE=cpu
  # The kernel through Triton's interpreter, where this Triton's interpreter runs it.
  if probe=$(TRITON_INTERPRET=1 timeout 120 "$PY" -P -c "
import torch
from qmc_sampler.triton_kernels import triton_inverse_cdf
t, s, p = triton_inverse_cdf(torch.randn(2, 300), torch.rand(2, dtype=torch.float64), torch.ones(2), None)
assert (t >= 0).all()" 2>&1); then
    KERNEL="the Triton kernel runs under TRITON_INTERPRET=1"
    INTERP=(TRITON_INTERPRET=1)
    BENCH_BACKEND=(TRITON_INTERPRET=1 QMC_SAMPLER_BACKEND=triton)
  else
    KERNEL="Triton's interpreter fails here (${probe##*$'\n'}): kernel tests skip, the bench's fused column is the CPU backend"
    INTERP=()
    BENCH_BACKEND=()
  fi
  DEVICE_LINE="none (dry run); $KERNEL"
  BENCH_ARGS=(--device cpu --batches 2 --vocabs 1100 --repeats 1 --no-vllm)
  HF_ARGS=(--device cpu --tiny)
else
  MODE="GPU"
  DEVICE=cuda
  INTERP=()
  BENCH_BACKEND=()
  DEVICE_LINE=$(nvidia-smi -L 2>&1 | head -4 | tr '\n' ' ')
  BENCH_ARGS=(--device cuda --repeats 5)
  HF_ARGS=(--device cuda)
fi
printf 'device: %s\n%s\npackage: %s (links to %s)\n' "$DEVICE_LINE" "$versions" "$where" "$PWD" | tee "$OUT/env.txt"

declare -a rows=()
row() { rows+=("$(printf '%-16s %-9s %5ss  %s' "$1" "$2" "$3" "$4")"); }
step() {  # step NAME LIMIT_S COMMAND...: run, keep the log, record status, seconds and the log's last line
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "gpu-check: $name (at most ${limit}s) ..."
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local status=pass; [ $rc -eq 124 ] && status=timeout; [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="fail($rc)"
  row "$name" "$status" $((SECONDS - start)) "$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-100)"
}
skip() { echo "gpu-check: $1 skipped: $2"; row "$1" skipped 0 "$2"; }
PYTEST=("$PY" -P -m pytest -q -p no:cacheprovider -o "addopts=-ra --import-mode=importlib --durations=5" -m cuda)

# Limits: 120 + 60 + 120 + 120 = 420 s of steps, under 8 minutes with the set-up.
step cuda-tests 120 env "${INTERP[@]}" "${PYTEST[@]}" tests/core/test_cuda_paths.py tests/core/test_triton_kernel.py \
  tests/core/test_processing.py tests/core/test_sample_group.py tests/hf/test_generate_cuda.py
step no-host-syncs 60 env "${INTERP[@]}" "${PYTEST[@]}" tests/core/test_cuda_syncs.py
step sampler-bench 120 env "${BENCH_BACKEND[@]}" "$PY" benchmarks/sampler_bench.py "${BENCH_ARGS[@]}"
step hf-throughput 120 "$PY" benchmarks/hf_throughput.py "${HF_ARGS[@]}"

# vLLM on a GPU: only where this Python has vLLM's CUDA build (the GPU machine this check is made for has none).
if [ "$DRY" = 1 ]; then
  why="dry run: vLLM's steps need vLLM on a GPU"
elif ! has vllm; then
  why="vLLM is not installed in $PY"
else
  why=""
fi
if [ -n "$why" ]; then
  for name in vllm-mrv2-tests trl-grpo-test e2e-v1 e2e-mrv2-async; do skip "$name" "$why"; done
else
  step vllm-mrv2-tests 300 "${PYTEST[@]}" tests/vllm_plugin/test_mrv2_cuda.py
  if has trl; then
    step trl-grpo-test 300 "${PYTEST[@]}" tests/integrations/test_grpo_gpu.py
  else
    skip trl-grpo-test "TRL is not installed in $PY"
  fi
  step e2e-v1 120 env VLLM_USE_V2_MODEL_RUNNER=0 "$PY" benchmarks/e2e_overhead.py --rounds 2
  step e2e-mrv2-async 120 env VLLM_USE_V2_MODEL_RUNNER=1 "$PY" benchmarks/e2e_overhead.py --rounds 2
fi

{
  echo "gpu-check $(date -u '+%Y-%m-%d %H:%M UTC'), $MODE, $((SECONDS - BEGIN)) s in all"
  cat "$OUT/env.txt"
  echo
  printf '%-16s %-9s %6s  %s\n' step status time "last line of its log ($OUT/STEP.log)"
  printf '%s\n' "${rows[@]}"
  if [ -s "$OUT/sampler-bench.log" ]; then
    echo; echo "sampler-bench ($DEVICE):"; grep -E '^ *(batch|-{20}|[0-9]+ )|^(fused|summary)' "$OUT/sampler-bench.log"
  fi
  if [ -s "$OUT/hf-throughput.log" ]; then
    echo; echo "hf-throughput ($DEVICE):"; grep -E '^(model|round|lattice/plain)' "$OUT/hf-throughput.log"
  fi
} >"$OUT/summary.txt"
echo
cat "$OUT/summary.txt"
for r in "${rows[@]}"; do [[ $r =~ ^[^\ ]+\ +(pass|skipped)\  ]] || exit 1; done
exit 0
