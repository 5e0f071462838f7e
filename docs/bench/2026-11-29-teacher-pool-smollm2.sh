#!/bin/bash
# Issue 59 item 1: on-policy distillation with the teacher on the trainer's devices against the
# teacher on a pool of its own (`distillation.nnodes=1 distillation.n_gpus_per_node=1`), GRPO on
# SmolLM2-135M and GSM8K with the k3 loss backpropagated beside the task's and the reference's KL
# loss; the teacher is SmolLM2-135M itself (the figure is the time, not the learning). Reads each
# step's `timing_s/step`, `timing_s/ref`, `timing_s/teacher` (the step's wait for the teachers)
# and `timing_s/teacher_pool` (the pool's time from hand-over to its last answer).
# SMOLLM2_F32: the f32 export of ../shared/models/smollm2-135m-instruct (`burn-rlhf model export
# --model ../shared/models/smollm2-135m-instruct --out DIR`). Build: cargo build --release -p
# burn-rlhf. Run from the repository root.
# $1: here | pool, $2: out dir, $3: steps
mode=$1 out=$2 steps=$3
args=(configs/grpo_gsm8k.ron actor_rollout_ref.model.path=$SMOLLM2_F32
  "data.train_files=[../shared/data/gsm8k/train.jsonl]" "data.val_files=[../shared/data/gsm8k/test.jsonl]"
  data.max_prompt_length=256 data.max_response_length=128 data.train_batch_size=4
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.actor.use_kl_loss=true
  distillation.enabled=true distillation.teacher_models.teacher_model.model_path=$SMOLLM2_F32
  distillation.distillation_loss.loss_mode=k3
  trainer.total_training_steps=$steps trainer.test_freq=-1 trainer.save_freq=-1 trainer.val_before_train=false
  trainer.logger=[jsonl] trainer.resume_mode=disable trainer.default_local_dir=$out trainer.seed=1)
[ "$mode" = pool ] && args+=(distillation.nnodes=1 distillation.n_gpus_per_node=1
  "+distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1")
target/release/burn-rlhf train "${args[@]}"
python3 -c "
import json
for line in open('$out/metrics.jsonl'):
    m=json.loads(line)
    print(m.get('step',''), *(f'{k}={m[k]:.2f}' for k in ['timing_s/step','timing_s/gen','timing_s/ref','timing_s/teacher','timing_s/teacher_pool','timing_s/update_actor','distillation/abs_loss'] if k in m))
"
