//! The coordinator's layering, checked from its own sources: every module
//! imports only modules below it (the table in [`ALLOWED`]), so the import
//! graph has no circle; and only the store names `sqlx`.
//!
//! It reads every `coordinator/src/**/*.rs` but the binaries (`main.rs`,
//! `bin/`) and test-only code (`tests.rs`, `*_tests.rs`, `test_utils*`,
//! and a trailing `#[cfg(test)] mod ... { }`), collects each file's
//! `crate::...` paths (in `use` trees and in code; comments are skipped)
//! and checks each against the importing module's row.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// Top to bottom: what each module may import (besides itself). A module
/// not listed may import nothing of the crate.
const ALLOWED: &[(&str, &[&str])] = &[
    // The crate root declares the modules and re-exports the two types
    // every caller starts from.
    ("lib", &["app", "config"]),
    ("app", &["*"]),
    // The binary's flags: the last layer over the config.
    ("cli", &["config"]),
    // `config` only gathers the sections their modules define.
    (
        "config",
        &[
            "api",
            "http",
            "dispatch",
            "link",
            "ledger",
            "audit",
            "store",
            "catalogue",
            "scheduler",
            "world",
            "metrics",
            "domain",
            "util",
        ],
    ),
    ("api", BELOW_HTTP.split_at(2).1),
    // The OpenAI-compatible API is a second front of the client API (its
    // keys, limits and submit path); the HTTP listener serves it.
    ("openai", BELOW_HTTP.split_at(1).1),
    ("http", &BELOW_HTTP),
    (
        "dispatch",
        &[
            "link",
            "jobs",
            "relay",
            "ledger",
            "audit",
            "store",
            "catalogue",
            "scheduler",
            "world",
            "metrics",
            "domain",
            "util",
        ],
    ),
    (
        "link",
        &[
            "ledger",
            "audit",
            "store",
            "catalogue",
            "scheduler",
            "world",
            "metrics",
            "domain",
            "util",
        ],
    ),
    ("ledger", &["store", "catalogue", "domain", "util"]),
    ("audit", &["store", "catalogue", "domain", "util"]),
    ("store/sqlite", &["store", "domain", "util"]),
    ("store/postgres", &["store", "domain", "util"]),
    ("store", &["domain", "util"]),
    ("catalogue", &["domain", "scheduler"]),
    ("jobs", &["domain", "util"]),
    ("relay", &["store", "metrics", "domain", "util"]),
    ("domain", &[]),
    ("scheduler", &[]),
    ("world", &[]),
    ("metrics", &[]),
    ("util", &[]),
];

/// What `http` may import; `openai` all but itself, `api` neither of the two.
const BELOW_HTTP: [&str; 15] = [
    "openai",
    "api",
    "dispatch",
    "link",
    "jobs",
    "relay",
    "ledger",
    "audit",
    "store",
    "catalogue",
    "scheduler",
    "world",
    "metrics",
    "domain",
    "util",
];

/// Imports that break the table today, tolerated until the step that
/// removes them lands: (importer, imported). The test also fails when one
/// of these no longer occurs, so the list only shrinks.
const KNOWN: &[(&str, &str)] = &[];

/// The module a file belongs to, as the table names it.
fn module_of(rel: &Path) -> String {
    let parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    layer_key(&parts)
}

/// The table's name for a path of module segments (`store/sqlite` for the
/// SQLite backend, else the top-level module).
fn layer_key(path: &[String]) -> String {
    match path {
        [store, backend, ..]
            if store == "store" && (backend == "sqlite" || backend == "postgres") =>
        {
            format!("store/{backend}")
        }
        [first, ..] => first.clone(),
        [] => String::new(),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("reading coordinator/src")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Files that are not part of the library, or only of its tests.
fn skipped(rel: &Path) -> bool {
    let name = rel
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    rel.starts_with("bin")
        || rel == Path::new("main.rs")
        || name == "tests.rs"
        || name.ends_with("_tests.rs")
        || name == "test_utils.rs"
        || rel.starts_with("test_utils")
}

/// `text` without comments, and without a trailing inline test module.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            let next = lines.peek().map(|l| l.trim_start()).unwrap_or_default();
            let opens = |l: &str| {
                let l = l
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub ");
                l.starts_with("mod ") && l.trim_end().ends_with('{')
            };
            if opens(t.trim_start_matches("#[cfg(test)]").trim_start()) || opens(next) {
                break;
            }
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(strip_trailing_comment(line));
        out.push('\n');
    }
    out
}

/// `line` up to a `//` comment outside string literals.
fn strip_trailing_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut in_str = false;
    let mut i = 0;
    while i + 1 < bytes.len() {
        match bytes[i] {
            b'\\' if in_str => i += 1,
            b'"' => in_str = !in_str,
            b'/' if !in_str && bytes[i + 1] == b'/' => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

/// Every `crate::` path in `code`, as segments (a `use crate::{a, b::c}`
/// tree gives each leaf path).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 7 <= chars.len() {
        let at_word_start = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if at_word_start && chars[i..i + 7].iter().collect::<String>() == "crate::" {
            let mut j = i + 7;
            let mut prefix = Vec::new();
            tree(&chars, &mut j, &mut prefix, &mut out);
            i = j.max(i + 7);
        } else {
            i += 1;
        }
    }
    out
}

fn skip_ws(chars: &[char], j: &mut usize) {
    while *j < chars.len() && chars[*j].is_whitespace() {
        *j += 1;
    }
}

fn ident(chars: &[char], j: &mut usize) -> String {
    let mut s = String::new();
    while *j < chars.len() && (chars[*j].is_alphanumeric() || chars[*j] == '_') {
        s.push(chars[*j]);
        *j += 1;
    }
    s
}

/// Parses a use tree (or a plain path) at `j`, pushing each leaf path.
fn tree(chars: &[char], j: &mut usize, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    skip_ws(chars, j);
    if *j < chars.len() && chars[*j] == '{' {
        *j += 1;
        loop {
            skip_ws(chars, j);
            if *j >= chars.len() {
                return;
            }
            if chars[*j] == '}' {
                *j += 1;
                return;
            }
            if chars[*j] == ',' {
                *j += 1;
                continue;
            }
            let depth = prefix.len();
            tree(chars, j, prefix, out);
            prefix.truncate(depth);
            skip_ws(chars, j);
            // `as name`
            if chars[*j..].iter().take(3).collect::<String>() == "as " {
                *j += 3;
                skip_ws(chars, j);
                ident(chars, j);
            }
        }
    }
    let name = ident(chars, j);
    if name.is_empty() {
        if !prefix.is_empty() {
            out.push(prefix.clone());
        }
        if *j < chars.len() && chars[*j] == '*' {
            *j += 1;
        }
        return;
    }
    if name != "self" {
        prefix.push(name);
    }
    if chars[*j..].iter().take(2).collect::<String>() == "::" {
        *j += 2;
        tree(chars, j, prefix, out);
    } else {
        out.push(prefix.clone());
    }
}

struct Found {
    /// (importer, imported) -> files where it occurs.
    imports: BTreeMap<(String, String), BTreeSet<String>>,
    /// Files outside the store that name `sqlx`.
    sqlx_outside_store: BTreeSet<String>,
}

fn scan(src: &Path) -> Found {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut found = Found {
        imports: BTreeMap::new(),
        sqlx_outside_store: BTreeSet::new(),
    };
    for path in files {
        let rel = path.strip_prefix(src).expect("under src").to_path_buf();
        let text = std::fs::read_to_string(&path).expect("reading a source file");
        let shown = rel.display().to_string();
        let in_store = rel.starts_with("store") || rel == Path::new("store.rs");
        // This file names sqlx to look for it.
        let this = rel == Path::new("layering_tests.rs");
        if !in_store && !this && !rel.starts_with("bin") && text.contains("sqlx") {
            found.sqlx_outside_store.insert(shown.clone());
        }
        if skipped(&rel) {
            continue;
        }
        let importer = module_of(&rel);
        for p in crate_paths(&code_of(&text)) {
            let imported = layer_key(&p);
            if imported.is_empty() || imported == importer {
                continue;
            }
            found
                .imports
                .entry((importer.clone(), imported))
                .or_default()
                .insert(shown.clone());
        }
    }
    found
}

fn allowed(importer: &str, imported: &str) -> bool {
    ALLOWED
        .iter()
        .find(|(m, _)| *m == importer)
        .is_some_and(|(_, may)| may.contains(&"*") || may.contains(&imported))
}

fn violations(found: &Found) -> Vec<String> {
    let mut out = Vec::new();
    for ((from, to), files) in &found.imports {
        if !allowed(from, to) && !KNOWN.contains(&(from.as_str(), to.as_str())) {
            out.push(format!("{from} imports {to} (in {files:?})"));
        }
    }
    for (from, to) in KNOWN {
        if !found
            .imports
            .contains_key(&(from.to_string(), to.to_string()))
        {
            out.push(format!(
                "KNOWN lists {from} -> {to}, which no longer occurs: remove it"
            ));
        }
    }
    for f in &found.sqlx_outside_store {
        out.push(format!("{f} names sqlx outside store/"));
    }
    out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_module_imports_only_modules_below_it_and_only_the_store_names_sqlx() {
    let found = scan(&src());
    assert!(
        found.imports.len() > 20,
        "the scan found almost no imports: {:?}",
        found.imports.keys()
    );
    let broken = violations(&found);
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

#[test]
fn the_table_is_an_order_so_the_graph_has_no_circle() {
    // Depth-first search over the allowed edges: a back edge is a circle.
    fn visit<'a>(m: &'a str, path: &mut Vec<&'a str>, done: &mut BTreeSet<&'a str>) {
        if done.contains(m) {
            return;
        }
        assert!(!path.contains(&m), "circle: {path:?} -> {m}");
        path.push(m);
        if let Some((_, may)) = ALLOWED.iter().find(|(n, _)| *n == m) {
            for next in may.iter().filter(|n| **n != "*") {
                visit(next, path, done);
            }
        }
        path.pop();
        done.insert(m);
    }
    let mut done = BTreeSet::new();
    for (m, _) in ALLOWED {
        visit(m, &mut Vec::new(), &mut done);
    }
}

#[test]
fn the_scan_sees_use_trees_paths_and_skips_comments_and_tests() {
    let code = code_of(
        "use crate::{a::{b, c::D}, e as f, store::sqlite::X};\n\
         // crate::hidden in a comment\n\
         fn g() { crate::util::now_ms(); let s = \"//\"; crate::h::i() }\n\
         #[cfg(test)]\nmod tests {\n    use crate::test_only::X;\n}\n",
    );
    let keys: BTreeSet<String> = crate_paths(&code).iter().map(|p| layer_key(p)).collect();
    let want: BTreeSet<String> = ["a", "e", "store/sqlite", "util", "h"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(keys, want);
    // A forbidden import is reported.
    let mut found = Found {
        imports: BTreeMap::new(),
        sqlx_outside_store: BTreeSet::new(),
    };
    found.imports.insert(
        ("ledger".into(), "dispatch".into()),
        BTreeSet::from(["ledger.rs".into()]),
    );
    assert_eq!(violations(&found).len(), 1 + KNOWN.len());
}
