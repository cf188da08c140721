//! The ledger's settings: which PostgreSQL (`DATABASE_URL`, its password
//! never shown) and how many connections its pool holds.

use std::fmt;
use std::str::FromStr;

use clap::{Args, Parser};
use sqlx::postgres::PgConnectOptions;

/// Where the regional ledger lives.
#[derive(Args, Clone, Debug)]
pub struct LedgerSettings {
    /// PostgreSQL URL of this region's ledger (created by `migrate` if missing).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/keyfence",
        hide_env_values = true
    )]
    pub database_url: DatabaseUrl,
    /// Connections the ledger pool holds at most (each phase takes one for its transaction).
    #[arg(long = "ledger-pool-size", env = "KEYFENCE_LEDGER_POOL_SIZE", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub pool_size: u32,
}

impl LedgerSettings {
    /// A ledger a command makes a statement or two of (another region's):
    /// a pool of two.
    pub fn remote(database_url: DatabaseUrl) -> Self {
        Self { database_url, pool_size: 2 }
    }

    /// The settings as flags-less start-up would see them: environment, then defaults.
    pub fn from_env() -> Result<Self, clap::Error> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            settings: LedgerSettings,
        }
        Ok(Only::try_parse_from(["keyfence"])?.settings)
    }
}

/// A PostgreSQL URL, checked when parsed; `Debug` and `Display` hide the password.
#[derive(Clone)]
pub struct DatabaseUrl {
    options: PgConnectOptions,
}

impl DatabaseUrl {
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// The database this URL names (PostgreSQL's default: the user's name).
    pub fn database(&self) -> &str {
        self.options.get_database().unwrap_or_else(|| self.options.get_username())
    }

    /// The same server and credentials, another database.
    pub fn with_database(&self, name: &str) -> Self {
        Self { options: self.options.clone().database(name) }
    }
}

impl FromStr for DatabaseUrl {
    type Err = String;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let options = url.parse::<PgConnectOptions>().map_err(|e| format!("not a PostgreSQL URL: {e}"))?;
        Ok(Self { options })
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        write!(f, "postgres://{}@{}:{}/{}", o.get_username(), o.get_host(), o.get_port(), self.database())
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DatabaseUrl({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_url_hides_its_password() {
        let url: DatabaseUrl = "postgres://app:s3cret@db.internal:6432/ledger".parse().unwrap();
        assert_eq!(url.to_string(), "postgres://app@db.internal:6432/ledger");
        assert!(!format!("{url:?}").contains("s3cret"));
    }
}
