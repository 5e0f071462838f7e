//! verl keys with no key of their own here, as verl's scripts set them on the command line: each is
//! read under the name it has here (verl renamed or moved it), read at the one value whose meaning
//! holds here, or refused saying why and what to do instead. `docs/verl_keys.md` lists every key
//! of verl's PPO, GRPO and DAPO example scripts with its treatment; a test keeps it true.

/// What an override of a verl key becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Read as this key (verl's other name for it).
    Alias(&'static str),
    /// Read when its value is one of these (compared case-insensitively, numbers by value): the
    /// meaning holds here; any other value is refused with the reason.
    OnlyAt(&'static [&'static str], &'static str),
    /// Refused: why, and what to do instead.
    Refused(&'static str),
}

/// Also `FsdpConfig::decode`'s reason, for the key written in a config file.
pub(super) const NO_PARAM_OFFLOAD: &str =
    "a trained model is on the device in every phase that uses it (generation runs on the \
     trained weights: there is no second copy to make room for); \
     `fsdp_config.optimizer_offload=true` keeps AdamW's moments in host memory, \
     `trainer.zero_stage=1` shards them, and `actor_rollout_ref.ref.fsdp_config.param_offload=true` \
     keeps the reference in host memory between its passes";
const NO_GRAD_OFFLOAD: &str = "gradients stay on the device (verl 0.9.1 has no such key): \
     `fsdp_config.optimizer_offload=true` keeps AdamW's moments in host memory and \
     `trainer.zero_stage=1` shards them across data-parallel ranks";
const NO_MODEL_PARALLEL: &str =
    "sequence parallelism is not built: each rank holds whole sequences; split models with \
     `actor_rollout_ref.actor.megatron.tensor_model_parallel_size` and add data parallelism \
     (`trainer.n_gpus_per_node`, `trainer.nnodes`)";
const GLOBAL_MICRO_BATCH: &str = "verl's deprecated global micro-batch: set the `_per_gpu` key \
     instead, to this value divided by `trainer.nnodes` x `trainer.n_gpus_per_node`";
const NO_DROPOUT: &str = "burn-rlhf's decoders have no dropout: 0 is their behaviour";

/// The verl keys handled here, by their full path (without Hydra's `+`).
pub const VERL_KEYS: &[(&str, Treatment)] = &[
    (
        "reward_model.model.use_remove_padding",
        Treatment::Refused(
            "a reward model's scoring passes run padded here (padding-free passes are the \
             policy's, reference's and critic's: `actor_rollout_ref.model.use_remove_padding`, \
             `critic.model.use_remove_padding`); padding is masked, so the scores are those of \
             either verl layout: remove the key",
        ),
    ),
    (
        "reward_model.micro_batch_size",
        Treatment::Refused(GLOBAL_MICRO_BATCH),
    ),
    // FSDP offload and layout.
    (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        Treatment::OnlyAt(&["false"], NO_PARAM_OFFLOAD),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.grad_offload",
        Treatment::OnlyAt(&["false"], NO_GRAD_OFFLOAD),
    ),
    (
        "critic.model.fsdp_config.param_offload",
        Treatment::OnlyAt(&["false"], NO_PARAM_OFFLOAD),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.fsdp_size",
        Treatment::OnlyAt(
            &["-1"],
            "-1 (one group of every rank) is the only data-parallel layout here (parameters \
             replicated, the AdamW state sharded with `trainer.zero_stage=1`); hybrid groups are \
             not built",
        ),
    ),
    // Model parallelism.
    (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        Treatment::OnlyAt(&["1"], NO_MODEL_PARALLEL),
    ),
    (
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        Treatment::OnlyAt(&["1"], NO_MODEL_PARALLEL),
    ),
    // The rollout engine.
    (
        "actor_rollout_ref.rollout.name",
        Treatment::OnlyAt(
            &["hf", "vllm", "sglang"],
            "generation runs burn-rlhf's own KV-cache sampler in the trainer's process, whichever \
             of verl's engines is named (hf, vllm, sglang)",
        ),
    ),
    // Renamed or deprecated in verl.
    (
        "actor_rollout_ref.actor.use_token_level_loss",
        Treatment::Refused(
            "verl's older switch for the loss aggregation: set \
             `actor_rollout_ref.actor.loss_agg_mode=token-mean` (true) or `seq-mean-token-mean` \
             (false)",
        ),
    ),
    (
        "actor_rollout_ref.actor.ppo_micro_batch_size",
        Treatment::Refused(GLOBAL_MICRO_BATCH),
    ),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        Treatment::Refused(GLOBAL_MICRO_BATCH),
    ),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size",
        Treatment::Refused(GLOBAL_MICRO_BATCH),
    ),
    (
        "critic.ppo_micro_batch_size",
        Treatment::Refused(GLOBAL_MICRO_BATCH),
    ),
    (
        "custom_reward_function.overlong_buffer.enable",
        Treatment::Alias("reward_model.overlong_buffer.enable"),
    ),
    (
        "custom_reward_function.overlong_buffer.len",
        Treatment::Alias("reward_model.overlong_buffer.len"),
    ),
    (
        "custom_reward_function.overlong_buffer.penalty_factor",
        Treatment::Alias("reward_model.overlong_buffer.penalty_factor"),
    ),
    (
        "custom_reward_function.overlong_buffer.log",
        Treatment::Alias("reward_model.overlong_buffer.log"),
    ),
    // HF config overrides (DAPO's dropouts).
    (
        "actor_rollout_ref.model.override_config.attention_dropout",
        Treatment::OnlyAt(&["0"], NO_DROPOUT),
    ),
    (
        "actor_rollout_ref.model.override_config.embd_pdrop",
        Treatment::OnlyAt(&["0"], NO_DROPOUT),
    ),
    (
        "actor_rollout_ref.model.override_config.resid_pdrop",
        Treatment::OnlyAt(&["0"], NO_DROPOUT),
    ),
];

/// The treatment of `key`, when it is one of [`VERL_KEYS`].
pub fn treatment(key: &str) -> Option<Treatment> {
    VERL_KEYS.iter().find(|(k, _)| *k == key).map(|(_, t)| *t)
}

/// Whether `raw` (an override's value) is one of `accepted`: case-insensitively, quotes aside,
/// and numbers by value (`0.` is `0`).
pub fn value_is(raw: &str, accepted: &[&str]) -> bool {
    let raw = raw
        .trim()
        .trim_matches(|c| c == '\'' || c == '"')
        .to_lowercase();
    accepted.iter().any(|a| {
        raw == *a || matches!((raw.parse::<f64>(), a.parse::<f64>()), (Ok(x), Ok(y)) if x == y)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_compare_by_meaning() {
        assert!(value_is("False", &["false"]) && value_is("'vllm'", &["hf", "vllm"]));
        assert!(value_is("0.", &["0"]) && value_is("-1", &["-1"]) && !value_is("2", &["1"]));
        assert!(treatment("actor_rollout_ref.rollout.name").is_some());
        assert!(treatment("actor_rollout_ref.rollout.n").is_none());
    }
}
