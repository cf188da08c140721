//! A connection's reads bounded by what it waits for, on two clocks: a
//! request's head must arrive within `head` of its first byte (a new
//! connection's first head within `head` of opening), and a keep-alive
//! connection idle between requests is closed after `idle`. One clock for
//! both (hyper's header timeout, which runs from the end of one answer to
//! the end of the next head) either closes idle connections before a load
//! balancer in front stops reusing them, which it sees as a reset and
//! answers 502, or gives a client trickling a head as long as an idle
//! connection.
//!
//! What the connection waits for is told by the service that answers it
//! ([`Phase`]): from a request's head to its answer, reads are the body's
//! (bounded elsewhere); from an answer on, the next head is awaited.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Whether a connection is answering a request, shared by its reads and the
/// service that answers it.
#[derive(Debug, Default)]
pub struct Phase {
    answering: AtomicBool,
    /// Answers made: a read that sees a new one starts the next wait afresh.
    answered: AtomicU64,
}

impl Phase {
    /// A request's head has arrived: its answer is being made.
    pub fn answering(&self) {
        self.answering.store(true, Ordering::Relaxed);
    }

    /// The answer is made: the connection awaits the next head.
    pub fn answered(&self) {
        self.answering.store(false, Ordering::Relaxed);
        self.answered.fetch_add(1, Ordering::Relaxed);
    }
}

/// The error a read ends with when its clock runs out (not a write stall).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ReadExpired(&'static str);

/// Which clock runs while a head is awaited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Clock {
    /// No byte of the next head yet: the connection is idle.
    Idle,
    /// A head has begun (or the connection is new).
    Head,
}

/// `S`, whose reads fail once the head or idle clock runs out.
pub struct ReadDeadline<S> {
    inner: S,
    head: Duration,
    idle: Duration,
    phase: Arc<Phase>,
    /// The clock running, and when it runs out; none while answering.
    running: Option<(Clock, Pin<Box<Sleep>>)>,
    /// The answers made when this last read.
    seen: u64,
}

impl<S> ReadDeadline<S> {
    /// A new connection, whose first head must arrive within `head`.
    pub fn new(inner: S, head: Duration, idle: Duration, phase: Arc<Phase>) -> Self {
        let running = Some((Clock::Head, Box::pin(tokio::time::sleep(head))));
        Self { inner, head, idle, phase, running, seen: 0 }
    }

    fn start(&mut self, clock: Clock) {
        let limit = if clock == Clock::Head { self.head } else { self.idle };
        self.running = Some((clock, Box::pin(tokio::time::sleep_until(Instant::now() + limit))));
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadDeadline<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let answered = this.phase.answered.load(Ordering::Relaxed);
        if this.phase.answering.load(Ordering::Relaxed) || answered != this.seen {
            this.running = None;
            this.seen = answered;
        }
        if this.phase.answering.load(Ordering::Relaxed) {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let arrived = matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before;
        match (this.running.as_ref().map(|(clock, _)| *clock), arrived) {
            (None | Some(Clock::Idle), true) => this.start(Clock::Head),
            (None, false) => this.start(Clock::Idle),
            _ => {}
        }
        if polled.is_ready() {
            return polled;
        }
        let Some((clock, sleep)) = this.running.as_mut() else { return Poll::Pending };
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let why = match clock {
                    Clock::Head => "the request's head did not arrive in time",
                    Clock::Idle => "the connection was idle for longer than the idle timeout",
                };
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, ReadExpired(why))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadDeadline<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_outlasts_the_head_clock_and_a_begun_head_does_not() {
        let (mut peer, ours) = duplex(1024);
        let phase = Arc::new(Phase::default());
        let mut reads = ReadDeadline::new(ours, Duration::from_secs(1), Duration::from_secs(60), phase.clone());
        let mut buf = [0_u8; 64];
        peer.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(reads.read(&mut buf).await.unwrap() > 0);
        phase.answering();
        phase.answered();
        // Idle for 30 s, past the head clock: then a head's first bytes.
        let waiting = tokio::spawn(async move {
            let first = reads.read(&mut buf).await.map(|_| ());
            let rest = reads.read(&mut buf).await;
            (first, rest)
        });
        tokio::time::sleep(Duration::from_secs(30)).await;
        peer.write_all(b"GET").await.unwrap();
        let (first, rest) = waiting.await.unwrap();
        assert!(first.is_ok(), "idle for 30 s of 60: {first:?}");
        let rest = rest.unwrap_err();
        assert!(rest.get_ref().is_some_and(|e| e.is::<ReadExpired>()), "{rest:?}");
        assert!(rest.to_string().contains("head"), "{rest}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_closes_after_the_idle_clock_and_a_new_one_after_the_head_clock() {
        let (_peer, ours) = duplex(1024);
        let phase = Arc::new(Phase::default());
        let mut reads = ReadDeadline::new(ours, Duration::from_secs(1), Duration::from_secs(60), phase.clone());
        let started = Instant::now();
        let silent = reads.read(&mut [0_u8; 8]).await.unwrap_err();
        assert!(silent.to_string().contains("head") && started.elapsed() == Duration::from_secs(1), "{silent}");

        let (mut peer, ours) = duplex(1024);
        let mut reads = ReadDeadline::new(ours, Duration::from_secs(1), Duration::from_secs(60), phase.clone());
        peer.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(reads.read(&mut [0_u8; 64]).await.unwrap() > 0);
        phase.answering();
        phase.answered();
        let idled = Instant::now();
        let idle = reads.read(&mut [0_u8; 8]).await.unwrap_err();
        assert!(idle.to_string().contains("idle") && idled.elapsed() == Duration::from_secs(60), "{idle}");
    }
}
