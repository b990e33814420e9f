//! max-memory-per-user: caps on the GPU memory a user's processes hold,
//! summed over every host seen this cycle (genv's per-environment
//! `gpu_memory` is the user's own to raise; this cap is the admin's).
//!
//! A process counts toward its user as attribution says
//! ([`super::attribution`]: the kernel's uid on a live host; a recording's
//! environment's user), with the memory nvidia-smi measured on each of its
//! GPUs (`[N/A]` counts nothing). A user over their cap loses processes,
//! youngest first (start times made comparable across hosts by each host's
//! boot time; ties in host order, then by pid), until under: the first
//! that brings them under is the last. Never a process whose usage is not
//! all known, whose start time is unknown (it could not be signalled
//! safely), or that holds nothing; what cannot be reclaimed so is noticed.
//! Processes the other rules terminate this cycle (their own or a device
//! cap's detach) count as freed, so two rules never take two bites of one
//! excess; only what is carried out in this cycle does: a termination
//! that waits out a grace, is warned only or is exempt leaves its memory
//! counted ([`super::Withheld`], [`super::taking::Taken`]).

use std::collections::{BTreeMap, HashSet};

use super::attribution::Attribution;
use super::{Action, Finding, Notice, Policy, Rule, Violation};
use crate::model::{HostId, Pid};

/// One host's part of the memory caps: each user's processes there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostMemory {
    pub users: BTreeMap<String, Vec<Held>>,
}

/// A process counted toward its user's memory cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub pid: Pid,
    /// When it started, comparable across hosts; `None`: never picked.
    pub started: Option<u64>,
    /// The memory measured on its GPUs (bytes).
    pub bytes: u64,
    /// Every one of its GPUs' usage was measured.
    pub known: bool,
}

impl Held {
    fn pickable(&self) -> bool {
        self.known && self.started.is_some() && self.bytes > 0
    }
}

impl HostMemory {
    /// What each user's processes hold on the host `a` is about.
    pub fn of(a: &Attribution) -> Self {
        let snap = a.snapshot();
        let mut users: BTreeMap<String, Vec<Held>> = BTreeMap::new();
        // Every process whose user the host names counts, whatever its
        // environment (unreadable, or its state garbled).
        for (pi, p) in snap.processes.iter().enumerate() {
            let Some(user) = a.user_of(pi) else { continue };
            let bytes = p
                .gpus
                .iter()
                .filter_map(|g| g.usage.bytes())
                .fold(0u64, u64::saturating_add);
            let known = p.gpus.iter().all(|g| g.usage.bytes().is_some());
            users.entry(user.into_owned()).or_default().push(Held {
                pid: p.pid,
                started: snap.started(p),
                bytes,
                known,
            });
        }
        HostMemory { users }
    }
}

/// The memory caps over every host's part (`hosts` in the order given):
/// a violation per user over their cap, with the terminations that bring
/// them under, and a notice for what cannot be reclaimed. `freed`: the
/// processes other rules terminate this cycle.
pub fn evaluate(
    hosts: &[(&HostId, &HostMemory)],
    policy: &Policy,
    freed: &HashSet<(HostId, Pid)>,
) -> (Vec<Violation>, Vec<Notice>) {
    let mut users: BTreeMap<&str, Vec<(usize, &HostId, &Held)>> = BTreeMap::new();
    for (k, (host, memory)) in hosts.iter().enumerate() {
        for (user, held) in &memory.users {
            let counted = held
                .iter()
                .filter(|h| !freed.contains(&((*host).clone(), h.pid)));
            users
                .entry(user)
                .or_default()
                .extend(counted.map(|h| (k, *host, h)));
        }
    }
    let mut violations = Vec::new();
    let mut notices = Vec::new();
    for (user, mut held) in users {
        let Some(cap) = policy.memory_cap_for(user) else {
            continue;
        };
        let used = held
            .iter()
            .map(|(_, _, h)| h.bytes)
            .fold(0u64, u64::saturating_add);
        let over = used.saturating_sub(cap);
        if over == 0 {
            continue;
        }
        let hosts_seen: HashSet<usize> = held.iter().map(|(k, _, _)| *k).collect();
        held.retain(|(_, _, h)| h.pickable());
        // Youngest first; ties in host order, then by pid.
        held.sort_by(|(ka, _, a), (kb, _, b)| {
            b.started
                .cmp(&a.started)
                .then(ka.cmp(kb))
                .then(a.pid.cmp(&b.pid))
        });
        let mut left = over;
        let mut actions = Vec::new();
        for (_, host, h) in held {
            if left == 0 {
                break;
            }
            left = left.saturating_sub(h.bytes);
            actions.push(Action::Terminate {
                host: host.clone(),
                pid: h.pid,
            });
        }
        if left > 0 {
            notices.push(Notice::MemoryExcessKept {
                user: user.to_string(),
                left,
            });
        }
        violations.push(Violation {
            rule: Rule::MaxMemoryPerUser,
            finding: Finding::MaxMemory {
                user: user.to_string(),
                used,
                cap,
                over,
                hosts: hosts_seen.len(),
            },
            actions: actions.into(),
        });
    }
    (violations, notices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    fn policy(cap: u64) -> Policy {
        Policy {
            max_memory_per_user: Some(cap),
            ..Policy::default()
        }
    }

    fn held(pid: u32, started: Option<u64>, gib: u64, known: bool) -> Held {
        Held {
            pid: Pid(pid),
            started,
            bytes: gib * GI,
            known,
        }
    }

    fn host(users: &[(&str, Vec<Held>)]) -> HostMemory {
        HostMemory {
            users: users
                .iter()
                .map(|(u, h)| (u.to_string(), h.clone()))
                .collect(),
        }
    }

    fn picked(v: &[Violation]) -> Vec<(String, u32)> {
        v.iter()
            .flat_map(|v| &v.actions)
            .map(|a| match a {
                Action::Terminate { host, pid } => (host.0.to_string(), pid.0),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn the_youngest_go_first_across_hosts_until_under() {
        let (a, b) = (HostId("a".into()), HostId("b".into()));
        // alice: 10 GiB on a (old), 8 GiB on b (youngest), 4 GiB on a
        // (middle); cap 12 GiB: over by 10, so b's 8 then a's 4.
        let ha = host(&[(
            "alice",
            vec![held(1, Some(100), 10, true), held(2, Some(300), 4, true)],
        )]);
        let hb = host(&[("alice", vec![held(9, Some(500), 8, true)])]);
        let (v, n) = evaluate(&[(&a, &ha), (&b, &hb)], &policy(12 * GI), &HashSet::new());
        assert_eq!(picked(&v), [("b".to_string(), 9), ("a".to_string(), 2)]);
        assert!(n.is_empty());
        assert_eq!(
            v[0].finding,
            Finding::MaxMemory {
                user: "alice".into(),
                used: 22 * GI,
                cap: 12 * GI,
                over: 10 * GI,
                hosts: 2
            }
        );
        // Under the cap: nothing.
        let (v, _) = evaluate(&[(&a, &ha), (&b, &hb)], &policy(22 * GI), &HashSet::new());
        assert!(v.is_empty());
    }

    #[test]
    fn unknown_usage_unpinned_or_empty_processes_are_never_picked_and_what_is_left_is_said() {
        let h = HostId("h".into());
        let m = host(&[(
            "bob",
            vec![
                held(1, Some(900), 30, false), // youngest, usage partly unknown
                held(2, None, 20, true),       // start time unknown
                held(3, Some(800), 0, true),   // holds nothing
                held(4, Some(100), 5, true),
            ],
        )]);
        let (v, n) = evaluate(&[(&h, &m)], &policy(10 * GI), &HashSet::new());
        assert_eq!(picked(&v), [("h".to_string(), 4)]);
        assert_eq!(
            n,
            [Notice::MemoryExcessKept {
                user: "bob".into(),
                left: 40 * GI
            }]
        );
    }

    #[test]
    fn what_other_rules_terminate_counts_as_freed_and_per_user_caps_override() {
        let h = HostId("h".into());
        let m = host(&[
            (
                "alice",
                vec![held(1, Some(1), 8, true), held(2, Some(2), 8, true)],
            ),
            ("carol", vec![held(5, Some(1), 8, true)]),
        ]);
        let freed: HashSet<(HostId, Pid)> = [(h.clone(), Pid(2))].into_iter().collect();
        let p = Policy {
            max_memory_for_user: [("carol".to_string(), 4 * GI)].into_iter().collect(),
            ..policy(8 * GI)
        };
        let (v, _) = evaluate(&[(&h, &m)], &p, &freed);
        assert_eq!(
            picked(&v),
            [("h".to_string(), 5)],
            "alice is under once 2 goes"
        );
        let only_carol = Policy {
            max_memory_for_user: [("carol".to_string(), 4 * GI)].into_iter().collect(),
            ..Policy::default()
        };
        assert_eq!(
            picked(&evaluate(&[(&h, &m)], &only_carol, &HashSet::new()).0),
            [("h".to_string(), 5)]
        );
    }

    #[test]
    fn memory_is_summed_from_attribution_with_unknown_usage_counting_nothing() {
        use super::super::test_support::*;
        use crate::model::*;
        let mut unknown = proc_(2, Some("e"), &[(0, Usage::Unknown), (1, mib(100))]);
        unknown.start_time = Some(50);
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, Some("e"), &[(0, mib(300)), (1, mib(200))]),
                unknown,
            ],
            envs: vec![env("e", Some("alice"), None)].into(),
            devices: devices(2, &[(0, "e"), (1, "e")]).into(),
            ..Default::default()
        };
        let a = Attribution::of(&snap, &Default::default());
        let m = HostMemory::of(&a);
        assert_eq!(
            m.users["alice"],
            [
                Held {
                    pid: Pid(1),
                    started: Some(1001),
                    bytes: 500 << 20,
                    known: true
                },
                Held {
                    pid: Pid(2),
                    started: Some(50),
                    bytes: 100 << 20,
                    known: false
                }
            ]
        );
    }

    proptest! {
        /// Never over-reclaims (the last pick is the first that brings the
        /// user under), never picks what cannot be picked, picks the
        /// youngest, and says what is left.
        #[test]
        fn picks_are_needed_pickable_youngest_and_deterministic(
            procs in proptest::collection::vec(
                (0usize..3, proptest::option::of(0u64..50), 0u64..40, any::<bool>()), 0..24),
            cap in 0u64..200,
        ) {
            let hosts: Vec<HostId> = (0..3).map(|k| HostId(format!("h{k}").into())).collect();
            let mut parts = vec![HostMemory::default(); 3];
            for (pid, (k, started, gib, known)) in procs.iter().enumerate() {
                parts[*k].users.entry("u".into()).or_default()
                    .push(held(pid as u32, *started, *gib, *known));
            }
            let input: Vec<(&HostId, &HostMemory)> = hosts.iter().zip(&parts).collect();
            let (v, n) = evaluate(&input, &policy(cap * GI), &HashSet::new());
            prop_assert_eq!(&evaluate(&input, &policy(cap * GI), &HashSet::new()), &(v.clone(), n.clone()));
            let all: Vec<(usize, &Held)> = parts.iter().enumerate()
                .flat_map(|(k, m)| m.users.values().flatten().map(move |h| (k, h))).collect();
            let used: u64 = all.iter().map(|(_, h)| h.bytes).sum();
            let picks = picked(&v);
            let pick_of = |(host, pid): &(String, u32)| {
                all.iter().find(|(k, h)| *hosts[*k].0 == **host && h.pid.0 == *pid).unwrap().1
            };
            let freed: Vec<u64> = picks.iter().map(|p| pick_of(p).bytes).collect();
            let total: u64 = freed.iter().sum();
            for p in &picks {
                prop_assert!(pick_of(p).pickable(), "picked {:?}", p);
            }
            if used <= cap * GI {
                prop_assert!(v.is_empty() && n.is_empty());
            } else if total >= used - cap * GI {
                let before_last: u64 = total - freed.last().unwrap();
                prop_assert!(before_last < used - cap * GI, "one pick too many");
                prop_assert!(n.is_empty());
            } else {
                // Not enough: every pickable one taken, the rest said.
                prop_assert_eq!(picks.len(), all.iter().filter(|(_, h)| h.pickable()).count());
                prop_assert_eq!(n, vec![Notice::MemoryExcessKept {
                    user: "u".into(), left: used - cap * GI - total }]);
            }
            // Youngest first: no unpicked pickable process is younger than
            // a picked one.
            let youngest_left = all.iter()
                .filter(|(k, h)| h.pickable() && !picks.contains(&(hosts[*k].0.to_string(), h.pid.0)))
                .filter_map(|(_, h)| h.started).max();
            if let (Some(left), Some(oldest_pick)) =
                (youngest_left, picks.iter().filter_map(|p| pick_of(p).started).min()) {
                prop_assert!(left <= oldest_pick);
            }
        }
    }
}
