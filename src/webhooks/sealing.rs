//! Webhook signing secrets sealed at rest. An endpoint's secret is stored
//! encrypted (AES-256-GCM, with what it is sealed for as associated data:
//! its client and endpoint, so a sealed secret moved to another endpoint or
//! client does not open), under either
//! - a data key from AWS KMS (envelope encryption): the key table holds the
//!   data key as KMS wrapped it, under the encryption context
//!   `purpose=keyfence-webhook-secrets`, so a role without `kms:Decrypt` on
//!   the KMS key (an SRE's, a copy of the table) reads no secret. One data
//!   key seals for five minutes at most; opened data keys are kept in
//!   memory, so a delivery costs no KMS call once its key is known. With a
//!   multi-Region KMS key every region opens what any region sealed.
//! - a local key, read from a file (32 random bytes, in base64), for
//!   deployments without KMS; or, with neither set and the key table on
//!   this machine only, a fixed development key.
//!
//! A secret stored before secrets were sealed (`whsec_...`) still signs;
//! `keyfence migrate` seals it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use aws_sdk_kms::primitives::Blob;
use aws_sdk_kms::types::DataKeySpec;
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use clap::Args;
use sha2::Digest as _;
use tokio::sync::Mutex;

use crate::keystore::KeyStoreSettings;

/// What every sealed secret begins with (and no secret in the clear does).
const SEALED: &str = "kfsealed1";

/// The encryption context of every data key: a data key KMS made for
/// anything else does not open here, and a policy can allow keyfence's
/// data keys only.
const CONTEXT: (&str, &str) = ("purpose", "keyfence-webhook-secrets");

/// How long one data key seals new secrets.
const DATA_KEY_FOR: Duration = Duration::from_secs(300);

/// Data keys an instance keeps open.
const OPENED_KEPT: usize = 1024;

/// What the development key is made from: it protects nothing, and is
/// refused wherever the key table is not on this machine.
const DEVELOPMENT_KEY_SEED: &str = "keyfence local development webhook sealing key";

/// How webhook secrets are sealed.
#[derive(Args, Clone, Debug, Default)]
pub struct SealingSettings {
    /// The AWS KMS key that seals webhook secrets (a key id, ARN or alias of this region; a
    /// multi-Region key, so every region opens what another sealed).
    #[arg(
        id = "webhook-kms-key",
        long = "webhook-kms-key",
        env = "KEYFENCE_WEBHOOK_KMS_KEY",
        conflicts_with = "webhook-sealing-key-file"
    )]
    pub kms_key: Option<String>,
    /// A file holding the key that seals webhook secrets (32 random bytes in base64:
    /// `head -c32 /dev/urandom | base64`), where KMS is not used.
    #[arg(
        id = "webhook-sealing-key-file",
        long = "webhook-sealing-key-file",
        env = "KEYFENCE_WEBHOOK_SEALING_KEY_FILE"
    )]
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error(
        "webhook secrets have no key to be sealed with: set KEYFENCE_WEBHOOK_KMS_KEY (AWS KMS) or \
         KEYFENCE_WEBHOOK_SEALING_KEY_FILE (the development key is used only while the key table is on this machine)"
    )]
    NoKey,
    #[error("the webhook sealing key file {0} could not be read: {1}")]
    KeyFile(PathBuf, String),
    #[error("the webhook sealing key file {0} does not hold 32 bytes in base64")]
    KeyMalformed(PathBuf),
    #[error("AWS KMS refused or failed: {0}")]
    Kms(String),
    #[error("a sealed webhook secret is malformed")]
    Malformed,
    #[error("a sealed webhook secret was sealed with another key ({0}) than this instance's")]
    OtherKey(String),
    #[error("a sealed webhook secret does not open: altered, or not this endpoint's")]
    Altered,
    #[error("could not draw random bytes")]
    Random,
}

/// Seals and opens webhook secrets. Cheap to clone.
#[derive(Clone)]
pub struct Sealer {
    how: Arc<How>,
}

enum How {
    Local {
        key: LessSafeKey,
        id: String,
    },
    Kms(Kms),
    /// For work that neither seals nor opens (listing endpoints).
    Unavailable,
}

struct Kms {
    client: aws_sdk_kms::Client,
    key_id: String,
    current: Mutex<Option<DataKey>>,
    opened: quick_cache::sync::Cache<Vec<u8>, Arc<LessSafeKey>>,
}

/// The data key that seals new secrets, as KMS made it.
struct DataKey {
    wrapped: Vec<u8>,
    key: Arc<LessSafeKey>,
    made: Instant,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.how {
            How::Local { id, .. } => write!(f, "Sealer(local key {id})"),
            How::Kms(kms) => write!(f, "Sealer(KMS key {})", kms.key_id),
            How::Unavailable => write!(f, "Sealer(none)"),
        }
    }
}

impl Sealer {
    /// The sealer `settings` name, against the key table `keys` names (its
    /// AWS settings reach KMS too).
    pub async fn new(settings: &SealingSettings, keys: &KeyStoreSettings) -> Result<Self, SealError> {
        let how = match (&settings.kms_key, &settings.key_file) {
            (Some(key_id), _) => {
                let shared = crate::keystore::sdk_config(keys).await.map_err(|e| SealError::Kms(e.to_string()))?;
                How::Kms(Kms {
                    client: aws_sdk_kms::Client::new(&shared),
                    key_id: key_id.clone(),
                    current: Mutex::new(None),
                    opened: quick_cache::sync::Cache::new(OPENED_KEPT),
                })
            }
            (None, Some(path)) => {
                let text =
                    std::fs::read_to_string(path).map_err(|e| SealError::KeyFile(path.clone(), e.to_string()))?;
                let bytes = STANDARD
                    .decode(text.trim())
                    .ok()
                    .filter(|b| b.len() == 32)
                    .ok_or_else(|| SealError::KeyMalformed(path.clone()))?;
                local(&bytes)
            }
            (None, None) if keys.local_endpoint() => local(&sha2::Sha256::digest(DEVELOPMENT_KEY_SEED)),
            (None, None) => return Err(SealError::NoKey),
        };
        Ok(Self { how: Arc::new(how) })
    }

    /// A sealer for work that never seals nor opens a secret: either
    /// refuses with [`SealError::NoKey`].
    pub fn unavailable() -> Self {
        Self { how: Arc::new(How::Unavailable) }
    }

    /// `secret` sealed for `context` (what it belongs to).
    pub async fn seal(&self, secret: &str, context: &str) -> Result<String, SealError> {
        let (kind, label, sealed) = match &*self.how {
            How::Local { key, id } => ("local", id.clone(), seal_with(key, secret, context)?),
            How::Kms(kms) => {
                let (wrapped, key) = kms.sealing_key().await?;
                ("kms", URL_SAFE_NO_PAD.encode(wrapped), seal_with(&key, secret, context)?)
            }
            How::Unavailable => return Err(SealError::NoKey),
        };
        Ok(format!("{SEALED}.{kind}.{label}.{sealed}"))
    }

    /// The secret `stored` holds for `context` (what it was sealed for):
    /// opened if sealed, as it is if stored before secrets were sealed.
    pub async fn open(&self, stored: &str, context: &str) -> Result<String, SealError> {
        if !is_sealed(stored) {
            metrics::counter!("keyfence_webhook_secrets_in_clear_total").increment(1);
            return Ok(stored.to_owned());
        }
        let parts: Vec<&str> = stored.split('.').collect();
        let [_, kind, label, sealed] = parts[..] else { return Err(SealError::Malformed) };
        let sealed = URL_SAFE_NO_PAD.decode(sealed).map_err(|_| SealError::Malformed)?;
        match (&*self.how, kind) {
            (How::Local { key, id }, "local") if id == label => open_with(key, sealed, context),
            (How::Kms(kms), "kms") => {
                let wrapped = URL_SAFE_NO_PAD.decode(label).map_err(|_| SealError::Malformed)?;
                let key = kms.opening_key(wrapped).await?;
                open_with(&key, sealed, context)
            }
            (How::Unavailable, _) => Err(SealError::NoKey),
            (_, "local") => Err(SealError::OtherKey(format!("local key {label}"))),
            (_, "kms") => Err(SealError::OtherKey("an AWS KMS key".into())),
            _ => Err(SealError::Malformed),
        }
    }
}

/// Whether `stored` is a sealed secret (not one kept in the clear).
pub fn is_sealed(stored: &str) -> bool {
    stored.starts_with(SEALED)
}

fn local(bytes: &[u8]) -> How {
    let id = hex::encode(&sha2::Sha256::digest(bytes)[..4]);
    How::Local { key: aes_key(bytes), id }
}

fn aes_key(bytes: &[u8]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, bytes).expect("an AES-256 key is 32 bytes"))
}

/// The random nonce, then the ciphertext and its tag, in base64.
fn seal_with(key: &LessSafeKey, secret: &str, context: &str) -> Result<String, SealError> {
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut nonce).map_err(|_| SealError::Random)?;
    let mut sealed = secret.as_bytes().to_vec();
    key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(context.as_bytes()), &mut sealed)
        .map_err(|_| SealError::Random)?;
    Ok(URL_SAFE_NO_PAD.encode([&nonce[..], &sealed].concat()))
}

fn open_with(key: &LessSafeKey, sealed: Vec<u8>, context: &str) -> Result<String, SealError> {
    if sealed.len() < NONCE_LEN {
        return Err(SealError::Malformed);
    }
    let (nonce, rest) = sealed.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Malformed)?;
    let mut rest = rest.to_vec();
    let open = key.open_in_place(nonce, Aad::from(context.as_bytes()), &mut rest).map_err(|_| SealError::Altered)?;
    String::from_utf8(open.to_vec()).map_err(|_| SealError::Altered)
}

impl Kms {
    /// The current data key, a new one once it has sealed long enough.
    async fn sealing_key(&self) -> Result<(Vec<u8>, Arc<LessSafeKey>), SealError> {
        let mut current = self.current.lock().await;
        if let Some(key) = current.as_ref().filter(|k| k.made.elapsed() < DATA_KEY_FOR) {
            return Ok((key.wrapped.clone(), key.key.clone()));
        }
        let made = self
            .client
            .generate_data_key()
            .key_id(&self.key_id)
            .key_spec(DataKeySpec::Aes256)
            .encryption_context(CONTEXT.0, CONTEXT.1)
            .send()
            .await
            .map_err(|e| SealError::Kms(aws_sdk_kms::error::DisplayErrorContext(e).to_string()))?;
        let (Some(plain), Some(wrapped)) = (made.plaintext(), made.ciphertext_blob()) else {
            return Err(SealError::Kms("GenerateDataKey answered without a key".into()));
        };
        if plain.as_ref().len() != 32 {
            return Err(SealError::Kms("GenerateDataKey answered with a key that is not 256 bits".into()));
        }
        let key = Arc::new(aes_key(plain.as_ref()));
        let wrapped = wrapped.as_ref().to_vec();
        self.opened.insert(wrapped.clone(), key.clone());
        *current = Some(DataKey { wrapped: wrapped.clone(), key: key.clone(), made: Instant::now() });
        Ok((wrapped, key))
    }

    /// The data key `wrapped` holds, from memory or from KMS.
    async fn opening_key(&self, wrapped: Vec<u8>) -> Result<Arc<LessSafeKey>, SealError> {
        if let Some(key) = self.opened.get(&wrapped) {
            return Ok(key);
        }
        let opened = self
            .client
            .decrypt()
            .key_id(&self.key_id)
            .ciphertext_blob(Blob::new(wrapped.clone()))
            .encryption_context(CONTEXT.0, CONTEXT.1)
            .send()
            .await
            .map_err(|e| SealError::Kms(aws_sdk_kms::error::DisplayErrorContext(e).to_string()))?;
        let plain = opened.plaintext().ok_or_else(|| SealError::Kms("Decrypt answered without a key".into()))?;
        if plain.as_ref().len() != 32 {
            return Err(SealError::Malformed);
        }
        let key = Arc::new(aes_key(plain.as_ref()));
        self.opened.insert(wrapped, key.clone());
        Ok(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealer(bytes: &[u8]) -> Sealer {
        Sealer { how: Arc::new(local(bytes)) }
    }

    #[tokio::test]
    async fn a_sealed_secret_opens_for_its_endpoint_only_and_with_its_key_only() {
        let (mine, other) = (sealer(&[7; 32]), sealer(&[8; 32]));
        let sealed = mine.seal("whsec_abc", "endpoint-1").await.unwrap();
        assert!(is_sealed(&sealed) && !sealed.contains("whsec_abc"), "{sealed}");
        assert_eq!(mine.open(&sealed, "endpoint-1").await.unwrap(), "whsec_abc");
        assert!(matches!(mine.open(&sealed, "endpoint-2").await, Err(SealError::Altered)));
        assert!(matches!(other.open(&sealed, "endpoint-1").await, Err(SealError::OtherKey(_))));
        assert_ne!(sealed, mine.seal("whsec_abc", "endpoint-1").await.unwrap(), "a fresh nonce each time");
    }

    #[tokio::test]
    async fn an_altered_seal_does_not_open_and_a_secret_in_the_clear_reads_as_it_is() {
        let mine = sealer(&[7; 32]);
        let sealed = mine.seal("whsec_abc", "e").await.unwrap();
        let (head, body) = sealed.rsplit_once('.').unwrap();
        let mut bytes = URL_SAFE_NO_PAD.decode(body).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        let altered = format!("{head}.{}", URL_SAFE_NO_PAD.encode(bytes));
        assert!(matches!(mine.open(&altered, "e").await, Err(SealError::Altered)));
        assert!(matches!(mine.open(&format!("{SEALED}.local.x"), "e").await, Err(SealError::Malformed)));
        assert_eq!(mine.open("whsec_old", "e").await.unwrap(), "whsec_old");
    }
}
