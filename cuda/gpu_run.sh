#!/usr/bin/env bash
# One command for a bare GPU machine: install the carried wheels, run the GPU self-test, then the GPU tests.
#
#   bash cuda/gpu_run.sh [quick|full|bench|prefill|sweep|marks|pipeline] [--budget SECONDS] [--timeout SECONDS] [--tokens N...] [-- PYTEST ARGS...]
#
#   quick (default): the self-test, then `pytest -m "gpu and not slow"` over every test module with GPU tests
#   full:            the self-test, `pytest -m gpu`, then the benchmarks (cmpchat bench decode, GEMV)
#   bench:           the self-test, then the benchmarks only (add --shapes 9B 27B ... to choose)
#   prefill:         the self-test, then prompt tok/s (cmpchat bench prefill, with llama.cpp when carried) and the
#                    prefill kernels' micro-benchmarks (DP4A GEMM, prefill attention, chunked Gated DeltaNet)
#   sweep:           the self-test, then the tuning sweeps (GEMV tilings and fixed costs, decode-attention tilings, GEMM tilings)
#   marks:           the self-test, then issue 25's engine marks (cuda/engine_marks.py)
#   pipeline:        the self-test, the pipeline's GPU tests (slow ones too), then 27B as three 16 GB stages on GPU 0:
#                    bench decode and prefill, served (cuda/pipeline_smoke.py) and chatted with in the app
#
# Expects the repository as working directory's parent of cuda/ and, where packages are missing (the
# device tool's H200 machine), their wheels in .whl/ (cuda/fetch_wheels.sh fetches them; name ".whl" in the
# device call's carry). They are installed into /tmp/site and put first on PYTHONPATH, so numpy 2.4 shadows
# the image's numpy 2.5. Results go to $OUT if set (the device tool returns that folder), else out/gpu-run/:
# log.txt (everything printed), selftest.xml and tests.xml (JUnit), summary.json and summary.txt.
# Exit status: 0 when every phase passed, 1 when a test failed, 3 when the wheels did not install.
set -uo pipefail

cd "$(dirname "$0")/.."
MODE=${1:-quick}
shift || true
RESULTS=${OUT:-out/gpu-run}
mkdir -p "$RESULTS"

# Unbuffered output for the log; NVLink multicast stays off as the machine's notes require; kernel tests
# run on the GPU, never in Numba's simulator.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset NUMBA_ENABLE_CUDASIM

{
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
            { echo "wheel install failed"; exit 3; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 cuda/gpu_run.py --mode "$MODE" --results "$RESULTS" "$@"
} 2>&1 | tee "$RESULTS/log.txt"
exit "${PIPESTATUS[0]}"
