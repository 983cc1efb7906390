#!/usr/bin/env bash
# The GPU checks and benchmarks of the DeepEP / DeepGEMM path, for a machine with Hopper GPUs where
# deep_ep and deep_gemm are installed (see docs/plugins.md). Results go to the folder given (default: .).
#   bash benchmarks/gpu_suite.sh OUT_DIR
set -o pipefail
out=${1:-.}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONFAULTHANDLER=1
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deep_gemm_jit}
nvidia-smi -L | tee "$out/gpus.txt"
timeout -s ABRT 200 python3 -m pytest -q -rs tests/test_deepep_deepgemm_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -30
conformance() {  # NAME ARGS...: one plugin's conformance suite, each under its own time limit
    local name=$1; shift
    timeout -s ABRT 100 python3 -m pytest -v -rs -p no:cacheprovider --pyargs moeplex.conformance "$@" 2>&1 \
        | tee "$out/conformance_$name.log" | tail -4
}
conformance ll --moeplex-plugin dispatcher:deepep-ll
conformance normal --moeplex-plugin dispatcher:deepep-normal
conformance auto --moeplex-plugin dispatcher:deepep-auto
conformance deepgemm --moeplex-plugin moe_kernel:deepgemm
timeout 300 python3 benchmarks/deepgemm_moe.py "${@:2}" 2>&1 | tee "$out/deepgemm_moe.md"
