//! The delivery worker inside `serve`: drains this region's outbox after
//! the commit. Each round it fans new events out to the endpoints
//! subscribed to them, takes the deliveries that are due (as many as it has
//! free slots), sends each under its lease, and records where it stands:
//! delivered on a 2xx; on a 410 the endpoint is disabled; otherwise tried
//! again on the schedule until it is used up, then failed, and the endpoint
//! flagged (disabled after enough such failures in a row). Every instance
//! runs one; the leases keep them off each other's deliveries. A crash
//! loses nothing: an event is fanned out until that commits, and a
//! delivery is taken again once its lease runs out, with the same id.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::deliveries::{Deliveries, Outcome, Queued, Taken, Target};
use super::send::{Response, Sender};
use super::{DeliverySettings, Endpoint, EndpointStore, webhook_id};
use crate::domain::webhook_signature as signature;
use crate::domain::{ClientId, IdempotencyKey, Millis, ScopedKey};
use crate::engine::{Moved, moved_away};
use crate::failpoint;
use crate::keystore::DynamoKeyStore;
use crate::ledger::{LedgerError, millis};

/// Events fanned out in one round at most.
const FAN_OUT_BATCH: i64 = 256;

/// How often finished events past their retention are deleted, and how
/// many at most each time.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
const PRUNE_BATCH: i64 = 1000;

/// How long a client whose endpoints could not be read is left out of the
/// fan-out, so its events do not hold up everyone else's.
const UNREADABLE_FOR: Duration = Duration::from_secs(30);

/// When a delivery not sent (its endpoints unreadable) is taken again.
const NOT_SENT_WAIT: Duration = Duration::from_secs(5);

pub struct Worker {
    deliveries: Deliveries,
    endpoints: EndpointStore,
    /// The key store, to tell whether a payment moved to another region.
    keys: DynamoKeyStore,
    region: String,
    sender: Sender,
    settings: DeliverySettings,
    /// Deliveries in flight in this worker, by client.
    in_flight: Mutex<HashMap<Uuid, usize>>,
    /// Clients whose endpoints could not be read, and since when.
    unreadable: Mutex<HashMap<Uuid, Instant>>,
}

/// What a worker needs besides its settings.
pub struct Stores {
    pub deliveries: Deliveries,
    pub endpoints: EndpointStore,
    pub keys: DynamoKeyStore,
    /// This instance's region.
    pub region: String,
}

impl Worker {
    pub fn new(stores: Stores, settings: DeliverySettings, targets: super::TargetPolicy) -> Self {
        Self {
            deliveries: stores.deliveries,
            endpoints: stores.endpoints,
            keys: stores.keys,
            region: stores.region,
            sender: Sender::new(targets.allow_private, targets.names, settings.timeout),
            settings,
            in_flight: Mutex::default(),
            unreadable: Mutex::default(),
        }
    }

    /// How long a taken delivery is this worker's: the receiver's time
    /// twice over and a margin, so a send always ends inside its lease.
    fn lease(&self) -> Duration {
        self.settings.timeout * 2 + Duration::from_secs(5)
    }

    /// The deliveries of one client this worker sends at once at most: a
    /// quarter of its slots, so one client's slow receivers leave the rest
    /// to everyone else.
    fn per_client(&self) -> usize {
        (self.settings.concurrency as usize / 4).max(1)
    }

    /// Runs rounds every `interval` (and as soon as a slot frees up while
    /// more is due) until `stop`, then lets the deliveries in flight end.
    pub async fn run_until_stopped(self: Arc<Self>, interval: Duration, mut stop: watch::Receiver<()>) {
        let slots = Arc::new(Semaphore::new(self.settings.concurrency as usize));
        let mut sending = JoinSet::new();
        let (mut pruned, mut reported) = (None::<Instant>, None::<Instant>);
        loop {
            while sending.try_join_next().is_some() {}
            if let Err(e) = self.fan_out().await {
                tracing::warn!(error = %e, "could not fan webhook events out; trying again");
            }
            let free = slots.available_permits();
            let mut saturated = false;
            if free > 0 {
                let asked = Instant::now();
                match self.take(free).await {
                    Ok(batch) => {
                        saturated = batch.len() == free;
                        for (taken, endpoint) in batch {
                            let slot = slots.clone().acquire_owned().await.expect("the slots are never closed");
                            let worker = self.clone();
                            worker.count(taken.client_id, 1);
                            sending.spawn(async move {
                                let client = taken.client_id;
                                worker.deliver(taken, endpoint, asked).await;
                                worker.count(client, -1);
                                drop(slot);
                            });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "could not take webhook deliveries; trying again"),
                }
            }
            if reported.is_none_or(|at| at.elapsed() >= interval) {
                reported = Some(Instant::now());
                self.report_backlog().await;
            }
            if pruned.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
                pruned = Some(Instant::now());
                match self.deliveries.prune(self.settings.retention, PRUNE_BATCH).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(events = n, "pruned webhook events past their retention"),
                    Err(e) => tracing::warn!(error = %e, "could not prune webhook events"),
                }
            }
            tokio::select! {
                _ = stop.changed() => break,
                () = tokio::time::sleep(interval) => {}
                Some(_) = sending.join_next(), if saturated => {}
            }
        }
        while sending.join_next().await.is_some() {}
    }

    fn count(&self, client: Uuid, by: isize) {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let n = in_flight.entry(client).or_default();
        *n = n.saturating_add_signed(by);
        if *n == 0 {
            in_flight.remove(&client);
        }
    }

    /// Fans queued events out to the endpoints subscribed to them when
    /// they were written. A client whose endpoints cannot be read keeps its
    /// events queued (a payment's later events wait for its earlier ones),
    /// and is left out for a while so the others' events go on.
    async fn fan_out(&self) -> Result<(), LedgerError> {
        let skipping: Vec<Uuid> = {
            let mut unreadable = self.unreadable.lock().unwrap_or_else(|p| p.into_inner());
            unreadable.retain(|_, since| since.elapsed() < UNREADABLE_FOR);
            unreadable.keys().copied().collect()
        };
        let queued = self.deliveries.queued(FAN_OUT_BATCH, &skipping).await?;
        if queued.is_empty() {
            return Ok(());
        }
        let endpoints = self.endpoints_of(queued.iter().map(|q| ClientId::new(q.client_id))).await;
        let planned: Vec<(&Queued, Vec<Target>)> = queued
            .iter()
            .filter_map(|event| {
                let (_, found) = endpoints.iter().find(|(client, _)| client.as_uuid() == event.client_id)?;
                let written = millis(event.created_at).get();
                let targets = found
                    .as_ref()?
                    .iter()
                    .filter(|e| e.created_at <= written && e.events.contains(&event.event))
                    .map(|e| Target {
                        endpoint: e.id,
                        webhook_id: webhook_id(event.event_id, e.id),
                        failed: e.disabled.as_ref().map(|d| format!("the endpoint is disabled: {}", d.reason)),
                    })
                    .collect();
                Some((event, targets))
            })
            .collect();
        if planned.is_empty() { Ok(()) } else { self.deliveries.fan_out(&planned).await }
    }

    /// Takes up to `free` due deliveries, each with its endpoint as it
    /// stands now (`None` inside: removed; `None` outside: its client's
    /// endpoints could not be read).
    async fn take(&self, free: usize) -> Result<Vec<(Taken, Option<Option<Endpoint>>)>, LedgerError> {
        let per_client = self.per_client();
        let busy: Vec<Uuid> = {
            let in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            in_flight.iter().filter(|(_, n)| **n >= per_client).map(|(client, _)| *client).collect()
        };
        let taken = self.deliveries.take(free as i64, self.lease(), &busy, per_client as i64).await?;
        let endpoints = self.endpoints_of(taken.iter().map(Taken::client)).await;
        Ok(taken
            .into_iter()
            .map(|t| {
                let found = endpoints.iter().find(|(client, _)| *client == t.client()).and_then(|(_, f)| f.as_ref());
                let endpoint = found.map(|all| all.iter().find(|e| e.id == t.endpoint_id).cloned());
                (t, endpoint)
            })
            .collect())
    }

    /// Each client's endpoints, read once per round (`None`: unreadable,
    /// and noted as such).
    async fn endpoints_of(&self, clients: impl Iterator<Item = ClientId>) -> Vec<(ClientId, Option<Vec<Endpoint>>)> {
        let mut distinct: Vec<ClientId> = clients.collect();
        distinct.sort();
        distinct.dedup();
        join_all(distinct.into_iter().map(|client| async move {
            match self.endpoints.list(client).await {
                Ok(found) => (client, Some(found)),
                Err(e) => {
                    tracing::warn!(%client, error = %e, "could not read a client's webhook endpoints");
                    self.unreadable.lock().unwrap_or_else(|p| p.into_inner()).insert(client.as_uuid(), Instant::now());
                    (client, None)
                }
            }
        }))
        .await
    }

    /// Whether the payment of `taken` was taken over by another region
    /// since its event was written here: then that region's ledger holds
    /// the payment's events, and this one's are stale.
    /// An error if the key store could not say (the delivery waits).
    async fn moved_away(&self, taken: &Taken) -> Result<Option<Moved>, String> {
        if !taken.before_fence_change {
            return Ok(None);
        }
        let Ok(key) = IdempotencyKey::parse(&taken.idem_key) else { return Ok(None) };
        let (key, created_at) = (ScopedKey::new(taken.client(), key), millis(taken.request_created_at));
        moved_away(&self.keys, &self.region, &key, created_at)
            .await
            .map_err(|e| format!("the payment's key or hand-off could not be read: {e}"))
    }

    /// Whether a send begun now could outlast the lease of a delivery
    /// taken at `asked`: then another worker may take it meanwhile.
    fn too_late(&self, taken: &Taken, asked: Instant) -> bool {
        let late = asked.elapsed() + self.settings.timeout + Duration::from_secs(1) >= self.lease();
        if late {
            tracing::warn!(webhook_id = taken.webhook_id, "a webhook delivery waited past its lease; given back");
        }
        late
    }

    /// One attempt of one delivery taken at `asked` (or before), and what
    /// follows from its outcome. An attempt that could not end inside the
    /// lease any more (this worker was held up since, before it began or by
    /// the key store's answer) is not made: it is given back, due at once,
    /// for whichever worker takes it next (or, if the lease ran out
    /// meanwhile, left to the worker that took it since).
    async fn deliver(&self, taken: Taken, endpoint: Option<Option<Endpoint>>, asked: Instant) {
        let held_up = || {
            let error = "held up past its lease before the send; given back".to_owned();
            (Outcome::NotSent { error, wait: Duration::ZERO }, FollowUp::None)
        };
        let (outcome, follow_up) = match &endpoint {
            _ if self.too_late(&taken, asked) => held_up(),
            None => {
                let error = "the endpoint could not be read".to_owned();
                (Outcome::NotSent { error, wait: NOT_SENT_WAIT }, FollowUp::None)
            }
            Some(None) => (Outcome::Failed { status: None, error: "the endpoint was removed".into() }, FollowUp::None),
            Some(Some(e)) if e.disabled.is_some() => {
                let why = e.disabled.as_ref().map(|d| d.reason.as_str()).unwrap_or_default();
                (Outcome::Failed { status: None, error: format!("the endpoint is disabled: {why}") }, FollowUp::None)
            }
            Some(Some(_)) if taken.payment_status == "voided" => {
                let error = "the payment was completed by another region, which sends its events".to_owned();
                (Outcome::Failed { status: None, error }, FollowUp::None)
            }
            Some(Some(e)) => match self.moved_away(&taken).await {
                Ok(Some(moved)) => {
                    let region =
                        moved.home.map_or("another region (a hand-off says so)".to_owned(), |r| format!("region {r}"));
                    let error = format!("the payment was taken over by {region}, which sends its events");
                    (Outcome::Failed { status: None, error }, FollowUp::None)
                }
                Ok(None) => {
                    failpoint::boundary(|| "before-webhook-send".to_owned());
                    if self.too_late(&taken, asked) { held_up() } else { self.attempt(&taken, e).await }
                }
                Err(error) => (Outcome::NotSent { error, wait: NOT_SENT_WAIT }, FollowUp::None),
            },
        };
        let recorded = match self.deliveries.record(&taken, &outcome).await {
            Ok(recorded) => recorded,
            Err(e) => {
                // Its lease runs out and it is taken again: at least once.
                tracing::warn!(webhook_id = taken.webhook_id, error = %e, "could not record a webhook delivery");
                return;
            }
        };
        let ended = match (&outcome, recorded) {
            (_, false) => Some("superseded"),
            (Outcome::Delivered { .. }, true) => Some("delivered"),
            (Outcome::Failed { .. }, true) => Some("failed"),
            (Outcome::Retry { .. } | Outcome::NotSent { .. }, true) => None,
        };
        if let Some(ended) = ended {
            metrics::counter!("keyfence_webhook_deliveries_total", "outcome" => ended).increment(1);
        }
        if !recorded {
            tracing::info!(webhook_id = taken.webhook_id, "a webhook delivery's lease ran out; its result is not kept");
            return;
        }
        let Some(Some(endpoint)) = endpoint else { return };
        let id = endpoint.id;
        if let Err(e) = self.follow_up(&taken, endpoint, follow_up).await {
            tracing::warn!(endpoint = %id, error = %e, "could not update a webhook endpoint after a delivery");
        }
    }

    /// Signs and sends one attempt; where it leaves the delivery.
    async fn attempt(&self, taken: &Taken, endpoint: &Endpoint) -> (Outcome, FollowUp) {
        let body = serde_json::json!({
            "type": taken.event,
            "timestamp": taken.created_at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default(),
            "data": taken.payload,
        });
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let secrets = match self.endpoints.signing_secrets(taken.client(), endpoint, Millis::now().get()).await {
            Ok(secrets) => secrets,
            Err(e) => {
                // Ours to fix (the sealing key), not the receiver's: no attempt is spent.
                tracing::error!(endpoint = %endpoint.id, error = %e, "could not open a webhook endpoint's secret");
                let error = format!("the endpoint's secret could not be opened: {e}");
                return (Outcome::NotSent { error, wait: NOT_SENT_WAIT }, FollowUp::None);
            }
        };
        let headers = signature::headers(&secrets.iter().collect::<Vec<_>>(), &taken.webhook_id, &body);
        let response = self.sender.send(&endpoint.url, headers, body).await;
        let result = match &response {
            Response::Accepted(_) => "delivered",
            Response::Gone => "gone",
            Response::Refused { .. } => "refused",
            Response::Unreachable(_) => "unreachable",
        };
        metrics::counter!("keyfence_webhook_attempts_total", "result" => result).increment(1);
        let made = u32::try_from(taken.attempts).unwrap_or(u32::MAX);
        let again = |status: Option<u16>, error: String, asked: Option<Duration>| match self
            .settings
            .schedule()
            .wait_after(made, asked)
        {
            Some(wait) => (Outcome::Retry { status, error, wait }, FollowUp::None),
            None => {
                let error = format!("{error}; no attempts left after {made}");
                (Outcome::Failed { status, error }, FollowUp::UsedUp)
            }
        };
        match response {
            Response::Accepted(status) => (Outcome::Delivered { status }, FollowUp::Arrived),
            Response::Gone => {
                (Outcome::Failed { status: Some(410), error: "the endpoint answered 410 Gone".into() }, FollowUp::Gone)
            }
            Response::Refused { status, retry_after } => again(Some(status), format!("answered {status}"), retry_after),
            Response::Unreachable(why) => again(None, why, None),
        }
    }

    /// What a recorded outcome means for its endpoint.
    async fn follow_up(&self, taken: &Taken, endpoint: Endpoint, what: FollowUp) -> Result<(), super::WebhooksError> {
        let owner = taken.client();
        let disabled = match what {
            FollowUp::None => return Ok(()),
            FollowUp::Arrived if endpoint.failed_deliveries == 0 => return Ok(()),
            FollowUp::Arrived => {
                self.endpoints.note_delivered(owner, endpoint.id).await?;
                return Ok(());
            }
            FollowUp::Gone => {
                self.endpoints.disable(owner, endpoint.id, "the endpoint answered 410 Gone").await?;
                "gone"
            }
            FollowUp::UsedUp => {
                if !self.endpoints.note_failed_delivery(owner, endpoint.id, self.settings.disable_after).await? {
                    return Ok(());
                }
                "failing"
            }
        };
        metrics::counter!("keyfence_webhook_endpoints_disabled_total", "reason" => disabled).increment(1);
        tracing::warn!(endpoint = %endpoint.id, client = %owner, reason = disabled, "webhook endpoint disabled");
        let why = format!("the endpoint was disabled ({disabled})");
        self.deliveries.end_pending_of(endpoint.id, &why).await.map_err(super::WebhooksError::Deliveries)?;
        Ok(())
    }

    async fn report_backlog(&self) {
        match self.deliveries.backlog().await {
            Ok(backlog) => {
                metrics::gauge!("keyfence_webhook_undelivered").set(backlog.undelivered as f64);
                metrics::gauge!("keyfence_webhook_oldest_undelivered_seconds").set(backlog.oldest_seconds);
            }
            // The gauges keep their last values rather than claim nothing waits.
            Err(e) => tracing::warn!(error = %e, "could not read the webhook backlog"),
        }
    }
}

/// What a delivery's outcome asks of its endpoint.
enum FollowUp {
    None,
    /// Delivered: a failing endpoint is failing no more.
    Arrived,
    /// 410: disable it.
    Gone,
    /// The schedule is used up: flag it (and disable it after enough).
    UsedUp,
}
