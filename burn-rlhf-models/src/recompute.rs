//! Layer-level activation checkpointing (HF's and verl's `enable_gradient_checkpointing`): a
//! training pass keeps each decoder layer's input and nothing else of the layers, and its
//! backward recomputes one layer at a time under autodiff, from the last to the first, handing
//! the gradient of each layer's input to the layer below. The activations held at once are the
//! layers' inputs (`layers x [B, L, H]`) and one layer's graph, instead of every layer's graph.
//!
//! Burn cannot run a backward inside another's step (its graph lock is held through the step),
//! so each layer is a backward of its own: `sum(layer(x) * dy)` differentiated at the layer's
//! parameters and at `x`, whose gradient is `dy` exactly. The layer's last product (the MLP's
//! down projection) feeds only that sum, so a dense layer does not compute it
//! ([`backward_pairing`]): the recomputation costs the layer's forward but for
//! its largest product but one. The caller collects each segment's
//! gradients ([`KeptLayers::backward_layers`]); a parameter's gradient is the same sum the whole graph
//! would make.

use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Int, Tensor};

use crate::heads::cast_weights;
use crate::kernels;
use crate::kernels::DecoderBackend;
use crate::rope::Rope;
use crate::tensor_parallel::VocabParallelEmbedding;
use crate::transformer::{
    count_dense_pass, Attend, DecoderLayer, DensePass, FeedForward, PassRows, Transformer,
};

/// What a layer-checkpointed pass kept for its backward ([`Transformer::forward_kept`]).
pub struct KeptLayers<B: Backend> {
    /// The decoder with its f32 weights (a clone shares them): each segment casts what it
    /// recomputes afresh, so no cast's graph node is reached by two backwards.
    decoder: Transformer<B>,
    /// The compute dtype the pass ran in (`None`: the weights' own).
    dtype: Option<FloatDType>,
    input_ids: Tensor<B, 2, Int>,
    pass: DensePass<B>,
    /// Each layer's input, without a graph. `[B, L, H]` each.
    inputs: Vec<Tensor<B, 3>>,
    /// The last layer's output: the leaf the caller's graph (the final norm, the heads, the
    /// loss) starts from.
    output: Tensor<B, 3>,
    /// Each sparse layer's router logits, without a graph, in layer order (`[B * L, experts]`).
    router: Vec<Tensor<B, 2>>,
    /// Per layer: its index in `router` when it is sparse.
    router_slot: Vec<Option<usize>>,
}

/// `module` in the compute dtype.
fn computed<B: Backend, M: Module<B>>(module: M, dtype: Option<FloatDType>) -> M {
    match dtype {
        Some(dtype) => cast_weights(module, dtype),
        None => module,
    }
}

impl<B: DecoderBackend> Transformer<B> {
    /// [`Transformer::forward_routed`] for a training pass with layer-level checkpointing: the
    /// layers run without a graph in `dtype` (the weights' own when `None`), keeping only their
    /// inputs. Returns the last layer's output **before the final norm**, a leaf that requires a
    /// gradient (the caller applies its own, possibly cast, `norm`), and what
    /// [`KeptLayers::backward_layers`] recomputes from. A sparse layer's router logits go to `router`
    /// without a graph: their gradient comes in the layers' backward.
    ///
    /// Shapes: input_ids `[B, L]` → `[B, L, H]`.
    pub fn forward_kept(
        &self,
        dtype: Option<FloatDType>,
        input_ids: Tensor<B, 2, Int>,
        rows: PassRows<'_>,
        router: Option<&mut Vec<Tensor<B, 2>>>,
    ) -> (Tensor<B, 3>, KeptLayers<B>) {
        count_dense_pass();
        let device = input_ids.device();
        let pass = DensePass::of_rows(self, rows, &device);
        let input_ids = rows.input_ids(input_ids);
        let table: VocabParallelEmbedding<B> = computed(self.embed_tokens.clone().no_grad(), dtype);
        let mut x = self.embed_with(&table, input_ids.clone()).detach();
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut kept_router = Vec::new();
        let mut router_slot = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let layer: DecoderLayer<B> = computed(layer.clone().no_grad(), dtype);
            let (rope, attend) = pass.attend(&layer);
            inputs.push(x.clone());
            let mut routed = Vec::new();
            x = layer.forward(x, rope, attend, Some(&mut routed));
            router_slot.push(routed.pop().map(|logits| {
                kept_router.push(logits.detach());
                kept_router.len() - 1
            }));
        }
        if let Some(router) = router {
            router.extend(kept_router.iter().cloned());
        }
        let output = x.detach().require_grad();
        let kept = KeptLayers {
            decoder: self.clone(),
            dtype,
            input_ids,
            pass,
            inputs,
            output: output.clone(),
            router: kept_router,
            router_slot,
        };
        (output, kept)
    }
}

/// `sum(layer.forward(x) ⊙ dy)` as the backward of a recomputed layer needs it
/// ([`crate::recompute`]): its gradients are the layer's for an output gradient `dy`, but the
/// MLP's down projection, whose output feeds nothing else, is not computed (its weight's and
/// input's gradients come from [`kernels::linear_vjp`]), and the value is not the sum.
/// `None` where the down projection's output is read by more than the sum (Gemma's norm
/// after the MLP), or is not one plain product (experts, tensor parallelism, a bias, LoRA).
/// Shapes: x, dy `[B, L, H]` → `[1]`.
fn backward_pairing<B: DecoderBackend>(
    layer: &DecoderLayer<B>,
    x: Tensor<B, 3>,
    rope: &Rope<B>,
    attend: Attend<'_, B>,
    dy: Tensor<B, 3>,
) -> Option<Tensor<B, 1>> {
    let FeedForward::Dense(mlp) = &layer.mlp else {
        return None;
    };
    let down = &mlp.down_proj;
    let plain =
        down.linear.lora.is_none() && down.linear.base.bias.is_none() && down.group.is_none();
    let gemma =
        layer.pre_feedforward_layernorm.is_some() || layer.post_feedforward_layernorm.is_some();
    if !plain || gemma {
        return None;
    }
    let attn = layer
        .self_attn
        .forward(layer.input_layernorm.forward(x.clone()), rope, attend);
    let h = x + attn;
    let hidden = mlp.activations(layer.post_attention_layernorm.forward(h.clone()));
    let [b, l, i] = hidden.dims();
    let width = dy.dims()[2];
    let down_pairing = kernels::linear_vjp(
        hidden.reshape([b * l, i]),
        down.linear.base.weight.val(),
        dy.clone().reshape([b * l, width]),
    );
    Some((h * dy).sum() + down_pairing)
}

impl<B: AutodiffBackend + DecoderBackend> KeptLayers<B> {
    /// The gradient of the last layer's output in `grads`, the backward of the caller's graph
    /// (the final norm, the heads, the loss), taken out of it.
    pub fn output_grad(&self, grads: &mut B::Gradients) -> Option<Tensor<B::InnerBackend, 3>> {
        self.output.grad_remove(grads)
    }

    /// The rest of the backward of a loss through this pass, given its last layer's output's
    /// gradient `dy` ([`KeptLayers::output_grad`]): each layer recomputed from its input, last to
    /// first, then the embeddings. `router_loss` is the part of the loss made from the router
    /// logits (the load-balancing loss times its weight, given every sparse layer's logits):
    /// each sparse layer's recomputation adds it with its own logits live. `segment` receives
    /// each backward's gradients in turn (a parameter's gradient is in one of them, but a tied
    /// embedding's, whose LM-head part is in the caller's backward), with the module it
    /// recomputed: the gradients are those of that module's parameters (the same tensors as the
    /// decoder's, unless the decoder's are lazy: FSDP's gathered copies).
    pub fn backward_layers(
        self,
        mut dy: Option<Tensor<B::InnerBackend, 3>>,
        router_loss: Option<&dyn Fn(&[Tensor<B, 2>]) -> Tensor<B, 1>>,
        mut segment: impl FnMut(B::Gradients, Segment<'_, B>),
    ) {
        for (i, layer) in self.decoder.layers.iter().enumerate().rev() {
            let sparse = router_loss.zip(self.router_slot[i]);
            if dy.is_none() && sparse.is_none() {
                continue;
            }
            let input = self.inputs[i].clone();
            let grad = dy.unwrap_or_else(|| input.zeros_like().inner());
            let x = input.require_grad();
            // Read once, so the cast copy computes with (and differentiates) these tensors.
            let source = layer.clone();
            read_parameters(&source);
            let layer: DecoderLayer<B> = computed(source.clone(), self.dtype);
            let dy_out: Tensor<B, 3> = Tensor::from_inner(grad);
            let (rope, attend) = self.pass.attend(&layer);
            let pairing = backward_pairing(&layer, x.clone(), rope, attend, dy_out.clone());
            let surrogate = pairing.unwrap_or_else(|| {
                let mut routed = Vec::new();
                let (rope, attend) = self.pass.attend(&layer);
                let y = layer.forward(x.clone(), rope, attend, Some(&mut routed));
                let mut surrogate = (y * dy_out).sum();
                if let Some((router_loss, slot)) = sparse {
                    let mut router = self.router.clone();
                    router[slot] = routed.pop().expect("a sparse layer routes");
                    surrogate = surrogate + router_loss(&router);
                }
                surrogate
            });
            let mut grads = surrogate.backward();
            dy = x.grad_remove(&mut grads);
            segment(grads, Segment::Layer(&source));
        }
        let Some(dy) = dy else { return };
        let source = self.decoder.embed_tokens.clone();
        read_parameters(&source);
        let table: VocabParallelEmbedding<B> = computed(source.clone(), self.dtype);
        let x = self.decoder.embed_with(&table, self.input_ids);
        segment(
            (x * Tensor::from_inner(dy)).sum().backward(),
            Segment::Embedding(&source),
        );
    }
}

/// The module a segment of a layer-checkpointed backward recomputed
/// ([`KeptLayers::backward_layers`]).
pub enum Segment<'a, B: Backend> {
    /// A decoder layer, in its own dtype.
    Layer(&'a DecoderLayer<B>),
    /// The token embeddings, in their own dtype.
    Embedding(&'a VocabParallelEmbedding<B>),
}

impl<B: AutodiffBackend> Segment<'_, B> {
    /// The segment's gradients by parameter id (read from the recomputed module's tensors).
    pub fn gradients(&self, grads: B::Gradients) -> burn::optim::GradientsParams {
        match self {
            Self::Layer(layer) => burn::optim::GradientsParams::from_grads(grads, *layer),
            Self::Embedding(table) => burn::optim::GradientsParams::from_grads(grads, *table),
        }
    }
}

/// Reads every float parameter of `module` once: a lazy parameter (gathered on first read,
/// FSDP's) gets its value, so clones of the module share it instead of reading their own.
pub fn read_parameters<B: Backend, M: Module<B>>(module: &M) {
    struct Read;
    impl<B: Backend> burn::module::ModuleVisitor<B> for Read {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Read);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TransformerConfig;
    use crate::heads::CausalLm;
    use crate::hf_config::HfConfig;
    use crate::routing::load_balancing_loss;
    use burn::backend::{Autodiff, Flex};
    use burn::module::{ModuleVisitor, Param, ParamId};
    use burn::tensor::TensorData;
    use std::collections::BTreeMap;

    type A = Autodiff<Flex>;

    /// Every float parameter's gradient by id, as host vectors.
    struct Collect<'a> {
        grads: &'a <A as AutodiffBackend>::Gradients,
        out: BTreeMap<ParamId, Vec<f32>>,
    }

    impl ModuleVisitor<A> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            if let Some(g) = param.val().grad(self.grads) {
                let g: Vec<f32> = g.into_data().convert::<f32>().to_vec().unwrap();
                self.out
                    .entry(param.id)
                    .and_modify(|sum| sum.iter_mut().zip(&g).for_each(|(s, v)| *s += v))
                    .or_insert(g);
            }
        }
    }

    fn grads_of(
        model: &CausalLm<A>,
        grads: &<A as AutodiffBackend>::Gradients,
    ) -> BTreeMap<ParamId, Vec<f32>> {
        let mut c = Collect {
            grads,
            out: BTreeMap::new(),
        };
        model.visit(&mut c);
        c.out
    }

    /// A loss that reads every position's logits, with weights so no two positions count alike,
    /// plus the load-balancing loss of a sparse model.
    fn loss_of(
        model: &CausalLm<A>,
        hidden: Tensor<A, 3>,
        router: &[Tensor<A, 2>],
        mask: &[Vec<i64>],
    ) -> Tensor<A, 1> {
        let logits = model.logits(hidden);
        let [b, l, v] = logits.dims();
        let w: Vec<f32> = (0..b * l * v)
            .map(|i| ((i * 7919) % 13) as f32 / 13.0 - 0.4)
            .collect();
        let w = Tensor::<A, 3>::from_data(TensorData::new(w, [b, l, v]), &logits.device());
        let mut loss = (burn::tensor::activation::log_softmax(logits, 2) * w).sum();
        if !router.is_empty() {
            loss = loss + load_balancing_loss(router, 2, mask).mul_scalar(0.3);
        }
        loss
    }

    /// The gradients of a loss through a layer-checkpointed pass equal the whole graph's, bit for
    /// bit (the same operations on the same shapes, and a tied embedding's two parts summed in
    /// the same order), for a
    /// dense Llama with tied embeddings, a Gemma 3 with sliding-window layers, and a
    /// mixture-of-experts model whose load-balancing loss joins the loss (its router's gradient
    /// comes in the layers' recomputation).
    #[test]
    fn recomputed_layers_give_the_whole_graphs_gradients() {
        let device = Default::default();
        let ids = [[0i64, 5, 6, 7, 8, 9, 2], [3, 4, 5, 6, 7, 1, 0]];
        let mask = vec![vec![0, 1, 1, 1, 1, 1, 1], vec![1, 1, 1, 1, 1, 1, 0]];
        let positions = vec![vec![0, 0, 1, 2, 3, 4, 5], vec![0, 1, 2, 3, 4, 5, 5]];
        let input_ids =
            Tensor::<A, 2, Int>::from_data(TensorData::new(ids.concat(), [2, 7]), &device);
        let shape = serde_json::json!({
            "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 4, "max_position_embeddings": 64, "tie_word_embeddings": true,
        });
        let config = |extra: serde_json::Value| -> TransformerConfig {
            let mut json = shape.clone();
            json.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let hf: HfConfig = serde_json::from_value(json).unwrap();
            hf.decoder(std::path::Path::new("test")).unwrap()
        };
        for (name, config) in [
            ("llama", config(serde_json::json!({"model_type": "llama"}))),
            (
                "gemma3",
                config(serde_json::json!({
                    "model_type": "gemma3_text", "sliding_window": 3,
                    "sliding_window_pattern": 2, "query_pre_attn_scalar": 4,
                    "final_logit_softcapping": 30.0,
                })),
            ),
            (
                "qwen3_moe",
                config(serde_json::json!({
                    "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 8, "norm_topk_prob": true,
                    "output_router_logits": true, "tie_word_embeddings": false,
                })),
            ),
        ] {
            let model = config.init_causal_lm::<A>(&device);
            let mut router = Vec::new();
            let hidden = model.model.forward_routed(
                input_ids.clone(),
                &mask,
                &positions,
                None,
                Some(&mut router),
            );
            let whole = grads_of(&model, &loss_of(&model, hidden, &router, &mask).backward());

            let mut router = Vec::new();
            let rows = PassRows {
                attention_mask: &mask,
                position_ids: &positions,
                packed: None,
            };
            let (last, kept) =
                model
                    .model
                    .forward_kept(None, input_ids.clone(), rows, Some(&mut router));
            let hidden = model.model.norm.forward(last);
            let loss = loss_of(&model, hidden, &router, &mask);
            let aux = |r: &[Tensor<A, 2>]| load_balancing_loss(r, 2, &mask).mul_scalar(0.3);
            let sparse = !router.is_empty();
            let mut kept_grads: BTreeMap<ParamId, Vec<f32>> = BTreeMap::new();
            let mut add = |g: <A as AutodiffBackend>::Gradients| {
                for (id, v) in grads_of(&model, &g) {
                    kept_grads
                        .entry(id)
                        .and_modify(|s| s.iter_mut().zip(&v).for_each(|(s, v)| *s += v))
                        .or_insert(v);
                }
            };
            let mut grads = loss.backward();
            let dy = kept.output_grad(&mut grads);
            add(grads);
            kept.backward_layers(dy, sparse.then_some(&aux as _), |g, _| add(g));
            assert_eq!(
                whole.keys().collect::<Vec<_>>(),
                kept_grads.keys().collect::<Vec<_>>(),
                "{name}: the same parameters get gradients"
            );
            for (id, want) in &whole {
                assert_eq!(&kept_grads[id], want, "{name}: parameter {id}");
            }
        }
    }
}
