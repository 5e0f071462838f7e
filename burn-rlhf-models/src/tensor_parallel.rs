//! Megatron-style tensor parallelism of the decoders: each rank of a group of `size` holds
//! `1/size` of every large weight. Attention is split by heads (query heads, and key/value heads
//! when there are at least `size` of them; fewer are kept whole on every rank, each rank
//! attending with the one its query heads share), the MLP and each expert of a mixture by their
//! intermediate width (gate and up by columns, down by rows), and the embeddings and LM head by
//! vocabulary rows. Norms, routers and value heads are whole. Each split block's input passes
//! through [`kernels::tp_copy`] and its output through [`kernels::tp_reduce`], so the forward
//! equals the whole model's and every whole weight gets the whole model's gradient on every rank.
//!
//! Shards are made from and gathered into HF tensor maps ([`CausalLm::export`]): a checkpoint is
//! always the whole model, and loads into any group size.

use std::collections::BTreeMap;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::config::TransformerConfig;
use crate::error::ModelError;
use crate::heads::{CausalLm, ValueModel};
use crate::kernels::{self, DecoderBackend};
use crate::transformer::{reduce_out, FeedForward, Transformer};
use crate::weights::{HostTensor, WeightMap};

pub use crate::tp_group::{LocalTpGroup, TpComm, TpGroup};

/// How a checkpoint tensor is divided among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// The same on every rank.
    Whole,
    /// Consecutive equal parts along this axis of the HF layout (`[out, in]` for a linear
    /// weight).
    Axis(usize),
}

/// The split of the tensor called `name` (HF names) in a model whose key/value projections are
/// whole when `kv_whole`.
fn split_of(name: &str, kv_whole: bool) -> Split {
    let mut parts = name.rsplit('.');
    let _kind = parts.next();
    match parts.next().unwrap_or("") {
        "embed_tokens" | "lm_head" | "q_proj" | "gate_proj" | "up_proj" | "w1" | "w3" => {
            Split::Axis(0)
        }
        "k_proj" | "v_proj" if !kv_whole => Split::Axis(0),
        "o_proj" | "down_proj" | "w2" => Split::Axis(1),
        _ => Split::Whole,
    }
}

/// Whether the key/value heads are too few to split over `size` ranks (each rank then keeps
/// them whole).
fn kv_whole(c: &TransformerConfig, size: usize) -> bool {
    !c.num_key_value_heads.is_multiple_of(size)
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

/// Rank `rank`'s part of the whole model's tensors `full` over `size` ranks.
pub fn shard_weights(
    full: &BTreeMap<String, HostTensor>,
    c: &TransformerConfig,
    rank: usize,
    size: usize,
) -> WeightMap {
    let whole_kv = kv_whole(c, size);
    let mut w = WeightMap::new(format!("tensor-parallel rank {rank} of {size}"));
    for (name, t) in full {
        let part = match split_of(name, whole_kv) {
            Split::Whole => t.clone(),
            Split::Axis(axis) => slice_axis(t, axis, rank, size),
        };
        w.insert(name.clone(), part);
    }
    w
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

/// The whole model's tensors from every rank's `local` ones: an exchange every rank of `tp`
/// makes, in the same (sorted) order.
pub fn gather_weights(
    local: BTreeMap<String, HostTensor>,
    c: &TransformerConfig,
    tp: &TpGroup,
) -> BTreeMap<String, HostTensor> {
    let whole_kv = kv_whole(c, tp.size());
    local
        .into_iter()
        .map(|(name, t)| {
            let t = match split_of(&name, whole_kv) {
                Split::Whole => t,
                Split::Axis(axis) => {
                    let parts = tp.gather(t.data);
                    concat_axis(&t.shape, axis, &parts)
                }
            };
            (name, t)
        })
        .collect()
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

/// Puts the group into every split layer of `model` (built from [`shard_weights`] with
/// [`local_config`]).
fn attach<B: Backend>(
    mut model: Transformer<B>,
    c: &TransformerConfig,
    tp: &TpGroup,
) -> Transformer<B> {
    let whole_kv = kv_whole(c, tp.size());
    for layer in model.layers.iter_mut() {
        let attn = &mut layer.self_attn;
        attn.tp = Some(tp.clone());
        // The head this rank's query heads share: rank r's first query head over the group size.
        attn.kv_head = whole_kv.then(|| tp.rank() * c.num_key_value_heads / tp.size());
        match &mut layer.mlp {
            FeedForward::Dense(m) => m.tp = Some(tp.clone()),
            FeedForward::Sparse(moe) => moe.tp = Some(tp.clone()),
        }
    }
    model.tp = Some(tp.clone());
    model
}

/// This rank's shard of the whole LM `model` (of shape `c`) in the group `tp`. LoRA adapters
/// are not split (refused).
pub fn shard_causal_lm<B: Backend>(
    model: &CausalLm<B>,
    c: &TransformerConfig,
    tp: &TpGroup,
    device: &B::Device,
) -> Result<CausalLm<B>, ModelError> {
    let local = local_config(c, tp.size())?;
    refuse_lora(!model.export_lora().is_empty(), tp.size())?;
    let w = shard_weights(&model.export(), c, tp.rank(), tp.size());
    let shard = CausalLm::from_weights(&local, w, device)?;
    Ok(CausalLm {
        model: attach(shard.model, c, tp),
        ..shard
    })
}

/// This rank's shard of the whole critic `model` (its value head whole).
pub fn shard_value_model<B: Backend>(
    model: &ValueModel<B>,
    c: &TransformerConfig,
    tp: &TpGroup,
    device: &B::Device,
) -> Result<ValueModel<B>, ModelError> {
    let local = local_config(c, tp.size())?;
    let w = shard_weights(&model.export(), c, tp.rank(), tp.size());
    let shard = ValueModel::critic_from_weights(&local, w, device)?;
    Ok(ValueModel {
        model: attach(shard.model, c, tp),
        ..shard
    })
}

/// The parameters of a shard (of a model of shape `c` over `size` ranks) that hold only this
/// rank's part: the ones whose gradient norms add up over the ranks. The others are whole and
/// equal on every rank.
pub fn split_param_ids<B: Backend, M: burn::module::Module<B>>(
    module: &M,
    c: &TransformerConfig,
    size: usize,
) -> std::collections::HashSet<burn::module::ParamId> {
    struct Split {
        path: Vec<String>,
        kv_whole: bool,
        ids: std::collections::HashSet<burn::module::ParamId>,
    }
    impl<B: Backend> burn::module::ModuleVisitor<B> for Split {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            let split = self.path.iter().any(|p| {
                matches!(
                    p.as_str(),
                    "embed_tokens"
                        | "lm_head"
                        | "q_proj"
                        | "gate_proj"
                        | "up_proj"
                        | "o_proj"
                        | "down_proj"
                ) || (!self.kv_whole && matches!(p.as_str(), "k_proj" | "v_proj"))
            });
            if split {
                self.ids.insert(param.id);
            }
        }
    }
    let mut v = Split {
        path: Vec::new(),
        kv_whole: kv_whole(c, size),
        ids: Default::default(),
    };
    module.visit(&mut v);
    v.ids
}

fn refuse_lora(has_lora: bool, size: usize) -> Result<(), ModelError> {
    if has_lora {
        return Err(ModelError::TensorParallel {
            size,
            message: "LoRA adapters are not split across ranks; train LoRA with data parallelism"
                .into(),
        });
    }
    Ok(())
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

    #[test]
    fn names_split_as_megatron() {
        assert_eq!(
            split_of("model.layers.0.self_attn.q_proj.weight", false),
            Split::Axis(0)
        );
        assert_eq!(
            split_of("model.layers.0.self_attn.k_proj.bias", true),
            Split::Whole
        );
        assert_eq!(
            split_of("model.layers.0.self_attn.o_proj.weight", false),
            Split::Axis(1)
        );
        assert_eq!(
            split_of("model.layers.1.block_sparse_moe.experts.3.w2.weight", false),
            Split::Axis(1)
        );
        assert_eq!(
            split_of("model.layers.1.mlp.gate.weight", false),
            Split::Whole
        );
        assert_eq!(split_of("model.embed_tokens.weight", false), Split::Axis(0));
        assert_eq!(split_of("model.norm.weight", false), Split::Whole);
        assert_eq!(split_of("score.weight", false), Split::Whole);
    }
}
