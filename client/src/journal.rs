//! The journal: which idempotency key belongs to which logical operation,
//! kept in a local file so that a client process that crashes and starts
//! again sends the same key, never a new one.
//!
//! One JSON object per line, `{"operation": ..., "key": ...}`, appended and
//! flushed to disk (`fsync`) before the key is used for the first time. A
//! torn last line, from a crash in the middle of an append, is ignored: its
//! key was never sent, because sending waits for the append.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::OperationId;

/// The journal could not be read or written: without it no key is safe to
/// use, so nothing is sent.
#[derive(Debug, thiserror::Error)]
#[error("journal {path}: {source}")]
pub struct JournalError {
    /// The journal's file.
    pub path: PathBuf,
    /// What the file system said.
    #[source]
    pub source: std::io::Error,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    operation: String,
    key: String,
}

/// A file-backed map from operation to idempotency key.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    file: File,
    keys: HashMap<String, String>,
}

impl Journal {
    /// Opens the journal at `path`, creating it if it does not exist.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        let failed = |source| JournalError { path: path.clone(), source };
        let mut file = OpenOptions::new().create(true).read(true).append(true).open(&path).map_err(failed)?;
        let mut keys = HashMap::new();
        let mut torn = false;
        for line in BufReader::new(&file).split(b'\n') {
            let line = line.map_err(failed)?;
            match serde_json::from_slice::<Entry>(&line) {
                Ok(entry) => {
                    keys.entry(entry.operation).or_insert(entry.key);
                    torn = false;
                }
                Err(_) => torn = !line.is_empty(),
            }
        }
        if torn {
            // End the torn line, so the next entry starts on a line of its own.
            file.write_all(b"\n").and_then(|()| file.sync_data()).map_err(failed)?;
        }
        Ok(Self { path, state: Mutex::new(State { file, keys }) })
    }

    /// The key of `operation`: the one journalled before, or a new one,
    /// durably journalled before this returns.
    pub fn key_for(&self, operation: &OperationId) -> Result<String, JournalError> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(key) = state.keys.get(operation.as_str()) {
            return Ok(key.clone());
        }
        let key = uuid::Uuid::new_v4().to_string();
        let entry = Entry { operation: operation.as_str().to_owned(), key: key.clone() };
        let mut line = serde_json::to_vec(&entry).expect("an entry is plain strings");
        line.push(b'\n');
        let failed = |source| JournalError { path: self.path.clone(), source };
        state.file.write_all(&line).map_err(failed)?;
        state.file.sync_data().map_err(failed)?;
        state.keys.insert(entry.operation, key.clone());
        Ok(key)
    }

    /// The key journalled for `operation`, if any.
    pub fn existing(&self, operation: &OperationId) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.keys.get(operation.as_str()).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("keyfence-journal-{}-{name}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("journal")
    }

    #[test]
    fn a_reopened_journal_gives_the_same_key() {
        let path = scratch("reopen");
        let op = OperationId::new("invoice-1").unwrap();
        let first = Journal::open(&path).unwrap().key_for(&op).unwrap();
        let again = Journal::open(&path).unwrap();
        assert_eq!(again.existing(&op), Some(first.clone()));
        assert_eq!(again.key_for(&op).unwrap(), first);
        let other = again.key_for(&OperationId::new("invoice-2").unwrap()).unwrap();
        assert_ne!(other, first);
    }

    #[test]
    fn a_torn_last_line_is_ignored_and_the_rest_kept() {
        let path = scratch("torn");
        let op = OperationId::new("kept").unwrap();
        let kept = Journal::open(&path).unwrap().key_for(&op).unwrap();
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(br#"{"operation":"torn","ke"#).unwrap();
        let journal = Journal::open(&path).unwrap();
        assert_eq!(journal.existing(&op), Some(kept.clone()));
        let torn = OperationId::new("torn").unwrap();
        assert_eq!(journal.existing(&torn), None);
        let fresh = journal.key_for(&torn).unwrap();
        let reopened = Journal::open(&path).unwrap();
        assert_eq!(reopened.existing(&op), Some(kept));
        assert_eq!(reopened.existing(&torn), Some(fresh));
    }
}
