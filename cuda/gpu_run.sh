#!/usr/bin/env bash
# One command for a bare GPU machine: install the carried wheels, run the GPU self-test, then the GPU tests.
#
#   bash cuda/gpu_run.sh [quick|full|bench|prefill|sweep|marks|pipeline|cmpcheck] [--profile native|cmp] [--budget SECONDS] [--timeout SECONDS] [--tokens N...] [-- PYTEST ARGS...]
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
#   cmpcheck:        the self-test, then cuda/cmp_path_check.py compare: the CMP code path's probe and its
#                    teacher-forced logits against this GPU's own code path (oracle model and 9B shape), then
#                    cmpchat doctor --quick --profile cmp
#
# --profile cmp runs every phase on the CMP 100-210's code path (cmpchat/cudart/target.py: compute_70 PTX from
# CUDA 12's NVVM, the sm_70 row, no early launch, 68 SMs on a green context, 16 GiB per stage) after a probe of it
# (cuda/cmp_path_check.py probe); modes quick, full, bench, prefill and cmpcheck. It needs CUDA 12's NVVM: carry
# .whl-cmp (cuda/fetch_wheels.sh packs it with the few wheels the GPU tier needs; ".whl" whole is too big beside it).
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
    # .whl-cmp (cuda/fetch_wheels.sh): the GPU tier's wheels unpacked as one xz archive (smaller than the wheels),
    # and CUDA 12's NVVM for the CMP code path.
    for bundle in .whl-cmp/site-*.tar.xz; do
        [ -e "$bundle" ] || continue
        echo "unpacking $bundle into /tmp/site"
        mkdir -p /tmp/site && tar -xJf "$bundle" -C /tmp/site || { echo "unpacking $bundle failed"; exit 3; }
    done
    for bundle in .whl-cmp/cuda12-nvvm-*.tar.xz; do
        [ -e "$bundle" ] || continue
        echo "unpacking $bundle into /tmp/cuda12-nvvm (CMPCHAT_CUDA12_NVVM)"
        mkdir -p /tmp/cuda12-nvvm && tar -xJf "$bundle" -C /tmp/cuda12-nvvm || { echo "unpacking $bundle failed"; exit 3; }
        export CMPCHAT_CUDA12_NVVM=/tmp/cuda12-nvvm
    done
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
            { echo "wheel install failed"; exit 3; }
    fi
    if [ -d /tmp/site ]; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 cuda/gpu_run.py --mode "$MODE" --results "$RESULTS" "$@"
} 2>&1 | tee "$RESULTS/log.txt"
exit "${PIPESTATUS[0]}"
