//! Logging and tracing. Events go to stderr, filtered by `RUST_LOG`
//! (default `info`, sqlx notices at `warn`), as text or, with
//! `KEYFENCE_LOG_FORMAT=json`, one JSON object per line; stdout stays free
//! for a command's own output. No event carries an API key, an account
//! number or a request body. When `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, the same spans are also
//! exported in batches over OTLP/HTTP (protobuf) as service `keyfence`
//! (`OTEL_SERVICE_NAME` overrides it); the standard `OTEL_*` variables tune
//! the exporter and the batches. Traces run across systems (W3C Trace
//! Context) whether or not they are exported: a request's `traceparent` is
//! the parent of its spans, calls to the rails and reads from other regions
//! carry the current one, and every log line of a request names its trace
//! (`trace_id`), so a caller's trace id finds its lines. Without an
//! exporter spans carry ids and the caller's sampling decision, and nothing
//! leaves the process.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::{SpanExporter, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Enables the spans of this module (the request's) at any log level.
const REQUEST_SPAN: &str = "keyfence::telemetry=info";

const ENDPOINT_VARIABLES: [&str; 2] = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];

/// Holds the tracer provider (and its exporter, if any) until [`Telemetry::shutdown`].
pub struct Telemetry {
    provider: SdkTracerProvider,
}

/// Installs the global subscriber; call once, first thing in `main`.
pub fn init() -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"))
        // The request's span, whatever RUST_LOG says: it carries the trace
        // that is propagated, and the trace id every log line names.
        .add_directive(REQUEST_SPAN.parse().expect("a valid directive"));
    let provider = if ENDPOINT_VARIABLES.iter().any(|v| std::env::var_os(v).is_some()) {
        exporting()?
    } else {
        // Ids for every span, to propagate and to log, and the caller's
        // sampling decision passed on; nothing is exported.
        SdkTracerProvider::builder().with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOff))).build()
    };
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let export = tracing_opentelemetry::layer().with_tracer(provider.tracer("keyfence"));
    let json = std::env::var("KEYFENCE_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let text = (!json).then(|| tracing_subscriber::fmt::layer().with_writer(std::io::stderr));
    let json = json.then(|| tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr));
    tracing_subscriber::registry().with(filter).with(text).with(json).with(export).init();
    Ok(Telemetry { provider })
}

/// The span of an incoming request, child of the caller's `traceparent`
/// when it sent one, named as OpenTelemetry's HTTP conventions name it
/// (`POST /v1/payments`: the method and the route template, never the path
/// with its ids), and holding the trace id for the log lines inside it.
pub fn request_span<B>(request: &axum::http::Request<B>) -> tracing::Span {
    let route = request.extensions().get::<axum::extract::MatchedPath>().map(|m| m.as_str().to_owned());
    let method = request.method();
    let name = route.as_deref().map_or_else(|| method.to_string(), |route| format!("{method} {route}"));
    let span = tracing::info_span!(
        "request",
        otel.name = %name,
        otel.kind = "server",
        http.request.method = %method,
        http.route = route.as_deref().unwrap_or_default(),
        url.path = %request.uri().path(),
        trace_id = tracing::field::Empty,
    );
    let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Headers(request.headers())));
    // Without a tracing layer for OpenTelemetry (a test's own subscriber) there is nothing to attach to.
    let _ = span.set_parent(parent);
    let trace = span.context().span().span_context().trace_id();
    if trace != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace));
    }
    span
}

/// Adds the current span's `traceparent` to an outgoing request's headers.
pub fn inject_trace_context(headers: &mut axum::http::HeaderMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&context, &mut HeadersMut(headers)));
}

struct Headers<'a>(&'a axum::http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(axum::http::HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut axum::http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (axum::http::HeaderName::try_from(key), axum::http::HeaderValue::try_from(value))
        {
            self.0.insert(name, value);
        }
    }
}

/// A tracer provider that batches spans to the OTLP endpoint.
fn exporting() -> anyhow::Result<SdkTracerProvider> {
    let exporter =
        SpanExporter::builder().with_http().with_protocol(opentelemetry_otlp::Protocol::HttpBinary).build()?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("keyfence");
    }
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build())
}

impl Telemetry {
    /// Sends the spans still buffered; call before the process exits.
    pub async fn shutdown(self) {
        let provider = self.provider;
        // Flushing blocks on the exporter's thread; keep it off the runtime's workers.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown().map_err(|e| e.to_string()));
        if let Err(e) = flushed.await.unwrap_or_else(|e| Err(e.to_string())) {
            eprintln!("keyfence: exporting the last spans: {e}");
        }
    }
}
