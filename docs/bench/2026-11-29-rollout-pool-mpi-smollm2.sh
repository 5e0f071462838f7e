#!/bin/bash
# Issue 58 item 4: GRPO on SmolLM2-135M and GSM8K (the config of 2026-11-28-one-step-off-grpo-smollm2.sh),
# synchronous on one process of two compute threads against one-step-off-policy training with the
# rollout pool in an MPI process of its own (one core each), on the same two cores.
# SMOLLM2_F32: the f32 export of ../shared/models/smollm2-135m-instruct (`burn-rlhf model export
# --model ../shared/models/smollm2-135m-instruct --out DIR`). Build: cargo build --release -p
# burn-rlhf --features mpi. Run from the repository root.
# $1: sync | pool, $2: out dir, $3: steps
mode=$1 out=$2 steps=$3
args=(configs/grpo_gsm8k.ron actor_rollout_ref.model.path=$SMOLLM2_F32
  "data.train_files=[../shared/data/gsm8k/train.jsonl]" "data.val_files=[../shared/data/gsm8k/test.jsonl]"
  data.max_prompt_length=256 data.max_response_length=128 data.train_batch_size=4
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
  trainer.total_training_steps=$steps trainer.test_freq=-1 trainer.save_freq=-1
  trainer.logger=[jsonl] trainer.resume_mode=disable trainer.default_local_dir=$out trainer.seed=1)
case $mode in
  sync) target/release/burn-rlhf train "${args[@]}" ;;
  pool) OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --bind-to core -np 2 \
          target/release/burn-rlhf train "${args[@]}" actor_rollout_ref.hybrid_engine=False ;;
esac
