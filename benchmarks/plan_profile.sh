#!/usr/bin/env bash
# The `--profile` step of `moeplex plan` (docs/plan.md): measure on one lent H200 the inputs the shipped profile
# core/plan/profiles/h200.json lacks or borrows, merge them into OUT/h200_measured.json (each number keeps its
# command as its source), check the model with it, then re-measure the fused MoE tables with the time left.
#
#   bash benchmarks/plan_profile.sh OUT            # one device call: everything ends within BUDGET_S (default 540 s: 9 min, and a stuck step is killed 5 s past its limit)
#   bash benchmarks/plan_profile.sh OUT 540 cpu    # every step at toy sizes on a CPU, the four measurements side by side (tests/test_plan_cli.py runs it)
#
# Steps (OUT/steps.txt says how each ended and how long it took; OUT/<step>.log holds its output):
#   routing   plan_routing.py: the distinct experts e2e_gpu.py's dummy DeepSeek-V3 hits per decode step (routing_deepseek_v3)
#   dispatch  plan_dispatch.py: deepep-ll's kernels and bare-call host share on one GPU (deepep_ll_kernel_us, deepep_ll_call_host_us)
#   gemm      plan_gemm.py: dense GEMMs and the prefill attention call at the model's shapes (gemm_slowdown, attention_slowdown)
#   launch    plan_launch.py: a replayed graph's gap between nodes (graph_gap_us)
#   merge     moeplex plan profile-update: the above over h200.json -> OUT/h200_measured.json, every changed entry listed
#   check     moeplex plan check --only own --profile OUT/h200_measured.json
#   fused_moe fused_moe.py tables (the expert tables the profile reads), as long as time is left
# Updating the shipped profile from OUT/h200_measured.json is a reviewed edit (OUT/profile_update.md lists the changes).
set -o pipefail
out=$(mkdir -p "${1:?usage: bash benchmarks/plan_profile.sh OUT [BUDGET_S] [cpu]}" && realpath "$1")
budget=${2:-540}
mode=${3:-gpu}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
py=${PYTHON:-python3}
deadline=$(( $(date +%s) + budget ))
: > "$out/steps.txt"

step() {  # step NAME MAX_S CMD...: CMD under the smaller of MAX_S and the time left (30 s kept for merge and check)
  local name=$1 max=$2 reserve=${RESERVE:-30}
  shift 2
  local left=$(( deadline - $(date +%s) - reserve ))
  local limit=$(( max < left ? max : left ))
  if (( limit < 10 )); then
    echo "$name: skipped, out of time" | tee -a "$out/steps.txt"
    return 0
  fi
  local start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1  # -k: a step that ignores the TERM is killed 5 s later
  local rc=$?
  echo "$name: rc $rc after $(( $(date +%s) - start )) s (limit $limit s): $*" | tee -a "$out/steps.txt"
  tail -n 20 "$out/$name.log"
}

if [[ $mode == cpu ]]; then
  # toy sizes: what each step runs, not what it measures; side by side (each is mostly a Python start-up, and the
  # numbers mean nothing here), then merge and check once all four have ended
  step routing 120 "$py" plan_routing.py --device cpu --preset tiny --batches 1 8 --out "$out/plan_routing_h200.json" &
  step dispatch 60 "$py" plan_dispatch.py --device cpu --dispatcher local --hidden 256 --experts 16 --tokens 8 --iters 3 --runs 2 \
    --out "$out/plan_dispatch_h200.md" --measured-out "$out/plan_dispatch_h200.json" &
  step gemm 120 "$py" plan_gemm.py --device cpu --model deepseek_v3:tiny --tokens 4 16 --seq 16 --runs 1 \
    --out "$out/plan_gemm_h200.md" --profile-out "$out/plan_gemm_h200.json" &
  step launch 60 "$py" plan_launch.py --device cpu --kernels 20 --runs 2 --out "$out/plan_launch_h200.md" --profile-out "$out/plan_launch_h200.json" &
  wait
else
  nvidia-smi -L > "$out/gpus.txt" 2>&1
  step routing 180 "$py" plan_routing.py --out "$out/plan_routing_h200.json"
  step dispatch 60 "$py" plan_dispatch.py --out "$out/plan_dispatch_h200.md" --measured-out "$out/plan_dispatch_h200.json"
  step gemm 180 "$py" plan_gemm.py --out "$out/plan_gemm_h200.md" --profile-out "$out/plan_gemm_h200.json"
  step launch 90 "$py" plan_launch.py --out "$out/plan_launch_h200.md" --profile-out "$out/plan_launch_h200.json"
fi

measured=()
for f in "$out"/plan_routing_h200.json "$out"/plan_dispatch_h200.json "$out"/plan_gemm_h200.json "$out"/plan_launch_h200.json; do
  [[ -s $f ]] && measured+=("$f")
done
if (( ${#measured[@]} )); then
  RESERVE=0 step merge 30 "$py" -m moeplex.cli plan profile-update "${measured[@]}" --out "$out/h200_measured.json"
  cp "$out/merge.log" "$out/profile_update.md" 2>/dev/null
  RESERVE=0 step check 30 "$py" -m moeplex.cli plan check --only own --profile "$out/h200_measured.json"
  cp "$out/check.log" "$out/plan_check_measured.md" 2>/dev/null
else
  echo "merge: nothing measured to merge" | tee -a "$out/steps.txt"
fi

if [[ $mode != cpu ]]; then
  RESERVE=5 step fused_moe_ep8_bf16 120 "$py" fused_moe.py --shape deepseek-v3-ep8 --dtype bf16
  RESERVE=5 step fused_moe_ep8_fp8 120 "$py" fused_moe.py --shape deepseek-v3-ep8 --dtype fp8
  RESERVE=5 step fused_moe_qwen3_bf16 120 "$py" fused_moe.py --shape qwen3-30b-a3b --dtype bf16
fi
echo "done in $(( $(date +%s) - deadline + budget )) s of $budget" | tee -a "$out/steps.txt"
