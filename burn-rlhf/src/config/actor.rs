//! `actor_rollout_ref.actor.*`: the policy update and its loss — the tree with verl's defaults,
//! the typed settings and their rules. The loss is built through the registry
//! ([`KnownNames`]) with the configured parameters, so its own rules are checked by it and
//! reported under the key of the parameter it names.

use burn_rlhf_algos::policy_loss::BypassMode;
use burn_rlhf_algos::{DpoLossType, KlPenalty, LossAggMode, PolicyLossParams};
use serde::{Deserialize, Serialize};

use super::data::DataConfig;
use super::names::KnownNames;
use super::optim::{FsdpConfig, OptimConfig, OptimSettings, Strategy};
use super::problems::Problems;
use super::rollout::RolloutConfig;
use super::rollout_correction::RolloutCorrectionSettings;

/// `actor_rollout_ref.actor.policy_loss.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    pub loss_mode: String,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// SPPO's step size (`loss_mode: "sppo"`).
    pub sppo_eta: f64,
    /// SPIN's DPO temperature (`loss_mode: "spin"`).
    pub dpo_beta: f64,
    /// SPIN's DPO label smoothing.
    pub dpo_label_smoothing: f64,
    /// SPIN's DPO loss: `sigmoid` or `ipo`.
    pub dpo_loss_type: String,
    /// DRO's quadratic log-ratio penalty (`loss_mode: "dro"`; required there, > 0).
    pub dro_beta: Option<f64>,
}

impl Default for PolicyLossConfig {
    /// The losses' own defaults ([`PolicyLossParams`], verl's values).
    fn default() -> Self {
        let p = PolicyLossParams::default();
        Self {
            loss_mode: "vanilla".into(),
            clip_cov_ratio: p.clip_cov_ratio,
            clip_cov_lb: p.clip_cov_lb,
            clip_cov_ub: p.clip_cov_ub,
            kl_cov_ratio: p.kl_cov_ratio,
            ppo_kl_coef: p.ppo_kl_coef,
            sppo_eta: p.sppo_eta,
            dpo_beta: p.dpo_beta,
            dpo_label_smoothing: p.dpo_label_smoothing,
            dpo_loss_type: p.dpo_loss_type.name().into(),
            dro_beta: None,
        }
    }
}

/// `actor_rollout_ref.actor.megatron.*` as written: the model's split over devices (verl's
/// Megatron engine keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorMegatronConfig {
    /// Ranks each model (actor, critic, reference) is split over, Megatron-style; the run's
    /// devices are `tensor_model_parallel_size` x data-parallel replicas.
    pub tensor_model_parallel_size: usize,
}

impl Default for ActorMegatronConfig {
    fn default() -> Self {
        Self {
            tensor_model_parallel_size: 1,
        }
    }
}

/// `actor_rollout_ref.actor.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    /// `fsdp` / `fsdp2` (verl's default): the parameters, gradients and AdamW state sharded over
    /// the data-parallel ranks; `megatron`: whole on each rank (split by tensor parallelism).
    pub strategy: String,
    pub optim: OptimConfig,
    /// verl's offload switches (`optimizer_offload`; `param_offload` refused) and FSDP's layout.
    pub fsdp_config: FsdpConfig,
    /// Tensor parallelism.
    pub megatron: ActorMegatronConfig,
    /// Prompts per mini-batch (multiplied by `rollout.n` into sequences, as verl).
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward; `None`: the whole mini-batch.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: usize,
    pub ppo_epochs: usize,
    pub shuffle: bool,
    pub clip_ratio: f64,
    /// `None`: `clip_ratio`.
    pub clip_ratio_low: Option<f64>,
    /// `None`: `clip_ratio`.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip lower bound; must be > 1.
    pub clip_ratio_c: f64,
    pub policy_loss: PolicyLossConfig,
    /// SAPO's gate temperatures.
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub loss_agg_mode: String,
    /// `seq-mean-token-sum-norm` divisor; `None`: `rollout.response_length` (the padded response
    /// width verl divides by).
    pub loss_scale_factor: Option<f64>,
    pub entropy_coeff: f64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: String,
    pub grad_clip: f64,
}

impl Default for ActorConfig {
    fn default() -> Self {
        let p = PolicyLossParams::default();
        Self {
            strategy: "fsdp".into(),
            optim: OptimConfig::default(),
            fsdp_config: FsdpConfig::default(),
            megatron: ActorMegatronConfig::default(),
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            ppo_epochs: 1,
            shuffle: false,
            clip_ratio: p.clip_ratio_low,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: p.clip_ratio_c,
            policy_loss: PolicyLossConfig::default(),
            tau_pos: p.tau_pos,
            tau_neg: p.tau_neg,
            loss_agg_mode: "token-mean".into(),
            loss_scale_factor: None,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: "low_var_kl".into(),
            grad_clip: 1.0,
        }
    }
}

/// `actor_rollout_ref.actor.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorSettings {
    /// The optimiser.
    pub optim: OptimSettings,
    /// Prompts per mini-batch (times `rollout.n` rows).
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward; `None`: the whole mini-batch.
    pub micro_batch_size: Option<usize>,
    /// `ppo_max_token_len_per_gpu` when `use_dynamic_bsz`: micro-batches of at most this many
    /// tokens instead (verl's `rearrange_micro_batches`).
    pub max_token_len: Option<usize>,
    /// Passes over the batch.
    pub ppo_epochs: usize,
    /// Each epoch takes the mini-batches in a seeded random order of rows (`shuffle`).
    pub shuffle: bool,
    /// The registry name of the loss the actor runs: `policy_loss.loss_mode`, or `bypass_mode`
    /// when `algorithm.rollout_correction.bypass_mode` is on (verl's `apply_bypass_mode` makes
    /// the same switch).
    pub loss_name: String,
    /// What the loss reads (clip ranges, the variants' coefficients, the seed).
    pub loss: PolicyLossParams,
    /// How the policy, entropy and KL terms are reduced.
    pub loss_agg_mode: LossAggMode,
    /// `seq-mean-token-sum-norm`'s divisor: `loss_scale_factor`, else `rollout.response_length`
    /// (verl divides by the padded response width, which is that length).
    pub loss_scale_factor: f64,
    /// Weight of the entropy bonus.
    pub entropy_coeff: f64,
    /// `use_kl_loss`: `kl_loss_coef` times the KL to the reference joins the loss.
    pub kl_loss_coef: Option<f64>,
    /// The estimator of `actor/kl_loss` (and of the loss with `use_kl_loss`).
    pub kl_loss_type: KlPenalty,
    /// Global gradient-norm limit.
    pub grad_clip: f64,
    /// Ranks each model is split over (`megatron.tensor_model_parallel_size`).
    pub tensor_parallel_size: usize,
}

/// The config key of a policy-loss parameter the loss names ([`PolicyLossParams`]'s fields are
/// the last part of verl's keys).
fn param_key(param: &str) -> String {
    match param {
        "clip_ratio_low" | "clip_ratio_high" | "clip_ratio_c" | "tau_pos" | "tau_neg" => {
            format!("actor_rollout_ref.actor.{param}")
        }
        "bypass_loss_type" => "algorithm.rollout_correction.loss_type".into(),
        "seed" => "trainer.seed".into(),
        _ => format!("actor_rollout_ref.actor.policy_loss.{param}"),
    }
}

/// What the actor's rules read from other sections.
pub(super) struct ActorContext<'a> {
    pub(super) data: &'a DataConfig,
    pub(super) rollout: &'a RolloutConfig,
    /// `algorithm.rollout_correction`, when it decoded.
    pub(super) correction: Option<&'a RolloutCorrectionSettings>,
    /// `trainer.seed`.
    pub(super) seed: u64,
}

impl ActorConfig {
    pub(super) fn decode(
        &self,
        p: &mut Problems,
        known: &KnownNames,
        cx: &ActorContext,
    ) -> Option<ActorSettings> {
        let key = |k: &str| format!("actor_rollout_ref.actor.{k}");
        let pl = &self.policy_loss;
        let mut optim = self.optim.decode(p, &key("optim"));
        let strategy = Strategy::decode(p, &key("strategy"), &self.strategy);
        let tp = self.megatron.tensor_model_parallel_size;
        p.check(tp <= 1 || strategy != Some(Strategy::Fsdp), || {
            format!(
                "`actor_rollout_ref.actor.megatron.tensor_model_parallel_size` ({tp}) splits the \
                 models under `strategy: megatron`; `{}` is `{}` (FSDP shards whole \
                 parameters): set `{}=megatron`",
                key("strategy"),
                self.strategy,
                key("strategy")
            )
        });
        self.fsdp_config.decode(
            p,
            &key("fsdp_config"),
            optim.as_mut(),
            (&key("strategy"), strategy),
        );
        let loss_agg_mode = p.algo(
            &key("loss_agg_mode"),
            |_| key("loss_agg_mode"),
            LossAggMode::from_name(&self.loss_agg_mode),
        );
        let kl_loss_type = p.algo(
            &key("kl_loss_type"),
            |_| key("kl_loss_type"),
            KlPenalty::from_name(&self.kl_loss_type),
        );
        let dpo_loss_type = p.algo(
            &key("policy_loss.dpo_loss_type"),
            |_| key("policy_loss.dpo_loss_type"),
            DpoLossType::from_name(&pl.dpo_loss_type),
        );
        let clip_ratio_low = p.derived(&key("clip_ratio_low"), self.clip_ratio_low);
        let clip_ratio_high = p.derived(&key("clip_ratio_high"), self.clip_ratio_high);
        for (name, v) in [
            ("clip_ratio", Some(self.clip_ratio)),
            ("clip_ratio_low", self.clip_ratio_low),
            ("clip_ratio_high", self.clip_ratio_high),
        ] {
            if let Some(v) = v {
                p.check(v >= 0.0, || {
                    format!("`{}` must be >= 0, got {v}", key(name))
                });
            }
        }
        let bypass = cx.correction.is_some_and(|c| c.bypass_mode);
        if bypass {
            p.check(
                pl.loss_mode == "vanilla" || pl.loss_mode == BypassMode::NAME,
                || {
                    format!(
                        "`algorithm.rollout_correction.bypass_mode` replaces the policy loss with \
                         `bypass_mode` (choose its loss with `rollout_correction.loss_type`), but \
                         `actor_rollout_ref.actor.policy_loss.loss_mode` is `{}`",
                        pl.loss_mode
                    )
                },
            );
        }
        let loss_name = if bypass {
            BypassMode::NAME.to_string()
        } else {
            pl.loss_mode.clone()
        };
        // The loss as the learner will build it: its rules, and how many rows it sees together.
        let loss = (|| {
            let correction = cx.correction?;
            Some(PolicyLossParams {
                clip_ratio_low: clip_ratio_low?,
                clip_ratio_high: clip_ratio_high?,
                clip_ratio_c: self.clip_ratio_c,
                tau_pos: self.tau_pos,
                tau_neg: self.tau_neg,
                clip_cov_ratio: pl.clip_cov_ratio,
                clip_cov_lb: pl.clip_cov_lb,
                clip_cov_ub: pl.clip_cov_ub,
                kl_cov_ratio: pl.kl_cov_ratio,
                ppo_kl_coef: pl.ppo_kl_coef,
                sppo_eta: pl.sppo_eta,
                dpo_beta: pl.dpo_beta,
                dpo_label_smoothing: pl.dpo_label_smoothing,
                dpo_loss_type: dpo_loss_type?,
                dro_beta: pl.dro_beta.unwrap_or(0.0),
                rollout_correction: correction.correction.clone(),
                bypass_loss_type: correction.bypass_loss_type,
                seed: cx.seed,
            })
        })();
        let unit = loss.as_ref().and_then(|params| {
            p.algo(
                &key("policy_loss.loss_mode"),
                param_key,
                known.policy_loss(&loss_name, params),
            )
        });
        self.check_batches(p, cx, unit.unwrap_or(1));
        p.check(self.megatron.tensor_model_parallel_size >= 1, || {
            "`actor_rollout_ref.actor.megatron.tensor_model_parallel_size` must be >= 1".into()
        });
        p.check(self.ppo_epochs >= 1, || {
            "`actor_rollout_ref.actor.ppo_epochs` must be >= 1".into()
        });
        let max_token_len = p.token_budget(
            &key("use_dynamic_bsz"),
            Some(self.use_dynamic_bsz),
            &key("ppo_max_token_len_per_gpu"),
            Some(self.ppo_max_token_len_per_gpu),
            cx.data.longest_sequence(),
        );
        let loss_scale_factor = match self.loss_scale_factor {
            Some(f) => Some(f),
            None => p
                .derived(
                    "actor_rollout_ref.rollout.response_length",
                    cx.rollout.response_length,
                )
                .map(|len| len as f64),
        };
        unit?;
        Some(ActorSettings {
            optim: optim?,
            ppo_mini_batch_size: self.ppo_mini_batch_size,
            micro_batch_size: self.ppo_micro_batch_size_per_gpu,
            max_token_len: max_token_len?,
            ppo_epochs: self.ppo_epochs,
            shuffle: self.shuffle,
            loss_name,
            loss: loss?,
            loss_agg_mode: loss_agg_mode?,
            loss_scale_factor: loss_scale_factor?,
            entropy_coeff: self.entropy_coeff,
            kl_loss_coef: self.use_kl_loss.then_some(self.kl_loss_coef),
            kl_loss_type: kl_loss_type?,
            grad_clip: self.grad_clip,
            tensor_parallel_size: self.megatron.tensor_model_parallel_size,
        })
    }

    /// The batch arithmetic in verl's units: batch sizes count prompts, each with `rollout.n`
    /// responses; micro-batches count sequences, rounded up to whole `unit`s of the loss.
    fn check_batches(&self, p: &mut Problems, cx: &ActorContext, unit: usize) {
        let n = cx.rollout.n;
        let mini = self.ppo_mini_batch_size;
        p.check(mini >= 1, || {
            "`actor_rollout_ref.actor.ppo_mini_batch_size` must be >= 1".into()
        });
        if mini == 0 || n == 0 {
            return;
        }
        let train_batch_size = cx.data.train_batch_size;
        let sequences = train_batch_size * n;
        p.check(sequences.is_multiple_of(mini * n), || {
            format!(
                "`data.train_batch_size` * `actor_rollout_ref.rollout.n` ({train_batch_size} * {n} = \
                 {sequences} sequences) must be divisible by \
                 `actor_rollout_ref.actor.ppo_mini_batch_size` * `rollout.n` ({mini} * {n} = {} \
                 sequences per mini-batch)",
                mini * n
            )
        });
        if let Some(micro) = self.ppo_micro_batch_size_per_gpu {
            let runs = micro.div_ceil(unit) * unit;
            p.check(micro >= 1 && (mini * n).is_multiple_of(runs), || {
                let rounded = if runs == micro {
                    String::new()
                } else {
                    format!(", rounded up to {runs} to keep the loss's rows together,")
                };
                format!(
                    "`actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` ({micro}){rounded} must \
                     divide the mini-batch of `ppo_mini_batch_size` * `rollout.n` = {} sequences",
                    mini * n
                )
            });
        }
    }
}
