#!/bin/bash
# SMOLLM2_F32: the f32 export of ../shared/models/smollm2-135m-instruct (`burn-rlhf model export --model ../shared/models/smollm2-135m-instruct --out DIR`); run from the repository root.
# $1: out dir, $2: hybrid_engine value, $3: steps
target/release/burn-rlhf train configs/grpo_gsm8k.ron \
  actor_rollout_ref.model.path=$SMOLLM2_F32 \
  data.train_files=[../shared/data/gsm8k/train.jsonl] data.val_files=[../shared/data/gsm8k/test.jsonl] \
  data.max_prompt_length=256 data.max_response_length=128 data.train_batch_size=4 \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.hybrid_engine=$2 trainer.total_training_steps=$3 trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.logger=[jsonl] trainer.resume_mode=disable trainer.default_local_dir=$1 trainer.seed=1
