//! FSDP's memory per rank, counted by this test's allocator on the CPU backend (where tensors live
//! on the heap): 4 ranks (threads) train a 4-layer decoder with layer checkpointing, holding its
//! parameters whole (gradients averaged, AdamW on every rank) or sharded (FSDP: chunks, each layer
//! gathered when run and freed after, gradients reduce-scattered, AdamW on the chunks). Between
//! steps a sharded rank holds 1/4 of the parameter and AdamW bytes; during a step (forward,
//! backward, AdamW) its live bytes rise by about one gathered layer with its gradient, plus the
//! parameters outside the layers (read once per micro-batch) and the activations, where a whole
//! rank's rise by every gradient. One test in this binary, so no other test's allocations mix in.

use std::sync::{Arc, Barrier};

use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use burn_rlhf::backend::{InferenceBackend, TrainBackend};
use burn_rlhf::distributed::fsdp::{ChunkGradients, FsdpShards, ShardGroups, ShardedAdamW};
use burn_rlhf::distributed::DataParallel;
use burn_rlhf::forward::{decoder_hidden, micro_model};
use burn_rlhf::models::collective::LocalTpGroup;
use burn_rlhf::models::transformer::PassRows;
use burn_rlhf::models::weights::WeightMap;
use burn_rlhf::models::{CausalLm, TransformerConfig};
use burn_rlhf::optim::{adamw, adamw_state_bytes, synced_step, FusedAdamW, ReplicaSync};
use burn_rlhf_test_assets::{peak_during, CountingAlloc};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

type B = TrainBackend;

const RANKS: usize = 4;

/// The starting weights every rank builds its model from.
type Weights = Arc<std::collections::BTreeMap<String, burn_rlhf::models::weights::HostTensor>>;
const ROWS: usize = 2;
const LEN: usize = 16;

fn config() -> TransformerConfig {
    // Weights, not activations, dominate: a short batch through a 4-layer decoder.
    TransformerConfig::new(
        burn_rlhf::models::ModelType::Qwen2,
        512,
        128,
        512,
        4,
        4,
        2,
        32,
    )
    .with_max_position_embeddings(LEN)
}

/// A rank's loss on its own ids: every logit weighted. Shapes: → `[1]`.
fn loss(
    model: &CausalLm<B>,
    rank: usize,
    checkpoint: Option<&mut burn_rlhf::forward::LayerCheckpoint<B>>,
) -> Tensor<B, 1> {
    let device = Default::default();
    let ids: Vec<i64> = (0..ROWS * LEN)
        .map(|i| ((i * 31 + rank * 7) % 509) as i64)
        .collect();
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [ROWS, LEN]), &device);
    let mask = vec![vec![1i64; LEN]; ROWS];
    let positions = vec![(0..LEN as i64).collect::<Vec<_>>(); ROWS];
    let rows = PassRows {
        attention_mask: &mask,
        position_ids: &positions,
        packed: None,
    };
    let logits = model.logits(decoder_hidden(&model.model, ids, rows, None, checkpoint));
    (logits.clone() * logits).mean()
}

/// What one rank does: `step()` runs one training step; `at_rest()` its bytes of parameters and
/// AdamW moments between steps.
trait Rank {
    fn step(&mut self);
    fn at_rest(&self) -> usize;
}

struct Whole {
    model: CausalLm<B>,
    optim: burn_rlhf::optim::AdamWOf<CausalLm<B>, B>,
    sync: ReplicaSync,
    rank: usize,
}

impl Rank for Whole {
    fn step(&mut self) {
        let (computing, mut checkpoint) = micro_model(&self.model, None, true);
        let l = loss(&computing, self.rank, checkpoint.as_mut());
        let mut grads = l.backward();
        let kept = checkpoint.map_or_else(Vec::new, |c| c.into_kept());
        let dys: Vec<_> = kept.iter().map(|k| k.output_grad(&mut grads)).collect();
        let mut sum = burn::optim::GradientsAccumulator::<CausalLm<B>>::new();
        sum.accumulate(&self.model, GradientsParams::from_grads(grads, &self.model));
        for (pass, dy) in kept.into_iter().zip(dys) {
            pass.backward_layers(dy, None, |g, segment| {
                sum.accumulate(&self.model, segment.gradients(g))
            });
        }
        let model = self.model.clone();
        let (model, _) =
            synced_step(model, &mut self.optim, 1e-3, sum.grads(), 1.0, &self.sync).unwrap();
        self.model = model;
    }

    fn at_rest(&self) -> usize {
        self.model.num_params() * 4 + adamw_state_bytes(&self.optim).device
    }
}

struct Sharded {
    kept: CausalLm<B>,
    shards: Arc<FsdpShards<B>>,
    adam: ShardedAdamW<InferenceBackend>,
    rank: usize,
    world: usize,
}

impl Rank for Sharded {
    fn step(&mut self) {
        let copy = self.shards.pass_copy(&self.kept, false);
        let (computing, mut checkpoint) = micro_model(&copy, None, true);
        let l = loss(&computing, self.rank, checkpoint.as_mut());
        let mut sums = ChunkGradients::new(self.shards.len());
        self.shards
            .backward_into(&computing, l, checkpoint, None, &mut sums)
            .unwrap();
        drop((copy, computing));
        let sums = sums.scaled(1.0 / self.world as f64);
        self.adam.step(&self.shards, sums, 1e-3, 1.0).unwrap();
    }

    fn at_rest(&self) -> usize {
        self.shards.bytes().0 + self.adam.state_bytes().device
    }
}

/// With `sharded` or not: each rank's bytes at rest, and the rise of the process's live bytes
/// during one step of all ranks (after a first step made the AdamW moments), per rank.
fn measure(start: &Weights, sharded: bool) -> (Vec<usize>, usize) {
    let ready = Arc::new(Barrier::new(RANKS + 1));
    let handles: Vec<_> = LocalTpGroup::group(RANKS)
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let (weights, ready) = (start.clone(), ready.clone());
            std::thread::spawn(move || {
                let device = Default::default();
                // Each rank's own tensors (ranks that share autodiff leaves share one graph).
                let mut w = WeightMap::new("start");
                for (k, v) in weights.iter() {
                    w.insert(k.clone(), v.clone());
                }
                let model = CausalLm::<B>::from_weights(&config(), w, &device).unwrap();
                let collective = group.collective();
                let mut me: Box<dyn Rank> = if sharded {
                    let (kept, shards) =
                        FsdpShards::shard(model, ShardGroups::of(collective), &device);
                    let adam =
                        ShardedAdamW::new(FusedAdamW::new([0.9, 0.999], 0.01, false), shards.len());
                    Box::new(Sharded {
                        kept,
                        shards,
                        adam,
                        rank,
                        world: RANKS,
                    })
                } else {
                    let dp = DataParallel::over(collective);
                    Box::new(Whole {
                        model,
                        optim: adamw([0.9, 0.999], 0.01, false),
                        sync: ReplicaSync {
                            dp,
                            ..Default::default()
                        },
                        rank,
                    })
                };
                me.step();
                ready.wait();
                // The measured step.
                ready.wait();
                me.step();
                ready.wait();
                me.at_rest()
            })
        })
        .collect();
    ready.wait();
    let (rise, ()) = peak_during(|| {
        ready.wait();
        ready.wait();
    });
    let at_rest = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (at_rest, rise / RANKS)
}

#[test]
fn a_sharded_rank_holds_a_quarter_at_rest_and_about_a_layer_more_in_a_step() {
    let device = Default::default();
    <B as burn::tensor::backend::Backend>::seed(&device, 3);
    let start: CausalLm<B> = config().init_causal_lm(&device);
    let weights: Weights = Arc::new(start.valid().export());
    let total = start.num_params() * 4;
    let layer = start.model.layers[0].num_params() * 4;
    let outside = total
        - start
            .model
            .layers
            .iter()
            .map(|l| l.num_params() * 4)
            .sum::<usize>();
    // Warm the backend's caches and the threads first.
    measure(&weights, true);
    measure(&weights, false);
    let (whole_rest, whole_rise) = measure(&weights, false);
    let (sharded_rest, sharded_rise) = measure(&weights, true);
    let mb = |b: usize| b as f64 / 1e6;
    println!(
        "{RANKS} ranks, parameters {:.2} MB (a layer {:.2} MB, outside the layers {:.2} MB): \
         at rest a whole rank holds {:.2} MB (parameters and AdamW moments), a sharded one \
         {:.2} MB; during a step the live bytes rise by {:.2} MB per whole rank, {:.2} MB per \
         sharded rank",
        mb(total),
        mb(layer),
        mb(outside),
        mb(whole_rest[0]),
        mb(sharded_rest[0]),
        mb(whole_rise),
        mb(sharded_rise),
    );
    for (rank, &held) in sharded_rest.iter().enumerate() {
        let quarter = whole_rest[rank] as f64 / RANKS as f64;
        assert!(
            (held as f64 - quarter).abs() < 0.01 * quarter,
            "rank {rank}: {held} bytes at rest against a quarter of {}",
            whole_rest[rank]
        );
    }
    // A whole rank's step holds every gradient (the parameters' bytes) at once.
    assert!(
        whole_rise as f64 > 0.9 * total as f64,
        "a whole rank's step: {whole_rise} bytes against {total} of gradients"
    );
    // What a whole rank's step holds beyond its gradients (activations, temporaries) a sharded
    // one holds too; beyond that it holds a layer, the outside parameters, their gradients and
    // its chunks of the gradients (a quarter).
    let beyond_gradients = whole_rise - total;
    let bound = beyond_gradients + 2 * (layer + outside) + total / RANKS;
    println!(
        "a sharded rank's rise beyond the activations a whole one also holds: {:.2} MB (bound: a \
         layer and the outside parameters with their gradients and a quarter of the gradients, \
         {:.2} MB)",
        mb(sharded_rise.saturating_sub(beyond_gradients)),
        mb(bound - beyond_gradients)
    );
    assert!(
        sharded_rise <= bound,
        "a sharded rank's step rose by {sharded_rise} bytes, above {bound}"
    );
    // The ranks' peaks overlap differently from run to run (the count is the process's): a
    // quarter of the gradients' bytes is the margin kept.
    assert!(
        sharded_rise + total / 4 < whole_rise,
        "sharding should spare at least a quarter of the gradients' bytes: {sharded_rise} \
         against {whole_rise}"
    );
}
