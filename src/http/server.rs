//! Serving a router over TCP with limits a slow or hostile client cannot
//! get around: a request's headers must arrive within `header_read` of
//! their first byte (a new connection's within `header_read` of opening;
//! a keep-alive connection sitting idle between requests is closed after
//! `idle`, a clock of its own: [`ReadDeadline`]), in at most [`MAX_HEADERS`] headers and [`MAX_HEAD_BYTES`]
//! bytes (else 431), its body within `body_read` (else 408); at most
//! `max_connections` connections are served at once (further ones wait in
//! the listen backlog until one closes) and at most `per_address` from one
//! peer address, an IPv6 peer's /64 counting as one (further ones are
//! closed at once); a connection serves at
//! most `requests_per_connection` requests and lives at most `max_age`,
//! then it is closed after its request in flight (`Connection: close`; one
//! idle at its age is closed by its idle clock or after its next request,
//! never under a client that may be sending on it), so no client can hold
//! its connections for ever, however politely it trickles requests.
//!
//! Nor however rudely: a write the peer leaves waiting for `write_stall`
//! ends the connection ([`WriteDeadline`], and `TCP_USER_TIMEOUT` for what
//! the kernel still holds), so a client that pipelines requests and never
//! reads the answers is cut off; and a connection told to close (past its
//! age, or at shutdown) has `drain` to finish its request in flight, then
//! it is dropped, whatever it is doing. On shutdown, idle connections are
//! closed at once and `serve` returns within `drain`.
//!
//! A connection over the per-address cap is closed unanswered rather than
//! sent a 503: answering means writing to a peer that already holds its
//! share, before its request is read (closing on an unread request resets
//! the connection, so the answer would often be lost anyway), and a closed
//! connection is what every client already retries.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use super::read_deadline::{Phase, ReadDeadline, ReadExpired};
use super::write_deadline::WriteDeadline;
use crate::domain::Shares;

/// Headers one request may carry.
pub const MAX_HEADERS: usize = 64;

/// Bytes a request's head (request line and headers) may take.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// What one client may take of the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// How long a request's head may take from its first byte.
    pub header_read: Duration,
    /// How long a keep-alive connection may sit idle between requests.
    pub idle: Duration,
    pub body_read: Duration,
    pub max_connections: usize,
    pub per_address: usize,
    pub requests_per_connection: u32,
    pub max_age: Duration,
    /// How long a write may wait on the peer before the connection ends.
    pub write_stall: Duration,
    /// How long a connection told to close may take to finish its request.
    pub drain: Duration,
}

/// The address a connection counts against: an IPv4 peer seen through an
/// IPv6 socket as itself, and an IPv6 peer as its /64, the block one host
/// or one customer of a provider is given (it can pick any address in it).
fn counted_as(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & !u128::from(u64::MAX))),
        },
        v4 => v4,
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
    let addresses = Shares::<IpAddr>::default();
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        // Heads and idle connections are bounded by `ReadDeadline`.
        .header_read_timeout(None)
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
        // The kernel gives up on unacknowledged data after the same time.
        if let Err(e) = socket2::SockRef::from(&stream).set_tcp_user_timeout(Some(limits.write_stall)) {
            tracing::debug!(error = %e, "could not set TCP_USER_TIMEOUT");
        }
        let served = Arc::new(AtomicU32::new(0));
        let opened = tokio::time::Instant::now();
        let counted = served.clone();
        let phase = Arc::new(Phase::default());
        let (answering, answered) = (phase.clone(), phase.clone());
        let service = tower::ServiceExt::map_request(
            router.clone(),
            move |request: axum::extract::Request<hyper::body::Incoming>| {
                answering.answering();
                request
            },
        );
        // Past either limit, the answer closes the connection behind it.
        let service = tower::ServiceExt::map_response(service, move |mut response: axum::response::Response| {
            let count = counted.fetch_add(1, Ordering::Relaxed) + 1;
            if count >= limits.requests_per_connection || opened.elapsed() >= limits.max_age {
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            answered.answered();
            response
        });
        let busy = phase.clone();
        let stream =
            ReadDeadline::new(WriteDeadline::new(stream, limits.write_stall), limits.header_read, limits.idle, phase);
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let mut stopping = stopping.clone();
        connections.spawn(async move {
            tokio::pin!(connection);
            // At shutdown, or busy with a request at its age, a connection
            // closes once answered, or is dropped when it has not been
            // within `drain` (an idle one closes at once). One idle at its
            // age is left to its idle clock, or to its next answer, which
            // closes it (`Connection: close`): closing it under a load
            // balancer that may be sending on it would cost that request a
            // 502. What it does after its age is bounded by the head, body
            // and write limits.
            let aged = tokio::time::sleep_until(opened + limits.max_age);
            tokio::pin!(aged);
            let mut past_age = false;
            let ended = loop {
                tokio::select! {
                    ended = connection.as_mut() => break Some(ended),
                    () = &mut aged, if !past_age => {
                        past_age = true;
                        if busy.busy() {
                            break None;
                        }
                    }
                    _ = stopping.changed() => break None,
                }
            };
            let ended = match ended {
                Some(ended) => Some(ended),
                None => {
                    connection.as_mut().graceful_shutdown();
                    tokio::time::timeout(limits.drain, connection).await.ok()
                }
            };
            let dropped = match &ended {
                None => Some("drain"),
                Some(Err(e)) if stalled(e) => Some("write_stall"),
                Some(_) => None,
            };
            if let Some(reason) = dropped {
                metrics::counter!("keyfence_connections_dropped_total", "reason" => reason).increment(1);
            }
            // A connection ends in an error whenever a client goes away
            // mid-request or is cut off by a limit: nothing to report.
            drop((slot, address));
        });
    }
    let _ = stop.send(true);
    // Each connection bounds itself; this bounds them all, should one not.
    let drained = tokio::time::timeout(limits.drain, async { while connections.join_next().await.is_some() {} });
    if drained.await.is_err() {
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
    Ok(())
}

/// Whether a connection ended because the peer left a write waiting.
fn stalled(error: &hyper::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            let read = io.get_ref().is_some_and(|inner| inner.is::<ReadExpired>());
            return io.kind() == std::io::ErrorKind::TimedOut && !read;
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::counted_as;

    #[test]
    fn a_mapped_ipv4_peer_counts_as_itself_and_an_ipv6_one_as_its_block() {
        assert_eq!(counted_as("::ffff:192.0.2.7".parse().unwrap()), counted_as("192.0.2.7".parse().unwrap()));
        assert_ne!(counted_as("192.0.2.7".parse().unwrap()), counted_as("192.0.2.8".parse().unwrap()));
        assert_eq!(
            counted_as("2001:db8::1".parse().unwrap()),
            counted_as("2001:db8::ffff:2".parse().unwrap()),
            "one /64"
        );
        assert_ne!(counted_as("2001:db8::1".parse().unwrap()), counted_as("2001:db8:0:1::1".parse().unwrap()));
    }
}
