//! max-devices-per-group: a Unix group's quota of devices, counted over
//! every host seen this cycle (a lab's share of the fleet).
//!
//! A group's count is the sum of its members' counts, each as the per-user
//! cap counts it ([`super::max_devices`]), membership as each host
//! resolves it (the host's name service, for the users it names: the
//! owners of live processes; a recording's `groups`). A user the host
//! does not name counts toward no group. The excess falls on who came
//! last: first the devices where none of a member's jobs runs (records
//! that list no live pid of theirs before the others), then the working
//! ones, the most recent first (by when the first of the member's jobs
//! there that run on after what is carried out this cycle started, which
//! only the kernel says, [`Taken::since`]; one first seen out of line
//! there, from when it was brought into line, [`super::in_line`]): a
//! member who starts jobs that
//! put the group over loses them, never another member's older work.
//! Another rule ending the first of a member's jobs on a device moves it
//! up in the cycle that job ends (or would end, were its host seen: a
//! wait due there while its genv state is unusable), whether the cap's
//! picks are carried out then or held a cycle for an unseen host. Ties (and idle devices) go in
//! one order: hosts as given, devices
//! by index, users by name. A device that can never be freed (a job there
//! is never terminated: its identity or environment unknown, its host's
//! genv state unusable) bears its share where its work puts it: that
//! share of the excess is kept (`group_excess_kept`), never passed on to
//! another member; an exempt member's, likewise. What the per-user caps (or an earlier group,
//! groups by name) take this cycle counts as taken already.

use std::collections::{BTreeMap, HashSet};

use super::max_devices::HostUsage;
use super::taking::{self, Candidate, Taken};
use super::{Finding, Notice, Policy, Rule, Violation};
use crate::model::{GpuIndex, HostId, HostSnapshot, Pid};

/// The group caps' order as it stood in the cycle the caps' hold first
/// kept back a pick that was due ([`crate::ladder::Ladder::holds_back`]),
/// after what that cycle carried out: when the first of each member's jobs on each device
/// that ran on started (ms since the Unix epoch). Kept while the picks are
/// held, and put back in the cycle that works them out again, so that a
/// pick held a cycle is worked out in the order it would have been
/// carried out in: another rule ending the first of a member's jobs on a
/// device meanwhile does not move it up. Its size is bounded by the hosts'
/// jobs: only a job's start time enters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldOrder(BTreeMap<(HostId, String, GpuIndex), u64>);

/// Each member device's jobs with their start times, as counted this
/// cycle: the makings of its [`HeldOrder`] once the cycle's plan is known.
#[derive(Debug, Clone, Default)]
pub struct Starts(BTreeMap<(HostId, String, GpuIndex), Vec<(Pid, u64)>>);

impl Starts {
    /// The jobs of `hosts` as counted this cycle.
    pub fn of<'a>(hosts: impl IntoIterator<Item = (&'a HostId, &'a HostUsage)>) -> Self {
        let mut starts = BTreeMap::new();
        for (host, usage) in hosts {
            for (user, held) in &usage.users {
                for d in held.devices.iter().filter(|d| !d.starts.is_empty()) {
                    let key = (host.clone(), user.clone(), d.index);
                    starts.insert(key, d.starts.to_vec());
                }
            }
        }
        Starts(starts)
    }

    /// The order after what this cycle carried out: `ended`, the jobs its
    /// plan terminates.
    pub fn after<'a>(self, ended: impl IntoIterator<Item = (&'a HostId, Pid)>) -> HeldOrder {
        let ended: HashSet<(&HostId, Pid)> = ended.into_iter().collect();
        let order = (self.0.into_iter())
            .filter_map(|(key, jobs)| {
                let first = (jobs.iter())
                    .filter(|(p, _)| !ended.contains(&(&key.0, *p)))
                    .map(|(_, t)| *t)
                    .min()?;
                Some((key, first))
            })
            .collect();
        HeldOrder(order)
    }
}

impl HeldOrder {
    /// What to keep after a cycle whose order was `now`: the order kept
    /// (`before`, or `now` if the hold began this cycle) while the caps'
    /// hold keeps back a pick that is due (`back`); nothing once none is.
    #[must_use]
    pub fn kept(before: Option<Self>, now: Self, back: bool) -> Option<Self> {
        back.then(|| before.unwrap_or(now))
    }

    /// Puts each of `host`'s devices back where it stood in the order
    /// ([`HeldDevice::held_since`](super::taking::HeldDevice::held_since)).
    pub fn restore(&self, host: &HostId, usage: &mut HostUsage) {
        for (user, held) in &mut usage.users {
            for d in &mut held.devices {
                let key = (host.clone(), user.clone(), d.index);
                d.held_since = self.0.get(&key).copied();
            }
        }
    }
}

/// Each user's groups by name, as `snap`'s host says (by uid, live; as
/// recorded, in a recording).
pub fn said(snap: &HostSnapshot) -> BTreeMap<&str, Vec<&str>> {
    match &snap.truth {
        Some(t) => {
            let mut by_name: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (uid, name) in &t.user_names {
                by_name
                    .entry(name)
                    .or_default()
                    .extend(t.groups_of(*uid).iter().map(String::as_str));
            }
            by_name
        }
        None => snap
            .recorded_groups
            .iter()
            .map(|(u, g)| (u.as_str(), g.iter().map(String::as_str).collect()))
            .collect(),
    }
}

/// One host's word on its users' groups: the capped groups each user
/// counted there is a member of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostGroups {
    pub users: BTreeMap<String, Vec<String>>,
}

impl HostGroups {
    /// The capped groups of each user in `usage`, as `snap`'s host says.
    /// Linear: the host's names are indexed once.
    pub fn of(snap: &HostSnapshot, usage: &HostUsage, policy: &Policy) -> Self {
        let capped = |g: &&&str| policy.max_devices_per_group.contains_key(**g);
        let said = said(snap);
        let users = usage
            .users
            .keys()
            .filter_map(|user| {
                let mut groups: Vec<String> = said
                    .get(user.as_str())?
                    .iter()
                    .filter(capped)
                    .map(|g| g.to_string())
                    .collect();
                groups.sort_unstable();
                groups.dedup();
                (!groups.is_empty()).then(|| (user.clone(), groups))
            })
            .collect();
        HostGroups { users }
    }
}

/// The group caps over every host's part (in the order given): a
/// violation per group over its cap, with the actions that bring it down,
/// and a notice for each group whose excess cannot all be freed.
/// `taken`: what the rules before take this cycle; what the groups take
/// is added to it.
pub fn evaluate(
    hosts: &[(&HostId, &HostUsage, &HostGroups)],
    policy: &Policy,
    taken: &mut Taken,
) -> (Vec<Violation>, Vec<Notice>) {
    let mut violations = Vec::new();
    let mut notices = Vec::new();
    for (group, &cap) in &policy.max_devices_per_group {
        // (host order, candidate) for each member's device still held.
        let mut held: Vec<(usize, Candidate)> = Vec::new();
        for (k, (host, usage, groups)) in hosts.iter().enumerate() {
            for (user, devices) in &usage.users {
                if !groups.users.get(user).is_some_and(|g| g.contains(group)) {
                    continue;
                }
                held.extend(
                    (devices.devices.iter())
                        .filter(|d| taken.holds_in_group(host, d))
                        .map(|d| (k, (*host, user.as_str(), d))),
                );
            }
        }
        let count = held.len();
        let over = count.saturating_sub(cap as usize);
        if over == 0 {
            continue;
        }
        held.sort_by_key(|&(k, (host, user, d))| {
            // A device never freed stands where its work puts it: it
            // bears its share (see taking::take), never passes it on.
            let turn = taken.turn(host, d).min(taking::WORKING);
            // Working: the most recent first (unknown: as the oldest).
            let recent = std::cmp::Reverse(if turn == taking::WORKING {
                taken.since(host, d).unwrap_or(0)
            } else {
                0
            });
            (turn, recent, k, d.index, user)
        });
        let candidates: Vec<Candidate> = held.into_iter().map(|(_, c)| c).collect();

        let (actions, freed) = taking::take(&candidates, over, taken, true);
        if freed < over {
            notices.push(Notice::GroupExcessKept {
                group: group.clone(),
                left: over - freed,
            });
        }
        violations.push(Violation {
            rule: Rule::MaxDevicesPerGroup,
            finding: Finding::MaxGroupDevices {
                group: group.clone(),
                devices: count,
                cap,
                over,
            },
            actions: actions.into(),
        });
    }
    (violations, notices)
}

#[cfg(test)]
mod tests {
    use super::super::max_devices::{Held, HeldDevice};
    use super::*;
    use crate::model::{EnvId, GpuIndex, Pid};
    use crate::rules::Action;
    use proptest::prelude::*;

    fn device(index: u32, eid: &str, working: bool, vouched: bool) -> HeldDevice {
        HeldDevice {
            index: GpuIndex(index),
            eids: smallvec::smallvec![EnvId(eid.into())],
            pids: if working {
                smallvec::smallvec![Pid(100 + index)]
            } else {
                smallvec::smallvec![]
            },
            jobs: smallvec::smallvec![],
            contested: smallvec::smallvec![],
            working,
            stray: false,
            kept: false,
            unseen: false,
            vouched,
            since: working.then_some(1000),
            off: smallvec::smallvec![],
            starts: smallvec::smallvec![],
            held_since: None,
            soon: Default::default(),
        }
    }

    fn usage(users: &[(&str, Vec<HeldDevice>)]) -> HostUsage {
        HostUsage {
            users: users
                .iter()
                .map(|(u, d)| {
                    (
                        u.to_string(),
                        Held {
                            envs: true,
                            devices: d.clone(),
                        },
                    )
                })
                .collect(),
        }
    }

    fn groups(of: &[(&str, &[&str])]) -> HostGroups {
        HostGroups {
            users: of
                .iter()
                .map(|(u, g)| (u.to_string(), g.iter().map(|s| s.to_string()).collect()))
                .collect(),
        }
    }

    fn policy(caps: &[(&str, u32)]) -> Policy {
        Policy {
            max_devices_per_group: caps.iter().map(|(g, n)| (g.to_string(), *n)).collect(),
            ..Policy::default()
        }
    }

    fn detaches(v: &[Violation]) -> Vec<(String, u32, String)> {
        v.iter()
            .flat_map(|v| &v.actions)
            .map(|a| match a {
                Action::Detach {
                    host, device, user, ..
                } => (host.0.to_string(), device.0, user.clone()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_labs_excess_across_hosts_is_detached_idle_first_in_one_order() {
        let (a, b) = (HostId("a".into()), HostId("b".into()));
        // lab: alice (2 on a: one working) + bob (2 on b: both idle, one
        // vouched) = 4; cap 1, so 3 go: the idle unvouched ones (a's, then
        // b's), then b's vouched one; alice's working device stays. carol
        // is not in the lab.
        let ua = usage(&[
            (
                "alice",
                vec![device(0, "a0", true, true), device(1, "a1", false, false)],
            ),
            ("carol", vec![device(2, "c", false, false)]),
        ]);
        let ub = usage(&[(
            "bob",
            vec![device(0, "b0", false, true), device(3, "b3", false, false)],
        )]);
        let ga = groups(&[("alice", &["lab"])]);
        let gb = groups(&[("bob", &["lab"])]);
        let (v, n) = evaluate(
            &[(&a, &ua, &ga), (&b, &ub, &gb)],
            &policy(&[("lab", 1)]),
            &mut Taken::default(),
        );
        assert_eq!(
            detaches(&v),
            [
                ("a".to_string(), 1, "alice".to_string()),
                ("b".to_string(), 3, "bob".to_string()),
                ("b".to_string(), 0, "bob".to_string()),
            ]
        );
        assert!(n.is_empty());
        assert_eq!(
            v[0].finding,
            Finding::MaxGroupDevices {
                group: "lab".into(),
                devices: 4,
                cap: 1,
                over: 3
            }
        );
        // What the per-user caps detach counts as gone: b's device 3.
        let mut done = Taken::default();
        done.detached
            .insert((b.clone(), GpuIndex(3), EnvId("b3".into())));
        let (v, _) = evaluate(
            &[(&a, &ua, &ga), (&b, &ub, &gb)],
            &policy(&[("lab", 1)]),
            &mut done,
        );
        assert_eq!(detaches(&v).len(), 2);
        // A user the host names in no capped group counts for none.
        let (v, _) = evaluate(
            &[(&a, &ua, &HostGroups::default())],
            &policy(&[("lab", 0)]),
            &mut Taken::default(),
        );
        assert!(v.is_empty());
    }

    /// What `v` asks for: detaches as (host, device, user), terminations
    /// as (host, pid).
    fn taken(v: &[Violation]) -> Vec<String> {
        v.iter()
            .flat_map(|v| &v.actions)
            .map(|a| match a {
                Action::Detach {
                    host, device, user, ..
                } => format!("{}: detach {user} from {}", host.0, device.0),
                Action::Terminate { host, pid } => format!("{}: terminate {}", host.0, pid.0),
            })
            .collect()
    }

    #[test]
    fn the_excess_falls_on_the_most_recent_work_strays_included() {
        let h = HostId("h".into());
        // alice: her job (since 1000) in e1 on device 1, with a stray of
        // hers beside it started at 5000; her job in e2 on 2 (since 2000).
        // bob: two strays (made-up ids) started at 3000 and 4000, each on
        // a device of its own.
        let beside = HeldDevice {
            jobs: smallvec::smallvec![Pid(51)],
            stray: true,
            since: Some(1000),
            ..device(1, "e1", true, true)
        };
        let e2 = HeldDevice {
            since: Some(2000),
            ..device(2, "e2", true, false)
        };
        let stray = |index: u32, pid: u32, since: u64| HeldDevice {
            eids: smallvec::smallvec![],
            pids: smallvec::smallvec![],
            jobs: smallvec::smallvec![Pid(pid)],
            stray: true,
            since: Some(since),
            ..device(index, "x", true, false)
        };
        let u = usage(&[
            ("alice", vec![beside, e2]),
            ("bob", vec![stray(0, 60, 3000), stray(3, 61, 4000)]),
        ]);
        let lab = groups(&[("alice", &["lab"]), ("bob", &["lab"])]);
        let part = [(&h, &u, &lab)];
        // Over by 2: bob's newer jobs go, never alice's older work.
        let (v, n) = evaluate(&part, &policy(&[("lab", 2)]), &mut Taken::default());
        assert_eq!(taken(&v), ["h: terminate 61", "h: terminate 60"]);
        assert_eq!(n, []);
        // Over by 3: then alice's most recent, e2 (her stray beside e1
        // started later, but the device was held since 1000).
        let (v, _) = evaluate(&part, &policy(&[("lab", 1)]), &mut Taken::default());
        assert_eq!(
            taken(&v),
            [
                "h: terminate 61",
                "h: terminate 60",
                "h: detach alice from 2"
            ]
        );
        // Over by all: the stray beside e1 is terminated with the detach.
        let (v, n) = evaluate(&part, &policy(&[("lab", 0)]), &mut Taken::default());
        assert_eq!(
            taken(&v)[3..],
            ["h: detach alice from 1", "h: terminate 51"]
        );
        assert_eq!(n, []);
        // Taken by her own cap already: not counted, not taken again.
        let mut done = Taken::default();
        done.detached
            .insert((h.clone(), GpuIndex(1), EnvId("e1".into())));
        done.terminated.insert((h.clone(), Pid(51)));
        let (v, _) = evaluate(&part, &policy(&[("lab", 0)]), &mut done);
        assert!(
            matches!(
                &v[0].finding,
                Finding::MaxGroupDevices {
                    devices: 3,
                    over: 3,
                    ..
                }
            ),
            "{v:?}"
        );
        assert!(!taken(&v).iter().any(|a| a.contains("from 1")), "{v:?}");
    }

    #[test]
    fn a_hosts_groups_are_its_name_services_for_the_users_it_names_or_the_recordings() {
        use crate::model::HostTruth;
        let u = usage(&[
            ("alice", vec![device(0, "a", false, false)]),
            ("bob", vec![device(1, "b", false, false)]),
            ("carol", vec![device(2, "c", false, false)]),
        ]);
        let p = policy(&[("lab", 1)]);
        let live = HostSnapshot {
            truth: Some(HostTruth {
                user_names: [(1001, "alice".to_string()), (1002, "bob".to_string())]
                    .into_iter()
                    .map(|(k, v)| (k, v.into()))
                    .collect(),
                groups: [
                    (1001, vec!["lab".to_string(), "users".to_string()]),
                    (1002, vec!["users".to_string()]),
                ]
                .into_iter()
                .collect(),
                ..HostTruth::default()
            }),
            // A recording's word is not taken on a live host.
            recorded_groups: [("carol".to_string(), vec!["lab".to_string()])]
                .into_iter()
                .collect(),
            ..HostSnapshot::default()
        };
        assert_eq!(
            HostGroups::of(&live, &u, &p),
            groups(&[("alice", &["lab"])])
        );
        let recorded = HostSnapshot {
            truth: None,
            ..live
        };
        assert_eq!(
            HostGroups::of(&recorded, &u, &p),
            groups(&[("carol", &["lab"])])
        );
    }

    proptest! {
        /// Never more detaches than the excess, each a member's device
        /// detached once (even under two groups), and the same every time.
        #[test]
        fn never_over_detaches_members_only_once_each(
            held in proptest::collection::vec((0usize..2, 0usize..3, 0u32..4, any::<bool>(), any::<bool>()), 0..16),
            member in proptest::collection::vec(any::<bool>(), 6),
            both in proptest::collection::vec(any::<bool>(), 6),
            cap_lab in 0u32..4,
            cap_ops in 0u32..4,
        ) {
            let names = ["u0", "u1", "u2"];
            let hosts = [HostId("h0".into()), HostId("h1".into())];
            let mut parts = [HostUsage::default(), HostUsage::default()];
            for (h, u, d, working, vouched) in &held {
                let entry = parts[*h].users.entry(names[*u].into()).or_default();
                if entry.devices.iter().all(|x| x.index.0 != *d) {
                    entry.devices.push(device(*d, &format!("{}-{}-{d}", h, u), *working, *vouched));
                }
            }
            let gs: Vec<HostGroups> = (0..2).map(|h| HostGroups {
                users: (0..3).filter(|u| member[h * 3 + u]).map(|u| {
                    let mut g = vec!["lab".to_string()];
                    if both[h * 3 + u] { g.push("ops".into()); }
                    (names[u].to_string(), g)
                }).collect(),
            }).collect();
            let input: Vec<_> = (0..2).map(|h| (&hosts[h], &parts[h], &gs[h])).collect();
            let p = policy(&[("lab", cap_lab), ("ops", cap_ops)]);
            let (v, _) = evaluate(&input, &p, &mut Taken::default());
            prop_assert_eq!(&evaluate(&input, &p, &mut Taken::default()).0, &v);
            let all = detaches(&v);
            let mut seen = std::collections::HashSet::new();
            for d in &all {
                prop_assert!(seen.insert(d.clone()), "detached twice: {:?}", d);
                let h: usize = d.0[1..].parse().unwrap();
                prop_assert!(gs[h].users.contains_key(&d.2), "not a member: {:?}", d);
            }
            for viol in &v {
                if let Finding::MaxGroupDevices { over, .. } = viol.finding {
                    prop_assert!(viol.actions.len() <= over);
                }
            }
        }
    }

    /// A device with its jobs' start times.
    fn started(index: u32, jobs: &[(u32, u64)]) -> HeldDevice {
        let mut d = device(index, &format!("e{index}"), true, true);
        for (p, t) in jobs {
            d.started(Pid(*p), Some(*t));
        }
        d
    }

    /// The order kept for a hold is each device's first job that runs on
    /// after what the cycle carried out, and it is put back as each
    /// device's `held_since`.
    #[test]
    fn the_held_order_is_the_first_job_that_runs_on_after_the_plan() {
        let (a, b) = (HostId("a".into()), HostId("b".into()));
        let on_a = usage(&[
            (
                "alice",
                vec![started(0, &[(1, 10), (2, 20)]), started(1, &[(3, 30)])],
            ),
            (
                "bob",
                vec![started(0, &[(4, 40)]), device(2, "idle", false, false)],
            ),
        ]);
        let on_b = usage(&[("alice", vec![started(0, &[(1, 50)])])]);
        let starts = Starts::of([(&a, &on_a), (&b, &on_b)]);
        // pid 1 ends on a (not on b), and so does bob's only job.
        let ended = [(&a, Pid(1)), (&a, Pid(4))];
        let order = starts.clone().after(ended);
        let key = |h: &HostId, u: &str, i: u32| (h.clone(), u.to_string(), GpuIndex(i));
        let want: BTreeMap<_, _> = [
            (key(&a, "alice", 0), 20),
            (key(&a, "alice", 1), 30),
            (key(&b, "alice", 0), 50),
        ]
        .into();
        assert_eq!(order, HeldOrder(want));
        assert_eq!(starts.after([]).0[&key(&a, "alice", 0)], 10);

        let mut restored = on_a.clone();
        order.restore(&a, &mut restored);
        let since = |r: &HostUsage, u: &str, k: usize| r.users[u].devices[k].held_since;
        let alices = (since(&restored, "alice", 0), since(&restored, "alice", 1));
        assert_eq!(alices, (Some(20), Some(30)));
        let bobs = (since(&restored, "bob", 0), since(&restored, "bob", 1));
        assert_eq!(bobs, (None, None));
        // restore also clears what a former order set.
        HeldOrder::default().restore(&a, &mut restored);
        assert_eq!(since(&restored, "alice", 0), None);
    }

    #[test]
    fn the_order_is_kept_from_the_cycle_a_hold_first_keeps_a_pick_back() {
        let order =
            |t: u64| HeldOrder([((HostId("a".into()), "u".to_string(), GpuIndex(0)), t)].into());
        assert_eq!(HeldOrder::kept(None, order(1), false), None);
        assert_eq!(HeldOrder::kept(Some(order(1)), order(2), false), None);
        assert_eq!(HeldOrder::kept(None, order(2), true), Some(order(2)));
        assert_eq!(
            HeldOrder::kept(Some(order(1)), order(2), true),
            Some(order(1))
        );
    }
}
