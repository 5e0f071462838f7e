//! The runnable examples are the files beside this folder (`examples/quickstart.rs`,
//! `examples/ppo_gsm8k.rs`, ...), declared in `examples/Cargo.toml`; this library holds what the
//! quickstarts share.

use std::sync::Arc;

use burn_rlhf::backend::TrainBackend;
use burn_rlhf::burn::optim::AdamWConfig;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::minibatch::{sft_update, OptimizerStep, SftPasses};
use burn_rlhf::models::{CausalLm, Tokenizer, TransformerConfig};
use burn_rlhf::optim::ReplicaSync;
use burn_rlhf::rollout::reward::RewardFn;
use burn_rlhf::rollout::{PromptRecord, PromptSampler};
use burn_rlhf::trainer::{Learner, LearnerParts};

/// The greedy accuracy of `actor` on `problems` (the mean of `reward`'s scores, as the learner's
/// validation computes it, `val-core/<data_source>/reward/mean@1`), under `config`'s rollout
/// settings with a critic-free estimator and no reference, so nothing but the policy is needed.
/// The quickstarts check it during their SFT warm-ups.
pub fn greedy_accuracy(
    actor: &CausalLm<TrainBackend>,
    model_config: &TransformerConfig,
    tokenizer: &Tokenizer,
    reward: Arc<dyn RewardFn>,
    problems: &[PromptRecord],
    mut config: RlhfConfig,
    device: &burn_rlhf::backend::Device,
) -> anyhow::Result<f64> {
    let source = problems
        .first()
        .map(|p| p.data_source.clone())
        .ok_or_else(|| anyhow::anyhow!("no problems to score"))?;
    let mut parts = LearnerParts::new(actor.clone(), model_config.clone(), tokenizer.clone());
    parts.rewards.register(reward);
    parts.train = problems.to_vec();
    parts.val = problems.to_vec();
    config.algorithm.adv_estimator = "reinforce_plus_plus".into();
    config.algorithm.use_kl_in_reward = false;
    config.actor_rollout_ref.actor.use_kl_loss = false;
    config.data.train_batch_size = config.data.train_batch_size.min(problems.len());
    config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size;
    config.trainer.logger = Vec::new();
    config.trainer.rollout_data_dir = None;
    config.trainer.validation_data_dir = None;
    let learner = Learner::new(config, parts, device)?;
    let key = format!("val-core/{source}/reward/mean@1");
    learner
        .validate()?
        .get(&key)
        .copied()
        .ok_or_else(|| anyhow::anyhow!("the validation gave no `{key}`"))
}

/// The quickstarts' SFT warm-up: how fast it learns and when it stops.
#[derive(Debug, Clone, Copy)]
pub struct WarmUp {
    /// AdamW's learning rate.
    pub lr: f64,
    /// Examples per step.
    pub batch: usize,
    /// It stops at the first check where the dev accuracy reaches this...
    pub target: f64,
    /// ...checked every this many steps...
    pub check_every: usize,
    /// ...or after this many steps.
    pub max_steps: usize,
    /// The seed of the examples' order.
    pub seed: u64,
}

/// SFT from `actor` on batches of `train` (made by `batch`) until `dev_accuracy` reaches
/// `warm_up.target` or `warm_up.max_steps` pass; the model and the steps taken. The copying
/// these tasks need is learned suddenly, at a step that depends on the CPU's rounding and the
/// seed, so a fixed step count leaves some runs with nothing right (RL has nothing to learn from)
/// and others with little left to learn.
pub fn warm_up(
    mut actor: CausalLm<TrainBackend>,
    train: &[PromptRecord],
    batch: impl Fn(&[&PromptRecord]) -> burn_rlhf::rollout::RolloutBatch,
    dev_accuracy: impl Fn(&CausalLm<TrainBackend>) -> anyhow::Result<f64>,
    warm_up: WarmUp,
    device: &burn_rlhf::backend::Device,
) -> anyhow::Result<(CausalLm<TrainBackend>, usize)> {
    let mut optim = AdamWConfig::new()
        .with_epsilon(1e-8)
        .with_weight_decay(0.0)
        .init();
    let mut sampler = PromptSampler::new(train.len(), warm_up.seed, true);
    for step in 1..=warm_up.max_steps {
        let picked: Vec<&PromptRecord> = sampler
            .next_batch(warm_up.batch)
            .iter()
            .map(|&i| &train[i])
            .collect();
        let step_of = OptimizerStep {
            optimizer: &mut optim,
            lr: warm_up.lr,
            grad_clip: 1.0,
            sync: &ReplicaSync::default(),
            sharded: None,
        };
        let passes = SftPasses {
            remove_padding: true,
            ..SftPasses::padded(warm_up.batch, burn_rlhf::config::DEFAULT_LOGITS_CHUNK)
        };
        // A tiny model: its activations are small, so nothing is recomputed.
        let (updated, m) = sft_update(actor, step_of, &batch(&picked), passes, false, device)?;
        actor = updated;
        if step % warm_up.check_every.max(1) == 0 || step == warm_up.max_steps {
            let accuracy = dev_accuracy(&actor)?;
            println!(
                "sft step {step}: loss {:.4}, dev accuracy {:.1}%",
                m["train/loss"],
                accuracy * 100.0
            );
            if accuracy >= warm_up.target {
                return Ok((actor, step));
            }
        }
    }
    Ok((actor, warm_up.max_steps))
}
