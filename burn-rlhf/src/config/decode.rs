//! Decoding a resolved and validated tree into [`Settings`](super::Settings): the one place a
//! tree becomes settings ([`Settings::from_config`]), one method per section.

use burn::tensor::FloatDType;
use burn_rlhf_algos::policy_loss::BypassLossType;
use burn_rlhf_algos::{
    DpoLossType, EstimatorParams, KlControllerParams, KlPenalty, LossAggMode, PolicyLossParams,
};
use burn_rlhf_models::pretrained::expand_home;
use burn_rlhf_models::LoraConfig;
use burn_rlhf_rollout::{LogprobsMode, Truncation};

use super::load::ConfigError;
use super::settings::*;
use super::tree::{OptimConfig, RlhfConfig, ValKwargsConfig};
use super::validate::KnownNames;

/// Decodes the sections of a resolved and validated tree. Its errors cannot happen after
/// validation unless the two disagree; they still name the key.
pub(super) struct Decoder<'a> {
    pub(super) origin: &'a str,
}

impl Decoder<'_> {
    fn error(&self, problem: String) -> ConfigError {
        ConfigError::Invalid {
            origin: self.origin.to_string(),
            problems: vec![problem],
        }
    }

    /// A name parsed into its type.
    fn parse<T, E: std::fmt::Display>(&self, key: &str, r: Result<T, E>) -> Result<T, ConfigError> {
        r.map_err(|e| self.error(format!("`{key}`: {e}")))
    }

    /// A key that [`RlhfConfig::resolve`] derives from another.
    fn derived<T>(&self, key: &str, value: Option<T>) -> Result<T, ConfigError> {
        value.ok_or_else(|| self.error(format!("`{key}` was not derived from its source key")))
    }

    /// A dtype name: `None` for float32, else the half precision it names.
    pub(super) fn dtype(&self, key: &str, name: &str) -> Result<Option<FloatDType>, ConfigError> {
        match name {
            "bfloat16" | "bf16" => Ok(Some(FloatDType::BF16)),
            "float16" | "fp16" => Ok(Some(FloatDType::F16)),
            "float32" | "fp32" => Ok(None),
            other => Err(self.error(format!("`{key}` = `{other}` is not a known dtype"))),
        }
    }

    /// A token budget when its `use_dynamic_bsz` switch (derived) is on.
    pub(super) fn dynamic(
        &self,
        switch_key: &str,
        switch: Option<bool>,
        budget_key: &str,
        budget: Option<usize>,
    ) -> Result<Option<usize>, ConfigError> {
        if self.derived(switch_key, switch)? {
            Ok(Some(self.derived(budget_key, budget)?))
        } else {
            Ok(None)
        }
    }

    pub(super) fn data(&self, c: &RlhfConfig) -> Result<DataSettings, ConfigError> {
        let d = &c.data;
        Ok(DataSettings {
            train_files: d.train_files.clone(),
            val_files: d.val_files.clone(),
            prompt_key: d.prompt_key.clone(),
            reward_fn_key: d.reward_fn_key.clone(),
            max_prompt_length: d.max_prompt_length,
            max_response_length: d.max_response_length,
            train_batch_size: d.train_batch_size,
            val_batch_size: d.val_batch_size,
            gen_batch_size: self.derived("data.gen_batch_size", d.gen_batch_size)?,
            shuffle: d.shuffle,
            seed: d.seed,
            filter_overlong_prompts: d.filter_overlong_prompts,
            truncation: self.parse("data.truncation", Truncation::from_name(&d.truncation))?,
        })
    }

    pub(super) fn model(&self, c: &RlhfConfig) -> Result<ModelSettings, ConfigError> {
        let m = &c.actor_rollout_ref.model;
        Ok(ModelSettings {
            path: m.path.clone(),
            tokenizer_path: self.derived(
                "actor_rollout_ref.model.tokenizer_path",
                m.tokenizer_path.clone(),
            )?,
            use_fused_kernels: m.use_fused_kernels,
            lora: (m.lora_rank > 0).then(|| LoraConfig {
                rank: m.lora_rank,
                alpha: m.lora_alpha,
                target_modules: m.target_modules.clone(),
            }),
            shape_bucket: m.shape_bucket,
            logits_chunk_size: m.logits_chunk_size,
            dtype: self.dtype("actor_rollout_ref.model.dtype", &m.dtype)?,
            gradient_checkpointing: m.enable_gradient_checkpointing,
        })
    }

    pub(super) fn actor(&self, c: &RlhfConfig) -> Result<ActorSettings, ConfigError> {
        let a = &c.actor_rollout_ref.actor;
        let pl = &a.policy_loss;
        let key = |k: &str| format!("actor_rollout_ref.actor.{k}");
        Ok(ActorSettings {
            optim: OptimSettings::from_tree(&a.optim),
            ppo_mini_batch_size: a.ppo_mini_batch_size,
            micro_batch_size: a.ppo_micro_batch_size_per_gpu,
            max_token_len: a.use_dynamic_bsz.then_some(a.ppo_max_token_len_per_gpu),
            ppo_epochs: a.ppo_epochs,
            shuffle: a.shuffle,
            // verl's `apply_bypass_mode` switches the loss.
            loss_mode: if c.algorithm.rollout_correction.bypass_mode {
                "bypass_mode".into()
            } else {
                pl.loss_mode.clone()
            },
            loss: PolicyLossParams {
                clip_ratio_low: self.derived(&key("clip_ratio_low"), a.clip_ratio_low)?,
                clip_ratio_high: self.derived(&key("clip_ratio_high"), a.clip_ratio_high)?,
                clip_ratio_c: a.clip_ratio_c,
                tau_pos: a.tau_pos,
                tau_neg: a.tau_neg,
                clip_cov_ratio: pl.clip_cov_ratio,
                clip_cov_lb: pl.clip_cov_lb,
                clip_cov_ub: pl.clip_cov_ub,
                kl_cov_ratio: pl.kl_cov_ratio,
                ppo_kl_coef: pl.ppo_kl_coef,
                sppo_eta: pl.sppo_eta,
                dpo_beta: pl.dpo_beta,
                dpo_label_smoothing: pl.dpo_label_smoothing,
                dpo_loss_type: self.parse(
                    &key("policy_loss.dpo_loss_type"),
                    DpoLossType::from_name(&pl.dpo_loss_type),
                )?,
                dro_beta: pl.dro_beta.unwrap_or(0.0),
                rollout_correction: self.parse(
                    "algorithm.rollout_correction",
                    c.algorithm.rollout_correction.decode(),
                )?,
                bypass_loss_type: self.parse(
                    "algorithm.rollout_correction.loss_type",
                    BypassLossType::from_name(&c.algorithm.rollout_correction.loss_type),
                )?,
                seed: c.trainer.seed,
            },
            loss_agg_mode: self.parse(
                &key("loss_agg_mode"),
                LossAggMode::from_name(&a.loss_agg_mode),
            )?,
            loss_scale_factor: match a.loss_scale_factor {
                Some(f) => f,
                None => self.derived(
                    "actor_rollout_ref.rollout.response_length",
                    c.actor_rollout_ref.rollout.response_length,
                )? as f64,
            },
            entropy_coeff: a.entropy_coeff,
            kl_loss_coef: a.use_kl_loss.then_some(a.kl_loss_coef),
            kl_loss_type: self
                .parse(&key("kl_loss_type"), KlPenalty::from_name(&a.kl_loss_type))?,
            grad_clip: a.grad_clip,
        })
    }

    pub(super) fn rollout(&self, c: &RlhfConfig) -> Result<RolloutSettings, ConfigError> {
        let r = &c.actor_rollout_ref.rollout;
        Ok(RolloutSettings {
            train: SamplingSettings {
                n: r.n,
                temperature: r.temperature,
                top_k: (r.top_k > 0).then_some(r.top_k as usize),
                top_p: r.top_p,
                do_sample: r.do_sample,
            },
            val: SamplingSettings::from_val_kwargs(&r.val_kwargs),
            response_length: self.derived(
                "actor_rollout_ref.rollout.response_length",
                r.response_length,
            )?,
            logprobs_mode: self.parse(
                "actor_rollout_ref.rollout.logprobs_mode",
                LogprobsMode::from_name(&r.logprobs_mode),
            )?,
            dtype: self.dtype(
                "actor_rollout_ref.rollout.dtype",
                &self.derived("actor_rollout_ref.rollout.dtype", r.dtype.clone())?,
            )?,
            log_prob_micro_batch_size: r.log_prob_micro_batch_size_per_gpu,
            log_prob_max_token_len: self.dynamic(
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
                r.log_prob_use_dynamic_bsz,
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                r.log_prob_max_token_len_per_gpu,
            )?,
            stop_token_ids: r.stop_token_ids.clone(),
            max_num_seqs: r.max_num_seqs,
            max_num_batched_tokens: r.max_num_batched_tokens,
        })
    }

    pub(super) fn critic(&self, c: &RlhfConfig) -> Result<CriticSettings, ConfigError> {
        let cr = &c.critic;
        let mode = self.derived("critic.loss_agg_mode", cr.loss_agg_mode.as_deref())?;
        Ok(CriticSettings {
            model_path: cr.model.path.clone(),
            optim: OptimSettings::from_tree(&cr.optim),
            ppo_mini_batch_size: self
                .derived("critic.ppo_mini_batch_size", cr.ppo_mini_batch_size)?,
            micro_batch_size: cr.ppo_micro_batch_size_per_gpu,
            max_token_len: self.dynamic(
                "critic.use_dynamic_bsz",
                cr.use_dynamic_bsz,
                "critic.ppo_max_token_len_per_gpu",
                Some(cr.ppo_max_token_len_per_gpu),
            )?,
            forward_max_token_len: self.dynamic(
                "critic.use_dynamic_bsz",
                cr.use_dynamic_bsz,
                "critic.forward_max_token_len_per_gpu",
                cr.forward_max_token_len_per_gpu,
            )?,
            ppo_epochs: self.derived("critic.ppo_epochs", cr.ppo_epochs)?,
            shuffle: self.derived("critic.shuffle", cr.shuffle)?,
            cliprange_value: cr.cliprange_value,
            loss_agg_mode: self.parse("critic.loss_agg_mode", LossAggMode::from_name(mode))?,
            grad_clip: cr.grad_clip,
            value_loss_scale: cr.value_loss_scale,
        })
    }

    pub(super) fn algorithm(&self, c: &RlhfConfig) -> Result<AlgorithmSettings, ConfigError> {
        let alg = &c.algorithm;
        let lam_policy = alg.gae_lambda_policy.unwrap_or(alg.lam);
        let lam_value = alg.gae_lambda_value.unwrap_or(alg.lam);
        let fg = &alg.filter_groups;
        let kl_in_reward = if alg.use_kl_in_reward {
            let penalty = KlPenalty::from_name(&alg.kl_penalty);
            Some(KlInReward {
                penalty: self.parse("algorithm.kl_penalty", penalty)?,
            })
        } else {
            None
        };
        Ok(AlgorithmSettings {
            adv_estimator: alg.adv_estimator.clone(),
            estimator: EstimatorParams {
                gamma: alg.gamma,
                lam: lam_policy,
                norm_adv_by_std_in_grpo: alg.norm_adv_by_std_in_grpo,
                sppo_beta: alg.sppo_beta,
                ..EstimatorParams::default()
            },
            value_lambda: (lam_value != lam_policy).then_some(lam_value),
            kl_in_reward,
            kl_ctrl: alg.kl_ctrl.r#type.clone(),
            kl_ctrl_params: KlControllerParams {
                kl_coef: alg.kl_ctrl.kl_coef,
                target_kl: alg.kl_ctrl.target_kl,
                horizon: alg.kl_ctrl.horizon,
            },
            filter_groups: fg.enable.then_some(FilterGroups {
                metric: match fg.metric.as_str() {
                    "acc" => FilterMetric::Acc,
                    "score" => FilterMetric::Score,
                    _ => FilterMetric::SeqReward,
                },
                max_num_gen_batches: (fg.max_num_gen_batches > 0).then_some(fg.max_num_gen_batches),
            }),
            rollout_correction: self.parse(
                "algorithm.rollout_correction",
                alg.rollout_correction.decode(),
            )?,
            bypass_mode: alg.rollout_correction.bypass_mode,
        })
    }

    pub(super) fn trainer(&self, c: &RlhfConfig) -> Result<TrainerSettings, ConfigError> {
        let t = &c.trainer;
        let positive = |v: i64| (v > 0).then_some(v as usize);
        let dir = self.derived("trainer.default_local_dir", t.default_local_dir.as_deref())?;
        let resume = match t.resume_mode.as_str() {
            "disable" => ResumeMode::Disable,
            "resume_path" => {
                let path =
                    self.derived("trainer.resume_from_path", t.resume_from_path.as_deref())?;
                ResumeMode::Path(expand_home(path))
            }
            _ => ResumeMode::Auto,
        };
        Ok(TrainerSettings {
            total_epochs: t.total_epochs,
            total_training_steps: t.total_training_steps,
            console: t.logger.iter().any(|l| l == "console"),
            jsonl: t.logger.iter().any(|l| l == "jsonl"),
            nnodes: t.nnodes,
            n_gpus_per_node: t.n_gpus_per_node,
            balance_batch: t.balance_batch,
            shard_optimizer: t.zero_stage >= 1,
            collective_timeout: std::time::Duration::from_secs(t.collective_timeout_s),
            save_freq: positive(t.save_freq),
            test_freq: positive(t.test_freq),
            val_before_train: t.val_before_train,
            actor_start_step: t
                .critic_warmup
                .max(t.policy_training_start_step.unwrap_or(0)),
            ref_update_freq: (t.ref_update_freq > 0).then_some(t.ref_update_freq),
            checkpoint_dir: expand_home(dir),
            resume,
            seed: t.seed,
        })
    }
}

impl Settings {
    /// Resolves verl's derived keys, checks every rule (all problems reported together, with
    /// `origin` naming the file and overrides) and decodes the tree.
    pub fn from_config(
        config: &RlhfConfig,
        known: &KnownNames,
        origin: &str,
    ) -> Result<Self, ConfigError> {
        let mut c = config.clone();
        c.resolve();
        c.validate_with(known, origin)?;
        let d = Decoder { origin };
        Ok(Self {
            data: d.data(&c)?,
            model: d.model(&c)?,
            actor: d.actor(&c)?,
            rollout: d.rollout(&c)?,
            ref_micro_batch_size: c
                .actor_rollout_ref
                .reference
                .log_prob_micro_batch_size_per_gpu,
            ref_max_token_len: d.dynamic(
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                c.actor_rollout_ref.reference.log_prob_use_dynamic_bsz,
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                c.actor_rollout_ref.reference.log_prob_max_token_len_per_gpu,
            )?,
            critic: if known.critic_estimators.contains(&c.algorithm.adv_estimator) {
                Some(d.critic(&c)?)
            } else {
                None
            },
            reward: RewardSettings {
                function: c.custom_reward_function.name.clone(),
                overlong: c
                    .reward_model
                    .overlong_buffer
                    .enable
                    .then_some(OverlongPenalty {
                        len: c.reward_model.overlong_buffer.len,
                        penalty_factor: c.reward_model.overlong_buffer.penalty_factor,
                    }),
            },
            algorithm: d.algorithm(&c)?,
            trainer: d.trainer(&c)?,
        })
    }
}

impl OptimSettings {
    pub(super) fn from_tree(o: &OptimConfig) -> Self {
        Self {
            lr: o.lr,
            betas: o.betas,
            weight_decay: o.weight_decay,
            warmup: if o.lr_warmup_steps > 0 {
                Warmup::Steps(o.lr_warmup_steps as usize)
            } else {
                Warmup::Ratio(o.lr_warmup_steps_ratio)
            },
            schedule: if o.lr_scheduler_type == "cosine" {
                ScheduleKind::Cosine
            } else {
                ScheduleKind::Constant
            },
            min_lr_ratio: o.min_lr_ratio,
            num_cycles: o.num_cycles,
            total_steps: (o.total_training_steps > 0).then_some(o.total_training_steps as usize),
        }
    }
}

impl SamplingSettings {
    pub(super) fn from_val_kwargs(v: &ValKwargsConfig) -> Self {
        Self {
            n: v.n,
            temperature: v.temperature,
            top_k: (v.top_k > 0).then_some(v.top_k as usize),
            top_p: v.top_p,
            do_sample: v.do_sample,
        }
    }
}
