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
# stops at deep_jit's utils/exception.hpp, which includes elfutils' <elfutils/libdwfl.h>, absent there. deep_jit only
# dlopen()s libdw.so.1 at run time for symbolised stack traces and does nothing when it is missing, so the header's
# declarations are all the build needs. Where the machine has no such header, this script writes one into
# .dg/include/elfutils/ (the eight functions and three types exception.hpp names, declared as elfutils' documented
# API gives them) and adds .dg/include to the compiler's include path. With it the build ends in 93 s on an H100
# (session 18: results/deepgemm_build_h100_s18.md); gpu_system.sh's dgprobe part then checks that a GEMM runs.
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
if ! echo '#include <elfutils/libdwfl.h>' | g++ -fsyntax-only -x c++ - 2>/dev/null; then
  mkdir -p "$repo/.dg/include/elfutils"
  cat > "$repo/.dg/include/elfutils/libdwfl.h" <<'HEADER'
/* Declarations of the part of elfutils' libdwfl API that deep_jit's exception.hpp uses (written for moeplex's
   DeepGEMM build; the library itself is looked up with dlopen at run time). */
#pragma once
#include <stdint.h>
#include <sys/types.h>
#ifdef __cplusplus
extern "C" {
#endif
typedef uint64_t Dwarf_Addr;
typedef uint64_t Dwarf_Word;
typedef uint64_t GElf_Addr;
typedef uint32_t GElf_Word;
typedef struct Elf Elf;
typedef struct Dwfl Dwfl;
typedef struct Dwfl_Module Dwfl_Module;
typedef struct Dwfl_Line Dwfl_Line;
typedef struct GElf_Shdr GElf_Shdr;
typedef struct {
  int (*find_elf)(Dwfl_Module *, void **, const char *, Dwarf_Addr, char **, Elf **);
  int (*find_debuginfo)(Dwfl_Module *, void **, const char *, Dwarf_Addr, const char *, const char *, GElf_Word, char **);
  int (*section_address)(Dwfl_Module *, void **, const char *, Dwarf_Addr, const char *, GElf_Word, const GElf_Shdr *,
                         Dwarf_Addr *);
  char **debuginfo_path;
} Dwfl_Callbacks;
Dwfl *dwfl_begin(const Dwfl_Callbacks *callbacks);
int dwfl_linux_proc_report(Dwfl *dwfl, pid_t pid);
int dwfl_report_end(Dwfl *dwfl, int (*removed)(Dwfl_Module *, void *, const char *, Dwarf_Addr, void *), void *arg);
Dwfl_Module *dwfl_addrmodule(Dwfl *dwfl, Dwarf_Addr address);
const char *dwfl_module_addrname(Dwfl_Module *mod, GElf_Addr address);
Dwfl_Line *dwfl_module_getsrc(Dwfl_Module *mod, Dwarf_Addr address);
const char *dwfl_lineinfo(Dwfl_Line *line, Dwarf_Addr *addr, int *linep, int *colp, Dwarf_Word *mtime, Dwarf_Word *length);
int dwfl_linux_proc_find_elf(Dwfl_Module *mod, void **userdata, const char *module_name, Dwarf_Addr base,
                             char **file_name, Elf **elfp);
#ifdef __cplusplus
}
#endif
HEADER
  echo "elfutils/libdwfl.h: written into .dg/include (the machine has none)" >> "$out/env.txt"
fi
tools=/tmp/dg_tools  # the build imports wheel.bdist_wheel; add the carried wheel package only where it is missing
python3 -c "import wheel.bdist_wheel" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target $tools "$repo"/.dg/wheel-*.whl
rm -rf /tmp/dg_src /tmp/dg_wheel && mkdir -p /tmp/dg_src && tar xzf "$repo"/.dg/deepinfer_gemm-*.tar.gz -C /tmp/dg_src
cd /tmp/dg_src/deepinfer_gemm-* || exit 1
start=$(date +%s)
# -Bsymbolic-functions: the extension calls its own copies of the C++ library's inline templates (session 18's first
# GEMM call crashed in deep_jit's std::regex). That alone was not enough: the extension also carries its own copies
# of libstdc++'s locale objects and names no libstdc++.so.6, so it runs with that library preloaded (gpu_system.sh's
# dgprobe and dgmasked parts; results/deepgemm_masked_h100_s19.md).
LDFLAGS="-Wl,-Bsymbolic-functions${LDFLAGS:+ $LDFLAGS}" \
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
