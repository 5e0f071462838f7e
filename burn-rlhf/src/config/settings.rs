//! The config decoded once into typed settings: each section's keys are parsed into their types
//! and checked by the section's own file (`data.rs`, `actor.rs`, ...), with verl's derived keys
//! filled first ([`RlhfConfig::resolve`]); the few rules across sections are here. Decoding is
//! validation: every parse error and broken rule is collected, and a config with any of them is
//! refused with all of them. Everything below the config reads these, never the raw tree; an
//! `Option` here means something ("none": no critic, the whole set), never "use the default".

use super::actor::ActorContext;
pub use super::actor::ActorSettings;
pub use super::algorithm::{AlgorithmSettings, FilterGroups, FilterMetric, KlInReward};
use super::critic::CriticContext;
pub use super::critic::CriticSettings;
pub use super::data::DataSettings;
use super::error::ConfigError;
pub use super::model::ModelSettings;
use super::names::KnownNames;
pub use super::optim::{OptimSettings, ScheduleKind, Warmup};
use super::problems::Problems;
use super::reward::RewardContext;
pub use super::reward::{OverlongPenalty, RewardModelInput, RewardModelSettings, RewardSettings};
use super::rollout::PoolContext;
pub use super::rollout::{OneStepOff, RolloutSettings, SamplingSettings};
pub use super::trainer::{ResumeMode, TrainerSettings};
use super::tree::RlhfConfig;

/// The whole run's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `data.*`.
    pub data: DataSettings,
    /// `actor_rollout_ref.model.*`.
    pub model: ModelSettings,
    /// `actor_rollout_ref.actor.*`.
    pub actor: ActorSettings,
    /// `actor_rollout_ref.rollout.*`.
    pub rollout: RolloutSettings,
    /// `actor_rollout_ref.ref.*`: sequences per forward pass (`None`: all of a rank's rows).
    pub ref_micro_batch_size: Option<usize>,
    /// `actor_rollout_ref.ref.log_prob_max_token_len_per_gpu` when `log_prob_use_dynamic_bsz`:
    /// micro-batches of at most this many tokens instead.
    pub ref_max_token_len: Option<usize>,
    /// `actor_rollout_ref.ref.fsdp_config.param_offload`: the reference's weights in host memory
    /// except during its pass.
    pub ref_param_offload: bool,
    /// `actor_rollout_ref.ref.strategy: fsdp` (the actor's by default): the reference sharded
    /// over the data-parallel ranks (with more than one), gathered whole for its pass.
    pub ref_fsdp: Option<super::optim::FsdpSharding>,
    /// `actor_rollout_ref.ref.fsdp_config.model_dtype`: the dtype the reference's weights are
    /// held in (`None`: f32).
    pub ref_dtype: Option<burn::tensor::FloatDType>,
    /// `critic.*`; `None` when the estimator reads no values (verl's `critic.enable` default).
    pub critic: Option<CriticSettings>,
    /// `reward_model.*` and `custom_reward_function.*`.
    pub reward: RewardSettings,
    /// `algorithm.*`.
    pub algorithm: AlgorithmSettings,
    /// `trainer.*`.
    pub trainer: TrainerSettings,
    /// `actor_rollout_ref.hybrid_engine=False`: one-step-off-policy training with the root
    /// `rollout.*` pool; `None`: the hybrid engine (generation in the trainer's step).
    pub one_step_off: Option<OneStepOff>,
    /// `distillation.*` when `enabled`: the teachers and how their scores train the actor.
    pub distillation: Option<super::distillation::DistillationSettings>,
}

impl Settings {
    /// Resolves verl's derived keys, then parses and checks every key (all problems reported
    /// together, with `origin` naming the file and overrides); `known` is what the
    /// registry-selected keys may name.
    pub fn from_config(
        config: &RlhfConfig,
        known: &KnownNames,
        origin: &str,
    ) -> Result<Self, ConfigError> {
        let mut c = config.clone();
        c.resolve();
        let mut p = Problems::default();
        let settings = decode(&c, known, &mut p);
        p.finish(origin, settings)
    }

    /// Responses per training prompt (`rollout.n`).
    pub fn n(&self) -> usize {
        self.rollout.train.n
    }

    /// What in these settings makes the rollout's log-probs differ from the trainer's
    /// recomputation (each a key and why; empty: nothing here, the backend, its shape bucket and
    /// the estimator still have their say): what `actor_rollout_ref.rollout.exact_logprobs`
    /// checks.
    pub fn inexact_logprobs(&self) -> Vec<(&'static str, String)> {
        use burn::tensor::FloatDType;
        let mut why = Vec::new();
        let (passes, generation) = (
            self.model.dtype.unwrap_or(FloatDType::F32),
            self.rollout.dtype.unwrap_or(FloatDType::F32),
        );
        if passes != generation {
            why.push((
                "actor_rollout_ref.rollout.dtype",
                format!(
                    "generation computes in {generation:?} and the passes in {passes:?} \
                     (`actor_rollout_ref.model.dtype`): the rollout's log-probs are another \
                     precision's"
                ),
            ));
        } else if !matches!(passes, FloatDType::F32 | FloatDType::BF16) {
            why.push((
                "actor_rollout_ref.model.dtype",
                format!("{passes:?} passes run Burn's reference kernels, not batch-invariant"),
            ));
        }
        let train = &self.rollout.train;
        if train.greedy() {
            why.push((
                "actor_rollout_ref.rollout.temperature",
                "greedy decoding's log-probs are not the tempered distribution's".into(),
            ));
        }
        if train.top_k.is_some() || train.top_p < 1.0 {
            why.push((
                "actor_rollout_ref.rollout.top_k",
                "a top-k or top-p cut samples from another distribution than the trainer \
                 scores (as in verl)"
                    .into(),
            ));
        }
        if self.rollout.logprobs_mode == burn_rlhf_rollout::LogprobsMode::Raw
            && train.temperature != 1.0
        {
            why.push((
                "actor_rollout_ref.rollout.logprobs_mode",
                format!(
                    "raw log-probs are the untempered distribution's, the trainer scores at \
                     temperature {}",
                    train.temperature
                ),
            ));
        }
        if !self.model.use_fused_kernels {
            why.push((
                "actor_rollout_ref.model.use_fused_kernels",
                "without the fused LM head the trainer's log-softmax is Burn's, summed in \
                 another order"
                    .into(),
            ));
        }
        if self.model.lora_merge {
            why.push((
                "actor_rollout_ref.model.lora.merge",
                "generation runs on the merged weights, the trainer on the adapters".into(),
            ));
        }
        if self.one_step_off.is_some() {
            why.push((
                "actor_rollout_ref.hybrid_engine",
                "one-step-off-policy: the rollout ran the weights of the step before the \
                 trainer's"
                    .into(),
            ));
        }
        if self.actor.tensor_parallel_size > 1 {
            why.push((
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                "the vocabulary-parallel log-softmax sums each rank's share first (1.7e-7 apart)"
                    .into(),
            ));
        } else if self.rollout.tensor_parallel_size > 1 {
            why.push((
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "the split rollout's vocabulary-parallel log-softmax sums each rank's share \
                 first, the trainer's whole one does not"
                    .into(),
            ));
        }
        why
    }
}

impl RlhfConfig {
    /// Checks every key and rule with the built-in names.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.validate_with(&KnownNames::default(), origin)
    }

    /// Checks every key and rule; `known` lists what each name key may be.
    pub fn validate_with(&self, known: &KnownNames, origin: &str) -> Result<(), ConfigError> {
        Settings::from_config(self, known, origin).map(|_| ())
    }
}

/// Every section, in the order their rules read each other; `None` when any problem was found.
fn decode(c: &RlhfConfig, known: &KnownNames, p: &mut Problems) -> Option<Settings> {
    let arr = &c.actor_rollout_ref;
    let data = c.data.decode(p);
    let model = arr.model.decode(p);
    let rollout = arr.rollout.decode(p, &c.data, known);
    let ref_max_token_len = arr.reference.decode_budget(p, &c.data);
    let algorithm = c.algorithm.decode(p, known);
    let actor = arr.actor.decode(
        p,
        known,
        &ActorContext {
            data: &c.data,
            rollout: &arr.rollout,
            correction: algorithm.correction.as_ref(),
            seed: c.trainer.seed,
        },
    );
    let critic = c.critic.decode(
        p,
        &CriticContext {
            data: &c.data,
            actor_model: &arr.model,
            n: arr.rollout.n,
            estimator: &c.algorithm.adv_estimator,
            needs_critic: algorithm.needs_critic,
            actor_tp: arr.actor.megatron.tensor_model_parallel_size,
        },
    );
    let reward = c.reward_model.decode(
        p,
        &RewardContext {
            custom: &c.custom_reward_function,
            known,
            max_response_length: c.data.max_response_length,
            actor_tokenizers: [
                &arr.model.path,
                arr.model
                    .tokenizer_path
                    .as_deref()
                    .unwrap_or(&arr.model.path),
            ],
            actor_tp: arr.actor.megatron.tensor_model_parallel_size,
        },
    );
    let trainer = c.trainer.decode(p);
    if let Some(actor) = &actor {
        p.check(c.trainer.zero_stage == 0 || actor.optim.fsdp.is_none(), || {
            "`trainer.zero_stage=1` shards the AdamW state of parameters held whole on each rank \
             (`actor_rollout_ref.actor.strategy=megatron`, Megatron's distributed optimiser); \
             under `strategy: fsdp` the parameters, gradients and state are sharded already: \
             set one of the two"
                .into()
        });
    }
    let tp = arr.actor.megatron.tensor_model_parallel_size.max(1);
    let ref_fsdp = arr.reference.decode_sharding(p, tp);
    let ref_dtype = arr.reference.decode_model_dtype(p);
    c.critic.check_tensor_parallel(p, tp);
    let distillation = c.distillation.decode(p, tp);
    let devices = c.trainer.nnodes * c.trainer.n_gpus_per_node;
    let rollout_tp = arr
        .rollout
        .decode_tensor_parallel(p, tp, devices, arr.hybrid_engine);
    let one_step_off = c.rollout.decode(
        p,
        &PoolContext {
            hybrid_engine: arr.hybrid_engine,
            dynamic_sampling: c.algorithm.filter_groups.enable,
            lora_unmerged: arr.model.lora_rank > 0 && !arr.model.lora.merge,
        },
    );
    p.check(devices.is_multiple_of(tp), || {
        format!(
            "`actor_rollout_ref.actor.megatron.tensor_model_parallel_size` ({tp}) must divide the \
             run's devices (`trainer.nnodes` x `trainer.n_gpus_per_node` = {devices})"
        )
    });
    p.check(tp == 1 || arr.model.lora_rank == 0, || {
        "`actor_rollout_ref.model.lora_rank` with `actor_rollout_ref.actor.megatron.\
         tensor_model_parallel_size` > 1: LoRA adapters are not split across ranks; train LoRA \
         with data parallelism"
            .into()
    });
    p.check(
        !(c.algorithm.use_kl_in_reward && arr.actor.use_kl_loss),
        || {
            "`algorithm.use_kl_in_reward` and `actor_rollout_ref.actor.use_kl_loss` are both on: \
         apply the KL penalty either in the reward or in the loss, not both"
                .into()
        },
    );
    let (mut model, actor, mut rollout, critic) = (model?, actor?, rollout?, critic?);
    rollout.tensor_parallel_size = rollout_tp;
    if actor.optim.master_dtype.is_some()
        || critic
            .as_ref()
            .is_some_and(|c| c.optim.master_dtype.is_some())
    {
        // Weights held in half precision compute in `model.dtype` / `rollout.dtype` all the
        // same (float32 by default: a pass casts them up), as verl's FSDP mixed precision does.
        model.dtype.get_or_insert(burn::tensor::FloatDType::F32);
        rollout.dtype.get_or_insert(burn::tensor::FloatDType::F32);
    }
    Some(Settings {
        data: data?,
        model,
        actor,
        rollout,
        ref_micro_batch_size: arr.reference.log_prob_micro_batch_size_per_gpu,
        ref_max_token_len: ref_max_token_len?,
        ref_param_offload: arr.reference.offloads_params(),
        ref_fsdp,
        ref_dtype: ref_dtype?,
        critic,
        reward: reward?,
        algorithm: algorithm.settings?,
        trainer: trainer?,
        one_step_off,
        distillation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::error::ConfigError;
    use crate::config::names::KnownNames;
    use crate::config::tree::RlhfConfig;
    use burn_rlhf_algos::LossAggMode;

    fn settings(config: &RlhfConfig) -> Result<Settings, ConfigError> {
        Settings::from_config(config, &KnownNames::default(), "test")
    }

    /// `trainer.logger=[file]` writes where verl's `file` logger does.
    #[test]
    fn the_file_logger_goes_where_verls_does() {
        let mut c = RlhfConfig::default();
        c.trainer.logger = vec!["console".into(), "file".into()];
        c.trainer.project_name = "proj".into();
        c.trainer.experiment_name = "exp".into();
        let file = settings(&c).unwrap().trainer.loggers.file.unwrap();
        match (
            std::env::var_os("VERL_FILE_LOGGER_PATH"),
            std::env::var_os("VERL_FILE_LOGGER_ROOT"),
        ) {
            (Some(path), _) => assert_eq!(file, std::path::PathBuf::from(path)),
            (None, None) => assert_eq!(file, std::path::Path::new("./proj/exp.jsonl")),
            (None, Some(root)) => assert!(file.starts_with(root)),
        }
        c.trainer.logger = vec!["console".into()];
        assert_eq!(settings(&c).unwrap().trainer.loggers.file, None);
    }

    /// `model.cuda_matmul` names an engine; the cuBLAS ones need a CUDA build.
    #[test]
    fn the_cuda_matmul_key_names_an_engine() {
        use burn_rlhf_models::kernels::CudaMatmul;
        let mut c = RlhfConfig::default();
        assert_eq!(settings(&c).unwrap().model.cuda_matmul, CudaMatmul::CubeCl);
        c.actor_rollout_ref.model.cuda_matmul = "cublass".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(
            err.contains("actor_rollout_ref.model.cuda_matmul") && err.contains("cublas_tf32"),
            "{err}"
        );
        c.actor_rollout_ref.model.cuda_matmul = "cublas".into();
        match settings(&c) {
            Ok(s) => {
                assert!(cfg!(feature = "cuda"));
                assert_eq!(s.model.cuda_matmul, CudaMatmul::Cublas);
            }
            Err(e) => {
                assert!(!cfg!(feature = "cuda"));
                assert!(e.to_string().contains("needs a CUDA build"), "{e}");
            }
        }
    }

    #[test]
    fn derived_keys_and_names_decode_once() {
        let mut c = RlhfConfig::default();
        c.actor_rollout_ref.actor.clip_ratio = 0.3;
        c.actor_rollout_ref.actor.clip_ratio_high = Some(0.28);
        c.data.max_response_length = 77;
        c.algorithm.gae_lambda_value = Some(0.9);
        c.trainer.critic_warmup = 2;
        c.trainer.policy_training_start_step = Some(5);
        let s = settings(&c).unwrap();
        assert_eq!(
            (s.actor.loss.clip_ratio_low, s.actor.loss.clip_ratio_high),
            (0.3, 0.28)
        );
        assert_eq!(s.rollout.response_length, 77);
        assert_eq!(s.actor.loss_agg_mode, LossAggMode::TokenMean);
        assert_eq!(s.algorithm.value_lambda, Some(0.9));
        assert_eq!(s.trainer.actor_start_step, 5);
        let critic = s.critic.expect("gae has a critic");
        assert_eq!(
            critic.ppo_mini_batch_size,
            c.actor_rollout_ref.actor.ppo_mini_batch_size
        );
        assert_eq!(critic.ppo_epochs, 1);
        c.algorithm.adv_estimator = "grpo".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(err.contains("decoupled GAE lambdas need a critic"), "{err}");
        c.algorithm.gae_lambda_value = None;
        assert!(settings(&c).unwrap().critic.is_none());
    }

    #[test]
    fn rules_are_checked_before_decoding() {
        let mut c = RlhfConfig::default();
        c.actor_rollout_ref.actor.loss_agg_mode = "token-avg".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(
            err.contains("actor_rollout_ref.actor.loss_agg_mode"),
            "{err}"
        );
    }

    /// `hybrid_engine=False` is one-step-off-policy training on the root `rollout` pool; what
    /// it cannot run as written is refused naming the keys.
    #[test]
    fn hybrid_engine_off_is_one_step_off_policy() {
        let mut c = RlhfConfig::default();
        assert_eq!(settings(&c).unwrap().one_step_off, None);
        c.rollout.n_gpus_per_node = 8;
        let err = settings(&c).unwrap_err().to_string();
        assert!(err.contains("hybrid_engine=False"), "{err}");
        c.actor_rollout_ref.hybrid_engine = false;
        // A pool of 8 (MPI processes; the in-process worker refuses it when it starts).
        let s = settings(&c).unwrap();
        assert_eq!(s.one_step_off, Some(OneStepOff { rollout_devices: 8 }));
        c.rollout.n_gpus_per_node = 0;
        let err = settings(&c).unwrap_err().to_string();
        assert!(err.contains("`rollout.n_gpus_per_node` = 0"), "{err}");
        c.rollout.n_gpus_per_node = 1;
        // LoRA adapters generate merged only.
        c.actor_rollout_ref.model.lora_rank = 4;
        let err = settings(&c).unwrap_err().to_string();
        assert!(err.contains("lora.merge=true"), "{err}");
        c.actor_rollout_ref.model.lora.merge = true;
        settings(&c).unwrap();
        c.actor_rollout_ref.model.lora.merge = false;
        c.actor_rollout_ref.model.lora_rank = 0;
        let s = settings(&c).unwrap();
        assert_eq!(s.one_step_off, Some(OneStepOff { rollout_devices: 1 }));
        // The rollout's log-probs are a step older than the trainer's weights.
        assert!(s
            .inexact_logprobs()
            .iter()
            .any(|(key, _)| *key == "actor_rollout_ref.hybrid_engine"));
        // A data-parallel trainer of one process, or of several hosts (MPI processes beside
        // a pool; the launch checks the hosts).
        c.trainer.n_gpus_per_node = 2;
        settings(&c).unwrap();
        c.trainer.nnodes = 2;
        let s = settings(&c).unwrap();
        assert_eq!(s.one_step_off, Some(OneStepOff { rollout_devices: 1 }));
        c.trainer.nnodes = 1;
        c.actor_rollout_ref.actor.strategy = "megatron".into();
        c.actor_rollout_ref
            .actor
            .megatron
            .tensor_model_parallel_size = 2;
        // A tensor-parallel trainer hands the rollout worker its actor made whole.
        let s = settings(&c).unwrap();
        assert_eq!(s.one_step_off, Some(OneStepOff { rollout_devices: 1 }));
        c.actor_rollout_ref
            .actor
            .megatron
            .tensor_model_parallel_size = 1;
        c.trainer.n_gpus_per_node = 1;
        c.algorithm.filter_groups.enable = true;
        c.algorithm.filter_groups.metric = Some("acc".into());
        let err = settings(&c).unwrap_err().to_string();
        assert!(err.contains("algorithm.filter_groups.enable"), "{err}");
    }

    /// `agent.default_agent_loop` is looked up when the config is decoded: a name no loop
    /// answers to is one error naming the key and the loops known; with multi-turn on, a named
    /// loop is kept (the default, `single_turn_agent`, becomes `tool_agent`).
    #[test]
    fn the_default_agent_loop_is_looked_up_when_decoding() {
        let mut c = RlhfConfig::default();
        c.actor_rollout_ref.rollout.agent.default_agent_loop = "my_agent".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(
            err.contains("actor_rollout_ref.rollout.agent.default_agent_loop")
                && err.contains("single_turn_agent, tool_agent"),
            "{err}"
        );
        let known = KnownNames::default().with_agent_loops(["my_agent".to_string()]);
        let s = Settings::from_config(&c, &known, "test").unwrap();
        assert_eq!(s.rollout.default_agent_loop, "my_agent");
        c.data.return_raw_chat = true;
        c.actor_rollout_ref.rollout.multi_turn.enable = true;
        let s = Settings::from_config(&c, &known, "test").unwrap();
        assert_eq!(
            s.rollout.default_agent_loop, "my_agent",
            "a named loop is kept"
        );
        c.actor_rollout_ref.rollout.agent.default_agent_loop = "single_turn_agent".into();
        assert_eq!(
            settings(&c).unwrap().rollout.default_agent_loop,
            "tool_agent"
        );
        c.actor_rollout_ref.rollout.multi_turn.enable = false;
        c.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent".into();
        let err = settings(&c).unwrap_err().to_string();
        assert!(
            err.contains("needs `actor_rollout_ref.rollout.multi_turn.enable`"),
            "{err}"
        );
    }

    /// The multi-turn files are read when the config is decoded: a missing file, a file that
    /// does not parse and an unknown tool class are each refused naming the key and the file.
    #[test]
    fn multi_turn_files_are_read_when_decoding() {
        let dir = std::env::temp_dir().join(format!("burn-rlhf-mt-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = RlhfConfig::default();
        c.data.return_raw_chat = true;
        let mt = &mut c.actor_rollout_ref.rollout.multi_turn;
        mt.enable = true;
        let shipped = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/tools/gsm8k_calculator.yaml"
        );
        mt.tool_config_path = Some(shipped.into());
        settings(&c).unwrap();
        let key = "`actor_rollout_ref.rollout.multi_turn.tool_config_path`";
        for (name, text, says) in [
            ("missing.yaml", None, "missing.yaml"),
            (
                "broken.yaml",
                Some("tools: [\n  - class_name: x\n"),
                "broken.yaml",
            ),
            (
                "unknown.yaml",
                Some("tools:\n  - class_name: my.Tool\n    config: {}\n    tool_schema: {}\n"),
                "unknown tool class `my.Tool`",
            ),
        ] {
            let path = dir.join(name);
            if let Some(text) = text {
                std::fs::write(&path, text).unwrap();
            }
            c.actor_rollout_ref.rollout.multi_turn.tool_config_path =
                Some(path.display().to_string());
            let err = settings(&c).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(says), "{name}: {err}");
        }
        std::fs::remove_dir_all(dir).ok();
    }
}
