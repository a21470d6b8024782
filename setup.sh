#!/usr/bin/env bash
# One-step setup: the mlagen package with its build tools (pybind11, ninja), torch, the test tools,
# and the real sglang package for the plugin tests (installed without its heavy dependencies).
# Keeps an already installed torch (e.g. a CUDA build on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi
"$PY" -m pip install -e ".[test,plot]"
# SGLang plugin: sglang itself without dependencies (it pins a torch build), plus what it imports.
"$PY" -m pip install --no-deps "sglang==0.5.23"
"$PY" -m pip install -r requirements-sglang.txt
command -v nvcc >/dev/null || echo "warning: nvcc not on PATH: install the CUDA toolkit 13.x to build kernels" >&2
