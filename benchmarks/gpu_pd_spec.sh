#!/usr/bin/env bash
# The one-GPU checks and benchmarks of speculative decoding and PD disaggregation (issues #20, #21), sized to run in
# under ten minutes on one H200. Results go to the folder given (default: .).
#   bash benchmarks/gpu_pd_spec.sh OUT_DIR
set -o pipefail
out=${1:-.}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi -L | tee "$out/gpus.txt"
timeout -s ABRT 110 python3 -m pytest -q -rs -m gpu tests/test_speculative_gpu.py tests/test_kv_transfer_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log" | tail -8
timeout 170 python3 benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --batches 1 32 --runs 3 \
    --out "$out/speculative_h200.md" 2>&1 | tail -16
timeout 40 python3 benchmarks/pd.py transfer --device cuda --layers 48 --backends cuda-ipc --pages 256 4096 \
    --out "$out/pd_transfer_h200.md" 2>&1 | tail -6
# Qwen3-30B-A3B shapes cut to 12 of 48 layers: the co-located server, P and D (three processes) share the one GPU
model=$(mktemp -d)
python3 - "$model" <<'PY'
import sys
from moeplex.models.make_model import write_checkpoint
write_checkpoint(sys.argv[1], "qwen3_moe", "30b-a3b", config_only=True, overrides={"num_hidden_layers": 12})
PY
timeout 150 python3 benchmarks/pd_serving.py --device cuda --model "$model" --load-format dummy --serve-flag=--dtype \
    --serve-flag=bf16 --kv-memory-fraction 0.15 --backend cuda-ipc --rate 4 --duration 8 --long-prompt 8192 \
    --chunk 8192 --decode-tokens 128 --runs 3 2>&1 | tee "$out/pd_serving_h200.md" | tail -16
