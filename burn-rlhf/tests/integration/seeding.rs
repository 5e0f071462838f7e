//! What a test draws from the backend's one random stream under [`super::seeded_model`] is all
//! it draws: the model is read whole under the lock, so no value of it is drawn later, outside
//! the lock, from wherever another test left the stream.

use burn::backend::Flex;
use burn::tensor::{Distribution, Tensor};
use burn_rlhf::models::{CausalLm, ScoredModel};
use burn_rlhf::tasks;

/// `a` and `b` equal, or the first place they differ, for `what`.
fn assert_same(a: &[f32], b: &[f32], what: &str) {
    let first = a.iter().zip(b).position(|(x, y)| x != y);
    assert!(
        a.len() == b.len() && first.is_none(),
        "{what}: {} and {} values, first differing at {first:?}",
        a.len(),
        b.len()
    );
}

/// Another test's draw (under the lock, after this model's) between building a random model and
/// reading it changes nothing for a model drawn with [`super::seeded_model`]; a model only built
/// under the lock (Burn's initialisers being lazy) is drawn at its first read, after the other
/// draw, and comes out different: the way two CI runs failed.
#[test]
fn a_model_drawn_under_the_lock_is_drawn_whole() {
    let c = tasks::model_config(32, 1);
    let d = Default::default();
    let other = || {
        super::seeded(99, || {
            let _: Tensor<Flex, 1> = Tensor::random([64], Distribution::Default, &d);
        })
    };
    let quiet: CausalLm<Flex> = super::seeded_model(17, || c.init_causal_lm(&d));
    let disturbed: CausalLm<Flex> = super::seeded_model(17, || c.init_causal_lm(&d));
    other();
    assert_same(
        &super::params(&quiet),
        &super::params(&disturbed),
        "the causal LM",
    );
    let lazy: CausalLm<Flex> = super::seeded(17, || c.init_causal_lm(&d));
    other();
    assert_ne!(
        super::params(&quiet),
        super::params(&lazy),
        "built, not drawn, under the lock"
    );
    for (what, build) in [
        (
            "critic",
            ScoredModel::<Flex>::init_critic as fn(&_, &_) -> _,
        ),
        ("reward model", ScoredModel::<Flex>::init_reward),
    ] {
        let quiet = super::seeded_model(17, || build(&c, &d));
        let disturbed = super::seeded_model(17, || build(&c, &d));
        other();
        assert_same(&super::params(&quiet), &super::params(&disturbed), what);
    }
}
