#!/usr/bin/env bash
# One-time set-up of every benchmark peer in benches/peers/: a Python venv with PyTorch, HF
# transformers, TRL 1.16 and datasets (trl_grpo.py, hf_model.py), verl 0.9.1's algorithm code
# (cases.py) and TensorBoard (tests/fixtures/gen/tensorboard_events.py); collectives.py needs
# only torch. About 6 GB and a few minutes. Usage: setup.sh [VENV] (default /tmp/peer-venv); the benchmarks find it through
# RLHF_PEER_PYTHON (default /tmp/peer-venv/bin/python).
set -eu
venv=${1:-/tmp/peer-venv}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch numpy
"$venv/bin/pip" install -q transformers safetensors gguf accelerate datasets "trl==1.16.0" tensorboard
# verl without its GPU dependencies: core_algos needs only these.
"$venv/bin/pip" install -q --no-deps verl==0.9.1
"$venv/bin/pip" install -q ray omegaconf "tensordict>=0.8.0,!=0.9.0,<=0.10.0" codetiming
# verl's distillation losses (tests/fixtures/gen/verl_distillation.py) import its whole config package.
"$venv/bin/pip" install -q hydra-core pillow orjson
echo "peers ready: RLHF_PEER_PYTHON=$venv/bin/python"
