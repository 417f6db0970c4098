//! The paged KV cache: one fixed pool of pages per model, shared by every
//! sequence the node runs, and the two operations every architecture's
//! attention does on it (store this pass's keys and values, attend over a
//! sequence's pages).
//!
//! A page holds the keys and values of [`PAGE`] consecutive positions of one
//! sequence, for every layer and KV head of the model (or of a pod rank's
//! share). A sequence owns a page table (`&[PageId]`): position `p` lives in
//! page `table[p / PAGE]`, slot `p % PAGE`. The pool is allocated once, from
//! the node's memory budget, zeroed lazily by the OS; sequences take and give
//! back whole pages, so memory never grows with the load and a full pool is
//! a scheduling decision (wait, evict, preempt), never an out-of-memory crash.
//!
//! Pages are reference-counted so that a prompt prefix computed once is read
//! by several sequences and kept by the prefix cache ([`super::prefix`]):
//! a full page is never written again, only its last, partly filled page is
//! written by the sequence that owns it alone.
//!
//! The same store and attention serve the contiguous single-sequence cache
//! ([`super::ops::LayerCache`]): it is one page of `capacity` positions.
//!
//! # Invariants
//! - Arithmetic is the one of `ops` (keys and values rounded to f16 when
//!   stored, q and the probabilities rounded to f16, f32 dots accumulated in
//!   key order, softmax sums in f64): a row's attention output depends only
//!   on its query and the keys and values of its own sequence, never on the
//!   other rows of the pass, the page size or where the pages lie. So a
//!   sequence gives bit-identical results alone, in any batch, chunked in any
//!   way, and over pages a prefix cache shared with it.
//! - A page is in the free list exactly when its reference count is 0.
//!
//! # Failure
//! [`KvError`] for a pool that cannot be built; [`Rows::check`] rejects a
//! pass whose page tables do not cover its positions, before anything is
//! written (`super::batch::Pass` runs it on every batched pass), so a
//! caller's mistake is an error and never an out-of-bounds panic.

use super::ops::{AttnShape, LayerCache, MAX_HEAD_DIM};

/// Positions per page.
pub const PAGE: usize = 16;

/// Index of a page in its pool.
pub type PageId = u32;

/// What one position of one sequence takes in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Layers (of this model or share) with a cache.
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Bytes of one page (keys and values, f32).
    pub fn page_bytes(&self) -> u64 {
        2 * 4 * (self.layers * self.kv_heads * PAGE * self.head_dim) as u64
    }

    /// Pages that hold `positions` positions.
    pub fn pages_for(positions: usize) -> usize {
        positions.div_ceil(PAGE)
    }
}

/// Why a pool cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    #[error("a kv cache of {bytes} bytes holds no page of {page_bytes} bytes")]
    NoPage { bytes: u64, page_bytes: u64 },
    #[error("a kv cache of {0} pages is more than a page index can address")]
    TooManyPages(usize),
    #[error("kv cache shape {0:?} has an empty dimension")]
    EmptyShape(KvShape),
}

/// The pool: every layer's keys and values, page after page, and which
/// pages are in use.
pub struct KvPool {
    shape: KvShape,
    pages: usize,
    /// Per layer: `[pages][kv_heads][PAGE][head_dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    refs: Vec<u32>,
    /// Free pages; the most recently freed is reused first, so a lightly
    /// loaded node keeps touching the same memory.
    free: Vec<PageId>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("shape", &self.shape)
            .field("pages", &self.pages)
            .field("free", &self.free.len())
            .finish()
    }
}

impl KvPool {
    /// A pool of `pages` pages of `shape`.
    pub fn new(shape: KvShape, pages: usize) -> Result<KvPool, KvError> {
        if shape.layers == 0 || shape.kv_heads == 0 || shape.head_dim == 0 {
            return Err(KvError::EmptyShape(shape));
        }
        if pages == 0 {
            return Err(KvError::NoPage {
                bytes: 0,
                page_bytes: shape.page_bytes(),
            });
        }
        if pages >= PageId::MAX as usize {
            return Err(KvError::TooManyPages(pages));
        }
        let n = pages * shape.kv_heads * PAGE * shape.head_dim;
        // `vec![0.0; n]` is a zeroed allocation: the OS maps the memory
        // lazily, so a large pool costs only what sequences touch.
        let k = (0..shape.layers).map(|_| vec![0.0f32; n]).collect();
        let v = (0..shape.layers).map(|_| vec![0.0f32; n]).collect();
        Ok(KvPool {
            shape,
            pages,
            k,
            v,
            refs: vec![0; pages],
            free: (0..pages as PageId).rev().collect(),
        })
    }

    /// As many pages of `shape` as fit in `bytes`.
    pub fn with_budget(shape: KvShape, bytes: u64) -> Result<KvPool, KvError> {
        let page_bytes = shape.page_bytes();
        let pages = bytes / page_bytes.max(1);
        if pages == 0 {
            return Err(KvError::NoPage { bytes, page_bytes });
        }
        KvPool::new(shape, usize::try_from(pages).unwrap_or(usize::MAX))
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Pages no one holds.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// A free page, now held once; `None` when every page is in use.
    pub fn alloc(&mut self) -> Option<PageId> {
        let page = self.free.pop()?;
        self.refs[page as usize] = 1;
        Some(page)
    }

    /// One more holder of `page` (which must be held already).
    pub fn retain(&mut self, page: PageId) {
        let r = &mut self.refs[page as usize];
        debug_assert!(*r > 0, "retain of a free page");
        *r += 1;
    }

    /// One holder fewer; the page is free again when none is left.
    pub fn release(&mut self, page: PageId) {
        let r = &mut self.refs[page as usize];
        debug_assert!(*r > 0, "release of a free page");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(page);
        }
    }

    /// How many hold `page`.
    pub fn refs(&self, page: PageId) -> u32 {
        self.refs[page as usize]
    }

    /// Layer `layer`'s keys and values.
    pub fn layer(&mut self, layer: usize) -> KvLayer<'_> {
        KvLayer {
            k: &mut self.k[layer],
            v: &mut self.v[layer],
            page_len: PAGE,
            kv_heads: self.shape.kv_heads,
            head_dim: self.shape.head_dim,
        }
    }
}

/// One layer's keys and values, page after page: page `p`, head `h`, slot
/// `s` at `((p * kv_heads + h) * page_len + s) * head_dim`.
#[derive(Debug)]
pub struct KvLayer<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    /// Positions per page.
    pub page_len: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl<'a> KvLayer<'a> {
    /// The contiguous cache of one sequence, as one page of `capacity` positions.
    pub fn contiguous(cache: &'a mut LayerCache, shape: AttnShape) -> KvLayer<'a> {
        KvLayer {
            k: &mut cache.k,
            v: &mut cache.v,
            page_len: shape.capacity.max(1),
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
        }
    }

    fn offset(&self, page: PageId, head: usize, slot: usize) -> usize {
        ((page as usize * self.kv_heads + head) * self.page_len + slot) * self.head_dim
    }
}

/// One sequence's rows in a pass: `len` consecutive tokens from position
/// `pos`, stored through `pages`.
#[derive(Debug, Clone, Copy)]
pub struct RowRun<'t> {
    pub pos: usize,
    pub len: usize,
    pub pages: &'t [PageId],
}

/// Where the rows of one forward pass belong: the runs of each sequence in
/// order (row 0 is the first token of the first run).
#[derive(Debug, Clone)]
pub struct Rows<'t> {
    runs: Vec<RowRun<'t>>,
    /// Per row: its run and its position.
    at: Vec<(u32, u32)>,
}

/// The one page of a contiguous cache.
static CONTIGUOUS: [PageId; 1] = [0];

impl<'t> Rows<'t> {
    pub fn new(runs: Vec<RowRun<'t>>) -> Rows<'t> {
        let mut at = Vec::with_capacity(runs.iter().map(|r| r.len).sum());
        for (i, r) in runs.iter().enumerate() {
            at.extend((r.pos..r.pos + r.len).map(|p| (i as u32, p as u32)));
        }
        Rows { runs, at }
    }

    /// `s` tokens of one sequence from `pos` in a contiguous cache.
    pub fn contiguous(pos: usize, s: usize) -> Rows<'static> {
        Rows::new(vec![RowRun {
            pos,
            len: s,
            pages: &CONTIGUOUS,
        }])
    }

    /// Rows in the pass.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    pub fn runs(&self) -> &[RowRun<'t>] {
        &self.runs
    }

    /// Position of row `row` in its sequence.
    pub fn position(&self, row: usize) -> usize {
        self.at[row].1 as usize
    }

    /// `Err` with the reason unless every run's pages exist in a pool of
    /// `pages` pages of `page_len` positions and cover its positions.
    pub fn check(&self, pages: usize, page_len: usize) -> Result<(), String> {
        for (i, r) in self.runs.iter().enumerate() {
            let need = (r.pos + r.len).div_ceil(page_len.max(1));
            if r.pages.len() < need {
                return Err(format!(
                    "sequence {i}: {} pages do not hold positions up to {}",
                    r.pages.len(),
                    r.pos + r.len
                ));
            }
            if let Some(p) = r.pages[..need].iter().find(|&&p| p as usize >= pages) {
                return Err(format!(
                    "sequence {i}: page {p} is outside the pool of {pages}"
                ));
            }
        }
        Ok(())
    }
}

/// `x` rounded to the nearest f16, back as f32.
fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise the loop.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for j in chunks * 8..a.len() {
        sum += a[j] * b[j];
    }
    sum
}

/// Writes the keys and values of every row (`k`, `v`: `[rows][kv_heads][head_dim]`)
/// at its position, rounded to f16 as llama.cpp's default (f16) cache
/// stores them. The rows were checked against `kv` ([`Rows::check`]).
pub fn store(kv: &mut KvLayer<'_>, rows: &Rows<'_>, k: &[f32], v: &[f32]) {
    let hd = kv.head_dim;
    for (row, &(run, pos)) in rows.at.iter().enumerate() {
        let (pos, run) = (pos as usize, &rows.runs[run as usize]);
        let page = run.pages[pos / kv.page_len];
        for h in 0..kv.kv_heads {
            let src = (row * kv.kv_heads + h) * hd;
            let dst = kv.offset(page, h, pos % kv.page_len);
            for (d, x) in kv.k[dst..dst + hd].iter_mut().zip(&k[src..src + hd]) {
                *d = round_f16(*x);
            }
            for (d, x) in kv.v[dst..dst + hd].iter_mut().zip(&v[src..src + hd]) {
                *d = round_f16(*x);
            }
        }
    }
}

/// How one layer attends.
#[derive(Debug, Clone, Copy)]
pub struct Attend {
    /// Query heads (a multiple of the cache's KV heads).
    pub heads: usize,
    /// Multiplies every score (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a row at position `p` sees positions `> p - window`
    /// only. `None`: every earlier position.
    pub window: Option<usize>,
}

impl Attend {
    /// Full causal attention with the usual `1 / sqrt(head_dim)` scale.
    pub fn causal(heads: usize, head_dim: usize) -> Attend {
        Attend {
            heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        }
    }
}

/// Causal attention of every row's queries (`q`: `[rows][heads][head_dim]`)
/// over its own sequence's keys and values up to and including its
/// position (stored first with [`store`]). Returns `[rows][heads][head_dim]`.
pub fn attention(q: &[f32], kv: &KvLayer<'_>, rows: &Rows<'_>, attend: Attend) -> Vec<f32> {
    let hd = kv.head_dim;
    let heads = attend.heads;
    let group = heads / kv.kv_heads;
    let mut out = vec![0.0f32; q.len()];
    let work = |idx: usize, o: &mut [f32]| {
        let (run, pos) = rows.at[idx / heads];
        let run = &rows.runs[run as usize];
        let kvh = (idx % heads) / group;
        let len = pos as usize + 1;
        let first = attend.window.map_or(0, |w| len.saturating_sub(w));
        // llama.cpp multiplies f16 K by q converted to f16, and f16 V by the
        // probabilities converted to f16; rounding the same way keeps greedy
        // decoding on the same tokens.
        let mut qv = [0f32; MAX_HEAD_DIM];
        let qv = &mut qv[..hd];
        for (d, &x) in qv.iter_mut().zip(&q[idx * hd..(idx + 1) * hd]) {
            *d = round_f16(x);
        }
        // Positions `first..len`, page by page: (offset of the first, count).
        let spans = (first / kv.page_len..len.div_ceil(kv.page_len)).map(|i| {
            let from = (i * kv.page_len).max(first);
            let to = ((i + 1) * kv.page_len).min(len);
            (
                kv.offset(run.pages[i], kvh, from - i * kv.page_len),
                to - from,
            )
        });
        let mut scores = Vec::with_capacity(len - first);
        let mut max = f32::NEG_INFINITY;
        for (base, n) in spans.clone() {
            for j in 0..n {
                let sc = dot(qv, &kv.k[base + j * hd..base + (j + 1) * hd]) * attend.scale;
                max = max.max(sc);
                scores.push(sc);
            }
        }
        // ggml accumulates the softmax denominator in f64.
        let mut sum = 0.0f64;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += f64::from(*sc);
        }
        let inv = (1.0 / sum) as f32;
        let mut p = scores.iter();
        for (base, n) in spans {
            for j in 0..n {
                let w = round_f16(p.next().copied().unwrap_or(0.0) * inv);
                let vv = &kv.v[base + j * hd..base + (j + 1) * hd];
                for (oi, vi) in o.iter_mut().zip(vv) {
                    *oi += w * vi;
                }
            }
        }
    };
    // Parallel over (row, head) pairs on the kernels' pool (one pool for all
    // the model's work, so two never compete for cores), unless the whole
    // pass reads too few keys to pay for the fork.
    let keys: usize = rows.at.iter().map(|&(_, p)| p as usize + 1).sum();
    if rows.len() * heads > 1 && keys > 64 {
        super::kernels::par_chunks_mut(&mut out, hd, work);
    } else {
        out.chunks_mut(hd).enumerate().for_each(|(i, o)| work(i, o));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const SHAPE: KvShape = KvShape {
        layers: 1,
        kv_heads: 2,
        head_dim: 8,
    };

    fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
    }

    #[test]
    fn pages_are_counted_and_come_back_when_the_last_holder_lets_go() {
        let mut pool = KvPool::new(SHAPE, 3).unwrap();
        let a = pool.alloc().unwrap();
        let b = pool.alloc().unwrap();
        let c = pool.alloc().unwrap();
        assert_eq!(pool.alloc(), None, "three pages, three taken");
        assert_eq!(pool.free_pages(), 0);
        pool.retain(b);
        pool.release(b);
        assert_eq!(pool.free_pages(), 0, "b still has a holder");
        pool.release(b);
        assert_eq!((pool.free_pages(), pool.refs(b)), (1, 0));
        assert_eq!(pool.alloc(), Some(b), "the freed page is reused");
        for p in [a, b, c] {
            pool.release(p);
        }
        assert_eq!(pool.free_pages(), 3);
        assert!(KvPool::new(SHAPE, 0).is_err());
        assert!(KvPool::with_budget(SHAPE, SHAPE.page_bytes() - 1).is_err());
        assert_eq!(
            KvPool::with_budget(SHAPE, 5 * SHAPE.page_bytes() + 7)
                .unwrap()
                .pages(),
            5
        );
    }

    #[test]
    fn page_tables_that_miss_positions_are_refused() {
        let pages = [0, 1];
        let ok = Rows::new(vec![RowRun {
            pos: 20,
            len: 12,
            pages: &pages,
        }]);
        assert!(ok.check(4, PAGE).is_ok());
        let short = Rows::new(vec![RowRun {
            pos: 20,
            len: 13,
            pages: &pages,
        }]);
        assert!(short.check(4, PAGE).unwrap_err().contains("do not hold"));
        let outside = [0, 9];
        let bad = Rows::new(vec![RowRun {
            pos: 0,
            len: 17,
            pages: &outside,
        }]);
        assert!(bad.check(4, PAGE).unwrap_err().contains("outside"));
    }

    /// The same sequences attended alone in a contiguous cache and together
    /// over scattered pages, in chunks, give bit-identical outputs.
    #[test]
    fn paged_batched_attention_equals_contiguous_alone_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (kvh, hd, heads) = (SHAPE.kv_heads, SHAPE.head_dim, 4);
        let lens = [1usize, 17, 40, 5];
        let seqs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = lens
            .iter()
            .map(|&n| {
                (
                    random(&mut rng, n * heads * hd),
                    random(&mut rng, n * kvh * hd),
                    random(&mut rng, n * kvh * hd),
                )
            })
            .collect();
        for window in [None, Some(7)] {
            let attend = Attend {
                window,
                ..Attend::causal(heads, hd)
            };
            // Alone: one contiguous cache each, all tokens in one pass.
            let alone: Vec<Vec<f32>> = seqs
                .iter()
                .zip(lens)
                .map(|((q, k, v), n)| {
                    let shape = AttnShape {
                        heads,
                        kv_heads: kvh,
                        head_dim: hd,
                        capacity: n,
                    };
                    let mut cache = LayerCache::new(shape);
                    let mut kv = KvLayer::contiguous(&mut cache, shape);
                    let rows = Rows::contiguous(0, n);
                    store(&mut kv, &rows, k, v);
                    attention(q, &kv, &rows, attend)
                })
                .collect();
            // Together: pages handed out in a shuffled order, two passes
            // (the first part of every sequence, then the rest).
            let mut pool = KvPool::new(SHAPE, 16).unwrap();
            let mut order: Vec<PageId> = (0..16).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.gen_range(0..=i));
            }
            let mut next = order.into_iter();
            let tables: Vec<Vec<PageId>> = lens
                .iter()
                .map(|&n| {
                    (0..KvShape::pages_for(n))
                        .map_while(|_| next.next())
                        .collect()
                })
                .collect();
            let mut together: Vec<Vec<f32>> = vec![Vec::new(); lens.len()];
            for half in 0..2 {
                let cut = |n: usize| if half == 0 { (0, n / 2) } else { (n / 2, n) };
                let runs: Vec<RowRun> = lens
                    .iter()
                    .zip(&tables)
                    .filter(|(&n, _)| cut(n).1 > cut(n).0)
                    .map(|(&n, t)| RowRun {
                        pos: cut(n).0,
                        len: cut(n).1 - cut(n).0,
                        pages: t,
                    })
                    .collect();
                let rows = Rows::new(runs);
                let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
                for ((sq, sk, sv), &n) in seqs.iter().zip(&lens) {
                    let (a, b) = cut(n);
                    q.extend_from_slice(&sq[a * heads * hd..b * heads * hd]);
                    k.extend_from_slice(&sk[a * kvh * hd..b * kvh * hd]);
                    v.extend_from_slice(&sv[a * kvh * hd..b * kvh * hd]);
                }
                rows.check(pool.pages(), PAGE).unwrap();
                let mut kv = pool.layer(0);
                store(&mut kv, &rows, &k, &v);
                let out = attention(&q, &kv, &rows, attend);
                let mut at = 0;
                for (i, &n) in lens.iter().enumerate() {
                    let (a, b) = cut(n);
                    let m = (b - a) * heads * hd;
                    together[i].extend_from_slice(&out[at..at + m]);
                    at += m;
                }
            }
            assert_eq!(alone, together, "window {window:?}");
        }
    }
}
