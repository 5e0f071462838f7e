//! The reference worker: the frozen reference policy (verl's `ref` role), held as
//! `actor_rollout_ref.ref.*` says (its dtype, offloaded to host memory between passes, or
//! FSDP-sharded), and its log-prob pass.

use burn::tensor::FloatDType;
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use super::passes::{PassPlan, Passes, Rows};
use crate::backend::LearnerBackend;
use crate::config::Settings;
use crate::distributed::fsdp::ShardGroups;
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::offload::Parked;

/// What the reference reads of the settings.
#[derive(Debug, Clone)]
struct ReferenceSlice {
    plan: PassPlan,
    /// `ref.fsdp_config.model_dtype`: the dtype its weights are held in.
    held: Option<FloatDType>,
    /// `model.dtype`: the dtype its pass computes in.
    compute: Option<FloatDType>,
    fsdp: Option<crate::config::FsdpSharding>,
    param_offload: bool,
}

impl ReferenceSlice {
    fn of(settings: &Settings) -> Self {
        Self {
            plan: PassPlan {
                micro: settings.ref_micro_batch_size,
                max_tokens: settings.ref_max_token_len,
                key: "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            },
            held: settings.ref_dtype,
            compute: settings.model.dtype,
            fsdp: settings.ref_fsdp,
            param_offload: settings.ref_param_offload,
        }
    }
}

/// The frozen reference policy of one rank.
pub(crate) struct ReferenceWorker<B: LearnerBackend> {
    model: Parked<B::InnerBackend, CausalLm<B::InnerBackend>>,
    /// The step it was last replaced by the actor (`trainer.ref_update_freq`); `None`: the
    /// starting policy still.
    pub refreshed_at: Option<usize>,
    slice: ReferenceSlice,
}

impl<B: LearnerBackend> ReferenceWorker<B> {
    /// `model` held as `settings` say on this rank (`dp`'s FSDP groups when sharded).
    pub fn hold(
        model: CausalLm<B::InnerBackend>,
        settings: &Settings,
        dp: &DataParallel,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let slice = ReferenceSlice::of(settings);
        Ok(Self {
            model: Self::park(model, &slice, dp, device)?,
            refreshed_at: None,
            slice,
        })
    }

    fn park(
        model: CausalLm<B::InnerBackend>,
        slice: &ReferenceSlice,
        dp: &DataParallel,
        device: &B::Device,
    ) -> Result<Parked<B::InnerBackend, CausalLm<B::InnerBackend>>, TrainError> {
        let model = match slice.held {
            Some(dtype) => model.cast(dtype),
            None => model,
        };
        match slice.fsdp {
            Some(fsdp) if dp.mesh.shards_parameters(false) => {
                let groups = ShardGroups::of_ranks(dp, fsdp.group_size, fsdp.param_offload)
                    .map_err(|reason| {
                        TrainError::config("actor_rollout_ref.ref.fsdp_config.fsdp_size", reason)
                    })?;
                Ok(Parked::sharded(model, groups, &device.clone().into()))
            }
            _ => Ok(Parked::new(model, slice.param_offload)),
        }
    }

    /// Replaces the policy with `model` (SPIN's opponent, or a resumed refreshed reference),
    /// refreshed at `step`.
    pub fn replace(
        &mut self,
        model: CausalLm<B::InnerBackend>,
        step: usize,
        dp: &DataParallel,
        device: &B::Device,
    ) -> Result<(), TrainError> {
        self.model = Self::park(model, &self.slice, dp, device)?;
        self.refreshed_at = Some(step);
        Ok(())
    }

    /// The policy on the device (a copy uploaded from host memory when offloaded, gathered when
    /// sharded: a collective then).
    pub fn on_device(&self, device: &B::Device) -> CausalLm<B::InnerBackend> {
        self.model.on_device(device)
    }

    /// Bytes of its weights on the device and in host memory.
    pub fn bytes(&self) -> (usize, usize) {
        self.model.bytes()
    }

    /// Its log-probs of the batch's response tokens, in `model.dtype` (the old-log-prob pass's).
    pub fn log_probs(
        &self,
        passes: &Passes<'_, B>,
        batch: &RolloutBatch,
    ) -> Result<Rows, TrainError> {
        // An offloaded reference is uploaded for this pass and freed after it.
        let model = self.on_device(passes.device);
        let model = match self.slice.compute {
            Some(dtype) => model.cast(dtype),
            None => model,
        };
        let mut out = passes.log_probs(&model, batch, self.slice.plan, false)?;
        Ok(out.swap_remove(0))
    }
}
