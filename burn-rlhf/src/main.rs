//! The `burn-rlhf` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use burn_rlhf::config::{config_kind, config_to_ron, load_config, ConfigKind};
use clap::{Parser, Subcommand};

#[global_allocator]
static GLOBAL: burn_rlhf::runtime::MiMalloc = burn_rlhf::runtime::MiMalloc;

/// RL post-training for LLMs (PPO, GRPO, DAPO, ...) on Burn, with verl's config keys.
///
/// Configs are RON files with verl's key names (see `configs/`). Any key can be overridden after the
/// file, in verl's style: `algorithm.adv_estimator=grpo data.train_batch_size=8
/// trainer.logger=[console]`. A bare word is a string where the key holds a string.
#[derive(Parser, Debug)]
#[command(name = "burn-rlhf", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Inspect and check configuration files.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Generate text from a model, streaming tokens to the terminal.
    ///
    /// Example: `burn-rlhf generate --model ../shared/models/smollm2-135m-instruct --prompt "The
    /// capital of France is" --max-new-tokens 8 --greedy`
    Generate(GenerateArgs),
    /// Train with a config (PPO, GRPO, RLOO, ... by `algorithm.adv_estimator`).
    ///
    /// Ctrl-C finishes the current step, saves a checkpoint and exits; `trainer.resume_mode=auto`
    /// (the default) continues from the newest checkpoint in `trainer.default_local_dir`.
    ///
    /// Example: `burn-rlhf train configs/ppo_gsm8k.ron data.train_batch_size=8`
    ///
    /// Several devices: `trainer.n_gpus_per_node=N`. Several processes or hosts (a build with
    /// `--features mpi`): `mpirun -np P burn-rlhf train ...` or `srun`, with
    /// `trainer.nnodes` hosts of `trainer.n_gpus_per_node` devices (see README).
    Train {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
    },
    /// Supervised fine-tuning with verl's SFT trainer keys (`data.prompt_key`, `response_key`,
    /// `max_length`, `truncation`, `micro_batch_size_per_gpu`, `model.partial_pretrain`, `optim.*`,
    /// `trainer.total_epochs`): loss on response tokens only; checkpoints are HF folders that start
    /// a PPO run.
    ///
    /// Example: `burn-rlhf sft configs/sft_gsm8k.ron data.train_batch_size=8`
    Sft {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
    },
    /// Train a reward model on preference pairs (TRL's `RewardTrainer`): an HF
    /// `*ForSequenceClassification` model with one label, started from a reward model or from a
    /// causal LM (a new score head), the Bradley-Terry loss (`loss.center_rewards_coefficient`,
    /// the data's margins), accuracy and margin on `data.val_files`; checkpoints are HF folders
    /// that `reward_model.model.path` of a PPO run reads, and transformers loads as
    /// `AutoModelForSequenceClassification`. Keys as `sft`'s, plus `data.chosen_key`,
    /// `rejected_key`, `margin_key` and `loss.*`.
    ///
    /// Example: `burn-rlhf rm configs/rm_arithmetic.ron trainer.total_training_steps=50`
    Rm {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
    },
    /// Validation only: generate for `data.val_files` with `rollout.val_kwargs` and print
    /// mean@n, best@n, worst@n, maj@n and pass@k per data source.
    ///
    /// Example: `burn-rlhf eval configs/ppo_gsm8k.ron
    /// actor_rollout_ref.model.path=checkpoints/x/global_step_10/actor
    /// actor_rollout_ref.rollout.val_kwargs.n=4 actor_rollout_ref.rollout.val_kwargs.do_sample=true
    /// actor_rollout_ref.rollout.val_kwargs.temperature=1.0`
    Eval {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
    },
    /// Prepare datasets in verl's parquet layout.
    #[command(subcommand)]
    Data(DataCommand),
    /// Convert models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmark a config's actor on the selected backend: generation and forward+backward
    /// tokens/s (cold and warm) and the phase times of its first PPO steps, as JSON lines
    /// comparable with `../shared/gpu/torch_peer_gpu.py` on the same model. With `--peer`, TRL
    /// then runs the same steps (model folder, GSM8K jsonl, sizes) and a table of both follows.
    ///
    /// Example: `burn-rlhf bench configs/ppo_gsm8k.ron actor_rollout_ref.model.path=/tmp/qwen05`
    ///
    /// Side by side with TRL: `burn-rlhf bench configs/grpo_gsm8k.ron ... --generate 0 0 0
    /// --fwd-bwd 0 0 --steps 3 --peer benches/peers/trl_grpo.py`
    Bench {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
        /// Generation: prompts, prompt tokens, new tokens.
        #[arg(long, num_args = 3, default_values_t = [64, 128, 256])]
        generate: Vec<usize>,
        /// Forward and backward: sequences, tokens each.
        #[arg(long, num_args = 2, default_values_t = [8, 384])]
        fwd_bwd: Vec<usize>,
        /// PPO steps of the config to time.
        #[arg(long, default_value_t = 2)]
        steps: usize,
        /// A peer script to run the same steps after ours (`benches/peers/trl_grpo.py`).
        #[arg(long)]
        peer: Option<PathBuf>,
        /// The Python that runs the peer (its venv: `benches/peers/setup.sh`).
        #[arg(
            long,
            env = "RLHF_PEER_PYTHON",
            default_value = "/tmp/peer-venv/bin/python"
        )]
        peer_python: PathBuf,
        /// Rollout cases: the config's first PROMPTS training prompts, N samples each, up to
        /// TOKENS new ones, ending at EOS (`longtail`) and running to TOKENS (`uniform`); 0 0 0:
        /// none. Example: `--rollout 64 4 512`.
        #[arg(long, num_args = 3, default_values_t = [0, 0, 0], value_names = ["PROMPTS", "N", "TOKENS"])]
        rollout: Vec<usize>,
        /// `max_num_seqs` of the rollout runs (0: the config's).
        #[arg(long, num_args = 1.., default_values_t = [32, 0])]
        rollout_slots: Vec<usize>,
        /// Which rollout cases run.
        #[arg(long, num_args = 1.., default_values = ["longtail", "uniform"],
              value_parser = ["longtail", "uniform"])]
        rollout_cases: Vec<String>,
        /// HF transformers' side of the rollout cases (`benches/peers/hf_generate.py`).
        #[arg(long)]
        rollout_peer: Option<PathBuf>,
    },
    /// Time the decoder's matrix products on Qwen2.5-0.5B's shapes (the MLP's 896 → 4864 and the
    /// LM head's 896 → 151936 over `--rows` tokens: the forward product and the backward's two),
    /// on every engine this build has (CUDA: CubeCL's matmul, cuBLASLt in f32 and TF32), cold and
    /// warm: JSON lines comparable with `benches/peers/products.py` on the same GPU.
    ///
    /// Example: `burn-rlhf bench-products --rows 3072 --dtypes f32 bf16`
    BenchProducts {
        /// Tokens per product (the rows of `x`).
        #[arg(long, default_value_t = 3072)]
        rows: usize,
        /// Warm repetitions (their median is reported).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// The dtypes to multiply in.
        #[arg(long, num_args = 1.., default_values = ["f32", "bf16"], value_parser = ["f32", "bf16", "f16"])]
        dtypes: Vec<String>,
    },
    /// Time the collectives the trainer uses (all-reduce, all-gather, reduce-scatter, broadcast)
    /// on this launch's transport, 4 KiB up to `--max-mib`: JSON lines with nccl-tests' algorithm
    /// and bus bandwidths. With `--peer`, torch.distributed (gloo) runs the same operations over
    /// as many processes and a table of both follows.
    ///
    /// Example: `burn-rlhf bench-collectives --devices 2 --peer benches/peers/collectives.py`;
    /// processes (a build with `--features mpi`): `mpirun -np 2 --bind-to none burn-rlhf
    /// bench-collectives --devices 2`
    BenchCollectives {
        /// Hosts of the job (`trainer.nnodes`).
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// Devices per host (`trainer.n_gpus_per_node`): this process's ranks, or shared by the
        /// host's MPI processes.
        #[arg(long, default_value_t = 2)]
        devices: usize,
        /// The largest buffer, MiB.
        #[arg(long, default_value_t = 64)]
        max_mib: usize,
        /// How the ranks exchange (`trainer.collective_backend`): auto, nccl or host.
        #[arg(long, default_value = "auto")]
        transport: String,
        /// Every rank of this process on its first device (what NCCL does with two ranks on one
        /// GPU).
        #[arg(long)]
        same_device: bool,
        /// The peer script (`benches/peers/collectives.py`).
        #[arg(long)]
        peer: Option<PathBuf>,
        /// The Python that runs the peer (its venv: `benches/peers/setup.sh`).
        #[arg(
            long,
            env = "RLHF_PEER_PYTHON",
            default_value = "/tmp/peer-venv/bin/python"
        )]
        peer_python: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct GenerateArgs {
    /// A local HF folder, a .gguf file, or a hub id (`Qwen/Qwen2.5-0.5B-Instruct`).
    #[arg(long)]
    model: String,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Greedy decoding (overrides --temperature).
    #[arg(long)]
    greedy: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Keep only the k most likely tokens (-1: off).
    #[arg(long, default_value_t = -1)]
    top_k: i64,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// RNG seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// GSM8K to verl's parquet (`data_source`, `prompt`, `ability`, `reward_model`, `extra_info`),
    /// with verl's prompt: the question, a space, then its instruction.
    ///
    /// Example: `burn-rlhf data gsm8k --input ../shared/data/gsm8k --output /tmp/gsm8k`
    Gsm8k {
        /// A folder with train.jsonl and test.jsonl (OpenAI's layout), or the hub id `openai/gsm8k`.
        #[arg(long)]
        input: String,
        /// Output folder for train.parquet and test.parquet.
        #[arg(long)]
        output: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Write a model as an f32 HF folder (`model.safetensors`, `config.json`, tokenizer and chat
    /// template) that transformers and burn-rlhf both load: a GGUF file dequantized once, so a
    /// benchmark's peers start from identical weights.
    ///
    /// Example: `burn-rlhf model export --model ../shared/models/smollm2-135m-instruct --out
    /// /tmp/smollm2-f32`
    Export {
        /// A local HF folder, a .gguf file, or a hub id.
        #[arg(long)]
        model: String,
        /// The folder to write.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum ConfigCommand {
    /// Print the fully resolved config tree (file + overrides + verl's defaults) as RON.
    ///
    /// Example: `burn-rlhf config show configs/ppo_gsm8k.ron data.train_batch_size=8`
    Show {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
    },
    /// Check a config: unknown keys, types, names and cross-field rules. Exits non-zero on the
    /// first file with a problem, listing every rule it breaks.
    ///
    /// Example: `burn-rlhf config validate configs/ppo_gsm8k.ron algorithm.adv_estimator=grpo`
    Validate {
        /// The RON config file.
        config: PathBuf,
        /// `key.path=value` overrides, applied in order after the file.
        overrides: Vec<String>,
    },
}

use burn_rlhf::trainer::commands::{checked_config, config_origin as origin};

fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    use std::io::Write;

    use burn_rlhf::models::{load_pretrained, ChatMessage};
    use burn_rlhf::rollout::SamplingParams;

    let pretrained = load_pretrained(&args.model)?;
    let tokenizer = pretrained.tokenizer.clone().ok_or_else(|| {
        anyhow::anyhow!(
            "{}: the model has no tokenizer (tokenizer.json or GGUF metadata)",
            args.model
        )
    })?;
    let prompt = if args.chat {
        tokenizer.encode_chat(&[ChatMessage::user(&args.prompt)], true)?
    } else {
        tokenizer.encode(&args.prompt, true)?
    };
    let params = SamplingParams {
        greedy: args.greedy,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: (args.top_k > 0).then_some(args.top_k as usize),
        max_new_tokens: args.max_new_tokens,
        stop_token_ids: tokenizer.eos_token_ids.clone(),
        seed: args.seed,
        ..Default::default()
    };
    print!("{}", args.prompt);
    std::io::stdout().flush()?;
    let mut tokens = Vec::new();
    let mut printed = 0;
    burn_rlhf::trainer::commands::generate(pretrained, prompt, &params, &mut |t| {
        tokens.push(t);
        // Decode everything so far and print the new suffix: a character may span tokens.
        if let Ok(text) = tokenizer.decode(&tokens, true) {
            if text.len() > printed && text.is_char_boundary(printed) {
                print!("{}", &text[printed..]);
                let _ = std::io::stdout().flush();
                printed = text.len();
            }
        }
    })?;
    println!();
    Ok(())
}

fn run_model_export(model: &str, out: &std::path::Path) -> anyhow::Result<()> {
    let pretrained = burn_rlhf::models::load_pretrained(model)?;
    burn_rlhf::trainer::commands::export_f32(pretrained, out)?;
    println!("{}: {} as f32", out.display(), model);
    Ok(())
}

fn run_data_gsm8k(input: &str, output: &std::path::Path) -> anyhow::Result<()> {
    use burn_rlhf::datasets::load_data_file;
    use burn_rlhf::rollout::data::write_parquet;

    let dir = std::path::Path::new(input);
    for split in ["train", "test"] {
        let records = if dir.is_dir() {
            load_data_file(
                &dir.join(format!("{split}.jsonl")).display().to_string(),
                ("prompt", "data_source"),
                split,
            )?
        } else {
            load_data_file(
                &format!("{input}:{split}"),
                ("prompt", "data_source"),
                split,
            )?
        };
        let path = output.join(format!("{split}.parquet"));
        write_parquet(&path, &records)?;
        println!("{}: {} rows", path.display(), records.len());
    }
    Ok(())
}

/// Where a run left its outputs.
fn report(out: &burn_rlhf::trainer::RunOutputs) {
    for (what, path) in [("metrics", &out.jsonl), ("plot", &out.plot)] {
        if let Some(p) = path {
            println!("{what}: {}", p.display());
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => run_generate(args)?,
        Command::Train { config, overrides } => {
            let settings = checked_config(&config, &overrides)?;
            let out = burn_rlhf::trainer::commands::train(settings)?;
            report(&out);
        }
        Command::Sft { config, overrides } => {
            use burn_rlhf::config::SftConfig;
            let cfg = SftConfig::load(&config, &overrides)?;
            cfg.validate(&config.display().to_string())?;
            let stop = burn_rlhf::trainer::stop_on_ctrl_c();
            report_supervised(&burn_rlhf::trainer::sft::sft(&cfg, stop)?);
        }
        Command::Rm { config, overrides } => {
            use burn_rlhf::config::RmConfig;
            let cfg = RmConfig::load(&config, &overrides)?;
            cfg.validate(&config.display().to_string())?;
            let stop = burn_rlhf::trainer::stop_on_ctrl_c();
            report_supervised(&burn_rlhf::trainer::rm::rm(&cfg, stop)?);
        }
        Command::Eval { config, overrides } => {
            let metrics = burn_rlhf::trainer::commands::eval(checked_config(&config, &overrides)?)?;
            println!("{}", burn_rlhf::trainer::logger::table(0, &metrics));
        }
        Command::Data(DataCommand::Gsm8k { input, output }) => run_data_gsm8k(&input, &output)?,
        Command::Model(ModelCommand::Export { model, out }) => run_model_export(&model, &out)?,
        Command::Bench {
            config,
            overrides,
            generate,
            fwd_bwd,
            steps,
            peer,
            peer_python,
            rollout,
            rollout_slots,
            rollout_cases,
            rollout_peer,
        } => {
            let rollout = (rollout[0] > 0).then(|| burn_rlhf::bench::RolloutBench {
                size: (rollout[0], rollout[1].max(1), rollout[2].max(1)),
                slots: rollout_slots,
                cases: rollout_cases
                    .iter()
                    .map(|c| match c.as_str() {
                        "longtail" => burn_rlhf::bench::RolloutCase::LongTail,
                        _ => burn_rlhf::bench::RolloutCase::Uniform,
                    })
                    .collect(),
                peer: rollout_peer.map(|script| burn_rlhf::bench::Peer {
                    python: peer_python.clone(),
                    script,
                }),
            });
            let options = burn_rlhf::bench::BenchOptions {
                gen: (generate[0], generate[1], generate[2]),
                fwd_bwd: (fwd_bwd[0], fwd_bwd[1]),
                steps,
                peer: peer.map(|script| burn_rlhf::bench::Peer {
                    python: peer_python,
                    script,
                }),
                rollout,
            };
            burn_rlhf::bench::run_bench_selected(checked_config(&config, &overrides)?, &options)?;
        }
        Command::BenchProducts { rows, reps, dtypes } => {
            let dtypes: Vec<burn::tensor::FloatDType> = dtypes
                .iter()
                .map(|d| match d.as_str() {
                    "bf16" => burn::tensor::FloatDType::BF16,
                    "f16" => burn::tensor::FloatDType::F16,
                    _ => burn::tensor::FloatDType::F32,
                })
                .collect();
            let device = burn_rlhf::backend::default_device();
            burn_rlhf::bench::bench_products::<burn_rlhf::backend::InferenceBackend>(
                &device, rows, reps, &dtypes,
            );
        }
        Command::BenchCollectives {
            nnodes,
            devices,
            max_mib,
            transport,
            same_device,
            peer,
            peer_python,
        } => {
            use burn_rlhf::bench::{bench_collectives, collectives_table, run_collectives_peer};
            let backend = burn_rlhf::config::CollectiveBackend::parse(&transport)
                .map_err(|e| anyhow::anyhow!("--transport: {e}"))?;
            if let Some((transport, rows)) =
                bench_collectives(nnodes, devices, max_mib << 20, backend, same_device)?
            {
                for row in &rows {
                    println!("{}", row.to_json(transport));
                }
                if let Some(script) = peer {
                    let ranks = rows.first().map_or(1, |r| r.ranks);
                    let theirs = run_collectives_peer(&peer_python, &script, ranks, max_mib << 20)?;
                    for row in &theirs {
                        println!("{}", row.to_json("torch.distributed gloo (processes)"));
                    }
                    println!(
                        "burn-rlhf: {transport}; peer: torch.distributed gloo; {ranks} ranks\n{}",
                        collectives_table(&rows, &theirs)
                    );
                }
            }
        }
        Command::Config(ConfigCommand::Show { config, overrides })
            if config_kind(&config)? == ConfigKind::Sft =>
        {
            let sft = burn_rlhf::config::SftConfig::load(&config, &overrides)?;
            println!("{}", ron::ser::to_string_pretty(&sft, Default::default())?);
            if let Err(e) = sft.validate(&origin(&config, &overrides)) {
                eprintln!("warning: {e}");
            }
        }
        Command::Config(ConfigCommand::Show { config, overrides })
            if config_kind(&config)? == ConfigKind::RewardModel =>
        {
            let rm = burn_rlhf::config::RmConfig::load(&config, &overrides)?;
            println!("{}", ron::ser::to_string_pretty(&rm, Default::default())?);
            if let Err(e) = rm.validate(&origin(&config, &overrides)) {
                eprintln!("warning: {e}");
            }
        }
        Command::Config(ConfigCommand::Show { config, overrides }) => {
            let resolved = load_config(&config, &overrides)?;
            println!("{}", config_to_ron(&resolved));
            // `show` is for looking: print the tree even when a rule fails, then say which.
            if let Err(e) = resolved.validate(&origin(&config, &overrides)) {
                eprintln!("warning: {e}");
            }
        }
        Command::Config(ConfigCommand::Validate { config, overrides })
            if config_kind(&config)? == ConfigKind::Sft =>
        {
            // An SFT config (a top-level `model`), checked against `burn-rlhf sft`'s schema.
            let sft = burn_rlhf::config::SftConfig::load(&config, &overrides)?;
            sft.validate(&origin(&config, &overrides))?;
            println!("{}: ok (an SFT config)", origin(&config, &overrides));
        }
        Command::Config(ConfigCommand::Validate { config, overrides })
            if config_kind(&config)? == ConfigKind::RewardModel =>
        {
            let rm = burn_rlhf::config::RmConfig::load(&config, &overrides)?;
            rm.validate(&origin(&config, &overrides))?;
            println!(
                "{}: ok (a reward-model config)",
                origin(&config, &overrides)
            );
        }
        Command::Config(ConfigCommand::Validate { config, overrides }) => {
            checked_config(&config, &overrides)?;
            println!("{}: ok", origin(&config, &overrides));
        }
    }
    Ok(())
}

/// What `sft` and `rm` print at the end: the last validation's metrics, the checkpoint and the
/// metrics file.
fn report_supervised(out: &burn_rlhf::trainer::supervised::SupervisedOutputs) {
    for (name, value) in &out.val {
        println!("{name}: {value:.4}");
    }
    println!("checkpoint: {}", out.checkpoint.display());
    if let Some(p) = &out.jsonl {
        println!("metrics: {}", p.display());
    }
}

fn main() -> ExitCode {
    // NCCL named by BURN_RLHF_NCCL_LIB becomes loadable (a restart in place, the first time).
    #[cfg(feature = "cuda")]
    if let Err(e) = burn_rlhf::distributed::nccl_library::prepare_library_path() {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    burn_rlhf::runtime::tune_allocator();
    burn_rlhf::runtime::configure_kernels();
    let cli = Cli::parse();
    match burn_rlhf::runtime::on_compute_threads(|| run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
