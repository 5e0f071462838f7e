//! A learned reward model scoring rollouts (`reward_model.enable`), as verl does: each response is
//! decoded with the actor's tokenizer and, after its row's prompt messages, rendered by the reward
//! model's own tokenizer ([`encode_scored`]: its chat template when it has one), cut to
//! `reward_model.max_length` on the right, and scored where transformers reads a
//! `*ForSequenceClassification` model's score; with `input_tokenizer: null` the actor's tokens
//! are scored as they are. Each rank scores its balanced share of the rows, in micro-batches of
//! `micro_batch_size_per_gpu` sequences or of `forward_max_token_len_per_gpu` tokens, and the
//! scores are gathered. The score replaces the rule reward and lands on the last response token.

use burn_rlhf_models::pretrained::load_pretrained;
use burn_rlhf_models::{ChatMessage, RewardModel, Tokenizer, TransformerConfig};
use burn_rlhf_rollout::preference::{encode_scored, Turns};
use burn_rlhf_rollout::RolloutBatch;

use crate::backend::ComputeBackend;
use crate::config::settings::{RewardModelInput, RewardModelSettings};
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::minibatch::{sequence_scores, token_budget_partitions, ScoreRead};
use crate::offload::Parked;

/// A reward model as loaded for scoring: the model, its shape and its tokenizer (when its folder
/// has one).
pub struct LoadedRewardModel<B: ComputeBackend> {
    /// The model.
    pub model: RewardModel<B>,
    /// Its shape (its `pad_token_id` says where scores are read).
    pub config: TransformerConfig,
    /// Its tokenizer.
    pub tokenizer: Option<Tokenizer>,
}

impl<B: ComputeBackend> LoadedRewardModel<B> {
    /// The reward model at `reward_model.model.path`; a checkpoint that is not one (no score
    /// head, or several labels) is refused naming the key.
    pub fn load(path: &str, device: &B::Device) -> Result<Self, TrainError> {
        let key = "reward_model.model.path";
        let pre = load_pretrained(path).map_err(|e| TrainError::config(key, e.to_string()))?;
        let (config, tokenizer) = (pre.config.clone(), pre.tokenizer.clone());
        let model = pre
            .reward_model(false, device)
            .map_err(|e| TrainError::config(key, e.to_string()))?;
        Ok(Self {
            model,
            config,
            tokenizer,
        })
    }
}

/// The reward model of a run and how it reads rollouts.
pub(crate) struct RewardScorer<B: ComputeBackend> {
    model: Parked<B, RewardModel<B>>,
    /// The tokenizer its inputs are rendered with (the actor's when it scores the actor's tokens).
    tokenizer: Tokenizer,
    /// Its `pad_token_id`.
    score_pad: Option<u32>,
    settings: RewardModelSettings,
}

impl<B: ComputeBackend> RewardScorer<B> {
    /// Checks that `loaded` can read the rollouts of `actor_tokenizer` as `settings` say, each
    /// mismatch refused naming the key: rendering needs the reward model's own tokenizer, and
    /// scoring the actor's tokens as they are needs the actor's vocabulary.
    pub fn new(
        loaded: LoadedRewardModel<B>,
        settings: &RewardModelSettings,
        actor_tokenizer: &Tokenizer,
    ) -> Result<Self, TrainError> {
        let tokenizer = match (&settings.input, loaded.tokenizer) {
            (RewardModelInput::Rendered, Some(t)) => t,
            (RewardModelInput::Rendered, None) => {
                return Err(TrainError::config(
                    "reward_model.model.path",
                    format!(
                        "`{}` has no tokenizer (tokenizer.json) to render the rollouts with; \
                         add the reward model's tokenizer files, or set \
                         reward_model.model.input_tokenizer=null to score the actor's tokens \
                         as they are (same vocabulary only)",
                        settings.path
                    ),
                ))
            }
            (RewardModelInput::ActorTokens, own) => {
                let same = match &own {
                    Some(t) => t.same_vocabulary(actor_tokenizer),
                    None => loaded.config.vocab_size >= actor_tokenizer.vocab_size(),
                };
                if !same {
                    return Err(TrainError::config(
                        "reward_model.model.input_tokenizer",
                        format!(
                            "null scores the actor's tokens as they are, and the reward model \
                             `{}` has another vocabulary ({} tokens, the actor's {}): they \
                             cannot be bridged token for token; set it to the actor's tokenizer \
                             (`${{actor_rollout_ref.model.path}}`, verl's default) to decode the \
                             rollouts and render them with the reward model's tokenizer",
                            settings.path,
                            own.as_ref()
                                .map_or(loaded.config.vocab_size, Tokenizer::vocab_size),
                            actor_tokenizer.vocab_size()
                        ),
                    ));
                }
                actor_tokenizer.clone()
            }
        };
        Ok(Self {
            model: Parked::new(
                match settings.model_dtype {
                    Some(dtype) => loaded.model.cast(dtype),
                    None => loaded.model,
                },
                settings.param_offload,
            ),
            tokenizer,
            score_pad: loaded.config.pad_token_id,
            settings: settings.clone(),
        })
    }

    /// This scorer as rank `dp.rank()` holds it: under `reward_model.strategy: fsdp` on several
    /// data-parallel ranks its model sharded over them (its chunks in host memory with
    /// `param_offload`), gathered whole for each scoring pass.
    pub fn held(mut self, dp: &DataParallel, device: &B::Device) -> Result<Self, TrainError> {
        let Some(fsdp) = self
            .settings
            .fsdp
            .filter(|_| dp.mesh.shards_parameters(false))
        else {
            return Ok(self);
        };
        let groups = crate::distributed::fsdp::ShardGroups::of_ranks(
            dp,
            fsdp.group_size,
            fsdp.param_offload,
        )
        .map_err(|reason| TrainError::config("reward_model.model.fsdp_config.fsdp_size", reason))?;
        self.model = Parked::sharded(self.model.on_device(device), groups, device);
        Ok(self)
    }

    /// Bytes of the reward model's weights this rank holds, on the device and in host memory.
    pub fn bytes(&self) -> (usize, usize) {
        self.model.bytes()
    }

    /// The sequence the reward model scores for row `r` of `batch`.
    fn sequence(
        &self,
        batch: &RolloutBatch,
        r: usize,
        actor_tokenizer: &Tokenizer,
    ) -> Result<Vec<u32>, TrainError> {
        let response = batch.response_tokens(r);
        let mut ids = match self.settings.input {
            RewardModelInput::ActorTokens => {
                let p = batch.prompt_len;
                let prompt = &batch.prompt_ids[r * p..(r + 1) * p];
                let mask = &batch.prompt_mask[r * p..(r + 1) * p];
                let mut ids: Vec<u32> = prompt
                    .iter()
                    .zip(mask)
                    .filter(|(_, &m)| m > 0)
                    .map(|(&t, _)| t)
                    .collect();
                ids.extend_from_slice(response);
                ids
            }
            RewardModelInput::Rendered => {
                let prompt: &[ChatMessage] = batch.raw_prompt.get(r).ok_or_else(|| {
                    TrainError::config(
                        "reward_model.model.input_tokenizer",
                        "this batch carries no prompt messages to render (it was not generated \
                         from prompt records): set input_tokenizer=null to score the actor's \
                         tokens as they are",
                    )
                })?;
                let text = actor_tokenizer.decode(response, true)?;
                encode_scored(
                    &self.tokenizer,
                    Some(&Turns::Messages(prompt.to_vec())),
                    &Turns::Text(text),
                )?
            }
        };
        if let Some(max) = self.settings.max_length {
            ids.truncate(max);
        }
        Ok(ids)
    }

    /// One score per row of `batch` (its responses decoded with `actor_tokenizer`): this rank's
    /// share scored, every rank's gathered (`dp`). With a shape `bucket` (GPUs), widths are
    /// rounded up to it and a short micro-batch of counted sequences is filled up with copies of
    /// its rows (their scores dropped), so the passes see few shapes.
    pub fn score(
        &self,
        batch: &RolloutBatch,
        actor_tokenizer: &Tokenizer,
        dp: &DataParallel,
        (bucket, device): (usize, &B::Device),
    ) -> Result<Vec<f64>, TrainError> {
        let rows = dp.rows_of_rank(batch);
        let sequences: Vec<Vec<u32>> = rows
            .iter()
            .map(|&r| self.sequence(batch, r, actor_tokenizer))
            .collect::<Result<_, TrainError>>()?;
        let lengths: Vec<usize> = sequences.iter().map(Vec::len).collect();
        let parts = match (self.settings.max_tokens, self.settings.micro_batch_size) {
            (Some(budget), _) => token_budget_partitions(&lengths, budget).ok_or_else(|| {
                TrainError::config(
                    "reward_model.forward_max_token_len_per_gpu",
                    format!(
                        "a rendered sequence has {} tokens, more than the budget of {budget}",
                        lengths.iter().max().unwrap_or(&0)
                    ),
                )
            })?,
            (None, micro) => (0..sequences.len())
                .collect::<Vec<_>>()
                .chunks(micro.unwrap_or(sequences.len()).max(1))
                .map(<[usize]>::to_vec)
                .collect(),
        };
        let model = self.model.on_device(device);
        let read = ScoreRead {
            pad_id: self.tokenizer.pad_token_id,
            score_pad: self.score_pad,
            bucket,
        };
        let fill = match (self.settings.max_tokens, self.settings.micro_batch_size) {
            (None, Some(micro)) if bucket > 1 => micro,
            _ => 0,
        };
        let mut mine = vec![0.0f32; rows.len()];
        for part in parts {
            let refs: Vec<&[u32]> = (0..part.len().max(fill))
                .map(|k| sequences[part[k % part.len()]].as_slice())
                .collect();
            let scores = sequence_scores(&model, &refs, &read, device, None);
            for (&i, s) in part.iter().zip(scores.into_data().iter::<f32>()) {
                mine[i] = s;
            }
        }
        let all = dp.gather_rows(&mine, &rows, batch.rows(), 1)?;
        Ok(all.into_iter().map(f64::from).collect())
    }
}
