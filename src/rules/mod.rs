//! The enforcement rules, pure functions over a [`Cluster`].
//!
//! Each rule returns [`Violation`]s in genv's order, each carrying the
//! actions it calls for. Merging those actions into per-host plans is
//! [`crate::plan`]'s job, and wording them is [`crate::report`]'s.

pub mod attribution;
mod env_devices;
mod env_memory;
mod max_devices;
mod non_env_processes;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{Cluster, EnvId, GpuIndex, HostId, HostSnapshot, Owner, Pid, Process};
use attribution::{Charge, Unconfirmed};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    NonEnvProcesses,
    EnvDevices,
    EnvMemory,
    MaxDevicesPerUser,
}

/// Something a rule wants done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// SIGTERM a process.
    Terminate { host: HostId, pid: Pid },
    /// Detach environments from a device (and terminate their processes there).
    Detach {
        host: HostId,
        device: GpuIndex,
        eids: Vec<EnvId>,
    },
}

/// What was found, with the figures genv prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// A GPU process outside any environment.
    NonEnvProcess { host: HostId, pid: Pid },
    /// A process whose `GENV_ENVIRONMENT_ID` names no environment on its host.
    UnknownEnvProcess { host: HostId, pid: Pid, eid: EnvId },
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
            | Finding::UnknownEnvProcess { host, .. }
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
    /// A GPU process whose environment could not be read: never terminated.
    UnknownOwner {
        host: HostId,
        pid: Pid,
        gpus: Vec<GpuIndex>,
        reason: String,
    },
    /// A process whose usage nvidia-smi could not measure, in an
    /// environment with a memory cap: it is left out of the sums.
    UnmeasuredUsage {
        host: HostId,
        pid: Pid,
        eid: EnvId,
        device: GpuIndex,
    },
    /// Under a device cap: an environment with devices that the host shows
    /// to be another user's than its record says; it counts as theirs.
    Recharged {
        host: HostId,
        eid: EnvId,
        recorded: Option<String>,
        charged: String,
    },
    /// Under a device cap: an environment with devices whose user the host
    /// cannot confirm; it counts toward no one's cap.
    Uncharged {
        host: HostId,
        eid: EnvId,
        recorded: Option<String>,
        #[serde(flatten)]
        why: Unconfirmed,
    },
}

/// The rules that need only one host's snapshot (all but the device
/// caps), on `host` alone, in genv's order: what can be enforced on a host
/// as soon as its snapshot is in, without waiting for the other hosts.
pub fn evaluate_host(host: &HostId, snap: &HostSnapshot, policy: &Policy) -> Vec<Violation> {
    let mut out = Vec::new();
    if policy.non_env_processes {
        out.extend(non_env_processes::evaluate(host, snap));
    }
    if policy.env_devices {
        out.extend(env_devices::evaluate(host, snap));
    }
    if policy.env_memory {
        out.extend(env_memory::evaluate(host, snap));
    }
    out
}

/// Runs the rules `policy` turns on, in genv's order (rule by rule, each
/// over all hosts).
pub fn evaluate(cluster: &Cluster, policy: &Policy) -> Vec<Violation> {
    evaluate_with(cluster, policy, &Charges::of(cluster, policy))
}

/// Whose cap each environment of each host counts toward, worked out once
/// for the rules and the notices (empty when no cap applies).
#[derive(Debug, Clone, Default)]
pub struct Charges(Vec<Vec<Charge>>);

impl Charges {
    /// The charges of every environment of `cluster`, if `policy` caps devices.
    pub fn of(cluster: &Cluster, policy: &Policy) -> Self {
        if !policy.has_caps() {
            return Charges::default();
        }
        Charges(
            cluster
                .hosts
                .iter()
                .map(|(_, snap)| attribution::charges(snap))
                .collect(),
        )
    }
}

/// [`evaluate`] with the charges already worked out.
pub fn evaluate_with(cluster: &Cluster, policy: &Policy, charges: &Charges) -> Vec<Violation> {
    let mut out = Vec::new();
    for (host, snap) in &cluster.hosts {
        if policy.non_env_processes {
            out.extend(non_env_processes::evaluate(host, snap));
        }
    }
    for (host, snap) in &cluster.hosts {
        if policy.env_devices {
            out.extend(env_devices::evaluate(host, snap));
        }
    }
    for (host, snap) in &cluster.hosts {
        if policy.env_memory {
            out.extend(env_memory::evaluate(host, snap));
        }
    }
    out.extend(max_devices::evaluate(cluster, policy, &charges.0));
    out
}

/// What the rules leave alone but an admin should know about.
pub fn notices(cluster: &Cluster, policy: &Policy) -> Vec<Notice> {
    notices_with(cluster, &Charges::of(cluster, policy))
}

/// [`notices`] with the charges already worked out.
pub fn notices_with(cluster: &Cluster, charges: &Charges) -> Vec<Notice> {
    let mut out = Vec::new();
    for (i, (host, snap)) in cluster.hosts.iter().enumerate() {
        if let Some(charges) = charges.0.get(i) {
            out.extend(charge_notices(host, snap, charges));
        }
        for p in &snap.processes {
            if let Owner::Unknown(reason) = &p.owner {
                out.push(Notice::UnknownOwner {
                    host: host.clone(),
                    pid: p.pid,
                    gpus: p.indices().collect(),
                    reason: reason.clone(),
                });
            }
            if let Some(eid) = p.owner.eid() {
                if snap.env(eid).is_some_and(|e| e.gpu_memory.is_some()) {
                    for g in p.gpus.iter().filter(|g| g.usage.bytes().is_none()) {
                        out.push(Notice::UnmeasuredUsage {
                            host: host.clone(),
                            pid: p.pid,
                            eid: eid.clone(),
                            device: g.index,
                        });
                    }
                }
            }
        }
    }
    out
}

/// Environments with devices whose charge is not what their record says.
fn charge_notices(host: &HostId, snap: &HostSnapshot, charges: &[Charge]) -> Vec<Notice> {
    snap.envs
        .iter()
        .zip(charges.iter().cloned())
        .filter(|(e, _)| !snap.attached(&e.eid).is_empty())
        .filter_map(|(e, charge)| {
            let recorded = e.username.clone().filter(|u| !u.is_empty());
            match charge {
                Charge::User(user) if recorded.as_ref() == Some(&user) => None,
                Charge::User(charged) => Some(Notice::Recharged {
                    host: host.clone(),
                    eid: e.eid.clone(),
                    recorded,
                    charged,
                }),
                Charge::Nobody(Unconfirmed::Nameless) => None,
                Charge::Nobody(why) => Some(Notice::Uncharged {
                    host: host.clone(),
                    eid: e.eid.clone(),
                    recorded,
                    why,
                }),
            }
        })
        .collect()
}

/// Whether `p` claims an environment that does not exist on its host.
fn in_unknown_env<'a>(snap: &HostSnapshot, p: &'a Process) -> Option<&'a EnvId> {
    p.owner.eid().filter(|eid| snap.env(eid).is_none())
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
