#!/bin/bash
# Issue 58 item 3: what the rollout pool is sent each step, GRPO on SmolLM2-135M and GSM8K with
# the pool in an MPI process of its own (the config of 2026-11-29-rollout-pool-mpi-smollm2.sh):
# full fine-tuning against LoRA on q_proj and v_proj merged for generation. Reads
# `rollout/weight_values_sent` from each step's metrics.
# SMOLLM2_F32: the f32 export of ../shared/models/smollm2-135m-instruct (`burn-rlhf model export
# --model ../shared/models/smollm2-135m-instruct --out DIR`). Build: cargo build --release -p
# burn-rlhf --features mpi. Run from the repository root.
# $1: full | lora, $2: out dir, $3: steps
mode=$1 out=$2 steps=$3
args=(configs/grpo_gsm8k.ron actor_rollout_ref.model.path=$SMOLLM2_F32
  "data.train_files=[../shared/data/gsm8k/train.jsonl]" "data.val_files=[../shared/data/gsm8k/test.jsonl]"
  data.max_prompt_length=256 data.max_response_length=128 data.train_batch_size=4
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
  trainer.total_training_steps=$steps trainer.test_freq=-1 trainer.save_freq=-1
  trainer.logger=[jsonl] trainer.resume_mode=disable trainer.default_local_dir=$out trainer.seed=1
  actor_rollout_ref.hybrid_engine=False)
[ "$mode" = lora ] && args+=(actor_rollout_ref.model.lora_rank=8 "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"
  actor_rollout_ref.model.lora.merge=true)
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --bind-to core -np 2 \
  target/release/burn-rlhf train "${args[@]}"
python3 -c "
import json,sys
for line in open('$out/metrics.jsonl'):
    m=json.loads(line); print(m['step'] if 'step' in m else '', int(m.get('rollout/weight_values_sent',-1)), round(m.get('timing_s/step',0),1))
"
