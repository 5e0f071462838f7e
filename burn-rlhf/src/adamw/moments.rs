//! AdamW's per-parameter state, on the device or in host memory (verl's
//! `fsdp_config.optimizer_offload`). Its record is Burn's `AdamWState` field for field, so
//! checkpoints of either optimiser load into the other, offloaded or not.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::{AdaptorRecord, AdaptorRecordV1};
use burn::optim::SimpleOptimizer;
use burn::record::{PrecisionSettings, Record};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Where a parameter's two moments are kept between steps.
#[derive(Clone, Debug)]
pub enum Moments<B: Backend, const D: usize> {
    /// On the parameter's device.
    Device(Tensor<B, D>, Tensor<B, D>),
    /// In host memory (offloaded): uploaded for the parameter's step and read back after it.
    Host(Box<[TensorData; 2]>),
}

/// One parameter's AdamW state: its step count and moments.
#[derive(Clone, Debug)]
pub struct AdamWMoments<B: Backend, const D: usize> {
    /// Steps taken (the bias corrections' `t`).
    pub time: usize,
    /// The first and second moments.
    pub moments: Moments<B, D>,
}

impl<B: Backend, const D: usize> AdamWMoments<B, D> {
    /// The moments on `device`, wherever they were kept.
    pub fn on_device(self, device: &B::Device) -> (Tensor<B, D>, Tensor<B, D>) {
        match self.moments {
            Moments::Device(m, v) => (m, v),
            Moments::Host(host) => {
                let [m, v] = *host;
                (Tensor::from_data(m, device), Tensor::from_data(v, device))
            }
        }
    }

    /// The state after a step, kept in host memory when `offload`.
    pub fn kept(time: usize, m: Tensor<B, D>, v: Tensor<B, D>, offload: bool) -> Self {
        let moments = if offload {
            Moments::Host(Box::new([m.into_data(), v.into_data()]))
        } else {
            Moments::Device(m, v)
        };
        Self { time, moments }
    }

    /// Bytes of the moments on the device and in host memory.
    pub fn bytes(&self) -> StateBytes {
        match &self.moments {
            Moments::Device(m, v) => StateBytes {
                device: tensor_bytes(m) + tensor_bytes(v),
                host: 0,
            },
            Moments::Host(host) => StateBytes {
                device: 0,
                host: host.iter().map(|d| d.bytes.len()).sum(),
            },
        }
    }
}

fn tensor_bytes<B: Backend, const D: usize>(t: &Tensor<B, D>) -> usize {
    t.shape().num_elements() * t.dtype().size()
}

/// Bytes of optimiser state by where they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// On the training device.
    pub device: usize,
    /// In host memory.
    pub host: usize,
}

impl std::ops::Add for StateBytes {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            device: self.device + o.device,
            host: self.host + o.host,
        }
    }
}

/// Burn's `AdaptiveMomentumState` record item, field for field (`TensorData` serialises as
/// Burn's `FloatTensorSerde` does).
#[derive(Clone, Serialize, Deserialize)]
pub struct MomentumItem {
    time: usize,
    moment_1: TensorData,
    moment_2: TensorData,
    max_moment_2: Option<TensorData>,
}

/// Burn's `AdamWState` record item.
#[derive(Clone, Serialize, Deserialize)]
pub struct AdamWMomentsItem {
    momentum: MomentumItem,
}

impl<B: Backend, const D: usize> Record<B> for AdamWMoments<B, D> {
    type Item<S: PrecisionSettings> = AdamWMomentsItem;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        let (m, v) = match self.moments {
            Moments::Device(m, v) => (m.into_data(), v.into_data()),
            Moments::Host(host) => {
                let [m, v] = *host;
                (m, v)
            }
        };
        AdamWMomentsItem {
            momentum: MomentumItem {
                time: self.time,
                moment_1: m.convert::<S::FloatElem>(),
                moment_2: v.convert::<S::FloatElem>(),
                max_moment_2: None,
            },
        }
    }

    /// Loaded into host memory: the first step puts it where the optimiser keeps it, one
    /// parameter at a time, so an offloaded state never passes whole through the device.
    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &B::Device) -> Self {
        let m = item.momentum;
        Self {
            time: m.time,
            moments: Moments::Host(Box::new([
                m.moment_1.convert_dtype(DType::F32),
                m.moment_2.convert_dtype(DType::F32),
            ])),
        }
    }
}

/// Bytes of the state an [`OptimizerAdaptor`] of AdamW keeps, by where it is.
pub fn adamw_state_bytes<O, M, B>(optimizer: &OptimizerAdaptor<O, M, B>) -> StateBytes
where
    B: AutodiffBackend,
    M: burn::module::AutodiffModule<B>,
    O: SimpleOptimizer<B::InnerBackend> + MomentsOf<B::InnerBackend>,
{
    use burn::optim::Optimizer;
    optimizer
        .to_record()
        .into_values()
        .map(|record| {
            let AdaptorRecord::V1(record) = record;
            match record {
                AdaptorRecordV1::Rank0(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank1(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank2(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank3(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank4(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank5(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank6(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank7(s) => O::bytes_of(&s),
                AdaptorRecordV1::Rank8(s) => O::bytes_of(&s),
            }
        })
        .fold(StateBytes::default(), |a, b| a + b)
}

/// An optimiser whose per-parameter state can say where its bytes are.
pub trait MomentsOf<B: Backend>: SimpleOptimizer<B> {
    /// Bytes of one parameter's state.
    fn bytes_of<const D: usize>(state: &Self::State<D>) -> StateBytes;
}
