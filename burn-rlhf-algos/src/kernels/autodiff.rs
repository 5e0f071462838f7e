//! [`RlBackend`] under autodiff: the forward runs on the inner backend (kernel or reference), and
//! the backward is registered as one node whose gradient is the inner backend's `*_backward`.
//! Scans and indicators carry no gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::{PpoClip, RlBackend};

type Ad<B, C> = Autodiff<B, C>;

fn inner<B: RlBackend, C: CheckpointStrategy>(t: FloatTensor<Ad<B, C>>) -> FloatTensor<B> {
    <Ad<B, C> as AutodiffBackend>::inner(t)
}

fn outer<B: RlBackend, C: CheckpointStrategy>(t: FloatTensor<B>) -> FloatTensor<Ad<B, C>> {
    <Ad<B, C> as AutodiffBackend>::from_inner(t)
}

#[derive(Debug)]
struct PpoBackward(PpoClip);

impl<B: RlBackend> Backward<B, 1> for PpoBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (log_prob, old, adv) = ops.state;
        if let Some(node) = parent {
            let g = B::rl_ppo_clip_loss_backward(grad, log_prob, old, adv, self.0);
            grads.register::<B>(node.id, g);
        }
    }
}

#[derive(Debug)]
struct LogprobEntropyBackward(f32);

impl<B: RlBackend> Backward<B, 1> for LogprobEntropyBackward {
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (logits, labels) = ops.state;
        if let Some(node) = parent {
            let g = B::rl_logprob_entropy_backward(grad, logits, labels, self.0);
            grads.register::<B>(node.id, g);
        }
    }
}

#[derive(Debug)]
struct LinearLogprobEntropyBackward {
    temperature: f32,
    chunk: usize,
}

impl<B: RlBackend> Backward<B, 2> for LinearLogprobEntropyBackward {
    type State = (NodeId, NodeId, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (hidden, weight, labels) = ops.state;
        let hidden = c.retrieve_node_output::<FloatTensor<B>>(hidden);
        let weight = c.retrieve_node_output::<FloatTensor<B>>(weight);
        let (dh, dw) = B::rl_linear_logprob_entropy_backward(
            grad,
            hidden,
            weight,
            labels,
            self.temperature,
            self.chunk,
        );
        for (parent, g) in ops.parents.into_iter().zip([dh, dw]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

#[derive(Debug)]
struct LinearLogProbsAtBackward {
    temperature: f32,
    chunk: usize,
}

impl<B: RlBackend> Backward<B, 2> for LinearLogProbsAtBackward {
    type State = (NodeId, NodeId, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, c: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (hidden, weight, ids) = ops.state;
        let hidden = c.retrieve_node_output::<FloatTensor<B>>(hidden);
        let weight = c.retrieve_node_output::<FloatTensor<B>>(weight);
        let (dh, dw) = B::rl_linear_log_probs_at_backward(
            grad,
            hidden,
            weight,
            ids,
            self.temperature,
            self.chunk,
        );
        for (parent, g) in ops.parents.into_iter().zip([dh, dw]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

#[derive(Debug)]
struct ValueBackward(f32);

impl<B: RlBackend> Backward<B, 1> for ValueBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (vpreds, values, returns) = ops.state;
        if let Some(node) = parent {
            let g = B::rl_value_clip_loss_backward(grad, vpreds, values, returns, self.0);
            grads.register::<B>(node.id, g);
        }
    }
}

impl<B: RlBackend, C: CheckpointStrategy> RlBackend for Autodiff<B, C> {
    fn compiles_kernels() -> bool {
        B::compiles_kernels()
    }

    fn device_memory_reserved(device: &Self::Device) -> Option<u64> {
        B::device_memory_reserved(device)
    }

    fn rl_gae_scan(
        rewards: FloatTensor<Self>,
        values: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
        lam: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (a, r) = B::rl_gae_scan(
            inner::<B, C>(rewards),
            inner::<B, C>(values),
            inner::<B, C>(mask),
            gamma,
            lam,
        );
        (outer::<B, C>(a), outer::<B, C>(r))
    }

    fn rl_gae_whitened(
        rewards: FloatTensor<Self>,
        values: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
        lam: f32,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        B::rl_gae_whitened(
            inner::<B, C>(rewards),
            inner::<B, C>(values),
            inner::<B, C>(mask),
            gamma,
            lam,
        )
        .map(|(a, r)| (outer::<B, C>(a), outer::<B, C>(r)))
    }

    fn rl_discounted_return_scan(
        rewards: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
    ) -> FloatTensor<Self> {
        outer::<B, C>(B::rl_discounted_return_scan(
            inner::<B, C>(rewards),
            inner::<B, C>(mask),
            gamma,
        ))
    }

    fn rl_ppo_clip_loss(
        log_prob: FloatTensor<Self>,
        old_log_prob: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        clip: PpoClip,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (old, adv) = (inner::<B, C>(old_log_prob), inner::<B, C>(advantages));
        let lp = log_prob.primitive.clone();
        let (loss, clipped, dual) = B::rl_ppo_clip_loss(lp.clone(), old.clone(), adv.clone(), clip);
        let loss = match PpoBackward(clip)
            .prepare::<C>([log_prob.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((lp, old, adv), loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        (loss, outer::<B, C>(clipped), outer::<B, C>(dual))
    }

    fn rl_logprob_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        let z = logits.primitive.clone();
        let out = B::rl_logprob_entropy(z.clone(), labels.clone(), temperature);
        match LogprobEntropyBackward(temperature)
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((z, labels), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn rl_linear_logprob_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> FloatTensor<Self> {
        let out = B::rl_linear_logprob_entropy(
            hidden.primitive.clone(),
            weight.primitive.clone(),
            labels.clone(),
            temperature,
            chunk,
        );
        // Keeps the inputs (read through the checkpointer), never the logits.
        match (LinearLogprobEntropyBackward { temperature, chunk })
            .prepare::<C>([hidden.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&hidden), prep.checkpoint(&weight), labels);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn rl_linear_logprob_entropy_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dh, dw) = B::rl_linear_logprob_entropy_backward(
            inner::<B, C>(grad),
            inner::<B, C>(hidden),
            inner::<B, C>(weight),
            labels,
            temperature,
            chunk,
        );
        (outer::<B, C>(dh), outer::<B, C>(dw))
    }

    fn rl_linear_log_probs_at(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        ids: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> FloatTensor<Self> {
        let out = B::rl_linear_log_probs_at(
            hidden.primitive.clone(),
            weight.primitive.clone(),
            ids.clone(),
            temperature,
            chunk,
        );
        // Keeps the inputs (read through the checkpointer), never the logits.
        match (LinearLogProbsAtBackward { temperature, chunk })
            .prepare::<C>([hidden.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&hidden), prep.checkpoint(&weight), ids);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn rl_linear_log_probs_at_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        ids: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dh, dw) = B::rl_linear_log_probs_at_backward(
            inner::<B, C>(grad),
            inner::<B, C>(hidden),
            inner::<B, C>(weight),
            ids,
            temperature,
            chunk,
        );
        (outer::<B, C>(dh), outer::<B, C>(dw))
    }

    fn rl_value_clip_loss(
        vpreds: FloatTensor<Self>,
        values: FloatTensor<Self>,
        returns: FloatTensor<Self>,
        cliprange: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (old, ret) = (inner::<B, C>(values), inner::<B, C>(returns));
        let v = vpreds.primitive.clone();
        let (loss, clipped) = B::rl_value_clip_loss(v.clone(), old.clone(), ret.clone(), cliprange);
        let loss = match ValueBackward(cliprange)
            .prepare::<C>([vpreds.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((v, old, ret), loss),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        };
        (loss, outer::<B, C>(clipped))
    }
}
