#!/bin/bash
# The GPU figures of issue 39 in one device run (`../shared/gpu/pack.sh burn-rlhf
# test:burn-rlhf-algos:kernels` here first; on the GPU host, from the checkout:
# `bash benches/gpu/h100.sh [PHASE ...]`). Each phase has a time limit so one slow phase cannot eat
# the run; everything goes to $OUT/run.log (and JSON lines to $OUT/bench.jsonl).
#
# Phases (default: the first four): kernels (the fused kernels' parity), ppo (two PPO steps of 16
# prompts x 128 tokens, actor + critic: first and steady), gen (64 x 128+256 generation and 8 x 384
# forward+backward, cold and warm), peer (HF transformers and verl's code on the same GPU), then
# fixtures (verl's fixtures through the CUDA kernels), bf16 (generation in bf16), grpo (two GRPO
# steps), trl (three GRPO steps, then TRL's GRPOTrainer on the same GPU, model, prompts and sizes,
# f32 then bf16 weights: `benches/gpu/trl_wheels.sh` here first, and `.whl` carried), gpu
# (burn-rlhf's GPU tests: compile counts, kernel cache, the engine on the device) and nccl (a
# one-rank communicator checked and timed; two ranks on the one GPU).
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
log=$OUT/run.log
phases=${*:-kernels ppo gen peer}
# The test binaries find the checkout where they were built.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
export RLHF_FIXTURES_DIR=$PWD/tests/fixtures
model=/tmp/qwen05
data="data.train_files=.gpu/gsm8k/test.jsonl data.val_files=.gpu/gsm8k/test.jsonl"
# 16 prompts x 128 new tokens, one mini-batch; micro-batches as a GPU run sets them.
ppo="configs/ppo_gsm8k.ron actor_rollout_ref.model.path=$model critic.model.path=$model $data
  data.train_batch_size=16 actor_rollout_ref.actor.ppo_mini_batch_size=16 data.max_response_length=128
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 critic.ppo_micro_batch_size_per_gpu=8
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"
grpo="configs/grpo_gsm8k.ron actor_rollout_ref.model.path=$model $data data.train_batch_size=16
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=16 data.max_response_length=128"
step() { # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$log"
  local t0=$(date +%s.%N)
  timeout -k 5 "$limit" bash .gpu/run.sh "$@" 2>&1 | tee -a "$log" | grep '^{' >> "$OUT/bench.jsonl"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc wall=$(awk "BEGIN{print $(date +%s.%N) - $t0}")s" | tee -a "$log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
# Unpacks the binaries and makes the random model once, outside the phases' limits.
t0=$(date +%s); bash .gpu/run.sh true >> "$log" 2>&1; echo "=== setup $(( $(date +%s) - t0 ))s" | tee -a "$log"
for p in $phases; do
  case $p in
    kernels) step kernels 60 kernels --test-threads 1 ;;
    ppo) step ppo ${PPO_LIMIT_S:-320} burn-rlhf bench $ppo --generate 0 0 0 --fwd-bwd 0 0 --steps 2 ;;
    gen) step gen 120 burn-rlhf bench $ppo --steps 0 ;;
    peer) step peer 90 env PYTHONUNBUFFERED=1 python3 .gpu/torch_peer_gpu.py $model 64 ;;
    fixtures) step fixtures 40 verl_fixtures --test-threads 1 ;;
    bf16) step bf16 60 burn-rlhf bench $ppo actor_rollout_ref.rollout.dtype=bfloat16 --fwd-bwd 0 0 --steps 0 ;;
    grpo) step grpo 70 burn-rlhf bench $grpo --generate 0 0 0 --fwd-bwd 0 0 --steps 2 ;;
    trl) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$log" 2>&1
         export PYTHONPATH=/tmp/site
         # Micro-batches of 16 on both sides (TRL's per-device batch), no KL, on-policy.
         for dt in float32 bfloat16; do
           step trl-$dt ${TRL_LIMIT_S:-240} burn-rlhf bench $grpo actor_rollout_ref.model.dtype=$dt \
             actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=false \
             data.shuffle=false trainer.val_before_train=false --generate 0 0 0 --fwd-bwd 0 0 --steps 3 \
             --peer benches/peers/trl_grpo.py --peer-python python3
         done ;;
    gpu) step gpu 100 gpu --test-threads 1 ;;
    nccl) # pip's NCCL beside torch (libnccl.so.2), named for burn-rlhf.
          export BURN_RLHF_NCCL_LIB=$(python3 -c "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
          echo "BURN_RLHF_NCCL_LIB=$BURN_RLHF_NCCL_LIB: $(ls $BURN_RLHF_NCCL_LIB 2>&1)" | tee -a "$log"
          step nccl 25 burn-rlhf bench-collectives --devices 1 --max-mib 64 --transport nccl
          step nccl-two-ranks 15 burn-rlhf bench-collectives --devices 2 --same-device --max-mib 1 --transport nccl ;;
    *) echo "unknown phase $p" | tee -a "$log" ;;
  esac
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$log"
