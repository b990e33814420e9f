//! The enforcement rules, pure functions over host snapshots.
//!
//! Each host is assessed on its own ([`assess_host`]): who runs what
//! ([`attribution`]), the rules that need only that host (non-env-processes,
//! env-devices, env-memory), the notices, and the host's part of the device
//! caps. The caps then need only those parts ([`evaluate_caps`]). Each rule
//! returns [`Violation`]s in genv's order, each carrying the actions it
//! calls for. Merging those actions into per-host plans is
//! [`crate::plan`]'s job, and wording them is [`crate::report`]'s.

pub mod attribution;
mod env_devices;
mod env_memory;
pub mod max_devices;
mod non_env_processes;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{Cluster, EnvId, GpuIndex, HostId, HostSnapshot, Owner, Pid};
pub use attribution::Orphans;
use attribution::{Attribution, Standing, Stray, Unconfirmed};
use max_devices::HostUsage;

/// Which rules run, and the device caps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Policy {
    pub non_env_processes: bool,
    pub env_devices: bool,
    pub env_memory: bool,
    /// Cap on attached devices for every user (`--max-devices-per-user`).
    pub max_devices_per_user: Option<u32>,
    /// Per-user caps overriding the above (`--max-devices-for-user`); they
    /// apply even without a global cap (genv ignores them then).
    pub max_devices_for_user: BTreeMap<String, u32>,
}

impl Default for Policy {
    /// genv's defaults: env-devices and env-memory on, no caps.
    fn default() -> Self {
        Policy {
            non_env_processes: false,
            env_devices: true,
            env_memory: true,
            max_devices_per_user: None,
            max_devices_for_user: BTreeMap::new(),
        }
    }
}

impl Policy {
    /// Whether any device cap applies.
    pub fn has_caps(&self) -> bool {
        self.max_devices_per_user.is_some() || !self.max_devices_for_user.is_empty()
    }

    /// The cap for `user`, if any.
    pub fn cap_for(&self, user: &str) -> Option<u32> {
        self.max_devices_for_user
            .get(user)
            .copied()
            .or(self.max_devices_per_user)
    }
}

/// A rule, as named in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    NonEnvProcesses,
    EnvDevices,
    EnvMemory,
    MaxDevicesPerUser,
}

impl Rule {
    /// Every rule, in genv's order.
    pub const ALL: [Rule; 4] = [
        Rule::NonEnvProcesses,
        Rule::EnvDevices,
        Rule::EnvMemory,
        Rule::MaxDevicesPerUser,
    ];

    /// The rule of this name ([`Rule::name`]).
    pub fn from_name(name: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Its name, as in genv's flags and our reports.
    pub fn name(self) -> &'static str {
        match self {
            Rule::NonEnvProcesses => "non-env-processes",
            Rule::EnvDevices => "env-devices",
            Rule::EnvMemory => "env-memory",
            Rule::MaxDevicesPerUser => "max-devices-per-user",
        }
    }
}

/// Something a rule wants done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// SIGTERM a process.
    Terminate { host: HostId, pid: Pid },
    /// Detach environments from a device, and terminate their member
    /// processes there (`pids`).
    Detach {
        host: HostId,
        device: GpuIndex,
        eids: Vec<EnvId>,
        #[serde(skip)]
        pids: Vec<Pid>,
    },
}

/// What was found, with the figures genv prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// A GPU process outside any environment.
    NonEnvProcess { host: HostId, pid: Pid },
    /// A process on devices its environment is not attached to.
    NonAttachedDevices {
        host: HostId,
        pid: Pid,
        eid: EnvId,
        devices: Vec<GpuIndex>,
    },
    /// An environment over its `gpu_memory` on one device (bytes).
    EnvMemory {
        host: HostId,
        eid: EnvId,
        device: GpuIndex,
        used: u64,
        over: u64,
        capacity: String,
    },
    /// A user over their device cap, across all hosts seen this cycle.
    MaxDevices {
        user: String,
        devices: usize,
        hosts: usize,
        over: usize,
    },
}

impl Finding {
    /// The host it was found on; `None` for the cluster-wide per-user cap.
    pub fn host(&self) -> Option<&HostId> {
        match self {
            Finding::NonEnvProcess { host, .. }
            | Finding::NonAttachedDevices { host, .. }
            | Finding::EnvMemory { host, .. } => Some(host),
            Finding::MaxDevices { .. } => None,
        }
    }
}

/// A broken rule and what it calls for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub rule: Rule,
    pub finding: Finding,
    pub actions: Vec<Action>,
}

/// Something worth an admin's eye that no rule acts on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Notice {
    /// A GPU process whose environment or user could not be read: never
    /// terminated.
    UnknownOwner {
        host: HostId,
        pid: Pid,
        gpus: Vec<GpuIndex>,
        reason: String,
    },
    /// A GPU process that carries an environment id but is no member of
    /// that environment: left alone (see [`attribution`]).
    Stray {
        host: HostId,
        pid: Pid,
        /// With the pid, what identifies the process from cycle to cycle.
        start_time: Option<u64>,
        eid: EnvId,
        /// Its user, where the host says.
        user: Option<String>,
        gpus: Vec<GpuIndex>,
        #[serde(flatten)]
        why: Stray,
    },
    /// A process whose usage nvidia-smi could not measure, in an
    /// environment with a memory cap: it is left out of the sums.
    UnmeasuredUsage {
        host: HostId,
        pid: Pid,
        eid: EnvId,
        device: GpuIndex,
    },
    /// Under a device cap: an environment with devices whose processes are
    /// another user's than its record says; it counts as theirs.
    Recharged {
        host: HostId,
        eid: EnvId,
        recorded: Option<String>,
        charged: String,
    },
    /// Under a device cap: an environment with devices that counts toward
    /// no user's cap.
    Uncharged {
        host: HostId,
        eid: EnvId,
        recorded: Option<String>,
        #[serde(flatten)]
        why: Unconfirmed,
    },
    /// A user over their cap by devices that cannot be detached (held only
    /// by strays): they stay over by `left`.
    ExcessKept { user: String, left: usize },
}

/// What one host's snapshot shows on its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFindings {
    /// The per-host rules' violations, in genv's order.
    pub violations: Vec<Violation>,
    pub notices: Vec<Notice>,
    /// The host's part of the device caps (empty when no cap applies).
    pub usage: HostUsage,
    /// Its processes seen orphaned, to remember for the next cycle.
    pub orphans: Orphans,
}

/// Assesses one host: who runs what, the rules that need only this host
/// (all but the device caps), its notices and its part of the caps. What
/// it decides can be enforced as soon as the host's snapshot is in.
/// `orphans`: its processes seen orphaned in earlier cycles.
pub fn assess_host(
    host: &HostId,
    snap: &HostSnapshot,
    policy: &Policy,
    orphans: &Orphans,
) -> HostFindings {
    let a = Attribution::of(snap, orphans);
    let mut violations = Vec::new();
    if policy.non_env_processes {
        violations.extend(non_env_processes::evaluate(host, &a));
    }
    if policy.env_devices {
        violations.extend(env_devices::evaluate(host, &a));
    }
    if policy.env_memory {
        violations.extend(env_memory::evaluate(host, &a));
    }
    HostFindings {
        violations,
        notices: notices(host, &a, policy),
        usage: if policy.has_caps() {
            HostUsage::of(&a)
        } else {
            HostUsage::default()
        },
        orphans: a.orphans(),
    }
}

/// The device caps over the hosts' parts, in host order: violations and
/// the notices of users whose excess cannot all be detached.
pub fn evaluate_caps(
    hosts: &[(&HostId, &HostUsage)],
    policy: &Policy,
) -> (Vec<Violation>, Vec<Notice>) {
    if !policy.has_caps() {
        return (Vec::new(), Vec::new());
    }
    max_devices::evaluate(hosts, policy)
}

/// Every host's findings and the caps, merged in genv's order (rule by
/// rule, each over the hosts in order): violations and notices.
pub fn merge(
    hosts: Vec<(&HostId, HostFindings)>,
    policy: &Policy,
) -> (Vec<Violation>, Vec<Notice>) {
    let usage: Vec<(&HostId, &HostUsage)> = hosts.iter().map(|(h, f)| (*h, &f.usage)).collect();
    let (caps, kept) = evaluate_caps(&usage, policy);
    let mut by_rule: [Vec<Violation>; 3] = Default::default();
    let mut notices = Vec::new();
    for (_, f) in hosts {
        for v in f.violations {
            let slot = match v.rule {
                Rule::NonEnvProcesses => 0,
                Rule::EnvDevices => 1,
                // Per-host rules only: the caps come from `evaluate_caps`.
                Rule::EnvMemory | Rule::MaxDevicesPerUser => 2,
            };
            by_rule[slot].push(v);
        }
        notices.extend(f.notices);
    }
    let mut violations: Vec<Violation> = by_rule.into_iter().flatten().collect();
    violations.extend(caps);
    notices.extend(kept);
    (violations, notices)
}

/// Every rule over `cluster`: violations and notices in genv's order.
pub fn assess_cluster(cluster: &Cluster, policy: &Policy) -> (Vec<Violation>, Vec<Notice>) {
    let hosts = cluster
        .hosts
        .iter()
        .map(|(h, s)| (h, assess_host(h, s, policy, &Orphans::default())))
        .collect();
    merge(hosts, policy)
}

/// Runs the rules `policy` turns on, in genv's order.
pub fn evaluate(cluster: &Cluster, policy: &Policy) -> Vec<Violation> {
    assess_cluster(cluster, policy).0
}

/// What the rules leave alone on one host but an admin should know about.
fn notices(host: &HostId, a: &Attribution, policy: &Policy) -> Vec<Notice> {
    let snap = a.snapshot();
    let mut out = Vec::new();
    if policy.has_caps() {
        out.extend(charge_notices(host, a));
    }
    for (pi, p) in snap.processes.iter().enumerate() {
        match (a.standing(pi), &p.owner) {
            (Standing::Unknown, Owner::Unknown(reason)) => out.push(Notice::UnknownOwner {
                host: host.clone(),
                pid: p.pid,
                gpus: p.indices().collect(),
                reason: reason.clone(),
            }),
            (Standing::Unknown, _) => out.push(Notice::UnknownOwner {
                host: host.clone(),
                pid: p.pid,
                gpus: p.indices().collect(),
                reason: "its user could not be read".into(),
            }),
            (Standing::Stray(why), Owner::Env(eid)) => out.push(Notice::Stray {
                host: host.clone(),
                pid: p.pid,
                start_time: p.start_time,
                eid: eid.clone(),
                user: a.user_of(pi).map(|u| u.into_owned()),
                gpus: p.indices().collect(),
                why: why.clone(),
            }),
            (Standing::Member(i), Owner::Env(eid)) if snap.envs[*i].gpu_memory.is_some() => {
                for g in p.gpus.iter().filter(|g| g.usage.bytes().is_none()) {
                    out.push(Notice::UnmeasuredUsage {
                        host: host.clone(),
                        pid: p.pid,
                        eid: eid.clone(),
                        device: g.index,
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// Environments with devices whose charge is not what their record says.
fn charge_notices(host: &HostId, a: &Attribution) -> Vec<Notice> {
    let snap = a.snapshot();
    snap.envs
        .iter()
        .enumerate()
        .filter(|(i, _)| !a.attached(*i).is_empty())
        .filter_map(|(i, e)| {
            let recorded = e.username.as_deref().filter(|u| !u.is_empty());
            if let Some(charged) = a.charged(i) {
                return (recorded != Some(charged)).then(|| Notice::Recharged {
                    host: host.clone(),
                    eid: e.eid.clone(),
                    recorded: recorded.map(String::from),
                    charged: charged.to_string(),
                });
            }
            match a.uncharged(i)? {
                Unconfirmed::Nameless | Unconfirmed::Duplicate => None,
                why => Some(Notice::Uncharged {
                    host: host.clone(),
                    eid: e.eid.clone(),
                    recorded: recorded.map(String::from),
                    why: why.clone(),
                }),
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Small builders for rule and plan tests.
    use crate::model::*;

    pub fn mib(n: u64) -> Usage {
        Usage::Known(n * 1024 * 1024)
    }

    pub fn proc_(pid: u32, eid: Option<&str>, gpus: &[(u32, Usage)]) -> Process {
        Process {
            pid: Pid(pid),
            owner: match eid {
                Some(e) => Owner::Env(EnvId(e.into())),
                None => Owner::NoEnv,
            },
            gpus: gpus
                .iter()
                .map(|(i, u)| DeviceUsage {
                    index: GpuIndex(*i),
                    usage: *u,
                })
                .collect(),
            start_time: Some(1000 + u64::from(pid)),
            uid: Some(1000),
            user: Some("alice".into()),
        }
    }

    pub fn env(eid: &str, user: Option<&str>, gpu_memory: Option<&str>) -> Env {
        Env {
            eid: EnvId(eid.into()),
            uid: 1000,
            username: user.map(String::from),
            creation: "22/11/2026 15:04:05".into(),
            name: None,
            gpu_memory: gpu_memory.map(|t| Memory {
                text: t.into(),
                bytes: crate::snapshot::memory::parse(t).unwrap(),
            }),
            gpus: None,
            pids: vec![1],
            kernel_ids: vec![],
        }
    }

    pub fn devices(n: u32, attachments: &[(u32, &str)]) -> Vec<Device> {
        (0..n)
            .map(|i| Device {
                index: GpuIndex(i),
                total_memory: "81559mi".into(),
                attachments: attachments
                    .iter()
                    .filter(|(d, _)| *d == i)
                    .map(|(_, e)| Attachment {
                        eid: EnvId((*e).into()),
                        gpu_memory: None,
                        time: "22/11/2026 15:04:06".into(),
                    })
                    .collect(),
            })
            .collect()
    }

    pub fn local(snapshot: HostSnapshot) -> Cluster {
        Cluster::local(HostId("localhost".into()), snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use crate::model::*;

    /// One host with one process or environment behind each notice.
    fn noticed() -> (HostId, HostSnapshot) {
        let mut unknown = proc_(10, None, &[(0, mib(1))]);
        unknown.owner = Owner::Unknown("its environ is unreadable".into());
        let mut nameless = proc_(11, Some("m"), &[(0, mib(1))]);
        (nameless.uid, nameless.user) = (None, None);
        let stray = proc_(12, Some("gone"), &[(0, mib(1))]);
        let unmeasured = proc_(13, Some("m"), &[(0, Usage::Unknown)]);
        let uncapped = proc_(14, Some("n"), &[(3, Usage::Unknown)]);
        let recharged = proc_(15, Some("r"), &[(1, mib(1))]);
        let outside = proc_(16, None, &[(3, mib(1))]);
        // Two users' jobs in one environment: charged to neither.
        let shared = proc_(17, Some("c"), &[(2, mib(1))]);
        let mut bobs = proc_(18, Some("c"), &[(2, mib(1))]);
        (bobs.uid, bobs.user) = (Some(1001), Some("bob".into()));
        let snap = HostSnapshot {
            processes: vec![
                unknown, nameless, stray, unmeasured, uncapped, recharged, outside, shared, bobs,
            ],
            envs: vec![
                env("m", Some("alice"), Some("1gi")),
                env("n", Some("alice"), None),
                env("r", Some("bob"), None),
                // Idle and nameless: charged to nobody, as in genv, silently.
                env("u", None, None),
                env("c", Some("alice"), None),
            ],
            devices: devices(4, &[(0, "m"), (3, "n"), (1, "r"), (2, "u"), (2, "c")]),
            truth: Some(HostTruth {
                user_names: [(1000, "alice".to_string()), (1001, "bob".to_string())]
                    .into_iter()
                    .collect(),
                ..HostTruth::default()
            }),
        };
        (HostId("h".into()), snap)
    }

    #[test]
    fn each_thing_left_alone_is_noticed_and_charges_only_under_a_cap() {
        let (host, snap) = noticed();
        let kinds = |policy: &Policy| -> Vec<String> {
            assess_host(&host, &snap, policy, &Orphans::default())
                .notices
                .iter()
                .map(|n| match n {
                    Notice::UnknownOwner { pid, reason, .. } => {
                        format!("unknown {} {reason}", pid.0)
                    }
                    Notice::Stray { pid, eid, .. } => format!("stray {} {}", pid.0, eid.0),
                    Notice::UnmeasuredUsage { pid, device, .. } => {
                        format!("unmeasured {} on {}", pid.0, device.0)
                    }
                    Notice::Recharged {
                        eid,
                        recorded,
                        charged,
                        ..
                    } => format!("recharged {} {recorded:?} -> {charged}", eid.0),
                    Notice::Uncharged { eid, .. } => format!("uncharged {}", eid.0),
                    Notice::ExcessKept { user, .. } => format!("kept {user}"),
                })
                .collect()
        };
        let plain = Policy::default();
        let capped = Policy {
            max_devices_per_user: Some(8),
            ..Policy::default()
        };
        let per_host = [
            "unknown 10 its environ is unreadable",
            "unknown 11 its user could not be read",
            "stray 12 gone",
            "unmeasured 13 on 0",
            "stray 17 c",
            "stray 18 c",
        ];
        assert_eq!(kinds(&plain), per_host);
        let mut under_cap = vec![
            "recharged r Some(\"bob\") -> alice".to_string(),
            "uncharged c".to_string(),
        ];
        under_cap.extend(per_host.iter().map(|s| s.to_string()));
        assert_eq!(kinds(&capped), under_cap);
    }

    #[test]
    fn caps_are_on_with_either_flag() {
        assert!(!Policy::default().has_caps());
        let per_user = Policy {
            max_devices_per_user: Some(1),
            ..Policy::default()
        };
        let for_one = Policy {
            max_devices_for_user: [("bob".to_string(), 0)].into_iter().collect(),
            ..Policy::default()
        };
        assert!(per_user.has_caps() && for_one.has_caps());
    }

    #[test]
    fn a_finding_names_its_host_but_the_cap_names_none() {
        let (host, snap) = noticed();
        let policy = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(0),
            ..Policy::default()
        };
        let v = assess_cluster(
            &Cluster {
                mode: Mode::Remote,
                hosts: vec![(host.clone(), snap)],
            },
            &policy,
        )
        .0;
        assert!(v.iter().any(|v| v.finding.host() == Some(&host)));
        assert!(v
            .iter()
            .any(|v| v.rule == Rule::MaxDevicesPerUser && v.finding.host().is_none()));
    }

    #[test]
    fn a_detach_is_told_to_its_user_only_when_the_kernel_vouches_for_them() {
        let (host, mut snap) = noticed();
        snap.envs.push(env("idle", Some("carol"), None));
        // Group exemptions asked the host for its users' groups.
        if let Some(t) = snap.truth.as_mut() {
            t.groups.insert(1000, vec!["alice".into(), "lab".into()]);
        }
        snap.devices = devices(
            4,
            &[
                (0, "m"),
                (3, "n"),
                (1, "r"),
                (2, "u"),
                (2, "c"),
                (1, "idle"),
            ],
        );
        let policy = Policy {
            max_devices_per_user: Some(0),
            ..Policy::default()
        };
        let cluster = Cluster {
            mode: Mode::Remote,
            hosts: vec![(host.clone(), snap)],
        };
        let v = assess_cluster(&cluster, &policy).0;
        let plan = crate::plan::build(&cluster, &v);
        let detach = &plan.hosts[0].1.detach;
        let of = |eid: &str| {
            detach
                .iter()
                .find(|d| d.eid.0 == eid)
                .unwrap_or_else(|| panic!("{eid} not in {detach:?}"))
        };
        // `n`: alice's job (uid 1000) carries it: she is told.
        assert_eq!(of("n").charged.as_deref(), Some("alice"));
        assert_eq!(of("n").owner.as_deref(), Some("alice"));
        // `idle`: no process, charged by its record's username alone: the
        // admins only.
        assert_eq!(of("idle").charged.as_deref(), Some("carol"));
        assert_eq!(of("idle").owner, None);
        // `r`: recorded as bob's, carried by alice's job: alice.
        assert_eq!(of("r").charged.as_deref(), Some("alice"));
        assert_eq!(of("r").owner.as_deref(), Some("alice"));
        // The charged user's groups on the host go with each action.
        assert_eq!(of("n").groups, ["alice", "lab"]);
        assert!(of("idle").groups.is_empty(), "carol: no groups said");
        let terminate = &plan.hosts[0].1.terminate;
        assert!(!terminate.is_empty());
        for t in terminate {
            let want: &[&str] = match t.user.as_deref() {
                Some("alice") => &["alice", "lab"],
                _ => &[],
            };
            assert_eq!(t.groups, want, "{t:?}");
        }
    }
}
