//! verl 0.9.1's own config tree (its generated `_generated_ppo_trainer.yaml` and the Megatron
//! one, shipped in `burn-rlhf/verl_config/` as verl wrote them): verl's value of every key, for
//! the keys of sections that change nothing here. Such a key is accepted at verl's value (a
//! command line copied from verl keeps working) and refused at any other, saying why.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::Value;

const PPO_TREE: &str = include_str!("../../verl_config/_generated_ppo_trainer.yaml");
const MEGATRON_TREE: &str = include_str!("../../verl_config/_generated_ppo_megatron_trainer.yaml");

/// Sections (a key path or its start; `*` for any one part) whose keys change nothing here at
/// verl's values, and why.
const INERT: &[(&str, &str)] = &[
    (
        "global_profiler",
        "profilers are not built in (time phases with the `timing_s/*` metrics)",
    ),
    (
        "*.profiler",
        "profilers are not built in (time phases with the `timing_s/*` metrics)",
    ),
    (
        "ray_kwargs",
        "there is no Ray: ranks are threads and MPI processes",
    ),
    (
        "trainer.ray_wait_register_center_timeout",
        "there is no Ray",
    ),
    (
        "transfer_queue",
        "verl's transfer queue is not used: rollouts stay in the process",
    ),
    (
        "skip",
        "verl's rollout dump-and-replay switches are not built",
    ),
    ("distillation", "on-policy distillation is not built"),
    (
        "trainer.use_v1",
        "verl's asynchronous v1 trainer is not built",
    ),
    ("trainer.v1", "verl's asynchronous v1 trainer is not built"),
    (
        "algorithm.use_pf_ppo",
        "PF-PPO's reweighted replay is not built",
    ),
    (
        "algorithm.pf_ppo",
        "PF-PPO's reweighted replay is not built",
    ),
    (
        "*.nccl_timeout",
        "the collectives' timeout is `trainer.collective_timeout_s`",
    ),
    (
        "actor_rollout_ref.hybrid_engine",
        "the trained model always generates (hybrid)",
    ),
    (
        "trainer.esi_redundant_time",
        "verl's elastic-instance checkpoint timing is not built",
    ),
    (
        "trainer.default_hdfs_dir",
        "checkpoints are written to `trainer.default_local_dir` only",
    ),
    (
        "trainer.del_local_ckpt_after_load",
        "checkpoints are local and kept",
    ),
    (
        "trainer.device",
        "the device is the build's backend (`--features cuda`, wgpu, flex)",
    ),
    (
        "data.dataloader_num_workers",
        "data loads in the process, before training",
    ),
    (
        "data.filter_overlong_prompts_workers",
        "data loads in the process, before training",
    ),
    (
        "data.use_shm",
        "models load from their files, not shared memory",
    ),
    ("data.image_key", "models here read text only"),
    ("data.video_key", "models here read text only"),
    ("data.audio_key", "models here read text only"),
    ("data.image_patch_size", "models here read text only"),
    ("data.mm_processor_kwargs", "models here read text only"),
    (
        "data.return_multi_modal_inputs",
        "models here read text only",
    ),
    (
        "sandbox_fusion",
        "a sandbox is configured per tool, in the tool config file",
    ),
    // FSDP's engine details that have no counterpart in how the models run here (the sharding
    // keys themselves, `strategy`, `fsdp_size`, offload and dtypes, are read or refused
    // elsewhere).
    (
        "*.fsdp_config.wrap_policy",
        "every decoder layer is its own unit here",
    ),
    (
        "*.fsdp_config.forward_prefetch",
        "there is no FSDP all-gather to prefetch",
    ),
    (
        "*.fsdp_config.use_orig_params",
        "parameters are Burn's own, never flattened",
    ),
    (
        "*.fsdp_config.use_torch_compile",
        "there is no torch.compile: kernels are CubeCL's or the host's",
    ),
    (
        "*.use_torch_compile",
        "there is no torch.compile: kernels are CubeCL's or the host's",
    ),
    (
        "*.fsdp_config.full_determinism",
        "runs repeat bit for bit on one machine already",
    ),
    (
        "*.fsdp_config.qat",
        "quantisation-aware training is not built",
    ),
    (
        "*.fsdp_config.turbo_config",
        "verl's turbo FSDP engine is not used",
    ),
    ("*.freeze_vision_tower", "models here read text only"),
];

/// Whether `pattern` (dotted, `*` for any one part) names `key` or a section above it.
fn covers(pattern: &str, key: &str) -> bool {
    let (p, k): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), key.split('.').collect());
    if p.first() == Some(&"*") {
        // Anywhere below the top: a section of that name at any depth.
        return k
            .windows(p.len() - 1)
            .enumerate()
            .any(|(i, w)| i > 0 && w == &p[1..]);
    }
    k.len() >= p.len() && p.iter().zip(&k).all(|(a, b)| a == b)
}

/// Why `key` changes nothing here at verl's value, when it is in such a section.
pub fn inert_reason(key: &str) -> Option<&'static str> {
    INERT
        .iter()
        .find(|(pattern, _)| covers(pattern, key))
        .map(|(_, why)| *why)
}

/// Every leaf of verl's trees (`a.b.c` → value); the PPO tree's value where both have a key.
fn leaves() -> &'static BTreeMap<String, Value> {
    static LEAVES: OnceLock<BTreeMap<String, Value>> = OnceLock::new();
    LEAVES.get_or_init(|| {
        let mut all = BTreeMap::new();
        for text in [MEGATRON_TREE, PPO_TREE] {
            let tree: Value = serde_saphyr::from_str(text).expect("verl's generated tree is YAML");
            collect(&tree, "", &mut all);
        }
        all
    })
}

fn collect(tree: &Value, prefix: &str, out: &mut BTreeMap<String, Value>) {
    match tree {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                collect(v, &path, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// verl 0.9.1's value of `key` (a leaf of its generated trees).
pub fn verl_value(key: &str) -> Option<&'static Value> {
    leaves().get(key)
}

/// Whether `value` (an override's, parsed) is verl's `expected`: numbers by value, a missing
/// `{}`/`[]` alike.
pub(super) fn same_value(value: &Value, expected: &Value) -> bool {
    match (value, expected) {
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_value(x, y))
        }
        (Value::Object(a), Value::Object(b)) => a.is_empty() && b.is_empty(),
        _ => value == expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_cover_their_keys_at_any_depth() {
        assert!(covers(
            "*.profiler",
            "actor_rollout_ref.actor.profiler.tool"
        ));
        assert!(!covers("*.profiler", "profiler.tool"));
        assert!(covers("ray_kwargs", "ray_kwargs.ray_init.num_cpus"));
        assert!(!covers("trainer.v1", "trainer.v10"));
        assert_eq!(
            verl_value("trainer.ray_wait_register_center_timeout"),
            Some(&Value::from(300))
        );
        assert!(inert_reason("actor_rollout_ref.rollout.n").is_none());
    }
}
