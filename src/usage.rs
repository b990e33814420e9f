//! Who uses what, per host and user, from one cycle's snapshots: the
//! samples `--state-db` keeps for `report` and the per-user gauges. Pure.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

pub use crate::report::{samples, Sample};

/// A usage sample as recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageRow {
    pub time_ms: u64,
    /// How long it stands for (since the sample before).
    pub seconds: f64,
    pub host: String,
    pub user: String,
    pub devices: u32,
    pub memory_bytes: u64,
}

/// A warning, acting or clearing as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRow {
    pub host: String,
    pub user: Option<String>,
    pub stage: String,
    /// Comma-separated rule names.
    pub rules: String,
    /// What it is about (a pid, or an environment on a device; none for
    /// a row that counts those left out).
    pub target: String,
    /// Events it stands for.
    pub count: u64,
}

/// An action's outcome as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionRow {
    pub host: String,
    pub user: Option<String>,
    /// `terminate`, `kill` or `detach`.
    pub action: String,
    /// As in the JSON report (`signalled`, `detached`, `dry_run`, ...).
    pub result: String,
    pub rules: String,
    pub target: String,
    /// Outcomes it stands for.
    pub count: u64,
}

/// What a database holds for a period.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recorded {
    pub usage: Vec<UsageRow>,
    pub events: Vec<EventRow>,
    pub actions: Vec<ActionRow>,
}

/// One line of a report: a user's (or a host's) period.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Line {
    /// The user or the host.
    pub name: String,
    /// GPUs held by their processes, times how long.
    pub gpu_hours: f64,
    /// The most GPUs at once (over all hosts, for a user).
    pub peak_gpus: u32,
    /// Their processes' GPU memory, averaged over the cycles they ran in.
    pub mean_gpu_memory_bytes: u64,
    /// Distinct violations (a process, or an environment on a device) by
    /// rule.
    pub violations: BTreeMap<String, u64>,
    pub warnings: u64,
    pub terminations: u64,
    pub detaches: u64,
}

/// The report's lines, by user or by host, in name order.
pub fn summarize(r: &Recorded, by_host: bool) -> Vec<Line> {
    #[derive(Default)]
    struct Acc {
        line: Line,
        /// Per sample time: GPUs and memory then.
        at: BTreeMap<u64, (u32, u128)>,
        seen: BTreeSet<(String, String, String)>,
    }
    let unknown = "(unknown)".to_string();
    let mut acc: BTreeMap<String, Acc> = BTreeMap::new();
    for u in &r.usage {
        let key = if by_host { &u.host } else { &u.user };
        let a = acc.entry(key.clone()).or_default();
        a.line.gpu_hours += f64::from(u.devices) * u.seconds / 3600.0;
        let at = a.at.entry(u.time_ms).or_default();
        at.0 = at.0.saturating_add(u.devices);
        at.1 = at.1.saturating_add(u128::from(u.memory_bytes));
    }
    let violation = |a: &mut Acc, host: &str, rules: &str, target: &str| {
        for rule in rules.split(',').filter(|r| !r.is_empty()) {
            if a.seen
                .insert((rule.to_string(), host.to_string(), target.to_string()))
            {
                *a.line.violations.entry(rule.to_string()).or_default() += 1;
            }
        }
    };
    for e in &r.events {
        let key = if by_host {
            &e.host
        } else {
            e.user.as_ref().unwrap_or(&unknown)
        };
        let a = acc.entry(key.clone()).or_default();
        if e.stage == "warned" {
            a.line.warnings += e.count;
        }
        violation(a, &e.host, &e.rules, &e.target);
    }
    for x in &r.actions {
        let key = if by_host {
            &x.host
        } else {
            x.user.as_ref().unwrap_or(&unknown)
        };
        let a = acc.entry(key.clone()).or_default();
        match (x.action.as_str(), x.result.as_str()) {
            ("terminate", "signalled") => a.line.terminations += x.count,
            ("detach", "detached") => a.line.detaches += x.count,
            _ => {}
        }
        violation(a, &x.host, &x.rules, &x.target);
    }
    acc.into_iter()
        .map(|(name, a)| {
            let cycles = a.at.len() as u64;
            Line {
                name,
                peak_gpus: a.at.values().map(|(d, _)| *d).max().unwrap_or(0),
                mean_gpu_memory_bytes: u64::try_from(
                    a.at.values().map(|(_, m)| *m).sum::<u128>() / u128::from(cycles.max(1)),
                )
                .unwrap_or(u64::MAX),
                ..a.line
            }
        })
        .collect()
}

/// The columns of a report, after its first (`user` or `host`).
const COLUMNS: [&str; 7] = [
    "gpu_hours",
    "peak_gpus",
    "mean_gpu_memory_mib",
    "warnings",
    "terminations",
    "detaches",
    "violations",
];

fn cells(l: &Line) -> [String; 7] {
    [
        format!("{:.2}", l.gpu_hours),
        l.peak_gpus.to_string(),
        (l.mean_gpu_memory_bytes >> 20).to_string(),
        l.warnings.to_string(),
        l.terminations.to_string(),
        l.detaches.to_string(),
        l.violations
            .iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect::<Vec<_>>()
            .join(" "),
    ]
}

/// The report as an aligned table (names escaped for a terminal).
pub fn render_text(lines: &[Line], by_host: bool) -> String {
    let mut rows: Vec<Vec<String>> = vec![std::iter::once(if by_host { "host" } else { "user" })
        .chain(COLUMNS)
        .map(String::from)
        .collect()];
    rows.extend(lines.iter().map(|l| {
        std::iter::once(crate::report::clean(&l.name).into_owned())
            .chain(cells(l))
            .collect()
    }));
    let widths: Vec<usize> = (0..=COLUMNS.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            // Names left, numbers right; the last column as it is.
            let pad = widths[c] - cell.chars().count();
            if c == 0 || c == COLUMNS.len() {
                line.push_str(cell);
                if c < COLUMNS.len() {
                    line.push_str(&" ".repeat(pad));
                }
            } else {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One CSV field: quoted when it holds a comma, quote or line break, and
/// a leading `=`, `+`, `-` or `@` defused (a spreadsheet would run it).
fn csv_field(text: &str) -> String {
    let text = if text.starts_with(['=', '+', '-', '@']) {
        format!("'{text}")
    } else {
        text.to_string()
    };
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text
    }
}

/// The report as CSV, a header line first.
pub fn render_csv(lines: &[Line], by_host: bool) -> String {
    let mut out = std::iter::once(if by_host { "host" } else { "user" })
        .chain(COLUMNS)
        .collect::<Vec<_>>()
        .join(",");
    out.push('\n');
    for l in lines {
        let row: Vec<String> = std::iter::once(csv_field(&crate::report::clean(&l.name)))
            .chain(cells(l).iter().map(|c| csv_field(c)))
            .collect();
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

/// The report as one JSON array (terminal-safe).
pub fn render_json(lines: &[Line]) -> String {
    crate::report::json_safe(serde_json::to_string(lines).unwrap_or_else(|_| "[]".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Cluster, HostId, HostSnapshot, Mode, Usage};
    use crate::rules::test_support::{mib, proc_};

    #[test]
    fn each_users_devices_memory_and_processes_per_host() {
        let mut bobs = proc_(3, None, &[(1, mib(50))]);
        bobs.user = Some("bob".into());
        let mut nobody = proc_(4, None, &[(2, mib(1))]);
        nobody.user = None;
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, Some("a"), &[(0, mib(100)), (1, mib(10))]),
                proc_(2, Some("a"), &[(0, Usage::Unknown)]),
                bobs,
                nobody,
            ],
            ..HostSnapshot::default()
        };
        let cluster = Cluster {
            mode: Mode::Remote,
            hosts: vec![(HostId("h".into()), snap)],
        };
        let s = samples(&cluster);
        let rows: Vec<(&str, u32, u64, u32)> = s
            .iter()
            .map(|s| {
                (
                    s.user.as_str(),
                    s.devices,
                    s.memory_bytes >> 20,
                    s.processes,
                )
            })
            .collect();
        assert_eq!(rows, [("alice", 2, 110, 2), ("bob", 1, 50, 1)]);
    }

    #[test]
    fn a_period_summed_per_user_and_per_host() {
        let row = |t: u64, s: f64, host: &str, user: &str, devices: u32| UsageRow {
            time_ms: t,
            seconds: s,
            host: host.into(),
            user: user.into(),
            devices,
            memory_bytes: u64::from(devices) << 30,
        };
        let r = Recorded {
            usage: vec![
                row(0, 0.0, "h1", "alice", 2),
                row(0, 0.0, "h2", "alice", 1),
                row(1_800_000, 1800.0, "h1", "alice", 2),
                row(1_800_000, 1800.0, "h2", "alice", 2),
                row(1_800_000, 1800.0, "h2", "bob", 1),
            ],
            events: vec![EventRow {
                host: "h2".into(),
                user: Some("bob".into()),
                stage: "warned".into(),
                rules: "env-devices".into(),
                target: "pid 7".into(),
                count: 1,
            }],
            actions: vec![
                ActionRow {
                    host: "h2".into(),
                    user: Some("bob".into()),
                    action: "terminate".into(),
                    result: "signalled".into(),
                    rules: "env-devices".into(),
                    target: "pid 7".into(),
                    count: 1,
                },
                ActionRow {
                    host: "h1".into(),
                    user: Some("alice".into()),
                    action: "detach".into(),
                    result: "detached".into(),
                    rules: "max-devices-per-user".into(),
                    target: "a on 1".into(),
                    count: 3,
                },
            ],
        };
        let by_user = summarize(&r, false);
        let alice = &by_user[0];
        assert_eq!(
            (alice.name.as_str(), alice.gpu_hours, alice.peak_gpus),
            ("alice", 2.0, 4)
        );
        assert_eq!(alice.mean_gpu_memory_bytes, 7 << 29);
        assert_eq!(
            (alice.detaches, alice.terminations, alice.warnings),
            (3, 0, 0)
        );
        let bob = &by_user[1];
        assert_eq!((bob.gpu_hours, bob.warnings, bob.terminations), (0.5, 1, 1));
        // Seen warned and acted on: one violation.
        assert_eq!(bob.violations.get("env-devices"), Some(&1));
        let by_host = summarize(&r, true);
        assert_eq!(
            by_host
                .iter()
                .map(|l| (l.name.as_str(), l.gpu_hours))
                .collect::<Vec<_>>(),
            [("h1", 1.0), ("h2", 1.5)]
        );
    }

    #[test]
    fn names_are_escaped_for_each_medium() {
        let lines = vec![Line {
            name: "=cmd|x,\"y\"\x1b[2J".into(),
            ..Line::default()
        }];
        let csv = render_csv(&lines, false);
        let row = csv.lines().nth(1).unwrap();
        assert!(row.starts_with("\"'=cmd|x,"), "{row}");
        assert!(row.contains("\"\"y") && !row.contains('\x1b'), "{row}");
        let text = render_text(&lines, false);
        assert!(!text.contains('\x1b'), "{text}");
        assert!(!render_json(&lines).contains('\x1b'));
    }
}
