//! Heads, LoRA, saving and loading: what the trainers rely on beyond matching HF's logits.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::{Int, Tensor, TensorData};

use burn_rlhf_models::weights::{write_safetensors, HostTensor, WeightMap};
use burn_rlhf_models::{load_pretrained, save_pretrained, CausalLm, LoraConfig, ValueModel};

type B = Flex;
type AD = Autodiff<Flex>;

/// Every fixture model, loaded, with its folder's name for messages.
fn fixture_models() -> Vec<(String, PathBuf, burn_rlhf_models::Pretrained)> {
    burn_rlhf_test_assets::fixture_models()
        .into_iter()
        .map(|dir| {
            let name = dir.file_name().unwrap().to_string_lossy().to_string();
            let pre = load_pretrained(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
            (name, dir, pre)
        })
        .collect()
}

fn batch<BB: burn::tensor::backend::Backend>(
    vocab: usize,
) -> (Tensor<BB, 2, Int>, Tensor<BB, 2, Int>, Tensor<BB, 2, Int>) {
    let device = Default::default();
    let ids: Vec<i64> = (0..12).map(|i| (i * 37 % vocab) as i64).collect();
    let mask: Vec<i64> = vec![0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
    let pos: Vec<i64> = vec![0, 0, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5];
    let t = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [2, 6]), &device);
    (t(ids), t(mask), t(pos))
}

fn max_abs_diff<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
    (a - b).abs().max().into_scalar()
}

#[test]
fn saved_model_loads_back_with_identical_logits_and_config() {
    for (name, _, pre) in fixture_models() {
        let config = pre.config.clone();
        let model: CausalLm<B> = pre.causal_lm(&Default::default()).unwrap();
        let out = burn_rlhf_test_assets::temp_dir(&name);
        save_pretrained(&out, &config, &model.export(), None, None).unwrap();
        let again = load_pretrained(out.to_str().unwrap()).unwrap();
        assert_eq!(again.config, config, "{name}: config.json round trip");
        let reloaded: CausalLm<B> = again.causal_lm(&Default::default()).unwrap();
        assert_eq!(reloaded.is_tied(), model.is_tied());
        let (i, m, p) = batch::<B>(config.vocab_size);
        let d = max_abs_diff(
            model.forward(i.clone(), m.clone(), p.clone(), None),
            reloaded.forward(i, m, p, None),
        );
        assert_eq!(d, 0.0, "{name}: logits changed through save/load");
        std::fs::remove_dir_all(&out).ok();
    }
}

/// Copies a tiny model and rewrites its tensors with `edit`.
fn corrupted(
    src: &std::path::Path,
    tag: &str,
    edit: impl Fn(&mut BTreeMap<String, HostTensor>),
) -> PathBuf {
    let dir = burn_rlhf_test_assets::temp_dir(tag);
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut map = WeightMap::new("src");
    map.read_safetensors(&src.join("model.safetensors"))
        .unwrap();
    let mut tensors: BTreeMap<String, HostTensor> = map
        .remaining()
        .into_iter()
        .map(|n| (n.clone(), map.take_any(&n).unwrap()))
        .collect();
    edit(&mut tensors);
    write_safetensors(&dir.join("model.safetensors"), &tensors, Default::default()).unwrap();
    dir
}

#[test]
fn broken_checkpoints_fail_naming_file_and_tensor() {
    let src = burn_rlhf_test_assets::fixture_models().remove(0);
    let missing = corrupted(&src, "missing", |t| {
        t.remove("model.layers.0.mlp.up_proj.weight");
    });
    let err = load_pretrained(missing.to_str().unwrap())
        .unwrap()
        .causal_lm::<B>(&Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing tensor `model.layers.0.mlp.up_proj.weight`")
            && err.contains("model.safetensors"),
        "{err}"
    );

    let unexpected = corrupted(&src, "unexpected", |t| {
        let extra = t["model.norm.weight"].clone();
        t.insert("model.extra.weight".into(), extra);
    });
    let err = load_pretrained(unexpected.to_str().unwrap())
        .unwrap()
        .causal_lm::<B>(&Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unexpected tensor(s) model.extra.weight"),
        "{err}"
    );

    let k = "model.layers.0.self_attn.k_proj.weight";
    let [rows, cols] = {
        let pre = load_pretrained(src.to_str().unwrap()).unwrap();
        let c = pre.config;
        [c.num_key_value_heads * c.head_dim, c.hidden_size]
    };
    let shape = corrupted(&src, "shape", |t| {
        let w = t.get_mut(k).unwrap();
        w.data.extend(std::iter::repeat_n(0.0, cols));
        w.shape = vec![rows + 1, cols];
    });
    let err = load_pretrained(shape.to_str().unwrap())
        .unwrap()
        .causal_lm::<B>(&Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("`{k}` has shape [{}, {cols}]", rows + 1))
            && err.contains(&format!("[{rows}, {cols}]")),
        "{err}"
    );
    for d in [missing, unexpected, shape] {
        std::fs::remove_dir_all(d).ok();
    }
    let err = load_pretrained("/nonexistent/model/dir")
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/model/dir"), "{err}");
}

#[test]
fn value_head_gradients_reach_head_and_backbone() {
    for (name, _, pre) in fixture_models() {
        let config = pre.config.clone();
        let critic: ValueModel<AD> = pre.value_model(&Default::default()).unwrap();
        let (i, m, p) = batch::<AD>(config.vocab_size);
        let values = critic.forward(i, m, p);
        assert_eq!(values.dims(), [2, 6]);
        let grads = values.sum().backward();
        let g_head = critic
            .score
            .weight
            .grad(&grads)
            .expect("value head gradient");
        let g_q = critic.model.layers[0]
            .self_attn
            .q_proj
            .linear
            .base
            .weight
            .grad(&grads)
            .expect("backbone gradient");
        assert!(
            g_head.abs().sum().into_scalar() > 0.0 && g_q.abs().sum().into_scalar() > 0.0,
            "{name}"
        );
        // Saved critics load back as critics (score.weight/score.bias), not as fresh heads.
        let out = burn_rlhf_test_assets::temp_dir("critic");
        save_pretrained(
            &out,
            &config,
            &critic.valid().export(),
            Some(&config.model_type.token_classification_class()),
            None,
        )
        .unwrap();
        let again: ValueModel<B> = load_pretrained(out.to_str().unwrap())
            .unwrap()
            .value_model(&Default::default())
            .unwrap();
        let d = max_abs_diff(again.score.weight.val(), critic.valid().score.weight.val());
        assert_eq!(d, 0.0, "{name}");
        std::fs::remove_dir_all(out).ok();
    }
}

#[test]
fn lora_trains_only_adapters_and_merges_exactly() {
    for (name, _, pre) in fixture_models() {
        lora_trains_only_adapters(&name, pre);
    }
}

fn lora_trains_only_adapters(name: &str, pre: burn_rlhf_models::Pretrained) {
    let vocab = pre.config.vocab_size;
    let model: CausalLm<AD> = pre.causal_lm(&Default::default()).unwrap();
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        target_modules: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
    };
    let model = model.with_lora(&lora, &Default::default());
    let before = model.valid();
    let (i, m, p) = batch::<AD>(vocab);
    let mut optim = SgdConfig::new().init();
    let mut model = model;
    for _ in 0..2 {
        let loss = model
            .forward(i.clone(), m.clone(), p.clone(), None)
            .powi_scalar(2)
            .mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.5, model, grads);
    }
    let after = model.valid();
    let l0b = &before.model.layers[0];
    let l0a = &after.model.layers[0];
    // Base weights and every untargeted parameter are unchanged...
    assert_eq!(
        max_abs_diff(
            l0b.self_attn.q_proj.linear.base.weight.val(),
            l0a.self_attn.q_proj.linear.base.weight.val()
        ),
        0.0
    );
    assert_eq!(
        max_abs_diff(
            l0b.self_attn.k_proj.linear.base.weight.val(),
            l0a.self_attn.k_proj.linear.base.weight.val()
        ),
        0.0
    );
    assert_eq!(
        max_abs_diff(
            before.model.embed_tokens.weight.val(),
            after.model.embed_tokens.weight.val()
        ),
        0.0
    );
    assert_eq!(
        max_abs_diff(
            l0b.input_layernorm.weight.val(),
            l0a.input_layernorm.weight.val()
        ),
        0.0
    );
    if let (Some(b), Some(a)) = (&before.lm_head, &after.lm_head) {
        assert_eq!(
            max_abs_diff(b.linear.base.weight.val(), a.linear.base.weight.val()),
            0.0,
            "{name}"
        );
    }
    for (b, a) in [
        (&l0b.self_attn.q_norm, &l0a.self_attn.q_norm),
        (&l0b.self_attn.k_norm, &l0a.self_attn.k_norm),
    ] {
        if let (Some(b), Some(a)) = (b, a) {
            let d = max_abs_diff(b.weight.val(), a.weight.val());
            assert_eq!(d, 0.0, "{name}: a head norm moved");
        }
    }
    assert!(l0a.self_attn.k_proj.linear.lora.is_none());
    // ...and the adapters moved.
    let lb = l0a.self_attn.q_proj.linear.lora.as_ref().unwrap();
    assert!(
        lb.lora_b.val().abs().sum().into_scalar() > 0.0,
        "{name}: the adapter was not trained"
    );
    // Merged equals unmerged.
    let (i, m, p) = batch::<B>(vocab);
    let unmerged = after.forward(i.clone(), m.clone(), p.clone(), None);
    let merged = after.clone().merge_lora();
    assert!(merged.model.layers[0]
        .self_attn
        .q_proj
        .linear
        .lora
        .is_none());
    let d = max_abs_diff(unmerged, merged.forward(i, m, p, None));
    assert!(d < 1e-5, "{name}: merged LoRA differs by {d}");
}

#[test]
fn bare_gguf_carries_config_and_tokenizer() {
    let Some(dir) = burn_rlhf_test_assets::smollm2_dir("bare_gguf_carries_config_and_tokenizer")
    else {
        return;
    };
    let gguf = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "gguf"))
        .unwrap();
    // A folder with only the GGUF file: config and tokenizer come from its metadata.
    let alone = burn_rlhf_test_assets::temp_dir("gguf-alone");
    let link = alone.join(gguf.file_name().unwrap());
    std::os::unix::fs::symlink(&gguf, &link).unwrap();
    let bare = load_pretrained(link.to_str().unwrap()).unwrap();
    let full = load_pretrained(dir.to_str().unwrap()).unwrap();
    let (bc, fc) = (&bare.config, &full.config);
    assert_eq!(
        (
            bc.vocab_size,
            bc.hidden_size,
            bc.num_hidden_layers,
            bc.num_attention_heads,
            bc.num_key_value_heads,
            bc.head_dim
        ),
        (
            fc.vocab_size,
            fc.hidden_size,
            fc.num_hidden_layers,
            fc.num_attention_heads,
            fc.num_key_value_heads,
            fc.head_dim
        )
    );
    assert!(
        (bc.rope_theta - fc.rope_theta).abs() < 1e-3
            && bc.tie_word_embeddings == fc.tie_word_embeddings
    );
    let (bt, ft) = (
        bare.tokenizer.expect("GGUF tokenizer"),
        full.tokenizer.expect("tokenizer.json"),
    );
    for text in [
        "The capital of France is",
        "Natalia sold 48 clips in April, then 24 in May. #### 72",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        assert_eq!(
            bt.encode(text, false).unwrap(),
            ft.encode(text, false).unwrap(),
            "{text}"
        );
    }
    std::fs::remove_dir_all(alone).ok();
}

#[test]
fn gradient_checkpointing_gives_the_same_gradients() {
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    type Ckpt = Autodiff<Flex, BalancedCheckpointing>;
    for dir in burn_rlhf_test_assets::fixture_models() {
        let vocab = load_pretrained(dir.to_str().unwrap())
            .unwrap()
            .config
            .vocab_size;
        let plain: CausalLm<AD> = load_pretrained(dir.to_str().unwrap())
            .unwrap()
            .causal_lm(&Default::default())
            .unwrap();
        let ckpt: CausalLm<Ckpt> = load_pretrained(dir.to_str().unwrap())
            .unwrap()
            .causal_lm(&Default::default())
            .unwrap();
        let (i, m, p) = batch::<AD>(vocab);
        let g_plain = plain
            .forward(i, m, p, None)
            .powi_scalar(2)
            .mean()
            .backward();
        let (i, m, p) = batch::<Ckpt>(vocab);
        let g_ckpt = ckpt.forward(i, m, p, None).powi_scalar(2).mean().backward();
        let a = plain.model.layers[0]
            .self_attn
            .q_proj
            .linear
            .base
            .weight
            .grad(&g_plain)
            .unwrap();
        let b = ckpt.model.layers[0]
            .self_attn
            .q_proj
            .linear
            .base
            .weight
            .grad(&g_ckpt)
            .unwrap();
        let d = max_abs_diff(a, b);
        assert!(
            d < 1e-6,
            "{}: checkpointed gradients differ by {d}",
            dir.display()
        );
    }
}

/// Tensor parallelism: every fixture model split over 2, 3 or 4 ranks (each size its shape
/// allows; one at least) gives the whole model's logits, vocabulary-parallel log-probs and
/// entropies (a plain head's logits chunked, a soft-capped head's whole), and after an SGD step on
/// a loss of both, the whole model's weights (exported whole by the split layers).
#[test]
fn tensor_parallel_shards_compute_and_train_as_the_whole_model() {
    use burn_rlhf_models::tensor_parallel::{
        copy_in, local_config, vocab_parallel_entropy_and_logprobs,
        vocab_parallel_linear_entropy_and_logprobs, LocalTpGroup, TensorParallelModule,
    };
    // Per position: log-prob of the next id and 0.1 x entropy, summed.
    fn loss_of(model: &CausalLm<AD>, tp: bool) -> (Tensor<AD, 1>, Tensor<AD, 3>) {
        let (i, m, p) = batch::<AD>(model.vocab_size());
        let hidden = model.model.forward(i.clone(), m, p, None);
        let group = model.model.group().filter(|_| tp);
        let (entropy, logprobs) = match (group, model.local_head_weight()) {
            // A plain split head: its logits made 3 rows at a time, never whole.
            (Some(group), Some(weight)) => {
                let [b, l, h] = hidden.dims();
                vocab_parallel_linear_entropy_and_logprobs(
                    copy_in(hidden.clone().reshape([b * l, h]), Some(group)),
                    weight,
                    i.reshape([b * l]),
                    (1.3, 3),
                    group,
                )
            }
            _ => {
                let local = model.local_logits(hidden.clone());
                let [b, l, v] = local.dims();
                vocab_parallel_entropy_and_logprobs(
                    local.reshape([b * l, v]),
                    i.reshape([b * l]),
                    1.3,
                    group,
                )
            }
        };
        let loss = (logprobs + entropy * 0.1).sum();
        (loss, model.logits(hidden))
    }
    // Bytes of a module's parameters and of the gradients a backward pass gives them.
    fn bytes_of(model: &CausalLm<AD>, grads: &GradientsParams) -> (usize, usize) {
        struct Sizes<'a>(usize, usize, &'a GradientsParams);
        impl burn::module::ModuleVisitor<AD> for Sizes<'_> {
            fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<AD, D>>) {
                self.0 += p.val().shape().num_elements() * 4;
                if let Some(g) = self.2.get::<B, D>(p.id) {
                    self.1 += g.shape().num_elements() * 4;
                }
            }
        }
        let mut sizes = Sizes(0, 0, grads);
        burn::module::Module::visit(model, &mut sizes);
        (sizes.0, sizes.1)
    }
    fn param_sizes(model: &CausalLm<AD>) -> Vec<(burn::module::ParamId, usize)> {
        struct Sizes(Vec<(burn::module::ParamId, usize)>);
        impl burn::module::ModuleVisitor<AD> for Sizes {
            fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<AD, D>>) {
                self.0.push((p.id, p.val().shape().num_elements()));
            }
        }
        let mut sizes = Sizes(Vec::new());
        burn::module::Module::visit(model, &mut sizes);
        sizes.0
    }
    let step = |model: CausalLm<AD>, tp: bool| {
        let (loss, logits) = loss_of(&model, tp);
        let grads = GradientsParams::from_grads(loss.clone().backward(), &model);
        let bytes = bytes_of(&model, &grads);
        let model = SgdConfig::new().init().step(0.1, model, grads);
        (loss.into_scalar(), logits.inner(), model, bytes)
    };
    let mut tested = Vec::new();
    for (name, _, pre) in fixture_models() {
        let config = pre.config.clone();
        let whole: CausalLm<AD> = pre.causal_lm(&Default::default()).unwrap();
        let (whole_loss, whole_logits, stepped, whole_bytes) = step(whole.clone(), false);
        let expected = stepped.valid().export();
        let start = whole.valid().export();
        let mut sizes = 0usize;
        for size in [2, 3, 4] {
            if let Err(e) = local_config(&config, size) {
                let e = e.to_string();
                println!("{name}: {e}");
                assert!(
                    e.contains("is not a multiple") || e.contains("neither divides"),
                    "{e}"
                );
                continue;
            }
            sizes += 1;
            let ranks: Vec<_> = LocalTpGroup::group(size)
                .into_iter()
                .map(|tp| {
                    let (whole, config) = (whole.clone(), config.clone());
                    std::thread::spawn(move || {
                        let device = Default::default();
                        let whole_n: usize = param_sizes(&whole).iter().map(|p| p.1).sum();
                        // Loaded as a run loads it: the rank's part cut from the whole weights.
                        let weights = WeightMap::from_tensors("whole", whole.export());
                        let shard = CausalLm::load(&config, weights, Some(&tp), &device).unwrap();
                        // The split layers name their parameters: size x theirs and the whole
                        // ones once make the whole model.
                        let split = shard.split_param_ids();
                        let (mut split_n, mut kept_n) = (0, 0);
                        for (id, n) in param_sizes(&shard) {
                            match split.contains(&id) {
                                true => split_n += n,
                                false => kept_n += n,
                            }
                        }
                        assert_eq!(split_n * tp.size() + kept_n, whole_n);
                        let (loss, logits, stepped, bytes) = step(shard, true);
                        // A part exports the whole model (its layers gather the group's parts).
                        let gathered = stepped.valid().export();
                        (loss, logits, gathered, bytes)
                    })
                })
                .collect();
            for (rank, r) in ranks.into_iter().enumerate() {
                let (loss, logits, gathered, bytes) = r.join().unwrap();
                // Each rank holds about 1/size of the weights and gradients (the whole norms
                // and routers, and whole key/value heads when they are fewer, are the rest).
                let share = |part: usize, whole: usize| part as f64 / whole as f64;
                let (params, grads) =
                    (share(bytes.0, whole_bytes.0), share(bytes.1, whole_bytes.1));
                if rank == 0 {
                    println!(
                        "{name} tp={size}: per rank {:.3} of the parameter bytes, {:.3} of the gradient bytes",
                        params, grads
                    );
                }
                assert!(
                    params < 1.0 / size as f64 + 0.12,
                    "{name} tp={size}: {params}"
                );
                assert!(
                    grads < 1.0 / size as f64 + 0.12,
                    "{name} tp={size}: {grads}"
                );
                let logit_diff = max_abs_diff(logits, whole_logits.clone());
                // Relative to each tensor's largest step (the SGD step is 0.1 x its gradient).
                let mut weight_diff = 0.0f32;
                for (k, t) in &expected {
                    let g = &gathered[k];
                    assert_eq!(g.shape, t.shape, "{name} tp={size}: {k}");
                    let start = &start[k].data;
                    let moved = t
                        .data
                        .iter()
                        .zip(start)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    for (a, b) in g.data.iter().zip(&t.data) {
                        weight_diff = weight_diff.max((a - b).abs() / moved.max(1e-3));
                    }
                }
                if rank == 0 {
                    println!(
                        "{name} tp={size}: logits within {logit_diff:.1e}, loss {loss} vs \
                         {whole_loss}, weights after a step within {weight_diff:.1e} of the step"
                    );
                }
                assert!(
                    logit_diff < 1e-5,
                    "{name} tp={size}: logits differ by {logit_diff}"
                );
                assert!(
                    ((loss - whole_loss) / whole_loss.abs().max(1.0)).abs() < 1e-5,
                    "{name} tp={size}: loss {loss} vs {whole_loss}"
                );
                assert!(
                    weight_diff < 5e-5,
                    "{name} tp={size}: weights differ by {weight_diff}"
                );
            }
        }
        tested.push((name, sizes));
    }
    // A model no size divides was refused above, naming what does not divide; some split.
    assert!(tested.iter().any(|(_, n)| *n > 0), "{tested:?}");
}

/// Padding-free passes (verl's `use_remove_padding`): every fixture model's logits at the real
/// tokens of a packed pass are the padded pass's, and an SGD step on a loss of them moves the
/// weights as the padded pass's step does.
#[test]
fn packed_passes_compute_and_train_as_padded_ones() {
    use burn_rlhf_models::packing::PackedRows;
    use burn_rlhf_models::transformer::PassRows;
    // Three rows of 9: a left-padded prompt and a right-padded response, a full row, a short one.
    let mask: Vec<Vec<i64>> = vec![
        vec![0, 0, 1, 1, 1, 1, 1, 1, 0],
        vec![1, 1, 1, 1, 1, 1, 1, 1, 1],
        vec![0, 0, 0, 1, 1, 1, 0, 0, 0],
    ];
    let positions: Vec<Vec<i64>> = mask
        .iter()
        .map(|row| {
            let mut seen = 0i64;
            row.iter()
                .map(|&m| {
                    seen += m;
                    (seen - 1).max(0)
                })
                .collect()
        })
        .collect();
    let real = PackedRows::new(&mask, 1).unwrap().from_padded();
    let device = Default::default();
    // Per real token: Σ logits x a fixed pattern; the logits at the real tokens `[T, V]`.
    let loss_of = |model: &CausalLm<AD>, pack: Option<&PackedRows>| {
        let vocab = model.vocab_size();
        let ids: Vec<i64> = (0..27).map(|i| (i * 37 % vocab) as i64).collect();
        let ids = Tensor::<AD, 2, Int>::from_data(TensorData::new(ids, [3, 9]), &device);
        let rows = PassRows {
            attention_mask: &mask,
            position_ids: &positions,
            packed: pack,
        };
        let logits = model.logits(model.model.forward_pass(ids, rows, None));
        let [b, l, v] = logits.dims();
        let logits = match pack {
            // The bucket's tokens of no row come last.
            Some(_) => logits.reshape([l, v]).narrow(0, 0, real.len()),
            None => logits.reshape([b * l, v]).select(
                0,
                Tensor::from_data(TensorData::new(real.clone(), [real.len()]), &device),
            ),
        };
        let t = logits.dims()[0];
        let pattern: Vec<f32> = (0..t * v)
            .map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5)
            .collect();
        let pattern = Tensor::<AD, 2>::from_data(TensorData::new(pattern, [t, v]), &device);
        ((logits.clone() * pattern).sum(), logits.inner())
    };
    let step = |model: CausalLm<AD>, pack: Option<&PackedRows>| {
        let (loss, logits) = loss_of(&model, pack);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = SgdConfig::new().init().step(0.1, model, grads);
        (logits, model.valid().export())
    };
    for (name, _, pre) in fixture_models() {
        let model: CausalLm<AD> = pre.causal_lm(&device).unwrap();
        let start = model.valid().export();
        let (padded_logits, padded) = step(model.clone(), None);
        // Exact lengths, and lengths up to a bucket of 8 (GPU backends' shapes).
        for bucket in [1, 8] {
            let packed = PackedRows::new(&mask, bucket).unwrap();
            let (packed_logits, packed_weights) = step(model.clone(), Some(&packed));
            let logit_diff = max_abs_diff(packed_logits, padded_logits.clone());
            // Relative to each tensor's largest step.
            let mut weight_diff = 0.0f32;
            for (k, t) in &padded {
                let moved = t
                    .data
                    .iter()
                    .zip(&start[k].data)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                for (a, b) in packed_weights[k].data.iter().zip(&t.data) {
                    weight_diff = weight_diff.max((a - b).abs() / moved.max(1e-3));
                }
            }
            println!(
                "{name} (bucket {bucket}): packed logits within {logit_diff:.1e}, weights after a \
             step within {weight_diff:.1e} of the step"
            );
            assert!(logit_diff < 1e-5, "{name}: logits differ by {logit_diff}");
            assert!(
                weight_diff < 1e-5,
                "{name}: weights differ by {weight_diff}"
            );
        }
    }
}
