//! Shares of something every caller draws on (connections, name lookups),
//! counted per caller so one cannot take more than its cap: a share is
//! taken while one is free and given back when dropped.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// What each key has under way; cheap to clone (the clones count together).
#[derive(Debug)]
pub struct Shares<K>(Arc<Mutex<HashMap<K, usize>>>);

impl<K> Clone for Shares<K> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<K> Default for Shares<K> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

/// One share of `K`'s, given back when dropped.
#[derive(Debug)]
pub struct Share<K: Eq + Hash>(Shares<K>, K);

impl<K: Eq + Hash + Clone> Shares<K> {
    /// One more share for `key`, unless it already has `cap`.
    pub fn take(&self, key: K, cap: usize) -> Option<Share<K>> {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(key.clone()).or_default();
        if *count >= cap {
            return None;
        }
        *count += 1;
        Some(Share(self.clone(), key))
    }
}

impl<K: Eq + Hash> Drop for Share<K> {
    fn drop(&mut self) {
        let mut counts = self.0.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.1) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Shares;

    #[test]
    fn a_key_has_at_most_its_cap_and_gets_each_back_when_dropped() {
        let shares = Shares::default();
        let taken: Vec<_> = (0..3).map(|_| shares.take("a", 3).unwrap()).collect();
        assert!(shares.take("a", 3).is_none(), "a fourth is refused");
        assert!(shares.take("b", 3).is_some(), "another key has its own");
        drop(taken);
        assert!(shares.take("a", 3).is_some());
        assert!(shares.0.lock().unwrap().is_empty(), "nothing is kept for keys with nothing under way");
    }
}
