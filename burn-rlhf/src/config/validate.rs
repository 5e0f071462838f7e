//! Cross-field rules, checked after loading, one function per config section. Each failure is a
//! sentence naming the keys and the rule; one run reports all of them.

use burn_rlhf_algos::policy_loss::{BypassLossType, Dro, VanillaPpo};
use burn_rlhf_algos::{AlgoError, KlPenalty, LossAggMode, Registry};

use super::load::ConfigError;
use super::tree::{OptimConfig, RlhfConfig};

/// The dtype names the config accepts (verl's and their short forms).
const DTYPE_NAMES: &[&str] = &["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"];

/// The names a config may use for each registry-selected key, and which estimators need a critic.
/// [`KnownNames::default`] lists the built-ins; a program that registers its own estimator, loss
/// or controller builds this with [`KnownNames::from_registry`].
#[derive(Debug, Clone)]
pub struct KnownNames {
    /// `algorithm.adv_estimator`.
    pub adv_estimators: Vec<String>,
    /// The estimators that read a critic's values (a property of each estimator).
    pub critic_estimators: Vec<String>,
    /// `actor.policy_loss.loss_mode`.
    pub policy_losses: Vec<String>,
    /// The losses that see consecutive rows together (SPIN's pairs), with the unit: micro-batches
    /// are rounded up to whole units.
    pub policy_loss_units: Vec<(String, usize)>,
    /// `algorithm.kl_ctrl.type`.
    pub kl_controllers: Vec<String>,
    /// `custom_reward_function.name`; empty: not checked here (the reward registry is the
    /// learner's).
    pub reward_functions: Vec<String>,
}

impl Default for KnownNames {
    /// The built-in registry's names.
    fn default() -> Self {
        Self::from_registry(&Registry::<crate::backend::InferenceBackend>::builtin())
    }
}

impl KnownNames {
    /// The names `registry` can build (the built-ins plus whatever a program registered).
    pub fn from_registry<B: burn::tensor::backend::Backend>(registry: &Registry<B>) -> Self {
        Self {
            adv_estimators: registry.estimator_names(),
            critic_estimators: registry.critic_estimator_names(),
            policy_losses: registry.policy_loss_names(),
            policy_loss_units: registry.policy_loss_units(),
            kl_controllers: registry.kl_controller_names(),
            reward_functions: Vec::new(),
        }
    }
}

/// Collects rule violations so one run reports all of them.
#[derive(Default)]
pub(super) struct Problems(Vec<String>);

impl Problems {
    pub(super) fn check(&mut self, ok: bool, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(message());
        }
    }

    fn one_of(&mut self, key: &str, value: &str, valid: &[String]) {
        self.check(valid.iter().any(|v| v == value), || {
            format!(
                "`{key}` = `{value}` is not a known name; valid names: {}",
                valid.join(", ")
            )
        });
    }

    pub(super) fn one_of_str(&mut self, key: &str, value: &str, valid: &[&str]) {
        let valid: Vec<String> = valid.iter().map(|s| s.to_string()).collect();
        self.one_of(key, value, &valid);
    }

    /// `Ok` when nothing was found, else every problem of the config from `origin`.
    pub(super) fn into_result(self, origin: &str) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid {
                origin: origin.to_string(),
                problems: self.0,
            })
        }
    }

    /// A rule an algorithm owns about one of its parameters, reported under that parameter's
    /// key in `section` (the algorithm names the parameter: [`AlgoError::InvalidParam`]).
    fn param_rule(&mut self, section: &str, rule: Result<(), AlgoError>) {
        match rule {
            Err(AlgoError::InvalidParam { param, detail }) => {
                self.0.push(format!("`{section}.{param}` {detail}"))
            }
            other => self.algo_rule(section, other),
        }
    }

    /// A rule an algorithm owns, reported under the config key that sets its parameter.
    fn algo_rule(&mut self, key: &str, rule: Result<(), AlgoError>) {
        if let Err(e) = rule {
            let detail = match e {
                AlgoError::Invalid { detail, .. } | AlgoError::InvalidParam { detail, .. } => {
                    detail
                }
                other => other.to_string(),
            };
            self.0.push(format!("`{key}` {detail}"));
        }
    }
}

impl RlhfConfig {
    /// Checks the rules that involve more than one key, with the built-in names.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.validate_with(&KnownNames::default(), origin)
    }

    /// Checks the rules that involve more than one key; `known` lists what each name key may be.
    pub fn validate_with(&self, known: &KnownNames, origin: &str) -> Result<(), ConfigError> {
        let mut p = Problems::default();
        self.check_data(&mut p);
        self.check_actor(&mut p, known);
        self.check_rollout(&mut p);
        self.check_critic(&mut p, known);
        self.check_reward(&mut p, known);
        self.check_algorithm(&mut p, known);
        self.check_trainer(&mut p);
        p.into_result(origin)
    }

    fn check_data(&self, p: &mut Problems) {
        let data = &self.data;
        p.one_of_str(
            "data.truncation",
            &data.truncation,
            &["error", "left", "right"],
        );
        p.check(data.train_batch_size >= 1, || {
            "`data.train_batch_size` must be >= 1".into()
        });
        if let Some(gen) = data.gen_batch_size {
            p.check(gen >= 1, || "`data.gen_batch_size` must be >= 1".into());
        }
        p.check(data.max_response_length >= 1, || {
            "`data.max_response_length` must be >= 1".into()
        });
        p.check(data.return_raw_chat, || {
            "`data.return_raw_chat` = false is not supported: the rollout always applies the chat \
             template to each prompt's messages itself (verl's default, true)"
                .into()
        });
        p.check(!data.validation_shuffle, || {
            "`data.validation_shuffle` = true is refused: validation generates for every prompt, \
             each from its own random stream, so their order changes nothing"
                .into()
        });
        if let Some(len) = self.actor_rollout_ref.rollout.prompt_length {
            p.check(len == data.max_prompt_length, || {
                format!(
                    "`actor_rollout_ref.rollout.prompt_length` ({len}) must equal \
                     `data.max_prompt_length` ({}): prompts are cut to that length",
                    data.max_prompt_length
                )
            });
        }
    }

    /// `actor_rollout_ref.actor.*` and `model.*`, with the batch arithmetic in verl's units: batch
    /// sizes count prompts, each with `rollout.n` responses; micro-batches count sequences.
    fn check_actor(&self, p: &mut Problems, known: &KnownNames) {
        let arr = &self.actor_rollout_ref;
        let actor = &arr.actor;
        let n = arr.rollout.n;
        p.one_of(
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            &actor.policy_loss.loss_mode,
            &known.policy_losses,
        );
        p.one_of(
            "actor_rollout_ref.actor.loss_agg_mode",
            &actor.loss_agg_mode,
            &LossAggMode::names(),
        );
        p.one_of(
            "actor_rollout_ref.actor.kl_loss_type",
            &actor.kl_loss_type,
            &kl_penalty_names(),
        );
        p.one_of_str(
            "actor_rollout_ref.actor.policy_loss.dpo_loss_type",
            &actor.policy_loss.dpo_loss_type,
            &["sigmoid", "ipo"],
        );
        p.one_of_str(
            "actor_rollout_ref.model.dtype",
            &arr.model.dtype,
            DTYPE_NAMES,
        );
        if let Some(dtype) = &arr.rollout.dtype {
            p.one_of_str("actor_rollout_ref.rollout.dtype", dtype, DTYPE_NAMES);
        }
        check_optim(p, "actor_rollout_ref.actor.optim", &actor.optim);
        let mini = actor.ppo_mini_batch_size;
        p.check(mini >= 1, || {
            "`actor_rollout_ref.actor.ppo_mini_batch_size` must be >= 1".into()
        });
        if mini >= 1 && n >= 1 {
            let sequences = self.data.train_batch_size * n;
            p.check(sequences.is_multiple_of(mini * n), || {
                format!(
                    "`data.train_batch_size` * `actor_rollout_ref.rollout.n` ({} * {n} = {sequences} \
                     sequences) must be divisible by `actor_rollout_ref.actor.ppo_mini_batch_size` * \
                     `rollout.n` ({mini} * {n} = {} sequences per mini-batch)",
                    self.data.train_batch_size,
                    mini * n
                )
            });
            if let Some(micro) = actor.ppo_micro_batch_size_per_gpu {
                // The actor rounds a micro-batch up to whole units of its loss (SPIN's pairs).
                let unit = known
                    .policy_loss_units
                    .iter()
                    .find(|(name, _)| *name == actor.policy_loss.loss_mode)
                    .map_or(1, |(_, unit)| *unit);
                let runs = micro.div_ceil(unit) * unit;
                p.check(micro >= 1 && (mini * n).is_multiple_of(runs), || {
                    let rounded = if runs == micro {
                        String::new()
                    } else {
                        format!(", rounded up to {runs} to keep the loss's rows together,")
                    };
                    format!(
                        "`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` ({micro}){rounded} must divide \
                         the mini-batch of `ppo_mini_batch_size` * `rollout.n` = {} sequences",
                        mini * n
                    )
                });
            }
        }
        p.check(actor.ppo_epochs >= 1, || {
            "`actor_rollout_ref.actor.ppo_epochs` must be >= 1".into()
        });
        self.check_log_prob_budgets(p);
        p.param_rule(
            "actor_rollout_ref.actor",
            VanillaPpo::check_clip_ratio_c(actor.clip_ratio_c),
        );
        if actor.policy_loss.loss_mode == "dro" {
            p.param_rule(
                "actor_rollout_ref.actor.policy_loss",
                Dro::check_beta(actor.policy_loss.dro_beta.unwrap_or(0.0)),
            );
        }
        for (key, v) in [
            ("clip_ratio", Some(actor.clip_ratio)),
            ("clip_ratio_low", actor.clip_ratio_low),
            ("clip_ratio_high", actor.clip_ratio_high),
        ] {
            if let Some(v) = v {
                p.check(v >= 0.0, || {
                    format!("`actor_rollout_ref.actor.{key}` must be >= 0, got {v}")
                });
            }
        }
    }

    fn check_rollout(&self, p: &mut Problems) {
        let rollout = &self.actor_rollout_ref.rollout;
        p.one_of_str(
            "actor_rollout_ref.rollout.logprobs_mode",
            &rollout.logprobs_mode,
            &["raw_logprobs", "processed_logprobs"],
        );
        p.check(rollout.n >= 1, || {
            "`actor_rollout_ref.rollout.n` must be >= 1".into()
        });
        p.check(rollout.temperature >= 0.0, || {
            "`actor_rollout_ref.rollout.temperature` must be >= 0".into()
        });
        p.check(rollout.top_p > 0.0 && rollout.top_p <= 1.0, || {
            format!(
                "`actor_rollout_ref.rollout.top_p` must be in (0, 1], got {}",
                rollout.top_p
            )
        });
        p.check(rollout.top_k == -1 || rollout.top_k > 0, || {
            format!(
                "`actor_rollout_ref.rollout.top_k` must be -1 (off) or > 0, got {}",
                rollout.top_k
            )
        });
        p.check(rollout.val_kwargs.n >= 1, || {
            "`actor_rollout_ref.rollout.val_kwargs.n` must be >= 1".into()
        });
        p.check(
            rollout.max_num_seqs >= rollout.n.max(rollout.val_kwargs.n),
            || {
                format!(
                "`actor_rollout_ref.rollout.max_num_seqs` ({}) must hold one prompt's responses \
                 (`rollout.n` = {}, `val_kwargs.n` = {})",
                rollout.max_num_seqs, rollout.n, rollout.val_kwargs.n
            )
            },
        );
        p.check(rollout.max_num_batched_tokens >= 1, || {
            "`actor_rollout_ref.rollout.max_num_batched_tokens` must be >= 1".into()
        });
        p.check(self.actor_rollout_ref.model.shape_bucket != Some(0), || {
            "`actor_rollout_ref.model.shape_bucket` must be >= 1 (1: exact shapes)".into()
        });
        p.check(self.actor_rollout_ref.model.logits_chunk_size >= 1, || {
            "`actor_rollout_ref.model.logits_chunk_size` must be >= 1 (response tokens per chunk \
             of LM-head logits)"
                .into()
        });
    }

    /// The actor's and the log-prob passes' token budgets (`use_dynamic_bsz`).
    fn check_log_prob_budgets(&self, p: &mut Problems) {
        let arr = &self.actor_rollout_ref;
        let actor = &arr.actor;
        let rollout = &arr.rollout;
        for (key, dynamic, budget) in [
            (
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                Some(actor.use_dynamic_bsz),
                Some(actor.ppo_max_token_len_per_gpu),
            ),
            (
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                rollout.log_prob_use_dynamic_bsz,
                rollout.log_prob_max_token_len_per_gpu,
            ),
            (
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                arr.reference.log_prob_use_dynamic_bsz,
                arr.reference.log_prob_max_token_len_per_gpu,
            ),
        ] {
            self.check_token_budget(p, key, dynamic, budget);
        }
    }

    /// verl: with `use_dynamic_bsz` (`dynamic`) a token budget must hold one whole sequence.
    /// Both are derived keys, set by `resolve`.
    fn check_token_budget(
        &self,
        p: &mut Problems,
        key: &str,
        dynamic: Option<bool>,
        budget: Option<usize>,
    ) {
        let longest = self.data.max_prompt_length + self.data.max_response_length;
        if let (Some(true), Some(budget)) = (dynamic, budget) {
            p.check(budget >= longest, || {
                format!(
                    "`{key}` ({budget}) must hold one whole sequence: `data.max_prompt_length` + \
                     `data.max_response_length` = {longest} tokens"
                )
            });
        }
    }

    fn check_critic(&self, p: &mut Problems, known: &KnownNames) {
        let critic = &self.critic;
        let n = self.actor_rollout_ref.rollout.n;
        if let Some(mode) = &critic.loss_agg_mode {
            p.one_of("critic.loss_agg_mode", mode, &LossAggMode::names());
        }
        check_optim(p, "critic.optim", &critic.optim);
        if let (Some(cmini), Some(cmicro)) = (
            critic.ppo_mini_batch_size,
            critic.ppo_micro_batch_size_per_gpu,
        ) {
            p.check(cmicro >= 1 && (cmini * n).is_multiple_of(cmicro), || {
                format!(
                    "`critic.ppo_micro_batch_size_per_gpu` ({cmicro}) must divide the critic's mini-batch \
                     of `critic.ppo_mini_batch_size` * `rollout.n` = {} sequences",
                    cmini * n
                )
            });
        }
        p.check(critic.cliprange_value >= 0.0, || {
            format!(
                "`critic.cliprange_value` must be >= 0, got {}",
                critic.cliprange_value
            )
        });
        p.check(critic.value_loss_scale > 0.0, || {
            "`critic.value_loss_scale` must be > 0".into()
        });
        let estimator = &self.algorithm.adv_estimator;
        if known.critic_estimators.contains(estimator) {
            for (key, budget) in [
                (
                    "critic.ppo_max_token_len_per_gpu",
                    Some(critic.ppo_max_token_len_per_gpu),
                ),
                (
                    "critic.forward_max_token_len_per_gpu",
                    critic.forward_max_token_len_per_gpu,
                ),
            ] {
                self.check_token_budget(p, key, critic.use_dynamic_bsz, budget);
            }
            let actor_gc = self.actor_rollout_ref.model.enable_gradient_checkpointing;
            p.check(critic.model.enable_gradient_checkpointing == actor_gc, || {
                format!(
                    "`critic.model.enable_gradient_checkpointing` ({}) must equal \
                     `actor_rollout_ref.model.enable_gradient_checkpointing` ({actor_gc}): in Burn \
                     checkpointing belongs to the autodiff backend, which the actor and critic share",
                    critic.model.enable_gradient_checkpointing
                )
            });
            p.check(critic.enable != Some(false), || {
                format!("`algorithm.adv_estimator` = `{estimator}` needs a critic, but `critic.enable` is false")
            });
            p.check(!critic.model.path.trim().is_empty(), || {
                format!(
                    "`algorithm.adv_estimator` = `{estimator}` needs a critic: set `critic.model.path`"
                )
            });
            let model = &self.actor_rollout_ref.model;
            if let Some(tokenizer) = &critic.model.tokenizer_path {
                let actor_tokenizers = [Some(&model.path), model.tokenizer_path.as_ref()];
                p.check(actor_tokenizers.contains(&Some(tokenizer)), || {
                    format!(
                        "`critic.model.tokenizer_path` (`{tokenizer}`) must be the actor's \
                         tokenizer (`actor_rollout_ref.model.tokenizer_path`): the critic reads \
                         the actor's token ids"
                    )
                });
            }
        } else {
            p.check(critic.enable != Some(true), || {
                format!(
                    "`critic.enable` is true, but `algorithm.adv_estimator` = `{estimator}` reads \
                     no values: nothing would use the critic"
                )
            });
        }
    }

    fn check_reward(&self, p: &mut Problems, known: &KnownNames) {
        p.one_of_str(
            "reward_model.reward_manager",
            &self.reward_model.reward_manager,
            &["naive", "dapo"],
        );
        if let Some(name) = &self.custom_reward_function.name {
            if !known.reward_functions.is_empty() {
                p.one_of("custom_reward_function.name", name, &known.reward_functions);
            }
        }
        let ob = &self.reward_model.overlong_buffer;
        p.check(!ob.enable || self.reward_model.reward_manager == "dapo", || {
            format!(
                "`reward_model.overlong_buffer.enable` needs `reward_model.reward_manager` = `dapo` \
                 (verl's `{}` manager has no overlong buffer)",
                self.reward_model.reward_manager
            )
        });
        let max = self.data.max_response_length;
        p.check(!ob.enable || (ob.len >= 1 && ob.len <= max), || {
            format!(
                "`reward_model.overlong_buffer.len` ({}) must be in 1..=`data.max_response_length` ({max}) \
                 when the overlong buffer is enabled",
                ob.len
            )
        });
    }

    fn check_algorithm(&self, p: &mut Problems, known: &KnownNames) {
        let alg = &self.algorithm;
        let rc = &alg.rollout_correction;
        p.param_rule("algorithm.rollout_correction", rc.decode().map(|_| ()));
        let defaults = super::tree::RolloutCorrectionConfig::default();
        if rc.rollout_is.is_none() {
            for (key, set) in [
                (
                    "rollout_is_threshold",
                    rc.rollout_is_threshold != defaults.rollout_is_threshold,
                ),
                ("rollout_is_batch_normalize", rc.rollout_is_batch_normalize),
            ] {
                p.check(!set, || {
                    format!(
                        "`algorithm.rollout_correction.{key}` is set, but \
                         `algorithm.rollout_correction.rollout_is` is not: nothing reads it"
                    )
                });
            }
        }
        p.check(
            rc.rollout_rs.is_some() || rc.rollout_rs_threshold.is_none(),
            || {
                "`algorithm.rollout_correction.rollout_rs_threshold` is set, but \
             `algorithm.rollout_correction.rollout_rs` is not: nothing reads it"
                    .into()
            },
        );
        p.algo_rule(
            "algorithm.rollout_correction.loss_type",
            BypassLossType::from_name(&rc.loss_type).map(|_| ()),
        );
        let loss_mode = &self.actor_rollout_ref.actor.policy_loss.loss_mode;
        if rc.bypass_mode {
            p.check(loss_mode == "vanilla" || loss_mode == "bypass_mode", || {
                format!(
                    "`algorithm.rollout_correction.bypass_mode` replaces the policy loss with \
                     `bypass_mode` (choose its loss with `rollout_correction.loss_type`), but \
                     `actor_rollout_ref.actor.policy_loss.loss_mode` is `{loss_mode}`"
                )
            });
        }
        p.one_of(
            "algorithm.adv_estimator",
            &alg.adv_estimator,
            &known.adv_estimators,
        );
        p.one_of("algorithm.kl_penalty", &alg.kl_penalty, &kl_penalty_names());
        p.one_of(
            "algorithm.kl_ctrl.type",
            &alg.kl_ctrl.r#type,
            &known.kl_controllers,
        );
        p.one_of_str(
            "algorithm.filter_groups.metric",
            &alg.filter_groups.metric,
            &["acc", "score", "seq_reward"],
        );
        p.check(
            !(alg.use_kl_in_reward && self.actor_rollout_ref.actor.use_kl_loss),
            || {
                "`algorithm.use_kl_in_reward` and `actor_rollout_ref.actor.use_kl_loss` are both on: \
                 apply the KL penalty either in the reward or in the loss, not both"
                    .into()
            },
        );
        for (key, lam) in [
            ("gae_lambda_policy", alg.gae_lambda_policy),
            ("gae_lambda_value", alg.gae_lambda_value),
        ] {
            p.check(lam.is_none_or(|l| (0.0..=1.0).contains(&l)), || {
                format!("`algorithm.{key}` must be in [0, 1]")
            });
        }
        let decoupled = alg.gae_lambda_policy.is_some() || alg.gae_lambda_value.is_some();
        if decoupled && known.adv_estimators.contains(&alg.adv_estimator) {
            p.check(known.critic_estimators.contains(&alg.adv_estimator), || {
                format!(
                    "`algorithm.gae_lambda_policy`/`gae_lambda_value`: decoupled GAE lambdas need a \
                     critic's values; `{}` has none",
                    alg.adv_estimator
                )
            });
        }
    }

    fn check_trainer(&self, p: &mut Problems) {
        let trainer = &self.trainer;
        p.one_of_str(
            "trainer.resume_mode",
            &trainer.resume_mode,
            &["auto", "disable", "resume_path"],
        );
        for logger in &trainer.logger {
            p.one_of_str("trainer.logger", logger, &["console", "jsonl"]);
        }
        p.check(trainer.nnodes >= 1, || {
            "`trainer.nnodes` must be >= 1".into()
        });
        p.check(trainer.n_gpus_per_node >= 1, || {
            "`trainer.n_gpus_per_node` must be >= 1".into()
        });
        p.check(trainer.zero_stage <= 1, || {
            "`trainer.zero_stage` must be 0 (off) or 1 (sharded optimiser state)".into()
        });
        p.check(trainer.collective_timeout_s >= 1, || {
            "`trainer.collective_timeout_s` must be >= 1".into()
        });
        p.check(
            trainer.resume_mode != "resume_path" || trainer.resume_from_path.is_some(),
            || "`trainer.resume_mode` = `resume_path` needs `trainer.resume_from_path`".into(),
        );
        p.check(trainer.save_freq == -1 || trainer.save_freq > 0, || {
            format!(
                "`trainer.save_freq` must be -1 (only at the end) or > 0, got {}",
                trainer.save_freq
            )
        });
        p.check(trainer.test_freq == -1 || trainer.test_freq > 0, || {
            format!(
                "`trainer.test_freq` must be -1 (never) or > 0, got {}",
                trainer.test_freq
            )
        });
    }
}

fn kl_penalty_names() -> Vec<String> {
    KlPenalty::NAMES.iter().map(|s| s.to_string()).collect()
}

fn check_optim(p: &mut Problems, key: &str, optim: &OptimConfig) {
    p.one_of_str(
        &format!("{key}.lr_scheduler_type"),
        &optim.lr_scheduler_type,
        &["constant", "cosine"],
    );
    p.check(optim.lr >= 0.0, || {
        format!("`{key}.lr` must be >= 0, got {}", optim.lr)
    });
    p.check(optim.betas.iter().all(|b| (0.0..1.0).contains(b)), || {
        format!(
            "`{key}.betas` must both be in [0, 1), got {:?}",
            optim.betas
        )
    });
    p.check((0.0..=1.0).contains(&optim.lr_warmup_steps_ratio), || {
        format!(
            "`{key}.lr_warmup_steps_ratio` must be in [0, 1], got {}",
            optim.lr_warmup_steps_ratio
        )
    });
}
