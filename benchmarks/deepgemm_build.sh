#!/usr/bin/env bash
# Build DeepGEMM's wheel on a GPU machine that has no network, from PyPI's deepinfer-gemm source distribution
# carried in .dg/ (git-ignored; never committed), and hand it back in pieces under the device tool's file limits.
#   here:   mkdir -p .dg && curl -sO --output-dir .dg <deepinfer_gemm-2.8.2.tar.gz's URL on pypi.org/simple/deepinfer-gemm>
#           python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any wheel -d .dg
#   there:  bash benchmarks/deepgemm_build.sh OUT [BUILD_SECONDS]      (carry .dg)
#   back:   cat OUT/dg/wheel.part.* > .dg/$(cat OUT/dg/wheel.name)    (then gpu_system.sh's dgmasked part installs it)
# OUT/dg/env.txt says what the machine had (nvcc, torch, CUDA_HOME's include folders) and how the build ended;
# OUT/dg/build.log is the build's own log, so a missing header or tool is named there.
# Seen on an H200 image (session 17: nvcc 13.0, torch 2.11.0+cu130, CCCL in /usr/local/cuda/include/cccl): the build
# stops at deep_jit's utils/exception.hpp, which includes elfutils' <elfutils/libdwfl.h>, absent there. The library
# itself (libdw.so.1) is dlopen'ed at run time for stack traces, so its headers alone are needed: put elfutils'
# libdwfl.h and libdw.h under .dg/include/elfutils/ and libelf.h, gelf.h, dwarf.h under .dg/include/ (this script
# adds .dg/include to the compiler's include path).
set -o pipefail
out=${1:?OUT}/dg; seconds=${2:-360}
mkdir -p "$out"
repo=$PWD
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
{
  echo "nvcc: $(nvcc --version | tail -1)"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "CUDA_HOME $cuda_home: $(ls "$cuda_home/include" | grep -c .) entries in include/, cccl/: $(ls "$cuda_home/include/cccl" 2>/dev/null | tr '\n' ' ')"
} > "$out/env.txt" 2>&1
tools=/tmp/dg_tools  # the build imports wheel.bdist_wheel; add the carried wheel package only where it is missing
python3 -c "import wheel.bdist_wheel" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target $tools "$repo"/.dg/wheel-*.whl
rm -rf /tmp/dg_src /tmp/dg_wheel && mkdir -p /tmp/dg_src && tar xzf "$repo"/.dg/deepinfer_gemm-*.tar.gz -C /tmp/dg_src
cd /tmp/dg_src/deepinfer_gemm-* || exit 1
start=$(date +%s)
CPLUS_INCLUDE_PATH=$repo/.dg/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH} \
CUDA_HOME=$cuda_home DG_FORCE_BUILD=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH=$tools${PYTHONPATH:+:$PYTHONPATH} timeout "$seconds" \
  python3 -m pip wheel -v --no-deps --no-build-isolation --no-index -w /tmp/dg_wheel . > "$out/build.log" 2>&1
echo "build rc $? after $(( $(date +%s) - start )) s" >> "$out/env.txt"
wheel=$(ls /tmp/dg_wheel/*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { tail -5 "$out/build.log"; exit 1; }
basename "$wheel" > "$out/wheel.name"
split -b 15M "$wheel" "$out/wheel.part."
ls -la /tmp/dg_wheel >> "$out/env.txt"
tail -15 "$out/build.log" >> "$out/env.txt" && rm "$out/build.log"  # (the device tool brings back 8 files at most)
cp "$wheel" "$repo/.dg/"  # for gpu_system.sh's dgmasked part in the same call
cat "$out/env.txt"
