//! What a cycle adds to the state database's history: its events and its
//! actions' outcomes as rows, a bounded number per user. Each user (as the
//! kernel names them: a process's owner; for a detach, a live process of
//! the charged user; names a record makes up are nobody's, together) has
//! at most [`PER_USER`] rows of each a cycle, and an action carried out as
//! in the cycle before (a record written again after its detach) is not
//! written again one by one: what is left out is one row per host, kind,
//! result and user, with its `count`, so the usage report still counts
//! every warning and action.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use crate::ladder::{Event, Stage, What};
use crate::outcome::{Acted, Outcome};
use crate::rules::Rule;

/// Rows of each kind a user has a cycle, at most.
pub const PER_USER: usize = crate::audit::PER_USER;

/// An event, as the `events` table holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRow {
    pub host: String,
    pub stage: &'static str,
    pub action: &'static str,
    pub pid: Option<u32>,
    pub start_time: Option<u64>,
    pub device: Option<u32>,
    pub eid: Option<String>,
    pub user: Option<String>,
    /// Comma-separated rule names.
    pub rules: String,
    pub since_ms: u64,
    pub deadline_ms: Option<u64>,
    /// Events this row stands for (more than one: those left out).
    pub count: u64,
}

/// An action's outcome, as the `actions` table holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionRow {
    pub host: String,
    pub action: &'static str,
    pub pid: Option<u32>,
    pub device: Option<u32>,
    pub eid: Option<String>,
    pub result: String,
    pub user: Option<String>,
    pub rules: String,
    /// Outcomes this row stands for.
    pub count: u64,
}

/// An action as carried out, to tell one repeated from the cycle before:
/// host, kind, target and result.
pub type Done = (
    String,
    &'static str,
    Option<u32>,
    Option<u32>,
    Option<String>,
    String,
);

fn rules(rules: &[Rule]) -> String {
    rules.iter().map(|r| r.name()).collect::<Vec<_>>().join(",")
}

/// The rows of `events`, at most [`PER_USER`] a user (by whose the
/// kernel says each is), the rest counted.
pub fn events(events: &[Event]) -> Vec<EventRow> {
    let mut per_user: HashMap<Option<&str>, usize> = HashMap::new();
    let mut rows = Vec::new();
    let mut left: Vec<EventRow> = Vec::new();
    let mut at: HashMap<(&str, &str, &str, Option<&str>), usize> = HashMap::new();
    for e in events {
        let stage = match e.stage {
            Stage::Warned => "warned",
            Stage::Acted => "acted",
            Stage::Cleared => "cleared",
        };
        let (action, pid, start_time, device, eid) = match &e.what {
            What::Terminate(t) => (
                "terminate",
                Some(t.pid.0),
                t.start_time,
                None,
                t.eid.as_ref().map(|e| e.0.to_string()),
            ),
            What::Detach(d) => (
                "detach",
                None,
                None,
                Some(d.device.0),
                Some(d.eid.0.to_string()),
            ),
        };
        let owner = e.what.owner();
        let n = per_user.entry(owner).or_default();
        if *n < PER_USER {
            *n += 1;
            rows.push(EventRow {
                host: e.host.0.to_string(),
                stage,
                action,
                pid,
                start_time,
                device,
                eid,
                user: e.what.user().map(String::from),
                rules: rules(&e.what.rules()),
                since_ms: e.since_ms,
                deadline_ms: e.deadline_ms,
                count: 1,
            });
            continue;
        }
        match at.entry((&e.host.0, stage, action, owner)) {
            Entry::Occupied(i) => {
                let r = &mut left[*i.get()];
                r.count += 1;
                r.since_ms = r.since_ms.min(e.since_ms);
            }
            Entry::Vacant(v) => {
                v.insert(left.len());
                left.push(EventRow {
                    host: e.host.0.to_string(),
                    stage,
                    action,
                    pid: None,
                    start_time: None,
                    device: None,
                    eid: None,
                    user: owner.map(String::from),
                    rules: String::new(),
                    since_ms: e.since_ms,
                    deadline_ms: None,
                    count: 1,
                });
            }
        }
    }
    rows.extend(left);
    rows
}

/// The rows of `acted`, at most [`PER_USER`] a user and host, none again
/// for an action carried out as in the cycle before (`before`); the rest
/// counted. Also what was carried out, for the next cycle's `before`.
pub fn actions(acted: &[Acted], before: &HashSet<Done>) -> (Vec<ActionRow>, HashSet<Done>) {
    let mut per_user: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    let mut done = HashSet::new();
    let mut rows = Vec::new();
    let mut left: Vec<ActionRow> = Vec::new();
    let mut at: HashMap<(&str, &str, String, Option<&str>), usize> = HashMap::new();
    for a in acted {
        let (action, host, pid, device, eid, result) = match &a.outcome {
            Outcome::Terminate { host, pid, outcome } => {
                ("terminate", host, Some(pid.0), None, None, result(outcome))
            }
            Outcome::Kill { host, pid, outcome } => {
                ("kill", host, Some(pid.0), None, None, result(outcome))
            }
            Outcome::Detach {
                host,
                device,
                eid,
                outcome,
            } => (
                "detach",
                host,
                None,
                Some(device.0),
                Some(eid.0.to_string()),
                result(outcome),
            ),
        };
        let key: Done = (
            host.0.to_string(),
            action,
            pid,
            device,
            eid.clone(),
            result.clone(),
        );
        let repeated = before.contains(&key);
        done.insert(key);
        let n = per_user.entry((&host.0, a.owner.as_deref())).or_default();
        if !repeated && *n < PER_USER {
            *n += 1;
            rows.push(ActionRow {
                host: host.0.to_string(),
                action,
                pid,
                device,
                eid,
                result,
                user: a.user.clone(),
                rules: rules(&a.rules),
                count: 1,
            });
            continue;
        }
        match at.entry((&host.0, action, result.clone(), a.owner.as_deref())) {
            Entry::Occupied(i) => left[*i.get()].count += 1,
            Entry::Vacant(v) => {
                v.insert(left.len());
                left.push(ActionRow {
                    host: host.0.to_string(),
                    action,
                    pid: None,
                    device: None,
                    eid: None,
                    result,
                    user: a.owner.clone(),
                    rules: String::new(),
                    count: 1,
                });
            }
        }
    }
    rows.extend(left);
    (rows, done)
}

/// An outcome's `result`, as in the JSON report.
fn result(outcome: &impl serde::Serialize) -> String {
    serde_json::to_value(outcome)
        .ok()
        .and_then(|v| v.get("result").and_then(|r| r.as_str()).map(String::from))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvId, GpuIndex, HostId, Pid};
    use crate::outcome::DetachResult;
    use crate::plan::{Detach, Termination};

    fn warned(host: &str, pid: u32, owner: Option<&str>) -> Event {
        let mut t = Termination::of(Pid(pid), Some(u64::from(pid)));
        if let Some(o) = owner {
            t.uid = Some(1000);
            t.user = Some(o.into());
        }
        t.rules = Rule::EnvDevices.into();
        Event {
            stage: Stage::Warned,
            host: HostId(host.into()),
            what: What::Terminate(t),
            since_ms: u64::from(pid),
            deadline_ms: Some(10_000),
        }
    }

    #[test]
    fn a_users_events_are_bounded_a_cycle_and_the_rest_counted() {
        let mut all: Vec<Event> = (0..40).map(|p| warned("h1", p, Some("bob"))).collect();
        all.extend((100..103).map(|p| warned("h1", p, Some("alice"))));
        // Records with made-up names: nobody's, together, on two hosts.
        all.extend((200..250).map(|p| warned(if p % 2 == 0 { "h1" } else { "h2" }, p, None)));
        let rows = events(&all);
        let of = |user: Option<&str>, count: u64| {
            rows.iter()
                .filter(|r| r.user.as_deref() == user && r.count == count)
                .count()
        };
        // alice's three are all written, one by one.
        assert_eq!(
            rows.iter()
                .filter(|r| r.user.as_deref() == Some("alice"))
                .count(),
            3
        );
        assert_eq!(of(Some("bob"), 1), 32);
        assert!(rows
            .iter()
            .filter(|r| r.count == 1)
            .all(|r| r.rules == "env-devices"));
        let bob: Vec<&EventRow> = rows.iter().filter(|r| r.count > 1).collect();
        assert_eq!(bob.len(), 3, "{bob:?}");
        assert_eq!(bob[0].user.as_deref(), Some("bob"));
        assert_eq!((bob[0].count, bob[0].pid, bob[0].since_ms), (8, None, 32));
        // 32 of nobody's one by one, 18 more counted by host.
        assert_eq!(of(None, 1), 32);
        let nobody: Vec<(String, u64)> = (rows.iter())
            .filter(|r| r.user.is_none() && r.count > 1)
            .map(|r| (r.host.clone(), r.count))
            .collect();
        assert_eq!(nobody, [("h1".to_string(), 9), ("h2".to_string(), 9)]);
        let total: u64 = rows.iter().map(|r| r.count).sum();
        assert_eq!(total, all.len() as u64);
    }

    fn detached(eid: &str, owner: Option<&str>) -> Acted {
        Acted {
            outcome: Outcome::Detach {
                host: HostId("h1".into()),
                device: GpuIndex(0),
                eid: EnvId(eid.into()),
                outcome: DetachResult::Detached,
            },
            user: Some(format!("made-up {eid}")),
            rules: vec![Rule::MaxDevicesPerUser],
            owner: owner.map(String::from),
        }
    }

    #[test]
    fn an_action_as_the_cycle_before_is_counted_and_a_users_are_bounded() {
        let _ = Detach::of(GpuIndex(0), EnvId("x".into()));
        let mut acted: Vec<Acted> = (0..40).map(|i| detached(&format!("f{i}"), None)).collect();
        acted.push(detached("hers", Some("alice")));
        let (rows, done) = actions(&acted, &HashSet::new());
        assert_eq!(done.len(), 41);
        assert_eq!(rows.iter().filter(|r| r.count == 1).count(), 33);
        let left: Vec<(Option<&str>, u64)> = (rows.iter())
            .filter(|r| r.count > 1)
            .map(|r| (r.user.as_deref(), r.count))
            .collect();
        assert_eq!(left, [(None, 8)]);
        // The next cycle, the same detaches again: one row counts them,
        // alice's included (hers, as the cycle before, is hers).
        let (rows, _) = actions(&acted, &done);
        let rows: Vec<(Option<&str>, u64, &str)> = (rows.iter())
            .map(|r| (r.user.as_deref(), r.count, r.result.as_str()))
            .collect();
        assert_eq!(
            rows,
            [(None, 40, "detached"), (Some("alice"), 1, "detached")]
        );
        // Another outcome is another action: written.
        let mut failed = detached("hers", Some("alice"));
        if let Outcome::Detach { outcome, .. } = &mut failed.outcome {
            *outcome = DetachResult::Failed {
                error: "busy".into(),
            };
        }
        let (rows, _) = actions(&[failed], &done);
        assert_eq!(
            (rows.len(), rows[0].eid.as_deref(), rows[0].count),
            (1, Some("hers"), 1)
        );
    }
}
