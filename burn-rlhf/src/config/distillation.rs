//! `distillation.*`: verl 0.9.1's on-policy distillation (`trainer/config/distillation/
//! distillation.yaml`, `workers/config/distillation.py`): frozen teachers score the student's
//! sampled tokens and the student is trained toward them, alone or beside the task's rewards.
//!
//! The teachers run on a pool of devices of their own, as verl runs them (`nnodes` x
//! `n_gpus_per_node`, each teacher's `num_replicas`): here devices of the trainer's process after
//! its own, one whole replica per device, scoring a step's batch while the trainer runs its own
//! passes over it. With `nnodes` 0 (the YAML's default, which verl itself refuses once enabled)
//! they run beside the reference on the trainer's devices. The rest of `inference.*` (vLLM's
//! settings) is read only at verl's values.

use std::collections::BTreeMap;

use burn::tensor::FloatDType;
use burn_rlhf_algos::distillation::{
    DistillationLossMode, DistillationLossParams, TaskLossMix, TeacherDivergence,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::problems::Problems;

/// `distillation.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationConfig {
    /// Train the student toward the teachers.
    pub enabled: bool,
    /// How the teachers' scores become a loss.
    pub distillation_loss: DistillationLossConfig,
    /// The teachers' pool: devices per node (with `nnodes` 0, verl's default 8, unread).
    pub n_gpus_per_node: usize,
    /// The teachers' pool: nodes (here 1 at most, the trainer's process; 0: no pool, the teachers
    /// run on the trainer's devices).
    pub nnodes: usize,
    /// The teachers by entry name (any names; verl's single-teacher entry is `teacher_model`).
    pub teacher_models: BTreeMap<String, TeacherModelConfig>,
    /// The field of a row that picks its teacher (each teacher's `key`): `data_source`.
    pub teacher_key: String,
}

impl Default for DistillationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            distillation_loss: DistillationLossConfig::default(),
            n_gpus_per_node: 8,
            nnodes: 0,
            teacher_models: BTreeMap::new(),
            teacher_key: "data_source".into(),
        }
    }
}

/// `distillation.distillation_loss.*` as written (verl's YAML defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationLossConfig {
    /// The per-token divergence: `k3` (`low_var_kl`), `kl`/`k1`, `abs`, `mse`/`k2`,
    /// `forward_kl_topk`.
    pub loss_mode: String,
    /// The teacher's top-k for `forward_kl_topk`.
    pub topk: Option<usize>,
    /// Keep the task's policy loss beside the distillation loss.
    pub use_task_rewards: bool,
    /// The distillation loss's weight beside the task's.
    pub distillation_loss_coef: f64,
    /// Each token's divergence clamped to `[-c, c]`.
    pub loss_max_clamp: Option<f64>,
    /// Log-probs clamped below (`forward_kl_topk`).
    pub log_prob_min_clamp: Option<f64>,
    /// `-divergence` as each token's advantage in the clipped policy loss, instead of
    /// backpropagating the divergence.
    pub use_policy_gradient: bool,
    /// The policy loss of the policy gradient (verl: `vanilla` only).
    pub policy_loss_mode: String,
    /// Its clip range, when `clip_ratio_low`/`high` are null.
    pub clip_ratio: f64,
    /// Its lower clip range.
    pub clip_ratio_low: Option<f64>,
    /// Its upper clip range.
    pub clip_ratio_high: Option<f64>,
}

impl Default for DistillationLossConfig {
    fn default() -> Self {
        Self {
            loss_mode: "k3".into(),
            topk: Some(32),
            use_task_rewards: true,
            distillation_loss_coef: 1.0,
            loss_max_clamp: None,
            log_prob_min_clamp: None,
            use_policy_gradient: false,
            policy_loss_mode: "vanilla".into(),
            clip_ratio: 0.2,
            clip_ratio_low: Some(0.2),
            clip_ratio_high: Some(0.2),
        }
    }
}

/// `distillation.teacher_models.<name>.*` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherModelConfig {
    /// The value of the rows' `teacher_key` field this teacher scores (one teacher: every row).
    pub key: Option<String>,
    /// A local HF folder, a `.gguf` file or a hub id.
    pub model_path: Option<String>,
    /// Replicas of this teacher on the pool, one device each (one teacher: the whole pool, as
    /// verl derives it; 0 without a pool).
    pub num_replicas: usize,
    /// verl's inference server settings (vLLM's), read at verl's values only.
    pub inference: BTreeMap<String, Value>,
}

/// One teacher, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherSettings {
    /// The entry's name (for messages).
    pub name: String,
    /// The rows it scores: those whose `data_source` is this; `None`: every row (one teacher).
    pub key: Option<String>,
    /// Where its weights and tokenizer are.
    pub model_path: String,
    /// `inference.dtype` as written (`Some(None)`: float32); `None`: unwritten, the rollout's,
    /// as verl derives it.
    pub dtype: Option<Option<FloatDType>>,
    /// Its replicas on the teachers' pool, one device each (0: no pool).
    pub replicas: usize,
}

impl TeacherSettings {
    /// The dtype its weights are held and its pass computes in (`None`: float32), given the
    /// rollout's.
    pub fn dtype(&self, rollout: Option<FloatDType>) -> Option<FloatDType> {
        self.dtype.unwrap_or(rollout)
    }
}

/// `distillation.*`, decoded (when `enabled`).
#[derive(Debug, Clone, PartialEq)]
pub struct DistillationSettings {
    /// The per-token divergence and what the teachers' pass gives for it.
    pub divergence: TeacherDivergence,
    /// The clamp and the policy gradient.
    pub params: DistillationLossParams,
    /// How it joins the task's loss.
    pub mix: TaskLossMix,
    /// The teachers.
    pub teachers: Vec<TeacherSettings>,
    /// Devices of the teachers' own pool (`nnodes` x `n_gpus_per_node`); 0: they run on the
    /// trainer's devices.
    pub pool_devices: usize,
}

/// verl's teacher inference keys and their values (the ones it derives from the actor's rollout
/// are never to be written).
fn verl_inference_defaults() -> BTreeMap<&'static str, Option<Value>> {
    BTreeMap::from([
        ("name", None),
        ("dtype", None),
        ("prompt_length", None),
        ("response_length", None),
        ("temperature", None),
        ("gpu_memory_utilization", Some(json!(0.5))),
        ("enforce_eager", Some(json!(true))),
        ("cudagraph_capture_sizes", Some(Value::Null)),
        ("free_cache_engine", Some(json!(true))),
        ("data_parallel_size", Some(json!(1))),
        ("expert_parallel_size", Some(json!(1))),
        ("tensor_model_parallel_size", Some(json!(2))),
        ("max_num_batched_tokens", Some(json!(8192))),
        ("max_model_len", Some(Value::Null)),
        ("max_num_seqs", Some(json!(1024))),
        ("load_format", Some(json!("auto"))),
        ("engine_kwargs", Some(json!({}))),
        ("limit_images", Some(Value::Null)),
        ("enable_chunked_prefill", Some(json!(true))),
        ("enable_prefix_caching", Some(json!(true))),
        ("disable_log_stats", Some(json!(true))),
        ("skip_tokenizer_init", Some(json!(true))),
    ])
}

/// The inference keys a pool reads: a replica's devices (tensor x data parallel), 1 here.
const POOL_READ: &[&str] = &["tensor_model_parallel_size", "data_parallel_size"];

/// Whether two config values are the same (numbers by value).
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

impl DistillationConfig {
    /// Decodes and checks `distillation.*`; `None` when off. `actor_tp`: the actor's tensor
    /// parallelism (the teachers are whole models).
    pub(super) fn decode(&self, p: &mut Problems, actor_tp: usize) -> Option<DistillationSettings> {
        const KEY: &str = "distillation.distillation_loss";
        let l = &self.distillation_loss;
        let mode = match DistillationLossMode::from_name(&l.loss_mode) {
            Ok(mode) => Some(mode),
            Err(e) => {
                p.check(false, || format!("`{KEY}.loss_mode`: {e}"));
                None
            }
        };
        p.check(l.policy_loss_mode == "vanilla", || {
            format!(
                "`{KEY}.policy_loss_mode` = `{}`: verl 0.9.1 distils with the `vanilla` policy \
                 loss only",
                l.policy_loss_mode
            )
        });
        p.check(l.use_policy_gradient || l.loss_mode != "k1", || {
            format!(
                "`{KEY}.loss_mode` = `k1` with `use_policy_gradient=false`: backpropagating k1 \
                 is wrong, its gradient does not depend on the teacher (verl refuses it too)"
            )
        });
        p.check(l.topk.is_none_or(|k| k >= 1), || {
            format!("`{KEY}.topk` must be >= 1")
        });
        p.check(
            l.loss_max_clamp.is_none_or(|c| c >= 0.0 && c.is_finite()),
            || format!("`{KEY}.loss_max_clamp` must be a finite bound >= 0"),
        );
        // Read by the top-k loss only (verl's estimators pass them by): refused beside another.
        let topk_mode = mode.is_some_and(|m| m.uses_topk());
        let defaults = DistillationLossConfig::default();
        for (key, set) in [
            ("topk", l.topk != defaults.topk),
            ("log_prob_min_clamp", l.log_prob_min_clamp.is_some()),
        ] {
            p.check(topk_mode || !set, || {
                format!(
                    "`{KEY}.{key}` is read by `loss_mode=forward_kl_topk` only; `{}` reads the \
                     teacher's log-prob of the sampled token",
                    l.loss_mode
                )
            });
        }
        // Read when the clip ranges are null (verl's fallback).
        p.check(
            l.clip_ratio == defaults.clip_ratio
                || l.clip_ratio_low.is_none()
                || l.clip_ratio_high.is_none(),
            || {
                format!(
                    "`{KEY}.clip_ratio` is read where `clip_ratio_low` or `clip_ratio_high` is \
                     null; both are set"
                )
            },
        );
        let pool = self.check_pool(p);
        for (name, t) in &self.teacher_models {
            let at = format!("distillation.teacher_models.{name}");
            let defaults = verl_inference_defaults();
            for (k, v) in &t.inference {
                if k == "dtype" || (pool > 0 && POOL_READ.contains(&k.as_str())) {
                    // Read: the teacher's own dtype, decoded with the teachers; a replica's
                    // devices, checked with the pool.
                    continue;
                }
                if k == "temperature" {
                    // verl scores at 1.0 whatever this says (`_get_teacher_sampling_params`).
                    p.check(v.as_f64() == Some(1.0), || {
                        format!(
                            "`{at}.inference.temperature` = {v}: verl's teachers score at \
                             temperature 1.0 whatever it says (their log-probs are a forward \
                             pass), as here; set 1.0 or remove it"
                        )
                    });
                    continue;
                }
                match defaults.get(k.as_str()) {
                    Some(Some(verl)) if same(v, verl) => {}
                    Some(Some(verl)) => p.check(false, || {
                        format!(
                            "`{at}.inference.{k}` is read only at verl's value `{verl}`: the \
                             teacher is scored by this trainer's own pass, not a vLLM server"
                        )
                    }),
                    Some(None) => p.check(false, || {
                        format!(
                            "`{at}.inference.{k}`: verl derives it from the actor's rollout; \
                             the teacher's pass here reads the student's batch as it is"
                        )
                    }),
                    None => p.check(false, || {
                        format!(
                            "`{at}.inference.{k}` is not a key of verl's teacher inference \
                             config; known: {}",
                            defaults.keys().cloned().collect::<Vec<_>>().join(", ")
                        )
                    }),
                }
            }
        }
        if !self.enabled {
            return None;
        }
        let divergence = match mode? {
            DistillationLossMode::Estimator(penalty) => TeacherDivergence::Estimator(penalty),
            DistillationLossMode::ForwardKlTopk => {
                let Some(k) = l.topk else {
                    p.check(false, || {
                        format!("`{KEY}.topk` must be set for `loss_mode=forward_kl_topk`")
                    });
                    return None;
                };
                TeacherDivergence::ForwardKlTopk {
                    k,
                    log_prob_min_clamp: l.log_prob_min_clamp,
                }
            }
        };
        p.check(actor_tp == 1, || {
            "`distillation.enabled` with `actor_rollout_ref.actor.megatron.\
             tensor_model_parallel_size` > 1: a split student with whole teachers is not built"
                .into()
        });
        p.check(self.teacher_key == "data_source", || {
            format!(
                "`distillation.teacher_key` = `{}`: rows pick their teacher by `data_source`, \
                 the one field a row carries here",
                self.teacher_key
            )
        });
        let mut teachers = self.decode_teachers(p);
        self.place_replicas(p, pool, &mut teachers);
        let clip = |side: Option<f64>| side.unwrap_or(l.clip_ratio);
        Some(DistillationSettings {
            divergence,
            params: DistillationLossParams {
                loss_max_clamp: l.loss_max_clamp,
                use_policy_gradient: l.use_policy_gradient,
                clip_ratio_low: clip(l.clip_ratio_low),
                clip_ratio_high: clip(l.clip_ratio_high),
            },
            mix: TaskLossMix {
                use_task_rewards: l.use_task_rewards,
                distillation_loss_coef: l.distillation_loss_coef,
            },
            teachers,
            pool_devices: pool,
        })
    }

    /// The teachers' pool's devices (`nnodes` x `n_gpus_per_node`; 0: none), checked: one host
    /// (the trainer's process), and each replica one device.
    fn check_pool(&self, p: &mut Problems) -> usize {
        const AT: &str = "distillation";
        if self.nnodes == 0 {
            p.check(self.n_gpus_per_node == 8, || {
                format!(
                    "`{AT}.n_gpus_per_node` = {} with `{AT}.nnodes` = 0: no pool of the \
                     teachers' own is made, so it would be ignored; set `{AT}.nnodes=1` for a \
                     pool of that many devices, or remove it",
                    self.n_gpus_per_node
                )
            });
            for (name, t) in &self.teacher_models {
                p.check(t.num_replicas == 0, || {
                    format!(
                        "`{AT}.teacher_models.{name}.num_replicas` = {}: replicas are placed on \
                         the teachers' pool, and `{AT}.nnodes` = 0 makes none (the teachers run \
                         on the trainer's devices); set `{AT}.nnodes=1` and \
                         `{AT}.n_gpus_per_node`, or 0 replicas",
                        t.num_replicas
                    )
                });
            }
            return 0;
        }
        p.check(self.nnodes == 1, || {
            format!(
                "`{AT}.nnodes` = {}: the teachers' pool is devices of the trainer's process here, \
                 one host; set 1",
                self.nnodes
            )
        });
        p.check(self.n_gpus_per_node >= 1, || {
            format!("`{AT}.n_gpus_per_node` must be >= 1 for a pool of the teachers' own")
        });
        for (name, t) in &self.teacher_models {
            for key in POOL_READ {
                let value = t.inference.get(*key).and_then(Value::as_f64);
                // verl's default: a replica of 2 tensor-parallel devices.
                let written = value.unwrap_or(if *key == "tensor_model_parallel_size" {
                    2.0
                } else {
                    1.0
                });
                p.check(written == 1.0, || {
                    format!(
                        "`{AT}.teacher_models.{name}.inference.{key}` = {written}: a teacher's \
                         replica here is one whole model on one device of the pool (its pass \
                         does not split a model); set 1, and the pool's {} devices hold that \
                         many replicas",
                        self.nnodes * self.n_gpus_per_node
                    )
                });
            }
        }
        self.nnodes * self.n_gpus_per_node
    }

    /// Each teacher's replicas on a pool of `pool` devices, as verl places them: one teacher
    /// takes the whole pool (verl overwrites its `num_replicas`: a written one that differs is
    /// refused); several take their `num_replicas` each, which must fill the pool.
    fn place_replicas(&self, p: &mut Problems, pool: usize, teachers: &mut [TeacherSettings]) {
        const AT: &str = "distillation.teacher_models";
        if pool == 0 {
            return;
        }
        if let [one] = teachers {
            let written = self.teacher_models[&one.name].num_replicas;
            p.check(written == 0 || written == pool, || {
                format!(
                    "`{AT}.{}.num_replicas` = {written}: one teacher takes the whole pool of \
                     {pool} devices (verl overwrites it with that); remove it",
                    one.name
                )
            });
            one.replicas = pool;
            return;
        }
        let mut placed = 0;
        for t in teachers.iter_mut() {
            t.replicas = self.teacher_models[&t.name].num_replicas;
            p.check(t.replicas >= 1, || {
                format!(
                    "`{AT}.{}.num_replicas` must be >= 1: several teachers share the pool by it",
                    t.name
                )
            });
            placed += t.replicas;
        }
        p.check(placed == pool, || {
            format!(
                "the teachers' `num_replicas` sum to {placed} devices, and the pool \
                 (`distillation.nnodes` x `distillation.n_gpus_per_node`) has {pool}: they must \
                 match, as verl requires"
            )
        });
    }

    /// verl's teacher entries: one entry scores every row; several are routed by `key` (and
    /// verl drops the default `teacher_model` entry among several: refused here, not dropped).
    fn decode_teachers(&self, p: &mut Problems) -> Vec<TeacherSettings> {
        const AT: &str = "distillation.teacher_models";
        let entries = &self.teacher_models;
        p.check(!entries.is_empty(), || {
            format!(
                "`distillation.enabled` needs a teacher: set `{AT}.teacher_model.model_path` (and \
                 `key` for several teachers)"
            )
        });
        let several = entries.len() > 1;
        p.check(!several || !entries.contains_key("teacher_model"), || {
            format!(
                "`{AT}` has `teacher_model` beside other entries: verl drops that entry silently \
                 when others are added; give it another name"
            )
        });
        let mut teachers = Vec::new();
        let mut keys = std::collections::BTreeSet::new();
        for (name, t) in entries {
            let at = format!("{AT}.{name}");
            let Some(path) = t.model_path.clone().filter(|m| !m.is_empty()) else {
                p.check(false, || format!("`{at}.model_path` must be set"));
                continue;
            };
            let key = match (several, &t.key) {
                (false, _) => None,
                (true, Some(k)) => {
                    p.check(keys.insert(k.clone()), || {
                        format!("`{at}.key` = `{k}`: another teacher has that key")
                    });
                    Some(k.clone())
                }
                (true, None) => {
                    p.check(false, || {
                        format!("`{at}.key` must be set: several teachers are routed by it")
                    });
                    None
                }
            };
            let dtype = match t.inference.get("dtype") {
                None => None,
                Some(Value::String(name)) => {
                    super::model::dtype(p, &format!("{at}.inference.dtype"), name)
                }
                Some(other) => {
                    p.check(false, || {
                        format!("`{at}.inference.dtype` must be a dtype's name, got `{other}`")
                    });
                    None
                }
            };
            teachers.push(TeacherSettings {
                name: name.clone(),
                key,
                model_path: path,
                dtype,
                replicas: 0,
            });
        }
        teachers
    }
}
