//! Assessment, pure: the hosts' snapshots and findings (or failures) ->
//! the merged cluster, its violations and notices, and the plan that
//! answers them. Each host's own findings are worked out once, beside its
//! snapshot ([`rules::assess_host`]); here only the device caps, which need
//! every host, are added.

use std::collections::HashMap;

use serde::Serialize;

use crate::ladder::{Ladder, Waiting};
use crate::model::{Cluster, HostFailure, HostId, HostSnapshot, Mode, Pid};
use crate::plan::{self, HostPlan, Plan};
use crate::rules::{self, HostFindings, IdleHistory, Moment, Notice, Policy, Violation};

/// The hosts that did not answer this cycle, or whose genv state could
/// not be used: as good as unanswered for what needs that state.
pub fn unusable(hosts: &[HostStatus]) -> Vec<HostId> {
    (hosts.iter())
        .filter(|h| h.error.is_some() || h.degraded.is_some())
        .map(|h| h.host.clone())
        .collect()
}

/// How one host fared this cycle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostStatus {
    pub host: HostId,
    /// Why its snapshot failed, if it did (in JSON, its text).
    pub error: Option<HostFailure>,
    /// Why its genv state could not be used, if so: it answered, but only
    /// what needs no genv state was judged there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
    pub processes: usize,
    pub envs: usize,
    pub devices: usize,
    /// A recorded snapshot, not a live host (for the wording of errors).
    #[serde(skip)]
    pub recorded: bool,
}

/// What one cycle found and decides.
#[derive(Debug, Clone)]
pub struct Assessment {
    pub cycle: u64,
    pub mode: Mode,
    /// Nothing is to be carried out.
    pub dry_run: bool,
    pub hosts: Vec<HostStatus>,
    pub cluster: Cluster,
    pub notices: Vec<Notice>,
    pub violations: Vec<Violation>,
    pub plan: Plan,
    /// Actions held back: not yet confirmed, or within their grace.
    pub waiting: Vec<Waiting>,
    /// The hosts whose own plan the cluster-wide rules (idle, caps) added
    /// to: their plan is not the one worked out beside their snapshot.
    pub extended: Vec<HostId>,
    /// The jobs no rule judges this cycle (their host's genv state
    /// unusable) whose wait the ladder keeps ([`rules::Withheld::unseen_waiting`]).
    pub unseen_waiting: std::collections::HashSet<(HostId, Pid)>,
    /// Of those, the ones due this cycle ([`rules::Withheld::unseen_due`]).
    pub unseen_due: std::collections::HashSet<(HostId, Pid)>,
}

/// One host's result: its snapshot and what it shows on its own, or why
/// it failed.
pub type HostResult = Result<(HostSnapshot, HostFindings), HostFailure>;

/// A host's findings worked out beside its snapshot.
pub fn with_findings(
    host: &HostId,
    snapshot: Result<HostSnapshot, HostFailure>,
    policy: &Policy,
) -> HostResult {
    snapshot.map(|s| {
        let f = rules::assess_host(host, &s, policy, &rules::Orphans::default());
        (s, f)
    })
}

/// Assesses the hosts' snapshots (or why a host failed): rules
/// and plan over the merged snapshots.
pub fn assess(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    policy: &Policy,
    results: Vec<(HostId, Result<HostSnapshot, HostFailure>)>,
) -> Assessment {
    let results: Vec<(HostId, HostResult)> = results
        .into_iter()
        .map(|(h, r)| {
            let r = with_findings(&h, r, policy);
            (h, r)
        })
        .collect();
    // One cycle, no window before it: idle only at `--idle-after 0s`.
    let idle = track_idle(&IdleHistory::default(), policy, &results, 0, None);
    assess_found(
        cycle,
        mode,
        dry_run,
        policy,
        results,
        Moment {
            idle: &idle,
            now_ms: 0,
            shards: None,
            blind: &[],
        },
    )
}

/// The idle windows after this cycle's readings of the hosts that
/// answered (none when the idle rule is off).
pub fn track_idle(
    before: &IdleHistory,
    policy: &Policy,
    results: &[(HostId, HostResult)],
    now_ms: u64,
    gap: Option<std::time::Duration>,
) -> IdleHistory {
    let Some(idle) = &policy.idle else {
        return IdleHistory::default();
    };
    let seen: Vec<(&HostId, &HostSnapshot)> = results
        .iter()
        .filter_map(|(h, r)| r.as_ref().ok().map(|(s, _)| (h, s)))
        .collect();
    before.track(&seen, idle.below, now_ms, gap)
}

/// Assesses the hosts' results, each host's own findings already made:
/// the device caps over all of them, then the plan.
pub fn assess_found(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    policy: &Policy,
    results: Vec<(HostId, HostResult)>,
    moment: Moment,
) -> Assessment {
    let own = results
        .iter()
        .filter_map(|(h, r)| r.as_ref().ok().map(|(s, f)| own_plan(h, s, f)))
        .collect();
    assess_planned(cycle, mode, dry_run, policy, results, own, moment, None)
}

/// [`assess_found`] with each answering host's own plan (see
/// [`own_plan`]) already made, in host order: only what the cluster-wide
/// rules add is planned here. With `ladder`, what it holds back frees no
/// room under the caps.
#[allow(clippy::too_many_arguments)]
pub fn assess_planned(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    policy: &Policy,
    results: Vec<(HostId, HostResult)>,
    own: Vec<HostPlan>,
    moment: Moment,
    ladder: Option<&Ladder>,
) -> Assessment {
    let mut findings = Vec::with_capacity(results.len());
    let results: Vec<(HostId, Result<HostSnapshot, HostFailure>)> = results
        .into_iter()
        .map(|(h, r)| {
            let r = r.map(|(s, f)| {
                findings.push(f);
                s
            });
            (h, r)
        })
        .collect();
    let mut a = statuses(cycle, mode, dry_run, results);
    let hosts: Vec<(&HostId, HostFindings)> = a
        .cluster
        .hosts
        .iter()
        .map(|(h, _)| h)
        .zip(findings)
        .collect();
    let snapshots: Vec<&HostSnapshot> = a.cluster.hosts.iter().map(|(_, s)| s).collect();
    // merge puts the hosts' own violations first.
    let owned: usize = hosts.iter().map(|(_, f)| f.violations.len()).sum();
    let cluster = &a.cluster;
    // The jobs no rule judges this cycle, their host's genv state unusable.
    let unseen: std::collections::HashSet<(HostId, Pid, u64)> = (cluster.hosts.iter())
        .filter(|(_, s)| s.state_problem().is_some())
        .flat_map(|(h, s)| {
            (s.processes.iter())
                .filter(|p| p.owner.eid().is_some())
                .filter_map(move |p| Some((h.clone(), p.pid, p.start_time?)))
        })
        .collect();
    let (unseen_waiting, unseen_due) = match ladder {
        Some(l) => (
            l.unseen_waits(&unseen, moment.now_ms),
            l.unseen_due(&unseen, moment.now_ms),
        ),
        None => Default::default(),
    };
    let mut held = |v: &[Violation]| match ladder {
        Some(l) if l.waits() => rules::Withheld {
            unseen_waiting: unseen_waiting.clone(),
            unseen_due: unseen_due.clone(),
            ..l.held(
                &plan::whole(cluster, own.clone(), &v[owned..]).0,
                moment.now_ms,
            )
        },
        _ => rules::Withheld::default(),
    };
    // The caps' picks a hold kept back, carried out now. Never sharded:
    // a shard knows only its own, and would work the other shards' picks
    // out anew, apart from how they do.
    let unusable = unusable(&a.hosts);
    let mut release = |earlier: &[Violation], picks: &[Violation]| match ladder {
        Some(l) if moment.shards.is_none() && l.after_hold() => {
            let v: Vec<Violation> = earlier.iter().chain(picks).cloned().collect();
            let plan = plan::whole(cluster, own.clone(), &v[owned..]).0;
            l.released(&plan, &unusable, moment.now_ms)
        }
        _ => rules::Released::default(),
    };
    let (violations, notices) =
        rules::merge_held(hosts, &snapshots, policy, moment, &mut held, &mut release);
    (a.plan, a.extended) = plan::whole(&a.cluster, own, &violations[owned..]);
    a.violations = violations;
    a.notices = notices;
    a.unseen_waiting = unseen_waiting;
    a.unseen_due = unseen_due;
    a
}

/// The hosts' results without the rules: what genv's `-e` reports when a
/// host failed (it raises before any rule runs).
pub fn statuses(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    results: Vec<(HostId, Result<HostSnapshot, HostFailure>)>,
) -> Assessment {
    let hosts = results
        .iter()
        .map(|(host, r)| match r {
            Ok(s) => HostStatus {
                host: host.clone(),
                error: None,
                degraded: s.state_problem().map(String::from),
                processes: s.processes.len(),
                envs: s.envs.len(),
                devices: s.devices.len(),
                recorded: false,
            },
            Err(e) => HostStatus {
                host: host.clone(),
                error: Some(e.clone()),
                degraded: None,
                processes: 0,
                envs: 0,
                devices: 0,
                recorded: false,
            },
        })
        .collect();
    Assessment {
        cycle,
        mode,
        dry_run,
        hosts,
        cluster: Cluster::merge(mode, results),
        notices: Vec::new(),
        violations: Vec::new(),
        plan: Plan::default(),
        waiting: Vec::new(),
        extended: Vec::new(),
        unseen_waiting: Default::default(),
        unseen_due: Default::default(),
    }
}

/// What `a`'s waiting actions free at their deadline, by host (for the
/// other shards, [`rules::shards::Published::mark_soon`]): those that only
/// wait (not warned only, not exempt), the waits kept for unseen jobs,
/// and what is carried out now (gone from the part as it is published).
pub fn soon(a: &Assessment) -> HashMap<HostId, rules::shards::Soon> {
    let mut soon: HashMap<HostId, rules::shards::Soon> = HashMap::new();
    for w in &a.waiting {
        match w {
            Waiting::Terminate {
                host,
                pid,
                warn_only: false,
                exempt: None,
                ..
            } => {
                soon.entry(host.clone())
                    .or_default()
                    .terminated
                    .insert(*pid);
            }
            Waiting::Detach {
                host,
                device,
                eid,
                warn_only: false,
                exempt: None,
                ..
            } => {
                let s = soon.entry(host.clone()).or_default();
                s.detached.insert((*device, eid.clone()));
            }
            _ => {}
        }
    }
    for (host, pid) in &a.unseen_waiting {
        soon.entry(host.clone())
            .or_default()
            .terminated
            .insert(*pid);
    }
    for (host, p) in &a.plan.hosts {
        let s = soon.entry(host.clone()).or_default();
        s.terminated.extend(p.terminate.iter().map(|t| t.pid));
        s.detached
            .extend(p.detach.iter().map(|d| (d.device, d.eid.clone())));
    }
    soon
}

/// What one host's findings decide on their own (every rule but the
/// cluster-wide per-user cap): it can be carried out before the other
/// hosts have answered.
pub fn own_plan(host: &HostId, snap: &HostSnapshot, findings: &HostFindings) -> HostPlan {
    plan::for_host(host, snap, &findings.violations)
}

/// `plan` less what `done` already carried out, host by host.
pub fn remaining(plan: &Plan, done: &Plan) -> Plan {
    let done: std::collections::HashMap<&HostId, &HostPlan> =
        done.hosts.iter().map(|(h, p)| (h, p)).collect();
    Plan {
        hosts: plan
            .hosts
            .iter()
            .map(|(h, p)| match done.get(h) {
                Some(d) => (h.clone(), p.without(d)),
                None => (h.clone(), p.clone()),
            })
            .filter(|(_, p)| !p.is_empty())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvId, GpuIndex};
    use crate::snapshot::genv;

    fn gpu1() -> (HostId, HostSnapshot) {
        let text = include_str!("../fixtures/snapshots/gpu1.json");
        (
            HostId("gpu1".into()),
            genv::parse_snapshot(text, "gpu1").unwrap(),
        )
    }

    /// What a shard marks soon for the others: what waits to be carried
    /// out (not what is warned only or exempt), the waits kept for unseen
    /// jobs, and what is carried out now.
    #[test]
    fn what_is_soon_is_what_waits_to_be_carried_out_or_is_now() {
        let (host, snap) = gpu1();
        let mut a = assess(
            1,
            Mode::Remote,
            false,
            &Policy::default(),
            vec![(host.clone(), Ok(snap))],
        );
        let other = HostId("other".into());
        let term = |pid: u32, warn_only: bool, exempt: Option<&str>| Waiting::Terminate {
            host: host.clone(),
            pid: Pid(pid),
            seen: 1,
            needed: 2,
            deadline_ms: None,
            warn_only,
            exempt: exempt.map(String::from),
        };
        let detach = |d: u32, e: &str, warn_only: bool, exempt: Option<&str>| Waiting::Detach {
            host: host.clone(),
            device: GpuIndex(d),
            eid: EnvId(e.into()),
            seen: 1,
            needed: 2,
            deadline_ms: None,
            warn_only,
            exempt: exempt.map(String::from),
        };
        a.waiting = vec![
            term(1, false, None),
            term(2, true, None),
            term(3, false, Some("x")),
            detach(0, "a", false, None),
            detach(1, "b", true, None),
            detach(2, "c", false, Some("x")),
        ];
        a.unseen_waiting = [(other.clone(), Pid(4))].into();
        let mut now = HostPlan::default();
        now.terminate.push(plan::Termination::of(Pid(5), None));
        now.detach
            .push(plan::Detach::of(GpuIndex(3), EnvId("d".into())));
        a.plan = Plan {
            hosts: vec![(host.clone(), now)],
        };
        let soon = soon(&a);
        assert_eq!(soon.len(), 2);
        assert_eq!(soon[&host].terminated, [Pid(1), Pid(5)].into());
        let detached = [
            (GpuIndex(0), EnvId("a".into())),
            (GpuIndex(3), EnvId("d".into())),
        ];
        assert_eq!(soon[&host].detached, detached.into());
        assert_eq!(soon[&other].terminated, [Pid(4)].into());
        assert!(soon[&other].detached.is_empty());
    }

    #[test]
    fn a_hosts_own_plan_is_the_whole_plan_less_the_cluster_wide_cap() {
        let (host, snap) = gpu1();
        let policy = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(0),
            ..Policy::default()
        };
        let own = own_plan(
            &host,
            &snap,
            &rules::assess_host(&host, &snap, &policy, &Default::default()),
        );
        let whole = assess(
            1,
            Mode::Remote,
            false,
            &policy,
            vec![(host.clone(), Ok(snap))],
        );
        let all = &whole.plan.hosts[0].1;
        assert!(!own.terminate.is_empty(), "{own:?}");
        assert!(own.detach.is_empty(), "detaches come from the per-user cap");
        assert!(!all.detach.is_empty());
        let pids = |p: &HostPlan| p.terminate.iter().map(|t| t.pid).collect::<Vec<_>>();
        assert!(pids(&own).iter().all(|p| pids(all).contains(p)));
        let done = Plan {
            hosts: vec![(host.clone(), own.clone())],
        };
        let rest = remaining(&whole.plan, &done);
        let rest = &rest.hosts[0].1;
        let mut both = pids(rest);
        both.extend(pids(&own));
        both.sort();
        let mut expected = pids(all);
        expected.sort();
        assert_eq!(both, expected, "the rest is what the host's own plan left");
        assert!(pids(rest).iter().all(|p| !pids(&own).contains(p)));
        assert_eq!(rest.detach, all.detach);
        // Nothing left: the host drops out.
        let kills = Plan {
            hosts: vec![(
                host,
                HostPlan {
                    terminate: all.terminate.clone(),
                    detach: Vec::new(),
                },
            )],
        };
        assert!(remaining(&kills, &kills).hosts.is_empty());
    }

    use crate::model::FailureKind;

    /// One live host: bob's job outside genv holding 60 GiB on GPU 0, and
    /// an older one of his holding 10 GiB on GPU 1.
    fn bobs_big_job() -> (HostId, HostSnapshot) {
        use crate::model::{Boot, HostTruth, Owner};
        use crate::rules::test_support::*;
        let job = |pid: u32, gpu: u32, gib: u64, started: u64| {
            let mut p = proc_(pid, None, &[(gpu, mib(gib * 1024))]);
            (p.owner, p.uid, p.user) = (Owner::NoEnv, Some(1002), Some("bob".into()));
            p.start_time = Some(started);
            p
        };
        let snap = HostSnapshot {
            processes: vec![job(5, 0, 60, 2000), job(4, 1, 10, 1000)],
            devices: devices(2, &[]).into(),
            truth: Some(HostTruth {
                boot: Some(Boot {
                    btime: 1_000_000,
                    hz: 100,
                }),
                user_names: [(1002, "bob".into())].into_iter().collect(),
                ..HostTruth::default()
            }),
            ..Default::default()
        };
        (HostId("h".into()), snap)
    }

    /// The pids `a` terminates now, and the rules behind each.
    fn terminations(a: &Assessment) -> Vec<(u32, Vec<rules::Rule>)> {
        a.plan
            .hosts
            .iter()
            .flat_map(|(_, p)| &p.terminate)
            .map(|t| (t.pid.0, t.rules.iter().collect()))
            .collect()
    }

    #[test]
    fn a_cap_counts_as_freed_only_what_is_carried_out_this_cycle() {
        use crate::ladder::{Grace, RuleGrace};
        use rules::Rule;
        let (host, snap) = bobs_big_job();
        let policy = Policy {
            non_env_processes: true,
            max_memory_per_user: Some(40 << 30),
            ..Policy::default()
        };
        let run = |ladder: Option<&Ladder>| {
            let found = vec![(
                host.clone(),
                with_findings(&host, Ok(snap.clone()), &policy),
            )];
            let own = vec![own_plan(&host, &snap, &found[0].1.as_ref().unwrap().1)];
            let idle = IdleHistory::default();
            let moment = Moment {
                idle: &idle,
                now_ms: 5_000,
                shards: None,
                blind: &[],
            };
            let mut a = assess_planned(1, Mode::Local, false, &policy, found, own, moment, ladder);
            if let Some(l) = ladder {
                a.plan = l.split(&a.plan, 5_000).0;
            }
            a
        };
        // genv's way, nothing waits: the non-env rule's terminations free
        // bob's memory, so the memory cap asks for nothing more.
        let at_once = run(None);
        assert_eq!(
            terminations(&at_once),
            [
                (5, vec![Rule::NonEnvProcesses]),
                (4, vec![Rule::NonEnvProcesses])
            ]
        );
        // The non-env rule only warns (hosts.example.toml's way): its
        // terminations are never carried out, so they free nothing, and
        // the cap takes bob's youngest job itself.
        let warn = |rules: &[Rule]| {
            Ladder::new(Grace {
                rules: (rules.iter())
                    .map(|r| {
                        let g = RuleGrace {
                            warn_only: true,
                            after: None,
                        };
                        (*r, g)
                    })
                    .collect(),
                ..Grace::default()
            })
        };
        let warned = run(Some(&warn(&[Rule::NonEnvProcesses])));
        assert_eq!(
            terminations(&warned),
            [(5, vec![Rule::NonEnvProcesses, Rule::MaxMemoryPerUser])]
        );
        // With a grace on the non-env rule, the same while it waits.
        let graced = Ladder::new(Grace {
            rules: [(
                Rule::NonEnvProcesses,
                RuleGrace {
                    warn_only: false,
                    after: Some(std::time::Duration::from_secs(600)),
                },
            )]
            .into_iter()
            .collect(),
            ..Grace::default()
        });
        assert_eq!(terminations(&run(Some(&graced))).len(), 1);
        // Both only warn: nothing is carried out, and the cap says so.
        let both = run(Some(&warn(&[
            Rule::NonEnvProcesses,
            Rule::MaxMemoryPerUser,
        ])));
        assert!(terminations(&both).is_empty());
        let memory_cap = |a: &Assessment| {
            (a.violations.iter())
                .filter(|v| v.rule == Rule::MaxMemoryPerUser)
                .count()
        };
        assert_eq!(memory_cap(&both), 1);
        assert_eq!(memory_cap(&at_once), 0);
    }

    #[test]
    fn a_failed_host_is_a_status_and_statuses_run_no_rule() {
        let (host, snap) = gpu1();
        let policy = Policy {
            non_env_processes: true,
            ..Policy::default()
        };
        let results = vec![
            (host, Ok(snap)),
            (
                HostId("gpu9".into()),
                Err(HostFailure::new(
                    FailureKind::Connect(crate::model::ConnectFailure::Refused),
                    "down",
                )),
            ),
        ];
        let a = statuses(1, Mode::Remote, false, results.clone());
        assert!(a.violations.is_empty() && a.plan.hosts.is_empty() && a.notices.is_empty());
        let error = a.hosts[1].error.as_ref().unwrap();
        assert_eq!(
            (error.kind, error.message.as_str()),
            (
                FailureKind::Connect(crate::model::ConnectFailure::Refused),
                "down"
            )
        );
        assert!(a.hosts[0].processes > 0 && a.hosts[0].devices > 0);
        let full = assess(1, Mode::Remote, false, &policy, results);
        assert!(!full.violations.is_empty());
        assert_eq!(full.hosts, a.hosts);
    }
}
