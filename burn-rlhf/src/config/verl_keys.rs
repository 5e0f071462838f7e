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
    "under `strategy: megatron` a trained model's parameters are whole on the device in every \
     phase that uses it; `strategy: fsdp` with `fsdp_config.param_offload=true` keeps each rank's \
     chunks of them in host memory (gathered to the device per layer on use), \
     `fsdp_config.optimizer_offload=true` keeps AdamW's moments there, and \
     `actor_rollout_ref.ref.fsdp_config.param_offload=true` keeps the reference there between its \
     passes";
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
        "actor_rollout_ref.actor.fsdp_config.grad_offload",
        Treatment::OnlyAt(&["false"], NO_GRAD_OFFLOAD),
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

/// Also in verl's newer engine sections (`fsdp_config` of the actor and reference, the critic's
/// `fsdp`), and the keys that take several values with one meaning here.
pub const ENGINE_KEYS: &[(&str, Treatment)] = &[
    (
        "actor_rollout_ref.actor.optim.clip_grad",
        Treatment::Alias("actor_rollout_ref.actor.grad_clip"),
    ),
    (
        "critic.optim.clip_grad",
        Treatment::Alias("critic.grad_clip"),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
        Treatment::OnlyAt(&["1"], NO_MODEL_PARALLEL),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
        Treatment::OnlyAt(&["1"], NO_MODEL_PARALLEL),
    ),
    (
        "critic.fsdp.ulysses_sequence_parallel_size",
        Treatment::OnlyAt(&["1"], NO_MODEL_PARALLEL),
    ),
    (
        "critic.ulysses_sequence_parallel_size",
        Treatment::OnlyAt(&["1"], NO_MODEL_PARALLEL),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation",
        Treatment::OnlyAt(&["false", "true"], ONE_REDUCTION),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.use_no_sync_for_gradient_accumulation",
        Treatment::OnlyAt(&["false", "true"], ONE_REDUCTION),
    ),
    (
        "critic.fsdp.use_no_sync_for_gradient_accumulation",
        Treatment::OnlyAt(&["false", "true"], ONE_REDUCTION),
    ),
    (
        "critic.fsdp.param_offload",
        Treatment::Alias("critic.model.fsdp_config.param_offload"),
    ),
    (
        "critic.fsdp.optimizer_offload",
        Treatment::Alias("critic.model.fsdp_config.optimizer_offload"),
    ),
    (
        "critic.fsdp.fsdp_size",
        Treatment::Alias("critic.model.fsdp_config.fsdp_size"),
    ),
    (
        "critic.fsdp.reshard_after_forward",
        Treatment::Alias("critic.model.fsdp_config.reshard_after_forward"),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.optimizer_offload",
        Treatment::OnlyAt(&["false"], "the reference has no optimiser"),
    ),
    (
        "actor_rollout_ref.actor.optim.optimizer",
        Treatment::OnlyAt(&["adamw", "adam"], ADAMW),
    ),
    (
        "critic.optim.optimizer",
        Treatment::OnlyAt(&["adamw", "adam"], ADAMW),
    ),
    (
        "actor_rollout_ref.actor.optim.override_optimizer_config",
        Treatment::OnlyAt(
            &["null", "{}"],
            "the optimiser's settings are the `optim.*` keys",
        ),
    ),
    (
        "critic.optim.override_optimizer_config",
        Treatment::OnlyAt(
            &["null", "{}"],
            "the optimiser's settings are the `optim.*` keys",
        ),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.strategy",
        Treatment::OnlyAt(&["fsdp", "fsdp2"], STRATEGY),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.strategy",
        Treatment::OnlyAt(&["fsdp", "fsdp2"], STRATEGY),
    ),
    (
        "critic.fsdp.strategy",
        Treatment::OnlyAt(&["fsdp", "fsdp2"], STRATEGY),
    ),
    (
        "actor_rollout_ref.actor.megatron.param_offload",
        Treatment::OnlyAt(&["false"], NO_PARAM_OFFLOAD),
    ),
    (
        "critic.megatron.param_offload",
        Treatment::OnlyAt(&["false"], NO_PARAM_OFFLOAD),
    ),
    (
        "actor_rollout_ref.actor.megatron.optimizer_offload",
        Treatment::Alias("actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
    ),
    (
        "critic.megatron.optimizer_offload",
        Treatment::Alias("critic.model.fsdp_config.optimizer_offload"),
    ),
    (
        "actor_rollout_ref.ref.megatron.optimizer_offload",
        Treatment::OnlyAt(&["false"], "the reference has no optimiser"),
    ),
    (
        "actor_rollout_ref.actor.megatron.use_remove_padding",
        Treatment::Alias("actor_rollout_ref.model.use_remove_padding"),
    ),
    (
        "critic.megatron.use_remove_padding",
        Treatment::Alias("critic.model.use_remove_padding"),
    ),
    (
        "actor_rollout_ref.actor.megatron.sequence_parallel",
        Treatment::OnlyAt(&["true", "false"], SEQUENCE_PARALLEL),
    ),
    (
        "actor_rollout_ref.ref.megatron.sequence_parallel",
        Treatment::OnlyAt(&["true", "false"], SEQUENCE_PARALLEL),
    ),
    (
        "critic.megatron.sequence_parallel",
        Treatment::OnlyAt(&["true", "false"], SEQUENCE_PARALLEL),
    ),
    (
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer",
        Treatment::OnlyAt(&["true", "false"], DISTRIBUTED_OPTIMIZER),
    ),
    (
        "actor_rollout_ref.ref.megatron.use_distributed_optimizer",
        Treatment::OnlyAt(&["true", "false"], "the reference has no optimiser"),
    ),
    (
        "critic.megatron.use_distributed_optimizer",
        Treatment::OnlyAt(&["true", "false"], DISTRIBUTED_OPTIMIZER),
    ),
    (
        "critic.fsdp.model_dtype",
        Treatment::Alias("critic.model.fsdp_config.model_dtype"),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.dtype",
        Treatment::OnlyAt(&["bfloat16", "float16"], FSDP_DTYPE),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.dtype",
        Treatment::OnlyAt(&["bfloat16", "float16"], FSDP_DTYPE),
    ),
    (
        "critic.fsdp.dtype",
        Treatment::OnlyAt(&["bfloat16", "float16"], FSDP_DTYPE),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.reshard_after_forward",
        Treatment::OnlyAt(&["true", "false"], REF_WHOLE),
    ),
    // Megatron's parameter dtype is the dtype the model computes in.
    (
        "actor_rollout_ref.actor.megatron.dtype",
        Treatment::Alias("actor_rollout_ref.model.dtype"),
    ),
    (
        "actor_rollout_ref.ref.megatron.dtype",
        Treatment::Refused(ONE_COMPUTE_DTYPE),
    ),
    (
        "critic.megatron.dtype",
        Treatment::Refused(ONE_COMPUTE_DTYPE),
    ),
    (
        "actor_rollout_ref.rollout.enable_sleep_mode",
        Treatment::OnlyAt(
            &["false", "true"],
            "generation reads the trained weights in place and its KV pool exists only while a \
             batch generates: nothing sleeps or wakes",
        ),
    ),
    (
        "actor_rollout_ref.rollout.free_cache_engine",
        Treatment::OnlyAt(
            &["true", "false"],
            "the KV pool exists only while a batch generates (the engine is made per batch)",
        ),
    ),
    (
        "trainer.use_legacy_worker_impl",
        Treatment::OnlyAt(
            &["auto", "enable", "disable"],
            "burn-rlhf has one implementation of the workers (the learner's phases)",
        ),
    ),
    (
        "actor_rollout_ref.rollout.load_format",
        Treatment::OnlyAt(
            &[
                "dummy",
                "auto",
                "safetensors",
                "hf",
                "dtensor",
                "dummy_dtensor",
            ],
            "generation reads the trained weights in place, whatever the format named",
        ),
    ),
    (
        "actor_rollout_ref.rollout.layered_summon",
        Treatment::OnlyAt(
            &["false", "true"],
            "generation reads the trained (with LoRA, adapted) weights in place: no layer is \
             gathered to hand over",
        ),
    ),
    (
        "actor_rollout_ref.model.trust_remote_code",
        Treatment::OnlyAt(&["false", "true", "null"], NO_REMOTE_CODE),
    ),
    (
        "critic.model.trust_remote_code",
        Treatment::OnlyAt(&["false", "true", "null"], NO_REMOTE_CODE),
    ),
    (
        "reward_model.model.trust_remote_code",
        Treatment::OnlyAt(&["false", "true", "null"], NO_REMOTE_CODE),
    ),
    (
        "data.trust_remote_code",
        Treatment::OnlyAt(&["false", "true", "null"], NO_REMOTE_CODE),
    ),
    (
        "critic.model.lora_rank",
        Treatment::OnlyAt(
            &["0"],
            "the critic trains every weight (LoRA is the actor's)",
        ),
    ),
    (
        "data.tokenizer",
        Treatment::Alias("actor_rollout_ref.model.tokenizer_path"),
    ),
    (
        "reward.reward_manager.name",
        Treatment::Alias("reward_model.reward_manager"),
    ),
    (
        "reward.reward_model.enable",
        Treatment::Alias("reward_model.enable"),
    ),
    (
        "reward.reward_model.model_path",
        Treatment::Alias("reward_model.model.path"),
    ),
];

const STRATEGY: &str = "FSDP's version (verl fills it from the model's `strategy`): both shard \
     the parameters the same way here; `actor_rollout_ref.actor.strategy` and `critic.strategy` \
     choose between sharding (`fsdp`, `fsdp2`) and whole parameters (`megatron`), as `actor_rollout_ref.ref.strategy` does \
     for the reference";
const REF_WHOLE: &str = "the frozen reference's pass gathers it whole once (it has no backward to \
     gather its layers for again): either value computes the same numbers";
const FSDP_DTYPE: &str = "verl's FSDP engine checks this value and never computes in it (its \
     compute dtype is `fsdp_config.mixed_precision.param_dtype`, bf16 by default); the compute \
     dtype here is `actor_rollout_ref.model.dtype`";

const ONE_COMPUTE_DTYPE: &str = "the policy, the reference and the critic compute in one dtype \
     here, `actor_rollout_ref.model.dtype` (the actor's `megatron.dtype` sets it): remove the key \
     (or set it with `null`)";
const ADAMW: &str = "the optimiser is AdamW (Burn's, decoupled weight decay: Megatron's `adam` is \
     the same), with verl's betas, weight decay and schedule";

const SEQUENCE_PARALLEL: &str = "a tensor-parallel layer's activations are whole on each rank \
     (Megatron's sequence parallelism splits them along the sequence between the layers, for \
     memory); the numbers are those of either value";
const DISTRIBUTED_OPTIMIZER: &str = "the AdamW state is sharded across data-parallel ranks with \
     `trainer.zero_stage=1` (Megatron's distributed optimiser), whichever value";
const ONE_REDUCTION: &str = "gradients are reduced once per mini-batch, after its last \
     micro-batch (what `true` asks for); the numbers are those of either value";
const NO_REMOTE_CODE: &str = "no code from the hub runs: burn-rlhf's decoders and tokenizers are \
     built in, for the model types they name";

/// Whose verl keys a config tree knows beside its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerlDialect {
    /// The PPO trainer's (`_generated_ppo_trainer.yaml` and Megatron's).
    Ppo,
    /// The SFT trainer's (`sft_trainer_engine.yaml`): its `model`, `engine`, `optim`,
    /// `profiler` and `checkpoint` sections follow the rules of the PPO actor's same sections
    /// ([`sft_as_ppo`]).
    Sft,
}

impl VerlDialect {
    /// What an override of `key` becomes (`known`: the tree has the key itself).
    pub fn treatment(self, key: &str, known: bool) -> Option<Treatment> {
        match self {
            Self::Ppo => treatment(key),
            Self::Sft => SFT_KEYS
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, t)| *t)
                .or_else(|| {
                    // The PPO actor's rule for the same section; its other names are PPO keys.
                    let ppo = sft_as_ppo(key)?;
                    match treatment(&ppo) {
                        Some(Treatment::Alias(_)) => None,
                        t if !known => t,
                        _ => None,
                    }
                }),
        }
    }
}

/// verl's SFT sections and the PPO actor's section whose rules they follow (the same config
/// groups in verl: `model/hf_model`, `engine/fsdp`, `optim/fsdp`, the profiler, the checkpoint).
const SFT_SECTIONS: &[(&str, &str)] = &[
    ("model.", "actor_rollout_ref.model."),
    ("engine.", "actor_rollout_ref.actor.fsdp_config."),
    ("optim.", "actor_rollout_ref.actor.optim."),
    ("profiler.", "actor_rollout_ref.actor.profiler."),
    ("checkpoint.", "actor_rollout_ref.actor.checkpoint."),
];

/// The PPO tree's name of the SFT tree's `key`, for the sections they share.
pub fn sft_as_ppo(key: &str) -> Option<String> {
    SFT_SECTIONS
        .iter()
        .find_map(|(sft, ppo)| key.strip_prefix(sft).map(|rest| format!("{ppo}{rest}")))
}

/// verl 0.9.1's SFT trainer keys with no key of their own in the SFT tree.
pub const SFT_KEYS: &[(&str, Treatment)] = &[
    ("model.path", Treatment::Alias("model.partial_pretrain")),
    (
        "optim.lr_warmup_steps_ratio",
        Treatment::Alias("optim.warmup_steps_ratio"),
    ),
    (
        "optim.lr_scheduler_type",
        Treatment::Alias("optim.lr_scheduler"),
    ),
    (
        "data.balance_dp_token",
        Treatment::OnlyAt(
            &["false"],
            "verl's own note says \"to be implement\": ranks split a batch's rows evenly",
        ),
    ),
    (
        "data.num_workers",
        Treatment::OnlyAt(&["8"], "data loads in the process, before training"),
    ),
    (
        "trainer.balance_batch",
        Treatment::OnlyAt(
            &["true", "false"],
            "verl's SFT trainer never reads it: ranks split a batch's rows evenly",
        ),
    ),
    (
        "trainer.profile_interval",
        Treatment::OnlyAt(
            &["[-1,-1]"],
            "profilers are not built in (time phases with the `timing_s/*` metrics)",
        ),
    ),
];

/// The treatment of the PPO tree's `key`, when it is one of [`VERL_KEYS`] or [`ENGINE_KEYS`].
pub fn treatment(key: &str) -> Option<Treatment> {
    VERL_KEYS
        .iter()
        .chain(ENGINE_KEYS)
        .find(|(k, _)| *k == key)
        .map(|(_, t)| *t)
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
