//! The `burn-rlhf` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use burn_rlhf::config::{config_to_ron, load_config};
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

/// How a config is named in messages: the file, and whether overrides were applied.
fn origin(config: &std::path::Path, overrides: &[String]) -> String {
    if overrides.is_empty() {
        config.display().to_string()
    } else {
        format!("{} with {}", config.display(), overrides.join(" "))
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Config(ConfigCommand::Show { config, overrides }) => {
            let resolved = load_config(&config, &overrides)?;
            println!("{}", config_to_ron(&resolved));
            // `show` is for looking: print the tree even when a rule fails, then say which.
            if let Err(e) = resolved.validate(&origin(&config, &overrides)) {
                eprintln!("warning: {e}");
            }
        }
        Command::Config(ConfigCommand::Validate { config, overrides }) => {
            let resolved = load_config(&config, &overrides)?;
            resolved.validate(&origin(&config, &overrides))?;
            println!("{}: ok", origin(&config, &overrides));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    burn_rlhf::runtime::tune_allocator();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
