//! Failpoints at every boundary where a crash must be survivable: after the
//! claim, before and after each phase commit, after each external call.
//! Built only with the `failpoints` feature (test builds); then
//! `FAILPOINTS="after-call:ext2=return"` makes the process abort right
//! there, and `...=sleep(3000)` stalls it (a zombie owner). Without the
//! feature every boundary compiles to nothing.
//!
//! The names, in the order a payment meets them:
//! `before-claim` (after the request's checks, before it claims or acts on
//! the item its check read: a stall lets the key expire meanwhile),
//! `after-claim`, `before-commit:EXT1_SENT`, `after-commit:EXT1_SENT`,
//! `after-call:ext1`, `before-commit:EXT2_SENT`, `after-commit:EXT2_SENT`,
//! `after-call:ext2`, `before-commit:FINISHED`, `after-commit:FINISHED`;
//! and `before-phase:{point}` (after the lease check, before the phase
//! begins) for each of the three phases, where a stall makes a zombie;
//! and `before-fail-over` (a retry in another region, between reading the
//! key and moving it), where a stall lets the key finish meanwhile;
//! and `before-webhook-send` (a delivery worker between its key-store read
//! and the send), where a stall outlasts the delivery's lease.
//!
//! The same builds can set the process's clock off ([`clock_offset_ms`]).

/// Marks a boundary; `name` is built only when failpoints are compiled in.
#[inline]
pub fn boundary(name: impl FnOnce() -> String) {
    #[cfg(feature = "failpoints")]
    {
        let name = name();
        let eval = || {
            fail::fail_point!(&name, |_| {
                eprintln!("failpoint {name}: aborting the process");
                std::process::abort()
            })
        };
        if armed(&name) {
            stalls_only_this_task(eval);
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Whether the process armed the failpoint `name` (read once, after
/// [`from_env`] ran at start-up).
#[cfg(feature = "failpoints")]
fn armed(name: &str) -> bool {
    static ARMED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    ARMED.get_or_init(|| fail::list().into_iter().map(|(name, _)| name).collect()).iter().any(|armed| armed == name)
}

/// Runs a failpoint's action so that a `sleep` stalls the task that met it,
/// not the runtime thread under it: on a multi-threaded runtime the thread
/// hands its other tasks (the I/O tasks of pooled connections among them)
/// to another thread first.
#[cfg(feature = "failpoints")]
fn stalls_only_this_task(eval: impl FnOnce()) {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(eval),
        _ => eval(),
    }
}

/// How far this process's clock is set off, in milliseconds: in failpoints
/// builds, `KEYFENCE_CLOCK_OFFSET_MS` (read once) makes an instance whose
/// clock is wrong, for the clock-skew tests; otherwise always 0.
#[inline]
pub fn clock_offset_ms() -> i64 {
    #[cfg(feature = "failpoints")]
    {
        static OFFSET: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
        *OFFSET.get_or_init(|| std::env::var("KEYFENCE_CLOCK_OFFSET_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
    }
    #[cfg(not(feature = "failpoints"))]
    0
}

/// Reads `FAILPOINTS` from the environment; keep the guard for the process's life.
#[cfg(feature = "failpoints")]
pub fn from_env() -> fail::FailScenario<'static> {
    fail::FailScenario::setup()
}
