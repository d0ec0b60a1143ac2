#!/usr/bin/env bash
# The dtwatch demo: a real 4-rank DDP job on CPU (gloo) that hangs on a rank-conditional collective.
# dtwatch diagnoses it within its 5 s stall window, writes an incident bundle and ends the job.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[all]"

export OMP_NUM_THREADS=1
RUN_ROOT="${DTWATCH_DIR:-$(mktemp -d)/dtwatch}"
set +e
dtwatch run --dir "$RUN_ROOT" --stall-window 5 --fail-fast -- \
  torchrun --nproc-per-node 4 examples/hang_rank_conditional.py
status=$?
set -e
echo
echo "dtwatch run exited with $status (3 = dtwatch diagnosed the hang and ended the job)"
echo
dtwatch analyze "$RUN_ROOT" --svg "$RUN_ROOT/timeline.svg" || true
echo "timeline: $RUN_ROOT/timeline.svg"
