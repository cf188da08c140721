//! Failpoints at every boundary where a crash must be survivable: after the
//! claim, before and after each phase commit, after each external call.
//! Built only with the `failpoints` feature (test builds); then
//! `FAILPOINTS="after-call:ext2=return"` makes the process abort right
//! there, and `...=sleep(3000)` stalls it (a zombie owner). Without the
//! feature every boundary compiles to nothing.
//!
//! The names, in the order a payment meets them:
//! `after-claim`, `before-commit:EXT1_SENT`, `after-commit:EXT1_SENT`,
//! `after-call:ext1`, `before-commit:EXT2_SENT`, `after-commit:EXT2_SENT`,
//! `after-call:ext2`, `before-commit:FINISHED`, `after-commit:FINISHED`;
//! and `before-phase:{point}` (after the lease check, before the phase
//! begins) for each of the three phases, where a stall makes a zombie.

/// Marks a boundary; `name` is built only when failpoints are compiled in.
#[inline]
pub fn boundary(name: impl FnOnce() -> String) {
    #[cfg(feature = "failpoints")]
    {
        let name = name();
        fail::fail_point!(&name, |_| {
            eprintln!("failpoint {name}: aborting the process");
            std::process::abort()
        });
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Reads `FAILPOINTS` from the environment; keep the guard for the process's life.
#[cfg(feature = "failpoints")]
pub fn from_env() -> fail::FailScenario<'static> {
    fail::FailScenario::setup()
}
