//! The key store's settings: which table, where (AWS, LocalStack or an
//! emulator on this machine, chosen only by endpoint), and how patiently
//! the SDK asks it. Read from a flag, else the environment (the standard
//! `AWS_ENDPOINT_URL` and `AWS_REGION` among them), else a default that
//! suits the local stack.

use std::time::Duration;

use clap::{Args, Parser};

/// Where the key table lives and how the SDK talks to it.
#[derive(Args, Clone, Debug)]
pub struct KeyStoreSettings {
    /// DynamoDB table holding the idempotency keys.
    #[arg(long = "table", env = "KEYFENCE_TABLE", default_value = "keyfence-keys", value_parser = parse_table_name)]
    pub table: String,
    /// DynamoDB endpoint; unset means AWS itself. Local: http://127.0.0.1:4566.
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub aws_endpoint_url: Option<String>,
    /// AWS region of the key table. Unset: the SDK's region chain (AWS_DEFAULT_REGION, the
    /// profile, the instance's metadata); us-east-1 for a loopback endpoint.
    #[arg(long, env = "AWS_REGION")]
    pub aws_region: Option<String>,
    /// Sign with made-up credentials when none are configured: for an emulator that is not on
    /// loopback (a loopback endpoint gets them anyway). Never for AWS.
    #[arg(long = "aws-dummy-credentials", env = "KEYFENCE_AWS_DUMMY_CREDENTIALS")]
    pub dummy_credentials: bool,
    /// Attempts per key-store request, the first included (SDK standard retry mode). Unset:
    /// AWS_MAX_ATTEMPTS, else 3.
    #[arg(long = "keystore-attempts", env = "KEYFENCE_KEYSTORE_ATTEMPTS",
          value_parser = clap::value_parser!(u32).range(1..=10))]
    pub max_attempts: Option<u32>,
    /// Time limit of one key-store attempt, in milliseconds.
    #[arg(long = "keystore-attempt-timeout-ms", env = "KEYFENCE_KEYSTORE_ATTEMPT_TIMEOUT_MS",
          default_value = "5000", value_parser = crate::domain::parse_millis)]
    pub attempt_timeout: Duration,
}

impl KeyStoreSettings {
    /// Whether the key table is an emulator on this machine (the endpoint is
    /// a loopback address): only then do local-development defaults apply.
    /// The endpoint is keyfence's setting (`AWS_ENDPOINT_URL`), else the
    /// one the SDK reads for DynamoDB alone (`AWS_ENDPOINT_URL_DYNAMODB`).
    pub fn local_endpoint(&self) -> bool {
        // The SDK reads it only while configured endpoints are not ignored.
        let ignored =
            std::env::var("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        let sdk_own = || std::env::var("AWS_ENDPOINT_URL_DYNAMODB").ok().filter(|_| !ignored);
        self.aws_endpoint_url.clone().or_else(sdk_own).as_deref().is_some_and(is_loopback_url)
    }

    /// The settings as flags-less start-up would see them: environment, then defaults.
    pub fn from_env() -> Result<Self, clap::Error> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            settings: KeyStoreSettings,
        }
        Ok(Only::try_parse_from(["keyfence"])?.settings)
    }
}

/// Whether `url` names this machine: `localhost`, 127.0.0.0/8 or `::1`.
fn is_loopback_url(url: &str) -> bool {
    let Some(host) = reqwest::Url::parse(url).ok().and_then(|u| u.host_str().map(str::to_owned)) else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn parse_table_name(name: &str) -> Result<String, String> {
    let valid = (3..=255).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if valid {
        Ok(name.to_owned())
    } else {
        Err("a DynamoDB table name is 3-255 characters of letters, digits, '_', '-' and '.'".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_loopback_endpoint_is_local() {
        for url in ["http://127.0.0.1:4566", "http://localhost:4566", "http://[::1]:4566", "http://127.8.9.10"] {
            assert!(is_loopback_url(url), "{url}");
        }
        for url in [
            "https://dynamodb.eu-west-1.amazonaws.com",
            "https://vpce-0a1b.dynamodb.eu-west-1.vpce.amazonaws.com",
            "http://localstack:4566",
            "http://10.0.0.5:4566",
            "http://localhost.example.com",
            "not a url",
        ] {
            assert!(!is_loopback_url(url), "{url}");
        }
    }

    #[test]
    fn table_names_are_checked() {
        assert!(parse_table_name("keyfence-keys").is_ok());
        assert!(parse_table_name("k").is_err());
        assert!(parse_table_name("bad name").is_err());
    }
}
