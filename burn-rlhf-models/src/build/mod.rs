//! Building the modules: from checkpoint tensors (HF names, PyTorch layout) or from random
//! initialisation, and exporting them back to HF names for saving.

mod scored;

use std::collections::BTreeMap;

use burn::module::{Module, Param};
use burn::nn::{EmbeddingConfig, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::config::TransformerConfig;
use crate::error::ModelError;
use crate::heads::*;
use crate::lora::{LoraConfig, LoraLinear};
use crate::tensor_parallel::{
    kv_whole, local_config, shared_kv_head, ColumnParallelLinear, RowParallelLinear, TpGroup,
    VocabParallelEmbedding,
};
use crate::transformer::*;
use crate::weights::{HostTensor, WeightMap};

/// `[rows, cols]` row-major → `[cols, rows]`.
fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

fn tensor1<B: Backend>(t: HostTensor, device: &B::Device) -> Tensor<B, 1> {
    let n = t.data.len();
    Tensor::from_data(TensorData::new(t.data, [n]), device)
}

fn tensor2<B: Backend>(data: Vec<f32>, shape: [usize; 2], device: &B::Device) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(data, shape), device)
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> HostTensor {
    let shape = t.dims().to_vec();
    HostTensor {
        shape,
        data: t.into_data().iter::<f32>().collect(),
    }
}

/// A linear layer from HF `{prefix}.weight` (`[out, in]`) and, when `bias`, `{prefix}.bias`.
fn linear<B: Backend>(
    w: &mut WeightMap,
    prefix: &str,
    d_in: usize,
    d_out: usize,
    bias: bool,
    device: &B::Device,
) -> Result<Linear<B>, ModelError> {
    let weight = w.take(&format!("{prefix}.weight"), &[d_out, d_in])?;
    let weight = tensor2(transpose(&weight.data, d_out, d_in), [d_in, d_out], device);
    let bias = if bias {
        Some(Param::from_tensor(tensor1(
            w.take(&format!("{prefix}.bias"), &[d_out])?,
            device,
        )))
    } else {
        None
    };
    Ok(Linear {
        weight: Param::from_tensor(weight),
        bias,
    })
}

fn export_linear<B: Backend>(
    layer: &LoraLinear<B>,
    prefix: &str,
    out: &mut BTreeMap<String, HostTensor>,
) {
    let (weight, bias) = layer.to_hf();
    out.insert(format!("{prefix}.weight"), weight);
    if let Some(b) = bias {
        out.insert(format!("{prefix}.bias"), b);
    }
}

/// A whole layer in a column-parallel place (randomly initialised models are whole).
fn column<B: Backend>(linear: LoraLinear<B>) -> ColumnParallelLinear<B> {
    ColumnParallelLinear::whole(linear)
}

/// A whole layer in a row-parallel place.
fn row<B: Backend>(linear: LoraLinear<B>) -> RowParallelLinear<B> {
    RowParallelLinear::whole(linear)
}

fn norm<B: Backend>(
    w: &mut WeightMap,
    name: &str,
    c: &TransformerConfig,
    device: &B::Device,
) -> Result<RmsNorm<B>, ModelError> {
    sized_norm(w, name, c.hidden_size, c, device)
}

fn sized_norm<B: Backend>(
    w: &mut WeightMap,
    name: &str,
    width: usize,
    c: &TransformerConfig,
    device: &B::Device,
) -> Result<RmsNorm<B>, ModelError> {
    Ok(RmsNorm {
        weight: Param::from_tensor(tensor1(w.take(name, &[width])?, device)),
        eps: c.rms_norm_eps,
        offset: c.norm_offset(),
    })
}

fn init_norm<B: Backend>(c: &TransformerConfig, width: usize, device: &B::Device) -> RmsNorm<B> {
    // The identity scale either way: Gemma's `(1 + weight)` starts from zeros, as HF's.
    let init = if c.model_type.gemma() { 0.0 } else { 1.0 };
    RmsNorm {
        weight: Param::from_tensor(Tensor::full([width], init, device)),
        eps: c.rms_norm_eps,
        offset: c.norm_offset(),
    }
}

impl TransformerConfig {
    /// A randomly initialised decoder (Burn's default initialisers), for training from scratch.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Transformer<B> {
        let (h, q, kv) = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let qk_norm = self.model_type.qk_norm();
        let gemma = self.model_type.gemma();
        let layers = (0..self.num_hidden_layers)
            .map(|n| DecoderLayer {
                self_attn: Attention {
                    q_proj: column(LoraLinear::init(h, q, self.qkv_bias, device)),
                    k_proj: column(LoraLinear::init(h, kv, self.qkv_bias, device)),
                    v_proj: column(LoraLinear::init(h, kv, self.qkv_bias, device)),
                    o_proj: row(LoraLinear::init(q, h, self.o_bias, device)),
                    q_norm: qk_norm.then(|| init_norm(self, self.head_dim, device)),
                    k_norm: qk_norm.then(|| init_norm(self, self.head_dim, device)),
                    num_heads: self.num_attention_heads,
                    num_kv_heads: self.num_key_value_heads,
                    head_dim: self.head_dim,
                    sliding_window: self.layer_window(n),
                    query_scale: self.query_scale(),
                    kv_head: None,
                },
                mlp: self.init_feed_forward(n, device),
                input_layernorm: init_norm(self, h, device),
                post_attention_layernorm: init_norm(self, h, device),
                pre_feedforward_layernorm: gemma.then(|| init_norm(self, h, device)),
                post_feedforward_layernorm: gemma.then(|| init_norm(self, h, device)),
            })
            .collect();
        Transformer {
            embed_tokens: VocabParallelEmbedding::whole(
                EmbeddingConfig::new(self.vocab_size, h)
                    .init::<B>(device)
                    .weight
                    .val(),
            ),
            layers,
            norm: init_norm(self, h, device),
            rotary: self.rotary_frequencies(),
            local_rotary: self.local_rotary_frequencies(),
            embed_scale: self.embed_scale(),
            final_logit_softcapping: self.final_logit_softcapping,
        }
    }

    /// Layer `n`'s feed-forward block, randomly initialised: a dense MLP, or a router and
    /// experts.
    fn init_feed_forward<B: Backend>(&self, n: usize, device: &B::Device) -> FeedForward<B> {
        let h = self.hidden_size;
        let mlp = |width: usize| Mlp {
            gate_proj: column(LoraLinear::init(h, width, self.mlp_bias, device)),
            up_proj: column(LoraLinear::init(h, width, self.mlp_bias, device)),
            down_proj: row(LoraLinear::init(width, h, self.mlp_bias, device)),
            act: self.hidden_act,
        };
        match self.moe.as_ref().filter(|_| self.layer_is_sparse(n)) {
            Some(moe) => FeedForward::Sparse(SparseMoe {
                gate: LoraLinear::init(h, moe.num_experts, false, device),
                experts: (0..moe.num_experts)
                    .map(|_| mlp(moe.expert_intermediate_size))
                    .collect(),
                top_k: moe.num_experts_per_tok,
                norm_topk_prob: moe.norm_topk_prob,
                model_type: self.model_type,
            }),
            None => FeedForward::Dense(mlp(self.intermediate_size)),
        }
    }

    /// A randomly initialised causal LM (tied head when `tie_word_embeddings`).
    pub fn init_causal_lm<B: Backend>(&self, device: &B::Device) -> CausalLm<B> {
        let lm_head = (!self.tie_word_embeddings).then(|| {
            column(LoraLinear::init(
                self.hidden_size,
                self.vocab_size,
                false,
                device,
            ))
        });
        CausalLm {
            model: self.init(device),
            lm_head,
        }
    }
}

impl<B: Backend> Transformer<B> {
    /// The decoder from HF `model.*` tensors, taking each from `w`.
    pub fn from_weights(
        c: &TransformerConfig,
        w: &mut WeightMap,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load(c, w, None, device)
    }

    /// The decoder of shape `c` from the whole model's HF `model.*` tensors, taking each from
    /// `w`: with a group, this rank's part of every split layer (see [`crate::tensor_parallel`]).
    pub fn load(
        c: &TransformerConfig,
        w: &mut WeightMap,
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let size = group.map_or(1, TpGroup::size);
        let local = match size {
            1 => c.clone(),
            _ => local_config(c, size)?,
        };
        // Key/value heads too few to split stay whole; each rank attends with one of them.
        let (kv_group, kv_head) = match group {
            Some(g) if kv_whole(c, size) => (None, Some(shared_kv_head(c, g))),
            _ => (group, None),
        };
        let (h, q, kv, i) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        );
        let embed_tokens = VocabParallelEmbedding::load(
            w,
            "model.embed_tokens.weight",
            [c.vocab_size, h],
            group,
            device,
        )?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        // Gemma's norms around the MLP.
        let gemma_norm = |w: &mut WeightMap, name: &str| {
            c.model_type
                .gemma()
                .then(|| norm(w, name, c, device))
                .transpose()
        };
        // Qwen3's and Gemma's per-head query and key norms, `[head_dim]` each.
        let head_norm = |w: &mut WeightMap, name: &str| {
            c.model_type
                .qk_norm()
                .then(|| sized_norm(w, name, c.head_dim, c, device))
                .transpose()
        };
        for n in 0..c.num_hidden_layers {
            let p = format!("model.layers.{n}");
            let col = |w: &mut WeightMap, name: &str, shape, bias, group| {
                ColumnParallelLinear::load(w, &format!("{p}.{name}"), shape, bias, group, device)
            };
            let row = |w: &mut WeightMap, name: &str, shape, bias, reduce| {
                RowParallelLinear::load(
                    w,
                    &format!("{p}.{name}"),
                    shape,
                    bias,
                    (group, reduce),
                    device,
                )
            };
            let router = |w: &mut WeightMap, name: &str, experts: usize| {
                let weight = w.take(&format!("{p}.{name}.weight"), &[experts, h])?;
                Ok::<_, ModelError>(LoraLinear::from_hf(weight, None, device))
            };
            layers.push(DecoderLayer {
                self_attn: Attention {
                    q_proj: col(w, "self_attn.q_proj", [h, q], c.qkv_bias, group)?,
                    k_proj: col(w, "self_attn.k_proj", [h, kv], c.qkv_bias, kv_group)?,
                    v_proj: col(w, "self_attn.v_proj", [h, kv], c.qkv_bias, kv_group)?,
                    o_proj: row(w, "self_attn.o_proj", [q, h], c.o_bias, true)?,
                    q_norm: head_norm(w, &format!("{p}.self_attn.q_norm.weight"))?,
                    k_norm: head_norm(w, &format!("{p}.self_attn.k_norm.weight"))?,
                    num_heads: local.num_attention_heads,
                    num_kv_heads: local.num_key_value_heads,
                    head_dim: c.head_dim,
                    sliding_window: c.layer_window(n),
                    query_scale: c.query_scale(),
                    kv_head,
                },
                mlp: match c.moe.as_ref().filter(|_| c.layer_is_sparse(n)) {
                    None => FeedForward::Dense(Mlp {
                        gate_proj: col(w, "mlp.gate_proj", [h, i], c.mlp_bias, group)?,
                        up_proj: col(w, "mlp.up_proj", [h, i], c.mlp_bias, group)?,
                        down_proj: row(w, "mlp.down_proj", [i, h], c.mlp_bias, true)?,
                        act: c.hidden_act,
                    }),
                    Some(moe) => {
                        let (block, [gate, up, down]) = c.model_type.moe_names();
                        let width = moe.expert_intermediate_size;
                        let mut experts = Vec::with_capacity(moe.num_experts);
                        for e in 0..moe.num_experts {
                            let x = format!("{block}.experts.{e}");
                            // The mixture sums its experts' partial outputs once.
                            experts.push(Mlp {
                                gate_proj: col(
                                    w,
                                    &format!("{x}.{gate}"),
                                    [h, width],
                                    false,
                                    group,
                                )?,
                                up_proj: col(w, &format!("{x}.{up}"), [h, width], false, group)?,
                                down_proj: row(
                                    w,
                                    &format!("{x}.{down}"),
                                    [width, h],
                                    false,
                                    false,
                                )?,
                                act: c.hidden_act,
                            });
                        }
                        FeedForward::Sparse(SparseMoe {
                            gate: router(w, &format!("{block}.gate"), moe.num_experts)?,
                            experts,
                            top_k: moe.num_experts_per_tok,
                            norm_topk_prob: moe.norm_topk_prob,
                            model_type: c.model_type,
                        })
                    }
                },
                input_layernorm: norm(w, &format!("{p}.input_layernorm.weight"), c, device)?,
                post_attention_layernorm: norm(
                    w,
                    &format!("{p}.post_attention_layernorm.weight"),
                    c,
                    device,
                )?,
                pre_feedforward_layernorm: gemma_norm(
                    w,
                    &format!("{p}.pre_feedforward_layernorm.weight"),
                )?,
                post_feedforward_layernorm: gemma_norm(
                    w,
                    &format!("{p}.post_feedforward_layernorm.weight"),
                )?,
            });
        }
        Ok(Self {
            embed_tokens,
            layers,
            norm: norm(w, "model.norm.weight", c, device)?,
            rotary: c.rotary_frequencies(),
            local_rotary: c.local_rotary_frequencies(),
            embed_scale: c.embed_scale(),
            final_logit_softcapping: c.final_logit_softcapping,
        })
    }

    /// The decoder's tensors under HF names (adapters merged).
    pub fn export(&self, out: &mut BTreeMap<String, HostTensor>) {
        out.insert(
            "model.embed_tokens.weight".into(),
            self.embed_tokens.export(),
        );
        for (n, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{n}");
            let a = &layer.self_attn;
            a.q_proj.export(&format!("{p}.self_attn.q_proj"), out);
            a.k_proj.export(&format!("{p}.self_attn.k_proj"), out);
            a.v_proj.export(&format!("{p}.self_attn.v_proj"), out);
            a.o_proj.export(&format!("{p}.self_attn.o_proj"), out);
            for (name, head_norm) in [("q_norm", &a.q_norm), ("k_norm", &a.k_norm)] {
                if let Some(n) = head_norm {
                    out.insert(format!("{p}.self_attn.{name}.weight"), host(n.weight.val()));
                }
            }
            match &layer.mlp {
                FeedForward::Dense(m) => {
                    m.gate_proj.export(&format!("{p}.mlp.gate_proj"), out);
                    m.up_proj.export(&format!("{p}.mlp.up_proj"), out);
                    m.down_proj.export(&format!("{p}.mlp.down_proj"), out);
                }
                FeedForward::Sparse(moe) => {
                    let (block, [gate, up, down]) = moe.model_type.moe_names();
                    export_linear(&moe.gate, &format!("{p}.{block}.gate"), out);
                    for (e, x) in moe.experts.iter().enumerate() {
                        let x_name = format!("{p}.{block}.experts.{e}");
                        x.gate_proj.export(&format!("{x_name}.{gate}"), out);
                        x.up_proj.export(&format!("{x_name}.{up}"), out);
                        x.down_proj.export(&format!("{x_name}.{down}"), out);
                    }
                }
            }
            out.insert(
                format!("{p}.input_layernorm.weight"),
                host(layer.input_layernorm.weight.val()),
            );
            out.insert(
                format!("{p}.post_attention_layernorm.weight"),
                host(layer.post_attention_layernorm.weight.val()),
            );
            for (name, norm) in [
                (
                    "pre_feedforward_layernorm",
                    &layer.pre_feedforward_layernorm,
                ),
                (
                    "post_feedforward_layernorm",
                    &layer.post_feedforward_layernorm,
                ),
            ] {
                if let Some(n) = norm {
                    out.insert(format!("{p}.{name}.weight"), host(n.weight.val()));
                }
            }
        }
        out.insert("model.norm.weight".into(), host(self.norm.weight.val()));
    }

    /// Attaches LoRA adapters to the targeted linear layers and freezes everything else.
    pub fn with_lora(self, lora: &LoraConfig, device: &B::Device) -> Self {
        let layers = self
            .layers
            .into_iter()
            .map(|layer| {
                let layer = layer.map_linears(|name, l| {
                    let module = name.rsplit('.').next().unwrap_or(name);
                    Ok::<_, ModelError>(if lora.targets(module) {
                        l.with_adapter(lora.rank, lora.alpha, device)
                    } else {
                        l.no_grad()
                    })
                });
                let mut layer = layer.expect("adapting cannot fail");
                if let FeedForward::Sparse(moe) = layer.mlp {
                    layer.mlp = FeedForward::Sparse(moe.no_grad());
                }
                let attn = &mut layer.self_attn;
                attn.q_norm = attn.q_norm.take().map(|n| n.no_grad());
                attn.k_norm = attn.k_norm.take().map(|n| n.no_grad());
                DecoderLayer {
                    input_layernorm: layer.input_layernorm.no_grad(),
                    post_attention_layernorm: layer.post_attention_layernorm.no_grad(),
                    pre_feedforward_layernorm: layer.pre_feedforward_layernorm.map(|n| n.no_grad()),
                    post_feedforward_layernorm: layer
                        .post_feedforward_layernorm
                        .map(|n| n.no_grad()),
                    ..layer
                }
            })
            .collect();
        Self {
            embed_tokens: self.embed_tokens.no_grad(),
            layers,
            norm: self.norm.no_grad(),
            ..self
        }
    }
}

/// A decoder layer's linear layers, by their HF name inside the layer.
const LAYER_LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

impl<B: Backend> DecoderLayer<B> {
    /// The linear layer called `name` (one of [`LAYER_LINEARS`]); `None` for an MLP name of a
    /// sparse layer (its experts take no adapters).
    fn linear(&self, name: &str) -> Option<&LoraLinear<B>> {
        let a = &self.self_attn;
        Some(match name {
            "self_attn.q_proj" => &a.q_proj.linear,
            "self_attn.k_proj" => &a.k_proj.linear,
            "self_attn.v_proj" => &a.v_proj.linear,
            "self_attn.o_proj" => &a.o_proj.linear,
            _ => {
                let m = self.mlp.dense()?;
                match name {
                    "mlp.gate_proj" => &m.gate_proj.linear,
                    "mlp.up_proj" => &m.up_proj.linear,
                    _ => &m.down_proj.linear,
                }
            }
        })
    }

    /// The layer with each linear layer replaced by `f(its name, it)`.
    fn map_linears<E>(
        self,
        mut f: impl FnMut(&str, LoraLinear<B>) -> Result<LoraLinear<B>, E>,
    ) -> Result<Self, E> {
        let a = self.self_attn;
        let m = self.mlp;
        Ok(DecoderLayer {
            self_attn: Attention {
                q_proj: ColumnParallelLinear {
                    linear: f(LAYER_LINEARS[0], a.q_proj.linear)?,
                    ..a.q_proj
                },
                k_proj: ColumnParallelLinear {
                    linear: f(LAYER_LINEARS[1], a.k_proj.linear)?,
                    ..a.k_proj
                },
                v_proj: ColumnParallelLinear {
                    linear: f(LAYER_LINEARS[2], a.v_proj.linear)?,
                    ..a.v_proj
                },
                o_proj: RowParallelLinear {
                    linear: f(LAYER_LINEARS[3], a.o_proj.linear)?,
                    ..a.o_proj
                },
                ..a
            },
            // A sparse layer's router and experts take no adapters (LoRA adapts attention there).
            mlp: match m {
                FeedForward::Dense(m) => FeedForward::Dense(Mlp {
                    gate_proj: ColumnParallelLinear {
                        linear: f(LAYER_LINEARS[4], m.gate_proj.linear)?,
                        ..m.gate_proj
                    },
                    up_proj: ColumnParallelLinear {
                        linear: f(LAYER_LINEARS[5], m.up_proj.linear)?,
                        ..m.up_proj
                    },
                    down_proj: RowParallelLinear {
                        linear: f(LAYER_LINEARS[6], m.down_proj.linear)?,
                        ..m.down_proj
                    },
                    act: m.act,
                }),
                sparse => sparse,
            },
            ..self
        })
    }
}

impl<B: Backend> CausalLm<B> {
    /// The LM from a checkpoint: tied to the embeddings when `lm_head.weight` is absent. Fails
    /// (and returns no model) on a missing, unexpected or misshapen tensor.
    pub fn from_weights(
        c: &TransformerConfig,
        w: WeightMap,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Self::load(c, w, None, device)
    }

    /// [`CausalLm::from_weights`] as this rank's part in `group` (its share of the vocabulary in
    /// the LM head, see [`crate::tensor_parallel`]); the whole model without a group. LoRA
    /// adapters are attached after loading, and not under tensor parallelism.
    pub fn load(
        c: &TransformerConfig,
        mut w: WeightMap,
        group: Option<&TpGroup>,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let model = Transformer::load(c, &mut w, group, device)?;
        let lm_head = if w.contains("lm_head.weight") {
            Some(ColumnParallelLinear::load(
                &mut w,
                "lm_head",
                [c.hidden_size, c.vocab_size],
                false,
                group,
                device,
            )?)
        } else {
            None
        };
        w.finish()?;
        Ok(Self { model, lm_head })
    }

    /// Every tensor under HF names, adapters merged (what `save_pretrained` writes).
    pub fn export(&self) -> BTreeMap<String, HostTensor> {
        let mut out = BTreeMap::new();
        self.model.export(&mut out);
        if let Some(head) = &self.lm_head {
            head.export("lm_head", &mut out);
        }
        out
    }

    /// Whether the head reuses the embeddings.
    pub fn is_tied(&self) -> bool {
        self.lm_head.is_none()
    }

    /// Attaches LoRA adapters (the LM head is left frozen) and freezes the rest.
    pub fn with_lora(self, lora: &LoraConfig, device: &B::Device) -> Self {
        Self {
            model: self.model.with_lora(lora, device),
            lm_head: self.lm_head.map(|h| h.no_grad()),
        }
    }

    /// Merges every adapter into its base weight.
    pub fn merge_lora(self) -> Self {
        let layers = self
            .model
            .layers
            .into_iter()
            .map(|layer| {
                layer
                    .map_linears(|_, l| Ok::<_, ModelError>(l.merge()))
                    .expect("merging cannot fail")
            })
            .collect();
        Self {
            model: Transformer {
                layers,
                ..self.model
            },
            lm_head: self.lm_head.map(|h| ColumnParallelLinear {
                linear: h.linear.merge(),
                ..h
            }),
        }
    }

    /// The LoRA adapters in PEFT's file layout (`adapter_model.safetensors`):
    /// `base_model.model.model.layers.N.{self_attn,mlp}.X.lora_A.weight` `[r, in]` and
    /// `lora_B.weight` `[out, r]`. Empty without adapters.
    pub fn export_lora(&self) -> BTreeMap<String, HostTensor> {
        let mut out = BTreeMap::new();
        for (n, layer) in self.model.layers.iter().enumerate() {
            for name in LAYER_LINEARS {
                let Some(adapter) = layer.linear(name).and_then(|l| l.lora.as_ref()) else {
                    continue;
                };
                let prefix = format!("base_model.model.model.layers.{n}.{name}");
                for (part, t) in [("lora_A", &adapter.lora_a), ("lora_B", &adapter.lora_b)] {
                    let h = host(t.val());
                    let (rows, cols) = (h.shape[0], h.shape[1]);
                    out.insert(
                        format!("{prefix}.{part}.weight"),
                        HostTensor {
                            shape: vec![cols, rows],
                            data: transpose(&h.data, rows, cols),
                        },
                    );
                }
            }
        }
        out
    }

    /// This model with its adapters' values taken from `w` (PEFT's names and layout, as
    /// [`CausalLm::export_lora`] writes them): every adapter must be there with its shape, and
    /// `w` must hold no adapter this model lacks ([`WeightMap::finish`] after).
    pub fn load_lora(self, w: &mut WeightMap, device: &B::Device) -> Result<Self, ModelError> {
        let mut layers = Vec::with_capacity(self.model.layers.len());
        for (n, layer) in self.model.layers.into_iter().enumerate() {
            layers.push(layer.map_linears(|name, mut l| {
                if let Some(adapter) = l.lora.as_mut() {
                    let prefix = format!("base_model.model.model.layers.{n}.{name}");
                    let [d_in, r] = adapter.lora_a.dims();
                    let d_out = adapter.lora_b.dims()[1];
                    let a = w.take(&format!("{prefix}.lora_A.weight"), &[r, d_in])?;
                    let b = w.take(&format!("{prefix}.lora_B.weight"), &[d_out, r])?;
                    adapter.lora_a =
                        Param::from_tensor(tensor2(transpose(&a.data, r, d_in), [d_in, r], device));
                    adapter.lora_b = Param::from_tensor(tensor2(
                        transpose(&b.data, d_out, r),
                        [r, d_out],
                        device,
                    ));
                }
                Ok(l)
            })?);
        }
        Ok(Self {
            model: Transformer {
                layers,
                ..self.model
            },
            ..self
        })
    }
}
