//! Fused kernels where RL training spends launches and memory, as a Burn backend extension
//! ([`RlBackend`]): every method has a plain-tensor (or host) reference implementation, used by
//! default on every backend; CubeCL backends (wgpu, cuda) override them with `#[cube]` kernels, and
//! `Autodiff<B>` registers their backward passes. Parity tests compare the two
//! (`tests/kernels.rs`, run on wgpu through lavapipe in CI).
//!
//! - [`gae_scan`]: verl's GAE reverse scan with carry-forward masking, one thread per row.
//! - [`discounted_return_scan`]: REINFORCE++'s discounted return scan.
//! - [`ppo_clip_token_loss`]: PPO's clipped surrogate (clip-higher, dual-clip) per token, forward
//!   and backward, with the clip indicators.
//! - [`entropy_and_logprobs`]: log-probs of the labels and entropies from logits without
//!   materialising log-softmax over the vocabulary, forward and backward.
//! - [`value_clip_token_loss`]: the clipped value loss per token, forward and backward.
//! - [`adamw_step`]: one AdamW step of a parameter, its moments updated in the same pass.
//!
//! Names by layer: the functions above take and return tensors; each calls a backend operation
//! `RlBackend::rl_*` on primitives, whose default body is the function of the same name in
//! [`reference`] and which `cube` overrides with a kernel.

mod autodiff;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
pub mod reference;
pub mod runtime_config;

/// The CubeCL backend the kernels are written for (re-exported so the top crate can name it).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub use burn_cubecl::CubeBackend;
/// CUDA's CubeCL runtime (burn-cuda does not export it).
#[cfg(feature = "cuda")]
pub use cubecl::cuda::CudaRuntime;

/// The CubeCL backend this build's kernels run on, without Burn's fusion (a fused backend would
/// run the references): CUDA with the `cuda` feature, else wgpu.
#[cfg(feature = "cuda")]
pub type KernelBackend = CubeBackend<CudaRuntime, f32, i32, u8>;
/// The CubeCL backend this build's kernels run on, without Burn's fusion (a fused backend would
/// run the references): CUDA with the `cuda` feature, else wgpu.
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
pub type KernelBackend = CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;

/// The CubeCL runtime of [`KernelBackend`].
#[cfg(feature = "cuda")]
pub type KernelRuntime = CudaRuntime;
/// The CubeCL runtime of [`KernelBackend`].
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
pub type KernelRuntime = burn::backend::wgpu::WgpuRuntime;

/// Bytes of device memory held by live tensors on `device` (CubeCL's allocator: slices in use,
/// without the pools' reserve), after the device's queued work.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn device_bytes_in_use(device: &burn::tensor::Device<KernelBackend>) -> u64 {
    use cubecl::Runtime;
    let client = KernelRuntime::client(device);
    // An error here is a lost device; report it as nothing in use rather than panic a probe.
    client.memory_usage().map(|m| m.bytes_in_use).unwrap_or(0)
}

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorPrimitive};

static KERNELS_ENABLED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// This thread's switch while inside [`with_kernels`]; `None`: the process default.
    static THREAD_KERNELS: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    /// Fused-kernel calls made on this thread ([`fused_calls_on_this_thread`]).
    static FUSED_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Sets the process default of the fused kernels (on unless changed); a learner's own
/// `use_fused_kernels` is applied with [`with_kernels`] instead, so learners do not interfere.
pub fn set_kernels_enabled(enabled: bool) {
    KERNELS_ENABLED.store(enabled, Ordering::SeqCst);
}

/// Whether CubeCL backends use the fused kernels on this thread now: [`with_kernels`]'s setting
/// inside it, else the process default.
pub fn kernels_enabled() -> bool {
    THREAD_KERNELS
        .with(|k| k.get())
        .unwrap_or_else(|| KERNELS_ENABLED.load(Ordering::SeqCst))
}

/// Runs `f` with the fused kernels on or off on this thread (the switch of the learner calling
/// it), restoring the previous setting afterwards, also when `f` panics. Kernel choices are made
/// on the calling thread as operations are issued (forward and backward), so two learners on
/// different threads, or interleaved on one, each get their own.
pub fn with_kernels<R>(enabled: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            THREAD_KERNELS.with(|k| k.set(self.0));
        }
    }
    let _restore = Restore(THREAD_KERNELS.with(|k| k.replace(Some(enabled))));
    f()
}

/// How many times a fused kernel was chosen on this thread (tests check which path ran).
pub fn fused_calls_on_this_thread() -> u64 {
    FUSED_CALLS.with(|c| c.get())
}

/// [`kernels_enabled`], counting the call when it is (for the kernels' `if` at their top).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn take_fused_path() -> bool {
    let on = kernels_enabled();
    if on {
        FUSED_CALLS.with(|c| c.set(c.get() + 1));
    }
    on
}

/// PPO's clip settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoClip {
    /// Ratios below `1 - low` are clipped.
    pub low: f32,
    /// Ratios above `1 + high` are clipped.
    pub high: f32,
    /// Dual-clip bound on the loss of negative advantages (> 1).
    pub c: f32,
}

/// One AdamW step's settings (decoupled weight decay, bias-corrected moments: Burn's `AdamW`,
/// which is torch's `AdamW` up to rounding).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// The learning rate.
    pub lr: f64,
    /// First moment's decay.
    pub beta_1: f32,
    /// Second moment's decay.
    pub beta_2: f32,
    /// Added to the second moment's root.
    pub epsilon: f32,
    /// Decoupled weight decay (multiplied by `lr`).
    pub weight_decay: f32,
    /// The step's number, from 1 (the bias corrections' exponent).
    pub time: usize,
}

impl AdamWStep {
    /// The per-element constants in f32, computed as Burn's `AdamW` computes them, so a fused
    /// pass rounds as its chain of tensor ops does.
    pub fn constants(&self) -> AdamWConstants {
        let time = self.time as i32;
        AdamWConstants {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            grad_1: 1.0 - self.beta_1,
            grad_2: 1.0 - self.beta_2,
            correction_1: 1.0 - self.beta_1.powi(time),
            correction_2: 1.0 - self.beta_2.powi(time),
            epsilon: self.epsilon,
            keep: (1.0 - self.lr * self.weight_decay as f64) as f32,
            lr: self.lr as f32,
        }
    }
}

/// [`AdamWStep`] as the f32 constants of the element update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConstants {
    /// `m ← m·beta_1 + g·grad_1`.
    pub beta_1: f32,
    /// `v ← v·beta_2 + g²·grad_2`.
    pub beta_2: f32,
    /// `1 - beta_1`.
    pub grad_1: f32,
    /// `1 - beta_2`.
    pub grad_2: f32,
    /// `1 - beta_1^t`.
    pub correction_1: f32,
    /// `1 - beta_2^t`.
    pub correction_2: f32,
    /// Added to `sqrt(v̂)`.
    pub epsilon: f32,
    /// `1 - lr·weight_decay`, the decayed share of the parameter.
    pub keep: f32,
    /// The learning rate.
    pub lr: f32,
}

impl AdamWConstants {
    /// One element's step: (parameter, first moment, second moment) updated from its gradient,
    /// in the order of Burn's tensor ops.
    #[inline]
    pub fn update(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let m = m * self.beta_1 + g * self.grad_1;
        let v = v * self.beta_2 + g * g * self.grad_2;
        let delta = (m / self.correction_1) / ((v / self.correction_2).sqrt() + self.epsilon);
        (p * self.keep - delta * self.lr, m, v)
    }
}

/// The RL kernels as backend operations. Default methods are the reference implementations; a
/// backend with kernels overrides them. Tensors are row-major `[rows, cols]` unless noted.
pub trait RlBackend: Backend {
    /// Whether the backend compiles (and tunes) its kernels for each new tensor shape, as CubeCL
    /// does: callers then keep shapes to a small set (see `DecodeShapes` in burn-rlhf-rollout).
    fn compiles_kernels() -> bool {
        false
    }

    /// Whether the fused LM head's f32 log-probs and entropies of a row are the same bit for bit
    /// whatever the other rows of the product and the chunk size, for f32 and bf16 operands
    /// (Flex: the product handed to gemm in fixed depth blocks; bf16 logits rounded as the
    /// decoder's bf16 product rounds them), so that the rollout's sampled log-prob equals the trainer's
    /// recomputation (see `burn_rlhf_models::DecoderBackend::dec_batch_invariant` for the
    /// decoder's part).
    fn rl_batch_invariant() -> bool {
        false
    }

    /// Bytes the backend's device memory pool holds on `device` (CubeCL's reserved pool), for
    /// the per-phase memory report; `None` where memory is the process heap (CPU backends).
    fn device_memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// `Σ x²` over every element of `x` (any rank; a half-precision `x` cast up first), in f32,
    /// as a one-element tensor: a gradient norm's part. The same inputs give the same bits in
    /// every run (the default is the backend's whole-tensor sum; CubeCL overrides it, see there).
    fn rl_squared_sum(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::squared_sum::<Self>(x)
    }

    /// GAE: (advantages before whitening, returns) from rewards, values and mask.
    fn rl_gae_scan(
        rewards: FloatTensor<Self>,
        values: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
        lam: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::gae_scan::<Self>(rewards, values, mask, gamma, lam)
    }

    /// GAE with the advantages whitened over the mask (verl's `compute_gae_advantage_return`):
    /// (advantages, returns). `None` when the mask selects fewer than two tokens (the caller's
    /// whitening reports that). The default is one host pass for the scan and the statistics; a
    /// kernel backend scans on the device and whitens with tensor ops.
    fn rl_gae_whitened(
        rewards: FloatTensor<Self>,
        values: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
        lam: f32,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        reference::gae_whitened::<Self>(rewards, values, mask, gamma, lam)
    }

    /// Discounted returns `G_t = r_t + gamma * G_{t+1}`, reset after masked positions (verl's
    /// REINFORCE++ carry).
    fn rl_discounted_return_scan(
        rewards: FloatTensor<Self>,
        mask: FloatTensor<Self>,
        gamma: f32,
    ) -> FloatTensor<Self> {
        reference::discounted_return_scan::<Self>(rewards, mask, gamma)
    }

    /// PPO's per-token loss and its indicators: (loss, clipped, dual-clipped), `[rows, cols]`.
    fn rl_ppo_clip_loss(
        log_prob: FloatTensor<Self>,
        old_log_prob: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        clip: PpoClip,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::ppo_clip_loss::<Self>(log_prob, old_log_prob, advantages, clip)
    }

    /// `grad * d loss / d log_prob` of [`RlBackend::rl_ppo_clip_loss`].
    fn rl_ppo_clip_loss_backward(
        grad: FloatTensor<Self>,
        log_prob: FloatTensor<Self>,
        old_log_prob: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        clip: PpoClip,
    ) -> FloatTensor<Self> {
        reference::ppo_clip_loss_backward::<Self>(grad, log_prob, old_log_prob, advantages, clip)
    }

    /// Log-prob of each row's label and the row's entropy, from `logits / temperature`:
    /// logits `[rows, vocab]`, labels `[rows]` → `[rows, 2]` (log-prob, entropy).
    fn rl_logprob_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        reference::logprob_entropy::<Self>(logits, labels, temperature)
    }

    /// The gradient with respect to the logits of [`RlBackend::rl_logprob_entropy`], given the
    /// output's gradient `[rows, 2]`.
    fn rl_logprob_entropy_backward(
        grad: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
    ) -> FloatTensor<Self> {
        reference::logprob_entropy_backward::<Self>(grad, logits, labels, temperature)
    }

    /// Log-probs of the labels and entropies under `hidden · weightᵀ / temperature`, the logits
    /// made `chunk` rows at a time, so `[rows, vocab]` logits never exist at once (the technique
    /// of Liger's fused linear cross-entropy): hidden `[rows, H]`, weight `[vocab, H]`, labels
    /// `[rows]` → `[rows, 2]` (log-prob, entropy), f32. Each chunk's logits go through
    /// [`RlBackend::rl_logprob_entropy`] (the fused kernel on CubeCL).
    fn rl_linear_logprob_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> FloatTensor<Self> {
        reference::linear_logprob_entropy::<Self>(hidden, weight, labels, temperature, chunk)
    }

    /// The gradients (hidden, weight) of [`RlBackend::rl_linear_logprob_entropy`] given the
    /// output's gradient `[rows, 2]`, each chunk's logits recomputed.
    fn rl_linear_logprob_entropy_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        labels: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::linear_logprob_entropy_backward::<Self>(
            grad,
            hidden,
            weight,
            labels,
            temperature,
            chunk,
        )
    }

    /// Log-softmax of `hidden · weightᵀ / temperature` at `ids` (several per row), the logits
    /// made `chunk` rows at a time, in f32: hidden `[rows, H]`, weight `[vocab, H]`, ids
    /// `[rows, K]` → `[rows, K]`. The student's side of the top-k forward KL (on-policy
    /// distillation), whose `[rows, vocab]` log-softmax never exists at once.
    fn rl_linear_log_probs_at(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        ids: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> FloatTensor<Self> {
        reference::linear_log_probs_at::<Self>(hidden, weight, ids, temperature, chunk)
    }

    /// The gradients (hidden, weight) of [`RlBackend::rl_linear_log_probs_at`] given the output's
    /// gradient `[rows, K]`, each chunk's logits recomputed.
    fn rl_linear_log_probs_at_backward(
        grad: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        ids: IntTensor<Self>,
        temperature: f32,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::linear_log_probs_at_backward::<Self>(
            grad,
            hidden,
            weight,
            ids,
            temperature,
            chunk,
        )
    }

    /// The clipped value loss per token, `max((V - R)^2, (clip(V, V_old ± c) - R)^2)`, and where
    /// the clipped term is the larger: (loss, clipped).
    fn rl_value_clip_loss(
        vpreds: FloatTensor<Self>,
        values: FloatTensor<Self>,
        returns: FloatTensor<Self>,
        cliprange: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::value_clip_loss::<Self>(vpreds, values, returns, cliprange)
    }

    /// `grad * d loss / d vpreds` of [`RlBackend::rl_value_clip_loss`].
    fn rl_value_clip_loss_backward(
        grad: FloatTensor<Self>,
        vpreds: FloatTensor<Self>,
        values: FloatTensor<Self>,
        returns: FloatTensor<Self>,
        cliprange: f32,
    ) -> FloatTensor<Self> {
        reference::value_clip_loss_backward::<Self>(grad, vpreds, values, returns, cliprange)
    }

    /// One AdamW step of a parameter of any shape: (parameter, first moment, second moment)
    /// after it, from the gradient and the moments before it (`None` on the first step: zeros).
    /// The default is Burn's `AdamW` as tensor ops; a backend may update all three in one pass.
    fn rl_adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::adamw_step::<Self>(param, grad, moments, step)
    }
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn wrap<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// GAE's scan. Shapes: `[B, T]` each → (advantages before whitening, returns).
pub fn gae_scan<B: RlBackend>(
    rewards: Tensor<B, 2>,
    values: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    gamma: f64,
    lam: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (a, r) = B::rl_gae_scan(
        prim(rewards),
        prim(values),
        prim(mask),
        gamma as f32,
        lam as f32,
    );
    (wrap(a), wrap(r))
}

/// GAE with whitened advantages (`None` when the mask selects fewer than two tokens).
///
/// Shapes: `[B, T]` each → (advantages, returns).
pub fn gae_whitened<B: RlBackend>(
    rewards: Tensor<B, 2>,
    values: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    gamma: f64,
    lam: f64,
) -> Option<(Tensor<B, 2>, Tensor<B, 2>)> {
    B::rl_gae_whitened(
        prim(rewards),
        prim(values),
        prim(mask),
        gamma as f32,
        lam as f32,
    )
    .map(|(a, r)| (wrap(a), wrap(r)))
}

/// REINFORCE++'s discounted returns. Shapes: `[B, T]` each → `[B, T]`.
pub fn discounted_return_scan<B: RlBackend>(
    rewards: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    gamma: f64,
) -> Tensor<B, 2> {
    wrap(B::rl_discounted_return_scan(
        prim(rewards),
        prim(mask),
        gamma as f32,
    ))
}

/// PPO's clipped per-token loss, differentiable in `log_prob`, with the clip indicators.
///
/// Shapes: `[B, T]` each → (loss, clipped, dual-clipped) `[B, T]`.
pub fn ppo_clip_token_loss<B: RlBackend>(
    log_prob: Tensor<B, 2>,
    old_log_prob: Tensor<B, 2>,
    advantages: Tensor<B, 2>,
    clip: PpoClip,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) {
    let (l, c, d) = B::rl_ppo_clip_loss(prim(log_prob), prim(old_log_prob), prim(advantages), clip);
    (wrap(l), wrap(c), wrap(d))
}

/// Log-probs of `labels` and entropies under `logits / temperature`, differentiable in `logits`.
///
/// Shapes: logits `[B, T, V]`, labels `[B, T]` → (entropy `[B, T]`, log-probs `[B, T]`), the order
/// of [`crate::functional::entropy_and_logprobs`].
pub fn entropy_and_logprobs<B: RlBackend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
    temperature: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [b, t, v] = logits.dims();
    let flat = logits.reshape([b * t, v]);
    let out: Tensor<B, 2> = wrap(B::rl_logprob_entropy(
        prim(flat),
        labels.reshape([b * t]).into_primitive(),
        temperature as f32,
    ));
    let logp = out.clone().slice([0..b * t, 0..1]).reshape([b, t]);
    let entropy = out.slice([0..b * t, 1..2]).reshape([b, t]);
    (entropy, logp)
}

/// Log-probs of `labels` and entropies under `hidden · weightᵀ / temperature`, differentiable in
/// `hidden` and `weight`, the logits made `chunk` rows at a time (see
/// [`RlBackend::rl_linear_logprob_entropy`]).
///
/// Shapes: hidden `[N, H]`, weight `[V, H]`, labels `[N]` → (entropy `[N]`, log-probs `[N]`).
pub fn linear_entropy_and_logprobs<B: RlBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    temperature: f64,
    chunk: usize,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let n = hidden.dims()[0];
    assert_eq!(
        hidden.dims()[1],
        weight.dims()[1],
        "hidden and weight widths"
    );
    let out: Tensor<B, 2> = wrap(B::rl_linear_logprob_entropy(
        prim(hidden),
        prim(weight),
        labels.into_primitive(),
        temperature as f32,
        chunk.max(1),
    ));
    let logp = out.clone().slice([0..n, 0..1]).reshape([n]);
    let entropy = out.slice([0..n, 1..2]).reshape([n]);
    (entropy, logp)
}

/// Log-probs of several tokens per row (`ids`) under `hidden · weightᵀ / temperature`,
/// differentiable in `hidden` and `weight`, the logits made `chunk` rows at a time (see
/// [`RlBackend::rl_linear_log_probs_at`]).
///
/// Shapes: hidden `[N, H]`, weight `[V, H]`, ids `[N, K]` → `[N, K]` (f32).
pub fn linear_log_probs_at<B: RlBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
    temperature: f64,
    chunk: usize,
) -> Tensor<B, 2> {
    assert_eq!(
        hidden.dims()[1],
        weight.dims()[1],
        "hidden and weight widths"
    );
    assert_eq!(hidden.dims()[0], ids.dims()[0], "hidden and ids rows");
    wrap(B::rl_linear_log_probs_at(
        prim(hidden),
        prim(weight),
        ids.into_primitive(),
        temperature as f32,
        chunk.max(1),
    ))
}

/// The clipped value loss per token, differentiable in `vpreds`, and where clipping wins.
///
/// Shapes: `[B, T]` each → (loss, clipped) `[B, T]`.
pub fn value_clip_token_loss<B: RlBackend>(
    vpreds: Tensor<B, 2>,
    values: Tensor<B, 2>,
    returns: Tensor<B, 2>,
    cliprange: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (l, c) = B::rl_value_clip_loss(prim(vpreds), prim(values), prim(returns), cliprange as f32);
    (wrap(l), wrap(c))
}

/// `Σ x²` of a tensor in f32, read as an f64: a gradient norm's part, the same bits in every
/// run ([`RlBackend::rl_squared_sum`]).
pub fn squared_sum<B: RlBackend, const D: usize>(x: Tensor<B, D>) -> f64 {
    let sum = B::rl_squared_sum(x.into_primitive().tensor());
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sum))
        .into_data()
        .iter::<f64>()
        .next()
        .unwrap_or(f64::NAN)
}

/// One AdamW step of `param` (see [`RlBackend::rl_adamw_step`]). A half-precision parameter
/// (verl's `fsdp_config.model_dtype=bf16`: no f32 master copy) keeps its moments in its own
/// dtype, as torch's AdamW does for such a parameter; the step itself runs in f32 (the fused
/// kernel on the values cast up, any gradient dtype), and the parameter and moments are rounded
/// once to their dtype after it.
///
/// Shapes: param, grad and moments alike → (param, first moment, second moment) alike.
pub fn adamw_step<B: RlBackend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    moments: Option<(Tensor<B, D>, Tensor<B, D>)>,
    step: AdamWStep,
) -> (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>) {
    assert_eq!(param.dims(), grad.dims(), "parameter and gradient shapes");
    let dtype = param.dtype();
    if dtype != DType::F32 || grad.dtype() != DType::F32 {
        let up = |t: Tensor<B, D>| match t.dtype() {
            DType::F32 => t,
            _ => t.cast(FloatDType::F32),
        };
        let (p, m, v) = adamw_step(
            up(param),
            up(grad),
            moments.map(|(m, v)| (up(m), up(v))),
            step,
        );
        let kept = FloatDType::from(dtype);
        let down = |t: Tensor<B, D>| match dtype {
            DType::F32 => t,
            _ => t.cast(kept),
        };
        return (down(p), down(m), down(v));
    }
    let (p, m, v) = B::rl_adamw_step(
        prim(param),
        prim(grad),
        moments.map(|(m, v)| (prim(m), prim(v))),
        step,
    );
    (wrap(p), wrap(m), wrap(v))
}

#[cfg(feature = "flex")]
mod flex;

#[cfg(feature = "ndarray")]
impl RlBackend for burn::backend::NdArray<f32> {}

#[cfg(feature = "tch")]
impl RlBackend for burn::backend::LibTorch<f32> {}

// Fused backends run the reference ops (which fusion then fuses); the kernels run on the
// non-fused CubeCL backends (`burn_rlhf::backend` selects those).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl<B: burn_fusion::FusionBackend> RlBackend for burn_fusion::Fusion<B> {
    fn compiles_kernels() -> bool {
        true
    }
}

/// A training backend whose autodiff and inner backends both have the RL kernels: what the
/// learner needs (updates run under autodiff, rollout and log-prob passes on the inner backend).
pub trait RlAutodiffBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: RlBackend> + RlBackend
{
}

impl<B> RlAutodiffBackend for B
where
    B: burn::tensor::backend::AutodiffBackend + RlBackend,
    B::InnerBackend: RlBackend,
{
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each thread's scope is its own, nests, and is restored after a panic; the process default
    /// is untouched.
    #[test]
    fn kernel_switch_is_scoped_per_thread() {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let seen: Vec<(bool, bool)> = [false, true]
            .into_iter()
            .map(|on| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    with_kernels(on, || {
                        // Both threads are inside their scopes at once.
                        barrier.wait();
                        let outer = kernels_enabled();
                        let inner = with_kernels(!on, kernels_enabled);
                        barrier.wait();
                        assert_eq!(kernels_enabled(), outer);
                        (outer, inner)
                    })
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        assert_eq!(seen, vec![(false, true), (true, false)]);
        assert!(kernels_enabled(), "the process default stays on");
        let panicked = std::panic::catch_unwind(|| with_kernels(false, || panic!("inside")));
        assert!(panicked.is_err());
        assert!(kernels_enabled(), "restored after a panic");
    }
}
