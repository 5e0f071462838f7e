//! Data parallelism on CPU devices: two devices in one process and (the `mpi` feature) MPI
//! processes reproduce one device with the same global batch; ZeRO-1 gives the same parameters
//! with about half the optimiser state per rank and resumes from its shards; a rank that fails or
//! dies stops the others with a clear error. FSDP's own tests are in `fsdp.rs`, with these
//! helpers.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn_rlhf::config::{RlhfConfig, Settings};
use burn_rlhf::models::weights::WeightMap;
use burn_rlhf::models::{CausalLm, ValueModel};
use burn_rlhf::optim::StateBytes;
use burn_rlhf::rollout::agent::{AgentLoop, Conversation, ConversationStats, Next, TurnRole};
use burn_rlhf::rollout::encode::encode_prompt;
use burn_rlhf::rollout::{FinishReason, PromptRecord, RewardFn, RewardInput, RolloutError};
use burn_rlhf::tasks;
use burn_rlhf::trainer::logger::read_jsonl;
use burn_rlhf::trainer::{launch, NodeLaunch};
use burn_rlhf::trainer::{Learner, LearnerParts, Metrics, RankMemory, TrainError};
use burn_rlhf_test_assets::temp_dir;

type B = Autodiff<Flex>;

/// burn-collective has one in-process group per backend: runs in this file take turns.
pub(super) static ONE_GROUP_AT_A_TIME: Mutex<()> = Mutex::new(());

pub(super) const STEPS: usize = 3;

pub(super) fn tiny_models() -> (CausalLm<B>, ValueModel<B>) {
    super::tiny_models(7)
}

/// PPO with a critic, KL in the reward, 8 prompts x 2 samples, mini-batches of 4 prompts,
/// micro-batches of 2 rows.
pub(super) fn config(dir: &Path) -> RlhfConfig {
    let mut c = RlhfConfig::default();
    c.data.train_batch_size = 8;
    c.data.max_prompt_length = 8;
    c.data.max_response_length = 4;
    c.custom_reward_function.name = Some(tasks::DATA_SOURCE.into());
    c.algorithm.adv_estimator = "gae".into();
    c.algorithm.use_kl_in_reward = true;
    let a = &mut c.actor_rollout_ref.actor;
    a.optim.lr = 1e-3;
    a.ppo_mini_batch_size = 4;
    a.ppo_micro_batch_size_per_gpu = Some(2);
    c.critic.optim.lr = 1e-3;
    c.critic.ppo_micro_batch_size_per_gpu = Some(2);
    c.actor_rollout_ref.rollout.n = 2;
    c.trainer.total_training_steps = Some(STEPS);
    c.trainer.logger = vec!["jsonl".into()];
    c.trainer.test_freq = -1;
    c.trainer.val_before_train = false;
    c.trainer.resume_mode = "disable".into();
    c.trainer.collective_timeout_s = 60;
    c.trainer.default_local_dir = Some(dir.display().to_string());
    c
}

pub(super) fn parts(reward: Arc<dyn RewardFn>) -> LearnerParts<B> {
    let (actor, critic) = tiny_models();
    parts_of(actor, critic, tasks::model_config(32, 1), reward)
}

/// The tiny models with a vocabulary of 16 (two rows the tokenizer never uses), which divides
/// over 4 tensor-parallel ranks.
fn wide_vocab_models() -> (
    CausalLm<B>,
    ValueModel<B>,
    burn_rlhf::models::TransformerConfig,
) {
    let mut mc = tasks::model_config(32, 1);
    mc.vocab_size = 16;
    let (actor, critic) = super::models_of(&mc, 11);
    (actor, critic, mc)
}

pub(super) fn parts_of(
    actor: CausalLm<B>,
    critic: ValueModel<B>,
    mc: burn_rlhf::models::TransformerConfig,
    reward: Arc<dyn RewardFn>,
) -> LearnerParts<B> {
    let (train, val) = tasks::split_problems(16, 20, 1);
    let mut parts = LearnerParts::new(actor, mc.clone(), tasks::tokenizer());
    parts.critic = Some((critic, mc));
    parts.rewards.register(reward);
    parts.train = train;
    parts.val = val;
    parts
}

fn stop_flag() -> &'static AtomicBool {
    Box::leak(Box::new(AtomicBool::new(false)))
}

fn one_device(dir: &Path) -> PathBuf {
    let mut l = Learner::new(
        config(dir),
        parts(Arc::new(tasks::ExactAnswer)),
        &Default::default(),
    )
    .unwrap();
    l.fit(stop_flag()).unwrap().checkpoint.unwrap()
}

pub(super) fn two_devices(
    config: RlhfConfig,
    reward: Arc<dyn RewardFn>,
) -> Result<PathBuf, String> {
    n_devices(config, reward, 2)
}

pub(super) fn n_devices(
    config: RlhfConfig,
    reward: Arc<dyn RewardFn>,
    n: usize,
) -> Result<PathBuf, String> {
    n_devices_of(config, parts(reward), n)
}

pub(super) fn n_devices_of(
    config: RlhfConfig,
    parts: LearnerParts<B>,
    n: usize,
) -> Result<PathBuf, String> {
    n_devices_memory(config, parts, n).map(|(checkpoint, _)| checkpoint)
}

/// [`n_devices_of`] and what rank 0 held at the end.
pub(super) fn n_devices_memory(
    config: RlhfConfig,
    parts: LearnerParts<B>,
    n: usize,
) -> Result<(PathBuf, RankMemory), String> {
    let node = NodeLaunch::single(Duration::from_secs(60));
    let devices = vec![Default::default(); n];
    Settings::from_config(&config, &parts.known_names(), "test")
        .map_err(TrainError::from)
        .and_then(|settings| launch(settings, parts, &devices, &node, stop_flag()))
        .map(|out| (out.checkpoint.unwrap(), out.memory))
        .map_err(|e| e.to_string())
}

pub(super) fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let mut w = WeightMap::new(path.display().to_string());
    w.read_safetensors(path).unwrap();
    let mut names = w.remaining();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = w.take_any(&n).unwrap();
            (n, t.data)
        })
        .collect()
}

pub(super) fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Actor and critic weights of two checkpoints agree within 1e-5, and they moved from the
/// starting weights (which both runs load), so agreeing is not agreeing on nothing.
pub(super) fn assert_same_weights(a: &Path, b: &Path, what: &str) {
    assert_same_weights_from(a, b, what, &tiny_models().0);
}

/// [`assert_same_weights`] for runs that started from the actor `start`.
fn assert_same_weights_from(a: &Path, b: &Path, what: &str, start: &CausalLm<B>) {
    let start = start.valid().export();
    for part in ["actor", "critic"] {
        let file = |root: &Path| root.join(format!("{part}/model.safetensors"));
        let (x, y) = (tensors(&file(a)), tensors(&file(b)));
        assert_eq!(x.len(), y.len());
        let worst = x
            .iter()
            .zip(&y)
            .map(|((n, p), (m, q))| {
                assert_eq!(n, m);
                max_diff(p, q)
            })
            .fold(0.0, f32::max);
        println!("{what}: {part} parameters differ by at most {worst:.2e}");
        assert!(worst <= 1e-5, "{what}: {part} differs by {worst}");
        // The decoder's weights (the critic's too: it starts from the actor's); the critic's
        // fresh value head has no starting copy here.
        let moved = x
            .iter()
            .filter_map(|(n, p)| start.get(n).map(|s| max_diff(p, &s.data)))
            .fold(0.0, f32::max);
        assert!(
            moved > 1e-5,
            "{what}: {part} did not move from its start ({moved})"
        );
    }
}

/// Metrics that describe the run (not the machine's speed) agree.
pub(super) fn assert_same_metrics(a: &Path, b: &Path, what: &str) {
    assert_same_metrics_but(a, b, what, &[]);
}

/// [`assert_same_metrics`] without the metrics `skip`.
fn assert_same_metrics_but(a: &Path, b: &Path, what: &str, skip: &[&str]) {
    let read = |dir: &Path| -> Vec<(usize, Metrics)> {
        read_jsonl(&dir.parent().unwrap().join("metrics.jsonl")).unwrap()
    };
    let (x, y) = (read(a), read(b));
    assert_eq!(x.len(), STEPS, "{what}: steps logged");
    assert_eq!(y.len(), STEPS, "{what}: steps logged");
    let mut compared = 0;
    for ((s, m), (t, n)) in x.iter().zip(&y) {
        assert_eq!(s, t);
        for (k, v) in m {
            if burn_rlhf::trainer::usage::measures_the_machine(k) || skip.contains(&k.as_str()) {
                continue;
            }
            let w = n
                .get(k)
                .unwrap_or_else(|| panic!("{what}: step {s} lacks {k}"));
            let tol = 1e-5 * (1.0 + v.abs());
            assert!((v - w).abs() <= tol, "{what}: step {s} {k}: {v} vs {w}");
            compared += 1;
        }
        // The machine's measures name the phases that ran (the old-log-prob pass or not).
        let measured = |m: &Metrics| {
            m.keys()
                .filter(|k| !burn_rlhf::trainer::usage::measures_the_machine(k))
                .count()
        };
        assert_eq!(measured(m), measured(n), "{what}: step {s} metric count");
    }
    println!("{what}: {compared} metric values equal");
}

/// One-step-off-policy training (`hybrid_engine=False`) with a data-parallel trainer of two
/// devices in one process: rank 0's rollout worker generates each batch a step ahead and hands
/// its samples to the other rank; the run ends as the one-device run does, weights and metrics
/// (the engine's counters counted once, not once per rank).
#[test]
fn one_step_off_with_two_devices_reproduces_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-one-step-off");
    let off = |root: &str| {
        let mut c = config(&dir.join(root));
        c.actor_rollout_ref.hybrid_engine = false;
        c.actor_rollout_ref.actor.strategy = "megatron".into();
        c
    };
    let single = n_devices(off("single"), Arc::new(tasks::ExactAnswer), 1).unwrap();
    let dp = two_devices(off("dp"), Arc::new(tasks::ExactAnswer)).unwrap();
    assert_same_weights(&single, &dp, "one step off, 2 devices vs 1");
    assert_same_metrics(&single, &dp, "one step off, 2 devices vs 1");
}

/// One-step-off-policy training with a tensor-parallel trainer (refused before): the first
/// replica's ranks gather the split actor for the rollout worker, which generates each batch a
/// step ahead with the whole policy; its replica's ranks take its samples over their group,
/// then the other replica's. Split over 2 devices, and over 4 (two replicas), the run ends as
/// the one-device run does (weights and metrics); a run resumed from its checkpoint after the
/// first step (the generation in flight started again from its `rollout/`) ends with its weights.
#[test]
fn one_step_off_with_a_tensor_parallel_trainer_reproduces_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-tp-one-step-off");
    let off = |root: &str| {
        let mut c = config(&dir.join(root));
        c.actor_rollout_ref.hybrid_engine = false;
        c.actor_rollout_ref.actor.strategy = "megatron".into();
        c
    };
    let single = n_devices(off("single"), Arc::new(tasks::ExactAnswer), 1).unwrap();
    for devices in [2, 4] {
        let what = format!("one step off, tp=2 over {devices} devices vs 1");
        let c = tensor_parallel(off(&format!("tp2x{devices}")), 2, devices);
        let run = n_devices(c, Arc::new(tasks::ExactAnswer), devices).unwrap();
        assert_same_weights(&single, &run, &what);
        assert_same_metrics(&single, &run, &what);
    }
    // A checkpoint every step: each keeps the generation in flight.
    let mut c = tensor_parallel(off("saving"), 2, 2);
    c.trainer.save_freq = 1;
    let saving = n_devices(c, Arc::new(tasks::ExactAnswer), 2).unwrap();
    let after_first = saving.with_file_name("global_step_1");
    assert!(
        after_first.join("rollout").is_dir(),
        "the checkpoint keeps the weights of the generation in flight"
    );
    let mut c = tensor_parallel(off("resumed"), 2, 2);
    c.trainer.resume_mode = "resume_path".into();
    c.trainer.resume_from_path = Some(after_first.display().to_string());
    let resumed = n_devices(c, Arc::new(tasks::ExactAnswer), 2).unwrap();
    assert_same_weights(
        &single,
        &resumed,
        "one step off, tp=2, resumed after step 1",
    );
}

/// Parameters whole on each rank (`strategy: megatron` without tensor parallelism: plain data
/// parallelism).
#[test]
fn two_devices_in_one_process_reproduce_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-devices");
    let single = one_device(&dir.join("single"));
    let mut c = config(&dir.join("dp"));
    c.actor_rollout_ref.actor.strategy = "megatron".into();
    let dp = two_devices(c, Arc::new(tasks::ExactAnswer)).unwrap();
    assert!(single.ends_with(format!("global_step_{STEPS}")));
    assert_same_weights(&single, &dp, "2 devices vs 1");
    assert_same_metrics(&single, &dp, "2 devices vs 1");
}

/// The tiny models as a mixture of experts (Qwen3-MoE's layout): 64 experts, one per token. A rank
/// holds at most 4 rows x 12 positions = 48 routed tokens a mini-batch, so every rank's batch
/// leaves experts without a token (and, the routing being the random router's, experts that the
/// other rank's batch reached): their gradients exist on one rank only. The top-1 weight is the
/// router's probability (not renormalised to 1, which would leave the router a gradient of
/// rounding noise for AdamW to amplify). No load-balancing loss: it is computed per micro-batch
/// (as in transformers and verl) and is not linear in the rows, so ranks whose micro-batches hold
/// other rows than one device's (balanced by length) differ by it (7.2e-3 in the actor's weights
/// after 3 steps here), whatever the exchange does; its metric is left out of the comparison.
fn moe_models() -> (
    CausalLm<B>,
    ValueModel<B>,
    burn_rlhf::models::TransformerConfig,
) {
    let mut mc = tasks::model_config(32, 1);
    mc.model_type = burn_rlhf::models::ModelType::Qwen3Moe;
    mc.moe = Some(burn_rlhf::models::MoeConfig {
        num_experts: 64,
        num_experts_per_tok: 1,
        expert_intermediate_size: 16,
        norm_topk_prob: false,
        router_aux_loss_coef: 0.01,
        output_router_logits: false,
        sparse_layers: vec![true],
    });
    let (actor, critic) = super::models_of(&mc, 13);
    (actor, critic, mc)
}

/// The load-balancing loss's metric: a mean over micro-batches of a loss that is not linear in
/// their rows (see [`moe_models`]).
const ROUTER_AUX: &str = "actor/router_aux_loss";

/// Issue 40, 4a: experts that one rank's tokens never reach have no gradient there; the ranks
/// still reduce the same list (zeros and a had-gradient flag), so two devices give one device's
/// weights and metrics, and experts no rank reached keep their starting weights on both.
#[test]
fn a_mixture_of_experts_with_experts_one_rank_never_reaches_reproduces_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-moe");
    // Drawn once: both runs start from the very same weights.
    let (start, critic, mc) = moe_models();
    let run = |root: &Path, n: usize| {
        let parts = parts_of(
            start.clone(),
            critic.clone(),
            mc.clone(),
            Arc::new(tasks::ExactAnswer),
        );
        n_devices_of(config(root), parts, n).unwrap()
    };
    let single = run(&dir.join("single"), 1);
    let dp = run(&dir.join("dp"), 2);
    assert_same_weights_from(&single, &dp, "MoE, 2 devices vs 1", &start);
    assert_same_metrics_but(&single, &dp, "MoE, 2 devices vs 1", &[ROUTER_AUX]);
    // Some experts trained, some were reached by no token of any rank (left as they started).
    let start = start.valid().export();
    let (mut moved, mut still) = (0, 0);
    for (name, values) in tensors(&dp.join("actor/model.safetensors")) {
        if name.contains(".experts.") && name.ends_with("gate_proj.weight") {
            match max_diff(&values, &start[&name].data) > 0.0 {
                true => moved += 1,
                false => still += 1,
            }
        }
    }
    println!("MoE, 2 devices: {moved} experts trained, {still} reached by no token");
    assert!(moved > 0 && still > 0, "{moved} trained, {still} untouched");
}

#[test]
fn spin_pairs_stay_together_across_two_devices() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-spin");
    let spin = |d: &Path| {
        let mut c = config(d);
        c.algorithm.adv_estimator = "spin".into();
        c.actor_rollout_ref.actor.policy_loss.loss_mode = "spin".into();
        c.trainer.ref_update_freq = 2;
        c
    };
    let mut l = Learner::new(
        spin(&dir.join("single")),
        parts(Arc::new(tasks::ExactAnswer)),
        &Default::default(),
    )
    .unwrap();
    let single = l.fit(stop_flag()).unwrap().checkpoint.unwrap();
    let dp = two_devices(spin(&dir.join("dp")), Arc::new(tasks::ExactAnswer)).unwrap();
    let (a, b) = (
        tensors(&single.join("actor/model.safetensors")),
        tensors(&dp.join("actor/model.safetensors")),
    );
    let worst = a
        .iter()
        .zip(&b)
        .map(|((_, x), (_, y))| max_diff(x, y))
        .fold(0.0, f32::max);
    println!("SPIN, 2 devices vs 1: actor parameters differ by at most {worst:.2e}");
    assert!(worst <= 1e-5);
    // Right after the reference becomes the policy every margin is 0 up to rounding, and the
    // share of positive margins is the sign of that rounding: not comparable across splits.
    assert_same_metrics_but(
        &single,
        &dp,
        "SPIN, 2 devices vs 1",
        &["actor/dpo_reward_acc"],
    );
}

#[test]
fn sharded_optimizer_state_gives_the_same_parameters_with_half_the_state_per_rank() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-zero");
    let full = two_devices(config(&dir.join("full")), Arc::new(tasks::ExactAnswer)).unwrap();
    let mut c = config(&dir.join("zero"));
    zero1(&mut c);
    let zero = two_devices(c, Arc::new(tasks::ExactAnswer)).unwrap();
    assert_same_weights(&full, &zero, "ZeRO-1 vs unsharded");
    assert_same_metrics(&full, &zero, "ZeRO-1 vs unsharded");
    for part in ["actor", "critic"] {
        let size = |p: PathBuf| {
            std::fs::metadata(&p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                .len()
        };
        let whole = size(full.join(format!("{part}/optimizer.bin")));
        let shards: Vec<u64> = (0..2)
            .map(|r| size(zero.join(format!("{part}/optimizer_rank{r}_of_2.bin"))))
            .collect();
        let ratios: Vec<f64> = shards.iter().map(|&s| s as f64 / whole as f64).collect();
        println!(
            "{part} optimiser state per rank: unsharded {whole} bytes, ZeRO-1 {shards:?} bytes ({:.3}, {:.3} of it)",
            ratios[0], ratios[1]
        );
        for r in ratios {
            assert!(
                (0.4..0.6).contains(&r),
                "{part}: a shard holds {r} of the state"
            );
        }
    }
    // Every rank restores from the checkpoint (rank 0's weights, its own optimiser shard): two
    // steps, then a resumed run to three, equal three straight.
    let resumed_dir = dir.join("resumed");
    let mut c = config(&resumed_dir);
    zero1(&mut c);
    c.trainer.total_training_steps = Some(STEPS - 1);
    two_devices(c, Arc::new(tasks::ExactAnswer)).unwrap();
    let mut c = config(&resumed_dir);
    zero1(&mut c);
    c.trainer.resume_mode = "auto".into();
    let resumed = two_devices(c, Arc::new(tasks::ExactAnswer)).unwrap();
    assert_same_weights(&zero, &resumed, "ZeRO-1 resumed vs straight");
    assert_same_metrics(&zero, &resumed, "ZeRO-1 resumed vs straight");
}

/// `c` with the parameters whole on every rank and the AdamW state sharded (ZeRO-1, Megatron's
/// distributed optimiser).
fn zero1(c: &mut RlhfConfig) {
    c.actor_rollout_ref.actor.strategy = "megatron".into();
    c.trainer.zero_stage = 1;
}

/// `config` with AdamW's moments of the actor and the critic and the reference's weights in host
/// memory.
fn offloaded(mut c: RlhfConfig) -> RlhfConfig {
    c.actor_rollout_ref.actor.fsdp_config.optimizer_offload = true;
    c.critic.model.fsdp_config.optimizer_offload = true;
    c.actor_rollout_ref.reference.fsdp_config.param_offload = true;
    c
}

/// One device's run of `config`: its checkpoint, the actor's and critic's optimiser bytes and
/// the reference's weight bytes, each (device, host).
fn one_device_run(config: RlhfConfig) -> (PathBuf, [StateBytes; 3]) {
    let mut l = Learner::new(
        config,
        parts(Arc::new(tasks::ExactAnswer)),
        &Default::default(),
    )
    .unwrap();
    let checkpoint = l.fit(stop_flag()).unwrap().checkpoint.unwrap();
    let (actor, critic) = l.optimizer_memory();
    let (device, host) = l.reference_memory();
    (checkpoint, [actor, critic, StateBytes { device, host }])
}

#[test]
fn offloaded_optimizer_state_and_reference_give_the_same_parameters_with_none_on_the_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("offload");
    let (plain, on_device) = one_device_run(config(&dir.join("plain")));
    let (off, in_host) = one_device_run(offloaded(config(&dir.join("off"))));
    assert_same_weights(&plain, &off, "optimizer_offload vs on the device");
    assert_same_metrics(&plain, &off, "optimizer_offload vs on the device");
    let parts = [
        "actor AdamW moments",
        "critic AdamW moments",
        "reference weights",
    ];
    for (part, (d, h)) in parts.iter().zip(on_device.iter().zip(&in_host)) {
        println!("{part}: on the device {d:?}; offloaded {h:?}");
        assert!(d.device > 0 && d.host == 0, "{part}: {d:?}");
        assert_eq!((h.device, h.host), (0, d.device), "{part}");
    }
    // An offloaded run resumes from its checkpoint (the state loads into host memory).
    let resumed_dir = dir.join("resumed");
    let mut c = offloaded(config(&resumed_dir));
    c.trainer.total_training_steps = Some(STEPS - 1);
    one_device_run(c);
    let mut c = offloaded(config(&resumed_dir));
    c.trainer.resume_mode = "auto".into();
    let (resumed, memory) = one_device_run(c);
    assert_same_weights(&off, &resumed, "offloaded, resumed vs straight");
    assert_same_metrics(&off, &resumed, "offloaded, resumed vs straight");
    assert_eq!(
        memory, in_host,
        "the resumed state is where the run keeps it"
    );
    // With ZeRO-1 over two devices, each rank keeps its shard in host memory.
    let mut c = offloaded(config(&dir.join("zero-off")));
    zero1(&mut c);
    let zero_off = two_devices(c, Arc::new(tasks::ExactAnswer)).unwrap();
    let full = two_devices(config(&dir.join("full")), Arc::new(tasks::ExactAnswer)).unwrap();
    assert_same_weights(&full, &zero_off, "ZeRO-1 offloaded vs unsharded");
}

/// `config` with every model split over `tp` of `devices` devices (the rest data parallelism).
fn tensor_parallel(mut c: RlhfConfig, tp: usize, devices: usize) -> RlhfConfig {
    c.actor_rollout_ref.actor.strategy = "megatron".into();
    c.actor_rollout_ref
        .actor
        .megatron
        .tensor_model_parallel_size = tp;
    c.trainer.n_gpus_per_node = devices;
    c
}

#[test]
fn tensor_parallel_ranks_reproduce_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-tp");
    let single = one_device(&dir.join("one"));
    for (tp, devices) in [(2, 2), (2, 4)] {
        let what = format!("tp={tp} over {devices} devices");
        let c = tensor_parallel(config(&dir.join(format!("tp{tp}x{devices}"))), tp, devices);
        let run = n_devices(c, Arc::new(tasks::ExactAnswer), devices).unwrap();
        assert_same_weights(&single, &run, &what);
        assert_same_metrics(&single, &run, &what);
    }
    // A split run resumes from its whole-model checkpoint and its shards' optimiser states.
    let resumed_dir = dir.join("tp-resumed");
    let mut c = tensor_parallel(config(&resumed_dir), 2, 4);
    c.trainer.total_training_steps = Some(STEPS - 1);
    n_devices(c, Arc::new(tasks::ExactAnswer), 4).unwrap();
    let mut c = tensor_parallel(config(&resumed_dir), 2, 4);
    c.trainer.resume_mode = "auto".into();
    let resumed = n_devices(c, Arc::new(tasks::ExactAnswer), 4).unwrap();
    assert_same_weights(&single, &resumed, "tp=2 over 4 devices, resumed");
    assert_same_metrics(&single, &resumed, "tp=2 over 4 devices, resumed");
    for t in 0..2 {
        assert!(resumed
            .join(format!("actor/optimizer_tp{t}_of_2.bin"))
            .exists());
    }
    // Four ranks: a vocabulary that divides by 4.
    let wide = || {
        let (actor, critic, mc) = wide_vocab_models();
        parts_of(actor, critic, mc, Arc::new(tasks::ExactAnswer))
    };
    let (single, whole) = n_devices_memory(config(&dir.join("wide-one")), wide(), 1).unwrap();
    let mut shares = Vec::new();
    for tp in [2, 4] {
        let c = tensor_parallel(config(&dir.join(format!("wide-tp{tp}"))), tp, tp);
        let (run, memory) = n_devices_memory(c, wide(), tp).unwrap();
        if tp == 4 {
            let start = wide_vocab_models().0;
            assert_same_weights_from(&single, &run, "tp=4 over 4 devices", &start);
            assert_same_metrics(&single, &run, "tp=4 over 4 devices");
        }
        shares.push((tp, memory));
    }
    // Rank 0's actor and critic parameters and AdamW moments: about 1/tp of one device's (the
    // whole norms, value head and, at 4, the whole key/value heads are the rest).
    println!("one device: {whole:?}");
    for (tp, m) in &shares {
        let part = |x: usize, of: usize| x as f64 / of as f64;
        let (params, moments) = (
            part(m.parameters, whole.parameters),
            part(m.optimizer.device, whole.optimizer.device),
        );
        println!("tp={tp}: rank 0 holds {params:.3} of the parameter bytes, {moments:.3} of the AdamW bytes ({m:?})");
        assert!(params < 1.0 / *tp as f64 + 0.1, "tp={tp}: {params}");
        assert!(
            (moments - params).abs() < 1e-9,
            "tp={tp}: moments follow the parameters"
        );
    }
}

/// `config` trained whole on `devices` devices, generating on replicas of `rollout_tp` of them
/// (verl's rollout tensor parallelism beside FSDP training).
fn rollout_split(mut c: RlhfConfig, rollout_tp: usize, devices: usize) -> RlhfConfig {
    c.actor_rollout_ref.rollout.tensor_model_parallel_size = Some(rollout_tp);
    c.trainer.n_gpus_per_node = devices;
    c
}

#[test]
fn a_rollout_split_over_whole_trainers_reproduces_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-rollout-tp");
    let single = one_device(&dir.join("one"));
    for (tp, devices, fsdp) in [(2, 2, false), (2, 4, false), (2, 4, true)] {
        let what = format!("rollout tp={tp} over {devices} devices, fsdp {fsdp}");
        let mut c = rollout_split(
            config(&dir.join(format!("rtp{tp}x{devices}-{fsdp}"))),
            tp,
            devices,
        );
        if fsdp {
            c.actor_rollout_ref.actor.strategy = "fsdp".into();
        }
        let run = n_devices(c, Arc::new(tasks::ExactAnswer), devices).unwrap();
        assert_same_weights(&single, &run, &what);
        assert_same_metrics(&single, &run, &what);
        // The split generation's log-probs sum the vocabulary's shares first: the trainer's
        // whole pass is a few ulps away, where one device's generation matches it exactly.
        let last = |dir: &Path| {
            read_jsonl(&dir.parent().unwrap().join("metrics.jsonl")).unwrap()[0].1
                ["training/rollout_probs_diff_max"]
        };
        let (whole, split) = (last(&single), last(&run));
        println!("{what}: rollout_probs_diff_max {whole} vs {split}");
        assert!(split > 0.0, "{what}: generation ran on the whole policy");
    }
}

#[test]
fn rollout_splits_that_cannot_run_are_refused_naming_the_key() {
    let dir = temp_dir("dp-rollout-tp-refused");
    let key = "rollout.tensor_model_parallel_size";
    let validate = |c: &RlhfConfig| c.validate("test").map(|_| ()).map_err(|e| e.to_string());
    // Not dividing the devices; with a split actor; one step off.
    let three = rollout_split(config(&dir), 2, 3);
    let split_actor = rollout_split(tensor_parallel(config(&dir), 2, 4), 4, 4);
    let mut one_off = rollout_split(config(&dir), 2, 2);
    one_off.actor_rollout_ref.hybrid_engine = false;
    for (c, says) in [
        (&three, "must divide"),
        (&split_actor, "resharded from a split actor"),
        (&one_off, "one-step-off"),
    ] {
        let e = validate(c).unwrap_err();
        assert!(e.contains(key) && e.contains(says), "{e}");
    }
    // A vocabulary the split does not divide: refused before any step.
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // The tiny model's heads do not divide over 3.
    let e = n_devices(
        rollout_split(config(&dir.join("three")), 3, 3),
        Arc::new(tasks::ExactAnswer),
        3,
    )
    .unwrap_err();
    assert!(e.contains(key) && e.contains("not a multiple"), "{e}");
}

/// `burn-rlhf bench-collectives` between two devices of this process: every operation at every
/// size, timed on both ranks.
#[test]
fn the_collectives_benchmark_times_every_operation_on_two_ranks() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    use burn_rlhf::config::CollectiveBackend;
    // Every result is checked against the host's arithmetic before the timing.
    let (transport, rows) =
        burn_rlhf::bench::bench_collectives(1, 2, 64 * 1024, CollectiveBackend::Auto, false)
            .unwrap()
            .expect("the first rank reports");
    assert!(transport.starts_with("burn-collective"), "{transport}");
    assert_eq!(
        rows.len(),
        5 * 3,
        "4 operations on host buffers and a device tensor's all-reduce at 4, 16 and 64 KiB"
    );
    let tensor_rows = rows
        .iter()
        .filter(|r| r.op == burn_rlhf::bench::TENSOR_ALL_REDUCE)
        .count();
    assert_eq!(tensor_rows, 3);
    for row in &rows {
        assert_eq!(row.ranks, 2);
        assert!(row.median_s > 0.0 && row.busbw().is_finite(), "{row:?}");
    }
    // NCCL asked for where it cannot run: refused, naming the key and why.
    let err = burn_rlhf::bench::bench_collectives(1, 2, 4096, CollectiveBackend::Nccl, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("trainer.collective_backend") && err.contains("--features cuda"),
        "{err}"
    );
}

/// The arithmetic reward, except that on rank 1 its second batch fails.
struct FailsOnRank1 {
    calls: Mutex<usize>,
}

impl RewardFn for FailsOnRank1 {
    fn name(&self) -> &str {
        tasks::DATA_SOURCE
    }
    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RolloutError> {
        if std::thread::current().name() == Some("burn-rlhf-rank-1") {
            let mut calls = self.calls.lock().unwrap();
            *calls += 1;
            if *calls == 2 {
                return Err(RolloutError::Invalid("the reward server went away".into()));
            }
        }
        tasks::ExactAnswer.score(batch)
    }
}

#[test]
fn a_failing_device_rank_stops_the_other_with_its_error() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-fail");
    let start = Instant::now();
    let err = two_devices(
        config(&dir),
        Arc::new(FailsOnRank1 {
            calls: Mutex::new(0),
        }),
    )
    .unwrap_err();
    println!("stopped after {:?}: {err}", start.elapsed());
    assert!(err.contains("the reward server went away"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(60));
    // The next group in this process starts cleanly.
    let ok = two_devices(config(&dir.join("after")), Arc::new(tasks::ExactAnswer));
    assert!(ok.is_ok(), "{ok:?}");
    // A tensor-parallel rank that fails stops its group's other rank, waiting in an exchange.
    let start = Instant::now();
    let err = two_devices(
        tensor_parallel(config(&dir.join("tp")), 2, 2),
        Arc::new(FailsOnRank1 {
            calls: Mutex::new(0),
        }),
    )
    .unwrap_err();
    println!(
        "tensor-parallel pair stopped after {:?}: {err}",
        start.elapsed()
    );
    assert!(err.contains("the reward server went away"), "{err}");
    assert!(
        !err.contains("panicked"),
        "the failing rank's error is reported: {err}"
    );
    assert!(start.elapsed() < Duration::from_secs(30));
}

/// Runs of `burn-rlhf train` as MPI jobs (`mpirun` on this host).
#[cfg(feature = "mpi")]
mod processes {
    use std::io::Read;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use super::{assert_same_metrics_but, assert_same_weights_from, temp_dir, STEPS};

    /// The tiny model and the task's data as files, for the CLI.
    fn cli_assets(dir: &Path) -> (PathBuf, PathBuf) {
        super::super::cli_assets(dir, 7, 16)
    }

    fn cli_args(model: &Path, data: &Path, out: &Path, steps: usize) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/ppo_gsm8k.ron");
        vec![
            "train".into(),
            path(&config),
            format!("actor_rollout_ref.model.path={}", path(model)),
            format!("critic.model.path={}", path(model)),
            format!("data.train_files=[{}]", path(data)),
            "data.max_prompt_length=8".into(),
            "data.max_response_length=4".into(),
            "data.train_batch_size=8".into(),
            "data.filter_overlong_prompts=false".into(),
            "actor_rollout_ref.rollout.n=2".into(),
            "actor_rollout_ref.actor.ppo_mini_batch_size=4".into(),
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
            "critic.ppo_micro_batch_size_per_gpu=2".into(),
            "actor_rollout_ref.actor.optim.lr=0.001".into(),
            "critic.optim.lr=0.001".into(),
            "algorithm.use_kl_in_reward=true".into(),
            "custom_reward_function.name=arithmetic".into(),
            format!("trainer.total_training_steps={steps}"),
            "trainer.test_freq=-1".into(),
            "trainer.save_freq=-1".into(),
            "trainer.logger=[jsonl]".into(),
            "trainer.resume_mode=disable".into(),
            format!("trainer.default_local_dir={}", path(out)),
        ]
    }

    /// `mpirun -np {np}` of `burn-rlhf` with `args` (OpenMPI's; allowed to run as root, and more
    /// processes than cores).
    fn mpirun(np: usize, args: &[String]) -> Child {
        mpirun_with(np, args, &[])
    }

    /// [`mpirun`] with `envs` set in every process.
    fn mpirun_with(np: usize, args: &[String], envs: &[(&str, &str)]) -> Child {
        let mut command = Command::new("mpirun");
        command.args(["--oversubscribe", "-np", &np.to_string()]);
        for (key, value) in envs {
            command.args(["-x", &format!("{key}={value}")]);
        }
        command
            .arg(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(args)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun (install OpenMPI: apt-get install openmpi-bin libopenmpi-dev)")
    }

    /// Waits for `mpirun` at most `limit`; past that, stops it (SIGTERM, which it passes on to
    /// its processes) and then kills it. Returns its success and stderr.
    fn wait_bounded(mut child: Child, limit: Duration) -> (bool, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if start.elapsed() > limit {
                Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status()
                    .ok();
                std::thread::sleep(Duration::from_secs(5));
                child.kill().ok();
                child.wait().ok();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            e.read_to_string(&mut err).ok();
        }
        (status.is_some_and(|s| s.success()), err)
    }

    /// `burn-rlhf train` as one process with one device, then as an MPI job of 2 processes with
    /// `devices` devices each: same weights and metrics.
    fn mpi_job_reproduces_one_process(name: &str, devices: usize) {
        mpi_job_of(name, devices, &[]);
    }

    /// [`mpi_job_reproduces_one_process`] with `extra` overrides for the MPI job.
    fn mpi_job_of(name: &str, devices: usize, extra: &[&str]) {
        mpi_job_of_processes(name, 2, devices, extra)
    }

    /// `burn-rlhf train` as one process with one device, then as an MPI job of `np` processes
    /// with `devices` devices each and `extra` overrides: same weights and metrics.
    fn mpi_job_of_processes(name: &str, np: usize, devices: usize, extra: &[&str]) {
        let dir = temp_dir(name);
        mpi_job_in(&dir, np, devices, &[], extra)
    }

    /// [`mpi_job_of_processes`] in `dir`, with `both` overrides for both runs.
    fn mpi_job_in(dir: &Path, np: usize, devices: usize, both: &[String], extra: &[&str]) {
        mpi_job_with_env(dir, (np, devices), both, extra, &[])
    }

    /// [`mpi_job_in`] with `envs` set in the MPI job's processes.
    fn mpi_job_with_env(
        dir: &Path,
        (np, devices): (usize, usize),
        both: &[String],
        extra: &[&str],
        envs: &[(&str, &str)],
    ) {
        let start = super::tiny_models().0;
        mpi_job_on(
            dir,
            (cli_assets(dir), &start),
            (np, devices),
            (both, extra),
            (envs, &[]),
        )
    }

    /// [`mpi_job_with_env`] of the model and data files `assets`, the model's weights `start`.
    fn mpi_job_on(
        dir: &Path,
        ((model, data), start): ((PathBuf, PathBuf), &super::CausalLm<super::B>),
        (np, devices): (usize, usize),
        (both, extra): (&[String], &[&str]),
        (envs, skip): (&[(&str, &str)], &[&str]),
    ) {
        let single = dir.join("single");
        let mut args = cli_args(&model, &data, &single, STEPS);
        args.extend(both.iter().cloned());
        let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(args)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let multi = dir.join("multi");
        let mut args = cli_args(&model, &data, &multi, STEPS);
        args.extend(both.iter().cloned());
        args.push(format!("trainer.n_gpus_per_node={}", np * devices));
        args.extend(extra.iter().map(|e| e.to_string()));
        let (ok, err) = wait_bounded(mpirun_with(np, &args, envs), Duration::from_secs(300));
        assert!(ok, "the MPI job failed or ran past 300 s:\n{err}");
        let step = format!("global_step_{STEPS}");
        let what = format!("{np} MPI processes x {devices} device(s) {extra:?} vs 1");
        assert_same_weights_from(&single.join(&step), &multi.join(&step), &what, start);
        assert_same_metrics_but(&single.join(&step), &multi.join(&step), &what, skip);
    }

    /// Issue 40, 4a across processes: the mixture of experts of [`super::moe_models`], whose
    /// ranks' batches each leave experts without a token, in two MPI processes as in one.
    #[test]
    fn a_mixture_of_experts_in_two_mpi_processes_reproduces_one_process() {
        let dir = temp_dir("dp-mpi-moe");
        let (actor, _, mc) = super::moe_models();
        let (_, data) = cli_assets(&dir);
        let model = dir.join("moe-model");
        burn_rlhf::models::pretrained::save_pretrained(
            &model,
            &mc,
            &burn::module::AutodiffModule::valid(&actor).export(),
            None,
            Some(&burn_rlhf::tasks::tokenizer()),
        )
        .unwrap();
        mpi_job_on(
            &dir,
            ((model, data), &actor),
            (2, 1),
            (&[], &[]),
            (&[], &[super::ROUTER_AUX]),
        );
    }

    #[test]
    fn two_mpi_processes_reproduce_one_process() {
        mpi_job_reproduces_one_process("dp-mpi", 1);
    }

    /// Tensor parallelism inside each process (2 devices, one replica each), data parallelism
    /// across the two processes through MPI.
    #[test]
    fn two_mpi_processes_of_a_tensor_parallel_pair_each_reproduce_one_process() {
        mpi_job_of(
            "dp-mpi-tp",
            2,
            &[
                "actor_rollout_ref.actor.strategy=megatron",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            ],
        );
    }

    /// One process per device (as on GPU hosts): a tensor-parallel pair spans two processes,
    /// its exchanges through MPI.
    #[test]
    fn a_tensor_parallel_pair_across_two_mpi_processes_reproduces_one_process() {
        mpi_job_of_processes(
            "dp-mpi-tp-across",
            2,
            1,
            &[
                "actor_rollout_ref.actor.strategy=megatron",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            ],
        );
    }

    /// One process per device, trained whole (FSDP, verl's layout) on four processes and
    /// generating on two rollout replicas of a pair of processes each, their exchanges through
    /// MPI.
    #[test]
    fn a_rollout_split_across_mpi_processes_of_fsdp_trainers_reproduces_one_process() {
        mpi_job_of_processes(
            "dp-mpi-rollout-tp",
            4,
            1,
            &[
                "actor_rollout_ref.actor.strategy=fsdp",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ],
        );
    }

    /// Four processes of one device: two replicas of a pair that spans two processes, the
    /// replicas' ranks at each place a data-parallel group through MPI.
    #[test]
    fn two_replicas_of_a_tensor_parallel_pair_across_four_mpi_processes_reproduce_one_process() {
        mpi_job_of_processes(
            "dp-mpi-tp-across-2x2",
            4,
            1,
            &[
                "actor_rollout_ref.actor.strategy=megatron",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            ],
        );
    }

    /// A reward model scores the rollouts (each process its share of the rows, the scores
    /// gathered through MPI) as in one process.
    #[test]
    fn a_reward_model_scores_rollouts_in_two_mpi_processes_as_in_one() {
        let dir = temp_dir("dp-mpi-rm");
        let rm = crate::reward_model::reward_model_folder(&dir.join("rm"), false);
        let both = [
            "reward_model.enable=true".to_string(),
            format!("reward_model.model.path={}", rm.display()),
            "reward_model.micro_batch_size_per_gpu=3".into(),
            "custom_reward_function.name=null".into(),
        ];
        mpi_job_in(&dir, 2, 1, &both, &[]);
        // The reward model scored them (the rule gives 0 or 1).
        let log =
            burn_rlhf::trainer::logger::read_jsonl(&dir.join("single/metrics.jsonl")).unwrap();
        assert!(log
            .iter()
            .all(|(_, m)| ![0.0, 1.0].contains(&m["critic/score/max"])));
    }

    #[test]
    fn two_mpi_processes_of_two_devices_reproduce_one_process() {
        // World 4: each process's two device threads meet, then the processes sum through MPI,
        // here in buckets of 4 KiB (25 MiB by default), so the gradients cross many bucket
        // boundaries and the larger parameters are split within the transport.
        let dir = temp_dir("dp-mpi-devices");
        mpi_job_with_env(
            &dir,
            (2, 2),
            &[],
            &[],
            &[("BURN_RLHF_BUCKET_BYTES", "4096")],
        );
    }

    /// The processes `mpirun` (`pid`) started, with their MPI rank
    /// (`OMPI_COMM_WORLD_RANK` in their environment).
    fn mpi_ranks(pid: u32) -> Vec<(u32, usize)> {
        let mut found = Vec::new();
        let mut parents = vec![pid];
        while let Some(parent) = parents.pop() {
            for entry in std::fs::read_dir("/proc").unwrap().flatten() {
                let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
                    continue;
                };
                let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
                // `pid (comm) state ppid ...`: the parent is the second field after the name.
                let ppid = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|p| p.parse::<u32>().ok());
                if ppid != Some(parent) {
                    continue;
                }
                parents.push(child);
                let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
                let rank = environ
                    .split(|&b| b == 0)
                    .filter_map(|kv| std::str::from_utf8(kv).ok())
                    .find_map(|kv| kv.strip_prefix("OMPI_COMM_WORLD_RANK="))
                    .and_then(|r| r.parse().ok());
                if let Some(rank) = rank {
                    found.push((child, rank));
                }
            }
        }
        found
    }

    /// The metrics of the in-process worker's run (`single`, `steps` lines) and the pooled run's,
    /// after checking that every one describing the run (not the machine's speed) agrees within
    /// `tol` relative to the value.
    fn pooled_metrics(
        single: &Path,
        pooled: &Path,
        steps: usize,
        tol: f64,
    ) -> (Vec<(usize, super::Metrics)>, Vec<(usize, super::Metrics)>) {
        let read = |dir: &Path| super::read_jsonl(&dir.join("metrics.jsonl")).unwrap();
        let (a, b) = (read(single), read(pooled));
        assert_eq!(a.len(), steps);
        for ((s, m), (_, n)) in a.iter().zip(&b) {
            for (k, v) in m {
                if burn_rlhf::trainer::usage::measures_the_machine(k) {
                    continue;
                }
                let w = n[k];
                assert!(
                    (v - w).abs() <= tol * (1.0 + v.abs()),
                    "step {s} {k}: {v} vs {w}"
                );
            }
        }
        (a, b)
    }

    /// Issue 58 item 3: one-step-off-policy training with its rollout pool in an MPI process of
    /// its own (the trainer in process 0, the pool in process 1) trains as the in-process rollout
    /// worker does; and a job whose trainer is killed (`kill -9`) after a checkpoint, started
    /// again, sends the generation in flight to a fresh pool and ends with the same weights.
    #[test]
    fn a_rollout_pool_in_an_mpi_process_of_its_own_trains_as_the_in_process_worker() {
        let dir = temp_dir("dp-mpi-rollout-pool");
        let (model, data) = cli_assets(&dir);
        let start = super::tiny_models().0;
        let steps = 6;
        let args = |out: &Path, extra: &[&str]| {
            let mut a = cli_args(&model, &data, out, steps);
            a.push("actor_rollout_ref.hybrid_engine=False".into());
            a.extend(extra.iter().map(|e| e.to_string()));
            a
        };
        let single = dir.join("single");
        let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(args(&single, &[]))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let pooled = dir.join("pooled");
        let (ok, err) = wait_bounded(mpirun(2, &args(&pooled, &[])), Duration::from_secs(300));
        assert!(ok, "the pooled job failed:\n{err}");
        let last = format!("global_step_{steps}");
        let what = "trainer + rollout pool in 2 MPI processes vs the in-process worker";
        // Both read the steps of the whole run: `assert_same_metrics_but` counts STEPS.
        assert_same_weights_from(&single.join(&last), &pooled.join(&last), what, &start);
        let (_, b) = pooled_metrics(&single, &pooled, steps, 1e-5);
        assert_eq!(b[1].1["rollout/staleness"], 1.0);
        // Killed after its second checkpoint, then started again.
        let killed = dir.join("killed");
        let kill_args = args(
            &killed,
            &["trainer.save_freq=1", "trainer.resume_mode=auto"],
        );
        let job = mpirun(2, &kill_args);
        let begun = Instant::now();
        while !killed.join("global_step_2/trainer_state.json").exists() {
            assert!(
                begun.elapsed() < Duration::from_secs(120),
                "no checkpoint in 120 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let ranks = mpi_ranks(job.id());
        let (pid, _) = ranks
            .iter()
            .find(|(_, r)| *r == 0)
            .unwrap_or_else(|| panic!("no process of MPI rank 0 among {ranks:?}"));
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap();
        let (ok, _) = wait_bounded(job, Duration::from_secs(60));
        assert!(!ok, "the job should fail when its trainer dies");
        assert!(!killed.join(&last).exists(), "killed before its last step");
        let (ok, err) = wait_bounded(mpirun(2, &kill_args), Duration::from_secs(300));
        assert!(ok, "the resumed job failed:\n{err}");
        let file = |root: &Path| super::tensors(&root.join(&last).join("actor/model.safetensors"));
        assert_eq!(
            file(&pooled),
            file(&killed),
            "resumed after kill -9 vs straight"
        );
        // Started with another number of processes than trainer + pool: refused, naming why.
        let (ok, err) = wait_bounded(
            mpirun(3, &args(&dir.join("three"), &[])),
            Duration::from_secs(60),
        );
        assert!(
            !ok && err.contains("rollout.n_gpus_per_node") && err.contains("1 + 1"),
            "{err}"
        );
    }

    /// Issue 58 item 3: the rollout pool is sent only the tensors that changed since its last
    /// order. The first order carries every weight; under LoRA on `q_proj` and `v_proj` (merged
    /// for generation) the second carries none (the same weights, one step stale) and every later
    /// one exactly those layers' weights, and the run is the in-process worker's bit for bit (the
    /// pool kept the rest as it had them). Under full fine-tuning the first order carries every
    /// weight too.
    #[test]
    fn the_rollout_pool_is_sent_only_the_weights_that_changed() {
        let dir = temp_dir("dp-mpi-pool-delta");
        let (model, data) = cli_assets(&dir);
        let start = super::tiny_models().0;
        let exported = burn::module::AutodiffModule::valid(&start).export();
        let size = |keep: &dyn Fn(&str) -> bool| -> f64 {
            exported
                .iter()
                .filter(|(n, _)| keep(n))
                .map(|(_, t)| t.data.len() as f64)
                .sum()
        };
        let all = size(&|_| true);
        let adapted = size(&|n| n.contains("q_proj") || n.contains("v_proj"));
        assert!(adapted > 0.0 && adapted < all);
        let steps = 4;
        let args = |out: &Path, lora: bool| {
            let mut a = cli_args(&model, &data, out, steps);
            a.push("actor_rollout_ref.hybrid_engine=False".into());
            if lora {
                a.extend([
                    "actor_rollout_ref.model.lora_rank=4".into(),
                    "actor_rollout_ref.model.target_modules=[q_proj,v_proj]".into(),
                    "actor_rollout_ref.model.lora.merge=true".into(),
                ]);
            }
            a
        };
        let single = dir.join("single");
        let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(args(&single, true))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let pooled = dir.join("pooled");
        let (ok, err) = wait_bounded(mpirun(2, &args(&pooled, true)), Duration::from_secs(300));
        assert!(ok, "the pooled LoRA job failed:\n{err}");
        let last = format!("global_step_{steps}");
        let file = |root: &Path| super::tensors(&root.join(&last).join("actor/model.safetensors"));
        assert_eq!(
            file(&single),
            file(&pooled),
            "pooled LoRA vs in-process worker"
        );
        let read = |dir: &Path| super::read_jsonl(&dir.join("metrics.jsonl")).unwrap();
        let sent: Vec<f64> = read(&pooled)
            .iter()
            .map(|(_, m)| m["rollout/weight_values_sent"])
            .collect();
        println!("weight values sent by step under LoRA: {sent:?} (all {all}, adapted {adapted})");
        // The second batch is generated by the weights the first step started from, as the
        // first was (one step stale): nothing changed, nothing goes.
        assert_eq!(sent[..2], [all, 0.0]);
        assert!(sent[2..].iter().all(|&v| v == adapted), "{sent:?}");
        let full = dir.join("full");
        let (ok, err) = wait_bounded(mpirun(2, &args(&full, false)), Duration::from_secs(300));
        assert!(ok, "the pooled job failed:\n{err}");
        let sent = read(&full)[0].1["rollout/weight_values_sent"];
        assert_eq!(sent, all);
    }

    /// A run of `steps` in one process (`args(dir/single, 1)`) against an MPI job of `np`
    /// processes (`args(dir/pooled, value)`): the job ends with the single run's weights (1e-5)
    /// and every run metric within `tol`, for `what` (`start`: the starting actor). Returns the
    /// job's metrics by step.
    fn single_against_job(
        dir: &Path,
        args: &dyn Fn(&Path, usize) -> Vec<String>,
        (np, value): (usize, usize),
        (steps, tol): (usize, f64),
        (what, start): (&str, &super::CausalLm<super::B>),
    ) -> Vec<(usize, super::Metrics)> {
        let single = dir.join("single");
        let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(args(&single, 1))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let pooled = dir.join("pooled");
        let (ok, err) = wait_bounded(mpirun(np, &args(&pooled, value)), Duration::from_secs(300));
        assert!(ok, "{what}: the job failed:\n{err}");
        let last = format!("global_step_{steps}");
        assert_same_weights_from(&single.join(&last), &pooled.join(&last), what, start);
        pooled_metrics(&single, &pooled, steps, tol).1
    }

    /// Issue 58 item 3: a rollout pool of two MPI processes (`rollout.n_gpus_per_node=2`, the
    /// job trainer + 2), each generating half the prompts, trains as the in-process worker does,
    /// bit for bit; the in-process worker refuses two devices, naming the key.
    #[test]
    fn a_rollout_pool_of_two_processes_trains_as_the_in_process_worker() {
        let dir = temp_dir("dp-mpi-pool-two");
        let (model, data) = cli_assets(&dir);
        let start = super::tiny_models().0;
        let steps = 4;
        let args = |out: &Path, pool: usize| {
            let mut a = cli_args(&model, &data, out, steps);
            a.push("actor_rollout_ref.hybrid_engine=False".into());
            a.push(format!("rollout.n_gpus_per_node={pool}"));
            a
        };
        let what = "trainer + a rollout pool of 2 MPI processes vs the in-process worker";
        single_against_job(&dir, &args, (3, 2), (steps, 0.0), (what, &start));
        let output = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
            .args(args(&dir.join("thread"), 2))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && err.contains("rollout.n_gpus_per_node"),
            "{err}"
        );
    }

    /// Issue 58 item 3: a data-parallel trainer of two MPI processes beside a rollout pool of
    /// its own (the job trainer 2 + pool 1): the trainer's first process orders each generation
    /// from the pool over their own group and hands the samples to the other through the
    /// trainer's group; the run trains as one process with the in-process worker does. A job
    /// with too few processes for the trainer and the pool is refused, naming both counts, and
    /// a trainer of more hosts than its processes run on, naming `trainer.nnodes`.
    #[test]
    fn a_trainer_of_two_processes_beside_a_rollout_pool_trains_as_one_process() {
        let dir = temp_dir("dp-mpi-pool-trainers");
        let (model, data) = cli_assets(&dir);
        let start = super::tiny_models().0;
        let steps = 4;
        let args = |out: &Path, trainers: usize| {
            let mut a = cli_args(&model, &data, out, steps);
            a.push("actor_rollout_ref.hybrid_engine=False".into());
            a.push(format!("trainer.n_gpus_per_node={trainers}"));
            a
        };
        let what = "2 trainer processes + a rollout pool vs one process with the in-process worker";
        let b = single_against_job(&dir, &args, (3, 2), (steps, 1e-5), (what, &start));
        assert_eq!(b[1].1["rollout/staleness"], 1.0);
        // The pool generated (the trainer's first process sent it the weights).
        let sent = b[0].1.get("rollout/weight_values_sent").copied();
        assert!(sent.is_some_and(|v| v > 0.0), "weights sent: {sent:?}");
        let (ok, err) = wait_bounded(
            mpirun(2, &args(&dir.join("short"), 2)),
            Duration::from_secs(60),
        );
        assert!(
            !ok && err.contains("rollout.n_gpus_per_node") && err.contains("2 + 1"),
            "{err}"
        );
        // A trainer of two hosts, one process each, on this one host: refused, naming the key.
        let mut two_hosts = args(&dir.join("hosts"), 1);
        two_hosts.push("trainer.nnodes=2".into());
        let (ok, err) = wait_bounded(mpirun(3, &two_hosts), Duration::from_secs(60));
        assert!(
            !ok && err.contains("trainer.nnodes")
                && err.contains("run on 1 host(s), the config says 2"),
            "{err}"
        );
    }

    /// A tensor-parallel trainer of two MPI processes beside a rollout pool (trainer 2 + pool 1,
    /// the actor split over the two): the first process orders each generation with the actor
    /// made whole from both parts, and the run trains as one process whole.
    #[test]
    fn a_tensor_parallel_trainer_beside_a_rollout_pool_trains_as_one_process() {
        let dir = temp_dir("dp-mpi-pool-tp");
        let (model, data) = cli_assets(&dir);
        let start = super::tiny_models().0;
        let steps = 3;
        let args = |out: &Path, trainers: usize| {
            let mut a = cli_args(&model, &data, out, steps);
            a.push("actor_rollout_ref.hybrid_engine=False".into());
            a.push("actor_rollout_ref.actor.strategy=megatron".into());
            a.push(format!("trainer.n_gpus_per_node={trainers}"));
            a.push(format!(
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size={trainers}"
            ));
            a
        };
        let what = "a trainer split over 2 MPI processes + a rollout pool vs one process whole";
        let b = single_against_job(&dir, &args, (3, 2), (steps, 1e-5), (what, &start));
        let sent = b[0].1.get("rollout/weight_values_sent").copied();
        assert!(sent.is_some_and(|v| v > 0.0), "weights sent: {sent:?}");
    }

    #[test]
    fn a_killed_mpi_process_stops_the_job_naming_it() {
        let dir = temp_dir("dp-mpi-kill");
        let (model, data) = cli_assets(&dir);
        let out = dir.join("run");
        let mut args = cli_args(&model, &data, &out, 10_000);
        args.push("trainer.n_gpus_per_node=2".into());
        let job = mpirun(2, &args);
        // Kill rank 1 once the run is under way (rank 0 has logged a step).
        let log = out.join("metrics.jsonl");
        let start = Instant::now();
        while !std::fs::read_to_string(&log).is_ok_and(|s| s.lines().count() >= 1) {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "no step logged in 120 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let ranks = mpi_ranks(job.id());
        let (pid, _) = ranks
            .iter()
            .find(|(_, r)| *r == 1)
            .unwrap_or_else(|| panic!("no process of MPI rank 1 among {ranks:?}"));
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap();
        let killed = Instant::now();
        let (ok, err) = wait_bounded(job, Duration::from_secs(60));
        println!(
            "the job stopped {:?} after rank 1 was killed: {}",
            killed.elapsed(),
            err.lines().find(|l| l.contains("rank 1")).unwrap_or("")
        );
        assert!(!ok, "the job should fail when rank 1 dies");
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "the job did not stop within 60 s"
        );
        assert!(err.contains("rank 1"), "{err}");
    }

    #[test]
    fn processes_with_other_settings_are_refused_naming_them() {
        let dir = temp_dir("dp-mpi-settings");
        let (model, data) = cli_assets(&dir);
        let args = |lr: &str| {
            let mut a = cli_args(&model, &data, &dir.join("run"), STEPS);
            a.push("trainer.n_gpus_per_node=2".into());
            a.push(format!("actor_rollout_ref.actor.optim.lr={lr}"));
            a
        };
        // MPMD: process 0 and process 1 get different learning rates.
        let job = Command::new("mpirun")
            .args([
                "--oversubscribe",
                "-np",
                "1",
                env!("CARGO_BIN_EXE_burn-rlhf"),
            ])
            .args(args("0.001"))
            .args([":", "-np", "1", env!("CARGO_BIN_EXE_burn-rlhf")])
            .args(args("0.002"))
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (ok, err) = wait_bounded(job, Duration::from_secs(120));
        assert!(!ok);
        assert!(
            err.contains("processes 1 run with other settings than process 0"),
            "{err}"
        );
    }
}

/// A conversation loop for the arithmetic task: after the model's first turn, a user turn of
/// `=<answer>` is appended and the model answers again.
pub(super) struct Hint(pub(super) burn_rlhf::models::Tokenizer);

struct HintConversation {
    hint: Vec<u32>,
    given: bool,
    stats: ConversationStats,
}

impl AgentLoop for Hint {
    fn name(&self) -> &str {
        "hint"
    }
    fn prompt_ids(&self, record: &PromptRecord) -> Result<Vec<u32>, RolloutError> {
        encode_prompt(&self.0, record)
    }
    fn start(&self, record: &PromptRecord) -> Result<Box<dyn Conversation>, RolloutError> {
        Ok(Box::new(HintConversation {
            hint: self.0.encode(&format!("={}", record.ground_truth), false)?,
            given: false,
            stats: ConversationStats::default(),
        }))
    }
}

impl Conversation for HintConversation {
    fn after_model_turn(
        &mut self,
        _: &[u32],
        _: FinishReason,
        _: usize,
    ) -> Result<Next, RolloutError> {
        if std::mem::replace(&mut self.given, true) {
            return Ok(Next::End);
        }
        Ok(Next::Continue {
            tokens: self.hint.clone(),
            role: TurnRole::User,
        })
    }
    fn stats(&self) -> &ConversationStats {
        &self.stats
    }
}

/// Multi-turn conversations (a registered loop) split across two devices give the one device's
/// weights and metrics, `num_turns` included.
#[test]
fn conversations_on_two_devices_reproduce_one_device() {
    let _turn = ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("dp-conversations");
    let multi_turn = |dir: &Path| {
        let mut c = config(dir);
        c.data.max_response_length = 10;
        c.actor_rollout_ref.rollout.agent.default_agent_loop = "hint".into();
        c
    };
    let with_hint = || {
        let mut p = parts(Arc::new(tasks::ExactAnswer));
        p.agent_loops.push(Arc::new(Hint(tasks::tokenizer())));
        p
    };
    let one = dir.join("single");
    let mut single_config = multi_turn(&one);
    single_config.trainer.rollout_data_dir = Some(one.join("rollouts").display().to_string());
    let mut l = Learner::new(single_config, with_hint(), &Default::default()).unwrap();
    let single = l.fit(stop_flag()).unwrap().checkpoint.unwrap();
    let dp = n_devices_of(multi_turn(&dir.join("dp")), with_hint(), 2).unwrap();
    assert_same_weights(&single, &dp, "conversations: 2 devices vs 1");
    assert_same_metrics(&single, &dp, "conversations: 2 devices vs 1");
    let metrics = read_jsonl(&single.parent().unwrap().join("metrics.jsonl")).unwrap();
    assert!(
        metrics.iter().all(|(_, m)| m["num_turns/max"] == 4.0),
        "every step had a conversation of prompt, model, user, model"
    );
    // The dumps show each turn: the model's, the hint, the model's.
    let dump = std::fs::read_to_string(one.join("rollouts/1.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = dump
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = rows
        .iter()
        .find(|r| r.get("turns").is_some())
        .expect("a conversation's turns");
    let turns = row["turns"].as_array().unwrap();
    let roles: Vec<&str> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["assistant", "user", "assistant"]);
    assert!(turns[1]["content"].as_str().unwrap().starts_with('='));
    // The engine prefilled each prompt once (its 2 samples share it) and each appended turn with
    // the token sampled before it: never a conversation's history again. One character is one
    // token here.
    let chars = |v: &serde_json::Value| v.as_str().unwrap().chars().count() as f64;
    let prompts: f64 = rows.iter().step_by(2).map(|r| chars(&r["input"])).sum();
    let user_turns: Vec<&serde_json::Value> = rows
        .iter()
        .filter_map(|r| r.get("turns"))
        .flat_map(|t| t.as_array().unwrap())
        .filter(|t| t["role"] == "user")
        .collect();
    let appended: f64 = user_turns.iter().map(|t| chars(&t["content"])).sum();
    assert_eq!(metrics[0].1["rollout/appended_tokens"], appended);
    assert_eq!(
        metrics[0].1["rollout/prefill_tokens"],
        prompts + appended + user_turns.len() as f64
    );
}
