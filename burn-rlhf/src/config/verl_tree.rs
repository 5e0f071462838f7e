//! verl 0.9.1's own config tree (its generated `_generated_ppo_trainer.yaml` and the Megatron
//! one, shipped in `burn-rlhf/verl_config/` as verl wrote them): verl's value of every key, for
//! the keys of sections that change nothing here. Such a key is accepted at verl's value (a
//! command line copied from verl keeps working) and refused at any other, saying why.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::Value;

use super::verl_keys::VerlDialect;

const PPO_TREE: &str = include_str!("../../verl_config/_generated_ppo_trainer.yaml");
const MEGATRON_TREE: &str = include_str!("../../verl_config/_generated_ppo_megatron_trainer.yaml");
const SFT_TREE: &str = include_str!("../../verl_config/sft/sft_trainer_engine.yaml");

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
    // The optimiser: Burn's AdamW with verl's schedule.
    (
        "*.optim.optimizer_impl",
        "the optimiser is Burn's AdamW, not a torch class",
    ),
    (
        "*.optim.zero_indexed_step",
        "the schedule counts steps from 0, as verl's default does",
    ),
    (
        "*.optim.warmup_style",
        "verl's deprecated name: set `optim.lr_scheduler_type`",
    ),
    // More of FSDP's engine details with no counterpart here.
    (
        "*.fsdp_config.offload_policy",
        "parameters stay on the device (FSDP2's CPU offload policy is not built)",
    ),
    ("*.fsdp_config.seed", SEEDS),
    ("*.fsdp.seed", SEEDS),
    ("*.fsdp_config.pad_to_length_bucket", SHAPE_BUCKETS),
    ("*.fsdp.pad_to_length_bucket", SHAPE_BUCKETS),
    ("*.fsdp_config.forward_only", FORWARD_ONLY),
    ("*.fsdp.forward_only", FORWARD_ONLY),
    (
        "*.fsdp.wrap_policy",
        "every decoder layer is its own unit here",
    ),
    (
        "*.fsdp.forward_prefetch",
        "there is no FSDP all-gather to prefetch",
    ),
    (
        "*.fsdp.use_orig_params",
        "parameters are Burn's own, never flattened",
    ),
    (
        "*.fsdp.full_determinism",
        "runs repeat bit for bit on one machine already",
    ),
    ("*.fsdp.qat", "quantisation-aware training is not built"),
    (
        "*.fsdp.turbo_config",
        "verl's turbo FSDP engine is not used",
    ),
    ("*.fsdp.offload_policy", "parameters stay on the device"),
    ("*.qat", "quantisation-aware training is not built"),
    ("*.pad_to_length", SHAPE_BUCKETS),
    // Megatron-Core's optimiser and scheduler keys: the schedule here is verl's FSDP one
    // (`optim.lr_scheduler_type`, `lr_warmup_steps`, `min_lr_ratio`), the optimiser AdamW.
    ("*.optim.lr_warmup_init", MEGATRON_SCHEDULE),
    ("*.optim.lr_decay_steps", MEGATRON_SCHEDULE),
    ("*.optim.lr_decay_style", MEGATRON_SCHEDULE),
    ("*.optim.min_lr", MEGATRON_SCHEDULE),
    ("*.optim.weight_decay_incr_style", MEGATRON_SCHEDULE),
    ("*.optim.lr_wsd_decay_style", MEGATRON_SCHEDULE),
    ("*.optim.lr_wsd_decay_steps", MEGATRON_SCHEDULE),
    (
        "*.optim.use_checkpoint_opt_param_scheduler",
        MEGATRON_SCHEDULE,
    ),
    ("*.optim.use_precision_aware_optimizer", F32_OPTIMISER),
    ("*.optim.main_grads_dtype", F32_OPTIMISER),
    ("*.optim.exp_avg_dtype", F32_OPTIMISER),
    ("*.optim.exp_avg_sq_dtype", F32_OPTIMISER),
    (
        "*.optim.use_layer_wise_distributed_optimizer",
        "the AdamW state is sharded with `trainer.zero_stage=1`",
    ),
    ("*.optim.muon_momentum", NO_MUON),
    ("*.optim.muon_nesterov", NO_MUON),
    ("*.optim.muon_split_qkv", NO_MUON),
    ("*.optim.muon_scale_mode", NO_MUON),
    ("*.optim.muon_coefficient_type", NO_MUON),
    ("*.optim.muon_num_ns_steps", NO_MUON),
    ("*.optim.muon_tp_mode", NO_MUON),
    ("*.optim.muon_fp32_matmul_prec", NO_MUON),
    ("*.optim.muon_extra_scale_factor", NO_MUON),
    ("*.optim.muon_scalar_optimizer", NO_MUON),
    ("*.optim.muon_match_adamw_update_rms", NO_MUON),
    // Megatron-Core's engine: tensor parallelism here is burn-rlhf's own layers
    // (`megatron.tensor_model_parallel_size`); the rest of Megatron's layout is not built.
    (
        "*.megatron.expert_model_parallel_size",
        "experts are split with the tensor-parallel group (expert parallelism is not built)",
    ),
    (
        "*.megatron.expert_tensor_parallel_size",
        "experts are split with the tensor-parallel group (expert parallelism is not built)",
    ),
    (
        "*.megatron.pipeline_model_parallel_size",
        "pipeline parallelism is not built: every rank holds every layer",
    ),
    (
        "*.megatron.virtual_pipeline_model_parallel_size",
        "pipeline parallelism is not built: every rank holds every layer",
    ),
    (
        "*.megatron.context_parallel_size",
        "context parallelism is not built: each rank holds whole sequences",
    ),
    (
        "*.megatron.dynamic_context_parallel",
        "context parallelism is not built: each rank holds whole sequences",
    ),
    (
        "*.megatron.max_seqlen_per_dp_cp_rank",
        "context parallelism is not built: each rank holds whole sequences",
    ),
    ("*.megatron.use_dist_checkpointing", HF_CHECKPOINTS),
    ("*.megatron.dist_checkpointing_path", HF_CHECKPOINTS),
    ("*.megatron.dist_checkpointing_prefix", HF_CHECKPOINTS),
    (
        "*.megatron.dist_ckpt_optim_fully_reshardable",
        HF_CHECKPOINTS,
    ),
    (
        "*.megatron.distrib_optim_fully_reshardable_mem_efficient",
        HF_CHECKPOINTS,
    ),
    ("*.megatron.seed", SEEDS),
    (
        "*.megatron.override_ddp_config",
        "data parallelism's settings are `trainer.*` keys",
    ),
    (
        "*.megatron.override_mcore_model_config",
        "the model's shape is its config.json",
    ),
    (
        "*.megatron.override_transformer_config",
        "recomputation is `enable_gradient_checkpointing` (each decoder layer); attention is \
         burn-rlhf's kernel",
    ),
    ("*.megatron.use_mbridge", NO_BRIDGE),
    ("*.megatron.vanilla_mbridge", NO_BRIDGE),
    ("*.checkpoint.mbridge_config", NO_BRIDGE),
    ("*.megatron.pad_bshd_to_minibatch_max", SHAPE_BUCKETS),
    ("*.megatron.pad_to_length_bucket", SHAPE_BUCKETS),
    (
        "*.megatron.use_megatron_fsdp",
        "Megatron's FSDP is not used (data parallelism is `trainer.*`)",
    ),
    ("*.megatron.forward_only", FORWARD_ONLY),
    (
        "*.megatron.router_replay",
        "replaying the rollout's expert routing in training is not built",
    ),
    // The policy's passes.
    (
        "*.calculate_entropy",
        "entropies come with every log-prob pass (`actor/entropy` is always measured)",
    ),
    (
        "*.calculate_sum_pi_squared",
        "Σπ² is computed when the advantage estimator reads it (the optimal token baseline)",
    ),
    (
        "*.use_prefix_grouper",
        "verl's prefix grouper is not built: a prompt's samples share its KV blocks in \
         generation",
    ),
    (
        "*.data_loader_seed",
        "mini-batches are shuffled with `trainer.seed` (and `actor.shuffle`)",
    ),
    (
        "*.checkpoint.save_contents",
        "checkpoints hold the model, the optimiser and the trainer's state, always",
    ),
    (
        "*.checkpoint.load_contents",
        "checkpoints hold the model, the optimiser and the trainer's state, always",
    ),
    (
        "*.checkpoint.async_save",
        "checkpoints are written before the step returns (a kill -9 resumes bit for bit)",
    ),
    (
        "*.checkpoint.strict",
        "a checkpoint must hold every tensor of the model (a missing one is an error)",
    ),
    (
        "*.entropy_from_logits_with_chunking",
        "log-probs and entropies always come from chunked logits \
         (`actor_rollout_ref.model.logits_chunk_size`)",
    ),
    (
        "*.entropy_from_logits_chunk_size",
        "the chunk is `actor_rollout_ref.model.logits_chunk_size`",
    ),
    (
        "*.entropy_checkpointing",
        "the chunked LM head recomputes its logits in the backward always",
    ),
    // Model loading: burn-rlhf's own decoders, from the checkpoint's folder.
    (
        "*.model.hf_config_path",
        "the model's config.json is read from `model.path`",
    ),
    (
        "*.model.use_shm",
        "models load from their files, not shared memory",
    ),
    (
        "*.model.custom_chat_template",
        "the chat template is the tokenizer's (`tokenizer_config.json` or the GGUF's)",
    ),
    (
        "*.model.external_lib",
        "no Python library is imported: the decoders are built in",
    ),
    ("*.model.external_libs", "no Python library is imported"),
    (
        "*.model.enable_activation_offload",
        "activations stay on the device; `enable_gradient_checkpointing` trades them for \
         recomputation",
    ),
    (
        "*.model.exclude_modules",
        "LoRA's modules are chosen by `target_modules` only",
    ),
    (
        "*.model.lora_adapter_path",
        "LoRA adapters start fresh (loading a trained adapter is not built)",
    ),
    (
        "*.model.use_liger",
        "Liger's kernels are not used: the fused kernels here are burn-rlhf's \
         (`use_fused_kernels`)",
    ),
    (
        "*.model.fused_kernel_options",
        "the fused kernels here are burn-rlhf's (CubeCL and the host's)",
    ),
    (
        "*.model.tiled_mlp",
        "MLPs run whole (tiled MLPs are not built)",
    ),
    ("*.model.mtp", "multi-token prediction is not built"),
    (
        "*.model.override_config",
        "HF config overrides other than the dropouts are not read (the checkpoint's \
         config.json is)",
    ),
    // verl's Megatron-style LoRA section (`model.lora.*`): LoRA here is `model.lora_rank`,
    // `lora_alpha`, `target_modules`.
    (
        "*.model.lora",
        "LoRA here is set with `model.lora_rank`, `model.lora_alpha` and \
         `model.target_modules`",
    ),
    // The rollout engine: burn-rlhf's own, in the trainer's process.
    (
        "actor_rollout_ref.rollout.mode",
        "generation runs in the trainer's process, requests scheduled as verl's async mode does",
    ),
    (
        "actor_rollout_ref.rollout.nnodes",
        "generation runs on the trained model's devices",
    ),
    (
        "actor_rollout_ref.rollout.data_parallel_size",
        "generation runs on the trained model's devices, split as it is",
    ),
    (
        "actor_rollout_ref.rollout.expert_parallel_size",
        "generation runs on the trained model's devices, split as it is",
    ),
    (
        "actor_rollout_ref.rollout.pipeline_model_parallel_size",
        "generation runs on the trained model's devices, split as it is",
    ),
    (
        "actor_rollout_ref.rollout.full_determinism",
        "generation repeats bit for bit on one machine already",
    ),
    (
        "actor_rollout_ref.rollout.seed",
        "sampling is seeded by `trainer.seed` and the step",
    ),
    (
        "actor_rollout_ref.rollout.ignore_eos",
        "generation stops at the model's end-of-sequence tokens",
    ),
    (
        "critic.model.lora_alpha",
        "the critic trains every weight (LoRA is the actor's)",
    ),
    (
        "critic.model.target_modules",
        "the critic trains every weight (LoRA is the actor's)",
    ),
    (
        "critic.model.use_fused_kernels",
        "the critic's kernels follow `actor_rollout_ref.model.use_fused_kernels`",
    ),
    (
        "actor_rollout_ref.rollout.enforce_eager",
        "there are no CUDA graphs to capture",
    ),
    (
        "actor_rollout_ref.rollout.cudagraph_capture_sizes",
        "there are no CUDA graphs to capture",
    ),
    (
        "actor_rollout_ref.rollout.max_model_len",
        "sequences are at most `data.max_prompt_length` + `data.max_response_length`",
    ),
    (
        "actor_rollout_ref.rollout.enable_prefix_caching",
        "a prompt's samples and a conversation's turns share their KV blocks always",
    ),
    (
        "actor_rollout_ref.rollout.scheduling_policy",
        "requests are scheduled first come, first served",
    ),
    (
        "actor_rollout_ref.rollout.disable_log_stats",
        "the engine logs no statistics of its own (`timing_s/gen` and the rollout metrics are \
         measured)",
    ),
    (
        "actor_rollout_ref.rollout.over_sample_rate",
        "over-sampling and aborting the slowest requests is not built",
    ),
    (
        "actor_rollout_ref.rollout.multi_stage_wake_up",
        "the rollout reads the trained weights in place: nothing sleeps or wakes",
    ),
    (
        "actor_rollout_ref.rollout.engine_kwargs",
        "the engine's settings are `rollout.*` keys (vLLM's and SGLang's own are not read)",
    ),
    (
        "actor_rollout_ref.rollout.router_config_path",
        "requests go to the one engine in the process",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.function_tool_path",
        "tools come from `multi_turn.tool_config_path`",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        "turns are token in, token out: each turn's tokens are the model's own, never \
         re-rendered",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
        "turns are token in, token out: there is no re-tokenisation to check",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
        "a prompt's samples are `rollout.n`",
    ),
    (
        "actor_rollout_ref.rollout.calculate_log_probs",
        "the rollout's log-probs are always recorded (rollout correction reads them)",
    ),
    (
        "actor_rollout_ref.rollout.agent.num_workers",
        "agent loops run in the engine's scheduler, not in worker processes",
    ),
    (
        "actor_rollout_ref.rollout.agent.agent_loop_config_path",
        "the agent loops are verl's `single_turn_agent` and `tool_agent`, built in",
    ),
    (
        "actor_rollout_ref.rollout.agent.custom_async_server",
        "requests go to burn-rlhf's own engine",
    ),
    (
        "actor_rollout_ref.rollout.checkpoint_engine",
        "the rollout reads the trained weights in place: nothing is transferred",
    ),
    (
        "actor_rollout_ref.rollout.trace",
        "rollout tracing is not built",
    ),
    (
        "actor_rollout_ref.rollout.skip_tokenizer_init",
        "the engine takes token ids: there is no tokenizer in it",
    ),
    (
        "actor_rollout_ref.rollout.enable_rollout_routing_replay",
        "replaying the rollout's expert routing in training is not built",
    ),
    (
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval",
        "the rollout measures no expert load (`actor/router_aux_loss` is measured in training)",
    ),
    (
        "actor_rollout_ref.rollout.prometheus",
        "there is no metrics server",
    ),
    (
        "actor_rollout_ref.rollout.quantization",
        "generation runs on the trained weights (`rollout.dtype` casts them)",
    ),
    (
        "actor_rollout_ref.rollout.quantization_config_file",
        "generation runs on the trained weights (`rollout.dtype` casts them)",
    ),
    (
        "actor_rollout_ref.rollout.disaggregation",
        "prefill and decode run in the one engine",
    ),
    // Data.
    (
        "data.return_raw_input_ids",
        "the rollout batch keeps the policy's token ids only",
    ),
    (
        "data.return_full_prompt",
        "the rollout batch keeps the policy's token ids only",
    ),
    (
        "data.custom_cls",
        "datasets are read in verl's RLHFDataset layout (jsonl or parquet)",
    ),
    (
        "data.apply_chat_template_kwargs",
        "the chat template is rendered with the messages and `add_generation_prompt` only",
    ),
    (
        "trainer.checkpoint_callback_class",
        "checkpoints are written by the trainer itself",
    ),
    (
        "custom_reward_function.path",
        "reward functions are Rust functions registered by name \
         (`custom_reward_function.name`, `RewardRegistry`)",
    ),
    // verl's reward-loop workers (the `reward_model.*` keys of its reward loop, all null by
    // default, and the new `reward.*` section): scores are computed in the trainer's process.
    (
        "reward_model.num_workers",
        "scores are computed in the trainer's process",
    ),
    ("reward_model.enable_resource_pool", RM_ON_TRAINER),
    ("reward_model.n_gpus_per_node", RM_ON_TRAINER),
    ("reward_model.nnodes", RM_ON_TRAINER),
    (
        "reward_model.reward_loop_source",
        "verl's reward loop is not used: scores are computed in the trainer's process",
    ),
    (
        "reward_model.reward_loop_module_path",
        "verl's reward loop is not used: scores are computed in the trainer's process",
    ),
    (
        "reward_model.reward_loop_class_name",
        "verl's reward loop is not used: scores are computed in the trainer's process",
    ),
    (
        "reward_model.model.external_lib",
        "no Python library is imported: the decoders are built in",
    ),
    (
        "reward_model.rollout",
        "a generative reward model is not built: a reward model scores with its head",
    ),
    (
        "reward.num_workers",
        "scores are computed in the trainer's process",
    ),
    (
        "reward.reward_manager.source",
        "reward managers are burn-rlhf's: `reward_model.reward_manager`",
    ),
    (
        "reward.reward_manager.module",
        "reward managers are burn-rlhf's: `reward_model.reward_manager`",
    ),
    ("reward.reward_model.enable_resource_pool", RM_ON_TRAINER),
    ("reward.reward_model.n_gpus_per_node", RM_ON_TRAINER),
    ("reward.reward_model.nnodes", RM_ON_TRAINER),
    (
        "reward.reward_model.rollout",
        "a generative reward model is not built: a reward model scores with its head",
    ),
    (
        "reward.sandbox_fusion",
        "a sandbox is configured per tool, in the tool config file",
    ),
    (
        "reward.custom_reward_function.name",
        "the reward function is `custom_reward_function.name`, a Rust function registered by \
         that name (verl's function in a file is not read)",
    ),
    (
        "reward.custom_reward_function.path",
        "reward functions are Rust functions registered by name \
         (`custom_reward_function.name`, `RewardRegistry`)",
    ),
];

const NO_MUON: &str = "the optimiser is AdamW (Muon is not built)";
const HF_CHECKPOINTS: &str = "checkpoints are HF safetensors folders plus the trainer's state";
const SHAPE_BUCKETS: &str =
    "sequence shapes are bucketed by `actor_rollout_ref.model.shape_bucket`";
const FORWARD_ONLY: &str =
    "verl's engine flag: the reference only runs forward here, the actor and critic train";
const F32_OPTIMISER: &str = "gradients and AdamW's moments are f32";
const RM_ON_TRAINER: &str = "a reward model runs on the trainer's devices";
const NO_BRIDGE: &str = "HF checkpoints are read and written directly: there is no bridge";
const SEEDS: &str = "weights come from the checkpoint; sampling and shuffling are seeded by `trainer.seed` and `data.seed`";
const MEGATRON_SCHEDULE: &str = "Megatron's scheduler keys: the schedule is \
     `optim.lr_scheduler_type`, `optim.lr_warmup_steps` and `optim.min_lr_ratio`";

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
    LEAVES.get_or_init(|| leaves_of(&[MEGATRON_TREE, PPO_TREE]))
}

/// Every leaf of verl's SFT tree.
fn sft_leaves() -> &'static BTreeMap<String, Value> {
    static LEAVES: OnceLock<BTreeMap<String, Value>> = OnceLock::new();
    LEAVES.get_or_init(|| leaves_of(&[SFT_TREE]))
}

/// The leaves of `trees`, a later tree's value where two have a key.
fn leaves_of(trees: &[&str]) -> BTreeMap<String, Value> {
    let mut all = BTreeMap::new();
    for text in trees {
        let tree: Value = serde_saphyr::from_str(text).expect("verl's tree is YAML");
        collect(&tree, "", &mut all);
    }
    all
}

/// For a key of an inert section of `dialect`'s tree: why it changes nothing, and verl's value.
pub fn inert_in(dialect: VerlDialect, key: &str) -> Option<(&'static str, &'static Value)> {
    match dialect {
        VerlDialect::Ppo => inert_reason(key).zip(verl_value(key)),
        VerlDialect::Sft => sft_inert_reason(key).zip(sft_leaves().get(key)),
    }
}

/// [`inert_reason`] of the SFT tree's `key`: its own section's (`data`, `trainer`), or the PPO
/// actor's section it shares.
pub fn sft_inert_reason(key: &str) -> Option<&'static str> {
    inert_reason(&super::verl_keys::sft_as_ppo(key).unwrap_or_else(|| key.to_string()))
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
