//! Rollout log-probs equal to the trainer's bit for bit on flex (issue 42): the engine's decode
//! steps and prefill chunks and the trainer's passes compute every number the same way (the
//! products in fixed depth blocks on at least 2 rows, attention's sums in the training kernel's
//! order, the log-prob with the trainer's arithmetic), so `training/rollout_probs_diff_max` is
//! exactly 0 whatever the micro-batches, dynamic batches, padding or ranks; and so the rollout's
//! log-probs and entropies can stand in for the old-log-prob pass (`rollout.exact_logprobs`)
//! without changing a bit of the run.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
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

/// A random model of `config`, saved as `dir/name` and loaded back.
fn actor_of(dir: &Path, config: &TransformerConfig, name: &str) -> CausalLm<B> {
    use burn::module::AutodiffModule;
    // Drawn and read under the lock on the backend's one random stream: the parameters are
    // lazy, so their values are drawn when first read (outside the lock, another test's model
    // drawn meanwhile would come out different).
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

/// GRPO on 4 prompts x 4 samples of up to 12 tokens at temperature 0.8, two mini-batches, with
/// verl's old-log-prob pass (`rollout.exact_logprobs=false`: the pass is what these tests compare
/// the rollout with).
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
    c.actor_rollout_ref.rollout.exact_logprobs = Some(false);
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
    let (metrics, _) = run(config, parts(actor, model), ranks);
    metrics
        .iter()
        .map(|m| m["training/rollout_probs_diff_max"])
        .collect()
}

/// The rollout's sampled log-probs are the trainer's recomputation bit for bit: old-log-prob
/// micro-batches of 1, 3 and the whole batch, dynamic batches of a token budget, padded passes
/// instead of packed ones, two ranks, a model whose heads are 64 wide, a mixture of experts, and
/// bf16 generation and passes. (Not under tensor parallelism: there the trainer's vocabulary-parallel log-softmax sums each
/// rank's share first, 1.7e-7 and 2.7e-7 apart on this test, 2026-11-28.)
#[test]
fn rollout_log_probs_are_the_trainers_bit_for_bit() {
    let dir = temp_dir("exact-logprobs");
    let wide = actor(&dir, 576);
    let narrow = actor(&dir, 256);
    let experts = actor_of(&dir, &moe_config(), "moe");
    type Tune = fn(&mut RlhfConfig);
    let cases: [(&str, usize, usize, Tune); 9] = [
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
        // bf16 on both sides: the f32 kernels on widened inputs, each result rounded once.
        ("bf16", 576, 1, |c| {
            c.actor_rollout_ref.model.dtype = "bfloat16".into();
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
/// at a time) bit for bit: any rows, any chunk, a tied (transposed) head, temperatures 1 and 0.7,
/// in f32 and in bf16 (the decoder's logits rounded to bf16, the fused head's too).
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
    for (temperature, dtype) in [
        (1.0f64, DType::F32),
        (0.7, DType::F32),
        (1.0, DType::BF16),
        (0.7, DType::BF16),
    ] {
        let (hidden, weight) = (hidden.clone().cast(dtype), weight.clone().cast(dtype));
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
                    // As the decoder's head: in the model's dtype, read as f32.
                    let logits: Vec<f32> = burn_rlhf::models::kernels::linear(
                        hidden.clone().narrow(0, start, rows),
                        weight.clone().transpose(),
                    )
                    .into_data()
                    .iter::<f32>()
                    .collect();
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
                            "{dtype:?} row {} of a product of {rows}, chunk {chunk}, T \
                             {temperature}",
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
                learner
                    .actor
                    .model
                    .valid()
                    .visit(&mut Collect(&mut weights));
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

/// Every parameter's values of `model`, in visiting order (reading a lazy parameter draws it).
fn values_of<M: burn::module::Module<BB>, BB: burn::tensor::backend::Backend>(
    model: &M,
) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<BB: burn::tensor::backend::Backend> burn::module::ModuleVisitor<BB> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<BB, D>>) {
            self.0.extend(p.val().into_data().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// Two steps of `config` on `ranks` devices: each step's metrics (the machine's measures left
/// out) and the actor's weights after them.
fn run(
    config: RlhfConfig,
    parts: LearnerParts<B>,
    ranks: usize,
) -> (Vec<std::collections::BTreeMap<String, f64>>, Vec<f32>) {
    use burn::module::AutodiffModule;
    let keep = |m: burn_rlhf::trainer::metrics::Metrics| {
        m.into_iter()
            .filter(|(k, _)| !burn_rlhf::trainer::usage::measures_the_machine(k))
            .collect()
    };
    if ranks == 1 {
        let mut learner = Learner::new(config, parts, &Default::default()).unwrap();
        let metrics = (0..2).map(|_| keep(learner.step().unwrap())).collect();
        return (metrics, values_of(&learner.actor.model.valid()));
    }
    let _turn = super::data_parallel::ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut config = config;
    config.trainer.logger = vec!["jsonl".into()];
    let dir = std::path::PathBuf::from(config.trainer.default_local_dir.clone().unwrap());
    let checkpoint = super::data_parallel::n_devices_of(config, parts, ranks).unwrap();
    let metrics = burn_rlhf::trainer::logger::read_jsonl(&dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, m)| keep(m))
        .collect();
    let weights = super::data_parallel::tensors(&checkpoint.join("actor/model.safetensors"))
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect();
    (metrics, weights)
}

/// With `rollout.exact_logprobs` (on by default where it holds) the rollout's log-probs and
/// entropies are the old ones and no old-log-prob pass runs, and the run is the one with verl's
/// pass bit for bit: the same weights and every metric equal (`actor/entropy`, the
/// `rollout_corr/*` diagnostics, the probability gaps, here measured on the first mini-batch's
/// forward before its step) over two steps of two epochs of two mini-batches, for GRPO with a KL
/// loss, shuffled mini-batches, rollout correction's weights and rejection and padded passes, PPO
/// with a critic and the KL in the reward, GRPO on two ranks, conversations, and GRPO in bf16.
#[test]
fn exact_rollout_log_probs_replace_the_pass_bit_for_bit() {
    let dir = temp_dir("exact-logprobs-no-pass");
    let shape = model_config(256);
    let model = actor(&dir, 256);
    let critic = super::seeded(12, || {
        let critic = burn_rlhf::models::ValueModel::critic_from_weights(
            &shape,
            {
                use burn::module::AutodiffModule;
                let mut w = burn_rlhf::models::weights::WeightMap::new("actor");
                for (k, v) in model.valid().export() {
                    w.insert(k, v);
                }
                w
            },
            &Default::default(),
        )
        .unwrap();
        // Its value head drawn now, once for every copy.
        values_of(&critic);
        critic
    });
    type Tune = fn(&mut RlhfConfig);
    // (what, with a critic, with conversations, ranks, settings)
    let cases: [(&str, bool, bool, usize, Tune); 5] = [
        ("grpo", false, false, 1, |c| {
            c.actor_rollout_ref.actor.use_kl_loss = true;
            // Shuffled mini-batches: the first one's rows are any of the batch's.
            c.actor_rollout_ref.actor.shuffle = true;
            c.actor_rollout_ref.model.use_remove_padding = Some(false);
            let rc = &mut c.algorithm.rollout_correction;
            rc.rollout_is = Some("token".into());
            rc.rollout_rs = Some("token_k1".into());
            rc.rollout_rs_threshold =
                Some(burn_rlhf::config::ThresholdSpec::Text("0.5_2.0".into()));
        }),
        ("ppo", true, false, 1, |c| {
            c.algorithm.adv_estimator = "gae".into();
            c.algorithm.use_kl_in_reward = true;
            c.critic.ppo_epochs = Some(2);
            c.critic.ppo_mini_batch_size = Some(2);
        }),
        ("grpo on two ranks", false, false, 2, |c| {
            c.actor_rollout_ref.actor.use_kl_loss = true;
        }),
        ("conversations", false, true, 1, |c| {
            // A user turn appended after the model's first: the engine continues the sequence.
            c.data.max_response_length = 16;
            c.actor_rollout_ref.rollout.agent.default_agent_loop = "hint".into();
        }),
        ("grpo in bf16", false, false, 1, |c| {
            c.actor_rollout_ref.model.dtype = "bfloat16".into();
            c.actor_rollout_ref.actor.use_kl_loss = true;
        }),
    ];
    for (what, with_critic, with_hint, ranks, tune) in cases {
        let config = |exact: Option<bool>| {
            let name = format!("{}-{exact:?}", what.replace(' ', "-"));
            let mut c = grpo(&dir.join(name));
            c.actor_rollout_ref.actor.ppo_epochs = 2;
            c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = Some(2);
            c.actor_rollout_ref.rollout.exact_logprobs = exact;
            // A reward that varies within each group, so the policy loss moves the weights.
            c.custom_reward_function.name = Some("length".into());
            tune(&mut c);
            c
        };
        let parts = || {
            let mut p = parts(&model, &shape);
            p.rewards.register(std::sync::Arc::new(super::Length));
            if with_critic {
                p.critic = Some((critic.clone(), shape.clone()));
            }
            if with_hint {
                p.agent_loops
                    .push(std::sync::Arc::new(super::data_parallel::Hint(
                        tasks::tokenizer(),
                    )));
            }
            p
        };
        let (exact, exact_weights) = run(config(None), parts(), ranks);
        let (pass, pass_weights) = run(config(Some(false)), parts(), ranks);
        for (step, (e, p)) in exact.iter().zip(&pass).enumerate() {
            assert!(
                e.contains_key("actor/entropy")
                    && e.contains_key("rollout_corr/kl")
                    && e["training/rollout_probs_diff_valid"] == 1.0,
                "{what}: still reported at step {step}"
            );
            assert_eq!(e["training/rollout_probs_diff_max"], 0.0, "{what}");
            // The diagnostics comparing the two policies: exactly none apart.
            for k in [
                "kl",
                "k3_kl",
                "log_ppl_diff",
                "log_ppl_abs_diff",
                "chi2_seq",
            ] {
                assert_eq!(e[&format!("rollout_corr/{k}")], 0.0, "{what}: {k}");
            }
            println!(
                "{what} step {step}: entropy {}, turns {}, rollout_corr/chi2_token {:e}",
                e["actor/entropy"], e["num_turns/max"], e["rollout_corr/chi2_token"]
            );
            assert_eq!(e, p, "{what}: the metrics of step {step}");
        }
        assert_eq!(exact.len(), 2, "{what}");
        assert!(
            exact
                .iter()
                .all(|m| m["actor/pg_clipfrac"] > 0.0 || m["actor/ppo_kl"] != 0.0),
            "{what}: the ratio moves"
        );
        assert!(exact_weights == pass_weights, "{what}: the weights");
    }
}

/// The key's rules: a top-k cut (another distribution than the trainer's), bf16 generation for
/// f32 passes (another precision's log-probs) and f16 (Burn's reference kernels, not
/// batch-invariant) run verl's pass by default and refuse `true` naming the key and the reason;
/// the pass runs with `false`, and not by default where the log-probs are exact (f32, and bf16 on
/// both sides).
#[test]
fn exact_logprobs_runs_where_it_holds_and_refuses_true_elsewhere() {
    let dir = temp_dir("exact-logprobs-rules");
    let shape = model_config(256);
    let model = actor(&dir, 256);
    // Whether a step of the settings ran the old-log-prob pass.
    let ran_the_pass = |tune: &dyn Fn(&mut RlhfConfig)| {
        let mut c = grpo(&dir);
        c.actor_rollout_ref.rollout.exact_logprobs = None;
        tune(&mut c);
        Learner::new(c, parts(&model, &shape), &Default::default())
            .map(|mut l| l.step().unwrap().contains_key("timing_s/old_log_prob"))
    };
    assert!(!ran_the_pass(&|_| {}).unwrap(), "exact by default");
    assert!(
        !ran_the_pass(&|c| c.actor_rollout_ref.model.dtype = "bfloat16".into()).unwrap(),
        "exact by default in bf16"
    );
    assert!(
        ran_the_pass(&|c| c.actor_rollout_ref.rollout.exact_logprobs = Some(false)).unwrap(),
        "verl's pass when off"
    );
    type Tune = fn(&mut RlhfConfig);
    let inexact: [(&str, Tune); 3] = [
        ("actor_rollout_ref.rollout.top_k", |c| {
            c.actor_rollout_ref.rollout.top_k = 5
        }),
        ("actor_rollout_ref.rollout.dtype", |c| {
            c.actor_rollout_ref.rollout.dtype = Some("bfloat16".into())
        }),
        ("actor_rollout_ref.model.dtype", |c| {
            c.actor_rollout_ref.model.dtype = "float16".into()
        }),
    ];
    for (key, tune) in inexact {
        assert!(ran_the_pass(&tune).unwrap(), "{key}: the pass runs");
        let Err(refused) = ran_the_pass(&|c| {
            tune(c);
            c.actor_rollout_ref.rollout.exact_logprobs = Some(true);
        }) else {
            panic!("{key}: `true` is refused");
        };
        let refused = refused.to_string();
        for part in ["actor_rollout_ref.rollout.exact_logprobs", key] {
            assert!(refused.contains(part), "{key}: {refused}");
        }
    }
}
