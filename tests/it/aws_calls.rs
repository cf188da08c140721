//! A proxy in front of the AWS emulator (DynamoDB and KMS) that records
//! every call, for tests that count a command's calls or check them
//! against a policy.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::response::Response;
use serde_json::Value;

use crate::app::TestRail;

/// One call as the proxy saw it: `service:Operation` and its JSON body.
#[derive(Clone, Debug)]
pub struct Call {
    pub action: String,
    pub body: Value,
}

pub type Calls = Arc<Mutex<Vec<Call>>>;

/// An HTTP proxy in front of the emulator (DynamoDB and KMS) that records
/// every call.
pub async fn recording_proxy(upstream: String) -> (TestRail, Calls) {
    let calls: Calls = Arc::default();
    async fn forward(State((upstream, calls)): State<(String, Calls)>, request: Request) -> Response {
        let (parts, body) = request.into_parts();
        let target = parts.headers.get("x-amz-target").and_then(|v| v.to_str().ok()).unwrap_or("?.?");
        let (service, operation) = target.split_once('.').unwrap_or((target, "?"));
        let service = match service {
            "DynamoDB_20120810" => "dynamodb",
            "TrentService" => "kms",
            other => other,
        };
        let body: Bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let recorded = Call { action: format!("{service}:{operation}"), body: serde_json::from_slice(&body).unwrap() };
        calls.lock().unwrap().push(recorded);
        let mut sent = reqwest::Client::new().request(parts.method, format!("{upstream}{}", parts.uri));
        for (name, value) in &parts.headers {
            if name != "host" && name != "content-length" {
                sent = sent.header(name, value);
            }
        }
        let answer = sent.body(body).send().await.unwrap();
        let mut response = Response::builder().status(answer.status().as_u16());
        for (name, value) in answer.headers() {
            if name != "content-length" && name != "transfer-encoding" {
                response = response.header(name.as_str(), value.as_bytes());
            }
        }
        response.body(axum::body::Body::from(answer.bytes().await.unwrap())).unwrap()
    }
    let router = axum::Router::new().fallback(forward).with_state((upstream, calls.clone()));
    (TestRail::serving(router).await, calls)
}

/// The calls recorded so far, by operation alone (`GetItem`, `Scan`, ...),
/// and forgets them.
pub fn operations(calls: &Calls) -> Vec<String> {
    taken(calls)
        .into_iter()
        .map(|c| c.action.split_once(':').map_or(c.action.clone(), |(_, op)| op.to_owned()))
        .collect()
}

/// The calls recorded so far, and forgets them.
pub fn taken(calls: &Calls) -> Vec<Call> {
    std::mem::take(&mut *calls.lock().unwrap())
}
