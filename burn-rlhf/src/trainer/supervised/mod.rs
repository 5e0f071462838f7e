//! The supervised trainers: SFT (`sft`) and the reward model's (`rm`), on their shared run
//! (`run`: data, steps, validation, checkpoints, data parallelism).

pub mod rm;
pub(crate) mod run;
pub mod sft;

pub use run::*;
