//! The reconciler's report: every finding with its evidence and what the
//! repair did, counts per class, and the external calls left indeterminate
//! for settlement. As a table for people or JSON for machines; `unrepaired`
//! is what the exit status reflects.

use std::collections::BTreeMap;

use serde::Serialize;
use uuid::Uuid;

use super::Class;
use crate::domain::ScopedKey;
use crate::ledger::external::Indeterminate;
use crate::ledger::inbox::Unmatched;

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub class: Class,
    pub client_id: String,
    pub key: String,
    pub payment_id: Uuid,
    /// What each store said.
    pub evidence: String,
    /// For `worked_twice`: the copy clients are answered for the key, which
    /// is the one to keep; the other copy is this ledger's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answered: Option<Answered>,
    /// Present when repairs were asked for.
    pub repair: Option<Repair>,
}

/// A payment a return froze (no refund of it begins) whose return has not
/// taken effect: it overlaps refunds, or reached a region the payment left.
/// A person settles the return with the rail; it is listed until it takes
/// effect.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct FrozenPayment {
    pub payment_id: Uuid,
    /// What froze it: the return's message id and rail.
    pub by: String,
    #[serde(with = "time::serde::rfc3339")]
    pub frozen_at: time::OffsetDateTime,
    /// Refunded (settled) and still held for refunds in flight.
    pub refunded: i64,
    pub held: i64,
}

/// What a repair did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Repair {
    /// True once the stores agree again (by this repair or by another actor).
    pub resolved: bool,
    pub action: String,
}

/// The copy of a request whose answer clients hold.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Answered {
    pub payment_id: Uuid,
    /// The region whose ledger holds it.
    pub region: String,
}

impl Finding {
    pub fn new(class: Class, key: &ScopedKey, payment_id: Uuid, evidence: String) -> Self {
        Self {
            class,
            client_id: key.client.to_string(),
            key: key.key.as_str().to_owned(),
            payment_id,
            evidence,
            answered: None,
            repair: None,
        }
    }

    fn resolved(&self) -> bool {
        self.repair.as_ref().is_some_and(|r| r.resolved)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub region: String,
    pub repair: bool,
    pub keys_scanned: usize,
    pub ledger_rows_scanned: usize,
    /// Ledger requests finished longer ago than the retention whose key is
    /// gone, as it is meant to be: no divergence.
    pub expired: usize,
    /// Hand-offs of requests that left this region, read first.
    pub handoffs: usize,
    /// Hand-offs removed: their leftover here was voided (or never existed).
    pub handoffs_cleared: usize,
    pub findings: Vec<Finding>,
    pub indeterminate: Vec<Indeterminate>,
    /// Rail notifications kept for a person (naming no instruction of this
    /// ledger, or unable to take effect here: a return overlapping refunds,
    /// or of a payment that moved), all of them: for a person to settle
    /// with the rail (keyfence may have lost the payment).
    pub unmatched_notifications: Vec<Unmatched>,
    /// Rail notifications waiting to be handed to the region holding their
    /// live copy whose last offer could not reach some region.
    pub notifications_to_hand_on: i64,
    /// Payments a return froze whose return has not taken effect (in the
    /// key table, so every region's run lists them).
    pub frozen_payments: Vec<FrozenPayment>,
    pub seconds: f64,
    /// Time spent waiting on key-table scan pages, summed over segments.
    pub key_store_seconds: f64,
    /// Time spent in ledger queries during the comparison, summed over segments.
    pub ledger_seconds: f64,
}

/// Found and repaired, for one class.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Count {
    pub found: usize,
    pub repaired: usize,
}

impl Report {
    /// Findings still standing: all of them in a report-only run.
    pub fn unrepaired(&self) -> usize {
        self.findings.iter().filter(|f| !f.resolved()).count()
    }

    pub fn counts(&self) -> BTreeMap<&'static str, Count> {
        let mut counts: BTreeMap<&'static str, Count> =
            Class::ALL.iter().map(|c| (c.as_str(), Count::default())).collect();
        for finding in &self.findings {
            let count = counts.entry(finding.class.as_str()).or_default();
            count.found += 1;
            count.repaired += usize::from(finding.resolved());
        }
        counts
    }

    /// The run's figures in the Prometheus text format, for a textfile
    /// collector (node_exporter's): what each class left unrepaired, and
    /// when the run ended (`at`), so an alert can tell a stale file too.
    pub fn prometheus(&self, at: crate::domain::Millis) -> String {
        let mut out = String::from(
            "# HELP keyfence_reconcile_unrepaired Divergences the last reconcile run left standing, by class\n\
             # TYPE keyfence_reconcile_unrepaired gauge\n",
        );
        for (class, count) in self.counts() {
            out += &format!("keyfence_reconcile_unrepaired{{class=\"{class}\"}} {}\n", count.found - count.repaired);
        }
        out += "# HELP keyfence_reconcile_notifications_for_a_person Rail notifications the last reconcile run found \
                kept for a person (naming no instruction of this ledger, or unable to take effect here)\n\
                # TYPE keyfence_reconcile_notifications_for_a_person gauge\n";
        out += &format!("keyfence_reconcile_notifications_for_a_person {}\n", self.unmatched_notifications.len());
        out += "# HELP keyfence_reconcile_notifications_to_hand_on Rail notifications the last reconcile run found \
                waiting to be handed to the region holding their live copy, some region not asked\n\
                # TYPE keyfence_reconcile_notifications_to_hand_on gauge\n";
        out += &format!("keyfence_reconcile_notifications_to_hand_on {}\n", self.notifications_to_hand_on);
        out += "# HELP keyfence_reconcile_last_run_timestamp_seconds When the last reconcile run ended (Unix time)\n\
                # TYPE keyfence_reconcile_last_run_timestamp_seconds gauge\n";
        out += &format!("keyfence_reconcile_last_run_timestamp_seconds {:.3}\n", at.get() as f64 / 1000.0);
        out
    }

    /// The report as JSON, with the counts.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "region": self.region,
            "mode": if self.repair { "repair" } else { "report" },
            "keys_scanned": self.keys_scanned,
            "ledger_rows_scanned": self.ledger_rows_scanned,
            "expired": self.expired,
            "handoffs": self.handoffs,
            "handoffs_cleared": self.handoffs_cleared,
            "seconds": self.seconds,
            "key_store_seconds": self.key_store_seconds,
            "ledger_seconds": self.ledger_seconds,
            "counts": self.counts(),
            "unrepaired": self.unrepaired(),
            "findings": self.findings,
            "indeterminate": self.indeterminate,
            "unmatched_notifications": self.unmatched_notifications,
            "notifications_to_hand_on": self.notifications_to_hand_on,
            "frozen_payments": self.frozen_payments,
        })
    }

    /// The report for people: findings, then a summary table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for f in &self.findings {
            out += &format!("{:<17} client {} key {} payment {}\n", f.class.as_str(), f.client_id, f.key, f.payment_id);
            out += &format!("{:<17}   {}\n", "", f.evidence);
            if let Some(answered) = &f.answered {
                out += &format!(
                    "{:<17}   clients are answered payment {} in region {}: keep that one\n",
                    "", answered.payment_id, answered.region
                );
            }
            if let Some(repair) = &f.repair {
                let mark = if repair.resolved { "repaired" } else { "NOT repaired" };
                out += &format!("{:<17}   {mark}: {}\n", "", repair.action);
            }
        }
        out += &format!(
            "\nregion {}: {} keys and {} ledger requests compared in {:.1} s ({})\n",
            self.region,
            self.keys_scanned,
            self.ledger_rows_scanned,
            self.seconds,
            if self.repair { "repair" } else { "report only, nothing changed" }
        );
        out += &format!("{:<18} {:>7} {:>9}\n", "class", "found", "repaired");
        for (class, count) in self.counts() {
            out += &format!("{class:<18} {:>7} {:>9}\n", count.found, count.repaired);
        }
        out += &format!("expired (past retention, key gone as meant): {}\n", self.expired);
        out += &format!(
            "hand-offs of requests that left this region: {} ({} cleared)\n",
            self.handoffs, self.handoffs_cleared
        );
        out += &format!("unrepaired divergence: {}\n", self.unrepaired());
        if !self.indeterminate.is_empty() {
            out += &format!("indeterminate external calls, for settlement: {}\n", self.indeterminate.len());
            for i in &self.indeterminate {
                out += &format!(
                    "  client {} key {} payment {} step {} derived key {} ({} attempts)\n",
                    i.client_id, i.idem_key, i.payment_id, i.step, i.derived_key, i.attempts
                );
            }
        }
        if !self.unmatched_notifications.is_empty() {
            out += &format!(
                "rail notifications kept for a person (naming no instruction of this ledger, or unable to take \
                 effect here), for settlement: {}\n",
                self.unmatched_notifications.len()
            );
            for n in &self.unmatched_notifications {
                out += &format!(
                    "  rail {} message {} ({}) key {}: {}\n",
                    n.rail,
                    n.message_id,
                    n.kind,
                    n.idempotency_key.as_deref().unwrap_or("-"),
                    n.note.as_deref().unwrap_or("-")
                );
            }
        }
        if self.notifications_to_hand_on > 0 {
            out += &format!(
                "rail notifications waiting to be handed to the region holding their live copy (another region \
                 could not be asked yet): {}\n",
                self.notifications_to_hand_on
            );
        }
        if !self.frozen_payments.is_empty() {
            out += &format!(
                "payments frozen by a return that has not taken effect (no refund of them begins), for settlement: {}\n",
                self.frozen_payments.len()
            );
            for f in &self.frozen_payments {
                out += &format!(
                    "  payment {} frozen by {} at {}: {} refunded, {} held for refunds in flight\n",
                    f.payment_id, f.by, f.frozen_at, f.refunded, f.held
                );
            }
        }
        out
    }
}
