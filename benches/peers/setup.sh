#!/usr/bin/env bash
# One-time set-up of the benchmark peers (benches/peers/*.py): a Python venv with PyTorch, HF
# transformers, TRL and datasets. About 6 GB and a few minutes. Usage: setup.sh [VENV] (default
# /tmp/peer-venv); the benchmarks find it through RLHF_PEER_PYTHON (default /tmp/peer-venv/bin/python).
set -eu
venv=${1:-/tmp/peer-venv}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch numpy
"$venv/bin/pip" install -q transformers safetensors gguf accelerate datasets "trl==1.16.0"
echo "peers ready: RLHF_PEER_PYTHON=$venv/bin/python"
