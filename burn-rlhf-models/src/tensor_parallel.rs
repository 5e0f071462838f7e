//! Megatron-style tensor parallelism as layer types: each rank of a group of `size` holds `1/size`
//! of every large weight. [`ColumnParallelLinear`] holds its rank's output features (query,
//! key/value when there are at least `size` heads, gate and up projections: split by heads or by
//! intermediate width), [`RowParallelLinear`] its input features (output and down projections,
//! whose partial outputs are summed over the group), [`VocabParallelEmbedding`] its consecutive
//! rows of the vocabulary (the embeddings, and the LM head as a column-parallel layer). Norms,
//! routers and value heads stay whole. A split block's input passes through [`copy_in`] (Megatron's
//! `f`: identity forward, the gradient summed over the group) and its output through
//! [`reduce_out`] (`g`: the sum forward), so the forward equals the whole model's and every whole
//! weight gets the whole model's gradient on every rank.
//!
//! Each layer is built from the whole model's tensors by cutting its rank's part at load, as
//! candle's `TensorParallelColumnLinear::load` does, and exports the whole tensor by gathering the
//! group's parts: a checkpoint is always the whole model, and loads into any group size.

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::config::TransformerConfig;
use crate::error::ModelError;
use crate::kernels::{self, DecoderBackend};
use crate::lora::LoraLinear;
use crate::weights::{HostTensor, WeightMap};

pub use crate::collective::{Collective, CollectiveError, LocalTpGroup, Solo, TpGroup};

/// Megatron's copy into a tensor-parallel region when there is a group (see
/// [`kernels::tp_copy`]). Shapes: any → the same.
pub fn copy_in<B: DecoderBackend, const D: usize>(
    x: Tensor<B, D>,
    group: Option<&TpGroup>,
) -> Tensor<B, D> {
    match group {
        Some(g) => kernels::tp_copy(x, g),
        None => x,
    }
}

/// Megatron's reduction out of a tensor-parallel region when there is a group (see
/// [`kernels::tp_reduce`]). Shapes: any → the same.
pub fn reduce_out<B: DecoderBackend, const D: usize>(
    x: Tensor<B, D>,
    group: Option<&TpGroup>,
) -> Tensor<B, D> {
    match group {
        Some(g) => kernels::tp_reduce(x, g),
        None => x,
    }
}

/// Whether the key/value heads are too few to split over `size` ranks (each rank then keeps
/// them whole and attends with the one its query heads share).
pub fn kv_whole(c: &TransformerConfig, size: usize) -> bool {
    !c.num_key_value_heads.is_multiple_of(size)
}

/// The key/value head a rank attends with when they are whole ([`kv_whole`]): the one its first
/// query head uses.
pub fn shared_kv_head(c: &TransformerConfig, group: &TpGroup) -> usize {
    group.rank() * c.num_key_value_heads / group.size()
}

/// One rank's shape of `c` over `size` ranks: its heads, key/value heads, intermediate widths
/// and vocabulary rows. Refuses what does not divide, and biases of the row-split projections
/// (each rank would add them).
pub fn local_config(c: &TransformerConfig, size: usize) -> Result<TransformerConfig, ModelError> {
    let fail = |message: String| ModelError::TensorParallel { size, message };
    let divides = |what: &str, n: usize| {
        if n.is_multiple_of(size) {
            Ok(n / size)
        } else {
            Err(fail(format!("{what} ({n}) is not a multiple of it")))
        }
    };
    let mut local = c.clone();
    local.num_attention_heads = divides("num_attention_heads", c.num_attention_heads)?;
    if kv_whole(c, size) {
        if !size.is_multiple_of(c.num_key_value_heads) {
            return Err(fail(format!(
                "num_key_value_heads ({}) neither divides it nor is a multiple of it",
                c.num_key_value_heads
            )));
        }
    } else {
        local.num_key_value_heads = c.num_key_value_heads / size;
    }
    local.intermediate_size = divides("intermediate_size", c.intermediate_size)?;
    local.vocab_size = divides("vocab_size", c.vocab_size)?;
    if let Some(moe) = local.moe.as_mut() {
        moe.expert_intermediate_size =
            divides("moe_intermediate_size", moe.expert_intermediate_size)?;
    }
    if c.o_bias || c.mlp_bias {
        return Err(fail(
            "the model's o_proj or MLP projections have biases; a row-split projection's bias is \
             not supported"
                .into(),
        ));
    }
    Ok(local)
}

/// The key/value shape one rank's KV cache holds (`num_key_value_heads`: the heads its attention
/// reads: its share, or the one head it uses when they are whole).
pub fn cache_config(c: &TransformerConfig, size: usize) -> Result<TransformerConfig, ModelError> {
    let mut local = local_config(c, size)?;
    if kv_whole(c, size) {
        local.num_key_value_heads = 1;
    }
    Ok(local)
}

/// Part `rank` of `size` of `t` along `axis` (row-major).
fn slice_axis(t: &HostTensor, axis: usize, rank: usize, size: usize) -> HostTensor {
    let outer: usize = t.shape[..axis].iter().product();
    let inner: usize = t.shape[axis + 1..].iter().product();
    let n = t.shape[axis] / size;
    let mut data = Vec::with_capacity(outer * n * inner);
    for o in 0..outer {
        let start = (o * t.shape[axis] + rank * n) * inner;
        data.extend_from_slice(&t.data[start..start + n * inner]);
    }
    let mut shape = t.shape.clone();
    shape[axis] = n;
    HostTensor { shape, data }
}

/// The parts (each of `shape`) side by side along `axis`.
fn concat_axis(shape: &[usize], axis: usize, parts: &[Vec<f32>]) -> HostTensor {
    let outer: usize = shape[..axis].iter().product();
    let block = shape[axis..].iter().product::<usize>();
    let mut data = Vec::with_capacity(block * outer * parts.len());
    for o in 0..outer {
        for p in parts {
            data.extend_from_slice(&p[o * block..(o + 1) * block]);
        }
    }
    let mut full = shape.to_vec();
    full[axis] *= parts.len();
    HostTensor { shape: full, data }
}

/// This rank's part of the whole tensor `name` (of shape `whole`) along `axis`: the whole tensor
/// without a group.
fn take_part(
    w: &mut WeightMap,
    name: &str,
    whole: &[usize],
    axis: usize,
    group: Option<&TpGroup>,
) -> Result<HostTensor, ModelError> {
    let t = w.take(name, whole)?;
    Ok(match group {
        Some(g) => slice_axis(&t, axis, g.rank(), g.size()),
        None => t,
    })
}

/// The whole tensor from every rank's part `t` along `axis` (an exchange each rank of the group
/// makes); `t` itself without a group.
fn gather_part(t: HostTensor, axis: usize, group: Option<&TpGroup>) -> HostTensor {
    match group {
        Some(g) => {
            let shape = t.shape.clone();
            concat_axis(&shape, axis, &g.gather(t.data))
        }
        None => t,
    }
}

/// A linear layer of `[d_in, d_out]` features from HF `{prefix}.weight` (`[out, in]`, cut along
/// `axis` of that layout for this rank) and, when `bias`, `{prefix}.bias` (cut with the output
/// features).
fn load_linear<B: Backend>(
    w: &mut WeightMap,
    prefix: &str,
    [d_in, d_out]: [usize; 2],
    bias: bool,
    (axis, group): (usize, Option<&TpGroup>),
    device: &B::Device,
) -> Result<LoraLinear<B>, ModelError> {
    let weight = take_part(w, &format!("{prefix}.weight"), &[d_out, d_in], axis, group)?;
    let bias = bias
        .then(|| {
            let bias_group = group.filter(|_| axis == 0);
            take_part(w, &format!("{prefix}.bias"), &[d_out], 0, bias_group)
        })
        .transpose()?;
    Ok(LoraLinear::from_hf(weight, bias, device))
}

/// A linear layer whose output features are split over the group (Megatron's
/// `ColumnParallelLinear`, candle's `TensorParallelColumnLinear`): its output is this rank's
/// part. Its input must be in the region ([`ColumnParallelLinear::copy_in`], once for the
/// columns that share it). Without a group, a whole layer.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// This rank's output features (Burn layout `[in, out / size]`).
    pub linear: LoraLinear<B>,
    /// The ranks the output features are split over.
    #[module(skip)]
    pub group: Option<TpGroup>,
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// A whole layer.
    pub fn whole(linear: LoraLinear<B>) -> Self {
        Self {
            linear,
            group: None,
        }
    }

    /// This rank's part of the HF layer `{prefix}` of `shape` `[d_in, d_out]` (whole): its rows
    /// of the weight and the bias.
    pub fn load(
        w: &mut WeightMap,
        prefix: &str,
        shape: [usize; 2],
        bias: bool,
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            linear: load_linear(w, prefix, shape, bias, (0, group), device)?,
            group: group.cloned(),
        })
    }

    /// The whole layer's HF tensors under `prefix` (the group's parts gathered: every rank of
    /// the group calls it).
    pub fn export(&self, prefix: &str, out: &mut std::collections::BTreeMap<String, HostTensor>) {
        let (weight, bias) = self.linear.to_hf();
        let group = self.group.as_ref();
        out.insert(format!("{prefix}.weight"), gather_part(weight, 0, group));
        if let Some(b) = bias {
            out.insert(format!("{prefix}.bias"), gather_part(b, 0, group));
        }
    }
}

impl<B: DecoderBackend> ColumnParallelLinear<B> {
    /// Megatron's `f` for this layer's group: `x` as the split layers' input. Shapes: any → the
    /// same.
    pub fn copy_in<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        copy_in(x, self.group.as_ref())
    }

    /// This rank's output features. Shapes: `[.., in]` (in the region) → `[.., out / size]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.linear.forward(x)
    }
}

/// A linear layer whose input features are split over the group (Megatron's
/// `RowParallelLinear`): each rank multiplies its part of the input, and the partial outputs are
/// summed over the group unless the caller sums several at once (`reduce_results: false`, a
/// mixture's experts). Without a group, a whole layer.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// This rank's input features (Burn layout `[in / size, out]`).
    pub linear: LoraLinear<B>,
    /// The ranks the input features are split over.
    #[module(skip)]
    pub group: Option<TpGroup>,
    /// Sum the output over the group here (vLLM's `reduce_results`).
    #[module(skip)]
    pub reduce_results: bool,
}

impl<B: Backend> RowParallelLinear<B> {
    /// A whole layer.
    pub fn whole(linear: LoraLinear<B>) -> Self {
        Self {
            linear,
            group: None,
            reduce_results: true,
        }
    }

    /// This rank's part of the HF layer `{prefix}` of `shape` `[d_in, d_out]` (whole): its
    /// columns of the weight. A bias would be added by every rank: refused under a group.
    pub fn load(
        w: &mut WeightMap,
        prefix: &str,
        shape: [usize; 2],
        bias: bool,
        (group, reduce_results): (Option<&TpGroup>, bool),
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        if let (true, Some(g)) = (bias, group) {
            return Err(ModelError::TensorParallel {
                size: g.size(),
                message: format!(
                    "{prefix} has a bias; a row-split projection's bias is not supported"
                ),
            });
        }
        Ok(Self {
            linear: load_linear(w, prefix, shape, bias, (1, group), device)?,
            group: group.cloned(),
            reduce_results,
        })
    }

    /// The whole layer's HF tensors under `prefix` (gathered as [`ColumnParallelLinear::export`]).
    pub fn export(&self, prefix: &str, out: &mut std::collections::BTreeMap<String, HostTensor>) {
        let (weight, bias) = self.linear.to_hf();
        out.insert(
            format!("{prefix}.weight"),
            gather_part(weight, 1, self.group.as_ref()),
        );
        if let Some(b) = bias {
            out.insert(format!("{prefix}.bias"), b);
        }
    }
}

impl<B: DecoderBackend> RowParallelLinear<B> {
    /// Shapes: `[.., in / size]` → `[.., out]` (this rank's partial sum when not
    /// `reduce_results`).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let y = self.linear.forward(x);
        match self.reduce_results {
            true => reduce_out(y, self.group.as_ref()),
            false => y,
        }
    }
}

/// Token embeddings whose vocabulary rows are split over the group (Megatron's
/// `VocabParallelEmbedding`): each rank looks up the tokens of its consecutive `1/size` of the
/// vocabulary (zeros for the others) and the rows are summed over the group. A tied LM head reads
/// the same rows. Without a group, the whole table.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// This rank's rows, `[vocab / size, hidden]` (HF's `embed_tokens.weight`).
    pub weight: Param<Tensor<B, 2>>,
    /// The ranks the vocabulary is split over.
    #[module(skip)]
    pub group: Option<TpGroup>,
}

impl<B: Backend> VocabParallelEmbedding<B> {
    /// A whole table.
    pub fn whole(weight: Tensor<B, 2>) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            group: None,
        }
    }

    /// This rank's rows of the HF table `name` (`[vocab, hidden]`).
    pub fn load(
        w: &mut WeightMap,
        name: &str,
        [vocab, hidden]: [usize; 2],
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let t = take_part(w, name, &[vocab, hidden], 0, group)?;
        let rows = t.shape[0];
        Ok(Self {
            weight: Param::from_tensor(Tensor::from_data(
                TensorData::new(t.data, [rows, hidden]),
                device,
            )),
            group: group.cloned(),
        })
    }

    /// The whole table (gathered as [`ColumnParallelLinear::export`]), `[vocab, hidden]`.
    pub fn export(&self) -> HostTensor {
        let w = self.weight.val();
        let shape = w.dims().to_vec();
        let data = kernels::reference::host_f32(w);
        gather_part(HostTensor { shape, data }, 0, self.group.as_ref())
    }

    /// The vocabulary size (every rank's rows together).
    pub fn vocab_size(&self) -> usize {
        self.weight.dims()[0] * self.group.as_ref().map_or(1, TpGroup::size)
    }
}

impl<B: DecoderBackend> VocabParallelEmbedding<B> {
    /// Shapes: `[B, L]` → `[B, L, H]`.
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let table = self.weight.val();
        // Burn's embedding operation (as `nn::Embedding`): its backward is the backend's own,
        // deterministic where a select's scatter-add may not be.
        let lookup = |ids: Tensor<B, 2, Int>| burn::tensor::module::embedding(table.clone(), ids);
        match &self.group {
            None => lookup(input_ids),
            Some(group) => {
                let [b, l] = input_ids.dims();
                let [local, h] = table.dims();
                let ids = input_ids.sub_scalar((group.rank() * local) as i64);
                let outside = ids
                    .clone()
                    .lower_elem(0)
                    .bool_or(ids.clone().greater_equal_elem(local as i64));
                let x = lookup(ids.mask_fill(outside.clone(), 0));
                let x = x.mask_fill(outside.unsqueeze_dim::<3>(2).expand([b, l, h]), 0.0);
                kernels::tp_reduce(x, group)
            }
        }
    }
}

/// A model whose parameters may be split over a tensor-parallel group: which of them hold only
/// this rank's part (their gradient norms add up over the ranks; the others are whole and equal
/// on every rank).
pub trait TensorParallelModule {
    /// The split parameters (none without a group).
    fn split_param_ids(&self) -> HashSet<ParamId>;
}

/// The ids of every float parameter of `module` (a split layer's).
pub(crate) fn param_ids<B: Backend, M: Module<B>>(module: &M, into: &mut HashSet<ParamId>) {
    struct Ids<'a>(&'a mut HashSet<ParamId>);
    impl<B: Backend> ModuleVisitor<B> for Ids<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.insert(param.id);
        }
    }
    module.visit(&mut Ids(into));
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// Adds this layer's parameters to `split` when it is split.
    pub fn split_params(&self, split: &mut HashSet<ParamId>) {
        if self.group.is_some() {
            param_ids(self, split);
        }
    }
}

impl<B: Backend> RowParallelLinear<B> {
    /// Adds this layer's weight to `split` when it is split (a bias stays whole).
    pub fn split_params(&self, split: &mut HashSet<ParamId>) {
        if self.group.is_some() {
            param_ids(&self.linear.base.weight, split);
        }
    }
}

impl<B: Backend> VocabParallelEmbedding<B> {
    /// Adds the table to `split` when it is split.
    pub fn split_params(&self, split: &mut HashSet<ParamId>) {
        if self.group.is_some() {
            split.insert(self.weight.id);
        }
    }
}

/// Log-probs of `targets` and entropies of the tempered distribution (`logits / temperature`)
/// from this rank's share of the vocabulary's logits, without gathering them: the maximum,
/// the sum of exponentials, the target's logit and `Σ p·z` are each summed over the group.
/// Without a group the same computation on the whole vocabulary.
///
/// Shapes: local logits `[N, V / size]` (f32), targets `[N]` → (entropies `[N]`, log-probs
/// `[N]`).
pub fn vocab_parallel_entropy_and_logprobs<B: DecoderBackend>(
    local_logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    temperature: f64,
    tp: Option<&TpGroup>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [n, v] = local_logits.dims();
    let device = local_logits.device();
    let z = local_logits.div_scalar(temperature);
    // A shared shift for stability: the largest logit of every rank, as a constant.
    let local_max = z.clone().detach().max_dim(1).reshape([n]);
    let max = match tp {
        Some(tp) => {
            let all = tp.gather(kernels::reference::host_f32(local_max));
            let max: Vec<f32> = (0..n)
                .map(|i| all.iter().map(|p| p[i]).fold(f32::NEG_INFINITY, f32::max))
                .collect();
            Tensor::<B, 1>::from_data(TensorData::new(max, [n]), &device)
        }
        None => local_max,
    };
    let reduce = |x: Tensor<B, 1>| reduce_out(x, tp);
    let shifted = z.clone() - max.clone().reshape([n, 1]);
    let exp = shifted.exp();
    let sum = reduce(exp.clone().sum_dim(1).reshape([n]));
    let lse = sum.clone().log() + max;
    // The target's logit, from the rank whose share holds it.
    let start = tp.map_or(0, |tp| tp.rank() * v) as i64;
    let local = targets.sub_scalar(start);
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(v as i64));
    let index = local.mask_fill(outside.clone(), 0).reshape([n, 1]);
    let picked = z
        .clone()
        .gather(1, index)
        .reshape([n])
        .mask_fill(outside, 0.0);
    let logprobs = reduce(picked) - lse.clone();
    let expected = reduce((exp * z).sum_dim(1).reshape([n])) / sum;
    (lse - expected, logprobs)
}

/// [`vocab_parallel_entropy_and_logprobs`] from the hidden states and this rank's rows of the LM
/// head (`weight`, `[V / size, H]`), the logits made `chunk` rows at a time forward and backward
/// ([`kernels::vocab_stats`]): neither `[N, V]` nor `[N, V / size]` logits exist at once. Each
/// rank's statistics (log-sum-exp, `Σ p·z`, the label's logit) combine into the whole
/// vocabulary's: the other ranks' are gathered as constants, this rank's stay live, so each
/// rank's backward gives its own rows' gradient (and `hidden`'s part, summed over the group by
/// the copy `hidden` came through).
///
/// Shapes: hidden `[N, H]` (in the region), weight `[V / size, H]`, targets `[N]` → (entropies
/// `[N]`, log-probs `[N]`).
pub fn vocab_parallel_linear_entropy_and_logprobs<B: DecoderBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    (temperature, chunk): (f64, usize),
    group: &TpGroup,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let n = hidden.dims()[0];
    let device = hidden.device();
    let start = group.rank() * weight.dims()[0];
    let stats = kernels::vocab_stats(hidden, weight, targets, (start, temperature, chunk));
    let all = group.gather(kernels::reference::host_f32(stats.clone().detach()));
    let column =
        |stats: &Tensor<B, 2>, c: usize| stats.clone().slice([0..n, c..c + 1]).reshape([n]);
    let (lse_r, e_r, pick_r) = (column(&stats, 0), column(&stats, 1), column(&stats, 2));
    // The largest log-sum-exp of every rank as a shared shift; the others' terms as constants.
    let mut shift = vec![f32::NEG_INFINITY; n];
    let (mut others_sum, mut others_e, mut others_pick) =
        (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    for part in &all {
        for i in 0..n {
            shift[i] = shift[i].max(part[3 * i]);
        }
    }
    for (_, part) in all.iter().enumerate().filter(|(q, _)| *q != group.rank()) {
        for i in 0..n {
            let w = (part[3 * i] - shift[i]).exp();
            others_sum[i] += w;
            others_e[i] += w * part[3 * i + 1];
            others_pick[i] += part[3 * i + 2];
        }
    }
    let constant = |v: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(v, [n]), &device);
    let shift = constant(shift);
    let own = (lse_r - shift.clone()).exp();
    let sum = own.clone() + constant(others_sum);
    let lse = sum.clone().log() + shift;
    let expected = (own * e_r + constant(others_e)) / sum;
    let logprobs = pick_r + constant(others_pick) - lse.clone();
    (lse - expected, logprobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slicing_and_concatenating_are_inverse() {
        let t = HostTensor {
            shape: vec![4, 6],
            data: (0..24).map(|x| x as f32).collect(),
        };
        for axis in [0, 1] {
            let parts: Vec<Vec<f32>> = (0..2).map(|r| slice_axis(&t, axis, r, 2).data).collect();
            let mut shape = t.shape.clone();
            shape[axis] /= 2;
            assert_eq!(concat_axis(&shape, axis, &parts), t, "axis {axis}");
        }
        // Columns 3..6 of each row.
        assert_eq!(slice_axis(&t, 1, 1, 2).data[..3], [3.0, 4.0, 5.0]);
    }
}
