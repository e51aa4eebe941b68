#!/usr/bin/env bash
# Where the host's time goes in `cmpchat run` (py-spy, every thread, raw collapsed stacks) on a benchmark
# shape, beside the same shape's graph-replay decode rate (no host loop). Run on the GPU machine:
#
#   bash cuda/host_profile.sh [SHAPE] [TOKENS]      (default 0.8B 3000)
#
# Wheels from .whl/ are installed as gpu_run.sh does. Output: $OUT (or out/host-profile/): run.txt (the
# command's output), run-profile.txt (py-spy raw), bench.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE=${1:-0.8B}
TOKENS=${2:-3000}
RESULTS=${OUT:-out/host-profile}
FOLDER=/tmp/cmpchat-bench
mkdir -p "$RESULTS" "$FOLDER"
export PYTHONUNBUFFERED=1
unset NUMBA_ENABLE_CUDASIM
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
fi
MODEL=$(python3 -c "import sys; from pathlib import Path; from cmpchat.bench.model_files import bench_model_path; print(bench_model_path(sys.argv[1], Path(sys.argv[2])))" "$SHAPE" "$FOLDER") || exit 1
echo "model: $MODEL"
python3 -m cmpchat bench decode "$SHAPE" --folder "$FOLDER" --contexts 0 2>&1 | tee "$RESULTS/bench.txt"
RUN=(python3 -m cmpchat run -m "$MODEL" -p "Tell me a story about a GPU" -n "$TOKENS" --temp 0 --no-think)
"${RUN[@]}" >/dev/null 2>"$RESULTS/run-plain.txt"; tail -3 "$RESULTS/run-plain.txt"
py-spy record --threads --nonblocking -r 1000 -f raw -o "$RESULTS/run-profile.txt" -- "${RUN[@]}" >/dev/null 2>"$RESULTS/run.txt"
tail -3 "$RESULTS/run.txt"
