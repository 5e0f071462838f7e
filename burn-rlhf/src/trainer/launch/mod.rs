//! Starting a run: the ranks (`launch`) and the commands on top (`commands`).

pub mod commands;
pub(crate) mod launch;
mod rank_parts;
