//! API keys as values: what a key may do ([`Scopes`]), its own abuse
//! limits, a key as stored and listed (never its secret), and the caller
//! an authenticated key stands for.

/// What a key may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Submit and cancel jobs.
    Submit,
    /// Read jobs, balance, history, earnings.
    Read,
    /// Create accounts, grant MLX tokens, manage any account's keys.
    Admin,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Submit => "submit",
            Scope::Read => "read",
            Scope::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "submit" => Scope::Submit,
            "read" => Scope::Read,
            "admin" => Scope::Admin,
            _ => return None,
        })
    }
}

/// A list of scopes that is no valid key's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidScopes(pub &'static str);

/// A set of scopes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scopes {
    pub submit: bool,
    pub read: bool,
    pub admin: bool,
}

impl Scopes {
    pub const ALL: Scopes = Scopes {
        submit: true,
        read: true,
        admin: true,
    };

    /// Whether the set allows `scope` (admin allows everything).
    pub fn allows(&self, scope: Scope) -> bool {
        self.admin
            || match scope {
                Scope::Submit => self.submit,
                Scope::Read => self.read,
                Scope::Admin => false,
            }
    }

    pub fn from_list<'a>(list: impl IntoIterator<Item = &'a str>) -> Result<Self, InvalidScopes> {
        let mut out = Scopes::default();
        for s in list {
            match Scope::parse(s) {
                Some(Scope::Submit) => out.submit = true,
                Some(Scope::Read) => out.read = true,
                Some(Scope::Admin) => out.admin = true,
                None => return Err(InvalidScopes("scopes are submit, read and admin")),
            }
        }
        if out == Scopes::default() {
            return Err(InvalidScopes("a key needs at least one scope"));
        }
        Ok(out)
    }

    /// The stored form: names joined by commas.
    pub fn from_text(text: &str) -> Result<Self, InvalidScopes> {
        Self::from_list(text.split(',').filter(|s| !s.is_empty()))
    }

    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.submit {
            v.push("submit");
        }
        if self.read {
            v.push("read");
        }
        if self.admin {
            v.push("admin");
        }
        v
    }
}

/// A key's own abuse limits; `None` takes the coordinator's default, 0 is
/// unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    pub requests_per_sec: Option<u32>,
    pub max_in_flight: Option<u32>,
}

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub account_id: String,
    pub key_id: String,
    pub scopes: Scopes,
    /// The key's own abuse limits.
    pub limits: KeyLimits,
    /// When the key expires (`None`: never); a key it makes expires no later.
    pub expires_at_ms: Option<i64>,
}

/// A key as listed (no secret, no hash).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: String,
    pub account_id: String,
    pub scopes: Scopes,
    pub label: String,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
}

/// A valid key as the store finds it by its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredKey {
    pub caller: Caller,
    pub expires_at_ms: Option<i64>,
}
