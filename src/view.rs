//! What the enforcer sees after a cycle, for `status` and `top`: each
//! host, its GPUs and the jobs on them, each user's GPUs and memory
//! against their caps, what waits and what was done, each with the rule
//! that asks for it and why. Pure: built from a cycle's report and its
//! snapshots; nothing a user wrote is in it beyond ids and names, bounded
//! where they are parsed, and no environ.

use std::collections::{BTreeMap, BTreeSet};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ladder::Waiting;
use crate::model::{Cluster, GpuIndex, HostId, HostSnapshot, Mode, Pid, Process};
use crate::outcome::{DetachResult, Outcome, TerminateResult};
use crate::report::{violation_line, CycleReport};
use crate::rules::{Action, Policy, Violation};

/// The view's schema version (`status --output json`'s `schema`).
pub const SCHEMA: u32 = 1;

/// One cycle's view of the fleet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct View {
    pub schema: u32,
    pub cycle: u64,
    /// When the cycle ran (ms since the Unix epoch; none for a replay).
    pub at_ms: Option<u64>,
    /// Nothing was carried out (`--dry-run`, a replay, a follower).
    pub dry_run: bool,
    pub hosts: Vec<HostView>,
    pub users: Vec<UserView>,
    /// Each capped group (`--max-devices-per-group`): its members' GPUs
    /// against its cap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupView>,
    /// Actions that wait: for their deadline, for more sightings, or for
    /// ever (warned only, exempt).
    pub waiting: Vec<ActionView>,
    /// What this cycle did (or, in a dry run, would do).
    pub actions: Vec<ActionView>,
}

/// Whether a host answered, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HostState {
    Ok,
    /// It answered, but its genv state could not be used.
    Degraded,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HostView {
    pub host: String,
    pub state: HostState,
    /// Why it is degraded or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    pub gpus: Vec<GpuView>,
}

/// A GPU at a glance, the most pressing first: an action waits on it, a
/// rule finds against it, a job outside its environments runs on it, an
/// environment holds it, or nothing.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum GpuState {
    Free,
    InEnv,
    Stray,
    Violating,
    Waiting,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuView {
    pub index: u32,
    pub state: GpuState,
    /// The environments attached to it (as `devices.json` says).
    pub envs: Vec<String>,
    pub processes: Vec<ProcessView>,
    /// GPU memory its jobs hold (bytes), as nvidia-smi tells.
    #[serde(default)]
    pub memory_bytes: u64,
    /// How busy it was (percent), where asked (`--idle-after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_percent: Option<u32>,
}

/// A capped group over the fleet: its members (as the hosts name them)
/// and the GPUs their jobs run on, against its cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GroupView {
    pub group: String,
    pub devices: u32,
    pub device_cap: u32,
    pub users: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProcessView {
    pub pid: u32,
    /// Its owner, as the kernel says (in a recording, as its
    /// environment's record says).
    pub user: Option<String>,
    /// The environment it carries.
    pub env: Option<String>,
    /// GPU memory it holds here (bytes), where nvidia-smi could tell.
    pub memory_bytes: Option<u64>,
}

/// One user over the fleet: the GPUs their jobs run on, the memory those
/// hold, and their caps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UserView {
    pub user: String,
    pub devices: u32,
    pub memory_bytes: u64,
    pub processes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_cap: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_cap: Option<u64>,
}

/// What an action is on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Target {
    Terminate { pid: u32 },
    Detach { device: u32, env: String },
}

impl Target {
    /// What the action does, in words (`terminate pid 42`), the
    /// environment's id escaped.
    pub fn words(&self) -> String {
        match self {
            Target::Terminate { pid } => format!("terminate pid {pid}"),
            Target::Detach { device, env } => {
                format!("detach {} from gpu {device}", crate::report::clean(env))
            }
        }
    }
}

/// An action, waiting or done, with the rule behind it and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ActionView {
    pub host: String,
    #[serde(flatten)]
    pub target: Target,
    /// The rules behind it, and the report's line for each.
    pub rules: Vec<String>,
    pub why: Vec<String>,
    /// When it is due (ms since the Unix epoch), if it waits for a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// Warned only: never carried out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warn_only: bool,
    /// Why it is exempt, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exempt: Option<String>,
    /// Waiting for more sightings: seen so far, and needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen: Option<(u32, u32)>,
    /// What came of it (done actions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
}

/// The view of `report`'s cycle over `cluster`, under `policy`'s caps.
pub fn of(report: &CycleReport, cluster: &Cluster, policy: &Policy, at_ms: Option<u64>) -> View {
    let why = Why::of(report.mode, &report.violations);
    let waiting: Vec<ActionView> = report.waiting.iter().map(|w| why.waiting(w)).collect();
    let actions: Vec<ActionView> = report.outcomes.iter().map(|o| why.done(o)).collect();
    let pressed = Pressed::of(&report.violations, &waiting);
    // Each host's snapshot by id, found once (a scan per host is
    // quadratic over a large fleet).
    let mut by_host = std::collections::HashMap::with_capacity(cluster.hosts.len());
    for (h, s) in &cluster.hosts {
        by_host.entry(h).or_insert((h, s));
    }
    let hosts = report
        .hosts
        .iter()
        .map(|status| {
            let snap = by_host.get(&status.host).map(|&(h, s)| (h, s));
            let (state, why) = match (&status.error, &status.degraded) {
                (Some(e), _) => (HostState::Failed, Some(e.to_string())),
                (None, Some(d)) => (HostState::Degraded, Some(d.clone())),
                (None, None) => (HostState::Ok, None),
            };
            let gpus = snap.map_or_else(Vec::new, |(h, s)| gpus(h, s, &pressed));
            HostView {
                host: status.host.to_string(),
                state,
                why,
                gpus,
            }
        })
        .collect();
    View {
        schema: SCHEMA,
        cycle: report.cycle,
        at_ms,
        dry_run: report.dry_run,
        hosts,
        groups: Vec::new(),
        users: users(cluster, policy),
        waiting,
        actions,
    }
    .with_groups(cluster, policy)
}

impl View {
    /// Its capped groups, from its users and the hosts' word on who is in
    /// which group.
    fn with_groups(mut self, cluster: &Cluster, policy: &Policy) -> Self {
        if policy.max_devices_per_group.is_empty() {
            return self;
        }
        let mut members: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (_, snap) in &cluster.hosts {
            for (user, groups) in crate::rules::max_groups::said(snap) {
                let capped = groups
                    .into_iter()
                    .filter(|g| policy.max_devices_per_group.contains_key(*g));
                for g in capped {
                    members.entry(g).or_default().insert(user);
                }
            }
        }
        let devices: BTreeMap<&str, u32> = (self.users.iter())
            .map(|u| (u.user.as_str(), u.devices))
            .collect();
        let devices_of = |u: &str| devices.get(u).copied().unwrap_or(0);
        let groups = (policy.max_devices_per_group.iter())
            .map(|(group, cap)| {
                let users = members.get(group.as_str()).cloned().unwrap_or_default();
                GroupView {
                    group: group.clone(),
                    devices: users.iter().map(|u| devices_of(u)).sum(),
                    device_cap: *cap,
                    users: users.into_iter().map(String::from).collect(),
                }
            })
            .collect();
        self.groups = groups;
        self
    }
}

/// Each GPU of a host, by index: those `devices.json` lists and those a
/// job runs on.
fn gpus(host: &HostId, snap: &HostSnapshot, pressed: &Pressed) -> Vec<GpuView> {
    fn gpu(by_index: &mut BTreeMap<u32, GpuView>, index: GpuIndex) -> &mut GpuView {
        by_index.entry(index.0).or_insert_with(|| GpuView {
            index: index.0,
            state: GpuState::Free,
            envs: Vec::new(),
            processes: Vec::new(),
            memory_bytes: 0,
            utilization_percent: None,
        })
    }
    let mut by_index: BTreeMap<u32, GpuView> = BTreeMap::new();
    for d in snap.devices.iter() {
        let g = gpu(&mut by_index, d.index);
        g.envs
            .extend(d.attachments.iter().map(|a| a.eid.to_string()));
    }
    for p in &snap.processes {
        for u in &p.gpus {
            let g = gpu(&mut by_index, u.index);
            g.memory_bytes = g.memory_bytes.saturating_add(u.usage.bytes().unwrap_or(0));
            g.processes.push(ProcessView {
                pid: p.pid.0,
                user: user_of(snap, p).map(str::to_string),
                env: p.owner.eid().map(|e| e.to_string()),
                memory_bytes: u.usage.bytes(),
            });
        }
    }
    if let Some(u) = &snap.utilization {
        for (index, percent) in &u.gpus {
            gpu(&mut by_index, *index).utilization_percent = Some(*percent);
        }
    }
    for g in by_index.values_mut() {
        let stray = g
            .processes
            .iter()
            .any(|p| p.env.as_ref().is_none_or(|e| !g.envs.contains(e)));
        let on_it = |pids: &BTreeSet<(HostId, Pid)>| {
            g.processes
                .iter()
                .any(|p| pids.contains(&(host.clone(), Pid(p.pid))))
        };
        let device = (host.clone(), GpuIndex(g.index));
        g.state = if on_it(&pressed.waiting) || pressed.waiting_devices.contains(&device) {
            GpuState::Waiting
        } else if on_it(&pressed.violating) || pressed.violating_devices.contains(&device) {
            GpuState::Violating
        } else if stray {
            GpuState::Stray
        } else if !g.envs.is_empty() || !g.processes.is_empty() {
            GpuState::InEnv
        } else {
            GpuState::Free
        };
    }
    by_index.into_values().collect()
}

/// Whose a process is: as the kernel says, or in a recording (which has
/// no kernel's word) as its environment's record says.
fn user_of<'s>(snap: &'s HostSnapshot, p: &'s Process) -> Option<&'s str> {
    match (&p.user, &snap.truth) {
        (Some(user), _) => Some(user),
        (None, Some(_)) => None,
        (None, None) => snap.env(p.owner.eid()?)?.username.as_deref(),
    }
}

/// Each user whose jobs run on a GPU, over every host, with their caps.
fn users(cluster: &Cluster, policy: &Policy) -> Vec<UserView> {
    /// A user's GPUs (by host), memory and processes.
    type Use<'c> = (BTreeSet<(&'c HostId, GpuIndex)>, u64, u32);
    let mut by_user: BTreeMap<&str, Use> = BTreeMap::new();
    for (host, snap) in &cluster.hosts {
        for p in &snap.processes {
            let Some(user) = user_of(snap, p) else {
                continue;
            };
            let (devices, memory, processes) = by_user.entry(user).or_default();
            *processes += 1;
            for u in &p.gpus {
                devices.insert((host, u.index));
                *memory += u.usage.bytes().unwrap_or(0);
            }
        }
    }
    (by_user.into_iter())
        .map(|(user, (devices, memory_bytes, processes))| UserView {
            user: user.to_string(),
            devices: u32::try_from(devices.len()).unwrap_or(u32::MAX),
            memory_bytes,
            processes,
            device_cap: (policy.max_devices_for_user.get(user).copied())
                .or(policy.max_devices_per_user),
            memory_cap: (policy.max_memory_for_user.get(user).copied())
                .or(policy.max_memory_per_user),
        })
        .collect()
}

/// What the cycle's findings and waits press on: processes and devices.
#[derive(Default)]
struct Pressed {
    violating: BTreeSet<(HostId, Pid)>,
    violating_devices: BTreeSet<(HostId, GpuIndex)>,
    waiting: BTreeSet<(HostId, Pid)>,
    waiting_devices: BTreeSet<(HostId, GpuIndex)>,
}

impl Pressed {
    fn of(violations: &[Violation], waiting: &[ActionView]) -> Self {
        let mut p = Pressed::default();
        for a in violations.iter().flat_map(|v| &v.actions) {
            match a {
                Action::Terminate { host, pid } => {
                    p.violating.insert((host.clone(), *pid));
                }
                Action::Detach { host, device, .. } => {
                    p.violating_devices.insert((host.clone(), *device));
                }
            }
        }
        for w in waiting {
            let host = HostId(w.host.as_str().into());
            match &w.target {
                Target::Terminate { pid } => p.waiting.insert((host, Pid(*pid))),
                Target::Detach { device, .. } => {
                    p.waiting_devices.insert((host, GpuIndex(*device)))
                }
            };
        }
        p
    }
}

/// Which violations ask for each action, and the report's line for each.
struct Why {
    terminate: BTreeMap<(HostId, Pid), Vec<(String, String)>>,
    detach: BTreeMap<(HostId, GpuIndex, String), Vec<(String, String)>>,
}

impl Why {
    fn of(mode: Mode, violations: &[Violation]) -> Self {
        let mut why = Why {
            terminate: BTreeMap::new(),
            detach: BTreeMap::new(),
        };
        for v in violations {
            let said = (v.rule.name().to_string(), violation_line(mode, v));
            for a in &v.actions {
                match a {
                    Action::Terminate { host, pid } => {
                        why.terminate
                            .entry((host.clone(), *pid))
                            .or_default()
                            .push(said.clone());
                    }
                    Action::Detach {
                        host,
                        device,
                        eids,
                        pids,
                        ..
                    } => {
                        // Its member processes there end with it.
                        for pid in pids {
                            let said = said.clone();
                            why.terminate
                                .entry((host.clone(), *pid))
                                .or_default()
                                .push(said);
                        }
                        for eid in eids {
                            let key = (host.clone(), *device, eid.to_string());
                            why.detach.entry(key).or_default().push(said.clone());
                        }
                    }
                }
            }
        }
        why
    }

    fn action(&self, host: &HostId, target: Target) -> ActionView {
        let said = match &target {
            Target::Terminate { pid } => self.terminate.get(&(host.clone(), Pid(*pid))),
            Target::Detach { device, env } => {
                self.detach
                    .get(&(host.clone(), GpuIndex(*device), env.clone()))
            }
        };
        let (rules, why) = said.into_iter().flatten().cloned().unzip();
        ActionView {
            host: host.to_string(),
            target,
            rules,
            why,
            deadline_ms: None,
            warn_only: false,
            exempt: None,
            seen: None,
            result: None,
        }
    }

    fn waiting(&self, w: &Waiting) -> ActionView {
        match w {
            Waiting::Terminate {
                host,
                pid,
                seen,
                needed,
                deadline_ms,
                warn_only,
                exempt,
            } => ActionView {
                deadline_ms: *deadline_ms,
                warn_only: *warn_only,
                exempt: exempt.clone(),
                seen: (seen < needed).then_some((*seen, *needed)),
                ..self.action(host, Target::Terminate { pid: pid.0 })
            },
            Waiting::Detach {
                host,
                device,
                eid,
                seen,
                needed,
                deadline_ms,
                warn_only,
                exempt,
            } => ActionView {
                deadline_ms: *deadline_ms,
                warn_only: *warn_only,
                exempt: exempt.clone(),
                seen: (seen < needed).then_some((*seen, *needed)),
                ..self.action(
                    host,
                    Target::Detach {
                        device: device.0,
                        env: eid.to_string(),
                    },
                )
            },
        }
    }

    fn done(&self, o: &Outcome) -> ActionView {
        let (host, target, result) = match o {
            Outcome::Terminate { host, pid, outcome } | Outcome::Kill { host, pid, outcome } => {
                (host, Target::Terminate { pid: pid.0 }, terminated(outcome))
            }
            Outcome::Detach {
                host,
                device,
                eid,
                outcome,
            } => {
                let target = Target::Detach {
                    device: device.0,
                    env: eid.to_string(),
                };
                (host, target, detached(outcome))
            }
        };
        ActionView {
            result: Some(result),
            ..self.action(host, target)
        }
    }
}

fn terminated(t: &TerminateResult) -> String {
    match t {
        TerminateResult::Signalled => "signalled".into(),
        TerminateResult::DryRun => "dry run".into(),
        TerminateResult::AlreadyGone => "already gone".into(),
        TerminateResult::PidReused { .. } => "pid reused: left alone".into(),
        TerminateResult::NoIdentity => "no start time: left alone".into(),
        TerminateResult::PermissionDenied => "permission denied".into(),
        TerminateResult::Failed { error } => format!("failed: {error}"),
    }
}

fn detached(d: &DetachResult) -> String {
    match d {
        DetachResult::Detached => "detached".into(),
        DetachResult::DryRun => "dry run".into(),
        DetachResult::NotAttached => "not attached".into(),
        DetachResult::Failed { error } => format!("failed: {error}"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::assess::assess;
    use crate::snapshot::genv;

    /// The recorded fleet's view (for `top`'s tests).
    pub(crate) fn recorded_view() -> View {
        let (report, cluster, policy) = recorded();
        of(&report, &cluster, &policy, None)
    }

    /// The recorded 3-host fleet under the README's main job
    /// (non-env-processes, 2 devices a user), and its report.
    fn recorded() -> (CycleReport, Cluster, Policy) {
        let hosts = [
            ("gpu1", include_str!("../fixtures/snapshots/gpu1.json")),
            ("gpu2", include_str!("../fixtures/snapshots/gpu2.json")),
            ("gpu3", include_str!("../fixtures/snapshots/gpu3.json")),
        ];
        let policy = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(2),
            ..Policy::default()
        };
        let snaps = (hosts.iter())
            .map(|(h, text)| {
                (
                    HostId((*h).into()),
                    Ok(genv::parse_snapshot(text, h).unwrap()),
                )
            })
            .collect();
        let a = assess(1, Mode::Remote, true, &policy, snaps);
        let cluster = a.cluster.clone();
        let outcomes = crate::outcome::dry_run(&a.plan);
        (CycleReport::new(a, outcomes, None), cluster, policy)
    }

    /// A capped group: its members as the hosts say, their GPUs summed,
    /// against its cap; a group without a cap is not in the view.
    #[test]
    fn each_capped_group_counts_its_members_gpus() {
        let (report, mut cluster, mut policy) = recorded();
        policy.max_devices_per_group.insert("lab".into(), 3);
        let said = [("alice", "lab"), ("bob", "lab"), ("carol", "other")];
        cluster.hosts[0].1.recorded_groups = (said.iter())
            .map(|(u, g)| (u.to_string(), vec![g.to_string()]))
            .collect();
        let view = of(&report, &cluster, &policy, None);
        let devices = |u: &str| view.users.iter().find(|v| v.user == u).unwrap().devices;
        assert_eq!(
            view.groups,
            [GroupView {
                group: "lab".into(),
                devices: devices("alice") + devices("bob"),
                device_cap: 3,
                users: vec!["alice".into(), "bob".into()],
            }]
        );
        assert!(of(&report, &cluster, &Policy::default(), None)
            .groups
            .is_empty());
    }

    #[test]
    fn the_recorded_fleets_view() {
        let (report, cluster, policy) = recorded();
        let view = of(&report, &cluster, &policy, None);
        insta::assert_snapshot!(serde_json::to_string_pretty(&view).unwrap());
    }

    /// Every action done is in the view with the rule that asked for it,
    /// and every GPU it falls on is marked violating.
    #[test]
    fn each_action_says_its_rule_and_marks_its_gpu() {
        let (report, cluster, policy) = recorded();
        let view = of(&report, &cluster, &policy, None);
        assert_eq!(view.actions.len(), report.outcomes.len());
        assert!(!view.actions.is_empty());
        for a in &view.actions {
            assert!(!a.rules.is_empty(), "{a:?}");
            assert_eq!(a.rules.len(), a.why.len());
            assert_eq!(a.result.as_deref(), Some("dry run"));
            let host = view.hosts.iter().find(|h| h.host == a.host).unwrap();
            let marked = host.gpus.iter().any(|g| {
                g.state == GpuState::Violating
                    && match &a.target {
                        Target::Terminate { pid } => g.processes.iter().any(|p| p.pid == *pid),
                        Target::Detach { device, .. } => g.index == *device,
                    }
            });
            assert!(marked, "{a:?}");
        }
    }

    /// A wait is shown as waiting, with its deadline, on its GPU.
    #[test]
    fn a_wait_marks_its_gpu_and_keeps_its_deadline() {
        let (mut report, cluster, policy) = recorded();
        let done = report.outcomes.remove(0);
        let Outcome::Terminate { host, pid, .. } = done else {
            panic!("a termination first: {done:?}");
        };
        report.waiting.push(Waiting::Terminate {
            host: host.clone(),
            pid,
            seen: 1,
            needed: 1,
            deadline_ms: Some(1_800_000_000_000),
            warn_only: false,
            exempt: None,
        });
        let view = of(&report, &cluster, &policy, Some(1_799_999_000_000));
        let w = &view.waiting[0];
        assert_eq!(w.deadline_ms, Some(1_800_000_000_000));
        assert_eq!(w.seen, None);
        assert!(!w.rules.is_empty());
        let on = (view.hosts.iter().find(|h| h.host == host.to_string()))
            .unwrap()
            .gpus
            .iter()
            .filter(|g| g.processes.iter().any(|p| p.pid == pid.0));
        assert!(on.clone().count() > 0);
        assert!(on.into_iter().all(|g| g.state == GpuState::Waiting));
    }

    /// A host that failed is shown failed, with why, and no GPUs.
    #[test]
    fn a_failed_host_says_why() {
        let (mut report, mut cluster, policy) = recorded();
        report.hosts[1].error = Some(crate::model::HostFailure {
            kind: crate::model::FailureKind::Timeout,
            message: "ssh: connect to host gpu2: Connection refused".into(),
        });
        cluster.hosts.retain(|(h, _)| h.0.as_ref() != "gpu2");
        let view = of(&report, &cluster, &policy, None);
        assert_eq!(view.hosts[1].state, HostState::Failed);
        assert!(view.hosts[1].why.as_deref().unwrap().contains("refused"));
        assert!(view.hosts[1].gpus.is_empty());
        assert_eq!(view.hosts[0].state, HostState::Ok);
    }

    /// The view reads back as written (`status` reads the service's).
    #[test]
    fn the_view_reads_back_as_written() {
        let (report, cluster, policy) = recorded();
        let view = of(&report, &cluster, &policy, Some(5));
        let json = serde_json::to_string(&view).unwrap();
        assert_eq!(serde_json::from_str::<View>(&json).unwrap(), view);
    }
}
