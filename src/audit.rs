//! The audit log (`--audit-log FILE`): one JSON line per decided action,
//! written and flushed to disk before the action, and one with its outcome
//! after. The file is opened once, append-only, never truncated and never
//! through a symlink; it must be ours and writable by no one else, so that
//! no user can forge or erase what root did. The line format is in
//! `docs/operations.md` ("Audit log").

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use rustix::fs::{Mode, OFlags};
use serde::Serialize;
use thiserror::Error;

use crate::assess::HostStatus;
use crate::ladder::{Event, Stage, What};
use crate::model::{EnvId, FailureKind, GpuIndex, HostId, Pid};
use crate::outcome::Outcome;
use crate::plan::{HostPlan, Termination};
use crate::private::{own_file, Refusal};
use crate::report;
use crate::rules::{Notice, Rule, Rules};

/// An audit log that cannot be used: why it is refused, or the error that
/// kept it from being opened.
#[derive(Debug, Error)]
#[error("--audit-log {}", path.display())]
pub struct AuditError {
    pub path: PathBuf,
    #[source]
    pub source: Refusal,
}

/// An open audit log.
#[derive(Debug)]
pub struct AuditLog {
    file: Mutex<File>,
    /// The stray processes already noticed (host, pid, start time), for as
    /// long as each stays one: a line when first seen, not every cycle.
    noticed: Mutex<HashSet<(HostId, Pid, Option<u64>)>>,
    /// The hosts failing, and how: a line when one starts failing.
    failing: Mutex<HashMap<HostId, FailureKind>>,
    /// Why the last write failed, while writes fail: the log is degraded
    /// (actions go on unrecorded, said loudly).
    degraded: Mutex<Option<String>>,
    /// Each host's decisions of the last cycle it acted in, and of this
    /// one: a decision as the cycle before is not written again.
    decisions: Mutex<HashMap<HostId, Decisions>>,
}

/// `decided` lines one user may have on a host in a cycle; the rest are
/// counted in one line per action ([`AuditLog::bounded`]).
pub const PER_USER: usize = 32;

/// What makes two `decided` lines the same decision.
type Decision = (
    Action,
    Option<Pid>,
    Option<u64>,
    Option<GpuIndex>,
    Option<EnvId>,
    Rules,
);

fn decision(e: &Entry) -> Decision {
    let eid = e.eid.cloned();
    let rules = e.rules.iter().copied().collect();
    (e.action, e.pid, e.start_time, e.device, eid, rules)
}

/// A host's decisions: in `cycle`, and in the cycle before it; the lines
/// written in `cycle`, by whose they are.
#[derive(Debug, Default)]
struct Decisions {
    cycle: u64,
    now: HashSet<Decision>,
    before: HashSet<Decision>,
    lines: HashMap<Option<String>, usize>,
}

/// One line of the log.
#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    pub cycle: u64,
    pub host: &'a HostId,
    pub phase: Phase,
    pub action: Action,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<Pid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_time: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<GpuIndex>,
    pub eid: Option<&'a EnvId>,
    pub user: Option<&'a str>,
    pub rules: Vec<Rule>,
    /// genv's line for the action (`Terminating process ...`).
    pub message: String,
    /// The outcome (`done` lines only), as in the JSON report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<serde_json::Value>,
    /// The kind of step that failed (`failed` lines), or the channel
    /// (`unsent` lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<&'static str>,
    /// When the action is due (`warned` lines with a grace), RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    /// How many actions the line stands for, where it stands for several
    /// not written one by one ([`AuditLog::bounded`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// Whose the action is as the kernel says (a process's user; for a
    /// detach, a live process of the charged user carrying the
    /// environment), which the bound on lines goes by: a name a record
    /// makes up is nobody's.
    #[serde(skip)]
    pub whose: Option<&'a str>,
}

/// What a line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// An action, written before it is carried out.
    Decided,
    /// An action with its outcome.
    Done,
    /// A stray process left alone, one left unjudged, or one judged as
    /// carrying no environment because of what it did to its own, when
    /// first seen.
    Noticed,
    /// A host that failed, or whose genv state could not be used
    /// (`failure`: `degraded`), when it starts (or fails otherwise).
    Failed,
    /// An action that waits on its grace, when first seen (its owner told).
    Warned,
    /// A warned action whose violation ended before it was due.
    Cleared,
    /// A notification that could not be sent (`failure`: its channel,
    /// `message`: why).
    Unsent,
    /// The configuration read again on SIGHUP (no host).
    Reloaded,
    /// A configuration refused on SIGHUP, the running one kept (`message`:
    /// why).
    Refused,
}

/// The action a line is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Terminate,
    Kill,
    Detach,
    /// Nothing is done (`noticed` and `failed` lines).
    None,
}

impl AuditLog {
    /// Opens (creating 0600 if missing) `path` for appending, refusing a
    /// symlink, anything but a regular file, a file not ours, and one that
    /// others may write or that is write-protected.
    ///
    /// # Errors
    /// The file cannot be opened, or is refused.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        let refused = |source: Refusal| AuditError {
            path: path.to_path_buf(),
            source,
        };
        let fd: OwnedFd = rustix::fs::open(
            path,
            OFlags::WRONLY
                | OFlags::APPEND
                | OFlags::CREATE
                | OFlags::NOFOLLOW
                | OFlags::NONBLOCK
                | OFlags::NOCTTY
                | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| refused(e.into()))?;
        let stat = own_file(&fd, 0o022).map_err(refused)?;
        if stat.st_mode & 0o200 == 0 {
            return Err(refused(Refusal::WriteProtected));
        }
        Ok(AuditLog {
            file: Mutex::new(File::from(fd)),
            noticed: Mutex::default(),
            failing: Mutex::default(),
            degraded: Mutex::default(),
            decisions: Mutex::default(),
        })
    }

    /// Appends lines and flushes them to disk. A failure makes the log
    /// degraded until a write succeeds again; each change is said on
    /// stderr and in the journal.
    ///
    /// # Errors
    /// The write or the flush failed.
    pub fn write(&self, entries: &[Entry]) -> std::io::Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let written = self.append(entries);
        let mut degraded = self.degraded.lock().unwrap_or_else(|e| e.into_inner());
        match (&written, degraded.is_some()) {
            (Err(e), false) => {
                tracing::error!(error = %e, "audit log degraded: actions go on unrecorded");
                crate::output::complain(&format!(
                    "audit log degraded ({e}): actions go on, unrecorded, until it can be written again"
                ));
            }
            (Ok(()), true) => {
                tracing::warn!("audit log written again");
                crate::output::complain("audit log written again");
            }
            _ => {}
        }
        *degraded = written.as_ref().err().map(ToString::to_string);
        written
    }

    fn append(&self, entries: &[Entry]) -> std::io::Result<()> {
        let mut text = String::new();
        for e in entries {
            text.push_str(&report::json_safe(
                serde_json::to_string(e).map_err(std::io::Error::other)?,
            ));
            text.push('\n');
        }
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        file.write_all(text.as_bytes())?;
        file.sync_data()
    }

    /// Why the log cannot be written, while it cannot.
    pub fn degraded(&self) -> Option<String> {
        self.degraded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl AuditLog {
    /// Records the stray processes of `notices` (jobs carrying an
    /// environment id that are left alone) not noticed already, one
    /// `noticed` line each; forgets those no longer seen.
    ///
    /// # Errors
    /// The write or the flush failed (they are noticed again next cycle).
    pub fn strays(
        &self,
        cycle: u64,
        mode: crate::model::Mode,
        notices: &[Notice],
    ) -> std::io::Result<()> {
        let time = now();
        let mut noticed = self.noticed.lock().unwrap_or_else(|e| e.into_inner());
        let mut current = HashSet::new();
        let mut entries = Vec::new();
        for n in notices {
            // Left alone, or judged for what the process did to its own
            // environment: said once while it lasts.
            let (host, pid, start_time, eid, user) = match n {
                Notice::Stray {
                    host,
                    pid,
                    start_time,
                    eid,
                    user,
                    ..
                } => (host, pid, start_time, Some(eid), user.as_deref()),
                Notice::HiddenEnviron {
                    host, pid, user, ..
                } => (host, pid, &None, None, user.as_deref()),
                Notice::UnknownOwner { host, pid, .. } => (host, pid, &None, None, None),
                _ => continue,
            };
            let key = (host.clone(), *pid, *start_time);
            if !noticed.contains(&key) {
                entries.push(Entry {
                    pid: Some(*pid),
                    start_time: *start_time,
                    eid,
                    user,
                    ..Entry::about(
                        time.clone(),
                        cycle,
                        host,
                        Phase::Noticed,
                        report::notice_line(mode, n),
                    )
                });
            }
            current.insert(key);
        }
        self.write(&entries)?;
        *noticed = current;
        Ok(())
    }

    /// Records the hosts of `hosts` that failed this cycle and did not the
    /// last (or failed otherwise), one `failed` line each; forgets those
    /// that answered.
    ///
    /// # Errors
    /// The write or the flush failed (they are recorded again next cycle).
    pub fn failures(&self, cycle: u64, hosts: &[HostStatus]) -> std::io::Result<()> {
        let time = now();
        let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
        let mut current = HashMap::new();
        let mut entries = Vec::new();
        for h in hosts {
            let degraded = h
                .degraded
                .as_ref()
                .map(|why| crate::model::HostFailure::new(FailureKind::Degraded, why.clone()));
            let Some(f) = h.error.as_ref().or(degraded.as_ref()) else {
                continue;
            };
            if failing.get(&h.host) != Some(&f.kind) {
                entries.push(Entry {
                    failure: Some(f.kind.name()),
                    ..Entry::about(
                        time.clone(),
                        cycle,
                        &h.host,
                        Phase::Failed,
                        f.message.clone(),
                    )
                });
            }
            current.insert(h.host.clone(), f.kind);
        }
        self.write(&entries)?;
        *failing = current;
        Ok(())
    }
}

impl AuditLog {
    /// The `decided` lines of one host's actions in `cycle` to write,
    /// bounded so that nothing a user writes grows the log without bound:
    /// a decision the same as one of the host's in the cycle before (a
    /// record written again, a process that outlived its signal) is not
    /// written again, and each user (as the kernel says, see
    /// [`Entry::whose`]; the actions of nobody's together) has at most
    /// [`PER_USER`] lines a host and cycle. What is left out is counted in one line per action
    /// (`count`, and whose in `message`), and carried out all the same.
    pub fn bounded<'a>(
        &self,
        cycle: u64,
        host: &HostId,
        entries: Vec<Entry<'a>>,
    ) -> Vec<Entry<'a>> {
        let mut all = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        let d = all.entry(host.clone()).or_default();
        if d.cycle != cycle {
            let last = std::mem::take(&mut d.now);
            d.before = if d.cycle + 1 == cycle {
                last
            } else {
                HashSet::new()
            };
            d.cycle = cycle;
            d.lines.clear();
        }
        d.now.extend(entries.iter().map(decision));
        bound(entries, &d.before, &mut d.lines)
    }

    /// Records `events`' warnings and clearings, one line each (acting is
    /// recorded by its `decided` and `done` lines).
    ///
    /// # Errors
    /// The write or the flush failed.
    pub fn events(&self, cycle: u64, events: &[Event]) -> std::io::Result<()> {
        let time = now();
        let mut per_user: HashMap<Option<&str>, usize> = HashMap::new();
        // What each stage left out, by whose (the kernel's owner).
        let mut left: Vec<(Phase, HashMap<&str, u64>)> = Vec::new();
        let mut entries: Vec<Entry> = Vec::new();
        for e in events {
            let phase = match e.stage {
                Stage::Warned => Phase::Warned,
                Stage::Cleared => Phase::Cleared,
                Stage::Acted => continue,
            };
            let n = per_user.entry(e.what.owner()).or_default();
            if *n >= PER_USER {
                let i = match left.iter().position(|(p, _)| *p == phase) {
                    Some(i) => i,
                    None => {
                        left.push((phase, HashMap::new()));
                        left.len() - 1
                    }
                };
                *left[i].1.entry(e.what.owner().unwrap_or("")).or_default() += 1;
                continue;
            }
            *n += 1;
            let message = report::event_line(crate::model::Mode::Local, e)
                .map(|l| l.split_once("] ").map_or(l.clone(), |(_, m)| m.to_string()))
                .unwrap_or_default();
            entries.push(event_entry(time.clone(), cycle, e, phase, message));
        }
        let none = HostId::default();
        for (phase, users) in left {
            let count: u64 = users.values().sum();
            entries.push(Entry {
                count: Some(count),
                ..Entry::about(
                    time.clone(),
                    cycle,
                    &none,
                    phase,
                    format!(
                        "{count} more {} this cycle, not written one by one (past {PER_USER} lines a user: {})",
                        if phase == Phase::Warned { "warnings" } else { "clearings" },
                        whose(users),
                    ),
                )
            });
        }
        self.write(&entries)
    }

    /// Records that the notification of `e` through `channel` could not
    /// be sent, and why: an `unsent` line.
    ///
    /// # Errors
    /// The write or the flush failed.
    pub fn unsent(
        &self,
        cycle: u64,
        e: &Event,
        channel: &'static str,
        why: &str,
    ) -> std::io::Result<()> {
        let mut entry = event_entry(now(), cycle, e, Phase::Unsent, why.to_string());
        entry.failure = Some(channel);
        entry.deadline = None;
        self.write(&[entry])
    }
}

impl AuditLog {
    /// Records a reload (SIGHUP): applied, or refused and why (`cycle`:
    /// 0, a reload is between cycles).
    ///
    /// # Errors
    /// The write or the flush failed.
    pub fn reload(&self, cycle: u64, refused: Option<&str>) -> std::io::Result<()> {
        let none = HostId::default();
        let (phase, message) = match refused {
            None => (Phase::Reloaded, "configuration reloaded".to_string()),
            Some(why) => (
                Phase::Refused,
                format!("configuration not reloaded, the old one is kept: {why}"),
            ),
        };
        self.write(&[Entry::about(now(), cycle, &none, phase, message)])
    }
}

impl<'a> Entry<'a> {
    /// A line on `host` saying `message`, every other field empty: the
    /// base of every line.
    fn about(time: String, cycle: u64, host: &'a HostId, phase: Phase, message: String) -> Self {
        Entry {
            time,
            cycle,
            host,
            phase,
            action: Action::None,
            pid: None,
            start_time: None,
            device: None,
            eid: None,
            user: None,
            rules: Vec::new(),
            message,
            outcome: None,
            failure: None,
            deadline: None,
            count: None,
            whose: None,
        }
    }
}

/// The line of event `e`, saying `message`.
fn event_entry(time: String, cycle: u64, e: &Event, phase: Phase, message: String) -> Entry<'_> {
    let base = Entry {
        user: e.what.user(),
        rules: e.what.rules(),
        deadline: e.deadline_ms.map(report::when),
        ..Entry::about(time, cycle, &e.host, phase, message)
    };
    match &e.what {
        What::Terminate(t) => Entry {
            action: Action::Terminate,
            pid: Some(t.pid),
            start_time: t.start_time,
            eid: t.eid.as_ref(),
            ..base
        },
        What::Detach(d) => Entry {
            action: Action::Detach,
            device: Some(d.device),
            eid: Some(&d.eid),
            ..base
        },
    }
}

/// Now, for entries.
pub fn now() -> String {
    at(SystemTime::now())
}

/// `time` as entries say it: RFC 3339, UTC, milliseconds.
pub fn at(time: SystemTime) -> String {
    humantime::format_rfc3339_millis(time).to_string()
}

/// The `decided` line of a signal to `t`.
fn termination<'a>(
    time: &str,
    cycle: u64,
    host: &'a HostId,
    action: Action,
    t: &'a Termination,
    message: String,
) -> Entry<'a> {
    Entry {
        action,
        pid: Some(t.pid),
        start_time: t.start_time,
        eid: t.eid.as_ref(),
        user: t.user.as_deref(),
        whose: t.uid.and(t.user.as_deref()),
        rules: t.rules.iter().collect(),
        ..Entry::about(time.to_string(), cycle, host, Phase::Decided, message)
    }
}

/// The `decided` lines of a host's plan at `time`, one per action, in
/// plan order.
pub fn decided<'a>(
    time: SystemTime,
    cycle: u64,
    host: &'a HostId,
    plan: &'a HostPlan,
) -> Vec<Entry<'a>> {
    let time = at(time);
    let terminations = plan.terminate.iter().map(|t| {
        termination(
            &time,
            cycle,
            host,
            Action::Terminate,
            t,
            report::termination_line(t),
        )
    });
    let detaches = plan.detach.iter().map(|d| Entry {
        action: Action::Detach,
        device: Some(d.device),
        eid: Some(&d.eid),
        user: d.charged.as_deref().or(d.username.as_deref()),
        whose: d.owner.as_deref(),
        rules: vec![Rule::MaxDevicesPerUser],
        ..Entry::about(
            time.clone(),
            cycle,
            host,
            Phase::Decided,
            report::detach_line(d),
        )
    });
    terminations.chain(detaches).collect()
}

/// The `decided` lines of `--kill-after`'s SIGKILLs at `time`.
pub fn kills<'a>(
    time: SystemTime,
    cycle: u64,
    host: &'a HostId,
    terminations: &'a [Termination],
) -> Vec<Entry<'a>> {
    let time = at(time);
    terminations
        .iter()
        .map(|t| {
            let message = format!("Killing process {} (still running after SIGTERM)", t.pid);
            termination(&time, cycle, host, Action::Kill, t, message)
        })
        .collect()
}

/// Whose lines were left out, most first: `alice 40, owners unknown 8,
/// bob 3, 2 users more` (three named at most).
fn whose<'u>(users: impl IntoIterator<Item = (&'u str, u64)>) -> String {
    let mut users: Vec<(&str, u64)> = users.into_iter().collect();
    users.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut named: Vec<String> = (users.iter().take(3))
        .map(|(u, n)| format!("{} {n}", if u.is_empty() { "owners unknown" } else { u }))
        .collect();
    if users.len() > 3 {
        named.push(format!("{} users more", users.len() - 3));
    }
    named.join(", ")
}

/// `entries` (one host's `decided` lines, in order) without the decisions
/// in `before` and each user's lines past [`PER_USER`]; a line per action
/// counting what is left out, after the rest.
fn bound<'a>(
    entries: Vec<Entry<'a>>,
    before: &HashSet<Decision>,
    per_user: &mut HashMap<Option<String>, usize>,
) -> Vec<Entry<'a>> {
    /// What one action's lines left out: as the cycle before, and by user.
    struct Left<'a> {
        base: Entry<'a>,
        rules: Vec<Rule>,
        repeated: u64,
        users: HashMap<&'a str, u64>,
    }
    let mut left: Vec<Left> = Vec::new();
    let mut kept = Vec::new();
    for e in entries {
        let repeated = before.contains(&decision(&e));
        let n = per_user.entry(e.whose.map(String::from)).or_default();
        if !repeated && *n < PER_USER {
            *n += 1;
            kept.push(e);
            continue;
        }
        let i = match left.iter().position(|l| l.base.action == e.action) {
            Some(i) => i,
            None => {
                left.push(Left {
                    base: Entry {
                        action: e.action,
                        ..Entry::about(e.time.clone(), e.cycle, e.host, e.phase, String::new())
                    },
                    rules: Vec::new(),
                    repeated: 0,
                    users: HashMap::new(),
                });
                left.len() - 1
            }
        };
        let l = &mut left[i];
        for r in &e.rules {
            if !l.rules.contains(r) {
                l.rules.push(*r);
            }
        }
        if repeated {
            l.repeated += 1;
        } else {
            *l.users.entry(e.whose.unwrap_or("")).or_default() += 1;
        }
    }
    for l in left {
        let over: u64 = l.users.values().sum();
        let mut why = Vec::new();
        if l.repeated > 0 {
            why.push(format!("{} as decided the cycle before", l.repeated));
        }
        if over > 0 {
            why.push(format!(
                "{over} past {PER_USER} lines a user ({})",
                whose(l.users)
            ));
        }
        let mut rules = l.rules;
        rules.sort();
        kept.push(Entry {
            count: Some(l.repeated + over),
            rules,
            message: format!(
                "{} more {} on this host, not written one by one: {}; carried out all the same",
                l.repeated + over,
                match l.base.action {
                    Action::Terminate => "terminations",
                    Action::Kill => "kills",
                    Action::Detach => "detaches",
                    Action::None => "lines",
                },
                why.join("; ")
            ),
            ..l.base
        });
    }
    kept
}

/// The `done` lines at `time`: each decided line with its outcome (matched
/// by action and pid, or by device and eid); a line standing for several
/// with the results of the outcomes of its action no other line has, by
/// result.
pub fn done<'a>(time: SystemTime, decided: &[Entry<'a>], outcomes: &[Outcome]) -> Vec<Entry<'a>> {
    /// What an outcome answers.
    #[derive(PartialEq, Eq, Hash)]
    enum Key<'k> {
        Signal(Action, Pid),
        Detach(GpuIndex, &'k EnvId),
    }
    fn key_of(o: &Outcome) -> (Action, Key<'_>) {
        match o {
            Outcome::Terminate { pid, .. } => {
                (Action::Terminate, Key::Signal(Action::Terminate, *pid))
            }
            Outcome::Kill { pid, .. } => (Action::Kill, Key::Signal(Action::Kill, *pid)),
            Outcome::Detach { device, eid, .. } => (Action::Detach, Key::Detach(*device, eid)),
        }
    }
    let value = |o: &Outcome| match o {
        Outcome::Terminate { outcome, .. } | Outcome::Kill { outcome, .. } => {
            serde_json::to_value(outcome).ok()
        }
        Outcome::Detach { outcome, .. } => serde_json::to_value(outcome).ok(),
    };
    let key = |d: &Entry<'a>| match (d.action, d.pid, d.device, d.eid) {
        (Action::Terminate | Action::Kill, Some(pid), _, _) => Some(Key::Signal(d.action, pid)),
        (_, _, Some(device), Some(eid)) => Some(Key::Detach(device, eid)),
        _ => None,
    };
    // The first outcome of each action, looked up in one pass.
    let mut by_key: HashMap<Key, &crate::outcome::Outcome> = HashMap::new();
    for o in outcomes {
        by_key.entry(key_of(o).1).or_insert(o);
    }
    // The results of the outcomes no line of their own answers, by action.
    let answered: HashSet<Key> = decided.iter().filter_map(key).collect();
    let mut counted: HashMap<Action, std::collections::BTreeMap<String, u64>> = HashMap::new();
    for o in outcomes {
        let (action, k) = key_of(o);
        if !answered.contains(&k) {
            let result = value(o).and_then(|v| v["result"].as_str().map(String::from));
            *(counted.entry(action).or_default())
                .entry(result.unwrap_or_default())
                .or_default() += 1;
        }
    }
    let time = at(time);
    decided
        .iter()
        .map(|d| {
            let outcome = match d.count {
                Some(_) => serde_json::to_value(counted.get(&d.action)).ok(),
                None => key(d).and_then(|k| by_key.get(&k)).and_then(|o| value(o)),
            };
            Entry {
                time: time.clone(),
                phase: Phase::Done,
                outcome: Some(outcome.unwrap_or(serde_json::Value::Null)),
                message: d.message.clone(),
                rules: d.rules.clone(),
                deadline: d.deadline.clone(),
                ..*d
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_ours_alone_and_not_inherited_by_the_tools_we_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::open(&path).unwrap();
        let file = log.file.lock().unwrap();
        let fd_flags = rustix::io::fcntl_getfd(&*file).unwrap();
        assert!(fd_flags.contains(rustix::io::FdFlags::CLOEXEC));
        let fl = rustix::fs::fcntl_getfl(&*file).unwrap();
        assert!(fl.contains(OFlags::APPEND) && fl.contains(OFlags::WRONLY));
        let mode = std::fs::metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
    }

    #[test]
    fn a_stray_is_noticed_once_while_it_stays_one() {
        use crate::rules::attribution::Stray;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::open(&path).unwrap();
        let stray = |pid: u32, start_time: u64| Notice::Stray {
            host: HostId("h".into()),
            pid: Pid(pid),
            start_time: Some(start_time),
            eid: EnvId("gone\x1b[2J".into()),
            user: Some("alice".into()),
            gpus: vec![GpuIndex(0)],
            why: Stray::Orphaned,
        };
        let lines = || {
            std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .map(String::from)
                .collect::<Vec<_>>()
        };
        let remote = crate::model::Mode::Remote;
        log.strays(1, remote, &[stray(5, 50)]).unwrap();
        log.strays(2, remote, &[stray(5, 50), stray(6, 60)])
            .unwrap();
        log.strays(3, remote, &[stray(6, 60)]).unwrap();
        // 5 is gone, then back as a new process (another start time).
        log.strays(4, remote, &[stray(5, 51), stray(6, 60)])
            .unwrap();
        let l = lines();
        assert_eq!(l.len(), 3, "{l:#?}");
        let v: Vec<serde_json::Value> =
            l.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(
            v.iter()
                .map(|e| (e["cycle"].as_u64().unwrap(), e["pid"].as_u64().unwrap()))
                .collect::<Vec<_>>(),
            [(1, 5), (2, 6), (4, 5)]
        );
        assert_eq!(v[0]["phase"], "noticed");
        assert_eq!(v[0]["action"], "none");
        assert_eq!(v[0]["start_time"], 50);
        assert_eq!(v[0]["user"], "alice");
        assert_eq!(v[0]["eid"], "gone\x1b[2J");
        assert!(!l[0].contains('\x1b'), "{}", l[0]);
        assert!(v[0]["message"]
            .as_str()
            .unwrap()
            .contains("it is left alone"));
    }

    #[test]
    fn a_host_is_recorded_failing_once_while_it_fails_the_same_way() {
        use crate::model::{ConnectFailure, FailureKind as K, HostFailure};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::open(&path).unwrap();
        let status = |host: &str, kind: Option<K>| HostStatus {
            host: HostId(host.into()),
            error: kind.map(|k| HostFailure::new(k, "it broke\x1b[2J")),
            degraded: None,
            processes: 0,
            envs: 0,
            devices: 0,
            recorded: false,
        };
        let refused = Some(K::Connect(ConnectFailure::Refused));
        log.failures(1, &[status("a", refused), status("b", None)])
            .unwrap();
        log.failures(2, &[status("a", refused), status("b", Some(K::Sudo))])
            .unwrap();
        // a fails otherwise; then answers, then fails again.
        log.failures(
            3,
            &[status("a", Some(K::Timeout)), status("b", Some(K::Sudo))],
        )
        .unwrap();
        log.failures(4, &[status("a", None)]).unwrap();
        log.failures(5, &[status("a", Some(K::Timeout))]).unwrap();
        let v: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let seen: Vec<(u64, &str, &str)> = v
            .iter()
            .map(|e| {
                (
                    e["cycle"].as_u64().unwrap(),
                    e["host"].as_str().unwrap(),
                    e["failure"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (1, "a", "connect-refused"),
                (2, "b", "sudo"),
                (3, "a", "timeout"),
                (5, "a", "timeout")
            ]
        );
        assert!(v
            .iter()
            .all(|e| e["phase"] == "failed" && e["action"] == "none"));
        assert_eq!(v[0]["message"], "it broke\x1b[2J");
        assert!(!std::fs::read_to_string(&path).unwrap().contains('\x1b'));
    }

    #[test]
    fn a_decided_signal_names_its_user_and_rules_in_rule_order() {
        let host = HostId("h".into());
        let mut t = Termination::of(Pid(1), Some(10));
        t.user = Some("alice".into());
        t.rules = Rule::EnvMemory | Rule::NonEnvProcesses;
        let plan = HostPlan {
            terminate: vec![t],
            detach: Vec::new(),
        };
        let decided = decided(SystemTime::now(), 7, &host, &plan);
        assert_eq!(decided[0].user, Some("alice"));
        assert_eq!(decided[0].rules, [Rule::NonEnvProcesses, Rule::EnvMemory]);
    }

    #[test]
    fn a_hosts_lines_are_bounded_per_user_and_a_decision_as_the_cycle_before_is_counted() {
        use crate::outcome::{DetachResult, TerminateResult};
        use crate::plan::Detach;
        let host = HostId("h".into());
        let detach = |k: usize, user: &str| Detach {
            rules: Default::default(),
            groups: Default::default(),
            device: GpuIndex(1),
            eid: EnvId(format!("{user}{k}").into()),
            username: Some(user.into()),
            charged: None,
            owner: Some(user.into()),
            working: false,
        };
        // bob: 40 records detached; alice: 2; bob's job, signalled again.
        let mut plan = HostPlan {
            terminate: vec![Termination::of(Pid(9), Some(90))],
            detach: (0..40).map(|k| detach(k, "bob")).collect(),
        };
        plan.detach.extend((0..2).map(|k| detach(k, "alice")));
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(&dir.path().join("audit.log")).unwrap();
        let first = log.bounded(3, &host, decided(SystemTime::now(), 3, &host, &plan));
        let counts = |v: &[Entry]| -> Vec<(Action, Option<u64>)> {
            v.iter()
                .filter(|e| e.count.is_some())
                .map(|e| (e.action, e.count))
                .collect()
        };
        assert_eq!(first.len(), 1 + PER_USER + 2 + 1);
        assert_eq!(counts(&first), [(Action::Detach, Some(8))]);
        let last = first.last().unwrap();
        assert!(
            last.message.starts_with("8 more detaches on this host"),
            "{}",
            last.message
        );
        assert!(
            last.message.contains("8 past 32 lines a user (bob 8)"),
            "{}",
            last.message
        );
        assert_eq!((last.pid, last.eid, last.user), (None, None, None));
        // The next cycle, the same decisions: counted, not written again;
        // alice's new one is written.
        plan.detach.push(detach(2, "alice"));
        let again = log.bounded(4, &host, decided(SystemTime::now(), 4, &host, &plan));
        assert_eq!(
            again.len(),
            3,
            "{:?}",
            again.iter().map(|e| &e.message).collect::<Vec<_>>()
        );
        assert_eq!(again[0].eid, Some(&EnvId("alice2".into())));
        assert_eq!(
            counts(&again),
            [(Action::Terminate, Some(1)), (Action::Detach, Some(42))]
        );
        assert!(
            again[2].message.contains("42 as decided the cycle before"),
            "{}",
            again[2].message
        );
        // The done line of a count: the results no line of its own has.
        let outcomes: Vec<Outcome> = (plan.detach.iter())
            .map(|d| Outcome::Detach {
                host: host.clone(),
                device: d.device,
                eid: d.eid.clone(),
                outcome: if d.eid.0.as_ref() == "bob0" {
                    DetachResult::NotAttached
                } else {
                    DetachResult::Detached
                },
            })
            .chain([Outcome::Terminate {
                host: host.clone(),
                pid: Pid(9),
                outcome: TerminateResult::Signalled,
            }])
            .collect();
        let done = done(SystemTime::now(), &again, &outcomes);
        assert_eq!(done[0].outcome.as_ref().unwrap()["result"], "detached");
        assert_eq!(done[1].outcome, Some(serde_json::json!({"signalled": 1})));
        assert_eq!(
            done[2].outcome,
            Some(serde_json::json!({"detached": 41, "not_attached": 1}))
        );
        // A cycle later than the next, nothing is the cycle before's.
        let later = log.bounded(6, &host, decided(SystemTime::now(), 6, &host, &plan));
        assert_eq!(counts(&later), [(Action::Detach, Some(8))]);
        // Names a record makes up are nobody's: one bound for them all,
        // across the host's steps in a cycle.
        let made_up = HostPlan {
            terminate: Vec::new(),
            detach: (0..20)
                .map(|k| Detach {
                    owner: None,
                    ..detach(k, &format!("u{k}"))
                })
                .collect(),
        };
        let first = log.bounded(7, &host, decided(SystemTime::now(), 7, &host, &made_up));
        assert_eq!((first.len(), counts(&first)), (20, vec![]));
        let second = log.bounded(7, &host, decided(SystemTime::now(), 7, &host, &made_up));
        assert_eq!(
            (second.len(), counts(&second)),
            (13, vec![(Action::Detach, Some(8))])
        );
        assert!(
            second[12].message.contains("(owners unknown 8)"),
            "{}",
            second[12].message
        );
    }

    #[test]
    fn warnings_and_clearings_are_bounded_per_user_a_cycle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let log = AuditLog::open(&path).unwrap();
        let events: Vec<Event> = (0..40u32)
            .map(|k| Event {
                stage: if k % 2 == 0 {
                    Stage::Warned
                } else {
                    Stage::Cleared
                },
                host: HostId("h".into()),
                what: What::Terminate(Termination::of(Pid(k + 1), Some(1))),
                since_ms: 0,
                deadline_ms: Some(9),
            })
            .collect();
        log.events(3, &events).unwrap();
        let lines: Vec<serde_json::Value> = (std::fs::read_to_string(&path).unwrap().lines())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), PER_USER + 2);
        let counted: Vec<(&str, u64)> = (lines.iter())
            .filter_map(|l| Some((l["phase"].as_str()?, l["count"].as_u64()?)))
            .collect();
        assert_eq!(counted, [("warned", 4), ("cleared", 4)]);
    }

    #[test]
    fn done_lines_carry_each_actions_own_outcome() {
        use crate::outcome::{DetachResult, TerminateResult};
        use crate::plan::Detach;
        let host = HostId("h".into());
        let plan = HostPlan {
            terminate: vec![
                Termination::of(Pid(1), Some(10)),
                Termination::of(Pid(2), Some(20)),
            ],
            detach: vec![
                Detach {
                    rules: Default::default(),
                    groups: Default::default(),
                    device: GpuIndex(3),
                    eid: EnvId("e".into()),
                    username: Some("u".into()),
                    charged: None,
                    owner: None,
                    working: false,
                },
                Detach {
                    rules: Default::default(),
                    groups: Default::default(),
                    device: GpuIndex(3),
                    eid: EnvId("f".into()),
                    username: Some("u".into()),
                    charged: None,
                    owner: None,
                    working: false,
                },
                Detach {
                    rules: Default::default(),
                    groups: Default::default(),
                    device: GpuIndex(4),
                    eid: EnvId("e".into()),
                    username: Some("u".into()),
                    charged: None,
                    owner: None,
                    working: false,
                },
            ],
        };
        let decided = decided(SystemTime::now(), 7, &host, &plan);
        assert_eq!(decided.len(), 5);
        assert!(decided
            .iter()
            .all(|e| e.phase == Phase::Decided && e.cycle == 7 && e.outcome.is_none()));
        let when = humantime::parse_rfc3339(&decided[0].time).unwrap();
        let age = std::time::SystemTime::now().duration_since(when).unwrap();
        assert!(
            age < std::time::Duration::from_secs(60),
            "{}",
            decided[0].time
        );
        let outcomes = vec![
            Outcome::Detach {
                host: host.clone(),
                device: GpuIndex(4),
                eid: EnvId("e".into()),
                outcome: DetachResult::Detached,
            },
            Outcome::Detach {
                host: host.clone(),
                device: GpuIndex(3),
                eid: EnvId("f".into()),
                outcome: DetachResult::Failed { error: "x".into() },
            },
            Outcome::Kill {
                host: host.clone(),
                pid: Pid(1),
                outcome: TerminateResult::Signalled,
            },
            Outcome::Terminate {
                host: host.clone(),
                pid: Pid(2),
                outcome: TerminateResult::AlreadyGone,
            },
            Outcome::Terminate {
                host: host.clone(),
                pid: Pid(1),
                outcome: TerminateResult::PidReused {
                    expected: 10,
                    found: 11,
                },
            },
            Outcome::Detach {
                host: host.clone(),
                device: GpuIndex(3),
                eid: EnvId("e".into()),
                outcome: DetachResult::NotAttached,
            },
        ];
        let done = done(SystemTime::now(), &decided, &outcomes);
        let result = |i: usize| done[i].outcome.as_ref().unwrap()["result"].clone();
        assert_eq!(
            result(0),
            "pid_reused",
            "a terminate line takes the terminate outcome, not the kill"
        );
        assert_eq!(result(1), "already_gone");
        assert_eq!(result(2), "not_attached", "device and eid both match");
        assert_eq!(result(3), "failed");
        assert_eq!(result(4), "detached");
        assert!(done.iter().all(|e| e.phase == Phase::Done));
        let kills = kills(SystemTime::now(), 7, &host, &plan.terminate[..1]);
        assert_eq!(
            (kills[0].action, kills[0].pid),
            (Action::Kill, Some(Pid(1)))
        );
        let killed = super::done(SystemTime::now(), &kills, &outcomes);
        assert_eq!(killed[0].outcome.as_ref().unwrap()["result"], "signalled");
        // An action without an outcome says so.
        assert_eq!(
            super::done(SystemTime::now(), &kills, &[])[0].outcome,
            Some(serde_json::Value::Null)
        );
    }
}
