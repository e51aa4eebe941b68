#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` for CUDA and pack it to carry to a GPU machine, where `cmpchat bench`
# runs it on the same GGUF file to compare decode (tg128) and prompt (pp N) speed with ours.
#
# Run on a machine with nvcc (CUDA 13) and PyPI access, from anywhere in the repository:
#     cuda/build_llama_cpp.sh [ARCH]        ARCH: CUDA architecture, default 90 (H200); the CMP 100-210 is 70,
#                                           which CUDA 13 no longer builds: give a CUDA 12 toolkit as CUDA_HOME
# Environment (all optional):
#     LCP_CACHE=DIR     where the llama_cpp_python-VERSION.tar.gz sdist and the nvidia_cublas wheel are looked for
#                       first, and downloaded to if missing (default /tmp/cmpchat-llama.cpp/downloads)
#     LCP_VERSION=0.3.36            the llama-cpp-python sdist whose vendor/llama.cpp is built (it knows qwen35)
#     CUBLAS_VERSION=13.0.2.14      the nvidia-cublas wheel linked against when the toolkit has no cuBLAS
#     GGML_CUDA_FA_QUANTS=f16-f16   FlashAttention K-V types compiled (llama-bench's default KV cache is f16)
#     CUDA_HOME=/usr/local/cuda   JOBS=$(nproc)
#     LLAMA_WORK=/tmp/cmpchat-llama.cpp/smARCH     sources and build (about 1.1 GB), outside .llama.cpp/ so that
#                       the folder of archives can travel whole
#     CONFIGURE_ONLY=1              stop after cmake's configure (to check options in seconds)
# Output: .llama.cpp/llama-bench-smARCH.tar.xz (git-ignored), one folder llama-bench-smARCH/ holding
#     llama-bench          stripped; ggml, llama and libstdc++ static; needs glibc 2.34 (Ubuntu 22.04, Debian 12,
#                          RHEL 9), libcudart/libcublas/libcublasLt .so.13 (CUDA 13) and the driver's libcuda.so.1
#     run-llama-bench.sh   finds those libraries (python3's site-packages nvidia/*/lib, then /usr/local/cuda*)
#     lib/                 libgomp.so.1 (OpenMP), used only where the GPU machine lacks one
#     BUILD-INFO.txt       llama-cpp-python version, llama.cpp build number and commit, options, compilers
# There (no nvcc, no network needed):
#     tar xf .llama.cpp/llama-bench-sm90.tar.xz -C /tmp
#     /tmp/llama-bench-sm90/run-llama-bench.sh -m MODEL.gguf -p 512 -n 128 -fa 1 -ngl 99 -o json
# One architecture takes about 35 minutes on two cores: the CUDA templates (matrix products, FlashAttention)
# are most of it.
set -euo pipefail

ARCH=${1:-${CUDA_ARCH:-90}}
LCP_VERSION=${LCP_VERSION:-0.3.36}
CUBLAS_VERSION=${CUBLAS_VERSION:-13.0.2.14}
FA_QUANTS=${GGML_CUDA_FA_QUANTS:-f16-f16}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
JOBS=${JOBS:-$(nproc)}

ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
OUTDIR=$ROOT/.llama.cpp
ARCH_NAME=${ARCH%%-*}                       # 90-real -> 90
case $ARCH in *-*) CMAKE_ARCH=$ARCH ;; *) CMAKE_ARCH=$ARCH-real ;; esac   # SASS only: no PTX to carry
NAME=llama-bench-sm$ARCH_NAME
WORK=${LLAMA_WORK:-${TMPDIR:-/tmp}/cmpchat-llama.cpp/sm$ARCH_NAME}
DL=${LCP_CACHE:-${TMPDIR:-/tmp}/cmpchat-llama.cpp/downloads}
T0=$(date +%s)

step() { printf '\n[%s +%ds] == %s\n' "$(date +%H:%M:%S)" $(( $(date +%s) - T0 )) "$*"; }
die() { echo "build_llama_cpp: $*" >&2; exit 1; }

[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)"
CUDA_MAJOR=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
"$CUDA_HOME/bin/nvcc" --list-gpu-arch | grep -qx "compute_$ARCH_NAME" \
    || die "nvcc $CUDA_MAJOR cannot build sm_$ARCH_NAME (CUDA 13 dropped sm_70 and older): set CUDA_HOME to a CUDA 12 toolkit"
mkdir -p "$OUTDIR" "$WORK" "$DL"
grep -qxF '/.llama.cpp/' "$ROOT/.gitignore" 2>/dev/null || echo '/.llama.cpp/' >> "$ROOT/.gitignore"

# A file from the download folder, fetched by pip if missing there.
fetch() {  # fetch GLOB PIP-ARGS...
    local glob=$1 f; shift
    for f in $DL/$glob; do [ -f "$f" ] && { echo "$f"; return; }; done
    echo "downloading $glob" >&2
    python3 -m pip download -q --no-deps -d "$DL" "$@" >&2
    for f in $DL/$glob; do [ -f "$f" ] && { echo "$f"; return; }; done
    die "pip did not leave $glob in $DL"
}

step "source: llama-cpp-python $LCP_VERSION sdist (vendor/llama.cpp)"
SDIST=$(fetch "llama_cpp_python-$LCP_VERSION.tar.gz" --no-binary :all: "llama-cpp-python==$LCP_VERSION")
echo "sdist: $SDIST"
SRC=$WORK/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    tar -xzf "$SDIST" -C "$WORK" "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" \
        "llama_cpp_python-$LCP_VERSION/CHANGELOG.md"
fi
# The submodule's .git file points into a .git/modules the sdist lacks: drop it, so that no git command
# there finds our repository instead; the build number and commit are given to cmake below.
rm -f "$SRC/.git"
grep -q '"qwen35"' "$SRC/src/llama-arch.cpp" || die "this llama.cpp has no qwen35 architecture"

# llama-cpp-python's CHANGELOG names the llama.cpp commit of each release.
LLAMA_COMMIT=$(awk -v v="## [$LCP_VERSION]" '$0==v{f=1;next} /^## \[/{f=0} f' \
    "$WORK/llama_cpp_python-$LCP_VERSION/CHANGELOG.md" | grep -oE 'llama\.cpp@[0-9a-f]+' | head -1 | cut -d@ -f2)
LLAMA_COMMIT=${LLAMA_COMMIT:-unknown}
# llama.cpp's release tags b<number> for the commits of the versions we pin (public references to b11312).
declare -A KNOWN_BUILD=([0c1e57098]=11312)
LLAMA_BUILD=${LLAMA_BUILD_NUMBER:-${KNOWN_BUILD[$LLAMA_COMMIT]:-0}}
echo "llama.cpp commit $LLAMA_COMMIT, build b$LLAMA_BUILD"

step "CUDA: $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*'), cuBLAS, libcuda stub"
if [ -f "$CUDA_HOME/include/cublas_v2.h" ] && ls "$CUDA_HOME"/lib64/libcublas.so* >/dev/null 2>&1; then
    CUBLAS_INC=$CUDA_HOME/include
    CUBLAS_LIB=$(ls "$CUDA_HOME"/lib64/libcublas.so* | head -1)
    CUBLASLT_LIB=$(ls "$CUDA_HOME"/lib64/libcublasLt.so* | head -1)
    CUBLAS_FROM="toolkit $CUDA_HOME"
else  # a toolkit of pip wheels (nvcc, cudart) has no cuBLAS: headers and .so from the nvidia-cublas wheel
    [ "$CUDA_MAJOR" = 13 ] || die "no cuBLAS in $CUDA_HOME, and the nvidia-cublas wheel is CUDA 13's"
    WHEEL=$(fetch "nvidia_cublas-$CUBLAS_VERSION-*.whl" --only-binary :all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 "nvidia-cublas==$CUBLAS_VERSION")
    CUB=$WORK/cublas-$CUBLAS_VERSION
    if [ ! -f "$CUB/.done" ]; then
        python3 -m zipfile -e "$WHEEL" "$CUB" && touch "$CUB/.done"
    fi
    CUBLAS_INC=$(dirname "$(find "$CUB" -name cublas_v2.h | head -1)")
    CUBLAS_LIB=$(find "$CUB" -name 'libcublas.so.*' | head -1)
    CUBLASLT_LIB=$(find "$CUB" -name 'libcublasLt.so.*' | head -1)
    CUBLAS_FROM="wheel $(basename "$WHEEL")"
fi
echo "cuBLAS: $CUBLAS_FROM"
# libcuda.so comes with the driver; link against the toolkit's stub, or against one made here from cuda.h
# (every cu* function as an empty one, soname libcuda.so.1: only the link reads it).
CUDA_STUB=$(ls "$CUDA_HOME"/lib64/stubs/libcuda.so "$CUDA_HOME"/targets/*/lib/stubs/libcuda.so 2>/dev/null | head -1 || true)
if [ -z "$CUDA_STUB" ]; then
    CUDA_STUB=$WORK/stubs/libcuda.so
    mkdir -p "$WORK/stubs"
    echo '#include <cuda.h>' | gcc -E -P -I"$CUDA_HOME/include" -x c - \
        | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' \t(' | sort -u \
        | sed 's/.*/void &(void) {}/' > "$WORK/stubs/libcuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA_STUB" "$WORK/stubs/libcuda.c"
    echo "libcuda stub: $(wc -l < "$WORK/stubs/libcuda.c") functions from cuda.h"
fi

# std::random_device in the static libstdc++ calls arc4random, new in glibc 2.36: route it to getrandom
# (glibc 2.25), so that the binary needs glibc 2.34 (its start code) and runs on Ubuntu 22.04 too.
mkdir -p "$WORK/compat"
cat > "$WORK/compat/arc4random.c" <<'EOF'
#include <stdint.h>
#include <sys/random.h>
#include <time.h>
uint32_t __wrap_arc4random(void) {
    uint32_t v;
    if (getrandom(&v, sizeof v, 0) == (ssize_t) sizeof v) return v;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint32_t) (t.tv_nsec ^ (t.tv_sec * 2654435761u));
}
EOF
gcc -O2 -fPIC -c -o "$WORK/compat/arc4random.o" "$WORK/compat/arc4random.c"

step "configure (CUDA arch $CMAKE_ARCH, FlashAttention KV types $FA_QUANTS)"
BUILD=$WORK/build
CMAKE_ARGS=(
    -GNinja -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_HOME"
    -DCMAKE_CUDA_ARCHITECTURES="$CMAKE_ARCH"
    -DCMAKE_CUDA_FLAGS="-I$CUBLAS_INC"
    -DCUDA_cublas_LIBRARY="$CUBLAS_LIB" -DCUDA_cublasLt_LIBRARY="$CUBLASLT_LIB"
    -DCUDA_cuda_driver_LIBRARY="$CUDA_STUB"
    # one binary: libstdc++ inside (libgcc_s stays shared: cuBLAS needs it anyway); libcublas.so.13 needs
    # libcublasLt.so.13 at link time
    -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -Wl,--wrap=arc4random $WORK/compat/arc4random.o -Wl,-rpath-link,$(dirname "$CUBLASLT_LIB")"
    -DCMAKE_SKIP_RPATH=ON           # no build paths in the binary: run-llama-bench.sh sets LD_LIBRARY_PATH
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF
    # the GPU host's CPU runs only what is not offloaded: x86-64-v3, as llama.cpp's own releases build
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_CUDA=ON -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_QUANTS="$FA_QUANTS" -DGGML_CUDA_GRAPHS=ON
    -DGGML_CUDA_NCCL=OFF
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_NUMBER="$LLAMA_BUILD" -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT"
)
if ! cmake -S "$SRC" -B "$BUILD" "${CMAKE_ARGS[@]}" > "$WORK/configure.log" 2>&1; then
    tail -40 "$WORK/configure.log"; die "cmake configure failed: $WORK/configure.log"
fi
grep -E 'llama.cpp version|CUDA Toolkit found|CMAKE_CUDA_ARCHITECTURES=|CUDA host compiler|Including CUDA backend|Configuring done' \
    "$WORK/configure.log" || true
LLAMA_VERSION=$(sed -n 's/.*llama.cpp version: //p' "$WORK/configure.log" | head -1)

[ -z "${CONFIGURE_ONLY:-}" ] || { echo "configured: $BUILD"; exit 0; }

step "build llama-bench and llama-quantize with $JOBS jobs (long: ninja prints [done/total])"
# llama-quantize (seconds once llama-bench's libraries are built) stays in $BUILD/bin: it quantises on the
# CPU here, for tests/fixtures/oracle/quantize_oracle.py, and is not packed.
cmake --build "$BUILD" --target llama-bench llama-quantize -j "$JOBS"

step "pack"
STAGE=$WORK/stage/$NAME
rm -rf "$WORK/stage" && mkdir -p "$STAGE/lib"
strip -o "$STAGE/llama-bench" "$BUILD/bin/llama-bench"
NEEDED=$(readelf -d "$STAGE/llama-bench" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | paste -sd' ')
case " $NEEDED " in *" libgomp.so.1 "*) cp -L "$(gcc -print-file-name=libgomp.so.1)" "$STAGE/lib/" ;; esac
cat > "$STAGE/run-llama-bench.sh" <<'EOF'
#!/usr/bin/env bash
# Run the llama-bench next to this script with the CUDA @MAJOR@ runtime and cuBLAS found on this machine:
# python3's site-packages nvidia/*/lib (the pip wheels nvidia-cuda-runtime, nvidia-cublas), then
# /usr/local/cuda*; libcuda.so.1 is the driver's. Arguments go to llama-bench unchanged.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
roots=()
if command -v "${PYTHON:-python3}" >/dev/null 2>&1; then
    while IFS= read -r d; do [ -d "$d/nvidia" ] && roots+=("$d/nvidia"); done < <("${PYTHON:-python3}" -c \
        'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null || true)
fi
for d in /usr/local/cuda /usr/local/cuda-* /usr/local/cuda/targets/*-linux /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && roots+=("$d")
done
dirs=()
for lib in libcudart.so.@MAJOR@ libcublas.so.@MAJOR@ libcublasLt.so.@MAJOR@; do
    found=
    for r in "${roots[@]}"; do
        found=$(find -L "$r" -maxdepth 4 -name "$lib" -path '*/lib*/*' 2>/dev/null | head -1 || true)
        [ -n "$found" ] && break
    done
    [ -n "$found" ] || { echo "run-llama-bench: $lib not found in ${roots[*]:-nothing}" >&2; exit 1; }
    dirs+=("$(dirname "$found")")
done
cache=$(ldconfig -p 2>/dev/null || true)
if [[ $cache != *libcuda.so.1* ]]; then
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do [ -e "$d/libcuda.so.1" ] && dirs+=("$d"); done
fi
[[ $cache == *libgomp.so.1* ]] || dirs+=("$here/lib")   # the packed libgomp only where the system has none
path=$(printf '%s\n' "${dirs[@]}" | awk '!seen[$0]++' | paste -sd:)
export LD_LIBRARY_PATH=$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "run-llama-bench: LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >&2
exec "$here/llama-bench" "$@"
EOF
sed -i "s/@MAJOR@/$CUDA_MAJOR/g" "$STAGE/run-llama-bench.sh"
chmod +x "$STAGE/run-llama-bench.sh" "$STAGE/llama-bench"

GLIBC_MAX=$(objdump -T "$STAGE/llama-bench" | grep -oE 'GLIBC_[0-9.]+' | sort -uV | tail -1)
{
    echo "llama-bench for CUDA sm_$ARCH_NAME, built by cmpchat's cuda/build_llama_cpp.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "source:        llama-cpp-python $LCP_VERSION sdist ($(basename "$SDIST"), sha256 $(sha256sum "$SDIST" | cut -c1-64)), vendor/llama.cpp"
    echo "llama.cpp:     build b$LLAMA_BUILD, commit $LLAMA_COMMIT (from llama-cpp-python's CHANGELOG; the sdist has no git metadata)"
    echo "llama-bench:   version $LLAMA_VERSION, build-info.cpp: $(grep -oE '(LLAMA_BUILD_NUMBER|LLAMA_COMMIT|LLAMA_COMPILER|LLAMA_BUILD_TARGET) = [^;]*' "$BUILD/common/build-info.cpp" | paste -sd' ')"
    echo "nvcc:          $("$CUDA_HOME/bin/nvcc" --version | tail -2 | paste -sd' ')"
    echo "host compiler: $(gcc --version | head -1); libstdc++ linked statically"
    echo "cuBLAS:        $CUBLAS_FROM (linked dynamically: libcublas.so.$CUDA_MAJOR)"
    echo "CUDA arch:     $CMAKE_ARCH; FlashAttention KV types: $FA_QUANTS; CUDA graphs on; NCCL off"
    echo "needs:         glibc >= ${GLIBC_MAX#GLIBC_}; $NEEDED"
    echo "cmake options:"
    printf '    %s\n' "${CMAKE_ARGS[@]}"
} > "$STAGE/BUILD-INFO.txt"
cat "$STAGE/BUILD-INFO.txt"

ARCHIVE=$OUTDIR/$NAME.tar.xz
tar -C "$WORK/stage" -cf - "$NAME" | xz -9e -T"$JOBS" > "$ARCHIVE.tmp" && mv "$ARCHIVE.tmp" "$ARCHIVE"
step "done in $(( ($(date +%s) - T0) / 60 )) min: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1), $(stat -c %s "$ARCHIVE") bytes)"
echo "$ARCHIVE"
