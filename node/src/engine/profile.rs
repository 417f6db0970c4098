//! Where a forward pass's time goes: weight matmuls, attention, norms and
//! other element-wise work, activation quantization, collectives, and the
//! rest; per thread, switched on only by whoever measures (the pod_tp
//! bench), so production passes pay one thread-local flag read per span.
//!
//! Spans are exclusive: a span inside another (quantizing the activations
//! inside a matmul) pauses the outer one, so the parts add up to the wall
//! time between [`start`] and [`take`]; time outside every span is
//! [`Part::Other`] (embedding, allocations, copies, the output head's
//! bookkeeping).
//!
//! # Invariants
//! - While off, [`time`] only calls its closure.
//! - [`take`] returns what was measured since [`start`] and switches off.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

/// A kind of work in a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Weight matmuls (the output head included), less quantization.
    Matmul = 0,
    /// Scores, softmax and the weighted sum over the KV cache, and storing
    /// the new keys and values.
    Attention = 1,
    /// RMS norms, rotary embedding, SwiGLU and residual adds.
    Norm = 2,
    /// Quantizing activations for a quantized matmul.
    Quantize = 3,
    /// Waiting in and moving bytes through the pod's collectives.
    Collective = 4,
    /// Everything outside a span.
    Other = 5,
}

impl Part {
    pub const ALL: [Part; 6] = [
        Part::Matmul,
        Part::Attention,
        Part::Norm,
        Part::Quantize,
        Part::Collective,
        Part::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Part::Matmul => "matmuls",
            Part::Attention => "attention",
            Part::Norm => "norms",
            Part::Quantize => "quantization",
            Part::Collective => "collectives",
            Part::Other => "other",
        }
    }
}

/// Time per [`Part`], indexed by `Part as usize`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Breakdown(pub [Duration; 6]);

impl Breakdown {
    pub fn get(&self, part: Part) -> Duration {
        self.0[part as usize]
    }

    pub fn total(&self) -> Duration {
        self.0.iter().sum()
    }

    pub fn add(&mut self, other: &Breakdown) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }
}

struct State {
    parts: Breakdown,
    current: Part,
    since: Instant,
}

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Starts measuring on this thread (discarding anything unfinished).
pub fn start() {
    STATE.with(|s| {
        *s.borrow_mut() = Some(State {
            parts: Breakdown::default(),
            current: Part::Other,
            since: Instant::now(),
        })
    });
    ON.with(|on| on.set(true));
}

/// Stops measuring and returns what was measured since [`start`] (zero if
/// it was never started).
pub fn take() -> Breakdown {
    switch(Part::Other);
    ON.with(|on| on.set(false));
    STATE.with(|s| s.borrow_mut().take().map(|s| s.parts).unwrap_or_default())
}

/// Charges the time since the last switch to the current part and makes
/// `part` current; returns the part that was current.
fn switch(part: Part) -> Part {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let Some(s) = s.as_mut() else {
            return Part::Other;
        };
        let now = Instant::now();
        s.parts.0[s.current as usize] += now - s.since;
        s.since = now;
        std::mem::replace(&mut s.current, part)
    })
}

/// Runs `f`, charging its time (less that of spans inside it) to `part`.
#[inline]
pub fn time<R>(part: Part, f: impl FnOnce() -> R) -> R {
    if !ON.with(Cell::get) {
        return f();
    }
    let outer = switch(part);
    let r = f();
    switch(outer);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {
            std::hint::spin_loop();
        }
    }

    /// Nested spans are exclusive and the parts add up to the wall time.
    #[test]
    fn spans_are_exclusive_and_add_up() {
        assert_eq!(take(), Breakdown::default(), "never started: nothing");
        let wall = Instant::now();
        start();
        time(Part::Matmul, || {
            spin(Duration::from_millis(4));
            time(Part::Quantize, || spin(Duration::from_millis(2)));
        });
        spin(Duration::from_millis(1));
        let b = take();
        let wall = wall.elapsed();
        assert!(b.get(Part::Matmul) >= Duration::from_millis(4), "{b:?}");
        assert!(b.get(Part::Quantize) >= Duration::from_millis(2), "{b:?}");
        assert!(b.get(Part::Other) >= Duration::from_millis(1), "{b:?}");
        // Were the spans not exclusive, quantization would count twice and
        // the parts would add up to more than the wall time.
        assert!(b.total() <= wall, "{b:?} within {wall:?}");
        // Off again: spans cost nothing and record nothing.
        time(Part::Attention, || spin(Duration::from_millis(1)));
        assert_eq!(take(), Breakdown::default());
    }
}
