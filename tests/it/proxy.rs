//! A TCP proxy a test can partition: between the service and one of its
//! stores, while both keep running. Refusing, it closes every open
//! connection and drops new ones as soon as they are accepted (connection
//! refused or reset); hanging, it holds every connection open and passes
//! nothing (timeouts). Healed, it forwards again.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Open,
    Refuse,
    Hang,
}

pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
}

impl Proxy {
    /// Forwards a local port to `target` until dropped.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::Open);
        let modes = mode.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut mode = modes.subscribe();
                tokio::spawn(async move {
                    // Held (hanging) until the partition ends one way or the other.
                    let now = *mode.borrow();
                    if now == Mode::Hang {
                        let _ = mode.wait_for(|m| *m != Mode::Hang).await;
                    }
                    let now = *mode.borrow();
                    if now == Mode::Refuse {
                        return;
                    }
                    let Ok(mut outbound) = TcpStream::connect(target).await else { return };
                    let partitioned = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
                        left = mode.wait_for(|m| *m != Mode::Open) => left.is_ok(),
                    };
                    // Hanging: both ends stay open, passing nothing, until
                    // the partition heals or turns to refusing.
                    if partitioned {
                        let _ = mode.wait_for(|m| *m != Mode::Hang).await.is_ok();
                    }
                });
            }
        });
        Self { addr, mode }
    }

    /// Partitions: every connection through the proxy is refused from now on.
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Refuse);
    }

    /// Partitions: every connection through the proxy hangs from now on.
    pub fn hang(&self) {
        self.mode.send_replace(Mode::Hang);
    }

    pub fn heal(&self) {
        self.mode.send_replace(Mode::Open);
    }
}
