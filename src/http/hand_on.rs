//! Handing a rail's notification to another region's inbox
//! ([`crate::inbox::hand`]): posted to the region's own
//! `/v1/rail-events/{rail}` as the rail sent it (its bytes and Standard
//! Webhooks headers), signed as this region like a forwarded read, with
//! the digest of the bytes in the signed query so that the signature
//! covers them. The region checks the rail's signature itself and takes
//! the message only if it holds the live copy: 200 taken (or taken
//! before), 404 not held there (nothing recorded), 409 another message
//! under the id. An answer not signed by the region is not believed.

use axum::http::StatusCode;
use sha2::{Digest, Sha256};

use super::peers::{Asker, Peers, Posted, others};
use crate::domain::ClientId;
use crate::inbox::hand::{HandOn, Handed};
use crate::ledger::inbox::Waiting;
use crate::regions::RegionView;

/// The query parameter carrying the digest of a handed message's bytes.
pub const HANDED: &str = "handed";

/// The other regions' inboxes, as this region reaches them.
pub struct PeerInboxes {
    pub peers: Peers,
    pub regions: RegionView,
    pub me: String,
}

/// The digest a handed message's bytes are named by (hex SHA-256).
pub fn digest(raw: &[u8]) -> String {
    hex::encode(Sha256::digest(raw))
}

impl HandOn for PeerInboxes {
    async fn hand_on(&self, waiting: &Waiting) -> Handed {
        let mut registry = self.regions.current().await;
        if others(&registry, &self.me).next().is_none() {
            // A region that has just begun to advertise is not missed.
            registry = self.regions.fresh().await.unwrap_or(registry);
        }
        // A region-to-region request is made for a client; a rail's
        // message is no client's.
        let asker = Asker { me: &self.me, client: ClientId::new(uuid::Uuid::nil()) };
        let path = format!("/v1/rail-events/{}", waiting.rail);
        let digest = digest(&waiting.signed.raw);
        let headers = [
            ("content-type", "application/json".to_owned()),
            ("webhook-id", waiting.message_id.clone()),
            ("webhook-timestamp", waiting.signed.at.to_string()),
            ("webhook-signature", waiting.signed.signature.clone()),
        ];
        let posted = Posted { body: &waiting.signed.raw, headers: &headers };
        let mut not_yet = false;
        for (region, url) in others(&registry, &self.me) {
            match self.peers.post(asker, region, url, &path, &[(HANDED, &digest)], posted).await {
                Ok((StatusCode::OK, _)) => return Handed::To(region.to_owned()),
                // Only the inbox's own refusal, not any 409 on the way.
                Ok((StatusCode::CONFLICT, body)) if refused(&body) => return Handed::Conflicting(region.to_owned()),
                Ok((StatusCode::NOT_FOUND, _)) => {}
                Ok((status, _)) => {
                    tracing::warn!(region, %status, id = waiting.message_id, "another region could not take a notification yet");
                    not_yet = true;
                }
                Err(e) => {
                    tracing::warn!(region, id = waiting.message_id, error = %e, "another region could not be offered a notification");
                    not_yet = true;
                }
            }
        }
        if not_yet { Handed::NotYet } else { Handed::Nowhere }
    }
}

/// Whether an answer is the inbox's refusal of another message under an
/// id it holds (`{"received": false}`).
fn refused(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|answer| answer["received"] == false)
}
