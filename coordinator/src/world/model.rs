//! What the World knows of one node, and the network totals.
//!
//! # Invariants
//! - A stored [`NodeView`]'s location is a grid cell centre ([`super::grid`])
//!   or absent; the owner's own coordinates are dropped on insert.
//! - Display strings (name, chip, place label) are trimmed, free of control
//!   characters and at most [`MAX_TEXT_CHARS`] characters, so a node cannot
//!   bloat or break the page; a pod id likewise, and a pod keeps at most
//!   [`super::MAX_POD_MEMBERS`] member ids, each 64 hex characters.
//!
//! # Failure
//! A node id that is not 64 hex characters is a [`super::WorldError`]; a
//! location that is not on Earth keeps the node off the map (it is still
//! counted), it is not an error of the whole node.

use serde::Serialize;

use super::grid;

/// Longest name, chip or place label kept, in characters.
pub const MAX_TEXT_CHARS: usize = 64;

/// What a node is doing, as the page shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Online and running at least one job.
    Serving,
    /// Online and ready for jobs, running none.
    Idle,
    /// Online but not taking jobs now (its owner is using it, or it is full
    /// or draining).
    Busy,
    /// Not connected.
    Offline,
}

impl Status {
    pub const ALL: [Status; 4] = [Status::Serving, Status::Idle, Status::Busy, Status::Offline];

    pub fn is_online(self) -> bool {
        self != Status::Offline
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Serving => "serving",
            Status::Idle => "idle",
            Status::Busy => "busy",
            Status::Offline => "offline",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// Apple silicon generation, the marker colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Family {
    M1,
    M2,
    M3,
    M4,
    M5,
    /// Anything else (an Intel Mac, a Linux box in a test network).
    #[serde(rename = "other")]
    Other,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::M1,
        Family::M2,
        Family::M3,
        Family::M4,
        Family::M5,
        Family::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Family::M1 => "M1",
            Family::M2 => "M2",
            Family::M3 => "M3",
            Family::M4 => "M4",
            Family::M5 => "M5",
            Family::Other => "other",
        }
    }

    pub fn parse(s: &str) -> Option<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.as_str().eq_ignore_ascii_case(s))
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Chip tier within a generation, the marker shade.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Base,
    Pro,
    Max,
    Ultra,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Base, Tier::Pro, Tier::Max, Tier::Ultra];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Base => "base",
            Tier::Pro => "pro",
            Tier::Max => "max",
            Tier::Ultra => "ultra",
        }
    }

    pub fn parse(s: &str) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }
}

/// Family and tier read from a chip name such as "Apple M3 Ultra".
pub fn chip_class(chip: &str) -> (Family, Tier) {
    let mut words = chip.split_whitespace();
    while let Some(word) = words.next() {
        let family = match word {
            "M1" => Family::M1,
            "M2" => Family::M2,
            "M3" => Family::M3,
            "M4" => Family::M4,
            "M5" => Family::M5,
            _ => continue,
        };
        let tier = words.next().and_then(Tier::parse).unwrap_or(Tier::Base);
        return (family, tier);
    }
    (Family::Other, Tier::Base)
}

/// A node's place on the map: its owner's label and the centre of its cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Place {
    pub label: String,
    pub lat: f64,
    pub lon: f64,
}

impl Place {
    /// Snaps an owner-declared location; `None` when it is not on Earth.
    pub fn snapped(label: &str, lat: f64, lon: f64) -> Option<Place> {
        let s = grid::snap(lat, lon).ok()?;
        Some(Place {
            label: clean_text(label),
            lat: s.lat,
            lon: s.lon,
        })
    }
}

/// The pod a node belongs to: its id and every member's node id (this one
/// included).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodRef {
    pub pod_id: String,
    pub members: Vec<String>,
}

/// One node as the World page knows it.
///
/// The coordinator passes one to [`super::World::upsert_node`] on
/// registration and on every change; the World snaps its location and
/// cleans its text before storing it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeView {
    /// Lowercase hex of the node's ed25519 public key (64 characters).
    pub node_id: String,
    pub name: String,
    /// "Apple M3 Ultra"; family and tier are derived from it.
    pub chip: String,
    pub memory_bytes: u64,
    /// Where the owner says the node is; `None` = not on the map.
    pub location: Option<Place>,
    /// The owner opted out of the map: counted in totals, never drawn or listed.
    pub hidden: bool,
    pub pod: Option<PodRef>,
    pub status: Status,
    pub jobs_served: u64,
    pub tokens_produced: u64,
    /// Unix milliseconds since the node has been online; `None` while offline.
    /// Kept by the World: what the caller passes is ignored.
    pub online_since_ms: Option<u64>,
}

impl NodeView {
    /// A freshly registered node, idle, with no counters yet.
    pub fn new(node_id: impl Into<String>, name: &str, chip: &str, memory_bytes: u64) -> Self {
        NodeView {
            node_id: node_id.into(),
            name: name.to_owned(),
            chip: chip.to_owned(),
            memory_bytes,
            location: None,
            hidden: false,
            pod: None,
            status: Status::Idle,
            jobs_served: 0,
            tokens_produced: 0,
            online_since_ms: None,
        }
    }

    /// Sets the owner-declared location (snapped here already).
    pub fn at(mut self, label: &str, lat: f64, lon: f64) -> Self {
        self.location = Place::snapped(label, lat, lon);
        self
    }

    /// The node as a node announced itself in its `Hello`: name, chip,
    /// memory, and the owner's location and opt-out.
    pub fn from_hello(node_id: impl Into<String>, hello: &mlxnet_proto::v1::Hello) -> Self {
        let (chip, memory) = hello
            .hardware
            .as_ref()
            .map(|h| (h.chip.as_str(), h.memory_bytes))
            .unwrap_or(("", 0));
        let mut view = NodeView::new(node_id, &hello.name, chip, memory);
        if let Some(loc) = &hello.location {
            view.hidden = loc.hidden;
            // A default message (no label, 0/0) means "not declared".
            let declared =
                !loc.label.trim().is_empty() || loc.latitude != 0.0 || loc.longitude != 0.0;
            if declared {
                view.location = Place::snapped(&loc.label, loc.latitude, loc.longitude);
            }
        }
        // Clipped before anything is copied: a Hello may carry a pod name
        // and member list near its 1 MiB frame cap.
        view.pod = hello
            .pod
            .as_ref()
            .filter(|p| !p.name.is_empty())
            .map(|p| PodRef {
                pod_id: clean_text(&p.name),
                members: p
                    .members
                    .iter()
                    .filter(|m| m.len() == 32)
                    .take(super::MAX_POD_MEMBERS)
                    .map(hex::encode)
                    .collect(),
            });
        view
    }

    pub fn family(&self) -> Family {
        chip_class(&self.chip).0
    }

    pub fn tier(&self) -> Tier {
        chip_class(&self.chip).1
    }

    /// Drawn on the map: located and not opted out.
    pub fn is_visible(&self) -> bool {
        !self.hidden && self.location.is_some()
    }

    /// Brings every field inside the invariants (snapped place, clean text).
    pub(super) fn normalise(&mut self) {
        self.name = clean_text(&self.name);
        self.chip = clean_text(&self.chip);
        if let Some(place) = self.location.take() {
            self.location = Place::snapped(&place.label, place.lat, place.lon);
        }
        if let Some(pod) = self.pod.as_mut() {
            pod.pod_id = clean_text(&pod.pod_id);
            pod.members.retain(|m| super::check_id(m).is_ok());
            pod.members.truncate(super::MAX_POD_MEMBERS);
        }
        if self.pod.as_ref().is_some_and(|p| p.pod_id.is_empty()) {
            self.pod = None;
        }
    }
}

/// Trims, drops control characters and caps the length of a display string.
pub fn clean_text(s: &str) -> String {
    s.trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_TEXT_CHARS)
        .collect::<String>()
        .trim_end()
        .to_owned()
}

/// Network totals. Hidden nodes are counted here like any other.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Totals {
    /// Nodes connected now (any status but offline).
    pub macs_online: u64,
    /// Nodes known, online or not.
    pub macs_known: u64,
    /// Online nodes drawn on the map (the rest opted out or gave no place).
    pub macs_on_map: u64,
    /// Pods with at least one member online.
    pub pods: u64,
    /// Unified memory of the online nodes, bytes.
    pub memory_online_bytes: u64,
    /// Model tokens produced per second over the last [`super::TOKENS_WINDOW`].
    pub tokens_per_s: f64,
    /// Jobs completed since 00:00 UTC.
    pub jobs_today: u64,
    /// Model tokens per joule of the recent jobs that measured their
    /// energy ([`super::tokens_per_joule`]); `null` when none did.
    pub tokens_per_joule: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chip_names_map_to_family_and_tier() {
        assert_eq!(chip_class("Apple M3 Ultra"), (Family::M3, Tier::Ultra));
        assert_eq!(chip_class("Apple M1"), (Family::M1, Tier::Base));
        assert_eq!(chip_class("Apple M4 Pro"), (Family::M4, Tier::Pro));
        assert_eq!(chip_class("Apple M2 Max"), (Family::M2, Tier::Max));
        assert_eq!(
            chip_class("Intel(R) Xeon(R) CPU"),
            (Family::Other, Tier::Base)
        );
        assert_eq!(chip_class(""), (Family::Other, Tier::Base));
    }

    #[test]
    fn text_is_cleaned_and_capped() {
        assert_eq!(clean_text("  Lyon\n, France\u{7} "), "Lyon, France");
        assert_eq!(clean_text(&"x".repeat(500)).chars().count(), MAX_TEXT_CHARS);
    }

    #[test]
    fn hello_location_is_snapped_and_opt_out_kept() {
        let hello = mlxnet_proto::v1::Hello {
            name: "studio".into(),
            location: Some(mlxnet_proto::v1::Location {
                label: "Lyon, France".into(),
                latitude: 45.764_123,
                longitude: 4.835_789,
                hidden: true,
            }),
            ..Default::default()
        };
        let v = NodeView::from_hello("ab".repeat(32), &hello);
        let place = v.location.clone().unwrap();
        assert!(grid::is_centre(place.lat, place.lon));
        assert_ne!(place.lat, 45.764_123);
        assert!(v.hidden && !v.is_visible());

        let unset = mlxnet_proto::v1::Hello {
            location: Some(Default::default()),
            ..Default::default()
        };
        assert_eq!(NodeView::from_hello("cd".repeat(32), &unset).location, None);
    }
}
