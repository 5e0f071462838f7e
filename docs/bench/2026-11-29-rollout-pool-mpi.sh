#!/bin/bash
# Issue 58 item 4: GRPO on the quickstart's task (2-digit addition, its SFT model and data:
# `cargo run --release --example quickstart -- --out $Q` first), synchronous on one process of
# two compute threads against one-step-off-policy training with the rollout pool in an MPI
# process of its own (one core each), on the same two cores. Build: cargo build --release -p
# burn-rlhf --features mpi. Run from the repository root.
# $1: sync | pool | thread (one-step-off, the in-process worker), $2: out dir, $3: seed, $4: steps
Q=${Q:-runs/quickstart}
mode=$1 out=$2 seed=$3 steps=$4
args=(configs/grpo_gsm8k.ron actor_rollout_ref.model.path=$Q/sft_model
  "data.train_files=[$Q/data/train.parquet]" "data.val_files=[$Q/data/test.parquet]"
  custom_reward_function.name=arithmetic data.max_prompt_length=8 data.max_response_length=4
  data.train_batch_size=64 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=32
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128 actor_rollout_ref.actor.optim.lr=4e-5
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=256
  trainer.total_training_steps=$steps trainer.test_freq=$steps trainer.val_before_train=true
  trainer.save_freq=-1 trainer.logger=[jsonl] trainer.resume_mode=disable
  trainer.default_local_dir=$out trainer.seed=$seed data.seed=$seed)
case $mode in
  sync) target/release/burn-rlhf train "${args[@]}" ;;
  thread) target/release/burn-rlhf train "${args[@]}" actor_rollout_ref.hybrid_engine=False ;;
  pool) OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --bind-to core -np 2 \
          target/release/burn-rlhf train "${args[@]}" actor_rollout_ref.hybrid_engine=False ;;
esac
