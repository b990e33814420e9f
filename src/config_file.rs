//! The configuration file (`--config FILE`): one TOML file whose keys are
//! the flags' long names, in sections. Its values are checked by the
//! flags' own parsers and become command-line arguments, placed before the
//! admin's own at the subcommand that owns each flag, so that a flag given
//! on the command line wins and everything after is as if typed. Pure: the
//! file's text and the arguments in; arguments, or errors each at a file,
//! line and column, out.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;

use clap::{Arg, ArgAction, ArgMatches, Command};
use serde_json::{json, Value as Json};
use thiserror::Error;
use toml_edit::{ImDocument, Item, Value};

/// Where the service's configuration lives (`config check`'s default).
pub const DEFAULT_PATH: &str = "/etc/genv-enforce/genv-enforce.toml";

/// The file's sections, in the README's order: each a name, what it holds
/// and its keys (flags' long names; `web-config-file` is
/// `--web.config.file`'s alias, a key without dots).
pub const SECTIONS: &[(&str, &str, &[&str])] = &[
    (
        "hosts",
        "Which hosts and how to reach them (`remote`), or this machine's own (`enforce`).",
        &[
            "host",
            "hostfile",
            "inventory",
            "username",
            "identity-file",
            "timeout",
            "concurrency",
            "command-timeout",
            "control-dir",
            "control-persist",
            "host-key-check",
            "known-hosts-file",
            "exit-on-error",
            "quiet",
            "max-records",
            "snapshot-dir",
            "snapshot",
        ],
    ),
    (
        "rules",
        "genv's rules and the per-user and per-group limits.",
        &[
            "non-env-processes",
            "no-non-env-processes",
            "env-devices",
            "no-env-devices",
            "env-memory",
            "no-env-memory",
            "max-devices-per-user",
            "max-devices-for-user",
            "max-memory-per-user",
            "max-memory-for-user",
            "max-devices-per-group",
            "idle-after",
            "idle-below",
            "orphans-as-non-env",
            "count-non-env-devices",
        ],
    ),
    (
        "policy",
        "How and when violations are acted on: cycles, warnings first, confirmation.",
        &[
            "interval",
            "dry-run",
            "output",
            "grace",
            "confirm-cycles",
            "kill-after",
        ],
    ),
    (
        "notifications",
        "Mail, webhooks and terminals for the job's owner and the admins.",
        &[
            "smtp",
            "smtp-credentials",
            "mail-from",
            "mail-to",
            "mail-admin",
            "webhook",
            "webhook-file",
            "notify-terminal",
            "notify-rate",
            "notify-link",
        ],
    ),
    (
        "state",
        "What a run keeps and records: the state database and the audit log.",
        &["state-db", "retain", "audit-log"],
    ),
    (
        "metrics",
        "Prometheus metrics over HTTP, and the live view (`status`, `top`).",
        &[
            "metrics-listen",
            "web-config-file",
            "view-socket",
            "view-group",
        ],
    ),
    (
        "high-availability",
        "Several enforcer boxes on etcd, and shards.",
        &[
            "ha-etcd",
            "ha-key",
            "shard",
            "ha-name",
            "ha-ttl",
            "ha-fence-dir",
            "ha-cacert",
            "ha-cert",
            "ha-cert-key",
            "ha-user",
            "ha-password-file",
        ],
    ),
];

/// Flags that are not settings, so have no key: the file itself, logging
/// (the environment file's `GENV_ENFORCE_LOG`), help and version.
pub const NOT_KEYS: &[&str] = &["config", "verbose", "help", "version"];

/// Keys whose values are secrets or may hold one: never printed.
pub const SECRET_KEYS: &[&str] = &["webhook", "smtp"];

/// The flag a key sets (its long name).
pub fn long_of(key: &str) -> &str {
    match key {
        "web-config-file" => "web.config.file",
        k => k,
    }
}

/// The section a key belongs in.
pub fn section_of(key: &str) -> Option<&'static str> {
    SECTIONS
        .iter()
        .find(|(_, _, keys)| keys.contains(&key))
        .map(|(s, _, _)| *s)
}

/// A place in the file: 1-based line and column (in characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct At {
    pub line: usize,
    pub column: usize,
}

impl At {
    fn of(text: &str, offset: usize) -> Self {
        let before = &text[..offset.min(text.len())];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        At {
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
        }
    }
}

/// What is wrong at one place of the file.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{}:{}: {message}", at.line, at.column)]
pub struct Problem {
    pub at: At,
    pub message: String,
}

/// One key the file sets: its flag's values as they would be typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    pub key: String,
    /// Each a value of one `--flag=value` (none for a `true` switch).
    pub values: Vec<String>,
    /// `false` for a switch set to false: nothing to pass.
    pub on: bool,
    pub at: At,
}

/// Every command-line flag that has a key, from clap's definitions of
/// `root` and all its subcommands, by long name.
pub fn flags(root: &Command) -> BTreeMap<String, Arg> {
    let mut root = root.clone();
    root.build();
    // A flag several subcommands share (`--output`, `--command-timeout`)
    // is described as the service runs it: `remote enforce`'s first, then
    // `remote`'s, `enforce`'s, and any other's (`doctor`'s) last.
    let rank = |path: &[&str]| match path {
        ["remote", "enforce"] => 3,
        ["remote"] => 2,
        ["enforce"] => 1,
        _ => 0,
    };
    let mut out: BTreeMap<String, (u8, Arg)> = BTreeMap::new();
    let mut stack = vec![(vec![], &root)];
    while let Some((path, cmd)) = stack.pop() {
        let r = rank(&path);
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                if !NOT_KEYS.contains(&long) && out.get(long).is_none_or(|(had, _)| *had < r) {
                    out.insert(long.to_string(), (r, arg.clone()));
                }
            }
        }
        for sub in cmd.get_subcommands().filter(|c| !is_unconfigured(c)) {
            let mut p = path.clone();
            p.push(sub.get_name());
            stack.push((p, sub));
        }
    }
    out.into_iter().map(|(k, (_, a))| (k, a)).collect()
}

/// Subcommands whose flags are not configuration (`report` reads a
/// database; `docs` and `snapshot` write files or print).
fn is_unconfigured(cmd: &Command) -> bool {
    matches!(
        cmd.get_name(),
        "report" | "docs" | "snapshot" | "config" | "status" | "top"
    )
}

/// Whether a flag takes a value (not a switch).
pub fn takes_value(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Set | ArgAction::Append)
}

/// Whether a flag takes several values.
pub fn takes_many(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Append)
        || arg.get_num_args().is_some_and(|r| r.max_values() > 1)
        || arg.get_value_delimiter().is_some()
}

/// Whether a flag's values are `NAME=VALUE` pairs (written as a table).
pub fn takes_pairs(arg: &Arg) -> bool {
    arg.get_value_names()
        .and_then(|n| n.first())
        .is_some_and(|n| n.as_str().contains('='))
}

/// The file's settings, each value checked by its flag's own parser
/// (`root`'s definitions).
///
/// # Errors
/// Every problem found, in file order: TOML syntax, unknown sections or
/// keys, a key in the wrong section, wrong types, values the flag
/// refuses.
pub fn parse(text: &str, root: &Command) -> Result<Vec<Setting>, Vec<Problem>> {
    let doc = ImDocument::parse(text).map_err(|e| {
        vec![Problem {
            at: At::of(text, e.span().map_or(0, |s| s.start)),
            message: format!("not TOML: {}", e.message().trim_end().replace('\n', "; ")),
        }]
    })?;
    let flags = flags(root);
    let at = |span: Option<std::ops::Range<usize>>| At::of(text, span.map_or(0, |s| s.start));
    let mut settings = Vec::new();
    let mut problems = Vec::new();
    for (name, item) in doc.as_table().iter() {
        let key_at = at(doc.as_table().key(name).and_then(toml_edit::Key::span));
        let Some(table) = item.as_table_like() else {
            problems.push(Problem {
                at: key_at,
                message: match section_of(name) {
                    Some(s) => format!("{name:?} belongs in a section: [{s}]"),
                    None => format!("{name:?}: keys belong in sections ({})", section_list()),
                },
            });
            continue;
        };
        let Some((_, _, keys)) = SECTIONS.iter().find(|(s, _, _)| *s == name) else {
            problems.push(Problem {
                at: key_at,
                message: format!("unknown section [{name}] (sections: {})", section_list()),
            });
            continue;
        };
        for (key, item) in table.iter() {
            let key_at = at(table.key(key).and_then(toml_edit::Key::span));
            if !keys.contains(&key) {
                problems.push(Problem {
                    at: key_at,
                    message: match section_of(key) {
                        Some(s) => format!("{key:?} belongs in [{s}], not [{name}]"),
                        None => format!("unknown key {key:?} in [{name}]{}", nearest(key, keys)),
                    },
                });
                continue;
            }
            let Some(arg) = flags.get(long_of(key)) else {
                problems.push(Problem {
                    at: key_at,
                    message: format!("{key:?} is not a flag of this genv-enforce"),
                });
                continue;
            };
            let value_at = at(item.span()).max(key_at);
            match values(key, arg, item) {
                Ok((values, on)) => {
                    let refused: Vec<String> =
                        values.iter().filter_map(|v| refusal(arg, v)).collect();
                    if let Some(why) = refused.into_iter().next() {
                        problems.push(Problem {
                            at: value_at,
                            message: format!("{key}: {why}"),
                        });
                        continue;
                    }
                    settings.push(Setting {
                        key: key.to_string(),
                        values,
                        on,
                        at: key_at,
                    });
                }
                Err(why) => problems.push(Problem {
                    at: value_at,
                    message: format!("{key}: {why}"),
                }),
            }
        }
    }
    problems.sort_by_key(|p| p.at);
    if problems.is_empty() {
        Ok(settings)
    } else {
        Err(problems)
    }
}

fn section_list() -> String {
    SECTIONS
        .iter()
        .map(|(s, _, _)| format!("[{s}]"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// ", did you mean ...?" for a key one or two edits from a known one.
fn nearest(key: &str, keys: &[&str]) -> String {
    keys.iter()
        .map(|k| (strsim::levenshtein(key, k), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map_or(String::new(), |(_, k)| format!("; did you mean {k:?}?"))
}

/// A TOML value as the flag's values: a switch takes `true` or `false`;
/// a flag a string or an integer, a list of them where it takes several,
/// a table of `NAME = VALUE` where its values are such pairs.
fn values(key: &str, arg: &Arg, item: &Item) -> Result<(Vec<String>, bool), String> {
    let scalar = |v: &Value| match v {
        Value::String(s) => Ok(s.value().clone()),
        Value::Integer(i) => Ok(i.value().to_string()),
        other => Err(format!("a string or an integer, not {}", kind(other))),
    };
    let pair = |name: &str, v: &Item| match v.as_value() {
        Some(v) => scalar(v).map(|v| format!("{name}={v}")),
        None => Err(format!("{name}: a string or an integer, not a table")),
    };
    // `[rules.max-devices-for-user]` and dotted keys make tables too.
    if let (true, Some(t)) = (takes_pairs(arg), item.as_table_like()) {
        return t
            .iter()
            .map(|(n, v)| pair(n, v))
            .collect::<Result<_, _>>()
            .map(|v| (v, true));
    }
    let Some(value) = item.as_value() else {
        return Err(format!("a value, not a table (write `{key} = ...`)"));
    };
    if !takes_value(arg) {
        return match value.as_bool() {
            Some(on) => Ok((Vec::new(), on)),
            None => Err(format!("true or false, not {}", kind(value))),
        };
    }
    if takes_pairs(arg) {
        return match value {
            Value::Array(a) => a.iter().map(scalar).collect(),
            other => Err(format!(
                "a table such as {{ alice = 4 }}, not {}",
                kind(other)
            )),
        }
        .map(|v| (v, true));
    }
    match value {
        Value::Array(a) if takes_many(arg) => a.iter().map(scalar).collect(),
        Value::Array(_) => Err("one value, not a list".into()),
        v => scalar(v).map(|v| vec![v]),
    }
    .map(|v| (v, true))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "a list",
        Value::InlineTable(_) => "a table",
    }
}

/// Why `arg`'s own parser refuses `value`, if it does.
fn refusal(arg: &Arg, value: &str) -> Option<String> {
    let probe = Command::new("config")
        .no_binary_name(true)
        .disable_help_flag(true)
        .arg(
            Arg::new("v")
                .long("v")
                .action(ArgAction::Set)
                .allow_hyphen_values(true)
                .value_parser(arg.get_value_parser().clone()),
        );
    let e = probe.try_get_matches_from([format!("--v={value}")]).err()?;
    if let Some(source) = std::error::Error::source(&e) {
        return Some(format!("{value:?}: {source}"));
    }
    let valid: Vec<String> = arg
        .get_possible_values()
        .iter()
        .map(|p| p.get_name().to_string())
        .collect();
    Some(if valid.is_empty() {
        format!("{value:?} is refused")
    } else {
        format!("{value:?} is not one of {}", valid.join(", "))
    })
}

/// Where one subcommand's arguments begin on the command line, and which
/// flags (ids) the admin gave there.
#[derive(Debug)]
struct Level {
    cmd: Command,
    /// The index just after the subcommand's name (1 for the binary's).
    start: usize,
    given: BTreeSet<String>,
}

/// The subcommands the command line `args` runs and the flags it gives
/// at each (as clap would split them).
fn levels(root: &Command, args: &[OsString]) -> Vec<Level> {
    let mut root = root.clone();
    root.build();
    let mut levels = vec![Level {
        cmd: root,
        start: 1,
        given: BTreeSet::new(),
    }];
    let mut i = 1;
    while i < args.len() {
        let Some(tok) = args[i].to_str() else {
            i += 1;
            continue;
        };
        let level = levels.last_mut().expect("the root");
        if tok == "--" {
            break;
        }
        let found = if let Some(long) = tok.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, _)) => (n, true),
                None => (long, false),
            };
            level
                .cmd
                .get_arguments()
                .find(|a| {
                    a.get_long() == Some(name)
                        || a.get_all_aliases().is_some_and(|al| al.contains(&name))
                })
                .map(|a| (a.clone(), inline))
        } else if let Some(shorts) = tok.strip_prefix('-').filter(|s| !s.is_empty()) {
            // A cluster (-vv, -Hgpu1): the first short that takes a value
            // takes the rest, or the next word.
            let mut last = None;
            for (n, c) in shorts.char_indices() {
                if let Some(a) = level.cmd.get_arguments().find(|a| a.get_short() == Some(c)) {
                    level.given.insert(a.get_id().to_string());
                    if takes_value(a) {
                        last = Some((a.clone(), n + c.len_utf8() < shorts.len()));
                        break;
                    }
                }
            }
            last
        } else {
            let sub = level
                .cmd
                .get_subcommands()
                .find(|c| c.get_name() == tok || c.get_all_aliases().any(|a| a == tok))
                .cloned();
            if let Some(sub) = sub {
                levels.push(Level {
                    cmd: sub,
                    start: i + 1,
                    given: BTreeSet::new(),
                });
            }
            i += 1;
            continue;
        };
        i += 1;
        if let Some((arg, inline)) = found {
            level.given.insert(arg.get_id().to_string());
            if takes_value(&arg) && !inline {
                i += 1;
                if arg.get_num_args().is_some_and(|r| r.max_values() > 1) {
                    while i < args.len() && !args[i].to_string_lossy().starts_with('-') {
                        i += 1;
                    }
                }
            }
        }
    }
    levels
}

/// Where a file setting went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Passed on, as if typed.
    File(At),
    /// The command line gives the flag, or one that excludes it: it wins.
    Overridden(At),
    /// The command run has no such flag (e.g. `[hosts]` for `enforce`).
    Unused(At),
}

/// The command line `args` run with the file's `settings`: after the
/// [`default_command`] where `args` name none, each setting added at the
/// subcommand that owns its flag, unless the command line gives that flag
/// or one that excludes it. Returns the arguments and where each key
/// went.
pub fn apply(
    root: &Command,
    args: &[OsString],
    settings: &[Setting],
) -> (Vec<OsString>, BTreeMap<String, Source>) {
    let mut args = args.to_vec();
    let mut levels = levels(root, &args);
    if levels.len() == 1 {
        // Before the flags (`--config F --dry-run`): the command's own;
        // the binary's (`-v`, `--config`) are global.
        let at = 1.min(args.len());
        args.splice(at..at, default_command(settings).iter().map(OsString::from));
        levels = self::levels(root, &args);
    } else if levels[1].cmd.get_name() == "doctor" && default_command(settings)[0] == "remote" {
        // `--config F doctor`: a file that names hosts is checked as the
        // service reaches them (its inventory, known_hosts and host-key
        // policy), not as this machine.
        let at = levels[1].start.saturating_sub(1);
        args.insert(at, "remote".into());
        levels = self::levels(root, &args);
    }
    let given: BTreeSet<&str> = levels
        .iter()
        .flat_map(|l| l.given.iter().map(String::as_str))
        .collect();
    let mut inserts: Vec<(usize, Vec<OsString>)> = Vec::new();
    let mut sources = BTreeMap::new();
    for s in settings {
        let owner = levels
            .iter()
            .rev()
            .take_while(|l| !is_unconfigured(&l.cmd))
            .find_map(|l| {
                l.cmd
                    .get_arguments()
                    .find(|a| a.get_long() == Some(long_of(&s.key)) && !a.is_global_set())
                    .map(|a| (l, a))
            });
        let Some((level, arg)) = owner else {
            sources.insert(s.key.clone(), Source::Unused(s.at));
            continue;
        };
        let id = arg.get_id().as_str();
        let excluded = given.contains(id)
            || level
                .cmd
                .get_arg_conflicts_with(arg)
                .iter()
                .any(|c| given.contains(c.get_id().as_str()))
            || level.cmd.get_groups().any(|g| {
                let members: Vec<&str> = g.get_args().map(clap::Id::as_str).collect();
                !g.clone().is_multiple()
                    && members.contains(&id)
                    && members.iter().any(|m| given.contains(m))
            })
            || levels.iter().any(|l| {
                l.cmd.get_arguments().any(|other| {
                    given.contains(other.get_id().as_str())
                        && l.cmd
                            .get_arg_conflicts_with(other)
                            .iter()
                            .any(|c| c.get_id() == arg.get_id())
                })
            });
        if excluded {
            sources.insert(s.key.clone(), Source::Overridden(s.at));
            continue;
        }
        sources.insert(s.key.clone(), Source::File(s.at));
        let long = arg.get_long().expect("a key's flag has a long name");
        let words: Vec<OsString> = if takes_value(arg) {
            s.values
                .iter()
                .map(|v| format!("--{long}={v}").into())
                .collect()
        } else if s.on {
            vec![format!("--{long}").into()]
        } else {
            Vec::new()
        };
        inserts.push((level.start, words));
    }
    let mut out = args;
    // Later places first, so that earlier ones stay where they were; a
    // stable sort keeps the file's order at one place.
    inserts.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    let mut by_place: Vec<(usize, Vec<OsString>)> = Vec::new();
    for (at, words) in inserts {
        match by_place.last_mut() {
            Some((p, w)) if *p == at => w.extend(words),
            _ => by_place.push((at, words)),
        }
    }
    for (at, words) in by_place {
        let at = at.min(out.len());
        out.splice(at..at, words);
    }
    (out, sources)
}

/// Keys that name a fleet: a file with one runs `remote enforce` by default.
const FLEET_KEYS: &[&str] = &["host", "hostfile", "inventory", "snapshot-dir"];

/// The command `--config` alone runs: `remote enforce` where the file
/// names hosts, else `enforce`.
pub fn default_command(settings: &[Setting]) -> &'static [&'static str] {
    if settings
        .iter()
        .any(|s| FLEET_KEYS.contains(&s.key.as_str()))
    {
        &["remote", "enforce"]
    } else {
        &["enforce"]
    }
}

/// The settings `top` takes for cycles of its own, with no service to
/// attach to: which hosts and how to reach them, the rules and the
/// policy, for a dry run; nothing that records (the state database, the
/// audit log), tells (notifications), serves (metrics, the view), joins
/// an election or shares the service's SSH sockets, nor how a run
/// prints, ends or acts.
pub fn for_a_look(settings: &[Setting]) -> Vec<Setting> {
    const LEFT: &[&str] = &[
        "control-dir",
        "control-persist",
        "exit-on-error",
        "quiet",
        "dry-run",
        "output",
        "kill-after",
    ];
    (settings.iter())
        .filter(|s| {
            matches!(section_of(&s.key), Some("hosts" | "rules" | "policy"))
                && !LEFT.contains(&s.key.as_str())
        })
        .cloned()
        .collect()
}

/// The subcommands (names) the command line `args` runs.
pub fn command_of(root: &Command, args: &[OsString]) -> Vec<String> {
    levels(root, args)
        .iter()
        .skip(1)
        .map(|l| l.cmd.get_name().to_string())
        .collect()
}

/// Settings a running enforcer keeps until it restarts: a reload that
/// changes one is refused (the metrics endpoint, the state database, the
/// SSH sockets, and every key of the election, `[high-availability]`).
pub fn restart_keys() -> Vec<&'static str> {
    const OWN: &[&str] = &[
        "metrics-listen",
        "web-config-file",
        "view-socket",
        "view-group",
        "state-db",
        "control-dir",
        "control-persist",
    ];
    let ha = SECTIONS
        .iter()
        .filter(|(s, _, _)| *s == "high-availability")
        .flat_map(|(_, _, keys)| keys.iter().copied());
    OWN.iter().copied().chain(ha).collect()
}

/// The values the command line `args` gives `keys` (as typed; empty where
/// it gives none), by key; empty where `args` do not parse.
pub fn values_of(
    root: &Command,
    args: &[OsString],
    keys: &[&str],
) -> BTreeMap<String, Vec<String>> {
    let Ok(matches) = root.clone().try_get_matches_from(args) else {
        return BTreeMap::new();
    };
    let flags = flags(root);
    keys.iter()
        .map(|key| {
            let values = flags
                .get(long_of(key))
                .and_then(|arg| {
                    let id = arg.get_id().as_str();
                    holding(&matches, id)?.get_raw(id)
                })
                .map(|raw| raw.map(|v| v.to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            (key.to_string(), values)
        })
        .collect()
}

/// The matches of `matches`' subcommand chain that hold flag `id` (the
/// deepest: a subcommand's flag of the same name as its parent's wins).
pub fn holding<'a>(matches: &'a ArgMatches, id: &str) -> Option<&'a ArgMatches> {
    let mut chain = vec![matches];
    while let Some((_, sub)) = chain.last().and_then(|m| m.subcommand()) {
        chain.push(sub);
    }
    chain
        .into_iter()
        .rev()
        .find(|m| m.ids().any(|i| i.as_str() == id))
}

/// What two boxes of one election must agree on to act alike: the
/// sections of rules, policy and notifications, and the hosts (`host`
/// here, an inventory's or hostfile's text beside). Files of the box's own
/// (its audit log, state database, keys, metrics endpoint) and its name
/// and shard may differ.
const SHARED_SECTIONS: &[&str] = &["rules", "policy", "notifications"];

/// A digest of the configuration the command line `run` (a configuration
/// file applied) gives, with the text of its inventory or hostfile: the
/// values of the keys boxes share ([`SHARED_SECTIONS`], `host`), FNV-1a
/// over their JSON, 16 hex digits. Boxes that act alike have the same.
pub fn digest(root: &Command, run: &[OsString], hosts_text: Option<&str>) -> String {
    use std::hash::Hasher;
    let keys: Vec<&str> = SECTIONS
        .iter()
        .filter(|(s, _, _)| SHARED_SECTIONS.contains(s))
        .flat_map(|(_, _, keys)| keys.iter().copied())
        .chain(["host"])
        .collect();
    let values = values_of(root, run, &keys);
    let mut h = fnv::FnvHasher::default();
    h.write(&serde_json::to_vec(&values).expect("strings"));
    h.write(hosts_text.unwrap_or_default().as_bytes());
    format!("{:016x}", h.finish())
}

/// The value of `--config` on the command line `args`, if any.
pub fn path_in(args: &[OsString]) -> Option<OsString> {
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        if a == "--" {
            return None;
        }
        if a == "--config" {
            return it.next().cloned();
        }
        if let Some(v) = a.to_str().and_then(|s| s.strip_prefix("--config=")) {
            return Some(v.into());
        }
    }
    None
}

/// The JSON Schema (draft 2020-12) of the file, from clap's definitions of
/// `root`: what editors (taplo, Even Better TOML) check and complete.
pub fn schema(root: &Command) -> Json {
    let flags = flags(root);
    let mut sections = serde_json::Map::new();
    for (name, about, keys) in SECTIONS {
        let mut props = serde_json::Map::new();
        for key in *keys {
            let Some(arg) = flags.get(long_of(key)) else {
                continue;
            };
            props.insert((*key).to_string(), key_schema(arg));
        }
        sections.insert(
            (*name).to_string(),
            json!({
                "type": "object",
                "description": about,
                "additionalProperties": false,
                "properties": props,
            }),
        );
    }
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "genv-enforce configuration",
        "description": "genv-enforce's configuration file: each key is the flag of the same name (`genv-enforce --help`); a flag on the command line wins over the file. Check a file with `genv-enforce config check --config FILE`.",
        "type": "object",
        "additionalProperties": false,
        "properties": sections,
    })
}

fn key_schema(arg: &Arg) -> Json {
    let help = arg
        .get_long_help()
        .or_else(|| arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let mut s = if !takes_value(arg) {
        json!({ "type": "boolean" })
    } else {
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|p| p.get_name().to_string())
            .collect();
        let one = if possible.is_empty() {
            json!({ "type": ["string", "integer"] })
        } else {
            json!({ "type": "string", "enum": possible })
        };
        if takes_pairs(arg) {
            json!({
                "anyOf": [
                    { "type": "object", "additionalProperties": { "type": ["string", "integer"] } },
                    { "type": "array", "items": { "type": "string" } },
                ]
            })
        } else if takes_many(arg) {
            json!({ "anyOf": [one.clone(), { "type": "array", "items": one }] })
        } else {
            one
        }
    };
    let obj = s.as_object_mut().expect("an object");
    obj.insert("description".into(), help.into());
    if let Some(d) = arg
        .get_default_values()
        .first()
        .and_then(|d| d.to_str())
        .filter(|_| takes_value(arg))
    {
        obj.insert("default".into(), d.into());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn root() -> Command {
        crate::cli::Cli::command()
    }

    /// A flag takes several values when it may be repeated, takes more
    /// than one at a time, or splits one on a delimiter; else one.
    #[test]
    fn a_flag_takes_many_values_by_any_of_three_signs() {
        let set = || Arg::new("x").action(ArgAction::Set);
        assert!(takes_many(&Arg::new("x").action(ArgAction::Append)));
        assert!(takes_many(&set().num_args(1..)));
        assert!(takes_many(&set().value_delimiter(',')));
        assert!(!takes_many(&set()));
        assert!(!takes_many(&set().num_args(1)));
    }

    /// A look of `top`'s own takes the hosts, the rules and the policy
    /// of the shipped file, and nothing that records, tells, serves or
    /// joins.
    #[test]
    fn a_look_takes_hosts_rules_and_policy_only() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/contrib/genv-enforce.toml"
        ))
        .unwrap()
        .replace("# ha-etcd", "ha-etcd")
        .replace("# smtp", "smtp")
        .replace("# mail-from", "mail-from")
        .replace("# kill-after", "kill-after")
        .replace(
            "# concurrency = 32",
            "control-dir = \"/run/genv-enforce/ssh\"",
        );
        let all = parse(&text, &root()).unwrap();
        let keys = |s: &[Setting]| s.iter().map(|s| s.key.clone()).collect::<BTreeSet<_>>();
        for k in [
            "ha-etcd",
            "smtp",
            "state-db",
            "audit-log",
            "view-socket",
            "kill-after",
            "control-dir",
        ] {
            assert!(keys(&all).contains(k), "{k} in the file");
        }
        let look = keys(&for_a_look(&all));
        let want = [
            "inventory",
            "known-hosts-file",
            "host-key-check",
            "non-env-processes",
            "env-devices",
            "max-devices-per-user",
            "interval",
        ];
        assert_eq!(look, want.iter().map(|k| k.to_string()).collect());
    }

    fn args(line: &str) -> Vec<OsString> {
        std::iter::once("genv-enforce")
            .chain(line.split_whitespace())
            .map(OsString::from)
            .collect()
    }

    fn names(levels: &[Level]) -> Vec<&str> {
        levels.iter().map(|l| l.cmd.get_name()).collect()
    }

    #[test]
    fn levels_split_a_line_as_clap_does() {
        let set = |name: &'static str| Arg::new(name).long(name).action(ArgAction::Set);
        let root = Command::new("x")
            .arg(set("many").num_args(1..))
            .arg(set("one"))
            .arg(Arg::new("on").long("on").action(ArgAction::SetTrue))
            .subcommand(Command::new("run").alias("go").arg(set("n")));
        for line in [
            "x run --n 1",
            "x go --n 1",
            "x stop",
            "x --many a b run",
            "x --many a --on run",
            "x --one run",
            "x --one run run",
            "x --one=run run",
            "x --on run",
        ] {
            let words: Vec<OsString> = line.split(' ').map(OsString::from).collect();
            let found = levels(&root, &words);
            let Ok(clap) = root.clone().try_get_matches_from(&words) else {
                assert_eq!(names(&found), ["x"], "{line}");
                continue;
            };
            let want: Vec<&str> = std::iter::once("x").chain(clap.subcommand_name()).collect();
            assert_eq!(names(&found), want, "{line}");
        }
    }

    #[test]
    fn levels_pass_over_a_word_that_is_not_utf8() {
        use std::os::unix::ffi::OsStringExt;
        let mut line = args("");
        line.push(OsString::from_vec(b"\xff".to_vec()));
        line.extend(args("remote enforce --dry-run").into_iter().skip(1));
        let found = levels(&root(), &line);
        assert_eq!(names(&found), ["genv-enforce", "remote", "enforce"]);
        assert_eq!(found[2].start, 4);
        assert!(found[2].given.contains("dry_run"), "{:?}", found[2].given);
    }

    #[test]
    fn a_short_flags_value_is_the_rest_of_its_word_or_the_next_word() {
        // Attached: the next word is the subcommand.
        let found = levels(&root(), &args("remote -Hgpu1 enforce"));
        assert_eq!(names(&found), ["genv-enforce", "remote", "enforce"]);
        // Apart: the next word is the value, even one named as a subcommand.
        let found = levels(&root(), &args("remote -H doctor enforce"));
        assert_eq!(names(&found), ["genv-enforce", "remote", "enforce"]);
        assert_eq!(found[2].start, 5);
    }

    fn words(a: &[OsString]) -> String {
        a[1..]
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    const FILE: &str = r#"
[hosts]
inventory = "/etc/genv-enforce/hosts.toml"
concurrency = 8

[rules]
non-env-processes = true
max-devices-per-user = 2
max-devices-for-user = { alice = 4 }

[policy]
interval = "30s"
dry-run = false

[high-availability]
ha-etcd = ["http://a:2379", "http://b:2379"]
"#;

    #[test]
    fn each_value_goes_to_the_subcommand_that_owns_its_flag() {
        let settings = parse(FILE, &root()).unwrap();
        let (merged, _) = apply(&root(), &args("remote enforce"), &settings);
        assert_eq!(
            words(&merged),
            "remote --inventory=/etc/genv-enforce/hosts.toml --concurrency=8 enforce \
             --non-env-processes --max-devices-per-user=2 --max-devices-for-user=alice=4 \
             --interval=30s --ha-etcd=http://a:2379 --ha-etcd=http://b:2379"
        );
        use clap::Parser;
        crate::cli::Cli::try_parse_from(&merged).unwrap();
    }

    #[test]
    fn the_command_line_wins_and_excludes_what_conflicts() {
        let settings = parse(FILE, &root()).unwrap();
        let (merged, sources) = apply(
            &root(),
            &args("-v remote -H gpu1 -t 5 enforce --max-devices-per-user 3 --no-non-env-processes -- x"),
            &settings,
        );
        assert_eq!(
            words(&merged),
            "-v remote --concurrency=8 -H gpu1 -t 5 enforce --max-devices-for-user=alice=4 \
             --interval=30s --ha-etcd=http://a:2379 --ha-etcd=http://b:2379 \
             --max-devices-per-user 3 --no-non-env-processes -- x"
        );
        assert!(matches!(sources["inventory"], Source::Overridden(_)));
        assert!(matches!(
            sources["non-env-processes"],
            Source::Overridden(_)
        ));
        assert!(matches!(
            sources["max-devices-per-user"],
            Source::Overridden(_)
        ));
        assert!(matches!(sources["concurrency"], Source::File(_)));
    }

    #[test]
    fn a_flag_typed_that_excludes_a_key_wins_whichever_declares_it() {
        // --non-env-processes declares the conflict with the key's flag.
        let file = parse("[rules]\nno-non-env-processes = true\n", &root()).unwrap();
        let (merged, sources) = apply(&root(), &args("enforce --non-env-processes"), &file);
        assert_eq!(words(&merged), "enforce --non-env-processes");
        assert!(matches!(
            sources["no-non-env-processes"],
            Source::Overridden(_)
        ));
        // --webhook-file declares it with the key's --webhook.
        let file = parse("[notifications]\nwebhook = \"http://h/x\"\n", &root()).unwrap();
        let (merged, sources) = apply(&root(), &args("enforce --webhook-file /w"), &file);
        assert_eq!(words(&merged), "enforce --webhook-file /w");
        assert!(matches!(sources["webhook"], Source::Overridden(_)));
    }

    #[test]
    fn a_shared_flag_is_described_as_the_service_runs_it() {
        let f = flags(&root());
        let help = |k: &str| f[k].get_help().map(ToString::to_string).unwrap_or_default();
        assert!(
            help("command-timeout").contains("remote command"),
            "{}",
            help("command-timeout")
        );
        assert!(!help("output").contains("a table"), "{}", help("output"));
    }

    #[test]
    fn doctor_with_a_file_that_names_hosts_checks_them_as_the_service_reaches_them() {
        let settings = parse(FILE, &root()).unwrap();
        let (merged, _) = apply(&root(), &args("-v doctor --output json"), &settings);
        assert_eq!(
            words(&merged),
            "-v remote --inventory=/etc/genv-enforce/hosts.toml --concurrency=8 doctor \
             --ha-etcd=http://a:2379 --ha-etcd=http://b:2379 --output json"
        );
        use clap::Parser;
        crate::cli::Cli::try_parse_from(&merged).unwrap();
        // A file of this machine alone: its doctor.
        let local = parse("[rules]\nnon-env-processes = true\n", &root()).unwrap();
        let (merged, _) = apply(&root(), &args("doctor"), &local);
        assert_eq!(words(&merged), "doctor");
    }

    #[test]
    fn keys_a_command_lacks_are_unused() {
        let settings = parse(FILE, &root()).unwrap();
        let (merged, sources) = apply(&root(), &args("enforce --dry-run"), &settings);
        assert!(words(&merged).starts_with("enforce --non-env-processes"));
        assert!(matches!(sources["inventory"], Source::Unused(_)));
        assert!(matches!(sources["interval"], Source::File(_)));
    }

    #[test]
    fn problems_are_named_at_their_line_and_column() {
        let text = "[rules]\nmax-devices-per-user = \"two\"\nmax-device-per-user = 2\ninterval = 3\n[nope]\n[policy]\ndry-run = \"yes\"\ngrace = 3.5\n";
        let problems: Vec<String> = parse(text, &root())
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            problems,
            [
                "2:24: max-devices-per-user: \"two\": invalid digit found in string",
                "3:1: unknown key \"max-device-per-user\" in [rules]; did you mean \"max-devices-per-user\"?",
                "4:1: \"interval\" belongs in [policy], not [rules]",
                "5:2: unknown section [nope] (sections: [hosts], [rules], [policy], [notifications], [state], [metrics], [high-availability])",
                "7:11: dry-run: true or false, not a string",
                "8:9: grace: a string or an integer, not a float",
            ]
        );
        let bad = parse("[rules\n", &root()).unwrap_err();
        assert_eq!(bad[0].at.line, 1, "{bad:?}");
        assert!(bad[0].message.starts_with("not TOML"), "{bad:?}");
    }

    #[test]
    fn pairs_may_be_a_table_of_their_own() {
        let text = "[rules.max-devices-for-user]\nalice = 4\nbob = \"2\"\n[rules]\nmax-devices-per-group.ml = 3\n";
        let settings = parse(text, &root()).unwrap();
        let values: Vec<&[String]> = settings.iter().map(|s| &s.values[..]).collect();
        assert_eq!(
            values,
            [
                &["alice=4".to_string(), "bob=2".to_string()][..],
                &["ml=3".to_string()][..]
            ]
        );
        let nested = parse("[rules.max-devices-for-user.alice]\nx = 1\n", &root()).unwrap_err();
        assert_eq!(
            nested[0].message,
            "max-devices-for-user: alice: a string or an integer, not a table"
        );
    }

    #[test]
    fn the_default_command_goes_before_the_flags_and_reports_take_nothing() {
        let settings = parse(FILE, &root()).unwrap();
        let (merged, _) = apply(&root(), &args("--dry-run --interval 0"), &settings);
        let merged = words(&merged);
        assert!(merged.starts_with("remote --inventory="), "{merged}");
        assert!(merged.ends_with(" --dry-run --interval 0"), "{merged}");
        let state = parse(
            "[state]\nstate-db = \"/x.db\"\n[policy]\noutput = \"json\"\n",
            &root(),
        )
        .unwrap();
        let (merged, sources) = apply(&root(), &args("report --state-db /y.db"), &state);
        assert_eq!(words(&merged), "report --state-db /y.db");
        assert!(matches!(sources["output"], Source::Unused(_)));
        assert!(matches!(sources["state-db"], Source::Unused(_)));
    }

    #[test]
    fn a_digest_tells_configurations_apart_but_not_boxes() {
        let d = |line: &str, hosts: Option<&str>| digest(&root(), &args(line), hosts);
        let base = d(
            "remote -H a enforce --max-devices-per-user 2 --ha-etcd http://e:2379",
            None,
        );
        assert_eq!(base.len(), 16);
        assert_eq!(
            base,
            d(
                "remote -H a enforce --max-devices-per-user 2 --ha-etcd http://e:2379 --ha-name x \
                 --audit-log /b.log --shard 1/2",
                None
            )
        );
        assert_ne!(
            base,
            d(
                "remote -H b enforce --max-devices-per-user 2 --ha-etcd http://e:2379",
                None
            )
        );
        assert_ne!(
            base,
            d(
                "remote -H a enforce --max-devices-per-user 3 --ha-etcd http://e:2379",
                None
            )
        );
        assert_ne!(
            base,
            d(
                "remote -H a enforce --max-devices-per-user 2 --ha-etcd http://e:2379",
                Some("x")
            )
        );
    }

    #[test]
    fn the_config_flag_is_found_as_clap_reads_it() {
        assert_eq!(path_in(&args("--config a remote")), Some("a".into()));
        assert_eq!(
            path_in(&args("remote --config=b enforce")),
            Some("b".into())
        );
        assert_eq!(path_in(&args("remote enforce -- --config c")), None);
        assert_eq!(path_in(&args("remote enforce")), None);
    }

    #[test]
    fn restart_only_keys_are_the_listeners_stores_sockets_and_every_election_key() {
        let keys = restart_keys();
        for k in [
            "metrics-listen",
            "web-config-file",
            "view-socket",
            "view-group",
            "state-db",
            "control-dir",
        ] {
            assert!(keys.contains(&k), "{k} in {keys:?}");
        }
        let ha: Vec<&str> = SECTIONS
            .iter()
            .filter(|(s, _, _)| *s == "high-availability")
            .flat_map(|(_, _, k)| k.iter().copied())
            .collect();
        assert!(ha.contains(&"ha-etcd") && ha.iter().all(|k| keys.contains(k)));
        for k in ["interval", "non-env-processes", "retain", "grace"] {
            assert!(!keys.contains(&k), "{k} is applied on reload");
        }
        assert_eq!(keys.len(), 7 + ha.len(), "{keys:?}");
    }
}
