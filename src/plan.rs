//! Violations -> per-host plans: the pids to terminate and the
//! (device, environment) detaches, each once, in genv's order.
//!
//! genv's order: terminations in snapshot process order; detaches by device
//! in the order devices were first named, environments in snapshot order.
//! Detaching an environment from a device also terminates its processes
//! there. A process whose ownership is unknown is never planned, whatever
//! named it.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::model::{Cluster, EnvId, GpuIndex, HostId, HostSnapshot, Owner, Pid};
use crate::rules::{Action, Rule, Violation};

/// A process to SIGTERM, with what identifies it and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Termination {
    pub pid: Pid,
    /// Start time at snapshot; the pid is signalled only if it still matches.
    pub start_time: Option<u64>,
    pub eid: Option<EnvId>,
    pub gpus: Vec<GpuIndex>,
    pub uid: Option<u32>,
    pub user: Option<String>,
    pub rules: BTreeSet<Rule>,
}

impl Termination {
    /// A termination of `pid`, identified by `start_time`, with nothing else
    /// known (no environment, GPUs, owner or rule).
    pub fn of(pid: Pid, start_time: Option<u64>) -> Self {
        Termination {
            pid,
            start_time,
            eid: None,
            gpus: Vec::new(),
            uid: None,
            user: None,
            rules: BTreeSet::new(),
        }
    }
}

/// The signal of a termination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// genv's SIGTERM.
    Term,
    /// `--kill-after`'s SIGKILL.
    Kill,
}

/// An environment to detach from a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Detach {
    pub device: GpuIndex,
    pub eid: EnvId,
    pub username: Option<String>,
}

/// Everything to do on one host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HostPlan {
    pub terminate: Vec<Termination>,
    pub detach: Vec<Detach>,
}

impl HostPlan {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.terminate.is_empty() && self.detach.is_empty()
    }
}

/// The plans of the hosts that have something to do, in host order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    #[serde(serialize_with = "host_objects")]
    pub hosts: Vec<(HostId, HostPlan)>,
}

/// Serializes `(host, plan)` pairs as `{"host": .., "terminate": .., "detach": ..}`.
fn host_objects<S: serde::Serializer>(
    hosts: &[(HostId, HostPlan)],
    s: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Entry<'a> {
        host: &'a HostId,
        #[serde(flatten)]
        plan: &'a HostPlan,
    }
    s.collect_seq(hosts.iter().map(|(host, plan)| Entry { host, plan }))
}

/// What a host's violations ask for, before ordering.
#[derive(Default)]
struct Wanted {
    pids: BTreeMap<Pid, BTreeSet<Rule>>,
    /// Devices in first-named order, with the eids to detach there.
    detach: Vec<(GpuIndex, BTreeSet<EnvId>)>,
}

/// Builds the plan for `violations` found in `cluster`.
pub fn build(cluster: &Cluster, violations: &[Violation]) -> Plan {
    let mut wanted: BTreeMap<&HostId, Wanted> = BTreeMap::new();
    for v in violations {
        for action in &v.actions {
            match action {
                Action::Terminate { host, pid } => {
                    wanted
                        .entry(host)
                        .or_default()
                        .pids
                        .entry(*pid)
                        .or_default()
                        .insert(v.rule);
                }
                Action::Detach { host, device, eids } => {
                    let Some(snap) = cluster.host(host) else {
                        continue;
                    };
                    let w = wanted.entry(host).or_default();
                    let slot = match w.detach.iter().position(|(d, _)| d == device) {
                        Some(i) => i,
                        None => {
                            w.detach.push((*device, BTreeSet::new()));
                            w.detach.len() - 1
                        }
                    };
                    w.detach[slot].1.extend(eids.iter().cloned());
                    for eid in eids {
                        for p in snap
                            .processes_of(eid)
                            .filter(|p| p.usage_on(*device).is_some())
                        {
                            w.pids.entry(p.pid).or_default().insert(v.rule);
                        }
                    }
                }
            }
        }
    }
    let hosts = cluster
        .hosts
        .iter()
        .filter_map(|(host, snap)| {
            let w = wanted.remove(host)?;
            let plan = host_plan(snap, w);
            (!plan.is_empty()).then(|| (host.clone(), plan))
        })
        .collect();
    Plan { hosts }
}

/// The plan for one host's own violations (those of
/// [`crate::rules::evaluate_host`]: terminations only).
pub fn for_host(host: &HostId, snap: &HostSnapshot, violations: &[Violation]) -> HostPlan {
    let mut w = Wanted::default();
    for v in violations {
        for action in &v.actions {
            if let Action::Terminate { host: h, pid } = action {
                if h == host {
                    w.pids.entry(*pid).or_default().insert(v.rule);
                }
            }
        }
    }
    host_plan(snap, w)
}

impl HostPlan {
    /// What is left of this plan once `done` has been carried out: the
    /// terminations of pids `done` did not terminate, and every detach.
    pub fn without(&self, done: &HostPlan) -> HostPlan {
        HostPlan {
            terminate: self
                .terminate
                .iter()
                .filter(|t| !done.terminate.iter().any(|d| d.pid == t.pid))
                .cloned()
                .collect(),
            detach: self.detach.clone(),
        }
    }
}

fn host_plan(snap: &HostSnapshot, mut w: Wanted) -> HostPlan {
    let terminate = snap
        .processes
        .iter()
        .filter(|p| !matches!(p.owner, Owner::Unknown(_)))
        .filter_map(|p| {
            let rules = w.pids.remove(&p.pid)?;
            Some(Termination {
                pid: p.pid,
                start_time: p.start_time,
                eid: p.owner.eid().cloned(),
                gpus: p.indices().collect(),
                uid: p.uid,
                user: p.user.clone(),
                rules,
            })
        })
        .collect();
    let detach = w
        .detach
        .iter()
        .flat_map(|(device, eids)| {
            snap.envs
                .iter()
                .filter(|e| eids.contains(&e.eid))
                .map(|e| Detach {
                    device: *device,
                    eid: e.eid.clone(),
                    username: e.username.clone(),
                })
        })
        .collect();
    HostPlan { terminate, detach }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HostSnapshot;
    use crate::rules::test_support::*;
    use crate::rules::{evaluate, Policy};

    fn pids(plan: &HostPlan) -> Vec<u32> {
        plan.terminate.iter().map(|t| t.pid.0).collect()
    }

    #[test]
    fn union_of_rules_in_snapshot_order_each_pid_once() {
        // pid 3 is outside an env; pid 2 uses a non-attached GPU and is over memory.
        let c = local(HostSnapshot {
            processes: vec![
                proc_(3, None, &[(1, mib(10))]),
                proc_(2, Some("a"), &[(0, mib(3000)), (1, mib(10))]),
                proc_(1, Some("a"), &[(0, mib(10))]),
            ],
            envs: vec![env("a", Some("alice"), Some("1gi"))],
            devices: devices(2, &[(0, "a")]),
            truth: None,
        });
        let policy = Policy {
            non_env_processes: true,
            ..Policy::default()
        };
        let plan = build(&c, &evaluate(&c, &policy));
        let (_, hp) = &plan.hosts[0];
        assert_eq!(pids(hp), vec![3, 2]);
        assert_eq!(
            hp.terminate[1].rules,
            [Rule::EnvDevices, Rule::EnvMemory].into_iter().collect()
        );
        assert_eq!(hp.terminate[1].start_time, Some(1002));
    }

    #[test]
    fn detach_terminates_that_envs_processes_on_that_device_only() {
        let c = local(HostSnapshot {
            processes: vec![
                proc_(1, Some("a"), &[(0, mib(10))]),
                proc_(2, Some("a"), &[(1, mib(10))]),
                proc_(3, Some("b"), &[(0, mib(10))]),
            ],
            envs: vec![env("b", Some("bob"), None), env("a", Some("alice"), None)],
            devices: devices(2, &[(0, "a"), (0, "b"), (1, "a")]),
            truth: None,
        });
        let policy = Policy {
            max_devices_per_user: Some(1),
            ..Policy::default()
        };
        let plan = build(&c, &evaluate(&c, &policy));
        let (_, hp) = &plan.hosts[0];
        assert_eq!(pids(hp), vec![1]);
        assert_eq!(
            hp.detach,
            vec![Detach {
                device: GpuIndex(0),
                eid: EnvId("a".into()),
                username: Some("alice".into())
            }]
        );
    }

    #[test]
    fn unknown_owner_is_never_planned() {
        let mut p = proc_(1, Some("a"), &[(0, mib(10))]);
        let c = local(HostSnapshot {
            processes: vec![p.clone()],
            envs: vec![env("a", Some("alice"), None)],
            devices: devices(2, &[(0, "a"), (1, "a")]),
            truth: None,
        });
        p.owner = Owner::Unknown("permission denied".into());
        let unknown = local(HostSnapshot {
            processes: vec![p],
            ..c.hosts[0].1.clone()
        });
        let v = vec![Violation {
            rule: Rule::NonEnvProcesses,
            finding: crate::rules::Finding::NonEnvProcess {
                host: HostId("localhost".into()),
                pid: Pid(1),
            },
            actions: vec![Action::Terminate {
                host: HostId("localhost".into()),
                pid: Pid(1),
            }],
        }];
        assert!(build(&unknown, &v).hosts.is_empty());
        assert_eq!(build(&c, &v).hosts.len(), 1);
    }

    #[test]
    fn a_hosts_own_plan_then_the_rest_is_the_whole_plan() {
        let c = local(HostSnapshot {
            processes: vec![
                proc_(1, Some("a"), &[(0, mib(10))]),
                proc_(2, None, &[(1, mib(10))]),
                proc_(3, Some("a"), &[(1, mib(10))]),
            ],
            envs: vec![env("a", Some("alice"), None)],
            devices: devices(2, &[(0, "a")]),
            truth: None,
        });
        let policy = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(0),
            ..Policy::default()
        };
        let (host, snap) = &c.hosts[0];
        let own = for_host(
            host,
            snap,
            &crate::rules::evaluate_host(host, snap, &policy),
        );
        assert_eq!(
            pids(&own),
            vec![2, 3],
            "non-env 2, env-devices 3; no cap here"
        );
        assert!(own.detach.is_empty());
        let whole = &build(&c, &evaluate(&c, &policy)).hosts[0].1;
        assert_eq!(pids(whole), vec![1, 2, 3]);
        let rest = whole.without(&own);
        assert_eq!(
            pids(&rest),
            vec![1],
            "the cap's detach kills pid 1; 2 and 3 are done"
        );
        assert_eq!(rest.detach, whole.detach);
        assert_eq!(whole.without(&HostPlan::default()), *whole);
    }

    #[test]
    fn compliant_cluster_has_empty_plan() {
        let c = local(HostSnapshot {
            processes: vec![proc_(1, Some("a"), &[(0, mib(10))])],
            envs: vec![env("a", Some("alice"), Some("1gi"))],
            devices: devices(1, &[(0, "a")]),
            truth: None,
        });
        let everything = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(1),
            ..Policy::default()
        };
        assert_eq!(build(&c, &evaluate(&c, &everything)), Plan::default());
    }
}
