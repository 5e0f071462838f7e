//! Checkpoints in verl's layout, written atomically, and resuming from them.
//!
//! `{default_local_dir}/global_step_{N}/actor/` (and `critic/`) is an HF model folder
//! (`model.safetensors`, `config.json`, tokenizer files) that transformers loads, plus the AdamW
//! state (`optimizer.bin`, Burn's full-precision record, and `optimizer_params.json`, the order of
//! the parameters it belongs to). `trainer_state.json` holds the step, data position, KL
//! controller, the loss's random-stream position and the schedules' positions. A step is written
//! to a temporary folder and renamed into place, then `latest_checkpointed_iteration.txt` is
//! replaced: a run killed while saving keeps its previous checkpoint. A LoRA run also writes its
//! adapters in PEFT's layout (`adapter_model.safetensors`, `adapter_config.json`); it resumes
//! from them onto the base model it was started from.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::backend::LearnerBackend;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::Optimizer;
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::Tensor;
use burn_rlhf_algos::KlControllerState;
use burn_rlhf_models::pretrained::{load_pretrained, save_pretrained};
use burn_rlhf_models::weights::{write_safetensors, WeightMap};
use burn_rlhf_models::{CausalLm, LoraConfig, ValueModel};
use burn_rlhf_rollout::SamplerState;
use serde::{Deserialize, Serialize};

use super::learner::Learner;
use super::off_policy::ROLLOUT_DIR;
use super::workers::reference::ReferenceWorker;
use super::workers::rollout::PendingGeneration;
use crate::config::settings::ResumeMode;
use crate::error::TrainError;
use crate::optim::AdamWOf;
use crate::trainer::model_optimizer::ModelOptimizer;

/// The file naming the newest complete checkpoint (verl's name).
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";

/// Everything besides weights and optimiser moments that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Completed steps.
    pub global_step: usize,
    /// Where the prompt sampler is.
    pub sampler: SamplerState,
    /// The KL controller.
    pub kl_ctrl: KlControllerState,
    /// The policy loss's random-stream position (Clip-Cov).
    pub policy_loss_stream: u64,
    /// Actor optimiser steps (the schedule's position).
    pub actor_updates: usize,
    /// Critic optimiser steps.
    pub critic_updates: usize,
    /// The step SPIN's reference was last replaced by the actor; its weights are in `ref/`.
    #[serde(default)]
    pub reference_refreshed_at: Option<usize>,
    /// One-step-off-policy training: the generation in flight when the checkpoint was taken
    /// (the next step's batch); its weights are in `rollout/`.
    #[serde(default)]
    pub pending_generation: Option<PendingGeneration>,
}

/// Parameter ids in visiting order: the same model built twice visits the same order.
struct ParamOrder(Vec<ParamId>);

impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for ParamOrder {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.id);
    }
}

fn param_order<B: LearnerBackend, M: AutodiffModule<B>>(module: &M) -> Vec<ParamId> {
    let mut order = ParamOrder(Vec::new());
    module.visit(&mut order);
    order.0
}

fn io(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::checkpoint(path, e)
}

/// The parameter order the optimiser state belongs to (written once, by rank 0).
pub(crate) fn save_param_order<B: LearnerBackend, M: AutodiffModule<B>>(
    dir: &Path,
    module: &M,
) -> Result<(), TrainError> {
    write_param_order::<B, M>(dir, module, PARAMS_FILE)
}

/// The file of the parameter order of an unsplit model's optimiser state.
const PARAMS_FILE: &str = "optimizer_params.json";

fn write_param_order<B: LearnerBackend, M: AutodiffModule<B>>(
    dir: &Path,
    module: &M,
    file: &str,
) -> Result<(), TrainError> {
    let ids: Vec<String> = param_order::<B, M>(module)
        .into_iter()
        .map(|id| id.serialize())
        .collect();
    let ids_path = dir.join(file);
    std::fs::write(&ids_path, serde_json::to_string(&ids).expect("JSON"))
        .map_err(|e| io(&ids_path, e))
}

impl<M: AutodiffModule<B>, B: LearnerBackend> ModelOptimizer<M, B> {
    /// The optimiser file's stem: `optimizer`; under tensor parallelism each shard's
    /// `_tp{t}_of_{size}`, and with ZeRO-1 each rank's `_rank{r}_of_{world}` after it.
    fn stem(&self) -> String {
        let mut stem = String::from("optimizer");
        if let Some(tp) = &self.sync.tp {
            stem += &format!("_tp{}_of_{}", tp.group.rank(), tp.group.size());
        }
        if self.sync.shards.is_some() {
            let dp = &self.sync.dp;
            stem += &format!("_rank{}_of_{}", dp.rank(), dp.world());
        }
        stem
    }

    /// The file of the parameter order of this state: a tensor-parallel shard's own (its
    /// parameters are its own), else the model's.
    fn params_file(&self) -> String {
        match &self.sync.tp {
            Some(tp) => format!(
                "optimizer_params_tp{}_of_{}.json",
                tp.group.rank(),
                tp.group.size()
            ),
            None => PARAMS_FILE.into(),
        }
    }

    /// Writes the optimiser state of `module` into its checkpoint folder `dir`: rank 0 the
    /// whole state (`main`), every rank its shard under ZeRO-1, and under tensor parallelism
    /// each rank of the first replica its shard's, with its parameter order.
    pub(crate) fn save(&self, dir: &Path, main: bool, module: &M) -> Result<(), TrainError> {
        if let Some(sharded) = &self.sharded {
            // Gathered from every rank's chunks into the unsharded optimiser's record: the
            // checkpoint resumes at any world size, sharded or not.
            let record = sharded.adam.whole_record::<B, M>(&sharded.shards)?;
            if main {
                let stem = self.stem();
                BinFileRecorder::<FullPrecisionSettings>::new()
                    .record(record, dir.join(&stem))
                    .map_err(|e| io(&dir.join(format!("{stem}.bin")), e))?;
            }
            return Ok(());
        }
        let tp_shard = self.sync.tp.is_some() && self.sync.dp.rank() == 0;
        if !main && self.sync.shards.is_none() && !tp_shard {
            return Ok(());
        }
        if tp_shard {
            write_param_order::<B, M>(dir, module, &self.params_file())?;
        }
        let stem = self.stem();
        BinFileRecorder::<FullPrecisionSettings>::new()
            .record(self.optim.to_record(), dir.join(&stem))
            .map_err(|e| io(&dir.join(format!("{stem}.bin")), e))?;
        Ok(())
    }

    /// Reads the optimiser state saved in `dir` for `module` (a fresh load of the saved weights,
    /// whole) and returns `module` as this optimiser holds it: under FSDP sharded again, this
    /// rank keeping its chunks of the parameters and of the state (any world size reads the
    /// whole state a sharded or unsharded run wrote).
    pub(crate) fn load(
        &mut self,
        dir: &Path,
        module: M,
        device: &B::Device,
    ) -> Result<M, TrainError> {
        let (stem, params) = (self.stem(), self.params_file());
        // Saved in f32 (the values of a half-precision model exactly), held in the master dtype.
        let module = crate::optim::held_in(module, self.master);
        self.optim = load_optimizer(dir, &module, self.optim.clone(), (&stem, &params), device)?;
        let Some(sharded) = self.sharded.as_mut() else {
            return Ok(module);
        };
        let (module, shards) = sharded.shards.reshard(module);
        // The whole state read is dealt out to the chunks and not kept.
        let fresh = burn::optim::adaptor::OptimizerAdaptor::from(sharded.adam.adam());
        let record = std::mem::replace(&mut self.optim, fresh).to_record();
        sharded.adam = crate::distributed::fsdp::ShardedAdamW::from_whole_record::<B, M>(
            sharded.adam.adam(),
            &shards,
            record,
        );
        sharded.shards = shards;
        Ok(module)
    }
}

/// Loads the optimiser state saved beside a module into `optim` for `module` (a fresh load of the
/// same weights, whose parameter ids differ from the saved ones).
fn load_optimizer<B: LearnerBackend, M: AutodiffModule<B>>(
    dir: &Path,
    module: &M,
    optim: AdamWOf<M, B>,
    (stem, params_file): (&str, &str),
    device: &B::Device,
) -> Result<AdamWOf<M, B>, TrainError> {
    let file = dir.join(format!("{stem}.bin"));
    if !file.exists() {
        return Err(io(
            &file,
            "missing: a sharded optimiser state (trainer.zero_stage=1, or tensor parallelism) is resumed with the same number of ranks and tensor-parallel size, and an unsharded one without sharding",
        ));
    }
    let ids_path = dir.join(params_file);
    let text = std::fs::read_to_string(&ids_path).map_err(|e| io(&ids_path, e))?;
    let saved: Vec<String> = serde_json::from_str(&text).map_err(|e| io(&ids_path, e))?;
    let current = param_order::<B, M>(module);
    if saved.len() != current.len() {
        return Err(io(
            &ids_path,
            format!(
                "{} parameters saved, the model has {}",
                saved.len(),
                current.len()
            ),
        ));
    }
    let mut record: <AdamWOf<M, B> as Optimizer<M, B>>::Record =
        BinFileRecorder::<FullPrecisionSettings>::new()
            .load(dir.join(stem), device)
            .map_err(|e| io(&file, e))?;
    let mut remapped: <AdamWOf<M, B> as Optimizer<M, B>>::Record = Default::default();
    for (old, new) in saved.iter().zip(current) {
        if let Some(state) = record.remove(&ParamId::deserialize(old)) {
            remapped.insert(new, state);
        }
    }
    Ok(optim.load_record(remapped))
}

/// The LoRA adapters of a LoRA run, in PEFT's layout (`PeftModel.from_pretrained` loads the
/// folder onto the base model); `model.safetensors` beside it is the merged model.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";

/// Writes `actor`'s adapters and PEFT's `adapter_config.json` into `dir`.
fn save_adapters<B: burn::tensor::backend::Backend>(
    dir: &Path,
    actor: &CausalLm<B>,
    lora: &LoraConfig,
    base: &str,
) -> Result<(), TrainError> {
    write_safetensors(
        &dir.join(ADAPTER_FILE),
        &actor.export_lora(),
        HashMap::from([("format".to_string(), "pt".to_string())]),
    )?;
    let targets = match lora.target_modules.as_slice() {
        [all] if all == "all-linear" => serde_json::json!("all-linear"),
        list => serde_json::json!(list),
    };
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
    });
    let path = dir.join("adapter_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).expect("JSON"))
        .map_err(|e| io(&path, e))
}

/// The checkpoint `resume` points at under `root`: `auto` the newest (named by
/// `latest_checkpointed_iteration.txt`; none: a fresh start), a path that path, `disable` none.
pub(crate) fn checkpoint_to_resume(
    root: &Path,
    resume: &ResumeMode,
) -> Result<Option<PathBuf>, TrainError> {
    match resume {
        ResumeMode::Disable => Ok(None),
        ResumeMode::Auto => {
            let latest = root.join(LATEST_FILE);
            let Ok(text) = std::fs::read_to_string(&latest) else {
                return Ok(None);
            };
            let step: usize = text
                .trim()
                .parse()
                .map_err(|_| io(&latest, format!("`{}` is not a step number", text.trim())))?;
            let dir = root.join(format!("global_step_{step}"));
            let aside = replaced_dir(root, step);
            // Killed between moving a re-saved step's old folder aside and renaming the new
            // one in: the old one is complete.
            Ok(Some(if !dir.exists() && aside.exists() {
                aside
            } else {
                dir
            }))
        }
        ResumeMode::Path(path) => Ok(Some(path.clone())),
    }
}

/// Names `step` as the newest complete checkpoint under `root` (written aside, then renamed).
pub(crate) fn write_latest(root: &Path, step: usize) -> Result<(), TrainError> {
    let latest = root.join(LATEST_FILE);
    let latest_tmp = root.join(format!(".{LATEST_FILE}.partial"));
    std::fs::write(&latest_tmp, step.to_string()).map_err(|e| io(&latest_tmp, e))?;
    std::fs::rename(&latest_tmp, &latest).map_err(|e| io(&latest, e))
}

/// `global_step_N` folders by step, and the step the pointer names.
type SavedSteps = (Vec<(usize, PathBuf)>, Option<usize>);

/// The `global_step_N` folders under `root` by step, and the step
/// `latest_checkpointed_iteration.txt` names (a pointer that cannot be read protects nothing;
/// resuming reports it).
fn saved_steps(root: &Path) -> Result<SavedSteps, TrainError> {
    let entries = std::fs::read_dir(root).map_err(|e| io(root, e))?;
    let mut steps: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let step = name.to_str()?.strip_prefix("global_step_")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort();
    let pointed = std::fs::read_to_string(root.join(LATEST_FILE))
        .ok()
        .and_then(|text| text.trim().parse().ok());
    Ok((steps, pointed))
}

/// Keeps the newest `keep` whole `global_step_N` folders under `root` (a supervised run's
/// checkpoints, `trainer.max_ckpt_to_keep`; `None`: all), the step the pointer names always
/// among them, as [`prune_checkpoints`] does for the actor and critic.
pub fn prune_step_folders(root: &Path, keep: Option<usize>) -> Result<(), TrainError> {
    let Some(keep) = keep else { return Ok(()) };
    let (steps, pointed) = saved_steps(root)?;
    let others: Vec<&PathBuf> = steps
        .iter()
        .filter(|(step, _)| Some(*step) != pointed)
        .map(|(_, dir)| dir)
        .collect();
    let keep = match pointed {
        Some(step) if steps.iter().any(|(s, _)| *s == step) => keep.saturating_sub(1),
        _ => keep,
    };
    for dir in &others[..others.len().saturating_sub(keep)] {
        std::fs::remove_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    Ok(())
}

/// Keeps the newest `keep_actor` actor folders and `keep_critic` critic folders
/// (`trainer.max_actor_ckpt_to_keep`, `max_critic_ckpt_to_keep`; `None`: all) among the
/// `global_step_N` checkpoints under `root`, as verl's checkpoint managers do with the folders
/// they saved; a step left with neither is removed whole. Steps saved before a resume count too.
/// The step `latest_checkpointed_iteration.txt` names is never removed, whatever its number: a
/// run resumed from an older step into a folder holding newer ones saves below them, and the
/// pointer must keep naming a checkpoint that exists (it is kept beside the newest ones).
pub fn prune_checkpoints(
    root: &Path,
    keep_actor: Option<usize>,
    keep_critic: Option<usize>,
) -> Result<(), TrainError> {
    if keep_actor.is_none() && keep_critic.is_none() {
        return Ok(());
    }
    let (steps, pointed) = saved_steps(root)?;
    for (part, keep) in [("actor", keep_actor), ("critic", keep_critic)] {
        let Some(keep) = keep else { continue };
        let with_part: Vec<&PathBuf> = steps
            .iter()
            .filter(|(step, dir)| Some(*step) != pointed && dir.join(part).is_dir())
            .map(|(_, dir)| dir)
            .collect();
        // The pointed step takes one of the places when it has this part.
        let keep = match pointed {
            Some(step) if root.join(format!("global_step_{step}/{part}")).is_dir() => {
                keep.saturating_sub(1)
            }
            _ => keep,
        };
        for dir in &with_part[..with_part.len().saturating_sub(keep)] {
            let old = dir.join(part);
            std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
            // A one-step-off run's generation in flight resumes with the actor only.
            let rollout = dir.join(ROLLOUT_DIR);
            if part == "actor" && rollout.is_dir() {
                std::fs::remove_dir_all(&rollout).map_err(|e| io(&rollout, e))?;
            }
        }
    }
    for (_, dir) in &steps {
        if !dir.join("actor").exists() && !dir.join("critic").exists() {
            std::fs::remove_dir_all(dir).map_err(|e| io(dir, e))?;
        }
    }
    Ok(())
}

/// Where a re-saved step's previous folder waits until the new one is in place.
fn replaced_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!(".global_step_{step}.replaced"))
}

/// One step's checkpoint folder, `root/global_step_N`, written atomically (every trainer's: RL,
/// SFT, reward model): its files go into a partial folder beside it, then [`StepFolder::publish`]
/// renames that into place (a re-saved step's old folder moved aside first and deleted only
/// after, so the step's folder is never half-written; in the instant between the two renames a
/// resume finds the aside copy, [`checkpoint_to_resume`]) and names the step in
/// `latest_checkpointed_iteration.txt`. A run killed while saving keeps its previous checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepFolder {
    root: PathBuf,
    step: usize,
    partial: PathBuf,
}

impl StepFolder {
    /// Step `step`'s folder under `root` (nothing is touched yet).
    pub(crate) fn new(root: &Path, step: usize) -> Self {
        Self {
            root: root.to_path_buf(),
            step,
            partial: root.join(format!(".global_step_{step}.partial")),
        }
    }

    /// Where the step's files are written before [`StepFolder::publish`].
    pub(crate) fn partial(&self) -> &Path {
        &self.partial
    }

    /// Removes what a save killed before it published left in the partial folder.
    pub(crate) fn clear(&self) -> Result<(), TrainError> {
        if self.partial.exists() {
            std::fs::remove_dir_all(&self.partial).map_err(|e| io(&self.partial, e))?;
        }
        Ok(())
    }

    /// Renames the written partial folder into place and names the step as the newest
    /// checkpoint; returns the step's folder.
    pub(crate) fn publish(&self) -> Result<PathBuf, TrainError> {
        let done = self.root.join(format!("global_step_{}", self.step));
        let aside = replaced_dir(&self.root, self.step);
        if aside.exists() && done.exists() {
            std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        }
        if done.exists() {
            std::fs::rename(&done, &aside).map_err(|e| io(&aside, e))?;
        }
        std::fs::rename(&self.partial, &done).map_err(|e| io(&done, e))?;
        if aside.exists() {
            std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        }
        write_latest(&self.root, self.step)?;
        Ok(done)
    }
}

impl<B: LearnerBackend> Learner<B> {
    /// Where checkpoints go (`trainer.default_local_dir`).
    pub fn checkpoint_root(&self) -> PathBuf {
        self.settings.trainer.checkpoint_dir.clone()
    }

    /// Saves the current step; returns the checkpoint folder. Rank 0 writes the weights and the
    /// trainer state; with ZeRO-1 every rank writes its own optimiser shard. Every rank returns
    /// once the checkpoint is in place.
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        let main = self.dp.is_main();
        // Under tensor parallelism the first replica's ranks export the whole models (each
        // split layer gathers its group's parts: an exchange each of them makes) and the first
        // of them writes.
        let gathers = self.dp.rank() == 0;
        // Under FSDP every rank takes part in gathering the whole models.
        let actor = self.actor_whole();
        let actor_weights = gathers.then(|| actor.valid().export());
        let critic = self.critic.as_ref().map(|c| c.optimizer.whole(&c.model));
        let critic_weights = critic
            .as_ref()
            .filter(|_| gathers)
            .map(|m| m.valid().export());
        let refreshed_at = self.reference.as_ref().and_then(|r| r.refreshed_at);
        let reference_weights = match (refreshed_at, self.reference()) {
            (Some(_), Some(r)) if gathers => Some(r.export()),
            _ => None,
        };
        let root = self.checkpoint_root();
        let folder = StepFolder::new(&root, self.global_step);
        let tmp = folder.partial();
        let actor_dir = tmp.join("actor");
        let critic_dir = tmp.join("critic");
        if main {
            folder.clear()?;
            save_pretrained(
                &actor_dir,
                &self.model_config,
                actor_weights.as_ref().expect("the main rank gathers"),
                None,
                Some(&self.tokenizer),
            )?;
            if !self.dp.mesh.splits_models() {
                save_param_order::<B, _>(&actor_dir, &self.actor.model)?;
            }
            if let Some(lora) = &self.settings.model.lora {
                save_adapters(&actor_dir, &actor.valid(), lora, &self.settings.model.path)?;
            }
            if let (Some(c), Some(weights)) = (&self.critic, &critic_weights) {
                save_pretrained(
                    &critic_dir,
                    &c.config,
                    weights,
                    Some(&c.config.model_type.token_classification_class()),
                    Some(&self.tokenizer),
                )?;
                if !self.dp.mesh.splits_models() {
                    save_param_order::<B, _>(&critic_dir, &c.model)?;
                }
            }
            let state = TrainerState {
                global_step: self.global_step,
                sampler: self.sampler.state(),
                kl_ctrl: self.algorithms.kl_ctrl.state(),
                policy_loss_stream: self.algorithms.policy_loss.stream_position(),
                actor_updates: self.actor.updates(),
                critic_updates: self.critic.as_ref().map_or(0, |c| c.optimizer.updates),
                reference_refreshed_at: refreshed_at,
                pending_generation: None,
            };
            let pending = self.rollout.in_flight();
            if let Some((_, weights)) = &pending {
                self.save_rollout_weights(&tmp.join(ROLLOUT_DIR), weights)?;
            }
            let state = TrainerState {
                pending_generation: pending.map(|(p, _)| p),
                ..state
            };
            // A reference that is no longer the starting model (SPIN) is part of the state.
            if let Some(weights) = &reference_weights {
                save_pretrained(
                    &tmp.join("ref"),
                    &self.model_config,
                    weights,
                    None,
                    Some(&self.tokenizer),
                )?;
            }
            let state_path = tmp.join("trainer_state.json");
            std::fs::write(
                &state_path,
                serde_json::to_string_pretty(&state).expect("JSON"),
            )
            .map_err(|e| io(&state_path, e))?;
        }
        // The folders exist now; optimiser states are written by their holders.
        self.dp.barrier()?;
        self.actor
            .optimizer
            .save(&actor_dir, main, &self.actor.model)?;
        if let Some(c) = &self.critic {
            c.optimizer.save(&critic_dir, main, &c.model)?;
        }
        self.dp.barrier()?;
        if main {
            folder.publish()?;
            // Only now, with the new step in place and named as the latest, do older ones go.
            let t = &self.settings.trainer;
            prune_checkpoints(&root, t.keep_actor_checkpoints, t.keep_critic_checkpoints)?;
        }
        self.dp.barrier()?;
        Ok(root.join(format!("global_step_{}", self.global_step)))
    }

    /// The checkpoint `trainer.resume_mode` points at: `auto` the newest under the checkpoint
    /// root (none: a fresh start), `resume_path` `trainer.resume_from_path` (must exist),
    /// `disable` none.
    pub fn checkpoint_to_resume(&self) -> Result<Option<PathBuf>, TrainError> {
        checkpoint_to_resume(&self.checkpoint_root(), &self.settings.trainer.resume)
    }

    /// Restores weights, optimiser states and trainer state from a checkpoint folder.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<(), TrainError> {
        let state_path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_path).map_err(|e| io(&state_path, e))?;
        let state: TrainerState = serde_json::from_str(&text).map_err(|e| io(&state_path, e))?;
        let actor_dir = dir.join("actor");
        let adapters = actor_dir.join(ADAPTER_FILE);
        let actor: CausalLm<B> = match (&self.settings.model.lora, adapters.exists()) {
            // The frozen base is the model the run started from (`model.path`, loaded by this
            // learner); the checkpoint holds what trained: the adapters.
            (Some(_), true) => {
                let mut w = WeightMap::new(adapters.display().to_string());
                w.read_safetensors(&adapters)?;
                let actor = self.actor_whole().load_lora(&mut w, &self.device)?;
                w.finish()?;
                actor
            }
            (Some(_), false) => {
                return Err(io(
                    &adapters,
                    "missing: `actor_rollout_ref.model.lora_rank` > 0 resumes the LoRA adapters of a LoRA run, and this checkpoint has none",
                ))
            }
            (None, true) => {
                return Err(io(
                    &adapters,
                    "this checkpoint is of a LoRA run: set `actor_rollout_ref.model.lora_rank` (and its other LoRA keys) as that run did",
                ))
            }
            (None, false) => load_pretrained(&actor_dir.display().to_string())?
                .causal_lm_part(self.dp.tp.as_ref(), &self.device)?,
        };
        self.actor.model = self.actor.optimizer.load(&actor_dir, actor, &self.device)?;
        if let Some(c) = self.critic.as_mut() {
            let critic_dir = dir.join("critic");
            let model: ValueModel<B> = load_pretrained(&critic_dir.display().to_string())?
                .value_model_part(self.dp.tp.as_ref(), &self.device)?;
            c.model = c.optimizer.load(&critic_dir, model, &self.device)?;
        }
        if state.reference_refreshed_at.is_some() {
            let ref_dir = dir.join("ref");
            let reference = load_pretrained(&ref_dir.display().to_string())?
                .causal_lm_part::<B::InnerBackend>(self.dp.tp.as_ref(), &self.device)?;
            // A reference the run replaced by its policy (SPIN's opponent) comes back as saved.
            match (self.reference.as_mut(), state.reference_refreshed_at) {
                (Some(r), Some(step)) => r.replace(reference, step, &self.dp, &self.device)?,
                (None, Some(step)) => {
                    let mut r =
                        ReferenceWorker::hold(reference, &self.settings, &self.dp, &self.device)?;
                    r.refreshed_at = Some(step);
                    self.reference = Some(r);
                }
                (_, None) => {}
            }
        }
        self.algorithms.kl_ctrl.load_state(&state.kl_ctrl)?;
        self.algorithms
            .policy_loss
            .restore_stream_position(state.policy_loss_stream);
        self.sampler.restore(state.sampler);
        self.global_step = state.global_step;
        self.rollout.forget_next();
        match (state.pending_generation, self.settings.one_step_off) {
            (Some(pending), Some(_)) => self.resume_generation(dir, pending)?,
            (Some(_), None) => {
                return Err(TrainError::config(
                    "actor_rollout_ref.hybrid_engine",
                    format!(
                        "{} was written by a one-step-off-policy run (a generation in flight): \
                         resume it with `actor_rollout_ref.hybrid_engine=False`",
                        dir.display()
                    ),
                ))
            }
            // A synchronous run's checkpoint resumed one step off starts its first generation
            // at the next step.
            (None, _) => {}
        }
        self.actor.optimizer.updates = state.actor_updates;
        if let Some(c) = self.critic.as_mut() {
            c.optimizer.updates = state.critic_updates;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pruning_keeps_the_newest_of_each_part_and_removes_emptied_steps() {
        let root = std::env::temp_dir().join(format!("burn-rlhf-prune-{}", std::process::id()));
        for step in [1, 2, 3, 10] {
            for part in ["actor", "critic"] {
                std::fs::create_dir_all(root.join(format!("global_step_{step}/{part}"))).unwrap();
            }
        }
        std::fs::create_dir_all(root.join("other")).unwrap();
        prune_checkpoints(&root, None, None).unwrap();
        assert!(root.join("global_step_1/actor").is_dir());
        prune_checkpoints(&root, Some(2), Some(3)).unwrap();
        let has = |p: &str| root.join(p).is_dir();
        // Step 10 is newer than 3 (numbers, not names, order the steps).
        assert!(!has("global_step_1"), "neither part left");
        assert!(!has("global_step_2/actor") && has("global_step_2/critic"));
        assert!(has("global_step_3/actor") && has("global_step_10/actor"));
        assert!(has("global_step_3/critic") && has("global_step_10/critic"));
        assert!(has("other"));
        std::fs::remove_dir_all(root).ok();
    }

    #[test]
    fn pruning_never_removes_the_step_the_pointer_names() {
        // Resumed from step 1 (`resume_mode=resume_path`) into a folder that holds steps 3 and
        // 4 of a longer run: the run saves step 2 and the pointer names it. With 2 kept, the
        // named step and the newest other, 4, stay.
        let root =
            std::env::temp_dir().join(format!("burn-rlhf-prune-latest-{}", std::process::id()));
        for step in [1, 2, 3, 4] {
            std::fs::create_dir_all(root.join(format!("global_step_{step}/actor"))).unwrap();
        }
        write_latest(&root, 2).unwrap();
        prune_checkpoints(&root, Some(2), None).unwrap();
        let has = |p: &str| root.join(p).is_dir();
        assert!(
            has("global_step_2/actor"),
            "the step the pointer names is kept"
        );
        assert!(has("global_step_4/actor"), "the newest other step is kept");
        assert!(
            !has("global_step_1") && !has("global_step_3"),
            "two kept in all"
        );
        // With one kept, only the named step stays, even though newer ones exist.
        write_latest(&root, 2).unwrap();
        prune_checkpoints(&root, Some(1), None).unwrap();
        assert!(has("global_step_2/actor") && !has("global_step_4"));
        // A resume that continues from the named step then finds it.
        let text = std::fs::read_to_string(root.join(LATEST_FILE)).unwrap();
        assert!(has(&format!("global_step_{}", text.trim())));
        std::fs::remove_dir_all(root).ok();
    }

    /// A step folder is published whole: a save killed before publishing leaves the previous
    /// checkpoint as it was (and its partial folder is cleared by the next save), and a re-saved
    /// step replaces its folder with nothing left beside it.
    #[test]
    fn step_folders_are_published_whole() {
        let root =
            std::env::temp_dir().join(format!("burn-rlhf-step-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let write = |folder: &StepFolder, text: &str| {
            folder.clear().unwrap();
            std::fs::create_dir_all(folder.partial()).unwrap();
            std::fs::write(folder.partial().join("state"), text).unwrap();
        };
        let read = |step: usize| {
            std::fs::read_to_string(root.join(format!("global_step_{step}/state"))).unwrap()
        };
        let first = StepFolder::new(&root, 3);
        write(&first, "first");
        assert_eq!(first.publish().unwrap(), root.join("global_step_3"));
        // Killed mid-save: the partial folder holds half a step, the published one is intact.
        let killed = StepFolder::new(&root, 3);
        write(&killed, "half");
        assert_eq!(read(3), "first");
        let resumed = checkpoint_to_resume(&root, &ResumeMode::Auto).unwrap();
        assert_eq!(resumed, Some(root.join("global_step_3")));
        // The next save of the step clears what was left and replaces the step's folder.
        let again = StepFolder::new(&root, 3);
        write(&again, "second");
        again.publish().unwrap();
        assert_eq!(read(3), "second");
        let names: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let mut names = names;
        names.sort();
        assert_eq!(names, ["global_step_3", LATEST_FILE]);
        std::fs::remove_dir_all(root).ok();
    }
}
