//! `Receiver`: a webhook receiver in a child process
//! (`tests/receiver/receiver.py`) that verifies every delivery with the
//! Standard Webhooks reference library, so a test checks keyfence's
//! signatures against the specification's own code, not against ours.

use std::process::Stdio;

use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// One attempt as the receiver saw it.
#[derive(Debug, Clone, Deserialize)]
pub struct Arrival {
    pub webhook_id: String,
    /// When it arrived, in seconds since the epoch.
    pub at: f64,
    pub valid: bool,
    pub error: Option<String>,
    #[serde(rename = "type")]
    pub event: Option<String>,
    pub data: Option<Value>,
    /// `None` while it is being answered.
    pub answered: Option<u16>,
    pub overlapping: bool,
}

impl Arrival {
    pub fn accepted(&self) -> bool {
        self.answered.is_some_and(|s| (200..300).contains(&s))
    }
}

pub struct Receiver {
    pub url: String,
    http: reqwest::Client,
    _child: Child,
}

impl Receiver {
    pub async fn start() -> Self {
        let python = std::env::var("KEYFENCE_WEBHOOK_RECEIVER_PYTHON").expect(
            "KEYFENCE_WEBHOOK_RECEIVER_PYTHON names a Python with standardwebhooks: run the tests with scripts/test",
        );
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/receiver/receiver.py");
        let mut child = Command::new(python)
            .arg(script)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the receiver starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next_line().await.unwrap().expect("the receiver names its port");
        let port = first.strip_prefix("listening on ").expect("listening on PORT");
        Self { url: format!("http://127.0.0.1:{port}"), http: reqwest::Client::new(), _child: child }
    }

    /// Where endpoint `name` receives.
    pub fn hook(&self, name: &str) -> String {
        format!("{}/hooks/{name}", self.url)
    }

    /// Sets how endpoint `name` answers (see receiver.py): its secret, and
    /// `fail`, `status`, `retry_after`, `delay_ms`.
    pub async fn behave(&self, name: &str, behaviour: Value) {
        let put = self.http.put(format!("{}/endpoints/{name}", self.url)).json(&behaviour).send().await.unwrap();
        assert!(put.status().is_success());
    }

    /// Every attempt that reached endpoint `name`, in arrival order.
    pub async fn arrivals(&self, name: &str) -> Vec<Arrival> {
        self.http.get(format!("{}/endpoints/{name}/log", self.url)).send().await.unwrap().json().await.unwrap()
    }
}
