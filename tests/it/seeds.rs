//! The seeds the property tests (the models) run from. By default a fixed
//! seed ([`CI`]) and every seed a test keeps as a regression case, so a
//! fresh seed that finds an old bug never blocks unrelated work and every
//! run of the suite checks the same cases. `KEYFENCE_PROPTEST_SEED=N` runs
//! seed N alone; `KEYFENCE_PROPTEST_SEED=random` a fresh one, printed
//! first. A failing run names its seed and the smallest failing input
//! found; keep the seed in the test's list of kept seeds.

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// The seed every run of the suite checks.
pub const CI: u64 = 1;

/// Runs `test` on `cases` inputs drawn from `strategy`, once from each seed
/// of this run (see the module's header); panics naming the seed of the
/// first failure.
pub fn run<S: Strategy>(cases: u32, kept: &[u64], strategy: S, test: impl Fn(S::Value)) {
    for seed in seeds(kept) {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
        let config = Config { cases, failure_persistence: None, ..Config::default() };
        let mut runner = TestRunner::new_with_rng(config, rng);
        if let Err(failure) = runner.run(&strategy, |value| {
            test(value);
            Ok(())
        }) {
            panic!("seed {seed} fails (KEYFENCE_PROPTEST_SEED={seed} runs it again; keep it): {failure}");
        }
    }
}

/// This run's seeds.
fn seeds(kept: &[u64]) -> Vec<u64> {
    match std::env::var("KEYFENCE_PROPTEST_SEED").ok().as_deref() {
        Some("random") => {
            let seed = fastrand::u64(..);
            eprintln!("property test seed: {seed}");
            vec![seed]
        }
        Some(seed) => vec![seed.parse().expect("KEYFENCE_PROPTEST_SEED is a number or `random`")],
        None => std::iter::once(CI).chain(kept.iter().copied()).collect(),
    }
}
