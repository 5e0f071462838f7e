//! The host arithmetic that burn-rlhf's crates must compute identically, in one place so that
//! no copy is kept equal to another by a test: the models' decoder, the RL kernels' chunked LM
//! head and the rollout's sampler all read a token's logits and log-probs through these.
//!
//! - [`gemm`] (feature `gemm`): batch-invariant matrix products, whose output rows do not depend
//!   on the other rows of the product (the decoder's layers, attention, the LM head's chunks);
//! - [`softmax`]: the tempered softmax's sums over a row of logits in the trainer's order (the
//!   log-prob and entropy kernels, the sampler's one-pass pick);
//! - [`bf16`]: rounding to bf16 as Flex's casts round.
//!
//! It depends on nothing of Burn's: slices and raw operands in, numbers out.

pub mod bf16;
#[cfg(feature = "gemm")]
pub mod gemm;
pub mod softmax;
