#!/usr/bin/env bash
# The `--profile` step of `moeplex plan` (docs/plan.md): re-measure, on one lent H200, the tables the shipped
# profile core/plan/profiles/h200.json reads, and the dense costs it still prices at the peak. Results go to OUT;
# updating the profile from them is a reviewed edit (each number keeps its table and command as its source).
#   bash benchmarks/plan_profile.sh OUT        (about 8 minutes; under the 10-minute limit of one device call)
set -o pipefail
out=$(realpath "${1:-.}")
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
nvidia-smi -L | tee "$out/gpus.txt"
timeout 240 python3 plan_gemm.py --out "$out/plan_gemm_h200.md" --profile-out "$out/h200_measured.json" 2>&1 | tail -40
timeout 120 python3 plan_launch.py --out "$out/plan_launch_h200.md" --profile-in "$out/h200_measured.json" --profile-out "$out/h200_measured.json" 2>&1 | tail -12
(cd .. && python3 -m moeplex.cli plan check --only own --profile "$out/h200_measured.json") 2>&1 | tee "$out/plan_check_measured.md"
timeout 120 python3 fused_moe.py --shape deepseek-v3-ep8 --dtype bf16 2>&1 | tee "$out/fused_moe_ep8_bf16.md" | tail -20
timeout 120 python3 fused_moe.py --shape deepseek-v3-ep8 --dtype fp8 2>&1 | tee "$out/fused_moe_ep8_fp8.md" | tail -20
timeout 120 python3 fused_moe.py --shape qwen3-30b-a3b --dtype bf16 2>&1 | tee "$out/fused_moe_qwen3_bf16.md" | tail -20
