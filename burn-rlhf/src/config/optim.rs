//! `*.optim.*` (the actor's and the critic's): AdamW with a warm-up and a schedule — the tree
//! with verl's defaults, the typed settings and their rules.

use serde::{Deserialize, Serialize};

use super::problems::Problems;

/// `optim.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    /// Warm-up steps; negative: use `lr_warmup_steps_ratio`.
    pub lr_warmup_steps: i64,
    pub lr_warmup_steps_ratio: f64,
    /// `constant` or `cosine`.
    pub lr_scheduler_type: String,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
    /// Filled by the trainer from the run length when negative.
    pub total_training_steps: i64,
}

impl OptimConfig {
    /// verl's optimiser defaults with this learning rate (the actor's 1e-6, the critic's 1e-5).
    pub(super) fn with_lr(lr: f64) -> Self {
        Self {
            lr,
            betas: [0.9, 0.999],
            weight_decay: 0.01,
            lr_warmup_steps: -1,
            lr_warmup_steps_ratio: 0.0,
            lr_scheduler_type: "constant".into(),
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            total_training_steps: -1,
        }
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self::with_lr(1e-6)
    }
}

/// `optim.*`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimSettings {
    /// The base learning rate.
    pub lr: f64,
    /// AdamW's betas.
    pub betas: [f64; 2],
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Linear warm-up from 0.
    pub warmup: Warmup,
    /// The curve after the warm-up.
    pub schedule: ScheduleKind,
    /// The cosine's floor, as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Cosine waves over the run.
    pub num_cycles: f64,
    /// The schedule's length in optimiser steps; `None`: the run's steps.
    pub total_steps: Option<usize>,
    /// AdamW's moments in host memory between steps (`fsdp_config.optimizer_offload`).
    pub offload: bool,
    /// The parameters are sharded over the data-parallel ranks (`strategy: fsdp`), or `None`:
    /// whole on every rank (`strategy: megatron`).
    pub fsdp: Option<FsdpSharding>,
    /// `fsdp_config.model_dtype`: the dtype the trained weights and their AdamW moments are held
    /// in (`None`: f32 master weights; bf16/f16: no f32 copy, verl's pure half-precision
    /// training).
    pub master_dtype: Option<burn::tensor::FloatDType>,
}

/// FSDP's parameter sharding of one model (ZeRO-3, verl's `strategy: fsdp | fsdp2`): each rank
/// keeps 1/N of the parameters, gradients and AdamW state. Takes effect with more than one
/// data-parallel rank, or with `param_offload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpSharding {
    /// `fsdp_config.param_offload`: each rank's chunks in host memory, uploaded for a gather
    /// or a step (sharded over one rank too).
    pub param_offload: bool,
    /// `fsdp_config.reshard_after_forward`: each decoder layer is gathered for its use and
    /// freed after (with layer checkpointing, again for the backward's recomputation); `false`
    /// gathers the whole model once per micro-batch and keeps it through the backward.
    pub reshard_after_forward: bool,
    /// `fsdp_config.fsdp_size`: ranks per shard group, the groups replicas of each other
    /// (hybrid sharding); `None` (verl's -1): every rank in one group.
    pub group_size: Option<usize>,
}

/// How long the warm-up is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Warmup {
    /// This many steps (`lr_warmup_steps > 0`).
    Steps(usize),
    /// `int(ratio * total_steps)` (`lr_warmup_steps_ratio`).
    Ratio(f64),
}

/// Which curve follows the warm-up (`lr_scheduler_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Flat at the base rate.
    Constant,
    /// Half a cosine (with `num_cycles = 0.5`) down to `min_lr_ratio` of the base rate.
    Cosine,
}

impl ScheduleKind {
    /// verl's names, in the order of the variants.
    pub(super) const NAMES: [&'static str; 2] = ["constant", "cosine"];

    pub(super) fn from_name(name: &str) -> Option<Self> {
        match name {
            "constant" => Some(Self::Constant),
            "cosine" => Some(Self::Cosine),
            _ => None,
        }
    }
}

impl OptimConfig {
    /// Decodes the section at `key` (`actor_rollout_ref.actor.optim`, `critic.optim`).
    pub(super) fn decode(&self, p: &mut Problems, key: &str) -> Option<OptimSettings> {
        let schedule = p.name(
            &format!("{key}.lr_scheduler_type"),
            &self.lr_scheduler_type,
            &ScheduleKind::NAMES,
            ScheduleKind::from_name(&self.lr_scheduler_type),
        );
        p.check(self.lr >= 0.0, || {
            format!("`{key}.lr` must be >= 0, got {}", self.lr)
        });
        p.check(self.betas.iter().all(|b| (0.0..1.0).contains(b)), || {
            format!("`{key}.betas` must both be in [0, 1), got {:?}", self.betas)
        });
        p.check((0.0..=1.0).contains(&self.lr_warmup_steps_ratio), || {
            format!(
                "`{key}.lr_warmup_steps_ratio` must be in [0, 1], got {}",
                self.lr_warmup_steps_ratio
            )
        });
        Some(OptimSettings {
            lr: self.lr,
            betas: self.betas,
            weight_decay: self.weight_decay,
            warmup: if self.lr_warmup_steps > 0 {
                Warmup::Steps(self.lr_warmup_steps as usize)
            } else {
                Warmup::Ratio(self.lr_warmup_steps_ratio)
            },
            schedule: schedule?,
            min_lr_ratio: self.min_lr_ratio,
            num_cycles: self.num_cycles,
            master_dtype: None,
            total_steps: (self.total_training_steps > 0)
                .then_some(self.total_training_steps as usize),
            offload: false,
            fsdp: None,
        })
    }
}

/// How a model's parameters are held across the data-parallel ranks (`strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Strategy {
    /// `fsdp`, `fsdp2`: sharded (FSDP).
    Fsdp,
    /// `megatron`: whole on every rank, split by tensor parallelism.
    Megatron,
}

impl Strategy {
    /// The strategy named at `key`: `fsdp` and `fsdp2` (parameters sharded over the
    /// data-parallel ranks) or `megatron` (parameters whole on each rank, split by tensor
    /// parallelism).
    pub(super) fn decode(p: &mut Problems, key: &str, name: &str) -> Option<Self> {
        let parsed = match name {
            "fsdp" | "fsdp2" => Some(Self::Fsdp),
            "megatron" => Some(Self::Megatron),
            _ => None,
        };
        p.name(key, name, &["fsdp", "fsdp2", "megatron"], parsed)
    }
}

/// `fsdp_config.*` of a trained model as written: verl's offload switches and FSDP's layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// Under `strategy: fsdp`, each rank's chunks of the parameters in host memory, gathered to
    /// the device per layer when a pass uses them (refused under `megatron`).
    pub param_offload: bool,
    /// AdamW's moments in host memory between steps, streamed through the device one parameter
    /// at a time.
    pub optimizer_offload: bool,
    /// Ranks per FSDP shard group (-1: all of them).
    pub fsdp_size: i64,
    /// A layer's gathered parameters are freed after its forward (gathered again for the
    /// backward).
    pub reshard_after_forward: bool,
    /// The dtype the weights and AdamW moments are held in (`fp32`: f32 master weights;
    /// `bf16`, `fp16`: pure half precision).
    pub model_dtype: String,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            param_offload: false,
            optimizer_offload: false,
            fsdp_size: -1,
            reshard_after_forward: true,
            model_dtype: "fp32".into(),
        }
    }
}

impl FsdpConfig {
    /// Checks the section at `key` (`actor_rollout_ref.actor.fsdp_config`,
    /// `critic.model.fsdp_config`) and puts the optimiser's offload and, under `strategy`
    /// (named at `strategy_key`), FSDP's sharding into `optim`.
    pub(super) fn decode(
        &self,
        p: &mut Problems,
        key: &str,
        optim: Option<&mut OptimSettings>,
        strategy: (&str, Option<Strategy>),
    ) {
        let fsdp = self.sharding(p, key, strategy);
        let master = self.master_dtype(p, key);
        if let Some(optim) = optim {
            optim.offload = self.optimizer_offload;
            optim.fsdp = fsdp;
            optim.master_dtype = master.flatten();
        }
    }

    /// `model_dtype` (at `key.model_dtype`): `Some(None)` for f32 master weights.
    pub(super) fn master_dtype(
        &self,
        p: &mut Problems,
        key: &str,
    ) -> Option<Option<burn::tensor::FloatDType>> {
        super::model::dtype(p, &format!("{key}.model_dtype"), &self.model_dtype)
    }

    /// Checks the section at `key` and returns FSDP's sharding under `strategy` (named at
    /// `strategy_key`; `None` under `megatron`).
    pub(super) fn sharding(
        &self,
        p: &mut Problems,
        key: &str,
        (strategy_key, strategy): (&str, Option<Strategy>),
    ) -> Option<FsdpSharding> {
        p.check(
            !self.param_offload || strategy != Some(Strategy::Megatron),
            || {
                format!(
                    "`{key}.param_offload=true` with `{strategy_key}=megatron`: {}",
                    super::verl_keys::NO_PARAM_OFFLOAD
                )
            },
        );
        p.check(self.fsdp_size == -1 || self.fsdp_size >= 1, || {
            format!(
                "`{key}.fsdp_size` ({}) must be -1 (one shard group of every rank) or >= 1",
                self.fsdp_size
            )
        });
        let fsdp = (strategy == Some(Strategy::Fsdp)).then(|| FsdpSharding {
            param_offload: self.param_offload,
            reshard_after_forward: self.reshard_after_forward,
            group_size: (self.fsdp_size >= 1).then_some(self.fsdp_size as usize),
        });
        if strategy == Some(Strategy::Megatron) {
            p.check(self.fsdp_size == -1, || {
                format!(
                    "`{key}.fsdp_size` ({}) shards under `strategy: fsdp`; `{strategy_key}` is \
                     `megatron` (parameters whole on each rank)",
                    self.fsdp_size
                )
            });
        }
        fsdp
    }
}
