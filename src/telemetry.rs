//! Logging and tracing. Events go to stderr as text, filtered by `RUST_LOG`
//! (default `info`, sqlx notices at `warn`), so stdout stays free for a
//! command's own output. When `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, the same spans are also
//! exported in batches over OTLP/HTTP (protobuf) as service `keyfence`
//! (`OTEL_SERVICE_NAME` overrides it); the standard `OTEL_*` variables tune
//! the exporter and the batches.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

const ENDPOINT_VARIABLES: [&str; 2] = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];

/// Holds the span exporter, if any, until [`Telemetry::shutdown`].
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Installs the global subscriber; call once, first thing in `main`.
pub fn init() -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let provider = ENDPOINT_VARIABLES.iter().any(|v| std::env::var_os(v).is_some()).then(exporting).transpose()?;
    let export = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("keyfence")));
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(export)
        .init();
    Ok(Telemetry { provider })
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
        let Some(provider) = self.provider else { return };
        // Flushing blocks on the exporter's thread; keep it off the runtime's workers.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown().map_err(|e| e.to_string()));
        if let Err(e) = flushed.await.unwrap_or_else(|e| Err(e.to_string())) {
            eprintln!("keyfence: exporting the last spans: {e}");
        }
    }
}
