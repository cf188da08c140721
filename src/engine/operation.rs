//! `Operation`: what the engine drives. An operation is a fixed sequence of
//! steps: local phases, whose business writes run inside a fenced ledger
//! transaction, and external calls, each with a recovery point for its
//! intent (`sent`) and its outcome (`done`). The last step is the local
//! phase `FINISHED`, which returns the final answer. An external system may
//! also decline; then the operation's `declined` phase undoes what earlier
//! steps reserved and returns the final answer instead, and no later step
//! runs. Operations live outside the engine (`crate::operations`), and name
//! the rails they call; the engine knows them only through this trait.

use std::future::Future;

use sqlx::PgConnection;

use super::EngineError;
use crate::domain::{Fence, RecoveryPoint, StoredResponse};
use crate::keystore::Hold;
use crate::ledger::writes::Writes;
use crate::ledger::{Phase, RequestRecord, external};
use crate::rail::{Applied, Declined, Instruction, Verdict};

#[derive(Debug, Clone)]
pub struct ExternalStep {
    /// Names the step in derived keys and call records; never change it.
    pub name: &'static str,
    /// The external system it calls, by the name its client has in [`super::Rails`].
    pub rail: &'static str,
    pub sent: RecoveryPoint,
    pub done: RecoveryPoint,
}

#[derive(Debug, Clone)]
pub enum Step {
    Local(RecoveryPoint),
    External(ExternalStep),
}

/// What a local step works with: the phase and the request.
pub struct StepContext<'a> {
    pub phase: &'a mut Phase,
    pub request: &'a RequestRecord,
    pub fence: Fence,
    /// The verdict this phase records (the step awaited, and what it
    /// answered), written by the statement that opened the phase.
    pub settled: Option<(&'a str, &'a Verdict)>,
}

impl StepContext<'_> {
    /// The phase's transaction, for statements whose results the step
    /// reads (the writes held before them are sent first).
    pub async fn conn(&mut self) -> Result<&mut PgConnection, EngineError> {
        Ok(self.phase.conn().await?)
    }

    /// Where the step holds its writes that nothing in the phase reads:
    /// sent together, in order, before the phase's next other statement.
    pub fn writes(&mut self) -> &mut Writes {
        self.phase.writes()
    }

    /// What external step `step` applied, as the ledger holds it: the
    /// verdict this phase records, or else the one committed before.
    pub async fn applied(&mut self, step: &str) -> Result<Applied, EngineError> {
        if let Some((settled, Verdict::Applied(applied))) = self.settled
            && settled == step
        {
            return Ok(applied.clone());
        }
        let request = self.request;
        let result = external::outcome_of(self.conn().await?, request, step)
            .await?
            .ok_or_else(|| EngineError::Fault(format!("no recorded outcome for {step}")))?;
        serde_json::from_value(result).map_err(|e| EngineError::record(format!("the recorded outcome of {step}"), e))
    }
}

pub trait Operation: Send + Sync {
    /// Stored with each request, so a resumer knows what it is resuming.
    fn name(&self) -> &'static str;

    /// The steps in order, ending with `Step::Local(RecoveryPoint::FINISHED)`.
    fn steps(&self) -> &'static [Step];

    /// The business writes of local step `point`, inside its phase. The
    /// `FINISHED` step returns the final answer; the others return `None`.
    fn local(
        &self,
        point: &RecoveryPoint,
        cx: &mut StepContext<'_>,
    ) -> impl Future<Output = Result<Option<StoredResponse>, EngineError>> + Send;

    /// The business writes when external step `step` declined, inside the
    /// phase that records the refusal and reaches `FINISHED`: undo what the
    /// earlier steps reserved and return the final answer.
    fn declined(
        &self,
        step: &ExternalStep,
        declined: &Declined,
        cx: &mut StepContext<'_>,
    ) -> impl Future<Output = Result<StoredResponse, EngineError>> + Send;

    /// The business writes when the outcome of external step `step` has
    /// stayed unknown so long it is listed for settlement, inside the phase
    /// that marks it so: every park from then on (so they must be
    /// idempotent), whatever the limit was when it was first reached.
    fn indeterminate(
        &self,
        step: &ExternalStep,
        cx: &mut StepContext<'_>,
    ) -> impl Future<Output = Result<(), EngineError>> + Send;

    /// What external step `step` sends.
    fn instruction(&self, step: &ExternalStep) -> Instruction;

    /// A hold the request takes on a balance in the key store before its
    /// first phase (an amount of what an earlier request left to give), if it needs
    /// one. The engine takes it once per request (a retried hold is
    /// recognised), answers [`super::Answer::Exceeded`] without storing
    /// anything when the balance is too small, and concludes it when the
    /// request finishes: settled by a 2xx final answer, released by any
    /// other.
    fn hold(&self) -> Option<Hold> {
        None
    }
}
