//! Cross-field rules, checked after loading. Each failure is a sentence naming the keys and the rule.

use burn_rlhf_algos::names;

use super::load::ConfigError;
use super::tree::RlhfConfig;

/// The names a config may use for each registry-selected key. The built-in names by default; a
/// program that registers its own estimator or loss adds the name here too.
#[derive(Debug, Clone)]
pub struct KnownNames {
    pub adv_estimators: Vec<String>,
    pub policy_losses: Vec<String>,
    pub loss_agg_modes: Vec<String>,
    pub kl_penalties: Vec<String>,
    pub kl_controllers: Vec<String>,
    pub reward_functions: Vec<String>,
}

fn owned(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

impl Default for KnownNames {
    fn default() -> Self {
        Self {
            adv_estimators: owned(names::ADVANTAGE_ESTIMATORS),
            policy_losses: owned(names::POLICY_LOSSES),
            loss_agg_modes: owned(names::LOSS_AGG_MODES),
            kl_penalties: owned(names::KL_PENALTIES),
            kl_controllers: owned(names::KL_CONTROLLERS),
            reward_functions: Vec::new(),
        }
    }
}

impl KnownNames {
    /// The names `registry` can build (the built-ins plus whatever a program registered).
    pub fn from_registry<B: burn::tensor::backend::Backend>(
        registry: &burn_rlhf_algos::Registry<B>,
    ) -> Self {
        Self {
            adv_estimators: registry.estimator_names(),
            policy_losses: registry.policy_loss_names(),
            kl_controllers: registry.kl_controller_names(),
            ..Self::default()
        }
    }
}

/// Collects rule violations so one run reports all of them.
struct Problems(Vec<String>);

impl Problems {
    fn check(&mut self, ok: bool, message: impl FnOnce() -> String) {
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

    fn one_of_str(&mut self, key: &str, value: &str, valid: &[&str]) {
        self.one_of(key, value, &owned(valid));
    }
}

impl RlhfConfig {
    /// Checks the rules that involve more than one key, with the built-in names.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        self.validate_with(&KnownNames::default(), origin)
    }

    /// Checks the rules that involve more than one key; `names` lists what each name key may be.
    pub fn validate_with(&self, known: &KnownNames, origin: &str) -> Result<(), ConfigError> {
        let mut p = Problems(Vec::new());
        let data = &self.data;
        let actor = &self.actor_rollout_ref.actor;
        let rollout = &self.actor_rollout_ref.rollout;
        let critic = &self.critic;
        let alg = &self.algorithm;
        let trainer = &self.trainer;

        // Names.
        p.one_of(
            "algorithm.adv_estimator",
            &alg.adv_estimator,
            &known.adv_estimators,
        );
        p.one_of(
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            &actor.policy_loss.loss_mode,
            &known.policy_losses,
        );
        p.one_of(
            "actor_rollout_ref.actor.loss_agg_mode",
            &actor.loss_agg_mode,
            &known.loss_agg_modes,
        );
        if let Some(mode) = &critic.loss_agg_mode {
            p.one_of("critic.loss_agg_mode", mode, &known.loss_agg_modes);
        }
        p.one_of("algorithm.kl_penalty", &alg.kl_penalty, &known.kl_penalties);
        p.one_of(
            "actor_rollout_ref.actor.kl_loss_type",
            &actor.kl_loss_type,
            &known.kl_penalties,
        );
        p.one_of(
            "algorithm.kl_ctrl.type",
            &alg.kl_ctrl.r#type,
            &known.kl_controllers,
        );
        p.one_of_str(
            "data.truncation",
            &data.truncation,
            &["error", "left", "right"],
        );
        p.one_of_str(
            "reward_model.reward_manager",
            &self.reward_model.reward_manager,
            &["naive", "dapo"],
        );
        p.one_of_str(
            "actor_rollout_ref.rollout.logprobs_mode",
            &rollout.logprobs_mode,
            &["raw_logprobs", "processed_logprobs"],
        );
        for (key, optim) in [
            ("actor_rollout_ref.actor.optim", &actor.optim),
            ("critic.optim", &critic.optim),
        ] {
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
        p.one_of_str(
            "trainer.resume_mode",
            &trainer.resume_mode,
            &["auto", "disable", "resume_path"],
        );
        p.one_of_str(
            "algorithm.filter_groups.metric",
            &alg.filter_groups.metric,
            &["acc", "score", "seq_reward"],
        );
        p.one_of_str(
            "actor_rollout_ref.model.dtype",
            &self.actor_rollout_ref.model.dtype,
            &["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
        );
        for logger in &trainer.logger {
            p.one_of_str("trainer.logger", logger, &["console", "jsonl"]);
        }
        if let Some(name) = &self.custom_reward_function.name {
            if !known.reward_functions.is_empty() {
                p.one_of("custom_reward_function.name", name, &known.reward_functions);
            }
        }

        // Batch arithmetic, in verl's units: batch sizes count prompts, each with `rollout.n`
        // responses; micro-batches count sequences.
        let n = rollout.n;
        p.check(n >= 1, || {
            "`actor_rollout_ref.rollout.n` must be >= 1".into()
        });
        p.check(data.train_batch_size >= 1, || {
            "`data.train_batch_size` must be >= 1".into()
        });
        let mini = actor.ppo_mini_batch_size;
        p.check(mini >= 1, || {
            "`actor_rollout_ref.actor.ppo_mini_batch_size` must be >= 1".into()
        });
        if mini >= 1 && n >= 1 {
            let sequences = data.train_batch_size * n;
            p.check(sequences.is_multiple_of(mini * n), || {
                format!(
                    "`data.train_batch_size` * `actor_rollout_ref.rollout.n` ({} * {n} = {sequences} \
                     sequences) must be divisible by `actor_rollout_ref.actor.ppo_mini_batch_size` * \
                     `rollout.n` ({mini} * {n} = {} sequences per mini-batch)",
                    data.train_batch_size,
                    mini * n
                )
            });
            if let Some(micro) = actor.ppo_micro_batch_size_per_gpu {
                p.check(micro >= 1 && (mini * n).is_multiple_of(micro), || {
                    format!(
                        "`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` ({micro}) must divide \
                         the mini-batch of `ppo_mini_batch_size` * `rollout.n` = {} sequences",
                        mini * n
                    )
                });
            }
        }
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
        if let Some(gen) = data.gen_batch_size {
            p.check(gen >= 1, || "`data.gen_batch_size` must be >= 1".into());
        }
        p.check(actor.ppo_epochs >= 1, || {
            "`actor_rollout_ref.actor.ppo_epochs` must be >= 1".into()
        });

        // Losses.
        p.check(actor.clip_ratio_c > 1.0, || {
            format!(
                "`actor_rollout_ref.actor.clip_ratio_c` must be > 1 (the dual-clip lower bound on \
                 negative advantages), got {}",
                actor.clip_ratio_c
            )
        });
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
        p.check(critic.cliprange_value >= 0.0, || {
            format!(
                "`critic.cliprange_value` must be >= 0, got {}",
                critic.cliprange_value
            )
        });
        p.check(!(alg.use_kl_in_reward && actor.use_kl_loss), || {
            "`algorithm.use_kl_in_reward` and `actor_rollout_ref.actor.use_kl_loss` are both on: \
             apply the KL penalty either in the reward or in the loss, not both"
                .into()
        });
        if names::CRITIC_ESTIMATORS.contains(&alg.adv_estimator.as_str()) {
            p.check(critic.enable != Some(false), || {
                format!(
                    "`algorithm.adv_estimator` = `{}` needs a critic, but `critic.enable` is false",
                    alg.adv_estimator
                )
            });
            p.check(!critic.model.path.trim().is_empty(), || {
                format!(
                    "`algorithm.adv_estimator` = `{}` needs a critic: set `critic.model.path`",
                    alg.adv_estimator
                )
            });
        }

        // Sampling.
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
        p.check(data.max_response_length >= 1, || {
            "`data.max_response_length` must be >= 1".into()
        });

        // Run.
        p.check(trainer.nnodes >= 1, || {
            "`trainer.nnodes` must be >= 1".into()
        });
        p.check(trainer.n_gpus_per_node >= 1, || {
            "`trainer.n_gpus_per_node` must be >= 1".into()
        });
        p.check(self.critic.value_loss_scale > 0.0, || {
            "`critic.value_loss_scale` must be > 0".into()
        });
        for (key, lam) in [
            ("gae_lambda_policy", self.algorithm.gae_lambda_policy),
            ("gae_lambda_value", self.algorithm.gae_lambda_value),
        ] {
            p.check(lam.is_none_or(|l| (0.0..=1.0).contains(&l)), || {
                format!("`algorithm.{key}` must be in [0, 1]")
            });
        }
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
        let ob = &self.reward_model.overlong_buffer;
        p.check(!ob.enable || (ob.len >= 1 && ob.len <= data.max_response_length), || {
            format!(
                "`reward_model.overlong_buffer.len` ({}) must be in 1..=`data.max_response_length` ({}) \
                 when the overlong buffer is enabled",
                ob.len, data.max_response_length
            )
        });

        if p.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid {
                origin: origin.to_string(),
                problems: p.0,
            })
        }
    }
}
