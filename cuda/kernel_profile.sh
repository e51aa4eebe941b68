#!/usr/bin/env bash
# Where a kernel's instructions and stalls go, from Nsight Compute's hardware counters (Firecracker machines
# only; gVisor's ncu cannot read them): installs the carried wheels, then profiles the first launch of each
# kernel whose name matches KERNEL while COMMAND runs, and summarises it with cuda/sass_hotspots.py.
#
#   bash cuda/kernel_profile.sh KERNEL [KERNEL...] -- COMMAND...
#   bash cuda/kernel_profile.sh gdn_chunk_state gdn_chunk_prepare -- python3 -m cmpchat.bench.kernels.gdn_chunked 9B --tokens 16384
#
# Per kernel, in $OUT (or out/kernel-profile/): NAME.csv (every SASS instruction with its executions and stall
# samples), NAME.txt (speed of light, occupancy, stall reasons) and NAME.summary.txt (opcode mix and the
# share of instructions and stalls between barriers). Clocks are left as they are (--clock-control none).
set -uo pipefail

cd "$(dirname "$0")/.."
kernels=()
while (($#)) && [[ $1 != -- ]]; do kernels+=("$1"); shift; done
shift || true
if ((${#kernels[@]} == 0 || $# == 0)); then
    echo "usage: bash cuda/kernel_profile.sh KERNEL [KERNEL...] -- COMMAND..." >&2
    exit 2
fi
RESULTS=${OUT:-out/kernel-profile}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset NUMBA_ENABLE_CUDASIM
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        { echo "wheel install failed"; exit 3; }
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n $NCU ]] || { echo "no ncu on this machine"; exit 3; }
status=0
for name in "${kernels[@]}"; do
    "$NCU" --clock-control none -k "regex:$name" -c 1 --section SourceCounters --page source --print-source sass \
        --csv "$@" >"$RESULTS/$name.csv" 2>/dev/null || status=1
    "$NCU" --clock-control none -k "regex:$name" -c 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --print-details all "$@" >"$RESULTS/$name.txt" 2>&1 || status=1
    python3 cuda/sass_hotspots.py "$RESULTS/$name.csv" | tee "$RESULTS/$name.summary.txt" || status=1
done
exit $status
