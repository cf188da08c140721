//! A DNS server for tests, on a loopback UDP port: it answers A queries
//! for the names it is given, NXDOMAIN for other names, and nothing at all
//! for names under a silent zone (as a zone whose name servers never
//! answer looks to a resolver). It counts the queries it saw.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::UdpSocket;

pub struct TestDns {
    pub addr: SocketAddr,
    /// Queries for names under the silent zone, so far.
    pub unanswered: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestDns {
    /// Serves `names` (lower case, without the final dot) and never answers
    /// for names ending in `silent`.
    pub async fn start(names: &[(&str, Ipv4Addr)], silent: &str) -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let names: HashMap<String, Ipv4Addr> = names.iter().map(|(n, ip)| ((*n).to_owned(), *ip)).collect();
        let silent = silent.to_owned();
        let unanswered = Arc::new(AtomicUsize::new(0));
        let counted = unanswered.clone();
        let task = tokio::spawn(async move {
            let mut query = [0_u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut query).await {
                let Some((name, end)) = question(&query[..n]) else { continue };
                if name.ends_with(&silent) {
                    counted.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let qtype = u16::from_be_bytes([query[end], query[end + 1]]);
                let found = names.get(&name).copied();
                let _ = socket.send_to(&answer(&query[..end + 4], found, qtype), from).await;
            }
        });
        Self { addr, unanswered, task }
    }
}

/// The question's name (lower case, no final dot) and where its type starts.
fn question(packet: &[u8]) -> Option<(String, usize)> {
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = *packet.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(packet.get(at..at + len)?).to_lowercase());
        at += len;
    }
    (packet.len() >= at + 4).then(|| (labels.join("."), at))
}

/// The response to `asked` (its header and question): an A record when the
/// name is known and A was asked, no record (AAAA) or NXDOMAIN otherwise.
fn answer(asked: &[u8], found: Option<Ipv4Addr>, qtype: u16) -> Vec<u8> {
    let mut out = asked.to_vec();
    let rcode = if found.is_some() { 0 } else { 3 };
    out[2] = 0x81 | (asked[2] & 0x01);
    out[3] = 0x80 | rcode;
    out[6..12].copy_from_slice(&[0, 0, 0, 0, 0, 0]);
    if let (Some(ip), 1) = (found, qtype) {
        out[7] = 1;
        out.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        out.extend_from_slice(&ip.octets());
    }
    out
}
