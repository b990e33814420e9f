//! The documentation stays true: its command examples (```` ```console ````
//! blocks in the README and docs/) run with trycmd and must print what they
//! show, and every relative link points to a file that exists and, with an
//! anchor, to one of its headings.

mod util;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pulldown_cmark::{Event, Parser, Tag, TagEnd};

/// The Markdown an admin or user reads: the top level's and docs/.
fn pages() -> Vec<PathBuf> {
    let repo = util::repo();
    let mut pages: Vec<PathBuf> = ["README.md", "ARCHITECTURE.md"]
        .iter()
        .map(|p| repo.join(p))
        .collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_`
/// dropped, spaces as `-`; a repeated one gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut heading: Option<String> = None;
    for event in Parser::new(text) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                let h = heading.take().unwrap();
                let slug: String = h
                    .to_lowercase()
                    .chars()
                    .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
                    .map(|c| if c == ' ' { '-' } else { c })
                    .collect();
                let mut name = slug.clone();
                let mut n = 0;
                while seen.contains(&name) {
                    n += 1;
                    name = format!("{slug}-{n}");
                }
                seen.insert(name);
            }
            _ => {}
        }
    }
    seen
}

/// Each relative link of `text` (a page at `path`): what is wrong with it.
fn broken_links(path: &Path, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    for event in Parser::new(text) {
        let Event::Start(Tag::Link { dest_url, .. }) = event else {
            continue;
        };
        let dest = dest_url.to_string();
        if dest.contains("://") || dest.starts_with("mailto:") {
            continue;
        }
        let (file, anchor) = match dest.split_once('#') {
            Some((f, a)) => (f, Some(a)),
            None => (dest.as_str(), None),
        };
        let target = path.parent().unwrap().join(file);
        if !target.exists() {
            broken.push(format!("{dest}: no such file"));
            continue;
        }
        if let Some(a) = anchor {
            let linked = if file.is_empty() {
                text.to_string()
            } else if let Ok(linked) = std::fs::read_to_string(&target) {
                linked
            } else {
                broken.push(format!("{dest}: an anchor into what is not a page"));
                continue;
            };
            if !anchors(&linked).contains(a) {
                broken.push(format!("{dest}: no heading with that anchor"));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_and_anchor_of_the_docs_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for b in broken_links(&page, &text) {
            broken.push(format!("{}: {b}", page.display()));
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_check_would_notice() {
    let page = util::repo().join("docs/rules.md");
    let text = "# A b, c\n## A b, c\n[ok](#a-b-c-1) [x](#nope) [y](nope.md) [z](users.md#the-rules) [w](users.md#nope)";
    assert_eq!(
        broken_links(&page, text),
        [
            "#nope: no heading with that anchor",
            "nope.md: no such file",
            "users.md#nope: no heading with that anchor"
        ]
    );
    assert!(anchors("# `--config` and `[hosts]`\n").contains("--config-and-hosts"));
}

#[test]
fn the_docs_command_examples_print_what_they_show() {
    let repo = util::repo();
    let cases = trycmd::TestCases::new();
    cases.register_bin(
        "genv-enforce",
        Path::new(env!("CARGO_BIN_EXE_genv-enforce")),
    );
    let mut found = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        if text.lines().any(|l| l.starts_with("```console")) {
            found += 1;
            cases.case(page.strip_prefix(&repo).unwrap());
        }
    }
    assert!(found >= 2, "{found} pages with examples");
    cases.run();
}
