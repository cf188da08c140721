//! The resume loop. From the request's recovery point it runs one ledger
//! transaction per stretch of work: the outcome of the external call just
//! made, the local phases that follow, and the intent of the next call (or
//! the final answer), so a payment with two external calls takes three
//! transactions while every recovery point is still recorded. Between
//! transactions it calls the external system with the step's derived key.
//!
//! At a `sent` point with no outcome in hand (a resumed request), it probes
//! by derived key first and re-sends with the same key only if the external
//! system never saw it. An unknown outcome parks the request (202); a
//! definite refusal hands the key back (503). Neither is a final answer.

use crate::domain::{Millis, RecoveryPoint};
use crate::failpoint;
use crate::keystore::{Finish, KeyStore, KeyStoreError, Release};
use crate::ledger::external;
use crate::rail::{Applied, CallOutcome, ProbeOutcome};

use super::lease::Attempt;
use super::{Answer, Engine, EngineError, ExternalStep, Operation, Step, StepContext, derived_key};

/// One piece of work inside a transaction.
enum Work<'s> {
    Outcome(&'s ExternalStep),
    Local(&'s RecoveryPoint),
    Intent(&'s ExternalStep),
}

impl Work<'_> {
    fn point(&self) -> &RecoveryPoint {
        match self {
            Work::Outcome(step) => &step.done,
            Work::Local(point) => point,
            Work::Intent(step) => &step.sent,
        }
    }
}

/// Where the request stands relative to the steps.
enum Position<'s> {
    /// Start with step `index`.
    Before(usize),
    /// The intent of this external step is committed; its outcome is not.
    Awaiting(usize, &'s ExternalStep),
}

fn position<'s>(steps: &'s [Step], at: &RecoveryPoint) -> Result<Position<'s>, EngineError> {
    if *at == RecoveryPoint::STARTED {
        return Ok(Position::Before(0));
    }
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Local(point) if point == at => return Ok(Position::Before(i + 1)),
            Step::External(ext) if ext.sent == *at => return Ok(Position::Awaiting(i, ext)),
            Step::External(ext) if ext.done == *at => return Ok(Position::Before(i + 1)),
            _ => {}
        }
    }
    Err(EngineError::Fault(format!("recovery point {at} is not a step of this operation")))
}

/// The work of the next transaction, starting at step `from`.
fn stretch<'s>(steps: &'s [Step], outcome_of: Option<&'s ExternalStep>, from: usize) -> Vec<Work<'s>> {
    let mut work: Vec<Work<'_>> = outcome_of.into_iter().map(Work::Outcome).collect();
    for step in &steps[from..] {
        match step {
            Step::Local(point) => work.push(Work::Local(point)),
            Step::External(ext) => {
                work.push(Work::Intent(ext));
                break;
            }
        }
    }
    work
}

/// The derived key of `ext` as the external system receives it.
fn wire_key(attempt: &Attempt, ext: &ExternalStep) -> String {
    derived_key(&attempt.record.key, ext.name).simple().to_string()
}

/// How an external step settled.
enum Settled {
    Applied(Applied),
    Parked(Answer),
}

impl<K: KeyStore> Engine<K> {
    /// Drives the request to an answer. On a transient failure or a fault
    /// the key is handed back so the next retry (or the recovery worker)
    /// can resume at once; when fenced out, nothing more is touched.
    pub(super) async fn drive<O: Operation>(&self, op: &O, attempt: &mut Attempt) -> Result<Answer, EngineError> {
        let result = self.drive_to_answer(op, attempt).await;
        if let Err(EngineError::Transient(_) | EngineError::Fault(_)) = &result {
            self.hand_back(attempt).await;
        }
        result
    }

    pub(super) async fn drive_to_answer<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
    ) -> Result<Answer, EngineError> {
        let steps = op.steps();
        let mut outcome: Option<Applied> = None;
        loop {
            if attempt.at == RecoveryPoint::FINISHED {
                return self.publish(attempt).await;
            }
            let (awaiting, from) = match position(steps, &attempt.at)? {
                Position::Before(i) => (None, i),
                Position::Awaiting(i, ext) => {
                    if outcome.is_none() {
                        match self.settle(op, attempt, ext).await? {
                            Settled::Applied(applied) => outcome = Some(applied),
                            Settled::Parked(answer) => return Ok(answer),
                        }
                    }
                    (Some(ext), i + 1)
                }
            };
            let work = stretch(steps, awaiting, from);
            self.commit(op, attempt, &work, outcome.take()).await?;
            if let Some(Work::Intent(ext)) = work.last() {
                match self.call(op, attempt, ext).await? {
                    Settled::Applied(applied) => outcome = Some(applied),
                    Settled::Parked(answer) => return Ok(answer),
                }
            }
        }
    }

    /// One fenced transaction doing `work`; advances `attempt.at`.
    async fn commit<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
        work: &[Work<'_>],
        outcome: Option<Applied>,
    ) -> Result<(), EngineError> {
        let Some(last) = work.last() else {
            return Err(EngineError::Fault("an operation must end with its FINISHED step".into()));
        };
        let to = last.point().clone();
        attempt.keep_alive(&self.keys, self.settings.lease).await?;
        // A stall here is the classic zombie: the lease looked fresh a moment
        // ago, and the fence check below is what stops the write.
        failpoint::boundary(|| format!("before-phase:{to}"));
        let mut phase = self.ledger.begin_phase(&attempt.record, attempt.fence, &attempt.at, &to).await?;
        for item in work {
            phase.record_point(&attempt.record, item.point()).await?;
            match item {
                Work::Outcome(ext) => {
                    let applied = outcome.as_ref().ok_or_else(|| EngineError::Fault("outcome missing".into()))?;
                    let result = serde_json::to_value(applied).map_err(|e| EngineError::Fault(e.to_string()))?;
                    external::record_outcome(phase.conn(), &attempt.record, ext.name, &result, attempt.fence).await?;
                }
                Work::Local(point) => {
                    let mut cx = StepContext { conn: phase.conn(), request: &attempt.record, fence: attempt.fence };
                    if let Some(answer) = op.local(point, &mut cx).await? {
                        phase.store_answer(&attempt.record, &answer).await?;
                    }
                }
                Work::Intent(ext) => {
                    let key = derived_key(&attempt.record.key, ext.name);
                    external::record_intent(phase.conn(), &attempt.record, ext.name, key, attempt.fence).await?;
                }
            }
        }
        failpoint::boundary(|| format!("before-commit:{to}"));
        attempt.commit_attempted = true;
        attempt.at = phase.commit().await?;
        failpoint::boundary(|| format!("after-commit:{to}"));
        Ok(())
    }

    /// Sends external step `ext` (its intent is committed).
    async fn call<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
        ext: &ExternalStep,
    ) -> Result<Settled, EngineError> {
        attempt.keep_alive(&self.keys, self.settings.lease).await?;
        let key = wire_key(attempt, ext);
        match self.rails.get(ext.rail).send(&key, &op.instruction(ext)).await {
            CallOutcome::Applied(applied) => {
                failpoint::boundary(|| format!("after-call:{}", ext.name));
                Ok(Settled::Applied(applied))
            }
            CallOutcome::NotApplied(why) => {
                Err(EngineError::Transient(format!("{} refused the instruction: {why}", ext.name)))
            }
            CallOutcome::Unknown(why) => self.park(attempt, ext, &why).await,
        }
    }

    /// Finds out what became of an intent committed by an earlier attempt:
    /// probe first, and send again (same key) only if it never arrived.
    async fn settle<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
        ext: &ExternalStep,
    ) -> Result<Settled, EngineError> {
        attempt.keep_alive(&self.keys, self.settings.lease).await?;
        let key = wire_key(attempt, ext);
        match self.rails.get(ext.rail).probe(&key).await {
            ProbeOutcome::Found(applied) => Ok(Settled::Applied(applied)),
            ProbeOutcome::NotFound => self.call(op, attempt, ext).await,
            ProbeOutcome::Unknown(why) => self.park(attempt, ext, &why).await,
        }
    }

    /// Records an unknown outcome and hands the key back for a later
    /// resume. The request stays at `sent`: never reported as failed.
    async fn park(&self, attempt: &mut Attempt, ext: &ExternalStep, why: &str) -> Result<Settled, EngineError> {
        tracing::warn!(key = %attempt.record.key, step = ext.name, why, "external outcome unknown; parking the request");
        let mut phase = self.ledger.begin_phase(&attempt.record, attempt.fence, &attempt.at, &attempt.at).await?;
        let attempts = external::record_unknown_attempt(phase.conn(), &attempt.record, ext.name, attempt.fence).await?;
        if attempts >= self.settings.max_unknown_attempts {
            tracing::warn!(key = %attempt.record.key, step = ext.name, attempts, "outcome indeterminate; listed for settlement");
            external::mark_indeterminate(phase.conn(), &attempt.record, ext.name, attempt.fence).await?;
        }
        phase.commit().await?;
        self.hand_back(attempt).await;
        Ok(Settled::Parked(Answer::Pending { payment_id: attempt.record.payment_id }))
    }

    /// Copies the ledger's final answer into the key store.
    async fn publish(&self, attempt: &Attempt) -> Result<Answer, EngineError> {
        let response = self.ledger.answer(&attempt.record).await?.ok_or_else(|| {
            EngineError::Fault(format!("{} is finished but has no stored answer", attempt.record.key))
        })?;
        let finish = Finish { response: response.clone(), expires_at: Millis::now().plus(self.settings.retention) };
        match self.keys.finish(&attempt.record.key, attempt.fence, &finish).await {
            // Fenced out after our ledger commit: the new owner publishes the
            // same stored answer, so this one is already the final answer.
            Ok(_) | Err(KeyStoreError::FencedOut(_)) => Ok(Answer::Final { response, replayed: false }),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives the key back after a failure: forgotten if no commit was ever
    /// attempted (a commit whose answer was lost may have landed), else
    /// reopened so the next actor resumes at once.
    async fn hand_back(&self, attempt: &Attempt) {
        let untouched = attempt.at == RecoveryPoint::STARTED && !attempt.commit_attempted;
        let how = if untouched { Release::Forget } else { Release::Reopen };
        if let Err(e) = self.keys.release(&attempt.record.key, attempt.fence, how).await {
            tracing::warn!(key = %attempt.record.key, error = %e, "could not hand the key back; its lease will expire");
        }
    }
}
