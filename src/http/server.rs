//! Serving a router over TCP with limits a slow or hostile client cannot
//! get around: a request's headers must arrive within `header_read` (and a
//! keep-alive connection sitting idle between requests is closed after the
//! same time), in at most [`MAX_HEADERS`] headers and [`MAX_HEAD_BYTES`]
//! bytes (else 431), its body within `body_read` (else 408); at most
//! `max_connections` connections are served at once (further ones wait in
//! the listen backlog until one closes) and at most `per_address` from one
//! peer address (further ones are closed at once); a connection serves at
//! most `requests_per_connection` requests and lives at most `max_age`,
//! then it is closed after its request in flight (`Connection: close`), so
//! no client can hold its connections for ever, however politely it
//! trickles requests. On shutdown, requests in flight finish; idle
//! connections are closed.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

/// Headers one request may carry.
pub const MAX_HEADERS: usize = 64;

/// Bytes a request's head (request line and headers) may take.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// What one client may take of the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_read: Duration,
    pub body_read: Duration,
    pub max_connections: usize,
    pub per_address: usize,
    pub requests_per_connection: u32,
    pub max_age: Duration,
}

/// Connections open per peer address.
#[derive(Clone, Default)]
struct PerAddress(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// The address a connection counts against: an IPv4 peer seen through an
/// IPv6 socket as itself.
fn counted_as(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// One connection's place in [`PerAddress`], given back when dropped.
struct AddressSlot(PerAddress, IpAddr);

impl PerAddress {
    fn take(&self, address: IpAddr, cap: usize) -> Option<AddressSlot> {
        let mut open = self.0.lock().expect("the address counts are never poisoned");
        let count = open.entry(address).or_default();
        if *count >= cap {
            return None;
        }
        *count += 1;
        Some(AddressSlot(self.clone(), address))
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.0.0.lock().expect("the address counts are never poisoned");
        if let Some(count) = open.get_mut(&self.1) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.1);
            }
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router.layer(tower_http::timeout::RequestBodyDeadlineLayer::new(limits.body_read));
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let addresses = PerAddress::default();
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .keep_alive(true)
        .max_headers(MAX_HEADERS)
        .max_buf_size(MAX_HEAD_BYTES);
    tokio::pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: pause, then go on.
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(address) = addresses.take(counted_as(peer.ip()), limits.per_address) else {
            metrics::counter!("keyfence_connections_refused_total", "reason" => "per_address").increment(1);
            continue;
        };
        let served = Arc::new(AtomicU32::new(0));
        let opened = tokio::time::Instant::now();
        let counted = served.clone();
        // Past either limit, the answer closes the connection behind it.
        let service = tower::ServiceExt::<axum::extract::Request<hyper::body::Incoming>>::map_response(
            router.clone(),
            move |mut response: axum::response::Response| {
                let count = counted.fetch_add(1, Ordering::Relaxed) + 1;
                if count >= limits.requests_per_connection || opened.elapsed() >= limits.max_age {
                    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                response
            },
        );
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let mut stopping = stopping.clone();
        connections.spawn(async move {
            tokio::pin!(connection);
            // An idle connection past its age, or at shutdown, is closed;
            // one with a request in flight closes once it is answered.
            tokio::select! {
                _ = connection.as_mut() => {}
                () = tokio::time::sleep_until(opened + limits.max_age) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
                _ = stopping.changed() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            // A connection ends in an error whenever a client goes away
            // mid-request or is cut off by a limit: nothing to report.
            drop((slot, address));
        });
    }
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::counted_as;

    #[test]
    fn a_mapped_ipv4_peer_counts_as_itself() {
        assert_eq!(counted_as("::ffff:192.0.2.7".parse().unwrap()), counted_as("192.0.2.7".parse().unwrap()));
        assert_ne!(counted_as("192.0.2.7".parse().unwrap()), counted_as("192.0.2.8".parse().unwrap()));
        assert_ne!(counted_as("2001:db8::1".parse().unwrap()), counted_as("2001:db8::2".parse().unwrap()));
    }
}
