//! Every fixture in `$RLHF_FIXTURES_DIR/algos`: verl 0.9.1's own inputs, outputs and gradients,
//! recomputed in f32 through this crate's public API (the registry's trait objects for estimators
//! and losses) and compared within each file's tolerance; and likewise TRL's reward-model loss
//! (`trl/`).
//!
//! The test fails on an unknown kind or name, on an output or gradient it cannot produce, on an
//! empty or missing directory, and lists every mismatch.

use std::collections::BTreeMap;
use std::path::Path;

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf_algos::functional::{entropy_and_logprobs, masked_whiten, to_vec};
use burn_rlhf_algos::kl::{kl_penalty, AdaptiveKlController, KlController};
use burn_rlhf_algos::policy_loss::BypassLossType;
use burn_rlhf_algos::preference::{
    bradley_terry_loss, online_dpo_loss, reward_pair_stats, sppo_centered_rewards, sppo_loss,
    DpoLossType,
};
use burn_rlhf_algos::rollout_correction::RolloutCorrection;
use burn_rlhf_algos::{
    agg_loss, value_loss, AdvantageInput, EstimatorParams, GlobalBatchInfo, KlPenalty, LossAggMode,
    PolicyLossInput, PolicyLossParams, Registry,
};
use serde_json::Value;

/// The CPU default; with `--features wgpu` (or `cuda`), the non-fused CubeCL backend, so the
/// fixtures also check the fused kernels (GAE, the PPO and value losses) there.
#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
type Inner = burn::backend::Flex;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
type Inner = burn_rlhf_algos::kernels::KernelBackend;
type B = Autodiff<Inner>;

/// A fixture tensor: shape and row-major data.
struct Fx {
    shape: Vec<usize>,
    data: Vec<f64>,
}

impl Fx {
    fn parse(v: &Value) -> Result<Self, String> {
        match v {
            Value::Number(n) => Ok(Fx {
                shape: vec![],
                data: vec![n.as_f64().unwrap()],
            }),
            Value::Object(o) => {
                let shape = o
                    .get("shape")
                    .and_then(Value::as_array)
                    .ok_or("tensor without `shape`")?
                    .iter()
                    .map(|d| d.as_u64().map(|d| d as usize).ok_or("bad shape entry"))
                    .collect::<Result<Vec<_>, _>>()?;
                let data = o
                    .get("data")
                    .and_then(Value::as_array)
                    .ok_or("tensor without `data`")?
                    .iter()
                    .map(|d| d.as_f64().ok_or("non-numeric data"))
                    .collect::<Result<Vec<_>, _>>()?;
                let expected: usize = shape.iter().product();
                if data.len() != expected {
                    return Err(format!(
                        "shape {shape:?} needs {expected} values, has {}",
                        data.len()
                    ));
                }
                Ok(Fx { shape, data })
            }
            _ => Err("expected a tensor object or a number".into()),
        }
    }

    fn f32s(&self) -> Vec<f32> {
        self.data.iter().map(|&x| x as f32).collect()
    }

    fn t1(&self) -> Tensor<B, 1> {
        Tensor::from_data(
            TensorData::new(self.f32s(), [self.data.len()]),
            &Default::default(),
        )
    }

    fn t2(&self) -> Result<Tensor<B, 2>, String> {
        match self.shape.as_slice() {
            [b, t] => Ok(Tensor::from_data(
                TensorData::new(self.f32s(), [*b, *t]),
                &Default::default(),
            )),
            s => Err(format!("expected a 2-d tensor, got shape {s:?}")),
        }
    }

    fn t3(&self) -> Result<Tensor<B, 3>, String> {
        match self.shape.as_slice() {
            [b, t, v] => Ok(Tensor::from_data(
                TensorData::new(self.f32s(), [*b, *t, *v]),
                &Default::default(),
            )),
            s => Err(format!("expected a 3-d tensor, got shape {s:?}")),
        }
    }

    fn int2(&self) -> Result<Tensor<B, 2, Int>, String> {
        match self.shape.as_slice() {
            [b, t] => {
                let ints: Vec<i64> = self.data.iter().map(|&x| x as i64).collect();
                Ok(Tensor::from_data(
                    TensorData::new(ints, [*b, *t]),
                    &Default::default(),
                ))
            }
            s => Err(format!("expected 2-d labels, got shape {s:?}")),
        }
    }
}

/// One fixture file.
struct Case {
    kind: String,
    name: String,
    params: serde_json::Map<String, Value>,
    inputs: BTreeMap<String, Fx>,
    outputs: BTreeMap<String, Fx>,
    grads: BTreeMap<String, Fx>,
    atol: f64,
    rtol: f64,
}

impl Case {
    fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
        let field = |k: &str| v.get(k).ok_or_else(|| format!("missing `{k}`"));
        let tensors = |k: &str| -> Result<BTreeMap<String, Fx>, String> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(BTreeMap::new()),
                Some(Value::Object(o)) => o
                    .iter()
                    .map(|(n, t)| {
                        Fx::parse(t)
                            .map(|f| (n.clone(), f))
                            .map_err(|e| format!("{k}.{n}: {e}"))
                    })
                    .collect(),
                Some(_) => Err(format!("`{k}` is not an object")),
            }
        };
        let tol = field("tolerance")?;
        Ok(Case {
            kind: field("kind")?
                .as_str()
                .ok_or("`kind` is not a string")?
                .to_string(),
            name: field("name")?
                .as_str()
                .ok_or("`name` is not a string")?
                .to_string(),
            params: v
                .get("params")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
            inputs: tensors("inputs")?,
            outputs: tensors("outputs")?,
            grads: tensors("grads")?,
            atol: tol
                .get("atol")
                .and_then(Value::as_f64)
                .ok_or("tolerance.atol missing")?,
            rtol: tol
                .get("rtol")
                .and_then(Value::as_f64)
                .ok_or("tolerance.rtol missing")?,
        })
    }

    fn input(&self, name: &str) -> Result<&Fx, String> {
        self.inputs
            .get(name)
            .ok_or_else(|| format!("input `{name}` missing"))
    }

    fn f(&self, name: &str) -> Option<f64> {
        self.params.get(name).and_then(Value::as_f64)
    }

    fn s(&self, name: &str) -> Option<&str> {
        self.params.get(name).and_then(Value::as_str)
    }

    /// verl's `rollout_correction` keys among the params.
    fn rollout_correction(&self) -> Result<RolloutCorrection, String> {
        RolloutCorrection::from_verl_keys(
            self.s("rollout_is"),
            self.s("rollout_is_threshold").unwrap_or("2.0"),
            self.params
                .get("rollout_is_batch_normalize")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            self.s("rollout_rs"),
            self.s("rollout_rs_threshold"),
        )
        .map_err(|e| e.to_string())
    }

    fn agg_mode(&self) -> Result<LossAggMode, String> {
        LossAggMode::from_name(self.s("loss_agg_mode").unwrap_or("token-mean"))
            .map_err(|e| e.to_string())
    }

    fn expect_objective(&self, ours: &str) -> Result<(), String> {
        match self.s("grad_objective") {
            Some(theirs) if theirs.replace(' ', "") != ours.replace(' ', "") => Err(format!(
                "grad_objective `{theirs}` is not the one this test computes (`{ours}`)"
            )),
            _ => Ok(()),
        }
    }
}

/// What we computed: outputs and gradients by name.
#[derive(Default)]
struct Ours {
    outputs: BTreeMap<String, Vec<f64>>,
    grads: BTreeMap<String, Vec<f64>>,
}

impl Ours {
    fn out<const D: usize>(&mut self, name: &str, t: Tensor<B, D>) {
        self.outputs
            .insert(name.into(), to_vec(t).into_iter().map(f64::from).collect());
    }

    fn scalar(&mut self, name: &str, v: f64) {
        self.outputs.insert(name.into(), vec![v]);
    }

    fn grad<const D: usize>(
        &mut self,
        name: &str,
        x: &Tensor<B, D>,
        grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
    ) -> Result<(), String> {
        let g = x
            .grad(grads)
            .ok_or_else(|| format!("no gradient reached `{name}`"))?;
        self.grads.insert(
            name.into(),
            g.into_data().iter::<f32>().map(f64::from).collect(),
        );
        Ok(())
    }
}

fn compute(case: &Case) -> Result<Ours, String> {
    let mut ours = Ours::default();
    let registry = Registry::<B>::builtin();
    match case.kind.as_str() {
        "advantage" => {
            let params = EstimatorParams {
                sppo_beta: case.f("beta").unwrap_or(1.0),
                gamma: case.f("gamma").unwrap_or(1.0),
                lam: case.f("lam").unwrap_or(1.0),
                epsilon: case.f("epsilon").unwrap_or(1e-6),
                norm_adv_by_std_in_grpo: case
                    .params
                    .get("norm_adv_by_std_in_grpo")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
            };
            let estimator = registry
                .estimator(&case.name, &params)
                .map_err(|e| e.to_string())?;
            let input = AdvantageInput {
                token_level_rewards: case.input("token_level_rewards")?.t2()?,
                response_mask: case.input("response_mask")?.t2()?,
                values: case.inputs.get("values").map(Fx::t2).transpose()?,
                group_ids: match case.inputs.get("index") {
                    Some(ix) => ix.data.iter().map(|&x| x as u64).collect(),
                    None => (0..case.input("response_mask")?.shape[0] as u64).collect(),
                },
                reward_baselines: case.inputs.get("reward_baselines").map(Fx::t1),
                old_log_probs: case.inputs.get("old_log_probs").map(Fx::t2).transpose()?,
                sum_pi_squared: case.inputs.get("sum_pi_squared").map(Fx::t2).transpose()?,
                rollout_is_weights: case
                    .inputs
                    .get("rollout_is_weights")
                    .map(Fx::t2)
                    .transpose()?,
            };
            let out = estimator.compute(&input).map_err(|e| e.to_string())?;
            ours.out("advantages", out.advantages);
            ours.out("returns", out.returns);
        }
        "masked_whiten" => {
            let shift = case
                .params
                .get("shift_mean")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            let w = masked_whiten(
                case.input("values")?.t2()?,
                case.input("mask")?.t2()?,
                shift,
            )
            .map_err(|e| e.to_string())?;
            ours.out("whitened", w);
        }
        "logits" => {
            if case.name != "entropy_and_logprobs" {
                return Err(format!("unknown logits case `{}`", case.name));
            }
            case.expect_objective("sum(logprobs*mask) + 0.5*sum(entropy*mask)")?;
            let logits = case.input("logits")?.t3()?.require_grad();
            let mask = case.input("mask")?.t2()?;
            let (entropy, logprobs) = entropy_and_logprobs(
                logits.clone(),
                case.input("labels")?.int2()?,
                case.f("temperature").unwrap_or(1.0),
            );
            let objective =
                (logprobs.clone() * mask.clone()).sum() + (entropy.clone() * mask).sum() * 0.5;
            let grads = objective.backward();
            ours.grad("logits", &logits, &grads)?;
            ours.out("entropy", entropy);
            ours.out("logprobs", logprobs);
        }
        "kl_penalty" => {
            let penalty = KlPenalty::from_name(&case.name).map_err(|e| e.to_string())?;
            let logprob = case.input("logprob")?.t2()?.require_grad();
            let mask = case.input("mask")?.t2()?;
            let kl = kl_penalty(logprob.clone(), case.input("ref_logprob")?.t2()?, penalty);
            let grads = (kl.clone() * mask).sum().backward();
            ours.grad("logprob", &logprob, &grads)?;
            ours.out("kl", kl);
        }
        "agg_loss" => {
            let mode = LossAggMode::from_name(&case.name).map_err(|e| e.to_string())?;
            let info = GlobalBatchInfo {
                loss_scale_factor: case.f("loss_scale_factor"),
                ..GlobalBatchInfo::local()
            };
            let loss = agg_loss(
                case.input("loss_mat")?.t2()?,
                case.input("loss_mask")?.t2()?,
                mode,
                &info,
            )
            .map_err(|e| e.to_string())?;
            ours.out("loss", loss);
        }
        "policy_loss" => {
            let d = PolicyLossParams::default();
            let clip = case.f("clip_ratio").unwrap_or(d.clip_ratio_low);
            let params = PolicyLossParams {
                clip_ratio_low: case.f("clip_ratio_low").unwrap_or(clip),
                clip_ratio_high: case.f("clip_ratio_high").unwrap_or(clip),
                clip_ratio_c: case.f("clip_ratio_c").unwrap_or(d.clip_ratio_c),
                tau_pos: case.f("tau_pos").unwrap_or(d.tau_pos),
                tau_neg: case.f("tau_neg").unwrap_or(d.tau_neg),
                clip_cov_ratio: case.f("clip_cov_ratio").unwrap_or(d.clip_cov_ratio),
                clip_cov_lb: case.f("clip_cov_lb").unwrap_or(d.clip_cov_lb),
                clip_cov_ub: case.f("clip_cov_ub").unwrap_or(d.clip_cov_ub),
                kl_cov_ratio: case.f("kl_cov_ratio").unwrap_or(d.kl_cov_ratio),
                ppo_kl_coef: case.f("ppo_kl_coef").unwrap_or(d.ppo_kl_coef),
                sppo_eta: case.f("eta").unwrap_or(d.sppo_eta),
                dpo_beta: d.dpo_beta,
                dpo_label_smoothing: d.dpo_label_smoothing,
                dpo_loss_type: d.dpo_loss_type,
                dro_beta: case.f("dro_beta").unwrap_or(d.dro_beta),
                rollout_correction: case.rollout_correction()?,
                bypass_loss_type: match case.s("loss_type") {
                    Some(t) => BypassLossType::from_name(t).map_err(|e| e.to_string())?,
                    None => d.bypass_loss_type,
                },
                seed: d.seed,
            };
            let loss_fn = registry
                .policy_loss(&case.name, &params)
                .map_err(|e| e.to_string())?;
            let log_prob = case.input("log_prob")?.t2()?.require_grad();
            let input = PolicyLossInput {
                old_log_prob: case.input("old_log_prob")?.t2()?,
                log_prob: log_prob.clone(),
                advantages: case.input("advantages")?.t2()?,
                response_mask: case.input("response_mask")?.t2()?,
                loss_agg_mode: case.agg_mode()?,
                global: GlobalBatchInfo::local(),
                ref_log_prob: None,
                rollout_is_weights: case
                    .inputs
                    .get("rollout_is_weights")
                    .map(Fx::t2)
                    .transpose()?,
            };
            let out = loss_fn.compute(&input).map_err(|e| e.to_string())?;
            let grads = out.loss.backward();
            ours.grad("log_prob", &log_prob, &grads)?;
            ours.out("pg_loss", out.loss);
            for (name, value) in out.metrics {
                ours.scalar(name.trim_start_matches("actor/"), value);
            }
        }
        "value_loss" => {
            if case.name != "clipped" {
                return Err(format!("unknown value_loss `{}`", case.name));
            }
            let vpreds = case.input("vpreds")?.t2()?.require_grad();
            let out = value_loss(
                vpreds.clone(),
                case.input("values")?.t2()?,
                case.input("returns")?.t2()?,
                case.input("response_mask")?.t2()?,
                case.f("cliprange_value")
                    .ok_or("param cliprange_value missing")?,
                case.agg_mode()?,
                &GlobalBatchInfo::local(),
            )
            .map_err(|e| e.to_string())?;
            let grads = out.vf_loss.backward();
            ours.grad("vpreds", &vpreds, &grads)?;
            ours.out("vf_loss", out.vf_loss);
            ours.scalar("vf_clipfrac", out.vf_clipfrac);
        }
        "kl_controller" => {
            if case.name != "adaptive" {
                return Err(format!("unknown kl_controller `{}`", case.name));
            }
            let mut ctl = AdaptiveKlController::new(
                case.f("init_kl_coef").ok_or("param init_kl_coef missing")?,
                case.f("target_kl").ok_or("param target_kl missing")?,
                case.f("horizon").ok_or("param horizon missing")?,
            )
            .map_err(|e| e.to_string())?;
            let kls = &case.input("current_kl")?.data;
            let steps = &case.input("n_steps")?.data;
            let coefs = kls
                .iter()
                .zip(steps)
                .map(|(&kl, &n)| {
                    ctl.update(kl, n as usize);
                    ctl.coef()
                })
                .collect();
            ours.outputs.insert("coef".into(), coefs);
        }
        "distillation_loss" => {
            use burn_rlhf_algos::distillation::{
                abs_loss, distillation_loss, estimator_losses, DistillationInput,
                DistillationLossMode, DistillationLossParams,
            };
            let DistillationLossMode::Estimator(penalty) =
                DistillationLossMode::from_name(&case.name).map_err(|e| e.to_string())?
            else {
                return Err(format!("`{}` is not a single-sample estimator", case.name));
            };
            if case.s("policy_loss_mode").is_some_and(|m| m != "vanilla") {
                return Err("verl 0.9.1 distils with the vanilla policy loss only".into());
            }
            let flag = |name: &str| case.params.get(name).and_then(Value::as_bool);
            let params = DistillationLossParams {
                loss_max_clamp: case.f("loss_max_clamp"),
                use_policy_gradient: flag("use_policy_gradient")
                    .ok_or("param use_policy_gradient missing")?,
                clip_ratio_low: case.f("clip_ratio_low").unwrap_or(0.2),
                clip_ratio_high: case.f("clip_ratio_high").unwrap_or(0.2),
            };
            let log_prob = case.input("log_prob")?.t2()?.require_grad();
            let mask = case.input("response_mask")?.t2()?;
            let token_losses = estimator_losses(
                log_prob.clone(),
                case.input("teacher_log_prob")?.t2()?,
                penalty,
            );
            ours.scalar("abs_loss", abs_loss(token_losses.clone(), mask.clone()));
            let out = distillation_loss(
                DistillationInput {
                    token_losses,
                    log_prob: log_prob.clone(),
                    old_log_prob: case.input("old_log_prob")?.t2()?,
                    response_mask: mask,
                    loss_agg_mode: case.agg_mode()?,
                    global: GlobalBatchInfo::local(),
                    rollout_is_weights: None,
                },
                &params,
            )
            .map_err(|e| e.to_string())?;
            let grads = out.loss.backward();
            ours.grad("log_prob", &log_prob, &grads)?;
            ours.out("loss", out.loss);
            for (name, value) in out.metrics {
                ours.scalar(name.trim_start_matches("distillation/"), value);
            }
        }
        "distillation_topk" => {
            use burn_rlhf_algos::distillation::linear_forward_kl_topk;
            if case.name != "forward_kl_topk" {
                return Err(format!("unknown distillation_topk `{}`", case.name));
            }
            case.expect_objective("sum(clamp_min(distillation_losses, 0) * mask)")?;
            // The trainer's path: the student's logits through the chunked LM head, here as
            // hidden states under an identity head (logits = hidden · Iᵀ), 2 rows a chunk.
            let logits = case.input("logits")?.t2()?.require_grad();
            let vocab = logits.dims()[1];
            let mask = case.input("mask")?.t1();
            let out = linear_forward_kl_topk(
                (logits.clone(), Tensor::eye(vocab, &logits.device())),
                (1.0, 2),
                case.input("teacher_topk_log_probs")?.t2()?,
                case.input("teacher_topk_ids")?.int2()?,
                case.f("log_prob_min_clamp"),
            );
            let grads = (out.losses.clone().clamp_min(0.0) * mask).sum().backward();
            ours.grad("logits", &logits, &grads)?;
            ours.out("distillation_losses", out.losses);
            ours.out("student_mass", out.student_mass);
            ours.out("teacher_mass", out.teacher_mass);
            ours.outputs.insert(
                "overlap_count".into(),
                out.overlap_count.iter().map(|&c| c as f64).collect(),
            );
            ours.outputs.insert(
                "overlap_token_advantage".into(),
                out.overlap_token_advantage
                    .iter()
                    .map(|&a| f64::from(a))
                    .collect(),
            );
        }
        "preference_loss" => match case.name.as_str() {
            "online_dpo" => {
                let loss_type = DpoLossType::from_name(case.s("loss_type").unwrap_or("sigmoid"))
                    .map_err(|e| e.to_string())?;
                let chosen = case.input("policy_chosen_logps")?.t1().require_grad();
                let rejected = case.input("policy_rejected_logps")?.t1().require_grad();
                let loss = online_dpo_loss(
                    chosen.clone(),
                    rejected.clone(),
                    case.input("reference_chosen_logps")?.t1(),
                    case.input("reference_rejected_logps")?.t1(),
                    case.f("beta").ok_or("param beta missing")?,
                    case.f("label_smoothing").unwrap_or(0.0),
                    loss_type,
                );
                let grads = loss.backward();
                ours.grad("policy_chosen_logps", &chosen, &grads)?;
                ours.grad("policy_rejected_logps", &rejected, &grads)?;
                ours.out("loss", loss);
            }
            "sppo" => {
                let centered = sppo_centered_rewards(
                    case.input("raw_rewards")?.t1(),
                    case.f("beta").ok_or("param beta missing")?,
                );
                let log_prob = case.input("log_prob")?.t2()?.require_grad();
                let loss = sppo_loss(
                    case.input("old_log_prob")?.t2()?,
                    log_prob.clone(),
                    centered.clone(),
                    case.input("response_mask")?.t2()?,
                    case.f("eta").ok_or("param eta missing")?,
                );
                let grads = loss.backward();
                ours.grad("log_prob", &log_prob, &grads)?;
                ours.out("loss", loss);
                ours.out("centered_rewards", centered);
            }
            other => return Err(format!("unknown preference_loss `{other}`")),
        },
        "reward_loss" => {
            if case.name != "bradley_terry" {
                return Err(format!("unknown reward_loss `{}`", case.name));
            }
            let chosen = case.input("rewards_chosen")?.t1().require_grad();
            let rejected = case.input("rewards_rejected")?.t1().require_grad();
            let margin = case.inputs.get("margin").map(Fx::t1);
            let loss = bradley_terry_loss(
                chosen.clone(),
                rejected.clone(),
                margin,
                case.f("center_rewards_coefficient"),
            );
            let grads = loss.backward();
            ours.grad("rewards_chosen", &chosen, &grads)?;
            ours.grad("rewards_rejected", &rejected, &grads)?;
            ours.out("loss", loss);
            let (accuracy, margin) = reward_pair_stats(
                &case.input("rewards_chosen")?.f32s(),
                &case.input("rewards_rejected")?.f32s(),
            );
            ours.scalar("accuracy", accuracy);
            ours.scalar("margin", margin);
        }
        "rollout_correction" => {
            if case.name != "rollout_correction" {
                return Err(format!("unknown rollout_correction case `{}`", case.name));
            }
            let correction = case.rollout_correction()?;
            let mask = case.input("response_mask")?;
            let out = correction
                .apply(
                    &case.input("old_log_prob")?.data,
                    &case.input("rollout_log_prob")?.data,
                    &mask.data,
                    mask.shape[1],
                )
                .map_err(|e| e.to_string())?;
            ours.outputs.insert("response_mask".into(), out.mask);
            if let Some(w) = out.weights {
                ours.outputs.insert("rollout_is_weights".into(), w);
            }
            for (name, value) in out.metrics {
                ours.scalar(&name, value);
            }
        }
        other => return Err(format!("unknown fixture kind `{other}`")),
    }
    Ok(ours)
}

fn compare(what: &str, theirs: &Fx, ours: &[f64], atol: f64, rtol: f64) -> Result<(), String> {
    if theirs.data.len() != ours.len() {
        return Err(format!(
            "{what}: {} values expected (shape {:?}), computed {}",
            theirs.data.len(),
            theirs.shape,
            ours.len()
        ));
    }
    let mut worst: Option<(usize, f64, f64)> = None;
    for (i, (&r, &o)) in theirs.data.iter().zip(ours).enumerate() {
        // Written so that NaN on either side counts as a mismatch.
        let within = (o - r).abs() <= atol + rtol * r.abs();
        let bad = !within;
        if bad && worst.is_none_or(|(_, wr, wo)| (o - r).abs() > (wo - wr).abs()) {
            worst = Some((i, r, o));
        }
    }
    match worst {
        None => Ok(()),
        Some((i, r, o)) => Err(format!(
            "{what}[{i}]: reference {r}, ours {o} (|diff| {:.3e} > atol {atol} + rtol {rtol})",
            (o - r).abs()
        )),
    }
}

fn check(path: &Path) -> Result<(), String> {
    let case = Case::load(path)?;
    let ours = compute(&case)?;
    let mut problems = Vec::new();
    for (name, theirs) in &case.outputs {
        if let Some(p) = match ours.outputs.get(name) {
            Some(o) => compare(&format!("output {name}"), theirs, o, case.atol, case.rtol).err(),
            None => Some(format!(
                "output `{name}` is not computed by {} `{}`",
                case.kind, case.name
            )),
        } {
            problems.push(p)
        }
    }
    for (name, theirs) in &case.grads {
        if let Some(p) = match ours.grads.get(name) {
            Some(o) => compare(&format!("grad {name}"), theirs, o, case.atol, case.rtol).err(),
            None => Some(format!(
                "gradient for `{name}` is not computed by {} `{}`",
                case.kind, case.name
            )),
        } {
            problems.push(p)
        }
    }
    if case.outputs.is_empty() {
        problems.push("the fixture has no outputs".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

#[test]
fn verl_fixtures() {
    check_folder(&burn_rlhf_test_assets::fixtures_subdir("algos"), "verl");
}

/// TRL's `RewardTrainer` loss (`tests/fixtures/gen/trl_reward_loss.py`): the fixture set's `trl/`,
/// or the repository's own when that set has none.
#[test]
fn trl_fixtures() {
    check_folder(&burn_rlhf_test_assets::fixtures_subdir_or_own("trl"), "TRL");
}

/// Every fixture file in `dir`, each listed when it fails.
fn check_folder(dir: &Path, reference: &str) {
    let files = burn_rlhf_test_assets::files_with_ext(dir, ".json");
    let mut failures = Vec::new();
    for file in &files {
        if let Err(e) = check(file) {
            failures.push(format!(
                "{}: {e}",
                file.file_name().unwrap().to_string_lossy()
            ));
        }
    }
    let passed = files.len() - failures.len();
    println!("{reference} fixtures: {passed} passed");
    assert!(
        failures.is_empty(),
        "{} of {} fixtures failed:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}
