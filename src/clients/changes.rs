//! The directory's change log: one item, `control#clients#changes`, whose
//! `version` every change of a client record moves on by one and whose
//! `recent` names the clients of the last [`RECENT`] changes (client id →
//! the version its change made). An instance reads it once a second: when
//! the version has not moved, nothing has changed; when it has, `recent`
//! says which records to read again, without a scan of the table or the
//! index (whose view of a client created a moment ago may lag).
//!
//! The log is written after the record, by whoever changed it (the
//! operators' CLI): a change whose log write failed is seen at an
//! instance's next full read of the directory (every minute) instead.

use std::collections::HashMap;

use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use backon::{ExponentialBuilder, Retryable};

use super::store::{Attrs, ClientStore, n, number, s, store};
use super::{ClientId, ClientsError};

/// The change log's item.
pub(super) const CHANGES: &str = "control#clients#changes";

/// Changes the log names, at most.
const RECENT: u64 = 64;

/// Tries at a log write (others' writes may overtake it, the table may
/// refuse it for a moment), with growing pauses between them.
const ATTEMPTS: usize = 12;

/// The change log as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Changes {
    pub(super) version: u64,
    recent: HashMap<ClientId, u64>,
}

impl Changes {
    /// The clients changed since version `since`, if the log still names
    /// every one of them.
    pub(super) fn since(&self, since: u64) -> Option<Vec<ClientId>> {
        (self.version.saturating_sub(since) <= RECENT)
            .then(|| self.recent.iter().filter(|(_, at)| **at > since).map(|(id, _)| *id).collect())
    }

    /// Every client the log names.
    pub(super) fn named(&self) -> Vec<ClientId> {
        self.recent.keys().copied().collect()
    }

    /// The log once `id` has changed again.
    fn with(&self, id: ClientId) -> Self {
        let version = self.version + 1;
        let mut recent: HashMap<ClientId, u64> =
            self.recent.iter().filter(|(_, at)| **at + RECENT > version).map(|(id, at)| (*id, *at)).collect();
        recent.insert(id, version);
        Self { version, recent }
    }

    /// The log as stored; an entry of `recent` that does not read is left
    /// out (its client is seen at the next whole read), so one bad entry
    /// stops no instance from following the log.
    fn decode(item: &Attrs) -> Result<Self, ClientsError> {
        let recent = match item.get("recent") {
            Some(AttributeValue::M(recent)) => recent
                .iter()
                .filter_map(|(id, at)| match at {
                    AttributeValue::N(at) => Some((id.parse().ok()?, at.parse().ok()?)),
                    _ => None,
                })
                .collect(),
            _ => HashMap::new(),
        };
        Ok(Self { version: number(item, "version")?.unwrap_or(0), recent })
    }

    fn encode(&self) -> Attrs {
        HashMap::from([
            ("pk".to_owned(), s(CHANGES)),
            ("kind".to_owned(), s("client_changes")),
            ("version".to_owned(), n(self.version)),
            (
                "recent".to_owned(),
                AttributeValue::M(self.recent.iter().map(|(id, at)| (id.to_string(), n(*at))).collect()),
            ),
        ])
    }
}

impl ClientStore {
    /// The change log as it is now (a strongly consistent read).
    pub(super) async fn changes(&self) -> Result<Changes, ClientsError> {
        let out = self
            .client()
            .get_item()
            .table_name(self.table())
            .key("pk", s(CHANGES))
            .consistent_read(true)
            .send()
            .await
            .map_err(store)?;
        out.item().map(Changes::decode).transpose().map(Option::unwrap_or_default)
    }

    /// Logs that client `id`'s record changed (after the change, which
    /// stands whatever becomes of the log: a change not logged is seen at
    /// every instance's next whole read of the directory, and said so).
    pub(super) async fn changed(&self, id: ClientId) {
        let pauses = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(20))
            .with_jitter()
            .with_max_times(ATTEMPTS);
        let logged = (|| self.log(id)).retry(pauses).await;
        if let Err(e) = logged {
            tracing::warn!(
                client = %id,
                error = %e,
                "the change is made, but could not be logged: every instance sees it within a minute, at its next \
                 whole read of the directory"
            );
        }
    }

    /// One try at logging a change of client `id`.
    async fn log(&self, id: ClientId) -> Result<(), ClientsError> {
        let read = self.changes().await?;
        let condition = "attribute_not_exists(pk) OR version = :read";
        let values = HashMap::from([(":read".to_owned(), n(read.version))]);
        self.put_when(id, read.with(id).encode(), condition, Some(values)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_names_the_last_changes_and_says_when_it_no_longer_can() {
        let (a, b) = (ClientId::generate(), ClientId::generate());
        let mut log = Changes::default().with(a).with(b).with(a);
        assert_eq!(log.version, 3);
        assert_eq!(log.since(2), Some(vec![a]), "a changed again since");
        let mut both = log.since(0).unwrap();
        both.sort();
        let mut expected = vec![a, b];
        expected.sort();
        assert_eq!(both, expected);
        for _ in 0..RECENT {
            log = log.with(ClientId::generate());
        }
        assert_eq!(log.recent.len() as u64, RECENT, "only the last changes are named");
        assert_eq!(log.since(0), None, "a reader this far behind reads everything");
        assert_eq!(log.since(log.version - RECENT).map(|ids| ids.len() as u64), Some(RECENT));
        assert_eq!(Changes::decode(&log.encode()).unwrap(), log);
    }
}
