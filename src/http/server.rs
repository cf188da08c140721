//! Serving the router over TCP with limits a slow or hostile client cannot
//! get around: a request's headers must arrive within `header_read` (and a
//! keep-alive connection sitting idle between requests is closed after the
//! same time), its body within `body_read` (else 408), and at most
//! `max_connections` connections are served at once (further ones wait in
//! the listen backlog until one closes). On shutdown, requests in flight
//! finish; idle connections are closed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// What one client may take of the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_read: Duration,
    pub body_read: Duration,
    pub max_connections: usize,
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
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read).keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: pause, then go on.
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A connection ends in an error whenever a client goes away
            // mid-request or is cut off by a limit: nothing to report.
            let _ = connection.await;
            drop(slot);
        });
    }
    graceful.shutdown().await;
    Ok(())
}
