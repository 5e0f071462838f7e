//! [`DecoderBackend`] under autodiff: each operation's forward runs on the inner backend (kernel
//! or reference) and is registered as one node whose backward is the inner backend's
//! `*_backward`, so training never keeps the attention probabilities or any intermediate of a
//! fused operation.
//!
//! The nodes take part in Burn's gradient checkpointing as its own operations do: RMSNorm, SwiGLU
//! and the rotary embedding are memory-bound, with a retro-forward, so a checkpointing backend
//! recomputes their outputs in the backward pass instead of keeping them; attention is
//! compute-bound and keeps its output and log-sum-exp, reading its inputs through the
//! checkpointer (kept, or recomputed from the projections).

use std::marker::PhantomData;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::{AttentionMask, DecoderBackend, RmsNormParams};
use crate::collective::TpGroup;

type Ad<B, C> = Autodiff<B, C>;

fn inner<B: DecoderBackend, C: CheckpointStrategy>(t: FloatTensor<Ad<B, C>>) -> FloatTensor<B> {
    <Ad<B, C> as AutodiffBackend>::inner(t)
}

fn outer<B: DecoderBackend, C: CheckpointStrategy>(t: FloatTensor<B>) -> FloatTensor<Ad<B, C>> {
    <Ad<B, C> as AutodiffBackend>::from_inner(t)
}

/// Registers each gradient for its parent when the parent requires one.
macro_rules! register {
    ($B:ty, $parents:expr, $grads:expr, $into:expr) => {
        for (parent, g) in $parents.into_iter().zip($grads) {
            if let Some(node) = parent {
                $into.register::<$B>(node.id, g);
            }
        }
    };
}

#[derive(Debug)]
struct AttentionBackward(AttentionMask);

impl<B: DecoderBackend> Backward<B, 3> for AttentionBackward {
    type State = ([NodeId; 3], FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let ([q, k, v], out, lse) = ops.state;
        let [q, k, v] = [q, k, v].map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let (dq, dk, dv) = B::dec_attention_backward(q, k, v, out, lse, grad, &self.0);
        register!(B, ops.parents, [dq, dk, dv], grads);
    }
}

#[derive(Debug)]
struct LinearBackward;

impl<B: DecoderBackend> Backward<B, 2> for LinearBackward {
    type State = [NodeId; 2];

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [x, weight] = ops
            .state
            .map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let (dx, dw) = B::dec_linear_backward(grad, x, weight);
        register!(B, ops.parents, [dx, dw], grads);
    }
}

/// The gradients of `x · weight + bias`: the product's, and the bias's `Σ_rows grad` (in f32,
/// then the bias's dtype).
#[derive(Debug)]
struct LinearBiasBackward(burn::tensor::DType);

impl<B: DecoderBackend> Backward<B, 3> for LinearBiasBackward {
    type State = [NodeId; 2];

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, c: &mut Checkpointer) {
        use burn::tensor::{DType, Tensor, TensorPrimitive};
        let grad = grads.consume::<B>(&ops.node);
        let [x, weight] = ops
            .state
            .map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let g = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad.clone()));
        let width = g.dims()[1];
        let db = g.cast(DType::F32).sum_dim(0).reshape([width]).cast(self.0);
        let (dx, dw) = B::dec_linear_backward(grad, x, weight);
        register!(
            B,
            ops.parents,
            [dx, dw, db.into_primitive().tensor()],
            grads
        );
    }
}

#[derive(Debug)]
struct LinearVjpBackward;

impl<B: DecoderBackend> Backward<B, 2> for LinearVjpBackward {
    type State = ([NodeId; 2], FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        // The pairing's own gradient is 1 under the sum it is made for; `dy` is the product's.
        let _ = grads.consume::<B>(&ops.node);
        let ([x, weight], dy) = ops.state;
        let [x, weight] = [x, weight].map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let (dx, dw) = B::dec_linear_backward(dy, x, weight);
        register!(B, ops.parents, [dx, dw], grads);
    }
}

#[derive(Debug)]
struct VocabStatsBackward((usize, f32, usize));

impl<B: DecoderBackend> Backward<B, 2> for VocabStatsBackward {
    type State = ([NodeId; 2], burn::tensor::ops::IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let ([hidden, weight], labels) = ops.state;
        let [hidden, weight] =
            [hidden, weight].map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let (dh, dw) = B::dec_vocab_stats_backward(grad, hidden, weight, labels, self.0);
        register!(B, ops.parents, [dh, dw], grads);
    }
}

#[derive(Debug)]
struct RmsNormBackward(RmsNormParams);

#[derive(Debug, Clone)]
struct RetroRmsNorm<B> {
    x: NodeId,
    weight: NodeId,
    params: RmsNormParams,
    _backend: PhantomData<B>,
}

impl<B: DecoderBackend> RetroForward for RetroRmsNorm<B> {
    fn forward(&self, states: &mut BackwardStates, out: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.x);
        let weight = states.get_state::<FloatTensor<B>>(&self.weight);
        states.save(out, B::dec_rms_norm(x, weight, self.params));
    }
}

impl<B: DecoderBackend> Backward<B, 2> for RmsNormBackward {
    type State = [NodeId; 2];

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [x, weight] = ops
            .state
            .map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let (dx, dw) = B::dec_rms_norm_backward(grad, x, weight, self.0);
        register!(B, ops.parents, [dx, dw], grads);
    }
}

#[derive(Debug)]
struct SwigluBackward;

#[derive(Debug, Clone)]
struct RetroSwiglu<B> {
    gate: NodeId,
    up: NodeId,
    _backend: PhantomData<B>,
}

impl<B: DecoderBackend> RetroForward for RetroSwiglu<B> {
    fn forward(&self, states: &mut BackwardStates, out: NodeId) {
        let gate = states.get_state::<FloatTensor<B>>(&self.gate);
        let up = states.get_state::<FloatTensor<B>>(&self.up);
        states.save(out, B::dec_swiglu(gate, up));
    }
}

impl<B: DecoderBackend> Backward<B, 2> for SwigluBackward {
    type State = [NodeId; 2];

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [gate, up] = ops
            .state
            .map(|id| c.retrieve_node_output::<FloatTensor<B>>(id));
        let (dgate, dup) = B::dec_swiglu_backward(grad, gate, up);
        register!(B, ops.parents, [dgate, dup], grads);
    }
}

#[derive(Debug)]
struct RotaryBackward;

#[derive(Debug, Clone)]
struct RetroRotary<B: DecoderBackend> {
    x: NodeId,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
}

impl<B: DecoderBackend> RetroForward for RetroRotary<B> {
    fn forward(&self, states: &mut BackwardStates, out: NodeId) {
        let x = states.get_state::<FloatTensor<B>>(&self.x);
        states.save(out, B::dec_rotary(x, self.cos.clone(), self.sin.clone()));
    }
}

impl<B: DecoderBackend> Backward<B, 1> for RotaryBackward {
    type State = [FloatTensor<B>; 2];

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [cos, sin] = ops.state;
        register!(
            B,
            ops.parents,
            [B::dec_rotary_backward(grad, cos, sin)],
            grads
        );
    }
}

/// The backward of Megatron's copy into a tensor-parallel region: the gradient summed over the
/// group.
#[derive(Debug)]
struct TpCopyBackward(TpGroup);

impl<B: DecoderBackend> Backward<B, 1> for TpCopyBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let summed = super::reference::tp_all_reduce::<B>(grad, &self.0);
        register!(B, ops.parents, [summed], grads);
    }
}

/// The backward of Megatron's reduction out of a tensor-parallel region: the gradient as it is.
#[derive(Debug)]
struct TpReduceBackward;

impl<B: DecoderBackend> Backward<B, 1> for TpReduceBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        register!(B, ops.parents, [grad], grads);
    }
}

impl<B: DecoderBackend, C: CheckpointStrategy> DecoderBackend for Autodiff<B, C> {
    // Both are compute-bound, so a checkpointing backend keeps their outputs rather than
    // running their exchanges again in the backward pass (every rank must exchange the same
    // number of times).
    fn dec_tp_copy(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self> {
        let out = B::dec_tp_copy(x.primitive.clone(), group);
        match TpCopyBackward(group.clone())
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dec_tp_reduce(x: FloatTensor<Self>, group: &TpGroup) -> FloatTensor<Self> {
        let out = B::dec_tp_reduce(x.primitive.clone(), group);
        match TpReduceBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dec_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = B::dec_attention(
            q.primitive.clone(),
            k.primitive.clone(),
            v.primitive.clone(),
            mask,
        );
        let out = match AttentionBackward(mask.clone())
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let ids = [
                    prep.checkpoint(&q),
                    prep.checkpoint(&k),
                    prep.checkpoint(&v),
                ];
                prep.finish((ids, out.clone(), lse.clone()), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, outer::<B, C>(lse))
    }

    fn dec_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        mask: &AttentionMask,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::dec_attention_backward(
            inner::<B, C>(q),
            inner::<B, C>(k),
            inner::<B, C>(v),
            inner::<B, C>(out),
            inner::<B, C>(lse),
            inner::<B, C>(grad),
            mask,
        );
        (outer::<B, C>(dq), outer::<B, C>(dk), outer::<B, C>(dv))
    }

    fn dec_linear(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::dec_linear(x.primitive.clone(), weight.primitive.clone());
        match LinearBackward
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&x), prep.checkpoint(&weight)];
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dec_linear_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        use burn::tensor::TensorMetadata;
        let out = B::dec_linear_bias(
            x.primitive.clone(),
            weight.primitive.clone(),
            bias.primitive.clone(),
        );
        match LinearBiasBackward(bias.primitive.dtype())
            .prepare::<C>([x.node.clone(), weight.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&x), prep.checkpoint(&weight)];
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dec_vocab_stats(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: burn::tensor::ops::IntTensor<Self>,
        settings: (usize, f32, usize),
    ) -> FloatTensor<Self> {
        let out = B::dec_vocab_stats(
            hidden.primitive.clone(),
            weight.primitive.clone(),
            labels.clone(),
            settings,
        );
        match VocabStatsBackward(settings)
            .prepare::<C>([hidden.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = ([prep.checkpoint(&hidden), prep.checkpoint(&weight)], labels);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dec_vocab_stats_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: burn::tensor::ops::IntTensor<Self>,
        settings: (usize, f32, usize),
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dh, dw) = B::dec_vocab_stats_backward(
            inner::<B, C>(grad),
            inner::<B, C>(hidden),
            inner::<B, C>(weight),
            labels,
            settings,
        );
        (outer::<B, C>(dh), outer::<B, C>(dw))
    }

    fn dec_linear_vjp(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let out = B::dec_linear_vjp(
            x.primitive.clone(),
            weight.primitive.clone(),
            dy.primitive.clone(),
        );
        match LinearVjpBackward
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    [prep.checkpoint(&x), prep.checkpoint(&weight)],
                    dy.primitive,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dec_linear_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw) =
            B::dec_linear_backward(inner::<B, C>(grad), inner::<B, C>(x), inner::<B, C>(weight));
        (outer::<B, C>(dx), outer::<B, C>(dw))
    }

    fn dec_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> FloatTensor<Self> {
        let y = || B::dec_rms_norm(x.primitive.clone(), weight.primitive.clone(), params);
        match RmsNormBackward(params)
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .memory_bound()
            .retro_forward(RetroRmsNorm::<B> {
                x: x.node.id,
                weight: weight.node.id,
                params,
                _backend: PhantomData,
            })
            .parents([&x, &weight])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&x), prep.checkpoint(&weight)];
                prep.finish(state, y())
            }
            OpsKind::UnTracked(prep) => prep.finish(y()),
        }
    }

    fn dec_rms_norm_backward(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        params: RmsNormParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dw) = B::dec_rms_norm_backward(
            inner::<B, C>(grad),
            inner::<B, C>(x),
            inner::<B, C>(weight),
            params,
        );
        (outer::<B, C>(dx), outer::<B, C>(dw))
    }

    fn dec_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = || B::dec_swiglu(gate.primitive.clone(), up.primitive.clone());
        match SwigluBackward
            .prepare::<C>([gate.node.clone(), up.node.clone()])
            .memory_bound()
            .retro_forward(RetroSwiglu::<B> {
                gate: gate.node.id,
                up: up.node.id,
                _backend: PhantomData,
            })
            .parents([&gate, &up])
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&gate), prep.checkpoint(&up)];
                prep.finish(state, out())
            }
            OpsKind::UnTracked(prep) => prep.finish(out()),
        }
    }

    fn dec_swiglu_backward(
        grad: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dg, du) =
            B::dec_swiglu_backward(inner::<B, C>(grad), inner::<B, C>(gate), inner::<B, C>(up));
        (outer::<B, C>(dg), outer::<B, C>(du))
    }

    fn dec_write_positions(
        buffer: FloatTensor<Self>,
        value: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        // The KV cache is for generation, which runs without gradients; under autodiff it is
        // Burn's own (differentiable) slice assignment.
        super::reference::write_positions::<Self>(buffer, value, start)
    }

    fn dec_rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (cos, sin) = (inner::<B, C>(cos), inner::<B, C>(sin));
        let out = || B::dec_rotary(x.primitive.clone(), cos.clone(), sin.clone());
        match RotaryBackward
            .prepare::<C>([x.node.clone()])
            .memory_bound()
            .retro_forward(RetroRotary::<B> {
                x: x.node.id,
                cos: cos.clone(),
                sin: sin.clone(),
            })
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish([cos.clone(), sin.clone()], out()),
            OpsKind::UnTracked(prep) => prep.finish(out()),
        }
    }

    fn dec_rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        outer::<B, C>(B::dec_rotary_backward(
            inner::<B, C>(grad),
            inner::<B, C>(cos),
            inner::<B, C>(sin),
        ))
    }
}
