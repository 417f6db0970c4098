//! How a download shows its progress: a bar with rate and ETA on a
//! terminal ([`Bar`], indicatif), structured log lines in a service
//! ([`LogLines`]).
//!
//! # Invariants
//! `start` comes first for each file, then `advance` with the bytes held so
//! far (which may go back to 0 when a corrupt file is started over), then
//! one `finish`.

use std::time::{Duration, Instant};

/// Receives a download's progress.
pub trait Progress: Send {
    /// A file of `total` bytes starts, `have` of them already on disk.
    fn start(&mut self, file: &str, total: u64, have: u64);
    /// `have` bytes are now held.
    fn advance(&mut self, have: u64);
    /// Something worth telling (a mirror failed, a resume).
    fn note(&mut self, msg: &str);
    /// The file is done (`ok`) or given up.
    fn finish(&mut self, ok: bool);
}

/// A progress bar on stderr: bytes, rate, ETA.
pub struct Bar {
    bar: indicatif::ProgressBar,
}

impl Default for Bar {
    fn default() -> Self {
        Bar::new()
    }
}

impl Bar {
    pub fn new() -> Bar {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stderr(),
        );
        let style = indicatif::ProgressStyle::with_template(
            "{msg} [{bar:32}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
        bar.set_style(style);
        Bar { bar }
    }
}

impl Progress for Bar {
    fn start(&mut self, file: &str, total: u64, have: u64) {
        self.bar.set_length(total);
        self.bar.set_position(have);
        self.bar.reset_eta();
        self.bar.set_message(file.to_owned());
        if have > 0 {
            self.bar.println(format!(
                "resuming {file} at {}",
                mlxnet_proto::catalogue::human_bytes(have)
            ));
        }
    }
    fn advance(&mut self, have: u64) {
        self.bar.set_position(have);
    }
    fn note(&mut self, msg: &str) {
        self.bar.println(msg);
    }
    fn finish(&mut self, ok: bool) {
        if ok {
            self.bar.finish();
        } else {
            self.bar.abandon();
        }
    }
}

/// Log lines (`tracing` at info): one at the start, one per tenth of the
/// file or every `every`, whichever comes first, one at the end; fields
/// `file`, `have`, `total`, `percent`, `bytes_per_s`.
pub struct LogLines {
    file: String,
    total: u64,
    started: Instant,
    from: u64,
    last_at: Instant,
    last_tenth: u64,
    every: Duration,
}

impl Default for LogLines {
    fn default() -> Self {
        LogLines::new(Duration::from_secs(10))
    }
}

impl LogLines {
    pub fn new(every: Duration) -> LogLines {
        LogLines {
            file: String::new(),
            total: 0,
            started: Instant::now(),
            from: 0,
            last_at: Instant::now(),
            last_tenth: 0,
            every,
        }
    }

    fn line(&self, have: u64, what: &str) {
        let secs = self.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            (have.saturating_sub(self.from)) as f64 / secs
        } else {
            0.0
        };
        let percent = (have * 100).checked_div(self.total).unwrap_or(0);
        tracing::info!(
            file = %self.file,
            have,
            total = self.total,
            percent,
            bytes_per_s = rate as u64,
            "download {what}"
        );
    }
}

impl Progress for LogLines {
    fn start(&mut self, file: &str, total: u64, have: u64) {
        self.file = file.to_owned();
        self.total = total;
        self.started = Instant::now();
        self.from = have;
        self.last_at = Instant::now();
        self.last_tenth = have.saturating_mul(10) / total.max(1);
        self.line(have, "started");
    }
    fn advance(&mut self, have: u64) {
        let tenth = have.saturating_mul(10) / self.total.max(1);
        if tenth != self.last_tenth || self.last_at.elapsed() >= self.every {
            self.last_tenth = tenth;
            self.last_at = Instant::now();
            self.line(have, "progress");
        }
    }
    fn note(&mut self, msg: &str) {
        tracing::info!(file = %self.file, "download: {msg}");
    }
    fn finish(&mut self, ok: bool) {
        self.line(
            if ok { self.total } else { 0 },
            if ok { "finished" } else { "failed" },
        );
    }
}

/// The progress display for this process: the bar when stderr is a
/// terminal, log lines otherwise.
pub fn for_this_process() -> Box<dyn Progress> {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        Box::new(Bar::new())
    } else {
        Box::new(LogLines::default())
    }
}
