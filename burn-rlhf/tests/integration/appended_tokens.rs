//! Tokens the model did not sample (a tool's or a user's turn) carry no loss weight, end to end:
//! two runs whose conversations end with different appended turns of the same length train to
//! the same weights bit for bit, while `response_length` counts those tokens as verl does.

use std::path::Path;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::rollout::agent::{AgentLoop, Conversation, ConversationStats, Next, TurnRole};
use burn_rlhf::rollout::encode::encode_prompt;
use burn_rlhf::rollout::{FinishReason, PromptRecord, RolloutError};
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_test_assets::temp_dir;

/// After the model's one turn, `tail` is appended as a tool turn and the conversation ends.
struct Closing {
    tokenizer: burn_rlhf::models::Tokenizer,
    tail: Vec<u32>,
}

struct ClosingConversation {
    tail: Vec<u32>,
    stats: ConversationStats,
}

impl AgentLoop for Closing {
    fn name(&self) -> &str {
        "closing"
    }
    fn prompt_ids(&self, record: &PromptRecord) -> Result<Vec<u32>, RolloutError> {
        encode_prompt(&self.tokenizer, record)
    }
    fn start(&self, _: &PromptRecord) -> Result<Box<dyn Conversation>, RolloutError> {
        Ok(Box::new(ClosingConversation {
            tail: self.tail.clone(),
            stats: ConversationStats::default(),
        }))
    }
}

impl Conversation for ClosingConversation {
    fn after_model_turn(
        &mut self,
        _: &[u32],
        _: FinishReason,
        _: usize,
    ) -> Result<Next, RolloutError> {
        Ok(Next::Finish {
            tokens: self.tail.clone(),
            role: TurnRole::Tool,
        })
    }
    fn stats(&self) -> &ConversationStats {
        &self.stats
    }
}

fn config(dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 8;
    c.data.shuffle = false;
    c.custom_reward_function.name = Some("length".into());
    c.actor_rollout_ref.actor.optim.lr = 1e-2;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(2);
    c.actor_rollout_ref.actor.use_kl_loss = true;
    c.actor_rollout_ref.rollout.n = 4;
    c.actor_rollout_ref.rollout.agent.default_agent_loop = "closing".into();
    c.algorithm.adv_estimator = "grpo".into();
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

/// Two steps ending every conversation with `tail`: the weights before, after, and the metrics.
fn run(dir: &Path, tail: &str) -> (Vec<f32>, Vec<f32>, Vec<burn_rlhf::trainer::Metrics>) {
    let tokenizer = tasks::tokenizer();
    let tail = tokenizer.encode(tail, false).unwrap();
    let (actor, _) = super::tiny_models(5);
    let (train, _) = tasks::split_problems(10, 20, 1);
    let mut parts = LearnerParts::new(actor, tasks::model_config(32, 1), tokenizer.clone());
    parts.rewards.register(Arc::new(LengthOfModelTurn));
    parts
        .agent_loops
        .push(Arc::new(Closing { tokenizer, tail }));
    parts.train = train;
    let mut learner = Learner::new(config(dir), parts, &Default::default()).unwrap();
    let before = super::params(&learner.actor.model.valid());
    let metrics = (0..2).map(|_| learner.step().unwrap()).collect();
    (before, super::params(&learner.actor.model.valid()), metrics)
}

/// The response's length up to the appended tail's `+` (the last one) (the model's own characters), so both
/// runs score the same samples the same.
struct LengthOfModelTurn;

impl burn_rlhf::rollout::reward::RewardFn for LengthOfModelTurn {
    fn name(&self) -> &str {
        "length"
    }
    fn score(
        &self,
        batch: &[burn_rlhf::rollout::reward::RewardInput<'_>],
    ) -> Result<Vec<f64>, RolloutError> {
        Ok(batch
            .iter()
            .map(|r| r.response.rfind('+').unwrap_or(r.response.len()) as f64)
            .collect())
    }
}

#[test]
fn appended_turns_carry_no_loss_weight_end_to_end() {
    let dir = temp_dir("appended-tokens");
    let (before, a, ma) = run(&dir.join("a"), "+12");
    let (_, b, mb) = run(&dir.join("b"), "+89");
    assert!(a != before, "the steps moved the weights");
    assert!(a == b, "the appended tokens changed the update");
    for (step, (x, y)) in ma.iter().zip(&mb).enumerate() {
        for key in [
            "actor/pg_loss",
            "actor/entropy",
            "actor/kl_loss",
            "actor/grad_norm",
        ] {
            assert_eq!(x[key], y[key], "step {step}: {key}");
        }
        // verl's response length counts the appended tokens: every response has them.
        assert!(x["response_length/min"] >= 3.0, "step {step}: {x:?}");
        assert_eq!(x["response_length/mean"], y["response_length/mean"]);
    }
    std::fs::remove_dir_all(dir).ok();
}
