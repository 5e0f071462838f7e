//! Rollout log-probs equal to the trainer's bit for bit on flex (issue 42): the engine's decode
//! steps and prefill chunks and the trainer's passes compute every number the same way (the
//! products in fixed depth blocks on at least 2 rows, attention's sums in the training kernel's
//! order, the log-prob with the trainer's arithmetic), so `training/rollout_probs_diff_max` is
//! exactly 0 whatever the micro-batches, dynamic batches, padding or ranks.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use burn_rlhf::config::RlhfConfig;
use burn_rlhf::models::{CausalLm, TransformerConfig};
use burn_rlhf::tasks;
use burn_rlhf::trainer::{Learner, LearnerParts};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// The arithmetic task's vocabulary in a decoder `hidden` wide (4 heads of `hidden / 4`), 2
/// layers, its MLP 4 times wider: 576 passes gemm's 512-deep block in every product (as
/// SmolLM2-135M's 576 and 1536), 256 gives SmolLM2's head width of 64.
fn model_config(hidden: usize) -> TransformerConfig {
    tasks::small_llama(tasks::VOCAB.len(), hidden, 2, 64)
}

/// A random model of [`model_config`]`(hidden)`.
fn actor(dir: &Path, hidden: usize) -> CausalLm<B> {
    actor_of(dir, &model_config(hidden), &format!("model-{hidden}"))
}

/// [`model_config`]`(576)` as a mixture of experts (Qwen3-MoE's layout): 8 experts, 2 per token.
fn moe_config() -> TransformerConfig {
    let mut mc = model_config(576);
    mc.model_type = burn_rlhf::models::ModelType::Qwen3Moe;
    mc.moe = Some(burn_rlhf::models::MoeConfig {
        num_experts: 8,
        num_experts_per_tok: 2,
        expert_intermediate_size: 576,
        norm_topk_prob: true,
        router_aux_loss_coef: 0.0,
        output_router_logits: false,
        sparse_layers: vec![true, true],
    });
    mc
}

/// A random model of `config`, saved as `dir/name` and loaded back: its weights materialised (a
/// lazily initialised parameter would draw its values anew in each copy of the model).
fn actor_of(dir: &Path, config: &TransformerConfig, name: &str) -> CausalLm<B> {
    use burn::module::AutodiffModule;
    // Drawn and read under the lock on the backend's random stream: the parameters are lazy, so
    // their values are drawn when first read (outside the lock, another test's model drawn
    // meanwhile would come out different).
    let weights = super::seeded(11, || {
        let fresh: CausalLm<B> = config.init_causal_lm(&Default::default());
        fresh.valid().export()
    });
    let folder = dir.join(name);
    burn_rlhf::models::pretrained::save_pretrained(
        &folder,
        config,
        &weights,
        None,
        Some(&tasks::tokenizer()),
    )
    .unwrap();
    burn_rlhf::models::pretrained::load_pretrained(&folder.display().to_string())
        .unwrap()
        .causal_lm(&Default::default())
        .unwrap()
}

/// GRPO on 4 prompts x 4 samples of up to 12 tokens at temperature 0.8, two mini-batches (so the
/// old-log-prob pass runs).
fn grpo(dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 4;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 12;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    c.actor_rollout_ref.actor.optim.lr = 1e-4;
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 2;
    c.actor_rollout_ref.rollout.n = 4;
    c.actor_rollout_ref.rollout.temperature = 0.8;
    c.algorithm.adv_estimator = "grpo".into();
    c.trainer.total_training_steps = Some(2);
    c.trainer.logger = vec![];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

/// A learner's parts: `actor` of shape `model`, the arithmetic task's problems and reward.
fn parts(actor: &CausalLm<B>, model: &TransformerConfig) -> LearnerParts<B> {
    let (train, val) = tasks::split_problems(10, 20, 1);
    let mut parts = LearnerParts::new(actor.clone(), model.clone(), tasks::tokenizer());
    parts
        .rewards
        .register(std::sync::Arc::new(tasks::ExactAnswer));
    parts.train = train;
    parts.val = val;
    parts
}

/// Two GRPO steps of `config` on `ranks` devices; each step's `training/rollout_probs_diff_max`.
fn probs_diff(
    config: RlhfConfig,
    actor: &CausalLm<B>,
    model: &TransformerConfig,
    ranks: usize,
) -> Vec<f64> {
    let parts = parts(actor, model);
    if ranks == 1 {
        let mut learner = Learner::new(config, parts, &Default::default()).unwrap();
        return (0..2)
            .map(|_| learner.step().unwrap()["training/rollout_probs_diff_max"])
            .collect();
    }
    let _turn = super::data_parallel::ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut config = config;
    config.trainer.logger = vec!["jsonl".into()];
    let dir = std::path::PathBuf::from(config.trainer.default_local_dir.clone().unwrap());
    super::data_parallel::n_devices_of(config, parts, ranks).unwrap();
    burn_rlhf::trainer::logger::read_jsonl(&dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, m)| m["training/rollout_probs_diff_max"])
        .collect()
}

/// The rollout's sampled log-probs are the trainer's recomputation bit for bit: old-log-prob
/// micro-batches of 1, 3 and the whole batch, dynamic batches of a token budget, padded passes
/// instead of packed ones, two ranks, a model whose heads are 64 wide and a mixture of experts.
/// (Not under tensor parallelism: there the trainer's vocabulary-parallel log-softmax sums each
/// rank's share first, 1.7e-7 and 2.7e-7 apart on this test, 2026-11-28.)
#[test]
fn rollout_log_probs_are_the_trainers_bit_for_bit() {
    let dir = temp_dir("exact-logprobs");
    let wide = actor(&dir, 576);
    let narrow = actor(&dir, 256);
    let experts = actor_of(&dir, &moe_config(), "moe");
    type Tune = fn(&mut RlhfConfig);
    let cases: [(&str, usize, usize, Tune); 8] = [
        ("micro-batches of 1", 576, 1, |c| {
            c.actor_rollout_ref
                .rollout
                .log_prob_micro_batch_size_per_gpu = Some(1)
        }),
        ("micro-batches of 3", 576, 1, |c| {
            c.actor_rollout_ref
                .rollout
                .log_prob_micro_batch_size_per_gpu = Some(3)
        }),
        ("the whole batch", 576, 1, |c| {
            c.actor_rollout_ref
                .rollout
                .log_prob_micro_batch_size_per_gpu = None
        }),
        ("dynamic batches", 576, 1, |c| {
            c.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz = Some(true);
            c.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu = Some(45);
        }),
        ("padded passes", 576, 1, |c| {
            c.actor_rollout_ref.model.use_remove_padding = Some(false)
        }),
        ("two ranks", 576, 2, |c| {
            c.actor_rollout_ref
                .rollout
                .log_prob_micro_batch_size_per_gpu = Some(3)
        }),
        ("heads 64 wide", 256, 1, |c| {
            c.actor_rollout_ref
                .rollout
                .log_prob_micro_batch_size_per_gpu = Some(3)
        }),
        ("mixture of experts", 0, 1, |c| {
            c.actor_rollout_ref
                .rollout
                .log_prob_micro_batch_size_per_gpu = Some(3)
        }),
    ];
    for (what, hidden, ranks, tune) in cases {
        let mut c = grpo(&dir.join(what.replace(' ', "-")));
        tune(&mut c);
        let (model, shape) = match hidden {
            576 => (&wide, model_config(576)),
            256 => (&narrow, model_config(256)),
            _ => (&experts, moe_config()),
        };
        let diffs = probs_diff(c, model, &shape, ranks);
        println!("{what}: training/rollout_probs_diff_max per step {diffs:?}");
        assert_eq!(diffs, vec![0.0, 0.0], "{what}");
    }
}

/// The rollout's log-prob of a sampled token (`rollout::sample::trainer_logprob` on the logits
/// of the decoder's LM head, `burn_rlhf_models::kernels::linear`) equals the trainer's fused LM
/// head (`burn_rlhf::algos::kernels::linear_entropy_and_logprobs`, its logits made a chunk of rows
/// at a time) bit for bit: any rows, any chunk, a tied (transposed) head, temperatures 1 and 0.7.
#[test]
fn the_rollouts_log_prob_is_the_fused_heads() {
    let d = Default::default();
    let (n, h, v) = (37, 576, 1000);
    // Under the tests' lock on the backend's one random stream (another test's model drawn
    // meanwhile would come out different).
    let (hidden, weight): (Tensor<Flex, 2>, Tensor<Flex, 2>) = super::seeded(5, || {
        (
            Tensor::random([n, h], Distribution::Normal(0.0, 1.0), &d),
            Tensor::random([v, h], Distribution::Normal(0.0, 0.05), &d),
        )
    });
    let labels: Vec<i64> = (0..n).map(|i| (i * 37 % v) as i64).collect();
    for temperature in [1.0f64, 0.7] {
        for chunk in [1, 5, 64] {
            let (_, trainer) = burn_rlhf::algos::kernels::linear_entropy_and_logprobs(
                hidden.clone(),
                weight.clone(),
                Tensor::<Flex, 1, Int>::from_data(TensorData::new(labels.clone(), [n]), &d),
                temperature,
                chunk,
            );
            let trainer: Vec<f32> = trainer.into_data().to_vec().unwrap();
            for rows in [1, 2, 8] {
                for start in (0..n - rows).step_by(9) {
                    let logits: Vec<f32> = burn_rlhf::models::kernels::linear(
                        hidden.clone().narrow(0, start, rows),
                        weight.clone().transpose(),
                    )
                    .into_data()
                    .to_vec()
                    .unwrap();
                    for r in 0..rows {
                        let row = &logits[r * v..(r + 1) * v];
                        let label = labels[start + r] as usize;
                        let rollout = burn_rlhf::rollout::sample::trainer_logprob(
                            row,
                            label,
                            temperature as f32,
                        );
                        assert_eq!(
                            rollout.to_bits(),
                            trainer[start + r].to_bits(),
                            "row {} of a product of {rows}, chunk {chunk}, T {temperature}",
                            start + r
                        );
                    }
                }
            }
        }
    }
}

/// Runs repeat bit for bit whatever the number of threads: the same GRPO step in rayon pools of
/// 1, 2 and 3 threads samples the same tokens with the same log-probs, recomputes the same old
/// log-probs, and ends with the same weights (every metric but the timings equal).
#[test]
fn a_step_is_the_same_on_any_number_of_threads() {
    use burn::module::{AutodiffModule, Module};
    /// Every parameter's values, in visiting order.
    struct Collect<'a>(&'a mut Vec<f32>);
    impl burn::module::ModuleVisitor<Flex> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<Flex, D>>) {
            self.0.extend(p.val().into_data().iter::<f32>());
        }
    }
    let dir = temp_dir("exact-logprobs-threads");
    let model = actor(&dir, 576);
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let parts = parts(&model, &model_config(576));
                let c = grpo(&dir.join(format!("threads-{threads}")));
                let mut learner = Learner::new(c, parts, &Default::default()).unwrap();
                let batch = learner.generate(&[0, 1, 2, 3], 1).unwrap();
                let old = learner.old_log_probs(&batch).unwrap().log_probs;
                let metrics = learner.step().unwrap();
                let mut weights = Vec::new();
                learner.actor.valid().visit(&mut Collect(&mut weights));
                let metrics: Vec<(String, f64)> = metrics
                    .into_iter()
                    .filter(|(k, _)| !burn_rlhf::trainer::usage::measures_the_machine(k))
                    .collect();
                (
                    batch.response_ids,
                    batch.rollout_log_probs,
                    old,
                    metrics,
                    weights,
                )
            })
    };
    let one = run(1);
    for threads in [2, 3] {
        let other = run(threads);
        assert_eq!(one.0, other.0, "tokens on {threads} threads");
        assert_eq!(one.1, other.1, "rollout log-probs on {threads} threads");
        assert_eq!(one.2, other.2, "old log-probs on {threads} threads");
        assert_eq!(one.3, other.3, "metrics on {threads} threads");
        assert_eq!(one.4, other.4, "weights on {threads} threads");
    }
}
