//! The policy on recorded signals: an owner away, an owner back, a laptop
//! on battery, a hot Mac, and the edges of a schedule.

use super::*;

fn sample(name: &str) -> String {
    let path = format!("{}/src/policy/samples/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The signals a Mac reports in the recorded outputs.
fn mac(idle: &str, batt: &str, therm: &str, now: LocalTime) -> Signals {
    Signals {
        idle: Some(macos::parse_ioreg_idle(&sample(idle)).unwrap()),
        power: Some(macos::parse_pmset_batt(&sample(batt)).unwrap()),
        thermal: Some(macos::parse_pmset_therm(&sample(therm)).unwrap()),
        now,
    }
}

fn policy(mode: NodeMode, f: impl FnOnce(&mut LendingSettings)) -> Policy {
    let mut s = LendingSettings::default();
    f(&mut s);
    Policy::new(mode, &s).unwrap()
}

const TUESDAY_NOON: LocalTime = LocalTime {
    weekday: 1,
    minute: 12 * 60,
};

#[test]
fn idle_mode_lends_while_the_owner_is_away_and_pauses_when_they_return() {
    let p = policy(NodeMode::Idle, |s| s.min_idle_s = 300);
    let away = mac(
        "ioreg-idle-away.txt",
        "pmset-batt-ac.txt",
        "pmset-therm-nominal.txt",
        TUESDAY_NOON,
    );
    assert_eq!(p.decide(&away), Decision::Lend);
    let back = mac(
        "ioreg-idle-active.txt",
        "pmset-batt-ac.txt",
        "pmset-therm-nominal.txt",
        TUESDAY_NOON,
    );
    let d = p.decide(&back);
    assert_eq!(d, Decision::Pause(PauseReason::OwnerActive));
    let Decision::Pause(why) = d else {
        unreachable!()
    };
    assert!(why.to_string().starts_with("you are using"), "{why}");
    // The minimum idle time is the edge: just under pauses, at it lends.
    let at = |secs| Signals {
        idle: Some(Duration::from_secs(secs)),
        ..away
    };
    assert!(!p.decide(&at(299)).is_lend());
    assert!(p.decide(&at(300)).is_lend());
    // An unreadable idle time never lends in idle mode...
    assert_eq!(
        p.decide(&Signals { idle: None, ..away }),
        Decision::Pause(PauseReason::IdleUnknown)
    );
    // ...and does not matter to a dedicated Mac.
    let dedicated = policy(NodeMode::Dedicated, |_| {});
    assert!(dedicated.decide(&back).is_lend());
    assert!(dedicated.decide(&Signals { idle: None, ..back }).is_lend());
}

#[test]
fn on_battery_pauses_unless_the_owner_allows_it() {
    let unplugged = mac(
        "ioreg-idle-away.txt",
        "pmset-batt-battery.txt",
        "pmset-therm-nominal.txt",
        TUESDAY_NOON,
    );
    for mode in [NodeMode::Dedicated, NodeMode::Idle] {
        let d = policy(mode, |_| {}).decide(&unplugged);
        assert_eq!(
            d,
            Decision::Pause(PauseReason::OnBattery { percent: Some(85) }),
            "{mode}"
        );
        assert!(
            policy(mode, |s| s.ac_only = false)
                .decide(&unplugged)
                .is_lend(),
            "{mode}"
        );
    }
    let Decision::Pause(why) = policy(NodeMode::Idle, |_| {}).decide(&unplugged) else {
        unreachable!()
    };
    assert_eq!(why.to_string(), "on battery power (85%)");
    // A desktop's pmset has no battery at all; an unknown source pauses nothing.
    let desktop = mac(
        "ioreg-idle-away.txt",
        "pmset-batt-desktop.txt",
        "pmset-therm-nominal.txt",
        TUESDAY_NOON,
    );
    assert!(policy(NodeMode::Idle, |_| {}).decide(&desktop).is_lend());
    assert!(policy(NodeMode::Idle, |_| {})
        .decide(&Signals {
            power: None,
            ..desktop
        })
        .is_lend());
}

#[test]
fn thermal_pressure_pauses_every_mode() {
    for (therm, state) in [
        ("pmset-therm-warning.txt", Thermal::Serious),
        ("pmset-therm-limited.txt", Thermal::Critical),
    ] {
        let hot = mac(
            "ioreg-idle-away.txt",
            "pmset-batt-ac.txt",
            therm,
            TUESDAY_NOON,
        );
        for mode in [NodeMode::Dedicated, NodeMode::Idle] {
            assert_eq!(
                policy(mode, |_| {}).decide(&hot),
                Decision::Pause(PauseReason::Hot(state)),
                "{therm} {mode}"
            );
            assert!(policy(mode, |s| s.thermal_pause = false)
                .decide(&hot)
                .is_lend());
        }
    }
    let fair = Signals {
        thermal: Some(Thermal::Fair),
        ..Signals::away(TUESDAY_NOON)
    };
    assert!(policy(NodeMode::Dedicated, |_| {}).decide(&fair).is_lend());
}

#[test]
fn schedule_mode_lends_inside_its_windows_only() {
    let p = policy(NodeMode::Schedule, |s| {
        s.schedule = vec!["mon-fri 22:00-07:00".into(), "sat,sun 00:00-24:00".into()]
    });
    let at = |weekday, h, m| Signals::away(LocalTime::new(weekday, h, m));
    assert!(!p.decide(&at(1, 21, 59)).is_lend());
    assert!(p.decide(&at(1, 22, 0)).is_lend());
    assert!(p.decide(&at(2, 6, 59)).is_lend());
    assert_eq!(
        p.decide(&at(2, 7, 0)),
        Decision::Pause(PauseReason::OutsideSchedule)
    );
    // Friday night runs into the weekend; Sunday's window ends at midnight.
    assert!(p.decide(&at(5, 3, 0)).is_lend());
    assert!(p.decide(&at(6, 23, 59)).is_lend());
    // Early Monday is outside: Sunday's window ends at midnight, and the
    // weekday windows start on Monday evening.
    assert!(!p.decide(&at(0, 3, 0)).is_lend());
    // The rules still hold inside a window.
    let hot = Signals {
        thermal: Some(Thermal::Critical),
        ..at(5, 12, 0)
    };
    assert_eq!(
        p.decide(&hot),
        Decision::Pause(PauseReason::Hot(Thermal::Critical))
    );
}

#[tokio::test]
async fn the_poller_publishes_each_change_of_decision() {
    let p = policy(NodeMode::Idle, |s| s.min_idle_s = 60);
    let (inject, source) = InjectedSignals::new(Signals::away(TUESDAY_NOON));
    let (tx, mut rx) = watch::channel(None);
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(run(
        p,
        Box::new(source),
        Duration::from_millis(5),
        tx,
        stop.clone(),
    ));
    rx.wait_for(|d| d == &Some(Decision::Lend)).await.unwrap();
    inject.send_replace(Signals {
        idle: Some(Duration::ZERO),
        ..Signals::away(TUESDAY_NOON)
    });
    rx.wait_for(|d| d == &Some(Decision::Pause(PauseReason::OwnerActive)))
        .await
        .unwrap();
    stop.cancel();
    task.await.unwrap();
}
