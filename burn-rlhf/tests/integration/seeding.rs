//! What a test draws from the backend's one random stream under [`super::seeded`] is all it
//! draws: the library builds a random model whole, so no value of it is drawn later, outside the
//! lock, from wherever another test left the stream.

use burn::backend::Flex;
use burn::module::Module;
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

/// Every float parameter's values, in visiting order.
fn values<M: Module<Flex>>(module: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl burn::module::ModuleVisitor<Flex> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<Flex, D>>) {
            self.0.extend(param.val().into_data().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Another draw between building a random model and first reading it (another thread's, say)
/// changes nothing. With Burn's lazy initialisers each parameter would be drawn at its first
/// read, after the other draw, and come out different (tried: the causal LM differed).
#[test]
fn a_random_model_is_drawn_while_it_is_built() {
    let c = tasks::model_config(32, 1);
    let d = Default::default();
    let other = || {
        let _: Tensor<Flex, 1> = Tensor::random([64], Distribution::Default, &d);
    };
    let lm = |disturb: bool| {
        super::seeded(17, || {
            let m: CausalLm<Flex> = c.init_causal_lm(&d);
            if disturb {
                other();
            }
            values(&m)
        })
    };
    assert_same(&lm(false), &lm(true), "the causal LM");
    for (what, build) in [
        (
            "critic",
            ScoredModel::<Flex>::init_critic as fn(&_, &_) -> _,
        ),
        ("reward model", ScoredModel::<Flex>::init_reward),
    ] {
        let scored = |disturb: bool| {
            super::seeded(17, || {
                let m = build(&c, &d);
                if disturb {
                    other();
                }
                values(&m)
            })
        };
        assert_same(&scored(false), &scored(true), what);
    }
}
