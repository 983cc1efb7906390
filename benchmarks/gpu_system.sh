#!/usr/bin/env bash
# The one-GPU checks and benchmarks of the system issues (#19 prefix cache, #21 speculation, #22 decode launches,
# serving), in parts that each fit one ten-minute device call. Results go to OUT.
#   bash benchmarks/gpu_system.sh OUT tests|tests-spec|spec|spec-steady|spec-copy|spec-mixed|spec-dsv3|spec-dsv3-deep|spec-deep-admit|spec-dsv3-deep-steps|spec-dsv3-deep-mixed|spec-profile|spec-profile-dsv3|spec-profile-deep-mixed|tests-nextn|
#                                     spec-serve|spec-serve-spread|spec-profile-never|spec-never|spec-never-control|tests-overlap|host-prompts|e2e|serving|serving-1t|front-end|serving-interval|spec-oracle-steps|offline-host|small-m-tables|moe-small-m|gemv|router-warps|large-m|prefix|dgprobe|dgmasked ...
# What the open issues still need measured, one device call per line (each under ~9 minutes; session 20's state):
#   bash benchmarks/gpu_system.sh OUT serving offline-host     # #31 target 3 on an H200 (H200, session 17: served/
#                                         #      offline 1.03, 0.98-1.07, offline's decode steps 1.87-2.19 ms against
#                                         #      served 1.67-2.00: results/serving_offline_h200_s17.md; offline-host, the
#                                         #      host ms a step by phase, has never run on a GPU)
#   bash benchmarks/gpu_system.sh OUT front-end serving serving-interval spec-oracle-steps  # #31 target 3, #32 oracle:
#                                         #      on an H200 (H100, session 17: served/offline 0.90 pooled, a served
#                                         #      step 46.6 tokens of offline's 48.3; the oracle 3.40x at 7 steps)
#   bash benchmarks/gpu_system.sh OUT spec-copy spec-dsv3      # #32 on an H200 (H100, session 16: copy 1.46/1.49/1.52/
#                                         #      1.19x; nextn with the synthetic MTP 0.97-1.00x on the 4-layer shapes)
#   bash benchmarks/gpu_system.sh OUT spec-serve tests-overlap # #32 served, ngram at 1/16/64
#   bash benchmarks/gpu_system.sh OUT spec-never spec-never-control  # #32 never-worse with mixed steps priced by
#                                         #      the policy (H100, session 26: ngram 0.96/1.00/0.99/0.98x at 1/8/32/
#                                         #      64; batch 1 is the host's noise, the A/A control 1.00x beside the
#                                         #      adversary's 1.00x: results/speculative_h100_s26.md)
#   bash benchmarks/gpu_system.sh OUT spec-dsv3-deep           # #32 nextn at 1/8/32 (H100, session 27: 1.30x at 32,
#                                         #      overlapped verify steps back at 28 ms; half the steps hold a prompt:
#                                         #      results/speculative_h100_s27.md)
#   AB=1 DEEP_BATCHES="32 8" GPU_BUDGET_S=560 bash benchmarks/gpu_system.sh OUT spec-deep-admit tests-nextn  # #32:
#                                         #      the engine's largest graph sized for a full verify grid plus 256
#                                         #      rows of prompts, 384 here (session 30), against .ab = git archive
#                                         #      bb5d8cc core (largest graph 256: one prompt a step at 32; H100,
#                                         #      session 28: 1.29x
#                                         #      at 32, 1.85x at 8); predicted ~1.5x at 32 (spec_admit_rows.py: 30.3
#                                         #      of 32 running against 23.9), 8 unchanged
#   bash benchmarks/gpu_system.sh OUT e2e moe-small-m          # #31 targets 1-2: 3 e2e runs each; DeepSeek-V3 decode tiles
#   bash benchmarks/gpu_system.sh OUT large-m                  # #31 target 5 (EP8-global large M; H100, session 23:
#                                         #      1.03x with the gated GEMM 1: results/fused_moe_large_m_h100_s23.md)
#   bash benchmarks/gpu_system.sh OUT gemv router-warps e2e     # #31 targets 1-2 on an H200 (H100, session 22: the
#                                         #      GEMV saves DeepSeek-V3 6.8% at batch 1; Qwen3 2.04x, DeepSeek-V3 1.15x,
#                                         #      Qwen3 batch 8 1.25x: results/e2e_h100_s22.md)
#   AB=1 bash benchmarks/gpu_system.sh OUT spec-never; bash benchmarks/gpu_system.sh OUT spec-never spec-profile-never
#                                         # #32 never-worse on an H200, before/after the break calibration (.ab: the
#                                         #      core before 2ab866b; on an H100, session 19: results/
#                                         #      speculative_never_h100_s19.md)
#   bash benchmarks/plan_profile.sh OUT                        # #34: the inputs the shipped plan profile borrows
# AB=1: the serving parts import the moeplex copied into .ab/moeplex (an earlier commit's core/, git-ignored), for a
# before/after in one call: mkdir .ab && git archive REV core | tar x -C .ab && mv .ab/core .ab/moeplex
# dgmasked needs the DeepGEMM wheel carried in .dg/ (see benchmarks/results/deepgemm_moe_h200.md); its JIT cache
# goes back as OUT/dg_cache.tgz (unpack it into .dg/cache to skip the compiles next time).
set -o pipefail
out=${1:-.}; shift
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
nvidia-smi -L | tee "$out/gpus.txt"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]\+" | head -1 | tr H h)
card=${card:-gpu}  # the tables are named by the card that ran them (h100, h200)
deadline=$(( $(date +%s) + ${GPU_BUDGET_S:-3600} ))  # GPU_BUDGET_S: the whole call's seconds; each part's limit shrinks to fit
lim() { local left=$(( deadline - $(date +%s) - 5 )); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
for part in "$@"; do
  echo "== $part $(date +%T)"
  case $part in
    tests)
      timeout -s ABRT $(lim 480) python3 -m pytest -q -rs -m gpu tests/test_kernel_rope.py tests/test_kernel_router_gemv.py \
        tests/test_triton_attention.py tests/test_triton_moe.py tests/test_fused_kernels.py tests/test_cuda_graph.py \
        tests/test_speculative_gpu.py tests/test_draft_graphs.py tests/test_cuda_graph_parallel.py tests/test_prefix_cache_benchmark.py \
        tests/test_torch_attention.py tests/test_ngram_device.py tests/test_verify_graphs.py tests/test_prompt_graphs.py tests/test_transfer.py 2>&1 \
        | tee "$out/gpu_tests.log" | tail -15 ;;
    tests-spec)
      timeout -s ABRT $(lim 150) python3 -m pytest -q -rs -m gpu tests/test_speculative_gpu.py tests/test_draft_graphs.py tests/test_ngram_device.py 2>&1 \
        | tee "$out/gpu_tests_spec.log" | tail -5 ;;
    tests-nextn)  # nextn's GPU tests: its graphed chain, and its verify steps under the overlap schedule
      timeout -s ABRT $(lim 180) python3 -m pytest -q -rs -m gpu tests/test_nextn_overlap.py tests/test_verify_graphs.py \
        tests/test_speculative_gpu.py tests/test_draft_graphs.py 2>&1 | tee "$out/gpu_tests_nextn.log" | tail -8 ;;
    tests-overlap)  # the GPU tests of the overlap schedule's steps only (graphs, syncs, overlapped verify steps)
      timeout -s ABRT $(lim 180) python3 -m pytest -q -rs -m gpu tests/test_cuda_graph.py tests/test_verify_graphs.py \
        tests/test_spec_overlap.py tests/test_prompt_graphs.py tests/test_transfer.py 2>&1 | tee "$out/gpu_tests_overlap.log" | tail -8 ;;
    spec)
      timeout $(lim 240) python3 benchmarks/speculative.py --device cuda --qwen-layers 12 --batches 1 8 32 --runs 3 \
        --out "$out/speculative_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -40 ;;
    spec-steady)  # two processes of three engines each: five 12-layer engines do not fit an H100's 80 GB
      for set in "ngram ngram/table" "test-oracle-device test-adversary"; do
        name=$(echo "$set" | tr ' /' '_-')
        timeout $(lim 210) python3 benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --interleave \
          --steady --runs 3 --batches 1 8 32 64 --output-len 64 --drafters $set \
          --out "$out/speculative_steady_${name}_${card}.md" 2>&1 | grep -v -i warn | tee "$out/${part}_$name.log" | tail -12
      done ;;
    spec-copy)  # #32 ngram: random weights (never worse) and the synthetic-map target's copy workload (its gain)
      timeout $(lim 330) python3 benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --interleave \
        --steady --runs 3 --batches 1 8 32 64 --output-len 64 --drafters ngram test-adversary \
        --out "$out/speculative_copy_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -16 ;;
    spec-never)  # #32 "never worse" on random weights: ngram at 1, 8, 32, 64 and the adversary (AB=1: the core in .ab)
      PYTHONPATH=${AB:+$PWD/.ab:}$PYTHONPATH timeout $(lim 240) python3 benchmarks/speculative.py --device cuda --only qwen \
        --qwen-layers 12 --interleave --steady --runs 3 --batches 1 8 32 64 --output-len 64 --drafters ngram test-adversary \
        --no-copy --out "$out/speculative_never${AB:+_ab}_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part${AB:+_ab}.log" | tail -14 ;;
    spec-never-control)  # batch 1, where a step is host work: a second plain engine beside the adversary, the A/A
                         # control of the host's noise (session 26, H100: one engine's host ms a step moved 1.0-1.5x)
      timeout $(lim 150) python3 benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --interleave --steady \
        --runs 5 --batches 1 --output-len 64 --drafters none/control test-adversary --no-copy \
        --out "$out/speculative_never_control_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -6 ;;
    spec-mixed)
      timeout $(lim 300) python3 benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --interleave --steady \
        --runs 3 --batches 8 32 --output-len 64 --drafters ngram --mixed-chunk on \
        --out "$out/speculative_mixed_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -20 ;;
    spec-dsv3)
      timeout $(lim 360) python3 benchmarks/speculative.py --device cuda --only dsv3 --steady --runs 3 --batches 1 8 32 64 \
        --output-len 64 --drafters ${DSV3_DRAFTERS:-nextn} --out "$out/speculative_dsv3_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -30 ;;
    spec-dsv3-deep)  # nextn where its MTP layer weighs what it does in the full model at batch 1 (24 layers of 16 experts)
      timeout $(lim 300) python3 benchmarks/speculative.py --device cuda --only dsv3 --dsv3-layers 24 --dsv3-experts 16 \
        --synthetic-only --steady --runs 3 --batches 1 8 32 --output-len 64 --drafters ${DSV3_DRAFTERS:-nextn} \
        --out "$out/speculative_dsv3_deep_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -12 ;;
    spec-dsv3-deep-steps)  # batch 1 with 4 and 5 draft steps: the verify step's extra expert reads make 3 steps'
                           # ceiling ~1.78x there (benchmarks/spec_ceiling.py); predicted 1.89x / 1.96x decode-only
      for steps in ${DEEP_STEPS:-4 5}; do
        timeout $(lim 200) python3 benchmarks/speculative.py --device cuda --only dsv3 --dsv3-layers 24 --dsv3-experts 16 \
          --synthetic-only --steady --runs 3 --batches 1 --output-len 64 --drafters nextn --steps $steps \
          --out "$out/speculative_dsv3_deep_steps${steps}_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.$steps.log" | tail -6
      done ;;
    spec-deep-admit)  # #32: deep nextn at 32, 8, 1 where admissions join the run of verify steps (session 28); with
                      # AB=1 the core in .ab runs first, in the same call (the before)
      for v in ${AB:+before} after; do  # DEEP_BATCHES: the batches (default 32 8 1)
        pp=$PYTHONPATH; [ $v = before ] && pp=$PWD/.ab:$PYTHONPATH
        PYTHONPATH=$pp timeout $(lim 240) python3 benchmarks/speculative.py --device cuda --only dsv3 --dsv3-layers 24 \
          --dsv3-experts 16 --synthetic-only --steady --runs 3 --batches ${DEEP_BATCHES:-32 8 1} --output-len 64 --drafters nextn \
          --out "$out/speculative_dsv3_deep_admit_${v}_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.$v.log" | tail -10
      done ;;
    spec-dsv3-deep-mixed)  # the deep nextn run at 8 and 32 with mixed steps that verify (prompt tokens as decode rows
                           # beside the verify rows: ModelRunner.verify_rows), then under the default for comparison
      for mixed in on auto; do
        timeout $(lim 280) python3 benchmarks/speculative.py --device cuda --only dsv3 --dsv3-layers 24 --dsv3-experts 16 \
          --synthetic-only --steady --runs 3 --batches 8 32 --output-len 64 --drafters nextn --mixed-chunk $mixed \
          --out "$out/speculative_dsv3_deep_mixed_${mixed}_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.$mixed.log" | tail -8
      done ;;
    spec-profile)
      timeout $(lim 150) python3 benchmarks/spec_profile.py --device cuda --batch 1 --out "$out/prof1" \
        --drafters ngram/fixed/overlap ngram/overlap test-oracle-device 2>&1 | grep -v -i warn | tail -20
      timeout $(lim 150) python3 benchmarks/spec_profile.py --device cuda --batch 8 --out "$out/prof8" \
        --drafters ngram/overlap 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -20
      timeout $(lim 150) python3 benchmarks/spec_profile.py --device cuda --batch 32 --out "$out/prof32" \
        --drafters test-oracle-device ngram/overlap 2>&1 | grep -v -i warn | tee -a "$out/$part.log" | tail -20 ;;
    spec-profile-never)  # #32's never-worse misses on the H200: ngram (random weights) at 64 and 32, the adversary at 1;
                         # step kinds, overlap breaks, host and device ms per step against plain decoding
      for b in 64 32; do
        timeout $(lim 150) python3 benchmarks/spec_profile.py --device cuda --batch $b --out "$out/prof_never$b" \
          --drafters ngram 2>&1 | grep -v -i warn | grep "^| [nt]" | tee -a "$out/$part.log"
      done
      timeout $(lim 150) python3 benchmarks/spec_host_profile.py --device cuda --layers 12 --batches 1 --runs 3 \
        --output-len 64 --drafters none test-adversary ngram 2>&1 | grep -v -i warn | grep "^| Q" | tee -a "$out/$part.log" ;;
    spec-profile-dsv3)
      timeout $(lim 200) python3 benchmarks/spec_host_profile.py --device cuda --model dsv3 --drafters none nextn \
        --batches 1 8 32 --runs 3 --output-len 48 --out "$out/spec_host_dsv3.md" 2>&1 | grep -v -i warn | tail -8
      timeout $(lim 150) python3 benchmarks/spec_profile.py --device cuda --model dsv3 --batch 8 --out "$out/prof8_dsv3" \
        --drafters nextn 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -8 ;;
    spec-profile-deep-mixed)  # where a mixed verify step's time goes (deep nextn at 32: ~56 ms against ~25 ms for an
                              # overlapped verify step, H100 session 24), under --mixed-chunk on, then auto
      for mixed in on auto; do
        timeout $(lim 200) python3 benchmarks/spec_profile.py --device cuda --model dsv3 --dsv3-layers 24 --dsv3-experts 16 \
          --batch 32 --mixed-chunk $mixed --out "$out/prof32_deep_$mixed" --drafters nextn 2>&1 | grep -v -i warn \
          | tee "$out/$part.$mixed.log" | tail -6
      done ;;
    spec-serve-spread)  # the same, each request's new tokens uniform in 64 x [0.5, 1.5]: arrivals apart for both servers
      timeout $(lim 300) python3 benchmarks/spec_serving.py --arch qwen3_moe --preset 30b-a3b --layers 12 --load-format dummy \
        --dtype bf16 --device cuda --runs 3 --num-requests 128 --output-len 64 --output-spread 0.5 \
        --out "$out/spec_serving_spread_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -20 ;;
    host-prompts)  # steady decode at 16 with a 97-token prompt arriving every 4 steps: syncs, step kinds, cProfile
      for graphs in on off; do
        flags=(); [ $graphs = off ] && flags=(--disable-prompt-graphs)
        timeout $(lim 150) python3 benchmarks/host_profile.py --layers 12 --batch 16 --admit-every 4 --prompt-len 97 \
          --steps 40 "${flags[@]}" --out "$out/host_prompts_graphs_$graphs.md" 2>&1 | grep -v -i warn | grep -A4 "| kind"
      done ;;
    spec-serve)
      timeout $(lim 300) python3 benchmarks/spec_serving.py --arch qwen3_moe --preset 30b-a3b --layers 12 --load-format dummy \
        --dtype bf16 --device cuda --runs 3 --num-requests 128 --output-len 64 --out "$out/spec_serving_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -20 ;;
    moe-small-m)
      timeout $(lim 240) python3 benchmarks/moe_small_m.py --shapes deepseek-v3 --runs 5 --out "$out/moe_small_m_dsv3.md" \
        --write-configs "$out/configs" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -20 ;;
    small-m-tables)  # #31 targets 1-2 on a card without tuned tables: decode before, the small-M sweep writes this card's
                     # tables, they go into the plugin's configs/ (here only: commit them from OUT/configs), decode after
      for model in qwen dsv3; do
        timeout $(lim 150) python3 benchmarks/e2e_gpu.py --skip-correctness --only $model --decode 1 8 --prefill 4096 \
          --out "$out/e2e_${model}_before.md" 2>&1 | grep -v -i warn | tail -6
      done
      timeout $(lim 200) python3 benchmarks/moe_small_m.py --runs 5 --out "$out/moe_small_m_${card}.md" \
        --write-configs "$out/configs" 2>&1 | grep -v -i warn | tail -24
      cp "$out"/configs/*.json plugins/moe_kernels/triton_moe/configs/
      for model in qwen dsv3; do
        for run in 1 2 3; do
          prof=(); [ $run = 1 ] && prof=(--profile-graphed "$out/prof_$model")
          timeout $(lim 150) python3 benchmarks/e2e_gpu.py --skip-correctness --only $model --decode 1 8 --prefill 4096 \
            "${prof[@]}" --out "$out/e2e_${model}_run$run.md" 2>&1 | grep -v -i warn | tail -6
        done
      done ;;
    large-m)
      timeout $(lim 120) python3 -m pytest -q -m gpu tests/test_triton_moe_library.py tests/test_triton_attention.py 2>&1 | tee "$out/large_m_tests.log" | tail -3
      for run in 1 2 3; do
        timeout $(lim 150) python3 benchmarks/fused_moe.py --shape deepseek-v3-ep8 --dtype bf16 --routing global local \
          --tokens 512 2048 4096 16384 2>&1 | grep -v -i warn | tee "$out/fused_moe_large_m_run$run.md" | tail -10
      done
      timeout $(lim 90) python3 benchmarks/moe_grouping.py --shape deepseek-v3-ep8 --routing global local --tokens 2048 16384 \
        2>&1 | grep -v -i warn | tee "$out/moe_grouping.md" | tail -20
      (cd benchmarks && timeout $(lim 120) python3 large_m_probe.py 16384 2>&1 | tee "$out/large_m_probe.md" | tail -30) ;;
    gemv)  # #31 targets 1-2: what the start-up choice of the Triton GEMV saves a graphed decode step (the GEMV
           # layers switched off and on, 3 alternations), then the projections at 1-4 rows against cuBLAS, one by one
      for model in qwen dsv3; do  # one model a process: both engines at once do not fit an H100
        timeout $(lim 150) python3 benchmarks/e2e_gpu.py --skip-correctness --only $model --decode 1 4 --prefill \
          --ablate-launch-cuts --ablate-only GEMV --out "$out/e2e_gemv_${model}_${card}.md" > "$out/e2e_gemv_$model.log" 2>&1
        grep "^|" "$out/e2e_gemv_$model.log" | tee -a "$out/$part.log" | tail -12; grep -m3 -i "error" "$out/e2e_gemv_$model.log"
      done
      timeout $(lim 150) python3 benchmarks/gemv_small_m.py --out "$out/gemv_small_m_${card}.md" 2>&1 | grep -v -i warn \
        | grep "^|" | tee -a "$out/$part.log" | tail -30
      timeout $(lim 60) python3 -m pytest -q -m gpu tests/test_kernel_gemv.py 2>&1 | tail -2 | tee -a "$out/$part.log" ;;
    router-warps)  # the one-launch router's warps per program at each token block (router_gemv.WARPS_BY_TOKENS)
      timeout $(lim 150) python3 benchmarks/router_warps.py --out "$out/router_warps_${card}.md" 2>&1 | grep -v -i warn \
        | tee "$out/$part.log" | tail -18 ;;
    e2e)
      for model in qwen dsv3; do
        for run in 1 2 3; do
          timeout $(lim 150) python3 benchmarks/e2e_gpu.py --skip-correctness --only $model --decode 1 8 32 --prefill \
            --compare-fewer-launches --out "$out/e2e_${model}_run$run.md" 2>&1 | grep -v -i warn | tail -14
        done
      done ;;
    dgprobe|dgmasked)
      python3 -m pip install -q --no-deps --no-index .dg/deep*.whl  # built by benchmarks/deepgemm_build.sh
      mkdir -p .dg/cache
      export CPLUS_INCLUDE_PATH=$PWD/.dg/include DG_JIT_CACHE_DIR=$PWD/.dg/cache
      export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}  # where its JIT finds nvcc
      # The extension built on the lent image carries its own copies of libstdc++'s locale objects and names no
      # libstdc++.so.6, so its first call to the JIT runtime reached a wrong facet (or factory) and crashed; with the
      # shared library preloaded every copy resolves to the one (session 19: results/deepgemm_masked_h100_s19.md)
      export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}
      if [ $part = dgprobe ]; then  # does DeepGEMM run here at all: the libraries it may load, its JIT's commands
        { ldconfig -p | grep -E "libdw|libelf" ; command -v gdb; echo "CUDA_HOME=$CUDA_HOME"; } 2>&1 | tee "$out/dgprobe.log"
        DG_JIT_DEBUG=1 timeout $(lim 150) python3 -X faulthandler benchmarks/deepgemm_probe.py 2>&1 | tail -60 \
          | tee -a "$out/dgprobe.log" | grep -v "^  \|^$" | tail -25
        if grep -q "Segmentation fault" "$out/dgprobe.log"; then  # the native frames, named (no gdb on the image)
          gcc -shared -fPIC -o /tmp/segv_frames.so benchmarks/segv_frames.c
          LD_PRELOAD=/tmp/segv_frames.so timeout $(lim 120) python3 benchmarks/deepgemm_probe.py 2>&1 \
            | grep -A64 "native frames" > "$out/dgprobe_frames.log"
          grep -o "^[^ ]*(+0x[0-9a-f]*)" "$out/dgprobe_frames.log" | head -24 | while IFS='(' read -r lib offset; do
            echo "$(basename "$lib") ${offset%)}: $(addr2line -f -C -e "$lib" "${offset%)}" 2>/dev/null | head -1)"
          done | tee -a "$out/dgprobe_frames.log"
        fi
        continue
      fi
      for run in 1 2 3; do  # the plugin's whole masked path against the Triton kernel on the same routing
        timeout $(lim 200) python3 benchmarks/deepgemm_moe.py --decode 1 8 32 --prefill 2>&1 | grep -v -i warn \
          | tee "$out/deepgemm_moe_run$run.md" | grep "^| [0-9]"
      done
      timeout $(lim 420) python3 benchmarks/deepgemm_masked.py \
        --tokens 1 8 32 --runs 3 --out "$out/deepgemm_masked_${card}.md" 2>&1 | grep -v -i warn | tail -12
      tar czf "$out/dg_cache.tgz" -C .dg cache ;;
    serving|serving-1t)  # #31 target 3: served against the offline engine at concurrency 64 (tiny DeepSeek-V3), 3 runs
                         # each, alternated, with a second offline process as the A/A control of the host's noise;
                         # serving-1t: one torch CPU thread in the offline engine and the server's rank
      threads=(); [ $part = serving-1t ] && threads=(--threads 1)
      PYTHONPATH=${AB:+$PWD/.ab:}$PYTHONPATH timeout $(lim 300) python3 benchmarks/serving.py --device cuda --concurrency 64 --num-requests 256 --runs 3 --control "${threads[@]}" \
        --out "$out/${part}${AB:+_ab}_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part${AB:+_ab}.log" | tail -16 ;;
    front-end)  # #31 target 3: the front end alone, against a stand-in engine of 2 ms steps (no GPU used; this host's CPU)
      PYTHONPATH=${AB:+$PWD/.ab:}$PYTHONPATH timeout $(lim 120) python3 benchmarks/front_end_ceiling.py --runs 3 \
        --out "$out/front_end${AB:+_ab}_${card}_host.md" 2>&1 | grep -v -i warn | tail -4 ;;
    serving-interval)  # #31 target 3: served against offline at --stream-interval 1 and 4 (the front end's cost per chunk)
      for iv in 1 4; do
        timeout $(lim 150) python3 benchmarks/serving.py --device cuda --concurrency 64 --num-requests 256 --runs 3 \
          --stream-interval $iv --out "$out/serving_interval${iv}_${card}.md" 2>&1 | grep -v -i warn | grep -A3 "median (min"
      done ;;
    spec-oracle-steps)  # #32: the oracle's ceiling at batch 1 with 7 and 3 draft steps (256 tokens a request)
      for steps in 7 3; do
        timeout $(lim 150) python3 benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --steady --runs 3 \
          --batches 1 --output-len 256 --no-copy --drafters test-oracle-device --steps $steps \
          --out "$out/speculative_oracle_steps${steps}_${card}.md" 2>&1 | grep -v -i warn | tail -3
      done ;;
    offline-host)  # #31 target 3: host ms per step by phase, offline against a served rank 0 (tiny DeepSeek-V3, graphs)
      timeout $(lim 200) python3 benchmarks/offline_host_profile.py --device cuda --dtype bf16 --runs 3 \
        --out "$out/offline_host_${card}.md" 2>&1 | grep -v -i warn | tee "$out/$part.log" | tail -20 ;;
    prefix)
      timeout $(lim 300) python3 benchmarks/prefix_cache.py --device cuda --runs 3 --out "$out/prefix_cache_${card}.md" 2>&1 \
        | grep -v -i warn | tee "$out/$part.log" | tail -20 ;;
  esac
done
