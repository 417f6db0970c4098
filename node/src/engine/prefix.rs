//! The prefix cache: KV pages of token prefixes already computed (system
//! prompts, the earlier turns of a chat), kept by content and handed to the
//! next sequence that starts with the same tokens, so its prefill skips them.
//!
//! A full page of a sequence (positions `i * PAGE..(i + 1) * PAGE`) is named
//! by a hash chain over its tokens: `key_i = SHA-256(key_{i-1} || tokens of
//! page i)`, so a key names the whole prefix up to the end of its page, not
//! only the page's own tokens (the keys and values of a position depend on
//! every token before it). A lookup walks a new prompt's chain from the
//! start and takes the pages it finds until the first miss.
//!
//! One cache per model ([`super::batch`] keeps one beside its pool): keys
//! carry no model identity.
//!
//! # Invariants
//! - The cache holds one reference on each page it lists ([`KvPool`]
//!   counts them); a page shared with running sequences is never evicted.
//!   Only full pages are cached, and a full page is never written again, so
//!   a hit reads exactly the keys and values the sequence would have
//!   computed itself (the kernels give every row the same result whatever
//!   else is in the pass): outputs are identical with and without a hit.
//! - Eviction is least recently used, and within a chain the deeper pages
//!   go first, so a surviving entry's parents survive with it.
//!
//! # Failure
//! Nothing fails: a miss computes the prefix.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

use super::kv::{KvPool, PageId, PAGE};

/// Names a prefix that ends on a page boundary.
pub type PrefixKey = [u8; 32];

/// The chain keys of every full page of `tokens`.
pub fn keys(tokens: &[u32]) -> Vec<PrefixKey> {
    let mut prev = [0u8; 32];
    tokens
        .chunks_exact(PAGE)
        .map(|page| {
            let mut h = Sha256::new();
            h.update(prev);
            for t in page {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize().into();
            prev
        })
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    page: PageId,
    used: u64,
}

/// Cached pages by prefix key, with their age.
#[derive(Debug, Default)]
pub struct PrefixCache {
    entries: HashMap<PrefixKey, Entry>,
    /// Entries by last use, oldest first.
    by_age: BTreeMap<u64, PrefixKey>,
    tick: u64,
}

impl PrefixCache {
    pub fn new() -> PrefixCache {
        PrefixCache::default()
    }

    /// Pages held.
    pub fn pages(&self) -> usize {
        self.entries.len()
    }

    /// Pages that only the cache holds (what eviction can free now).
    pub fn evictable(&self, pool: &KvPool) -> usize {
        self.entries
            .values()
            .filter(|e| pool.refs(e.page) == 1)
            .count()
    }

    fn touch(&mut self, key: PrefixKey) {
        if let Some(e) = self.entries.get_mut(&key) {
            self.by_age.remove(&e.used);
            self.tick += 1;
            e.used = self.tick;
            self.by_age.insert(self.tick, key);
        }
    }

    /// The cached pages that begin `tokens`, at most `max_pages` of them, each
    /// now also held once by the caller (who releases them with its
    /// sequence).
    pub fn lookup(&mut self, pool: &mut KvPool, tokens: &[u32], max_pages: usize) -> Vec<PageId> {
        let chain = keys(tokens);
        let mut found = Vec::new();
        for key in chain.iter().take(max_pages) {
            match self.entries.get(key) {
                Some(e) => found.push((*key, e.page)),
                None => break,
            }
        }
        // The deepest page is touched first, so it is the oldest of its chain.
        for &(key, page) in found.iter().rev() {
            self.touch(key);
            pool.retain(page);
        }
        found.into_iter().map(|(_, page)| page).collect()
    }

    /// Offers a sequence's pages: `pages[i]` holds the keys and values of
    /// `tokens[i * PAGE..(i + 1) * PAGE]`; every full page of `tokens` not
    /// cached yet is kept (one more reference on it).
    pub fn insert(&mut self, pool: &mut KvPool, tokens: &[u32], pages: &[PageId]) {
        let chain = keys(tokens);
        for (key, &page) in chain.iter().zip(pages).rev() {
            if !self.entries.contains_key(key) {
                pool.retain(page);
                self.entries.insert(*key, Entry { page, used: 0 });
            }
            self.touch(*key);
        }
    }

    /// Frees the least recently used page that no sequence holds; `false`
    /// when every cached page is in use (or none is cached).
    pub fn evict(&mut self, pool: &mut KvPool) -> bool {
        let victim = self
            .by_age
            .iter()
            .find(|(_, key)| {
                self.entries
                    .get(*key)
                    .is_some_and(|e| pool.refs(e.page) == 1)
            })
            .map(|(&age, &key)| (age, key));
        let Some((age, key)) = victim else {
            return false;
        };
        self.by_age.remove(&age);
        if let Some(e) = self.entries.remove(&key) {
            pool.release(e.page);
        }
        true
    }

    /// Lets go of every page.
    pub fn clear(&mut self, pool: &mut KvPool) {
        for e in self.entries.values() {
            pool.release(e.page);
        }
        self.entries.clear();
        self.by_age.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv::KvShape;

    fn pool(pages: usize) -> KvPool {
        KvPool::new(
            KvShape {
                layers: 1,
                kv_heads: 1,
                head_dim: 4,
            },
            pages,
        )
        .unwrap()
    }

    fn take(pool: &mut KvPool, n: usize) -> Vec<PageId> {
        (0..n).map(|_| pool.alloc().unwrap()).collect()
    }

    #[test]
    fn a_key_names_the_whole_prefix_not_only_its_page() {
        let a: Vec<u32> = (0..2 * PAGE as u32).collect();
        let mut b = a.clone();
        b[0] = 999; // same second page, different first page
        let (ka, kb) = (keys(&a), keys(&b));
        assert_eq!(ka.len(), 2);
        assert_ne!(ka[1], kb[1]);
        assert_eq!(keys(&a[..PAGE + 3]), ka[..1], "partial pages have no key");
    }

    #[test]
    fn lookups_find_the_longest_cached_start_and_hold_its_pages() {
        let mut pool = pool(8);
        let mut cache = PrefixCache::new();
        let prompt: Vec<u32> = (0..3 * PAGE as u32 + 5).collect();
        let pages = take(&mut pool, 4);
        cache.insert(&mut pool, &prompt, &pages);
        assert_eq!(cache.pages(), 3, "three full pages");
        for &p in &pages {
            pool.release(p); // the sequence ends; the cache keeps its pages
        }
        assert_eq!(pool.free_pages(), 8 - 3);
        // A prompt sharing two pages and then diverging.
        let mut other = prompt.clone();
        other[2 * PAGE + 1] = 7;
        let hit = cache.lookup(&mut pool, &other, usize::MAX);
        assert_eq!(hit, pages[..2]);
        assert_eq!(pool.refs(pages[0]), 2, "the cache and the caller");
        assert_eq!(cache.lookup(&mut pool, &prompt, 1), pages[..1]);
        assert!(cache.lookup(&mut pool, &[5; PAGE], 8).is_empty());
    }

    #[test]
    fn eviction_is_lru_deepest_first_and_spares_pages_in_use() {
        let mut pool = pool(8);
        let mut cache = PrefixCache::new();
        let a: Vec<u32> = (0..2 * PAGE as u32).collect();
        let b: Vec<u32> = (100..100 + PAGE as u32).collect();
        let pa = take(&mut pool, 2);
        let pb = take(&mut pool, 1);
        cache.insert(&mut pool, &a, &pa);
        cache.insert(&mut pool, &b, &pb);
        for &p in pa.iter().chain(&pb) {
            pool.release(p);
        }
        // `a` used again: `b` is now the oldest.
        let held = cache.lookup(&mut pool, &a, 8);
        assert_eq!(cache.evictable(&pool), 1, "a's pages are in use");
        assert!(cache.evict(&mut pool));
        assert!(cache.lookup(&mut pool, &b, 8).is_empty(), "b went first");
        assert!(!cache.evict(&mut pool), "the rest is in use");
        for p in held {
            pool.release(p);
        }
        // Deepest first: a's second page goes before its first.
        assert!(cache.evict(&mut pool));
        let first = cache.lookup(&mut pool, &a, 8);
        assert_eq!(first, pa[..1]);
        pool.release(first[0]);
        assert!(cache.evict(&mut pool));
        assert_eq!(cache.pages(), 0);
        assert_eq!(pool.free_pages(), 8);
    }
}
