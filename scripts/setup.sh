#!/usr/bin/env bash
# Set up moeplex in ./.venv: the CPU build of torch on machines without an NVIDIA GPU,
# then the project with its test extras and the example third-party plugin package.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1); then
    # no GPU: pin the CPU wheel first so nothing below pulls a multi-GB CUDA build
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[test]" -e examples/moeplex-example-plugins
# NVIDIA NIXL for the nixl kv_transfer backend (the extra moeplex[nixl]); --no-deps, or pip swaps in a CUDA torch
"${PIP[@]}" --no-deps "nixl-cu12>=0.5" || echo "NIXL (nixl-cu12) did not install here: the nixl kv_transfer tests skip"
echo "moeplex is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
