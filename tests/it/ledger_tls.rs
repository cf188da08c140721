//! The ledger over TLS, against this machine's PostgreSQL (TLS on, with its
//! self-signed certificate for `localhost`): `sslmode=require` encrypts,
//! `verify-full` with the server's certificate as the root verifies it, and
//! `verify-full` against another CA is refused with an error that says so,
//! by the library and by `keyfence migrate` alike.

use keyfence::ledger::Ledger;
use keyfence::ledger::{DatabaseUrl, LedgerSettings};

use crate::harness::TestLedger;

/// The test database's URL on host `localhost` with `query` added.
fn url(db: &TestLedger, query: &str) -> String {
    let plain = db.url.split_once('?').map_or(db.url.as_str(), |(url, _)| url).replace("127.0.0.1", "localhost");
    format!("{plain}?{query}")
}

async fn connect(db: &TestLedger, query: &str) -> Result<Ledger, String> {
    let mut settings: LedgerSettings = db.settings.clone();
    settings.database_url = url(db, query).parse::<DatabaseUrl>().unwrap();
    Ledger::connect(&settings).await.map_err(|e| e.to_string())
}

async fn encrypted(ledger: &Ledger) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_ledger_speaks_tls_and_refuses_a_server_its_ca_did_not_sign() {
    let db = TestLedger::new().await;
    let server_cert: String = sqlx::query_scalar("SHOW ssl_cert_file").fetch_one(db.ledger.pool()).await.unwrap();

    let required = connect(&db, "sslmode=require").await.expect("sslmode=require connects");
    assert!(encrypted(&required).await, "and the session is encrypted");
    let verified = connect(&db, &format!("sslmode=verify-full&sslrootcert={server_cert}")).await;
    assert!(encrypted(&verified.expect("verify-full with the server's own CA connects")).await);

    let another = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/another-ca.pem");
    let refused = connect(&db, &format!("sslmode=verify-full&sslrootcert={another}")).await.err();
    let why = refused.expect("another CA is refused");
    assert!(why.contains("certificate"), "the error says why: {why}");

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_keyfence"))
        .arg("migrate")
        .env("DATABASE_URL", url(&db, &format!("sslmode=verify-full&sslrootcert={another}")))
        .env("AWS_ENDPOINT_URL", std::env::var("AWS_ENDPOINT_URL").unwrap_or("http://127.0.0.1:4566".into()))
        .env("KEYFENCE_TABLE", format!("keyfence-tls-{}", uuid::Uuid::new_v4().simple()))
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "migrate refuses the server");
    assert!(stderr.contains("certificate"), "and says why: {stderr}");
}
