//! The payout example (`examples/payout.rs`), an operation written outside
//! the crate, run against the real stores as the rest of the suite is: one
//! instruction at the rail for two callers and a retry, the same bytes for
//! all (the example checks both, and fails otherwise).

#[path = "../../examples/payout.rs"]
mod payout;

#[test]
fn an_operation_written_outside_the_crate_is_worked_exactly_once() {
    payout::main().expect("the payout example holds");
}
