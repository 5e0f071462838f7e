//! What a run reports and where it goes: the metrics map and its aggregation (`metrics`), the
//! sinks (`logger`: console, JSONL, verl's file logger, TensorBoard through `tensorboard`, the
//! plot through `plot`), phase timing and resource usage (`usage`), and the validation
//! generations shown (`generations`).

pub(crate) mod generations;
pub mod logger;
pub mod metrics;
pub(crate) mod plot;
pub mod tensorboard;
pub mod usage;
