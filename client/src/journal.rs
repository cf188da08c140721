//! The journal: which idempotency key belongs to which logical operation,
//! kept in a local file so that a client process that crashes and starts
//! again sends the same key, never a new one.
//!
//! One JSON object per line, `{"operation": ..., "key": ...}`, appended and
//! flushed to disk (`fsync`) before the key is used for the first time.
//! Only whole lines count: bytes after the last newline are a torn append
//! (a crash or a failed write in the middle of one), whose key was never
//! handed out. They are cut off before the next append, so that an entry
//! never runs on from a torn one and is lost with it.
//!
//! One writer at a time: opening takes an exclusive lock on the file (an
//! advisory `flock` on Unix, `LockFileEx` on Windows), held until the
//! journal is dropped. Two writers could each mint a key for one operation
//! and pay it twice, so a second opener, in this process or another, fails
//! at once with [`JournalError::Locked`] rather than waiting: a command
//! that waits on a lock held by a forgotten process looks hung, while one
//! that fails names the file.
//!
//! A new journal is readable by its owner only (mode 0600 on Unix): its
//! keys replay payments. Its directory is flushed on opening, so that
//! after a crash the file itself is there, not only its contents.

use std::collections::HashMap;
use std::fmt;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::OperationId;

/// The journal could not be opened, read or written: without it no key is
/// safe to use, so nothing is sent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// Another [`Journal`], in this process or another, has the file open.
    #[error("journal {path} is in use by another process (or another client in this one); one journal has one writer")]
    Locked {
        /// The journal's file.
        path: PathBuf,
    },
    /// The file system refused.
    #[error("journal {path}: {source}")]
    Io {
        /// The journal's file.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: io::Error,
    },
}

#[derive(Serialize, Deserialize)]
struct Entry {
    operation: String,
    key: String,
}

/// A file-backed map from operation to idempotency key, held exclusively.
pub struct Journal {
    path: PathBuf,
    state: Mutex<State>,
}

struct State {
    /// Locked for as long as it is open.
    file: File,
    keys: HashMap<String, String>,
    /// Where the last whole entry ends: anything past it is torn.
    whole: u64,
}

impl Journal {
    /// Opens the journal at `path`, creating it if it does not exist, and
    /// locks it; fails with [`JournalError::Locked`] if it is held.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        let failed = |source| JournalError::Io { path: path.clone(), source };
        let file = open_or_create(&path).map_err(failed)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(JournalError::Locked { path }),
            Err(TryLockError::Error(e)) => return Err(failed(e)),
        }
        let (keys, whole, unended) = read(&file).map_err(failed)?;
        let mut state = State { file, keys, whole };
        if unended {
            // A whole entry whose newline was never written (as an earlier
            // version of this crate could leave one): its key may have been
            // used, so it is kept, and ended.
            state.append(b"\n").map_err(failed)?;
        }
        Ok(Self { path, state: Mutex::new(state) })
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
        state.append(&line).map_err(|source| JournalError::Io { path: self.path.clone(), source })?;
        state.keys.insert(entry.operation, key.clone());
        Ok(key)
    }

    /// The key journalled for `operation`, if any.
    pub fn existing(&self, operation: &OperationId) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.keys.get(operation.as_str()).cloned()
    }
}

/// The file and how many operations it holds, never their keys.
impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        f.debug_struct("Journal").field("path", &self.path).field("operations", &state.keys.len()).finish()
    }
}

impl State {
    /// Appends `line` after the last whole entry, durably.
    fn append(&mut self, line: &[u8]) -> io::Result<()> {
        if self.file.metadata()?.len() > self.whole {
            self.file.set_len(self.whole)?;
        }
        self.file.write_all(line)?;
        self.file.sync_data()?;
        self.whole += line.len() as u64;
        Ok(())
    }
}

/// Opens the journal's file for reading and appending, creating it (owner
/// only) if there is none, and makes its directory entry durable: a file
/// created just before a crash is otherwise not there after it.
fn open_or_create(path: &Path) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).append(true).create(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let file = options.open(path)?;
    sync_directory(path)?;
    Ok(file)
}

/// Flushes the directory that holds `path` (Unix; elsewhere the file
/// system does, or offers no way to).
fn sync_directory(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        let directory = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(directory)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Every whole entry's key (the first for an operation, if a line repeats
/// one), where the whole entries end, and whether the last of them lacks
/// its newline. Lines that do not parse are skipped: torn lines ended by an
/// earlier version of this crate.
fn read(file: &File) -> io::Result<(HashMap<String, String>, u64, bool)> {
    let mut reader = BufReader::new(file);
    let mut keys = HashMap::new();
    let mut whole = 0;
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line)?;
        let ended = line.last() == Some(&b'\n');
        let entry = serde_json::from_slice::<Entry>(&line);
        if !ended {
            // The end of the file: nothing more, a torn entry (cut off at
            // the next append), or a whole one without its newline.
            let Ok(entry) = entry else { return Ok((keys, whole, false)) };
            keys.entry(entry.operation).or_insert(entry.key);
            return Ok((keys, whole + read as u64, true));
        }
        whole += read as u64;
        if let Ok(entry) = entry {
            keys.entry(entry.operation).or_insert(entry.key);
        }
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

    /// Every line of the file, read back: each must be a whole entry.
    fn entries(path: &Path) -> Vec<Entry> {
        let text = std::fs::read_to_string(path).unwrap();
        assert!(text.ends_with('\n'), "{text}");
        text.lines().map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"))).collect()
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
    fn a_second_open_of_one_journal_fails_at_once_naming_it() {
        let path = scratch("locked");
        let first = Journal::open(&path).unwrap();
        match Journal::open(&path) {
            Err(JournalError::Locked { path: named }) => assert_eq!(named, path),
            other => panic!("a second writer is refused: {other:?}"),
        }
        drop(first);
        Journal::open(&path).expect("the lock goes with the journal");
    }

    #[test]
    fn a_journal_shows_no_keys_in_debug() {
        let journal = Journal::open(scratch("debug")).unwrap();
        let key = journal.key_for(&OperationId::new("invoice-1").unwrap()).unwrap();
        let shown = format!("{journal:?}");
        assert!(!shown.contains(&key), "{shown}");
        assert!(shown.contains("operations: 1"), "{shown}");
    }

    #[cfg(unix)]
    #[test]
    fn a_new_journal_is_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let path = scratch("mode");
        drop(Journal::open(&path).unwrap());
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn a_whole_entry_without_its_newline_is_kept_and_not_run_into() {
        let path = scratch("torn-newline");
        let kept = OperationId::new("kept").unwrap();
        let key = Journal::open(&path).unwrap().key_for(&kept).unwrap();
        // Its key may have been handed out (an earlier version read such a line): it stays.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(br#"{"operation":"unended","key":"maybe-used"}"#).unwrap();
        let after = OperationId::new("after").unwrap();
        let fresh = Journal::open(&path).unwrap().key_for(&after).unwrap();
        assert_eq!(entries(&path).len(), 3, "every entry whole, none run into another");
        let reopened = Journal::open(&path).unwrap();
        assert_eq!(reopened.existing(&kept), Some(key));
        assert_eq!(reopened.existing(&OperationId::new("unended").unwrap()).as_deref(), Some("maybe-used"));
        assert_eq!(reopened.existing(&after), Some(fresh));
    }

    #[test]
    fn a_short_write_is_cut_off_before_the_next_entry() {
        let path = scratch("short-write");
        let journal = Journal::open(&path).unwrap();
        let first = journal.key_for(&OperationId::new("first").unwrap()).unwrap();
        // What a failed append leaves: part of an entry, no newline.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(br#"{"operation":"lost","key":"0190"#).unwrap();
        let next = OperationId::new("next").unwrap();
        let key = journal.key_for(&next).unwrap();
        drop(journal);
        assert_eq!(entries(&path).len(), 2, "the torn entry is gone, the new one whole");
        let reopened = Journal::open(&path).unwrap();
        assert_eq!(reopened.existing(&OperationId::new("first").unwrap()), Some(first));
        assert_eq!(reopened.existing(&next), Some(key));
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
        drop(journal);
        let reopened = Journal::open(&path).unwrap();
        assert_eq!(reopened.existing(&op), Some(kept));
        assert_eq!(reopened.existing(&torn), Some(fresh));
    }
}
