//! A connection's reads bounded by what it waits for, on two clocks: a
//! request's head must arrive within `head` of its first byte (a new
//! connection's first head within `head` of opening), and a keep-alive
//! connection idle between requests is closed after `idle`, counted from
//! the last write of its last answer. One clock for both (hyper's header
//! timeout, which runs from the end of one answer to the end of the next
//! head) either closes idle connections before a load balancer in front
//! stops reusing them, which it sees as a reset and answers 502, or gives a
//! client trickling a head as long as an idle connection.
//!
//! What the connection waits for is told by the service that answers it
//! ([`Phase`]): from a request's head to its answer, reads are the body's
//! (bounded elsewhere); from an answer on, the next head is awaited. The
//! idle clock is started (and moved on) by the answer's writes, which run
//! on the connection's task after its last read: a clock started only by a
//! read would never be polled until the peer sent something.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Where a connection is, shared by its reads and writes, the service
/// that answers it, and the task that serves it.
#[derive(Debug, Default)]
pub struct Phase {
    /// From a request's head to its answer.
    answering: AtomicBool,
    /// From a head's first byte to the head's end.
    in_head: AtomicBool,
    /// Requests answered or being answered: a read or write that sees a
    /// new one drops the clock its head ran on.
    requests: AtomicU64,
}

impl Phase {
    /// A request's head has arrived: its answer is being made.
    pub fn answering(&self) {
        self.in_head.store(false, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.answering.store(true, Ordering::Relaxed);
    }

    /// The answer is made: the connection awaits the next head.
    pub fn answered(&self) {
        self.answering.store(false, Ordering::Relaxed);
    }

    /// Whether the connection is busy with a request (its head begun, or
    /// its answer in the making), not idle between requests.
    pub fn busy(&self) -> bool {
        self.answering.load(Ordering::Relaxed) || self.in_head.load(Ordering::Relaxed)
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
    /// The clock running, if any (none while answering).
    clock: Option<Clock>,
    /// When the running clock runs out.
    deadline: Pin<Box<Sleep>>,
    /// The requests seen when the clock last changed.
    seen: u64,
}

impl<S> ReadDeadline<S> {
    /// A new connection, whose first head must arrive within `head`.
    pub fn new(inner: S, head: Duration, idle: Duration, phase: Arc<Phase>) -> Self {
        phase.in_head.store(true, Ordering::Relaxed);
        let deadline = Box::pin(tokio::time::sleep(head));
        Self { inner, head, idle, phase, clock: Some(Clock::Head), deadline, seen: 0 }
    }

    /// Drops the clock of a head that has since been answered.
    fn catch_up(&mut self) {
        let requests = self.phase.requests.load(Ordering::Relaxed);
        if requests != self.seen {
            self.seen = requests;
            self.clock = None;
        }
    }

    fn start(&mut self, clock: Clock) {
        let limit = if clock == Clock::Head { self.head } else { self.idle };
        self.phase.in_head.store(clock == Clock::Head, Ordering::Relaxed);
        self.clock = Some(clock);
        self.deadline.as_mut().reset(Instant::now() + limit);
    }

    /// A write of an answer (or its flush): once the answer is made, the
    /// idle clock starts from the last one, and is polled here, on the
    /// connection's task, so that it wakes it.
    fn wrote(&mut self, cx: &mut Context<'_>) {
        self.catch_up();
        if self.phase.answering.load(Ordering::Relaxed) || self.clock == Some(Clock::Head) {
            return;
        }
        self.start(Clock::Idle);
        // Pending, just reset: this registers the task's waker.
        let _ = self.deadline.as_mut().poll(cx);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadDeadline<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.catch_up();
        if this.phase.answering.load(Ordering::Relaxed) {
            this.clock = None;
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let arrived = matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before;
        match (this.clock, arrived) {
            (None | Some(Clock::Idle), true) => this.start(Clock::Head),
            (None, false) => this.start(Clock::Idle),
            _ => {}
        }
        if polled.is_ready() {
            return polled;
        }
        match this.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let why = match this.clock {
                    Some(Clock::Head) => "the request's head did not arrive in time",
                    _ => "the connection was idle for longer than the idle timeout",
                };
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, ReadExpired(why))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadDeadline<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.wrote(cx);
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.wrote(cx);
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.wrote(cx);
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    /// A connection that has read one request and written its answer.
    async fn answered_once(
        head: Duration,
        idle: Duration,
    ) -> (tokio::io::DuplexStream, ReadDeadline<tokio::io::DuplexStream>) {
        let (mut peer, ours) = duplex(1024);
        let phase = Arc::new(Phase::default());
        let mut reads = ReadDeadline::new(ours, head, idle, phase.clone());
        peer.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(reads.read(&mut [0_u8; 64]).await.unwrap() > 0);
        phase.answering();
        assert!(phase.busy());
        phase.answered();
        reads.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        assert!(!phase.busy(), "idle once answered");
        (peer, reads)
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_outlasts_the_head_clock_and_a_begun_head_does_not() {
        let (mut peer, mut reads) = answered_once(Duration::from_secs(1), Duration::from_secs(60)).await;
        let waiting = tokio::spawn(async move {
            let mut buf = [0_u8; 64];
            let first = reads.read(&mut buf).await.map(|_| ());
            let rest = reads.read(&mut buf).await;
            (first, rest)
        });
        // Idle for 30 s, past the head clock: then a head's first bytes.
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
        let mut reads = ReadDeadline::new(ours, Duration::from_secs(1), Duration::from_secs(60), Arc::default());
        let started = Instant::now();
        let silent = reads.read(&mut [0_u8; 8]).await.unwrap_err();
        assert!(silent.to_string().contains("head") && started.elapsed() == Duration::from_secs(1), "{silent}");

        let (_peer, mut reads) = answered_once(Duration::from_secs(1), Duration::from_secs(60)).await;
        let idled = Instant::now();
        let idle = reads.read(&mut [0_u8; 8]).await.unwrap_err();
        assert!(idle.to_string().contains("idle") && idled.elapsed() == Duration::from_secs(60), "{idle}");
    }

    /// The idle clock wakes the connection's task by itself: its waker is
    /// registered by the answer's last write, with no read after it.
    #[tokio::test(start_paused = true)]
    async fn the_idle_clock_started_by_the_last_write_wakes_the_task() {
        let (_peer, mut reads) = answered_once(Duration::from_secs(1), Duration::from_secs(60)).await;
        let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waker = waker_fn(woken.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut reads).poll_flush(&mut cx).is_ready());
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert!(woken.load(Ordering::SeqCst), "nothing woke the task when the idle clock ran out");
    }

    fn waker_fn(woken: Arc<std::sync::atomic::AtomicBool>) -> std::task::Waker {
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        std::task::Waker::from(Arc::new(Flag(woken)))
    }
}
