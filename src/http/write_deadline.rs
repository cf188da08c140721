//! A connection whose writes must make progress: a write (or flush, or
//! shutdown) that the peer leaves waiting for longer than the limit fails
//! with `TimedOut`, which ends the connection. A client that sends requests
//! and never reads the answers fills the socket's buffers, after which
//! every write waits on it; without a limit the connection would hold its
//! slot for as long as the client liked.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `S`, whose writes fail once one has waited `limit` without progress.
pub struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Armed when a write first waits; disarmed by any progress.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        Self { inner, limit, waiting: None }
    }

    /// What a write polled to, unless it has waited past the limit.
    fn bounded<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.waiting = None;
            return polled;
        }
        let limit = self.limit;
        let waiting = self.waiting.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match waiting.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer read nothing for longer than the write limit",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.bounded(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.bounded(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.bounded(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.bounded(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::WriteDeadline;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    /// A peer that never reads: the write waits, then fails; one that reads
    /// slowly keeps it going however long the whole takes.
    #[tokio::test]
    async fn a_write_that_waits_past_the_limit_fails() {
        let limit = Duration::from_millis(300);
        let (near, _far) = tokio::io::duplex(64);
        let stalled = WriteDeadline::new(near, limit).write_all(&[0; 256]).await.unwrap_err();
        assert_eq!(stalled.kind(), std::io::ErrorKind::TimedOut);

        let (near, mut far) = tokio::io::duplex(64);
        let reader = tokio::spawn(async move {
            let mut chunk = [0; 64];
            let mut total = 0;
            while total < 1024 {
                tokio::time::sleep(limit / 3).await;
                total += tokio::io::AsyncReadExt::read(&mut far, &mut chunk).await.unwrap();
            }
        });
        let started = tokio::time::Instant::now();
        WriteDeadline::new(near, limit).write_all(&[0; 1024]).await.expect("a reader that reads is not cut off");
        assert!(started.elapsed() > limit, "the whole took longer than the limit");
        reader.await.unwrap();
    }
}
