#!/usr/bin/env bash
# dtwatch on one GPU: a bounded, one-shot check of the NCCL/CUDA paths (docs/gpu-check.md).
#
#   bash benchmarks/gpu_check/run.sh                    on the GPU machine, from the checkout
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check/run.sh    CPU mode: gloo on the CPU, GPU-only checks SKIP
#
# Writes $OUT/gpu_check.log (everything) and $OUT/summary.json (OUT defaults to /tmp/gpu_check_out).
# Each step is a Python process of its own under `timeout`; the processes it started are ended afterwards
# by PID (found by GPU_CHECK_MARK in their environment), never by name. GPU_CHECK_TOTAL (330 s) bounds
# the whole run, GPU_CHECK_STEPS picks steps, GPU_CHECK_PYTHON the interpreter (python3).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

export GPU_CHECK_WORK="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check_work}"
rm -rf "$GPU_CHECK_WORK"
mkdir -p "$GPU_CHECK_WORK"
PY="${GPU_CHECK_PYTHON:-python3}"
TOTAL="${GPU_CHECK_TOTAL:-330}"
STEPS="${GPU_CHECK_STEPS:-env record pair nvml overhead}"
declare -A LIMIT=([env]=45 [record]=60 [pair]=150 [nvml]=40 [overhead]=60)  # seconds, clamped to what is left
START=$(date +%s)

# A clean dtwatch environment: nothing inherited from the caller's DTWATCH_* settings.
for var in $(compgen -e); do
  case "$var" in DTWATCH_*) unset "$var" ;; esac
done
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1
export DTWATCH_DIR="$GPU_CHECK_WORK/dtwatch-default"

echo "dtwatch GPU check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), python: $PY, steps: $STEPS, budget ${TOTAL} s"
[ "${GPU_CHECK_CPU:-0}" = "1" ] && echo "CPU mode: NCCL/CUDA replaced by gloo/CPU; GPU-only checks say SKIP"

# py-spy (the watchdog's stack dumps) from a wheel carried in wheels/, if any; without it stacks come from
# faulthandler.
SITE="$GPU_CHECK_WORK/site"
if ls "$HERE"/wheels/*.whl >/dev/null 2>&1; then
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$HERE"/wheels/*.whl || echo "[INFO] the carried wheels did not install; continuing without them"
  export PATH="$SITE/bin:$PATH"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # dtwatch from this checkout

run_step() {
  local name=$1 limit left mark rc
  limit=${LIMIT[$name]:-}
  echo
  echo "================ $name ================"
  if [ -z "$limit" ] || [ ! -f "$HERE/step_$name.py" ]; then
    echo "[FAIL] unknown step '$name' (steps: ${!LIMIT[*]})"
    touch "$GPU_CHECK_WORK/crashed-$name"
    return
  fi
  left=$(( TOTAL - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then
    echo "[FAIL] $name NOT RUN: ${left} s left of the ${TOTAL} s budget"
    touch "$GPU_CHECK_WORK/skipped-$name"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  mark="gpucheck-$$-$name"
  GPU_CHECK_MARK="$mark" timeout -k 5 "$limit" "$PY" "$HERE/step_$name.py" "$limit"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "[FAIL] $name TIMEOUT: ended after ${limit} s; the last lines of its processes:"
    touch "$GPU_CHECK_WORK/timeout-$name"
    for f in "$GPU_CHECK_WORK/$name"/*.out; do
      [ -f "$f" ] || continue
      echo "  --- $(basename "$f") ---"
      tail -n 20 "$f" | sed 's/^/  | /'
    done
  elif [ "$rc" -ne 0 ]; then
    echo "[FAIL] $name ERROR: the step exited with status $rc"
    touch "$GPU_CHECK_WORK/crashed-$name"
  fi
  "$PY" "$HERE/reap.py" "$mark"
}

for name in $STEPS; do
  run_step "$name"
done

"$PY" "$HERE/summary.py" "$OUT" "$(( $(date +%s) - START ))" "$(echo $STEPS | tr ' ' ',')"
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit 0
