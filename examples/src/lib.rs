//! The runnable examples are the files beside this folder (`examples/quickstart.rs`,
//! `examples/ppo_gsm8k.rs`), declared in `examples/Cargo.toml`; this empty library only makes the
//! folder a workspace member.
