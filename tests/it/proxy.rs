//! A TCP proxy a test can cut and heal: a partition between the service and
//! one of its stores, while both keep running. Cut, it closes every open
//! connection and drops new ones as soon as they are accepted.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    pub addr: SocketAddr,
    cut: watch::Sender<bool>,
}

impl Proxy {
    /// Forwards a local port to `target` until dropped.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, _) = watch::channel(false);
        let cuts = cut.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut cut = cuts.subscribe();
                if *cut.borrow() {
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(target).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Self { addr, cut }
    }

    /// Partitions: every connection through the proxy fails from now on.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}
