//! The module graph of `src/` has no cycle: every module sits above all it
//! imports (`ARCHITECTURE.md`'s layers), both between the top-level
//! modules (a folder counts as one) and between single modules. Read from
//! the sources as text: `use crate::...`, `crate::...` and `super::...`
//! paths outside comments and outside `#[cfg(test)]` modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each module of `src/` (`host::ssh`, `rules`, ...) and its file.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts == ["lib"] || parts == ["main"] {
                continue;
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// `text` without `//` comments and without its test module.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`.
fn expand(prefix: &str, tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![format!("{prefix}{tree}")];
    };
    let (head, rest) = tree.split_at(open);
    let inner = &rest[1..rest.rfind('}').unwrap()];
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.extend(expand(&format!("{prefix}{head}"), &inner[start..i]));
                start = i + 1;
            }
            _ => {}
        }
    }
    if !inner[start..].trim().is_empty() {
        out.extend(expand(&format!("{prefix}{head}"), &inner[start..]));
    }
    out
}

/// The paths `code` names from the crate's root.
fn paths(module: &str, code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("use crate::") {
        let after = &rest[i + "use crate::".len()..];
        let end = after.find(';').unwrap_or(after.len());
        let tree: String = after[..end].split_whitespace().collect();
        out.extend(expand("", &tree));
        rest = &after[end..];
    }
    // The parent of a file's module (`super`): a `mod.rs` is its folder.
    let mut parent: Vec<&str> = module.split("::").collect();
    parent.pop();
    for (word, base) in [("crate::", String::new()), ("super::", parent.join("::"))] {
        let mut rest = code;
        while let Some(i) = rest.find(word) {
            let before = rest[..i].chars().last();
            let after = &rest[i + word.len()..];
            let len = after
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(after.len());
            let path = after[..len].trim_end_matches(':');
            if !path.is_empty()
                && !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
            {
                out.push(if base.is_empty() {
                    path.to_string()
                } else {
                    format!("{base}::{path}")
                });
            }
            rest = &after[len..];
        }
    }
    out
}

/// The module a path names: its longest prefix that is one.
fn module_of<'a>(path: &str, modules: &'a BTreeMap<String, PathBuf>) -> Option<&'a str> {
    let segments: Vec<&str> = path.split("::").collect();
    (1..=segments.len())
        .rev()
        .find_map(|n| modules.get_key_value(&segments[..n].join("::")))
        .map(|(k, _)| k.as_str())
}

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Module -> the modules it imports, and the same between top-level
/// modules.
fn graphs() -> (Graph, Graph) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let (mut fine, mut top) = (Graph::new(), Graph::new());
    for (m, file) in &modules {
        let text = code(&std::fs::read_to_string(file).unwrap());
        fine.entry(m.clone()).or_default();
        top.entry(m.split("::").next().unwrap().to_string())
            .or_default();
        for p in paths(m, &text) {
            let Some(to) = module_of(&p, &modules) else {
                continue;
            };
            // A module's own children are its own business.
            if to == m || to.starts_with(&format!("{m}::")) || m.starts_with(&format!("{to}::")) {
                continue;
            }
            fine.get_mut(m).unwrap().insert(to.to_string());
            let (a, b) = (
                m.split("::").next().unwrap(),
                to.split("::").next().unwrap(),
            );
            if a != b {
                top.get_mut(a).unwrap().insert(b.to_string());
            }
        }
    }
    (fine, top)
}

/// A cycle of `g`, as the modules on it, if there is one.
fn a_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        n: &str,
        on: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = on.iter().position(|x| x == n) {
            let mut cycle = on[i..].to_vec();
            cycle.push(n.to_string());
            return Some(cycle);
        }
        if done.contains(n) {
            return None;
        }
        on.push(n.to_string());
        for next in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(g, next, on, done) {
                return Some(c);
            }
        }
        on.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|n| visit(g, n, &mut Vec::new(), &mut done))
}

/// Each module's layer: one above the highest it imports (a cycle has
/// none: it is named instead).
fn layers(g: &Graph) -> BTreeMap<String, usize> {
    if let Some(c) = a_cycle(g) {
        panic!(
            "modules import each other, so they have no layers: {}",
            c.join(" -> ")
        );
    }
    fn layer(g: &Graph, n: &str, memo: &mut BTreeMap<String, usize>) -> usize {
        if let Some(l) = memo.get(n) {
            return *l;
        }
        let l = g
            .get(n)
            .into_iter()
            .flatten()
            .map(|m| layer(g, m, memo) + 1)
            .max()
            .unwrap_or(1);
        memo.insert(n.to_string(), l);
        l
    }
    let mut memo = BTreeMap::new();
    for n in g.keys() {
        layer(g, n, &mut memo);
    }
    memo
}

#[test]
fn no_module_imports_one_above_it() {
    let (fine, top) = graphs();
    assert!(fine.len() > 40, "the sources were not read: {fine:?}");
    assert!(
        fine["cycle"].contains("assess") && top["host"].contains("snapshot"),
        "imports were not read: {fine:?}"
    );
    if let Some(c) = a_cycle(&top) {
        panic!("top-level modules import each other: {}", c.join(" -> "));
    }
    if let Some(c) = a_cycle(&fine) {
        panic!("modules import each other: {}", c.join(" -> "));
    }
    let layers = layers(&top);
    let mut by_layer: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for (m, l) in &layers {
        by_layer.entry(*l).or_default().push(m);
    }
    for (l, ms) in by_layer.iter().rev() {
        eprintln!("layer {l:2}: {}", ms.join(", "));
    }
}

#[test]
fn a_cycle_is_found_where_there_is_one() {
    let g: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]
        .into_iter()
        .fold(Graph::new(), |mut g, (x, y)| {
            g.entry(x.into()).or_default().insert(y.into());
            g
        });
    let c = a_cycle(&g).unwrap();
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4);
    assert_eq!(
        layers(&Graph::from([("x".into(), BTreeSet::new())]))["x"],
        1
    );
    assert_eq!(
        paths(
            "host::ssh",
            "use crate::{a::{B, c::D}, e};\nlet x = super::f::g();"
        ),
        ["a::B", "a::c::D", "e", "host::f::g"]
    );
}

/// Config is pure: it resolves flags and the text setup read into
/// settings, and never reads a file, the environment or the clock, makes
/// a directory or opens a database itself (`setup` does).
#[test]
fn config_does_no_io() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/config.rs"))
        .unwrap();
    let code = code(&text);
    let io = [
        "std::fs",
        "fs::",
        "std::env",
        "env::var",
        "tempfile",
        "read_secret",
        "hostname(",
        "state_dir_from_env",
        "::open(",
        "::load(",
        "SystemTime",
        "Instant",
        "File::",
        "private::",
        "this_machine",
        "std::net::TcpListener",
        "std::process",
    ];
    let found: Vec<&str> = io.iter().copied().filter(|n| code.contains(n)).collect();
    assert!(found.is_empty(), "src/config.rs does I/O: {found:?}");
}

/// `ARCHITECTURE.md`, read from the repository root.
fn architecture_md() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md")).unwrap()
}

/// The backticked names that open the list items of `text` between the
/// headings `from` and `to`: `- \`name\`: ...`.
fn listed(text: &str, from: &str, to: &str) -> BTreeSet<String> {
    let start = text.find(from).unwrap_or_else(|| panic!("no {from:?}"));
    let end = start
        + text[start..]
            .find(to)
            .unwrap_or_else(|| panic!("no {to:?}"));
    text[start..end]
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_string()))
        .collect()
}

#[test]
fn the_module_map_names_every_file_of_src_and_nothing_else() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeSet::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(&src).unwrap().display().to_string();
                files.insert(rel);
            }
        }
    }
    let map: BTreeSet<String> = listed(
        &architecture_md(),
        "## Module map",
        "## From the command line",
    )
    .into_iter()
    .filter(|n| n.ends_with(".rs"))
    .collect();
    let missing: Vec<_> = files.difference(&map).collect();
    let gone: Vec<_> = map.difference(&files).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "ARCHITECTURE.md's module map: not listed {missing:?}; listed but not in src/ {gone:?}"
    );
}

#[test]
fn the_test_list_names_every_suite_of_tests() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let suites: BTreeSet<String> = std::fs::read_dir(&tests)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| format!("tests/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    let listed = listed(
        &architecture_md(),
        "The suites in `tests/`",
        "A test whose prerequisite",
    );
    assert_eq!(
        listed, suites,
        "ARCHITECTURE.md's test list against tests/*.rs"
    );
}

#[test]
fn the_ground_layer_is_the_one_architecture_md_names() {
    let (_, top) = graphs();
    let ground: BTreeSet<String> = layers(&top)
        .into_iter()
        .filter(|(_, l)| *l == 1)
        .map(|(m, _)| m)
        .collect();
    let text = architecture_md();
    let said = text
        .split_once("at the top to ")
        .and_then(|(_, rest)| rest.split_once(" at the ground"))
        .map(|(names, _)| names)
        .expect("ARCHITECTURE.md names the ground layer");
    let named: BTreeSet<String> = said
        .split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect();
    assert_eq!(named, ground, "ARCHITECTURE.md's ground layer: {said}");
}
