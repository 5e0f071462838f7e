//! The decoder with a scalar head ([`ScoredModel`]: the critic, a reward model) from checkpoint
//! tensors or random initialisation, and back to HF names.

use std::collections::BTreeMap;

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

use super::{export_linear, linear};
use crate::config::TransformerConfig;
use crate::error::ModelError;
use crate::heads::ScoredModel;
use crate::lora::LoraLinear;
use crate::tensor_parallel::TpGroup;
use crate::transformer::Transformer;
use crate::weights::{HostTensor, WeightMap};

/// A new `score` head's initialisation: normal(0, 0.02) weight and zero bias, as HF initialises a
/// new `score` layer (`initializer_range`).
fn init_value_head<B: Backend>(hidden: usize, bias: bool, device: &B::Device) -> Linear<B> {
    let weight = Tensor::random([hidden, 1], Distribution::Normal(0.0, 0.02), device);
    let mut l = LinearConfig::new(hidden, 1).with_bias(bias).init(device);
    l.weight = Param::from_tensor(weight);
    if let Some(b) = l.bias.as_mut() {
        *b = Param::from_tensor(Tensor::zeros([1], device));
    }
    l
}

impl<B: Backend> ScoredModel<B> {
    /// The critic from a checkpoint: a saved critic (`score.weight`/`score.bias`) or an LM checkpoint
    /// (its `lm_head.weight` is dropped and a fresh value head initialised, as verl's critic is).
    pub fn critic_from_weights(
        c: &TransformerConfig,
        w: WeightMap,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load_critic(c, w, None, device)
    }

    /// [`ScoredModel::critic_from_weights`] as this rank's part in `group` (the value head
    /// whole); the whole critic without a group.
    pub fn load_critic(
        c: &TransformerConfig,
        mut w: WeightMap,
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let model = Transformer::load(c, &mut w, group, device)?;
        let score = if w.contains("score.weight") {
            let bias = w.contains("score.bias");
            linear(&mut w, "score", c.hidden_size, 1, bias, device)?
        } else {
            w.take_optional("lm_head.weight", &[c.vocab_size, c.hidden_size])?;
            init_value_head(c.hidden_size, true, device)
        };
        w.finish()?;
        Ok(Self { model, score })
    }

    /// A randomly initialised critic.
    pub fn init_critic(c: &TransformerConfig, device: &B::Device) -> Self {
        Self {
            model: c.init(device),
            score: init_value_head(c.hidden_size, true, device),
        }
    }

    /// The reward model of a checkpoint: a `*ForSequenceClassification` one (`score.weight`
    /// `[1, hidden]`, a bias if it has one), or with `new_head` an LM checkpoint (its LM head
    /// dropped, a score head initialised as transformers initialises one: TRL's way to start a
    /// reward model from an SFT model). Without `new_head`, a checkpoint without a score head is
    /// refused as not a reward model, and a head of several labels as another kind of classifier.
    pub fn reward_from_weights(
        c: &TransformerConfig,
        mut w: WeightMap,
        new_head: bool,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let kind = |message: String, w: &WeightMap| ModelError::Kind {
            source_desc: w.source().to_string(),
            message,
        };
        let score =
            match w.shape("score.weight").map(<[usize]>::to_vec) {
                Some(shape) if shape.len() == 2 && shape[0] != 1 => {
                    return Err(kind(
                        format!(
                        "its score head has {} labels (`score.weight` {shape:?}); a reward model \
                         has one",
                        shape[0]
                    ),
                        &w,
                    ))
                }
                Some(_) => {
                    let bias = w.contains("score.bias");
                    linear(&mut w, "score", c.hidden_size, 1, bias, device)?
                }
                None if new_head => init_value_head(c.hidden_size, false, device),
                None => return Err(kind(
                    "no score head (`score.weight`): not a reward model; a reward model is an HF \
                     `*ForSequenceClassification` checkpoint with one label, as `burn-rlhf rm` \
                     writes"
                        .into(),
                    &w,
                )),
            };
        let model = Transformer::from_weights(c, &mut w, device)?;
        w.take_optional("lm_head.weight", &[c.vocab_size, c.hidden_size])?;
        w.finish()?;
        Ok(Self { model, score })
    }

    /// A randomly initialised reward model.
    pub fn init_reward(c: &TransformerConfig, device: &B::Device) -> Self {
        Self {
            model: c.init(device),
            score: init_value_head(c.hidden_size, false, device),
        }
    }

    /// Every tensor under HF names (`model.*` and `score.*`).
    pub fn export(&self) -> BTreeMap<String, HostTensor> {
        let mut out = BTreeMap::new();
        self.model.export(&mut out);
        export_linear(&LoraLinear::new(self.score.clone()), "score", &mut out);
        out
    }
}
