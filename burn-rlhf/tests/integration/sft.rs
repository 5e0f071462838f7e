//! The SFT recipe: `burn-rlhf sft` with verl's SFT keys on a tiny model. Its loss counts response
//! tokens only, it decreases over 20 steps, and its checkpoint starts a PPO run.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf::minibatch::{sft_loss, SftPasses};
use burn_rlhf::models::pretrained::{load_pretrained, save_pretrained};
use burn_rlhf::models::CausalLm;
use burn_rlhf::rollout::data::{write_parquet, TextPair};
use burn_rlhf::rollout::Truncation;
use burn_rlhf::tasks;
use burn_rlhf::trainer::logger::read_jsonl;
use burn_rlhf::trainer::sft::{encode_pair, sft_rollout_batch};
use burn_rlhf_test_assets::temp_dir;

type B = Flex;

/// A tiny random model and the arithmetic task as `{question, answer}` jsonl.
fn assets(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let c = tasks::model_config(32, 1);
    let model: CausalLm<Autodiff<B>> =
        super::seeded_model(3, || c.init_causal_lm(&Default::default()));
    let path = dir.join("model");
    save_pretrained(
        &path,
        &c,
        &model.valid().export(),
        None,
        Some(&tasks::tokenizer()),
    )
    .unwrap();
    let (train, test) = tasks::split_problems(40, 16, 3);
    let write = |name: &str, records: &[burn_rlhf::rollout::PromptRecord]| {
        let file = dir.join(name);
        let lines: Vec<String> = records
            .iter()
            .map(|r| {
                serde_json::json!({"question": r.prompt[0].content, "answer": r.ground_truth})
                    .to_string()
            })
            .collect();
        std::fs::write(&file, lines.join("\n")).unwrap();
        file
    };
    (
        path,
        write("train.jsonl", &train),
        write("test.jsonl", &test),
    )
}

#[test]
fn loss_counts_only_response_tokens() {
    let dir = temp_dir("sft-loss");
    let (model_dir, _, _) = assets(&dir);
    let pre = load_pretrained(&model_dir.display().to_string()).unwrap();
    let model: CausalLm<B> = pre.causal_lm(&Default::default()).unwrap();
    let t = tasks::tokenizer();
    let example = encode_pair(
        &t,
        &TextPair {
            prompt: "37+48=".into(),
            response: "85".into(),
        },
        32,
        Truncation::Error,
    )
    .unwrap();
    let batch = sft_rollout_batch(&[&example], t.pad_token_id);
    let loss = sft_loss(
        &model,
        &batch,
        SftPasses::padded(1, 512),
        &Default::default(),
    );
    // Padding-free: the same loss.
    let passes = SftPasses {
        remove_padding: true,
        ..SftPasses::padded(1, 512)
    };
    let packed = sft_loss(&model, &batch, passes, &Default::default());
    assert!((packed - loss).abs() < 1e-6, "packed {packed} vs {loss}");
    // By hand: log-softmax over the whole sequence, then the next-token log-prob at every place.
    let ids: Vec<i64> = example
        .prompt
        .iter()
        .chain(&example.response)
        .map(|&x| x as i64)
        .collect();
    let l = ids.len();
    let int = |v: Vec<i64>| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [1, l]), &Default::default())
    };
    let logits = model.forward(
        int(ids.clone()),
        int(vec![1; l]),
        int((0..l as i64).collect()),
        None,
    );
    let logp: Vec<f32> = log_softmax(logits, 2).into_data().to_vec().unwrap();
    let v = logp.len() / l;
    let next = |t: usize| -(logp[(t - 1) * v + ids[t] as usize] as f64);
    let p = example.prompt.len();
    let response_nll = (p..l).map(next).sum::<f64>() / (l - p) as f64;
    let all_nll = (1..l).map(next).sum::<f64>() / (l - 1) as f64;
    assert!(
        (loss - response_nll).abs() < 1e-4,
        "{loss} vs {response_nll}"
    );
    assert!(
        (loss - all_nll).abs() > 1e-3,
        "the prompt tokens must not count"
    );
}

fn ron_list(p: &Path) -> String {
    format!("[\"{}\"]", p.display())
}

#[test]
fn sft_command_lowers_the_loss_and_its_checkpoint_starts_ppo() {
    let dir = temp_dir("sft-run");
    assets(&dir);
    let out = dir.join("out");
    sft_cli(
        &dir,
        &out,
        20,
        &["optim.warmup_steps_ratio=0", "trainer.test_freq=10"],
    );
    let log = read_jsonl(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(log.len(), 20);
    let loss = |s: usize| log[s - 1].1["train/loss"];
    let first = (loss(1) + loss(2)) / 2.0;
    let last = (loss(19) + loss(20)) / 2.0;
    println!(
        "train/loss {first:.3} -> {last:.3}; val/loss {:.3} -> {:.3}",
        log[9].1["val/loss"], log[19].1["val/loss"]
    );
    assert!(last < first * 0.8, "loss {first} -> {last}");
    assert!(log[19].1["val/loss"] < log[9].1["val/loss"] + 1.0);

    // The checkpoint is an HF folder a PPO run starts from.
    let ckpt = out.join("global_step_20");
    let records = tasks::split_problems(40, 16, 3).0;
    let data = dir.join("train.parquet");
    write_parquet(&data, &records).unwrap();
    let ppo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/ppo_gsm8k.ron");
    let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg("train")
        .arg(&ppo)
        .args([
            format!("actor_rollout_ref.model.path={}", ckpt.display()),
            format!("critic.model.path={}", ckpt.display()),
            format!("data.train_files={}", ron_list(&data)),
            "data.max_prompt_length=8".into(),
            "data.max_response_length=4".into(),
            "data.train_batch_size=4".into(),
            "actor_rollout_ref.actor.ppo_mini_batch_size=4".into(),
            "custom_reward_function.name=arithmetic".into(),
            "trainer.total_training_steps=1".into(),
            "trainer.test_freq=-1".into(),
            "trainer.val_before_train=false".into(),
            "trainer.logger=[jsonl]".into(),
            format!("trainer.default_local_dir={}", dir.join("ppo").display()),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(dir
        .join("ppo/global_step_1/actor/model.safetensors")
        .exists());
}

/// `burn-rlhf sft` on the tiny assets of `dir` for `steps` steps into `out`, with `extra`
/// overrides.
fn sft_cli(dir: &Path, out: &Path, steps: usize, extra: &[&str]) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sft_gsm8k.ron");
    let status = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg("sft")
        .arg(&config)
        .args(sft_overrides(dir, out, steps))
        .args(extra)
        .status()
        .unwrap();
    assert!(status.success(), "sft {steps} steps into {}", out.display());
}

/// The overrides of [`sft_cli`]'s runs: `dir`'s model and problems, batches of 8 in micro-batches
/// of 3, `steps` steps validated every 2, into `out`.
fn sft_overrides(dir: &Path, out: &Path, steps: usize) -> Vec<String> {
    vec![
        format!("model.partial_pretrain={}", dir.join("model").display()),
        format!("data.train_files={}", ron_list(&dir.join("train.jsonl"))),
        format!("data.val_files={}", ron_list(&dir.join("test.jsonl"))),
        "data.max_length=16".into(),
        "data.train_batch_size=8".into(),
        "data.micro_batch_size_per_gpu=3".into(),
        "optim.lr=0.003".into(),
        "optim.lr_scheduler=constant".into(),
        format!("trainer.total_training_steps={steps}"),
        "trainer.test_freq=2".into(),
        "trainer.logger=[jsonl]".into(),
        format!("trainer.default_local_dir={}", out.display()),
    ]
}

/// [`sft_cli`]'s run in this process (`burn_rlhf::trainer::sft::sft`), for what the returning
/// rank held.
fn sft_here(
    dir: &Path,
    out: &Path,
    steps: usize,
    extra: &[&str],
) -> burn_rlhf::trainer::supervised::SupervisedOutputs {
    static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    // Ranks of this process share the one in-process collective group with the other tests'.
    let _turn = super::data_parallel::ONE_GROUP_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sft_gsm8k.ron");
    let mut overrides = sft_overrides(dir, out, steps);
    overrides.extend(extra.iter().map(|e| e.to_string()));
    let config = burn_rlhf::config::SftConfig::load(&config, &overrides).unwrap();
    burn_rlhf::trainer::sft::sft(&config, &STOP).unwrap()
}

/// `engine.strategy: fsdp` (verl's default) shards the parameters, gradients and AdamW state
/// over the ranks: 2 ranks, 3 ranks with unequal micro-batch counts (the ranks' gathers kept in
/// lockstep) and 4 ranks in hybrid groups of 2 end where one device does, each rank holding
/// 1/N of the parameter and AdamW bytes; `megatron` keeps them whole; `engine.model_dtype=bf16`
/// halves them again. A checkpoint of the sharded run resumes on one device.
#[test]
fn sft_sharded_over_ranks_reproduces_one_device() {
    let dir = temp_dir("sft-fsdp");
    let (model_dir, _, _) = assets(&dir);
    let one = sft_here(&dir, &dir.join("one"), 4, &[]);
    let (params, state) = (one.memory.parameters, one.memory.optimizer.device);
    assert!(params > 0 && state == 2 * params, "{:?}", one.memory);
    let cases: [(&str, &[&str], usize); 4] = [
        ("two", &["trainer.n_gpus_per_node=2"], 2),
        (
            "three",
            &[
                "trainer.n_gpus_per_node=3",
                "data.micro_batch_size_per_gpu=2",
            ],
            3,
        ),
        (
            "hybrid",
            &["trainer.n_gpus_per_node=4", "engine.fsdp_size=2"],
            2,
        ),
        (
            "whole",
            &["trainer.n_gpus_per_node=2", "engine.strategy=megatron"],
            1,
        ),
    ];
    for (name, extra, share) in cases {
        let run = sft_here(&dir, &dir.join(name), 4, extra);
        super::assert_same_runs(
            &dir.join("one"),
            &dir.join(name),
            4,
            "model.safetensors",
            &model_dir,
            1e-5,
        );
        // Chunks are rounded up to whole elements per parameter: within a few per tensor.
        let slack = 64 * 4 * 8;
        let held = run.memory.parameters;
        eprintln!(
            "{name}: rank 0 holds {held} of {params} parameter bytes, {} of {state} AdamW bytes",
            run.memory.optimizer.device
        );
        assert!(
            held.abs_diff(params / share) <= slack,
            "{name}: {held} of {params} bytes, 1/{share} expected"
        );
        let moments = run.memory.optimizer.device;
        assert!(
            moments.abs_diff(state / share) <= 2 * slack,
            "{name}: {moments} of {state} AdamW bytes, 1/{share} expected"
        );
    }
    // `engine.model_dtype=bf16`: weights and AdamW moments in bf16 (half the bytes), the loss
    // still falling as the f32 run's does.
    let half = sft_here(
        &dir,
        &dir.join("bf16"),
        4,
        &["engine.model_dtype=bf16", "trainer.n_gpus_per_node=2"],
    );
    assert_eq!(4 * half.memory.parameters, params, "{:?}", half.memory);
    assert_eq!(4 * half.memory.optimizer.device, state, "{:?}", half.memory);
    let losses = |name: &str| -> Vec<f64> {
        read_jsonl(&dir.join(name).join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .filter_map(|(_, m)| m.get("train/loss").copied())
            .collect()
    };
    let (full, bf16) = (losses("one"), losses("bf16"));
    println!("train/loss per step: f32 {full:?}, bf16 {bf16:?}");
    assert!(bf16.last() < bf16.first(), "{bf16:?}");
    for (a, b) in full.iter().zip(&bf16) {
        assert!((a - b).abs() < 0.05 * a.abs(), "{full:?} against {bf16:?}");
    }
    let resumed = dir.join("resumed");
    sft_here(&dir, &resumed, 2, &["trainer.n_gpus_per_node=2"]);
    sft_here(&dir, &resumed, 4, &[]);
    super::assert_same_runs(
        &dir.join("one"),
        &resumed,
        4,
        "model.safetensors",
        &model_dir,
        1e-5,
    );
}

/// verl 0.9.1's messages layout: the same problems as `{messages: [user, assistant]}` rows
/// through a chat template that renders them as the pairs are encoded (the prompt's text, the
/// answer and EOS) train exactly as the pairs do, in micro-batches of rows; in micro-batches of
/// at most 24 tokens (`use_dynamic_bsz`) to within rounding; the newest two checkpoints are kept
/// (`trainer.max_ckpt_to_keep`).
#[test]
fn sft_on_messages_trains_as_on_pairs() {
    let dir = temp_dir("sft-messages");
    let (model_dir, _, _) = assets(&dir);
    // The same weights with a chat template.
    let chat_model = dir.join("chat-model");
    std::fs::create_dir_all(&chat_model).unwrap();
    for entry in std::fs::read_dir(&model_dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, chat_model.join(path.file_name().unwrap())).unwrap();
    }
    std::fs::write(
        chat_model.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}<eos>{% endif %}{% endfor %}",
    )
    .unwrap();
    for name in ["train", "test"] {
        let pairs = std::fs::read_to_string(dir.join(format!("{name}.jsonl"))).unwrap();
        let rows: Vec<String> = pairs
            .lines()
            .map(|line| {
                let pair: serde_json::Value = serde_json::from_str(line).unwrap();
                serde_json::json!({"messages": [
                    {"role": "user", "content": pair["question"]},
                    {"role": "assistant", "content": pair["answer"]},
                ]})
                .to_string()
            })
            .collect();
        std::fs::write(dir.join(format!("{name}-messages.jsonl")), rows.join("\n")).unwrap();
    }
    let messages = |extra: &[&str]| {
        let mut args = vec![
            format!("model.path={}", chat_model.display()),
            format!(
                "data.train_files={}",
                ron_list(&dir.join("train-messages.jsonl"))
            ),
            format!(
                "data.val_files={}",
                ron_list(&dir.join("test-messages.jsonl"))
            ),
            "data.prompt_key=null".into(),
            "data.response_key=null".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let (pairs, rows, budget) = (dir.join("pairs"), dir.join("rows"), dir.join("budget"));
    sft_cli(&dir, &pairs, 4, &[]);
    let args = messages(&["trainer.max_ckpt_to_keep=2", "trainer.save_freq=1"]);
    sft_cli(
        &dir,
        &rows,
        4,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    super::assert_same_runs(&pairs, &rows, 4, "model.safetensors", &model_dir, 0.0);
    let kept: Vec<bool> = (1..=4)
        .map(|s| rows.join(format!("global_step_{s}")).is_dir())
        .collect();
    assert_eq!(
        kept,
        [false, false, true, true],
        "the newest two checkpoints"
    );
    let args = messages(&["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=24"]);
    sft_cli(
        &dir,
        &budget,
        4,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    super::assert_same_runs(&pairs, &budget, 4, "model.safetensors", &model_dir, 1e-5);
}

/// `burn-rlhf sft` stopped after 3 steps and run again to 6 (a new process, `resume_mode=auto`)
/// ends with the weights and metrics of 6 uninterrupted steps.
#[test]
fn sft_resumes_in_a_new_process_as_if_never_stopped() {
    let dir = temp_dir("sft-resume");
    let (model_dir, _, _) = assets(&dir);
    let (straight, resumed) = (dir.join("straight"), dir.join("resumed"));
    sft_cli(&dir, &straight, 6, &[]);
    sft_cli(&dir, &resumed, 3, &[]);
    sft_cli(&dir, &resumed, 6, &[]);
    super::assert_same_runs(
        &straight,
        &resumed,
        6,
        "model.safetensors",
        &model_dir,
        1e-6,
    );
}

/// `burn-rlhf sft` on two devices (each rank half of every batch, gradients averaged through the
/// collectives RL uses) ends where one device does, with the same metrics.
#[test]
fn sft_on_two_devices_reproduces_one() {
    let dir = temp_dir("sft-dp");
    let (model_dir, _, _) = assets(&dir);
    let (one, two) = (dir.join("one"), dir.join("two"));
    sft_cli(&dir, &one, 4, &[]);
    sft_cli(&dir, &two, 4, &["trainer.n_gpus_per_node=2"]);
    super::assert_same_runs(&one, &two, 4, "model.safetensors", &model_dir, 1e-5);
    // Two ranks really split the batch: one row cannot be shared by two.
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sft_gsm8k.ron");
    let out = Command::new(env!("CARGO_BIN_EXE_burn-rlhf"))
        .arg("sft")
        .arg(&config)
        .args([
            format!("model.partial_pretrain={}", model_dir.display()),
            format!("data.train_files={}", ron_list(&dir.join("train.jsonl"))),
            "data.val_files=[]".into(),
            "data.max_length=16".into(),
            "data.train_batch_size=1".into(),
            "trainer.n_gpus_per_node=2".into(),
            "trainer.total_training_steps=1".into(),
            format!(
                "trainer.default_local_dir={}",
                dir.join("one-row").display()
            ),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot be split over 2 ranks"),
        "{err}"
    );
}
