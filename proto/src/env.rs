//! Configuration from environment variables, read the same way by every
//! binary: `PREFIX` + `KEY`, with `__` between nested sections
//! (`MLXNET__LIMITS__MAX_TOKENS`, `MLX_NODE__LOCATION__PLACE`), turned into a
//! TOML table that is layered over the file's before the whole is
//! deserialized into the binary's config type.
//!
//! A value is read as a TOML scalar when it parses as one (numbers,
//! booleans), else as a string; when the setting refuses the scalar (a name
//! or a path that happens to look like a number), the string is tried.
//!
//! # Invariants
//! - Every variable is checked on its own against the config type before it
//!   is kept, so an error names the variable (and its setting) that is wrong.
//! - Variables without the prefix are ignored; one with it must name a
//!   setting of the config type.
//!
//! # Failure
//! [`EnvError`]: an empty section (`PREFIX__A____B`), a key that is no
//! setting, or a value the setting refuses.

use serde::de::DeserializeOwned;

/// Why an environment variable could not be taken as a setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    #[error("environment variable {var} has an empty section")]
    EmptySection { var: String },
    #[error("unknown environment variable {var}: there is no setting `{key}`")]
    Unknown { var: String, key: String },
    #[error("environment variable {var}={value:?} (setting `{key}`): {reason}")]
    Invalid {
        var: String,
        key: String,
        value: String,
        reason: String,
    },
}

/// The `prefix`-ed variables of `env` as a table of settings of `T` (keys
/// lowercased, `__` nesting sections). Others are ignored.
pub fn overrides<T, I, K, V>(prefix: &str, env: I) -> Result<toml::Table, EnvError>
where
    T: DeserializeOwned,
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut table = toml::Table::new();
    for (var, raw) in env {
        let (var, raw) = (var.as_ref(), raw.as_ref());
        let Some(rest) = var.strip_prefix(prefix) else {
            continue;
        };
        let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        if path.iter().any(String::is_empty) {
            return Err(EnvError::EmptySection {
                var: var.to_owned(),
            });
        }
        let value = accepted::<T>(var, &path, raw)?;
        merge(&mut table, nested(&path, value));
    }
    Ok(table)
}

/// `value` as the setting at `path` takes it: typed if it accepts the
/// typed reading, else the raw string.
fn accepted<T: DeserializeOwned>(
    var: &str,
    path: &[String],
    raw: &str,
) -> Result<toml::Value, EnvError> {
    let typed = scalar(raw);
    let first = match check::<T>(path, typed.clone()) {
        Ok(()) => return Ok(typed),
        Err(e) => e,
    };
    let string = toml::Value::String(raw.to_owned());
    if typed != string && check::<T>(path, string.clone()).is_ok() {
        return Ok(string);
    }
    let key = path.join(".");
    if first.message().starts_with("unknown field") {
        return Err(EnvError::Unknown {
            var: var.to_owned(),
            key,
        });
    }
    Err(EnvError::Invalid {
        var: var.to_owned(),
        key,
        value: raw.to_owned(),
        reason: first.message().to_owned(),
    })
}

/// Whether `T` accepts a table holding only `value` at `path`.
fn check<T: DeserializeOwned>(path: &[String], value: toml::Value) -> Result<(), toml::de::Error> {
    toml::Value::Table(nested(path, value))
        .try_into::<T>()
        .map(|_| ())
}

/// A table holding `value` at `path` (not empty).
fn nested(path: &[String], value: toml::Value) -> toml::Table {
    let mut value = value;
    for key in path.iter().skip(1).rev() {
        let mut t = toml::Table::new();
        t.insert(key.clone(), value);
        value = toml::Value::Table(t);
    }
    let mut top = toml::Table::new();
    if let Some(first) = path.first() {
        top.insert(first.clone(), value);
    }
    top
}

/// `raw` as a TOML number or boolean when it is one, else a string.
fn scalar(raw: &str) -> toml::Value {
    match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => match t.remove("v") {
            Some(
                v @ (toml::Value::Integer(_) | toml::Value::Boolean(_) | toml::Value::Float(_)),
            ) => v,
            _ => toml::Value::String(raw.to_owned()),
        },
        Err(_) => toml::Value::String(raw.to_owned()),
    }
}

/// Layers `over` onto `base`: a table merges key by key, anything else
/// (scalars, arrays) replaces what was there.
pub fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Config {
        name: String,
        port: u16,
        ratio: f64,
        section: Section,
    }

    #[derive(Debug, serde::Deserialize, PartialEq, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Section {
        on: bool,
        path: String,
    }

    #[test]
    fn variables_become_typed_settings_and_name_themselves_when_refused() {
        let env = [
            ("APP__NAME", "42"),
            ("APP__PORT", "7070"),
            ("APP__RATIO", "1"),
            ("APP__SECTION__ON", "true"),
            ("APP__SECTION__PATH", "/srv/x"),
            ("OTHER", "ignored"),
        ];
        let table = overrides::<Config, _, _, _>("APP__", env).unwrap();
        let c: Config = toml::Value::Table(table).try_into().unwrap();
        assert_eq!(
            c,
            Config {
                name: "42".into(),
                port: 7070,
                ratio: 1.0,
                section: Section {
                    on: true,
                    path: "/srv/x".into()
                }
            }
        );

        let bad = overrides::<Config, _, _, _>("APP__", [("APP__PORT", "lots")]).unwrap_err();
        assert!(
            matches!(&bad, EnvError::Invalid { var, key, .. } if var == "APP__PORT" && key == "port"),
            "{bad}"
        );
        let unknown =
            overrides::<Config, _, _, _>("APP__", [("APP__SECTION__NOPE", "1")]).unwrap_err();
        assert_eq!(
            unknown,
            EnvError::Unknown {
                var: "APP__SECTION__NOPE".into(),
                key: "section.nope".into()
            }
        );
        assert!(matches!(
            overrides::<Config, _, _, _>("APP__", [("APP__SECTION____ON", "1")]),
            Err(EnvError::EmptySection { .. })
        ));
    }

    #[test]
    fn merging_refines_sections_and_replaces_values() {
        let mut base: toml::Table = "a = 1\nlist = [1, 2]\n[s]\nx = 1\ny = 2\n".parse().unwrap();
        let over: toml::Table = "list = [3]\n[s]\ny = 5\n".parse().unwrap();
        merge(&mut base, over);
        let want: toml::Table = "a = 1\nlist = [3]\n[s]\nx = 1\ny = 5\n".parse().unwrap();
        assert_eq!(base, want);
    }
}
