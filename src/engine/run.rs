//! The resume loop. From the request's recovery point it runs one ledger
//! transaction per stretch of work: the outcome of the external call just
//! made, the local phases that follow, and the intent of the next call (or
//! the final answer), so an operation with two external calls takes three
//! transactions while every recovery point is still recorded. Between
//! transactions it calls the external system with the step's derived key.
//!
//! Only an attempt that made the claim itself sends without asking: any
//! other (a takeover, a rebuild, an adoption after the ledger lost commits)
//! probes by derived key first and re-sends with the same key only if the
//! external system never saw it, since the system may have forgotten the
//! key's deduplication by then. An unknown outcome parks the request (202);
//! "not applied" hands the key back (503). Neither is a final answer. A
//! decline is: the next transaction records it and runs the operation's
//! `declined` phase straight to `FINISHED`.

use std::time::Duration;

use crate::domain::{RecoveryPoint, StoredResponse};
use crate::failpoint;
use crate::keystore::{Concluded, Conclusion, Finish, HeldBy, Holding, KeyState, KeyStore, KeyStoreError, Release};
use crate::ledger::external::{self, CallWrites, Intent, Sent};
use crate::rail::{CallOutcome, ProbeOutcome, Verdict};

use super::error::{Cause, Fenced};
use super::lease::Attempt;
use super::{Answer, Engine, EngineError, ExternalStep, Operation, Step, StepContext, derived_key};

/// Where a decline takes the request.
static FINISHED: RecoveryPoint = RecoveryPoint::FINISHED;

/// One piece of work inside a transaction.
enum Work<'s> {
    Outcome(&'s ExternalStep),
    Local(&'s RecoveryPoint),
    Intent(&'s ExternalStep),
    /// The step declined: the operation winds the request up.
    Declined(&'s ExternalStep),
}

impl Work<'_> {
    fn point(&self) -> &RecoveryPoint {
        match self {
            Work::Outcome(step) => &step.done,
            Work::Local(point) => point,
            Work::Intent(step) => &step.sent,
            Work::Declined(_) => &FINISHED,
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

/// The work of the next transaction, starting at step `from`, after the
/// outcome (if any) of the step awaited: a decline ends the request there.
fn stretch<'s>(steps: &'s [Step], awaited: Option<(&'s ExternalStep, &Verdict)>, from: usize) -> Vec<Work<'s>> {
    let mut work: Vec<Work<'_>> = Vec::new();
    if let Some((ext, verdict)) = awaited {
        work.push(Work::Outcome(ext));
        if let Verdict::Declined(_) = verdict {
            work.push(Work::Declined(ext));
            return work;
        }
    }
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
    derived_key(&attempt.record.key, attempt.record.payment_id, ext.name).simple().to_string()
}

/// The instruction of `ext`, naming the client it is made for.
fn instruction<O: Operation>(op: &O, attempt: &Attempt, ext: &ExternalStep) -> crate::rail::Instruction {
    crate::rail::Instruction { originator: attempt.record.key.client.to_string(), ..op.instruction(ext) }
}

/// How an external step settled.
enum Settled {
    Verdict(Verdict),
    Parked(Answer),
}

impl<K: KeyStore> Engine<K> {
    /// Drives the request to an answer. On a transient failure or a fault
    /// the key is handed back so the next retry (or the recovery worker)
    /// can resume at once; when fenced out, nothing more is touched.
    pub(super) async fn drive<O: Operation>(&self, op: &O, attempt: &mut Attempt) -> Result<Answer, EngineError> {
        let result = self.drive_to_answer(op, attempt).await;
        if let Err(e) = &result {
            self.stopped(attempt, e).await;
        }
        result
    }

    /// Takes the operation's hold, before its first phase; `Some` answer
    /// if the balance is too small. Nothing was held, committed or stored
    /// then, so the request is given up: this attempt's own claim is
    /// forgotten; a request taken over (its first owner died before its hold
    /// was taken) is voided in the ledger under this attempt's fence and its
    /// key deleted, so nobody resumes it later behind the client's back.
    async fn take_hold<O: Operation>(&self, op: &O, attempt: &mut Attempt) -> Result<Option<Answer>, EngineError> {
        let Some(hold) = op.hold() else { return Ok(None) };
        let by = HeldBy {
            id: attempt.record.payment_id,
            key: attempt.record.key.clone(),
            created_at: attempt.record.created_at,
            region: self.settings.region.clone(),
        };
        failpoint::boundary(|| "before-hold".to_owned());
        // Like a commit: once sent, the hold may have been taken, whatever the answer.
        attempt.hold_sent = true;
        let mut holding = self.keys.hold(&hold, &by, self.settings.clock.now()).await?;
        // What is left may be held for requests that are gone: given back, it may be enough.
        if let Holding::Exceeded { .. } = holding
            && self.release_orphans(&hold.balance).await? > 0
        {
            holding = self.keys.hold(&hold, &by, self.settings.clock.now()).await?;
        }
        let Holding::Exceeded { left } = holding else {
            failpoint::boundary(|| "after-hold".to_owned());
            return Ok(None);
        };
        metrics::counter!("keyfence_holds_exceeded_total").increment(1);
        // The balance, read consistently, holds nothing for this request.
        attempt.hold_sent = false;
        // Only a request that is gone is answered "does not fit": one that
        // could not be given up (another owner moved it on, a store failed)
        // may still be worked, so its answer is not known yet.
        if attempt.forgettable() {
            self.keys.release(&attempt.record.key, &attempt.holder, Release::Forget).await?;
        } else {
            self.ledger.void(&attempt.record, attempt.holder.fence, &RecoveryPoint::STARTED).await?;
            self.abandon(attempt).await?;
        }
        Ok(Some(Answer::Exceeded { left }))
    }

    /// Deletes the key of a request given up (its ledger row voided under
    /// this attempt's fence: by this attempt, or by an earlier owner that
    /// could not delete the key itself, found voided when taken over).
    async fn abandon(&self, attempt: &Attempt) -> Result<(), EngineError> {
        self.keys.release(&attempt.record.key, &attempt.holder, Release::Abandon).await?;
        tracing::info!(key = %attempt.record.key, "gave up a request whose hold does not fit its balance");
        Ok(())
    }

    /// Settles or releases the operation's hold as the final answer says.
    async fn conclude_hold<O: Operation>(
        &self,
        op: &O,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<(), EngineError> {
        let Some(hold) = op.hold() else { return Ok(()) };
        let how = if (200..300).contains(&response.status) { Conclusion::Settle } else { Conclusion::Release };
        let id = attempt.record.payment_id;
        if self.keys.conclude_hold(&hold.balance, id, how).await? == Concluded::Missing {
            tracing::warn!(key = %attempt.record.key, balance = hold.balance, "a finished request has no hold on its balance");
        }
        Ok(())
    }

    /// An attempt that stopped short of an answer: after a failure it hands
    /// the key back; fenced out, it touches nothing and is counted.
    pub(super) async fn stopped(&self, attempt: &Attempt, e: &EngineError) {
        match e {
            _ if e.hands_back() => self.hand_back(attempt).await,
            EngineError::FencedOut(by) if *by != Fenced::Race => {
                metrics::counter!("keyfence_fenced_out_total", "store" => by.as_str()).increment(1);
            }
            _ => {}
        }
    }

    pub(super) async fn drive_to_answer<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
    ) -> Result<Answer, EngineError> {
        let steps = op.steps();
        // Given up by an earlier owner, which voided it here but could not
        // delete its key: finish giving it up.
        if attempt.at == RecoveryPoint::VOIDED
            && let Some(hold) = op.hold()
        {
            self.abandon(attempt).await?;
            let left = self.keys.balance(&hold.balance).await?.map_or(hold.total, |b| b.left());
            return Ok(Answer::Exceeded { left });
        }
        // A rebuild works a request the key says is finished: its owner took
        // the hold and concluded it.
        if attempt.at == RecoveryPoint::STARTED
            && attempt.known_answer.is_none()
            && let Some(refused) = self.take_hold(op, attempt).await?
        {
            return Ok(refused);
        }
        let mut outcome: Option<Verdict> = None;
        loop {
            if attempt.at == RecoveryPoint::FINISHED {
                return self.publish(op, attempt).await;
            }
            let (awaiting, from) = match position(steps, &attempt.at)? {
                Position::Before(i) => (None, i),
                Position::Awaiting(i, ext) => {
                    if outcome.is_none() {
                        match self.settle(op, attempt, ext).await? {
                            Settled::Verdict(verdict) => outcome = Some(verdict),
                            Settled::Parked(answer) => return Ok(answer),
                        }
                    }
                    (Some(ext), i + 1)
                }
            };
            let verdict = outcome.take();
            let work = stretch(steps, awaiting.zip(verdict.as_ref()), from);
            self.commit(op, attempt, &work, verdict.as_ref()).await?;
            if let Some(Work::Intent(ext)) = work.last() {
                let settled = if attempt.fresh {
                    self.call(op, attempt, ext).await?
                } else {
                    self.settle(op, attempt, ext).await?
                };
                match settled {
                    Settled::Verdict(verdict) => outcome = Some(verdict),
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
        outcome: Option<&Verdict>,
    ) -> Result<(), EngineError> {
        let Some(last) = work.last() else {
            return Err(EngineError::Fault("an operation must end with its FINISHED step".into()));
        };
        let to = last.point().clone();
        self.check_region().await?;
        attempt.keep_alive(&self.keys, self.settings.clock.now(), self.settings.lease).await?;
        // A stall here is the classic zombie: the lease looked fresh a moment
        // ago, and the fence check below is what stops the write.
        failpoint::boundary(|| format!("before-phase:{to}"));
        let fence = attempt.holder.fence;
        let points: Vec<&RecoveryPoint> = work.iter().map(Work::point).collect();
        let missing = || EngineError::Fault("outcome missing".into());
        // The external calls' writes ride the statement that checks the fence
        // (a stretch of work awaits one step at most and sends one at most:
        // a second would go unrecorded, so it is refused, never overwritten).
        let twice = |what: &str| EngineError::Fault(format!("a phase carries one {what} at most"));
        let mut calls = CallWrites::default();
        let instruction = work.iter().find_map(|item| match item {
            Work::Intent(ext) => Some(op.instruction(ext)),
            _ => None,
        });
        for item in work {
            match item {
                Work::Outcome(ext) => {
                    let verdict = (ext.name, outcome.ok_or_else(missing)?);
                    if calls.verdict.replace(verdict).is_some() {
                        return Err(twice("verdict"));
                    }
                }
                Work::Intent(ext) => {
                    let sent = instruction.as_ref().ok_or_else(missing)?;
                    let intent = Intent {
                        step: ext.name,
                        derived_key: derived_key(&attempt.record.key, attempt.record.payment_id, ext.name),
                        sent: Sent {
                            end_to_end_id: &sent.end_to_end_id,
                            amount_minor: sent.amount_minor,
                            currency: &sent.currency,
                        },
                    };
                    if calls.intent.replace(intent).is_some() {
                        return Err(twice("intent"));
                    }
                }
                Work::Local(_) | Work::Declined(_) => {}
            }
        }
        let mut phase = self.ledger.begin_phase_held(&attempt.record, fence, &attempt.at, &to, &points, calls).await?;
        let mut stored = None;
        for item in work {
            let mut cx = StepContext { phase: &mut phase, request: &attempt.record, fence, settled: calls.verdict };
            let answer = match item {
                Work::Outcome(_) | Work::Intent(_) => None,
                Work::Local(point) => op.local(point, &mut cx).await?,
                Work::Declined(ext) => {
                    let Some(Verdict::Declined(declined)) = outcome else { return Err(missing()) };
                    let answer = op.declined(ext, declined, &mut cx).await?;
                    metrics::counter!("keyfence_declines_total", "step" => ext.name).increment(1);
                    Some(answer)
                }
            };
            if let Some(answer) = answer {
                let answer = self.answer_to_store(attempt.known_answer.as_ref(), &answer)?;
                phase.store_answer(&attempt.record, answer);
                stored = Some(answer.clone());
            }
        }
        // Everything but the commit: if any of it fails, no commit was ever
        // sent, and the request may still be forgotten.
        phase.send().await?;
        failpoint::boundary(|| format!("before-commit:{to}"));
        attempt.commit_attempted = true;
        attempt.at = phase.commit().await?;
        attempt.committed_answer = stored;
        failpoint::boundary(|| format!("after-commit:{to}"));
        Ok(())
    }

    /// The final answer a phase stores: one already known (stored before)
    /// as it is, else `fresh` if it fits the stored-answer limit. One that
    /// does not is the operation's bug: the phase that would store it rolls
    /// back, so the request stays where it was and nothing oversized is
    /// ever kept.
    fn answer_to_store<'a>(
        &self,
        known: Option<&'a StoredResponse>,
        fresh: &'a StoredResponse,
    ) -> Result<&'a StoredResponse, EngineError> {
        if let Some(known) = known {
            return Ok(known);
        }
        let (size, limit) = (fresh.size(), self.settings.answer_limit);
        if size > limit {
            return Err(EngineError::Fault(format!(
                "a final answer of {size} bytes is over the stored-answer limit of {limit} (KEYFENCE_ANSWER_LIMIT)"
            )));
        }
        Ok(fresh)
    }

    /// Sends external step `ext` (its intent is committed).
    async fn call<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
        ext: &ExternalStep,
    ) -> Result<Settled, EngineError> {
        attempt.keep_alive(&self.keys, self.settings.clock.now(), self.settings.lease).await?;
        let key = wire_key(attempt, ext);
        match self.rails.get(ext.rail)?.send(&key, &instruction(op, attempt, ext)).await {
            CallOutcome::Settled(verdict) => {
                failpoint::boundary(|| format!("after-call:{}", ext.name));
                Ok(Settled::Verdict(verdict))
            }
            CallOutcome::NotApplied(why) => {
                Err(EngineError::Transient(Cause::Rail(format!("{} refused the instruction: {why}", ext.name))))
            }
            CallOutcome::Unknown(why) => self.park(op, attempt, ext, &why).await,
        }
    }

    /// Finds out what became of an intent an earlier attempt may have sent:
    /// probe first, and send (same key) only if it never arrived.
    async fn settle<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
        ext: &ExternalStep,
    ) -> Result<Settled, EngineError> {
        attempt.keep_alive(&self.keys, self.settings.clock.now(), self.settings.lease).await?;
        let key = wire_key(attempt, ext);
        let sent = instruction(op, attempt, ext);
        if let Some(verdict) = self.notified(attempt, ext, &key, &sent).await? {
            return Ok(Settled::Verdict(verdict));
        }
        match self.rails.get(ext.rail)?.probe(&key, &sent).await {
            ProbeOutcome::Found(verdict) => Ok(Settled::Verdict(verdict)),
            ProbeOutcome::NotFound => self.call(op, attempt, ext).await,
            ProbeOutcome::Unknown(why) => self.park(op, attempt, ext, &why).await,
        }
    }

    /// The verdict a rail's notification brought for `ext` (the inbox),
    /// if one waits and it answers what was sent: taken as a probe's
    /// answer would be, and marked applied by the phase that records it.
    async fn notified(
        &self,
        attempt: &Attempt,
        ext: &ExternalStep,
        key: &str,
        sent: &crate::rail::Instruction,
    ) -> Result<Option<Verdict>, EngineError> {
        let derived = derived_key(&attempt.record.key, attempt.record.payment_id, ext.name);
        let Some((kind, body)) = self.ledger.notified_verdict(derived).await? else { return Ok(None) };
        let verdict = match kind.as_str() {
            "applied" => serde_json::from_value(body).map(Verdict::Applied),
            _ => serde_json::from_value(body).map(Verdict::Declined),
        };
        match verdict {
            Ok(verdict) if crate::rail::answers(&verdict, key, sent) => {
                metrics::counter!("keyfence_notified_verdicts_total", "step" => ext.name).increment(1);
                Ok(Some(verdict))
            }
            _ => {
                tracing::warn!(
                    key,
                    step = ext.name,
                    "a notified verdict does not answer the instruction sent; probing"
                );
                Ok(None)
            }
        }
    }

    /// Records an unknown outcome and hands the key back for a later
    /// resume. The request stays at `sent`: never reported as failed.
    async fn park<O: Operation>(
        &self,
        op: &O,
        attempt: &mut Attempt,
        ext: &ExternalStep,
        why: &str,
    ) -> Result<Settled, EngineError> {
        tracing::warn!(key = %attempt.record.key, step = ext.name, why, "external outcome unknown; parking the request");
        self.check_region().await?;
        let fence = attempt.holder.fence;
        let mut phase = self.ledger.begin_phase(&attempt.record, fence, &attempt.at, &attempt.at, &[]).await?;
        let attempts = external::record_unknown_attempt(
            phase.conn().await?,
            &attempt.record,
            ext.name,
            fence,
            self.settings.probe_backoff,
        )
        .await?;
        metrics::counter!("keyfence_unknown_outcomes_total", "step" => ext.name).increment(1);
        if attempts >= self.settings.max_unknown_attempts {
            metrics::counter!("keyfence_indeterminate_total", "step" => ext.name).increment(1);
            tracing::warn!(key = %attempt.record.key, step = ext.name, attempts, "outcome indeterminate; listed for settlement");
            external::mark_indeterminate(phase.conn().await?, &attempt.record, ext.name, fence).await?;
            let mut cx = StepContext { phase: &mut phase, request: &attempt.record, fence, settled: None };
            op.indeterminate(ext, &mut cx).await?;
        }
        phase.commit().await?;
        self.hand_back(attempt).await;
        Ok(Settled::Parked(Answer::Pending { payment_id: attempt.record.payment_id }))
    }

    /// Copies the ledger's final answer into the key store. Only what the
    /// key store holds is ever answered: refused, this attempt answers with
    /// the key's stored answer if it is finished (someone else's, perhaps
    /// rebuilt elsewhere, and the one every retry gets), else "in flight".
    async fn publish<O: Operation>(&self, op: &O, attempt: &Attempt) -> Result<Answer, EngineError> {
        let response = match &attempt.committed_answer {
            Some(answer) => answer.clone(),
            None => self.ledger.answer(&attempt.record).await?.ok_or_else(|| {
                EngineError::Fault(format!("{} is finished but has no stored answer", attempt.record.key))
            })?,
        };
        // Before the key is finished: a finished key's hold is concluded.
        self.conclude_hold(op, attempt, &response).await?;
        let finish = Finish {
            response: response.clone(),
            expires_at: self.settings.retention.expires_at(self.settings.clock.now()),
        };
        let record = &attempt.record;
        match self.keys.finish(&record.key, &attempt.holder, &finish).await {
            Ok(_) => {
                self.answers.remember(&record.key, &record.request_hash, &response, Some(finish.expires_at.as_secs()));
                Ok(Answer::Final { response, replayed: false })
            }
            Err(KeyStoreError::FencedOut(Some(item))) if item.state == KeyState::Finished => {
                let response = item
                    .response
                    .ok_or_else(|| EngineError::Fault(format!("{} is finished without an answer", record.key)))?;
                self.answers.remember(&item.key, &item.request_hash, &response, item.expires_at);
                Ok(Answer::Final { response, replayed: true })
            }
            Err(KeyStoreError::FencedOut(_)) => Ok(Answer::InFlight { retry_after: Duration::from_secs(1) }),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives the key back after a failure: forgotten if this attempt made
    /// the claim and no commit was ever attempted (a commit whose answer was
    /// lost may have landed), else reopened so the next actor resumes at once.
    pub(super) async fn hand_back(&self, attempt: &Attempt) {
        let untouched = attempt.forgettable();
        let how = if untouched { Release::Forget } else { Release::Reopen };
        let label = if untouched { "forget" } else { "reopen" };
        metrics::counter!("keyfence_hand_backs_total", "how" => label).increment(1);
        if let Err(e) = self.keys.release(&attempt.record.key, &attempt.holder, how).await {
            tracing::warn!(key = %attempt.record.key, error = %e, "could not hand the key back; its lease will expire");
        }
    }
}
