//! What happened when a plan was carried out: plain data for the report.

use std::collections::HashSet;

use serde::Serialize;

use crate::model::{EnvId, GpuIndex, HostId, Pid};
use crate::plan::{HostPlan, Plan, Termination};

/// The result of one planned termination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum TerminateResult {
    /// SIGTERM was delivered to the same process the snapshot saw.
    Signalled,
    /// Nothing done: `--dry-run` or a recorded snapshot.
    DryRun,
    /// The pid no longer exists.
    AlreadyGone,
    /// The pid now belongs to another process: left alone.
    PidReused { expected: u64, found: u64 },
    /// The snapshot did not record a start time: never signalled blind.
    NoIdentity,
    /// The kernel refused the signal.
    PermissionDenied,
    /// Anything else.
    Failed { error: String },
}

/// The result of one planned detach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum DetachResult {
    /// Removed from devices.json.
    Detached,
    /// Nothing done: `--dry-run` or a recorded snapshot.
    DryRun,
    /// The attachment was already gone.
    NotAttached,
    /// devices.json could not be updated; it was left as it was.
    Failed { error: String },
}

/// One outcome, located.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Outcome {
    Terminate {
        host: HostId,
        pid: Pid,
        outcome: TerminateResult,
    },
    Detach {
        host: HostId,
        device: GpuIndex,
        eid: EnvId,
        outcome: DetachResult,
    },
    /// `--kill-after`: SIGKILL to a process still running after its SIGTERM.
    Kill {
        host: HostId,
        pid: Pid,
        outcome: TerminateResult,
    },
}

impl Outcome {
    /// The host it was on.
    pub fn host(&self) -> &HostId {
        match self {
            Outcome::Terminate { host, .. }
            | Outcome::Detach { host, .. }
            | Outcome::Kill { host, .. } => host,
        }
    }

    /// Whether nothing was tried: a dry run's.
    pub fn is_dry_run(&self) -> bool {
        matches!(
            self,
            Outcome::Terminate {
                outcome: TerminateResult::DryRun,
                ..
            } | Outcome::Kill {
                outcome: TerminateResult::DryRun,
                ..
            } | Outcome::Detach {
                outcome: DetachResult::DryRun,
                ..
            }
        )
    }

    /// Whether this outcome should make the run's exit status non-zero.
    pub fn is_error(&self) -> bool {
        matches!(
            self,
            Outcome::Terminate {
                outcome: TerminateResult::PermissionDenied | TerminateResult::Failed { .. },
                ..
            } | Outcome::Kill {
                outcome: TerminateResult::PermissionDenied | TerminateResult::Failed { .. },
                ..
            } | Outcome::Detach {
                outcome: DetachResult::Failed { .. },
                ..
            }
        )
    }
}

/// The actions `outcomes` say were carried out (a SIGTERM delivered, a
/// detach done), indexed once: asking about every action of a plan costs
/// linear work however many a user's records make.
#[derive(Debug, Default)]
pub struct CarriedOut<'o> {
    signalled: HashSet<(&'o HostId, Pid)>,
    detached: HashSet<(&'o HostId, GpuIndex, &'o EnvId)>,
}

impl<'o> CarriedOut<'o> {
    pub fn of(outcomes: &'o [Outcome]) -> Self {
        let mut done = CarriedOut::default();
        for o in outcomes {
            match o {
                Outcome::Terminate {
                    host,
                    pid,
                    outcome: TerminateResult::Signalled,
                } => {
                    done.signalled.insert((host, *pid));
                }
                Outcome::Detach {
                    host,
                    device,
                    eid,
                    outcome: DetachResult::Detached,
                } => {
                    done.detached.insert((host, *device, eid));
                }
                _ => {}
            }
        }
        done
    }

    /// Whether `pid`'s SIGTERM on `host` was delivered.
    pub fn signalled(&self, host: &HostId, pid: Pid) -> bool {
        self.signalled.contains(&(host, pid))
    }

    /// Whether `eid` was detached from `device` on `host`.
    pub fn detached(&self, host: &HostId, device: GpuIndex, eid: &EnvId) -> bool {
        self.detached.contains(&(host, device, eid))
    }
}

/// A host's detached (device, environment) pairs and ended processes.
pub type Freed = (HashSet<(GpuIndex, EnvId)>, HashSet<Pid>);

/// What `outcomes` freed, by host, in one pass: the (device, environment)
/// pairs detached and the processes signalled (or already gone), for a
/// shard's part.
pub fn freed_by_host(outcomes: &[Outcome]) -> std::collections::HashMap<&HostId, Freed> {
    let mut by_host: std::collections::HashMap<_, Freed> = std::collections::HashMap::new();
    for o in outcomes {
        match o {
            Outcome::Detach {
                host,
                device,
                eid,
                outcome: DetachResult::Detached,
            } => {
                (by_host.entry(host).or_default().0).insert((*device, eid.clone()));
            }
            Outcome::Terminate {
                host,
                pid,
                outcome: TerminateResult::Signalled | TerminateResult::AlreadyGone,
            } => {
                (by_host.entry(host).or_default().1).insert(*pid);
            }
            _ => {}
        }
    }
    by_host
}

/// `outcomes` in the order of the actions of `plan` (hosts in order, each
/// host's terminations then detaches), whatever order they were carried
/// out in; actions without an outcome are left out.
pub fn in_plan_order(plan: &Plan, outcomes: Vec<Outcome>) -> Vec<Outcome> {
    /// What an outcome is about.
    #[derive(PartialEq, Eq, Hash)]
    enum Key<'a> {
        Terminate(&'a HostId, Pid),
        Detach(&'a HostId, GpuIndex, &'a EnvId),
    }
    // Each action's outcomes, first carried out first (linear, whatever the plan's size).
    let mut by_key: std::collections::HashMap<Key, std::collections::VecDeque<usize>> =
        std::collections::HashMap::new();
    for (i, o) in outcomes.iter().enumerate() {
        let key = match o {
            Outcome::Terminate { host, pid, .. } => Key::Terminate(host, *pid),
            Outcome::Detach {
                host, device, eid, ..
            } => Key::Detach(host, *device, eid),
            Outcome::Kill { .. } => continue,
        };
        by_key.entry(key).or_default().push_back(i);
    }
    let mut order = Vec::with_capacity(outcomes.len());
    for (host, hp) in &plan.hosts {
        for t in &hp.terminate {
            order.extend(
                by_key
                    .get_mut(&Key::Terminate(host, t.pid))
                    .and_then(|q| q.pop_front()),
            );
        }
        for d in &hp.detach {
            order.extend(
                by_key
                    .get_mut(&Key::Detach(host, d.device, &d.eid))
                    .and_then(|q| q.pop_front()),
            );
        }
    }
    drop(by_key);
    let mut slots: Vec<Option<Outcome>> = outcomes.into_iter().map(Some).collect();
    order.into_iter().filter_map(|i| slots[i].take()).collect()
}

/// Every action of one host's plan failed with `error`.
pub fn failed(host: &HostId, plan: &HostPlan, error: &str) -> Vec<Outcome> {
    let t = plan.terminate.iter().map(|t| Outcome::Terminate {
        host: host.clone(),
        pid: t.pid,
        outcome: TerminateResult::Failed {
            error: error.to_string(),
        },
    });
    let d = plan.detach.iter().map(|d| Outcome::Detach {
        host: host.clone(),
        device: d.device,
        eid: d.eid.clone(),
        outcome: DetachResult::Failed {
            error: error.to_string(),
        },
    });
    t.chain(d).collect()
}

/// Every kill of `terminations` (`--kill-after`) failed with `error`.
pub fn failed_kills(host: &HostId, terminations: &[Termination], error: &str) -> Vec<Outcome> {
    terminations
        .iter()
        .map(|t| Outcome::Kill {
            host: host.clone(),
            pid: t.pid,
            outcome: TerminateResult::Failed {
                error: error.to_string(),
            },
        })
        .collect()
}

/// Outcomes for a plan that is not carried out.
pub fn dry_run(plan: &Plan) -> Vec<Outcome> {
    plan.hosts
        .iter()
        .flat_map(|(host, p)| {
            let t = p.terminate.iter().map(move |t| Outcome::Terminate {
                host: host.clone(),
                pid: t.pid,
                outcome: TerminateResult::DryRun,
            });
            let d = p.detach.iter().map(move |d| Outcome::Detach {
                host: host.clone(),
                device: d.device,
                eid: d.eid.clone(),
                outcome: DetachResult::DryRun,
            });
            t.chain(d)
        })
        .collect()
}

/// An outcome with what the plan says of its action: the user it is
/// charged to, the rules asking, and whose it is as the kernel says.
#[derive(Debug, Clone, PartialEq)]
pub struct Acted {
    pub outcome: Outcome,
    pub user: Option<String>,
    pub rules: Vec<crate::rules::Rule>,
    pub owner: Option<String>,
}

/// Each outcome with what `plan` says of its action: the user charged,
/// the rules asking and whose it is as the kernel says (for the state
/// database's record of actions).
pub fn attributed(plan: &crate::plan::Plan, outcomes: &[Outcome]) -> Vec<Acted> {
    let mut signals = std::collections::HashMap::new();
    let mut detaches = std::collections::HashMap::new();
    for (host, p) in &plan.hosts {
        for t in &p.terminate {
            signals.insert((host, t.pid), t);
        }
        for d in &p.detach {
            detaches.insert((host, d.device, &d.eid), d);
        }
    }
    outcomes
        .iter()
        .map(|o| {
            let (user, rules, owner) = match o {
                Outcome::Terminate { host, pid, .. } | Outcome::Kill { host, pid, .. } => signals
                    .get(&(host, *pid))
                    .map_or((None, Vec::new(), None), |t| {
                        let user = t.user.as_deref().map(String::from);
                        let owner = t.uid.and(user.clone());
                        (user, t.rules.iter().collect(), owner)
                    }),
                Outcome::Detach {
                    host, device, eid, ..
                } => detaches.get(&(host, *device, eid)).map_or(
                    (None, vec![crate::rules::Rule::MaxDevicesPerUser], None),
                    |d| {
                        let rules = if d.rules.is_empty() {
                            vec![crate::rules::Rule::MaxDevicesPerUser]
                        } else {
                            d.rules.iter().collect()
                        };
                        (d.charged.clone(), rules, d.owner.clone())
                    },
                ),
            };
            Acted {
                outcome: o.clone(),
                user,
                rules,
                owner,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Detach as PlannedDetach, HostPlan, Termination as Planned};

    #[test]
    fn each_outcome_is_told_whose_it_is_and_why() {
        let h = HostId("h".into());
        let mut t = Planned::of(Pid(7), Some(70));
        (t.uid, t.user) = (Some(1001), Some("bob".into()));
        t.rules = crate::rules::Rule::EnvDevices.into();
        // A termination whose uid the kernel did not say is nobody's.
        let mut unowned = Planned::of(Pid(8), Some(80));
        unowned.user = Some("named".into());
        let mut d = PlannedDetach::of(GpuIndex(1), EnvId("e".into()));
        (d.charged, d.owner) = (Some("made-up".into()), None);
        d.rules = crate::rules::Rule::MaxDevicesPerGroup.into();
        let plan = Plan {
            hosts: vec![(
                h.clone(),
                HostPlan {
                    terminate: vec![t, unowned],
                    detach: vec![d],
                },
            )],
        };
        let outcomes = [
            Outcome::Terminate {
                host: h.clone(),
                pid: Pid(7),
                outcome: TerminateResult::Signalled,
            },
            Outcome::Terminate {
                host: h.clone(),
                pid: Pid(8),
                outcome: TerminateResult::AlreadyGone,
            },
            Outcome::Detach {
                host: h.clone(),
                device: GpuIndex(1),
                eid: EnvId("e".into()),
                outcome: DetachResult::Detached,
            },
        ];
        let acted = attributed(&plan, &outcomes);
        let told: Vec<(Option<&str>, Vec<&str>, Option<&str>)> = (acted.iter())
            .map(|a| {
                let rules = a.rules.iter().map(|r| r.name()).collect();
                (a.user.as_deref(), rules, a.owner.as_deref())
            })
            .collect();
        assert_eq!(
            told,
            [
                (Some("bob"), vec!["env-devices"], Some("bob")),
                (Some("named"), vec![], None),
                (Some("made-up"), vec!["max-devices-per-group"], None),
            ]
        );
    }

    #[test]
    fn only_what_was_carried_out_is_freed() {
        let (h1, h2) = (HostId("h1".into()), HostId("h2".into()));
        let term = |host: &HostId, pid: u32, outcome| Outcome::Terminate {
            host: host.clone(),
            pid: Pid(pid),
            outcome,
        };
        let detach = |eid: &str, outcome| Outcome::Detach {
            host: h1.clone(),
            device: GpuIndex(0),
            eid: EnvId(eid.into()),
            outcome,
        };
        let outcomes = [
            term(&h1, 1, TerminateResult::Signalled),
            term(&h1, 2, TerminateResult::AlreadyGone),
            term(&h1, 3, TerminateResult::DryRun),
            term(
                &h1,
                4,
                TerminateResult::PidReused {
                    expected: 1,
                    found: 2,
                },
            ),
            term(&h2, 5, TerminateResult::PermissionDenied),
            detach("a", DetachResult::Detached),
            detach("b", DetachResult::DryRun),
            detach("c", DetachResult::NotAttached),
        ];
        let freed = freed_by_host(&outcomes);
        let (detached, ended) = &freed[&h1];
        assert_eq!(
            detached.iter().map(|(_, e)| &*e.0).collect::<Vec<_>>(),
            ["a"]
        );
        let mut ended: Vec<u32> = ended.iter().map(|p| p.0).collect();
        ended.sort_unstable();
        assert_eq!(ended, [1, 2]);
        assert!(!freed.contains_key(&h2));
    }

    #[test]
    fn failures_are_errors_and_nothing_else_is() {
        let h = HostId("h".into());
        let term = |outcome| Outcome::Terminate {
            host: h.clone(),
            pid: Pid(1),
            outcome,
        };
        let detach = |outcome| Outcome::Detach {
            host: h.clone(),
            device: GpuIndex(0),
            eid: EnvId("e".into()),
            outcome,
        };
        for o in [
            term(TerminateResult::PermissionDenied),
            term(TerminateResult::Failed { error: "x".into() }),
            detach(DetachResult::Failed { error: "x".into() }),
        ] {
            assert!(o.is_error(), "{o:?}");
        }
        for o in [
            term(TerminateResult::Signalled),
            term(TerminateResult::DryRun),
            term(TerminateResult::AlreadyGone),
            term(TerminateResult::PidReused {
                expected: 1,
                found: 2,
            }),
            term(TerminateResult::NoIdentity),
            detach(DetachResult::Detached),
            detach(DetachResult::DryRun),
            detach(DetachResult::NotAttached),
        ] {
            assert!(!o.is_error(), "{o:?}");
        }
    }

    #[test]
    fn every_action_of_a_failed_or_dry_plan_has_its_outcome() {
        let h = HostId("h".into());
        let plan = HostPlan {
            terminate: vec![Planned::of(Pid(1), Some(1)), Planned::of(Pid(2), None)],
            detach: vec![PlannedDetach::of(GpuIndex(0), EnvId("e".into()))],
        };
        let out = failed(&h, &plan, "no audit");
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(Outcome::is_error));
        assert!(
            matches!(&out[1], Outcome::Terminate { pid: Pid(2), outcome: TerminateResult::Failed { error }, .. } if error == "no audit")
        );
        assert!(matches!(
            &out[2],
            Outcome::Detach {
                outcome: DetachResult::Failed { .. },
                ..
            }
        ));
        let dry = dry_run(&Plan {
            hosts: vec![(h, plan)],
        });
        assert_eq!(dry.len(), 3);
        assert!(dry.iter().all(|o| !o.is_error()));
    }

    #[test]
    fn outcomes_follow_the_plan_whatever_order_they_came_in() {
        let h = HostId("h".into());
        let t = |pid| Planned::of(Pid(pid), Some(1));
        let plan = Plan {
            hosts: vec![(
                h.clone(),
                HostPlan {
                    terminate: vec![t(1), t(2)],
                    detach: vec![PlannedDetach {
                        rules: Default::default(),
                        groups: Default::default(),
                        device: GpuIndex(0),
                        eid: EnvId("e".into()),
                        username: None,
                        charged: None,
                        owner: None,
                        working: false,
                    }],
                },
            )],
        };
        let term = |pid| Outcome::Terminate {
            host: h.clone(),
            pid: Pid(pid),
            outcome: TerminateResult::Signalled,
        };
        let detach = Outcome::Detach {
            host: h.clone(),
            device: GpuIndex(0),
            eid: EnvId("e".into()),
            outcome: DetachResult::Detached,
        };
        let stray = Outcome::Terminate {
            host: HostId("other".into()),
            pid: Pid(1),
            outcome: TerminateResult::Signalled,
        };
        assert_eq!(
            in_plan_order(&plan, vec![detach.clone(), term(2), stray, term(1)]),
            vec![term(1), term(2), detach]
        );
    }
}
