//! Weekly lending windows in local time: `"mon-fri 22:00-07:00"`,
//! `"sat,sun 00:00-24:00"`, `"daily 12:00-13:00"`.
//!
//! A window's days are a list of day names or ranges (`mon`..`sun`,
//! `mon-fri`, `fri-mon` wraps over the weekend, `daily`); its times are
//! `HH:MM-HH:MM`, start included, end excluded, `24:00` allowed as an end.
//! A window whose end is not after its start runs past midnight into the
//! next day (`fri 22:00-02:00` covers Saturday 00:00-02:00 too).
//!
//! # Failure
//! [`ScheduleError`] names the window and what in it is wrong.

use std::fmt;

/// A point of the week in local time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalTime {
    /// 0 = Monday .. 6 = Sunday.
    pub weekday: u8,
    /// Minutes since local midnight, 0..1440.
    pub minute: u16,
}

impl LocalTime {
    /// `weekday` 0 = Monday; `hh:mm`.
    pub fn new(weekday: u8, hour: u16, min: u16) -> Self {
        Self {
            weekday: weekday % 7,
            minute: (hour * 60 + min) % 1440,
        }
    }

    /// Now, in the machine's time zone (UTC when it cannot be read).
    pub fn now() -> Self {
        let now = jiff::ZonedDateTime::now();
        Self {
            weekday: now.weekday().to_monday_zero_offset() as u8,
            minute: now.hour() as u16 * 60 + now.minute() as u16,
        }
    }
}

impl fmt::Display for LocalTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:02}:{:02}",
            DAYS[self.weekday as usize % 7],
            self.minute / 60,
            self.minute % 60
        )
    }
}

const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// Why a schedule window is not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    #[error("window {window:?}: expected `<days> HH:MM-HH:MM`")]
    Shape { window: String },
    #[error("window {window:?}: unknown day {day:?} (mon..sun, a range like mon-fri, or daily)")]
    Day { window: String, day: String },
    #[error("window {window:?}: bad time {time:?} (HH:MM, 00:00 to 24:00)")]
    Time { window: String, time: String },
    #[error("window {window:?} is empty (start equals end)")]
    Empty { window: String },
}

/// One window: the days it starts on and its span.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Window {
    days: [bool; 7],
    start: u16,
    /// Exclusive; may be <= start (then the window ends the next day).
    end: u16,
}

impl Window {
    fn contains(&self, t: LocalTime) -> bool {
        let (d, m) = (t.weekday as usize, t.minute);
        if self.start < self.end {
            self.days[d] && (self.start..self.end).contains(&m)
        } else {
            let yesterday = (d + 6) % 7;
            (self.days[d] && m >= self.start) || (self.days[yesterday] && m < self.end)
        }
    }
}

/// A set of weekly windows; empty means "never".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    windows: Vec<Window>,
}

fn day(window: &str, name: &str) -> Result<usize, ScheduleError> {
    const FULL: [&str; 7] = [
        "monday",
        "tuesday",
        "wednesday",
        "thursday",
        "friday",
        "saturday",
        "sunday",
    ];
    let n = name.trim().to_ascii_lowercase();
    (0..7)
        .find(|&i| DAYS[i] == n || FULL[i] == n)
        .ok_or_else(|| ScheduleError::Day {
            window: window.to_owned(),
            day: name.to_owned(),
        })
}

fn time(window: &str, text: &str, is_end: bool) -> Result<u16, ScheduleError> {
    let bad = || ScheduleError::Time {
        window: window.to_owned(),
        time: text.to_owned(),
    };
    let (h, m) = text.trim().split_once(':').ok_or_else(bad)?;
    let (h, m): (u16, u16) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
    if m >= 60 || h > 24 || (h == 24 && (m != 0 || !is_end)) {
        return Err(bad());
    }
    Ok(h * 60 + m)
}

impl Schedule {
    /// Parses every window; the first bad one is the error.
    pub fn parse(windows: &[String]) -> Result<Self, ScheduleError> {
        let mut out = Vec::with_capacity(windows.len());
        for w in windows {
            let shape = || ScheduleError::Shape { window: w.clone() };
            let mut parts = w.split_whitespace();
            let (Some(days_text), Some(span), None) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(shape());
            };
            let mut days = [false; 7];
            for item in days_text.split(',') {
                let item = item.trim();
                if item.eq_ignore_ascii_case("daily") {
                    days = [true; 7];
                } else if let Some((a, b)) = item.split_once('-') {
                    let (a, b) = (day(w, a)?, day(w, b)?);
                    let mut d = a;
                    loop {
                        days[d] = true;
                        if d == b {
                            break;
                        }
                        d = (d + 1) % 7;
                    }
                } else {
                    days[day(w, item)?] = true;
                }
            }
            let (start, end) = span.split_once('-').ok_or_else(shape)?;
            let (start, end) = (time(w, start, false)?, time(w, end, true)?);
            if start == end {
                return Err(ScheduleError::Empty { window: w.clone() });
            }
            out.push(Window { days, start, end });
        }
        Ok(Self { windows: out })
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Whether `t` falls in a window.
    pub fn contains(&self, t: LocalTime) -> bool {
        self.windows.iter().any(|w| w.contains(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(w: &[&str]) -> Schedule {
        Schedule::parse(&w.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    const MON: u8 = 0;
    const FRI: u8 = 4;
    const SAT: u8 = 5;
    const SUN: u8 = 6;

    #[test]
    fn a_window_includes_its_start_and_excludes_its_end() {
        let s = sched(&["mon-fri 09:00-17:30"]);
        assert!(!s.contains(LocalTime::new(MON, 8, 59)));
        assert!(s.contains(LocalTime::new(MON, 9, 0)));
        assert!(s.contains(LocalTime::new(FRI, 17, 29)));
        assert!(!s.contains(LocalTime::new(FRI, 17, 30)));
        assert!(!s.contains(LocalTime::new(SAT, 12, 0)));
    }

    #[test]
    fn overnight_windows_run_into_the_next_day_and_across_the_week() {
        let s = sched(&["fri 22:00-07:00", "sun 23:00-01:00"]);
        assert!(!s.contains(LocalTime::new(FRI, 21, 59)));
        assert!(s.contains(LocalTime::new(FRI, 22, 0)));
        assert!(s.contains(LocalTime::new(SAT, 6, 59)));
        assert!(!s.contains(LocalTime::new(SAT, 7, 0)));
        // Friday's morning belongs to Thursday's window, which there is none of.
        assert!(!s.contains(LocalTime::new(FRI, 3, 0)));
        // Sunday night into Monday (the week wraps).
        assert!(s.contains(LocalTime::new(SUN, 23, 30)));
        assert!(s.contains(LocalTime::new(MON, 0, 59)));
        assert!(!s.contains(LocalTime::new(MON, 1, 0)));
    }

    #[test]
    fn whole_days_ranges_lists_and_daily() {
        let s = sched(&["sat,sun 00:00-24:00"]);
        assert!(s.contains(LocalTime::new(SAT, 0, 0)));
        assert!(s.contains(LocalTime::new(SUN, 23, 59)));
        assert!(!s.contains(LocalTime::new(MON, 0, 0)));
        let s = sched(&["fri-mon 12:00-13:00"]);
        for d in [FRI, SAT, SUN, MON] {
            assert!(s.contains(LocalTime::new(d, 12, 30)), "day {d}");
        }
        assert!(!s.contains(LocalTime::new(2, 12, 30)));
        let s = sched(&["daily 12:00-13:00"]);
        assert!((0..7).all(|d| s.contains(LocalTime::new(d, 12, 0))));
        assert!(sched(&["Monday 10:00-11:00"]).contains(LocalTime::new(MON, 10, 0)));
        assert!(Schedule::default().is_empty());
        assert!(!Schedule::default().contains(LocalTime::new(MON, 10, 0)));
    }

    #[test]
    fn malformed_windows_name_what_is_wrong() {
        let err = |w: &str| Schedule::parse(&[w.to_string()]).unwrap_err();
        assert!(matches!(err("mon-fri"), ScheduleError::Shape { .. }));
        assert!(matches!(err("mon 9-17"), ScheduleError::Time { .. }));
        assert!(matches!(err("mon 09:00-25:00"), ScheduleError::Time { .. }));
        assert!(matches!(err("mon 24:00-01:00"), ScheduleError::Time { .. }));
        assert!(matches!(err("mon 09:60-10:00"), ScheduleError::Time { .. }));
        assert!(matches!(
            err("funday 09:00-10:00"),
            ScheduleError::Day { .. }
        ));
        assert!(matches!(
            err("mon 09:00-09:00"),
            ScheduleError::Empty { .. }
        ));
        assert!(err("mon 9-17").to_string().contains("mon 9-17"));
    }
}
