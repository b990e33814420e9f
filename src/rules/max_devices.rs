//! max-devices-per-user: caps on the devices a user holds, counted over
//! every host seen this cycle.
//!
//! Each host is summed up on its own ([`HostUsage::of`], beside the
//! host's other rules); the caps then need only those summaries.
//!
//! A user's count is the number of (host, device) pairs on which an
//! environment charged to them is attached ([`super::attribution`]: its
//! processes' user, else its record's) or a job of theirs runs, counted
//! once whatever the job carries: a member of an environment attached
//! there counts through it; a stray (a job whose environment is gone or
//! contested), a job of theirs whose environment is not attached there, a
//! job whose environment cannot be judged, and (when asked) a job outside
//! genv count by the GPUs they run on. What the rules before the cap take
//! this cycle (and carry out in it) no longer counts.
//!
//! The excess falls on the user alone, device by device ([`super::taking`]):
//! each taken device is freed of them (their environments there detached,
//! with their jobs there; their other jobs there terminated, through the
//! ladder like any action). First the devices where no job of the user
//! runs (those whose environments list no live process of the user, such
//! as a record forged in their name, before the others), then those where
//! one does; each group in genv's order (hosts as given, devices by index),
//! except that where a group cap is set the working ones go the most
//! recent first, as the group takes them ([`super::max_groups`]).
//! genv takes devices in index order only, so that attaching someone's
//! environment to spare devices would get their working device detached.
//! What cannot be freed (a job whose identity is not pinned) is reported.
//! Users are visited in name order (genv: Python set order).

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::model::{Few, HashMap};
use serde::{Deserialize, Serialize};

use super::attribution::{Attribution, Standing, Unconfirmed};
pub use super::taking::HeldDevice;
use super::taking::{self, Candidate, Taken};
use super::{Finding, Notice, Policy, Rule, Violation};
use crate::model::SMALL;
use crate::model::{Device, GpuIndex, HostId};

/// One host's part of the device caps: what each user holds there (what
/// a shard publishes, see [`super::shards`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostUsage {
    pub users: BTreeMap<String, Held>,
}

/// What one user holds on one host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Held {
    /// An environment of theirs is on the host (genv's host count).
    pub envs: bool,
    /// The devices counted toward their cap, in device order.
    pub devices: Vec<HeldDevice>,
}

impl HostUsage {
    /// What each user holds on the host `a` is about. Linear: users are
    /// keyed by borrowed names while it is worked out, and each (record,
    /// device) pair is visited once.
    /// `non_env`: the devices of their GPU jobs outside genv count too
    /// (`--count-non-env-devices`).
    pub fn of(a: &Attribution, non_env: bool) -> Self {
        let snap = a.snapshot();
        // Each user's devices, found by index.
        type Devices = Few<GpuIndex, HeldDevice>;
        let mut users: Few<Cow<str>, (bool, Devices)> = Few::default();
        for (i, e) in snap.envs.iter().enumerate() {
            let Some(u) = a.charged(i) else { continue };
            let (envs, devices) = users.get_or_insert_with(Cow::Borrowed(u), Default::default);
            *envs = true;
            let attached = a.attached(i);
            if attached.is_empty() {
                continue;
            }
            let vouched = a.vouched(i);
            for &d in attached {
                let held = devices.get_or_insert_with(d, || HeldDevice::new(d));
                held.eids.push(e.eid.clone());
                for p in a.members_on(i, d) {
                    held.pids.push(p.pid);
                    held.started(p.pid, snap.started(p));
                }
                // Only a job of one of its environments makes it working:
                // one of hers outside them (no id, or another environment's)
                // must not shield a device bob attached her record to.
                held.working |= !held.pids.is_empty();
                held.vouched |= vouched;
            }
        }
        // A contested environment counts toward each user whose jobs carry
        // its id, as it would toward the one whose it is (bob carrying
        // alice's id takes none of its devices out of her count), and is
        // never detached under a cap.
        for (i, e) in snap.envs.iter().enumerate() {
            let Some(Unconfirmed::Contested { users: carriers }) = a.uncharged(i) else {
                continue;
            };
            for u in carriers {
                let (_, devices) = users.get_or_insert_with(Cow::Borrowed(u), Default::default);
                for &d in a.attached(i) {
                    let held = devices.get_or_insert_with(d, || HeldDevice::new(d));
                    held.contested.push(e.eid.clone());
                }
            }
        }
        for (pi, p) in snap.processes.iter().enumerate() {
            let Some(user) = a.user_of(pi) else { continue };
            // Counted by the GPUs it runs on: a stray, a job whose
            // environment cannot be judged (its environ unreadable, or the
            // host's genv state garbled), a member on a device its
            // environment is not attached to, and, when asked, a job
            // outside genv. A member on its environment's devices counts
            // through the attachment.
            let standing = a.standing(pi);
            let member = match standing {
                Standing::Stray(_) | Standing::Unknown => None,
                Standing::NoEnv if non_env => None,
                Standing::NoEnv => continue,
                Standing::Member(i) => Some(*i),
            };
            let mut on = p
                .indices()
                .filter(|&d| member.is_none_or(|i| !a.is_attached(i, d)))
                .peekable();
            if on.peek().is_none() {
                continue;
            }
            let (_, devices) = users.get_or_insert_with(user, Default::default);
            for index in on {
                let held = devices.get_or_insert_with(index, || HeldDevice::new(index));
                held.working = true;
                held.stray = true;
                // Never terminated: a job whose identity is not pinned,
                // whose environ could not be read at all, or whose
                // environment cannot be judged (its host's genv state
                // unusable, which anyone can cause: a cap must never
                // pick among a user's jobs by what it cannot see).
                match (p.start_time, &p.owner, standing) {
                    (None, ..) | (_, crate::model::Owner::Unknown(_), _) => held.kept = true,
                    (.., Standing::Unknown) => {
                        held.unseen = true;
                        held.jobs.push(p.pid);
                    }
                    (Some(_), ..) => held.jobs.push(p.pid),
                }
                if member.is_some() {
                    held.off.push(p.pid);
                }
                held.started(p.pid, snap.started(p));
            }
        }
        // Devices in genv's order: as devices.json lists them (then any
        // only strays hold).
        let places = Places::of(&snap.devices);
        HostUsage {
            users: users
                .into_entries()
                .into_iter()
                .map(|(u, (envs, devices))| {
                    let mut devices: Vec<HeldDevice> =
                        devices.into_entries().into_iter().map(|(_, d)| d).collect();
                    devices.sort_by_key(|d| places.of_index(d.index).unwrap_or(usize::MAX));
                    (u.into_owned(), Held { envs, devices })
                })
                .collect(),
        }
    }
}

/// Where each device is listed in devices.json, one listed twice at its
/// last place: found by scan among a few, by hash among many (past
/// [`SMALL`]).
struct Places<'s> {
    devices: &'s [Device],
    many: Option<HashMap<GpuIndex, usize>>,
}

impl<'s> Places<'s> {
    fn of(devices: &'s [Device]) -> Self {
        let many = (devices.len() > SMALL).then(|| {
            devices
                .iter()
                .enumerate()
                .map(|(k, d)| (d.index, k))
                .collect()
        });
        Places { devices, many }
    }

    fn of_index(&self, index: GpuIndex) -> Option<usize> {
        match &self.many {
            Some(places) => places.get(&index).copied(),
            None => self.devices.iter().rposition(|d| d.index == index),
        }
    }
}

/// The caps over every host's usage (`hosts` in the order given): a
/// violation per user over their cap, with the actions that bring them
/// down, and a notice for each user whose excess cannot all be freed.
/// `taken`: what the rules before take this cycle (it no longer counts);
/// what the caps take is added to it.
pub fn evaluate(
    hosts: &[(&HostId, &HostUsage)],
    policy: &Policy,
    taken: &mut Taken,
) -> (Vec<Violation>, Vec<Notice>) {
    let mut users: BTreeMap<&str, Vec<(&HostId, &Held)>> = BTreeMap::new();
    for (host, usage) in hosts {
        for (user, held) in &usage.users {
            users.entry(user).or_default().push((host, held));
        }
    }
    let mut violations = Vec::new();
    let mut notices = Vec::new();
    for (user, held) in users {
        let Some(cap) = policy.cap_for(user) else {
            continue;
        };
        // Still held, in genv's order.
        let mut candidates: Vec<Candidate> = (held.iter())
            .flat_map(|(host, h)| h.devices.iter().map(move |d| (*host, user, d)))
            .filter(|(host, user, d)| taken.holds(host, user, d))
            .collect();
        let count = candidates.len();
        let over = count.saturating_sub(cap as usize);
        if over == 0 {
            continue;
        }
        // Turn by turn, each in genv's order (the working ones a subset of
        // what genv would take); under a group cap, the working ones in the
        // group's order (the most recent first), so that a member's own cap
        // and the group agree on which of his devices are his last.
        let grouped = !policy.max_devices_per_group.is_empty();
        candidates.sort_by_key(|(host, _, d)| {
            let turn = taken.turn(host, d);
            let recent = (grouped && turn == taking::WORKING).then(|| taken.since(host, d));
            (turn, std::cmp::Reverse(recent.flatten().unwrap_or(0)))
        });
        let (actions, freed) = taking::take_sparing(&candidates, over, taken);
        if freed < over {
            notices.push(Notice::ExcessKept {
                user: user.to_string(),
                left: over - freed,
            });
        }
        violations.push(Violation {
            rule: Rule::MaxDevicesPerUser,
            finding: Finding::MaxDevices {
                user: user.to_string(),
                devices: count,
                hosts: held
                    .iter()
                    .filter(|(_, h)| h.envs || !h.devices.is_empty())
                    .count(),
                over,
            },
            actions: actions.into(),
        });
    }
    (violations, notices)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{Cluster, HostSnapshot, Mode, Process};
    use crate::model::{EnvId, Pid};
    use crate::rules::Action;

    fn policy(global: Option<u32>, per_user: &[(&str, u32)]) -> Policy {
        Policy {
            max_devices_per_user: global,
            max_devices_for_user: per_user.iter().map(|(u, n)| (u.to_string(), *n)).collect(),
            ..Policy::default()
        }
    }

    fn host(envs: Vec<crate::model::Env>, attachments: &[(u32, &str)]) -> HostSnapshot {
        HostSnapshot {
            processes: vec![],
            envs: envs.into(),
            devices: devices(4, attachments).into(),
            truth: None,
            ..Default::default()
        }
    }

    fn live(mut s: HostSnapshot, processes: Vec<Process>) -> HostSnapshot {
        s.processes = processes;
        s.truth = Some(alice_and_bob(&[(1, 1001)]));
        s
    }

    fn job(pid: u32, eid: Option<&str>, uid: u32, gpu: u32) -> Process {
        let mut p = proc_(pid, eid, &[(gpu, mib(1))]);
        p.uid = Some(uid);
        p
    }

    /// The per-user cap's violation among `v`.
    fn user_cap(v: &[Violation]) -> &Violation {
        v.iter()
            .find(|v| v.rule == Rule::MaxDevicesPerUser)
            .expect("a cap violation")
    }

    /// A record in `user`'s name listing `pid` (bob's forgery).
    fn forged(eid: &str, user: &str, pid: i64) -> crate::model::Env {
        let mut e = env(eid, Some(user), None);
        e.pids = vec![pid];
        e
    }

    fn detached(v: &Violation) -> Vec<(String, u32, usize)> {
        v.actions
            .iter()
            .map(|a| match a {
                Action::Detach {
                    host, device, eids, ..
                } => (host.0.to_string(), device.0, eids.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// A user's devices follow devices.json, a device listed twice at its
    /// last place, among a few devices (scanned) as among many (hashed).
    #[test]
    fn held_devices_follow_the_last_place_a_device_is_listed_at() {
        for padding in [0, 13, 14, SMALL as u32] {
            // alice's environment is attached to 3 and 1, listed in that
            // order; 3 is listed again, last, with nothing attached.
            let mut order = vec![3, 1];
            order.extend(10..10 + padding);
            order.push(3);
            let listed = order.iter().enumerate().map(|(k, &i)| Device {
                index: GpuIndex(i),
                total_memory: "81559mi".into(),
                attachments: devices(1, &[(0, "a")])[0]
                    .attachments
                    .iter()
                    .filter(|_| k < 2)
                    .cloned()
                    .collect(),
            });
            let snap = HostSnapshot {
                envs: vec![env("a", Some("alice"), None)].into(),
                devices: listed.collect::<Vec<_>>().into(),
                ..Default::default()
            };
            let usage = HostUsage::of(&Attribution::of(&snap, &Default::default()), false);
            let held: Vec<u32> = usage.users["alice"]
                .devices
                .iter()
                .map(|d| d.index.0)
                .collect();
            assert_eq!(held, [1, 3], "{} devices listed", order.len());
            // Linear among many: a hash past 16 devices, not a scan each.
            let many = Places::of(&snap.devices).many.is_some();
            assert_eq!(many, order.len() > 16, "{} devices listed", order.len());
        }
    }

    #[test]
    fn over_cap_by_several_detaches_first_devices_in_order() {
        let c = local(host(
            vec![
                env("a1", Some("alice"), None),
                env("a2", Some("alice"), None),
                env("b", Some("bob"), None),
            ],
            &[(0, "a1"), (1, "a1"), (1, "a2"), (2, "a2"), (3, "b")],
        ));
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[]));
        assert_eq!(v.len(), 1);
        assert_eq!(
            v[0].finding,
            Finding::MaxDevices {
                user: "alice".into(),
                devices: 3,
                hosts: 1,
                over: 2
            }
        );
        assert_eq!(
            detached(&v[0]),
            vec![("localhost".into(), 0, 1), ("localhost".into(), 1, 2)]
        );
    }

    #[test]
    fn across_hosts_in_given_order() {
        let h1 = host(vec![env("a", Some("alice"), None)], &[(2, "a"), (3, "a")]);
        let h2 = host(vec![env("x", Some("alice"), None)], &[(0, "x")]);
        let c = Cluster {
            mode: Mode::Remote,
            hosts: vec![(HostId("h2".into()), h2), (HostId("h1".into()), h1)],
        };
        let v = crate::rules::evaluate(&c, &policy(Some(2), &[]));
        assert_eq!(
            v[0].finding,
            Finding::MaxDevices {
                user: "alice".into(),
                devices: 3,
                hosts: 2,
                over: 1
            }
        );
        assert_eq!(detached(&v[0]), vec![("h2".into(), 0, 1)]);
    }

    #[test]
    fn overrides_zero_caps_and_nameless_envs() {
        let c = local(host(
            vec![
                env("a", Some("alice"), None),
                env("b", Some("bob"), None),
                env("n", None, None),
            ],
            &[(0, "a"), (1, "b"), (2, "n"), (3, "n")],
        ));
        // bob may have 1; alice 0 by override; the nameless env is never counted.
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[("alice", 0)]));
        assert_eq!(v.len(), 1);
        assert!(
            matches!(&v[0].finding, Finding::MaxDevices { user, over: 1, .. } if user == "alice")
        );
        // Per-user caps apply without a global cap; other users are uncapped.
        let v = crate::rules::evaluate(&c, &policy(None, &[("bob", 0)]));
        assert!(matches!(&v[0].finding, Finding::MaxDevices { user, .. } if user == "bob"));
        assert!(crate::rules::evaluate(&c, &policy(None, &[])).is_empty());
        assert!(
            crate::rules::evaluate(&c, &policy(Some(0), &[("alice", 5), ("bob", 5)])).is_empty()
        );
    }

    #[test]
    fn spare_devices_go_before_the_one_a_job_runs_on() {
        // alice works on device 0; bob attached her env to 1..3 as well.
        let s = live(
            host(
                vec![env("a", Some("alice"), None)],
                &[(0, "a"), (1, "a"), (2, "a"), (3, "a")],
            ),
            vec![job(10, Some("a"), 1001, 0)],
        );
        let v = crate::rules::evaluate(&local(s), &policy(Some(2), &[]));
        assert_eq!(
            detached(&v[0]),
            vec![("localhost".into(), 1, 1), ("localhost".into(), 2, 1)]
        );
        assert!(v[0]
            .actions
            .iter()
            .all(|a| matches!(a, Action::Detach { pids, .. } if pids.is_empty())));
        // Over by all her devices: the working one goes last, with its job.
        let s = live(
            host(vec![env("a", Some("alice"), None)], &[(0, "a"), (1, "a")]),
            vec![job(10, Some("a"), 1001, 0)],
        );
        let v = crate::rules::evaluate(&local(s), &policy(Some(0), &[]));
        assert_eq!(
            v[0].actions[1],
            Action::Detach {
                host: HostId("localhost".into()),
                device: GpuIndex(0),
                eids: vec![EnvId("a".into())],
                pids: vec![Pid(10)],
                user: "alice".into(),
            }
        );
    }

    #[test]
    fn a_record_forged_in_someones_name_goes_before_their_own() {
        // alice's env lists her shell (pid 1); bob forged "f" in her name,
        // listing his own pid 2: both idle, the forged one goes first.
        let forged = forged("f", "alice", 2);
        let s = live(
            host(
                vec![env("a", Some("alice"), None), forged],
                &[(0, "a"), (1, "a"), (2, "f")],
            ),
            vec![job(10, Some("a"), 1001, 0)],
        );
        let v = crate::rules::evaluate(&local(s), &policy(Some(2), &[]));
        assert_eq!(detached(&v[0]), vec![("localhost".into(), 2, 1)]);
    }

    #[test]
    fn a_job_outside_a_devices_environments_never_shields_it() {
        // alice: env "a" on device 0 with her job 10, and job 11 without
        // an id on device 1 (cap 1, no --non-env-processes). bob forged
        // "f" in her name (listing pid 1) and attached it to device 1:
        // device 1 is idle for the cap (no job of "f" runs there), so it
        // goes, not her working device 0.
        let forged = forged("f", "alice", 1);
        let s = live(
            host(
                vec![env("a", Some("alice"), None), forged],
                &[(0, "a"), (1, "f")],
            ),
            vec![job(10, Some("a"), 1001, 0), job(11, None, 1001, 1)],
        );
        let v = crate::rules::evaluate(&local(s), &policy(Some(1), &[]));
        assert_eq!(
            v[0].actions.to_vec(),
            vec![Action::Detach {
                host: HostId("localhost".into()),
                device: GpuIndex(1),
                eids: vec![EnvId("f".into())],
                pids: vec![],
                user: "alice".into(),
            }]
        );
        // Nor does a job of another of her environments (env-devices'
        // business): "b" on device 1 goes, with no job, before device 0.
        let s = live(
            host(
                vec![env("a", Some("alice"), None), env("b", Some("alice"), None)],
                &[(0, "a"), (1, "b")],
            ),
            vec![job(10, Some("a"), 1001, 0), job(12, Some("a"), 1001, 1)],
        );
        let v = crate::rules::evaluate(&local(s), &policy(Some(1), &[]));
        let cap = user_cap(&v);
        assert_eq!(detached(cap), vec![("localhost".into(), 1, 1)]);
    }

    /// What `v` asks for, in order: "detach E from D" or "terminate P".
    fn asked(v: &Violation) -> Vec<String> {
        v.actions
            .iter()
            .map(|a| match a {
                Action::Detach { device, eids, .. } => {
                    let eids: Vec<&str> = eids.iter().map(|e| &*e.0).collect();
                    format!("detach {} from {}", eids.join(","), device.0)
                }
                Action::Terminate { pid, .. } => format!("terminate {}", pid.0),
            })
            .collect()
    }

    #[test]
    fn strays_count_toward_their_users_cap_and_are_taken_like_members() {
        // alice's nohup job on device 2 outlived its env; her new env holds 0 and 1.
        let s = live(
            host(vec![env("a", Some("alice"), None)], &[(0, "a"), (1, "a")]),
            vec![job(10, Some("gone"), 1001, 2), job(11, Some("a"), 1001, 0)],
        );
        let c = local(s);
        let v = crate::rules::evaluate(&c, &policy(Some(2), &[]));
        assert!(
            matches!(
                &v[0].finding,
                Finding::MaxDevices {
                    devices: 3,
                    over: 1,
                    ..
                }
            ),
            "{v:?}"
        );
        assert_eq!(asked(&v[0]), ["detach a from 1"], "the idle one");
        // A cap of 0: the idle one, then the working ones in genv's order
        // (the stray's device, listed in no devices.json, last): all freed.
        let (v, n) = crate::rules::assess_cluster(&c, &policy(Some(0), &[]));
        assert_eq!(
            asked(&v[0]),
            ["detach a from 1", "detach a from 0", "terminate 10"]
        );
        assert!(
            !n.iter().any(|n| matches!(n, Notice::ExcessKept { .. })),
            "{n:?}"
        );
        // One whose start time is unknown is never terminated: kept, said.
        let mut s = c.hosts[0].1.clone();
        s.processes[0].start_time = None;
        let (v, n) = crate::rules::assess_cluster(&local(s), &policy(Some(0), &[]));
        assert_eq!(asked(&v[0]), ["detach a from 1", "detach a from 0"]);
        assert!(n.contains(&Notice::ExcessKept {
            user: "alice".into(),
            left: 1
        }));
    }

    #[test]
    fn a_nameless_record_for_an_orphans_id_is_its_owners_and_the_job_is_taken() {
        // bob's job with a made-up id `x` on devices 0 and 1, seen orphaned;
        // then he writes a record for `x` naming no one, attached to both.
        let mut orphan = job(20, Some("x"), 1002, 0);
        orphan.gpus.push(crate::model::DeviceUsage {
            index: GpuIndex(1),
            usage: mib(1),
        });
        let s = live(
            host(vec![env("x", None, None)], &[(0, "x"), (1, "x")]),
            vec![orphan],
        );
        let known: crate::rules::Orphans = [(Pid(20), 1020)].into_iter().collect();
        let usage = HostUsage::of(&Attribution::of(&s, &known), false);
        let h = HostId("h".into());
        let (v, n) = evaluate(
            &[(&h, &usage)],
            &policy(Some(1), &[]),
            &mut Taken::default(),
        );
        assert!(
            matches!(&v[0].finding, Finding::MaxDevices { user, devices: 2, over: 1, .. } if user == "bob"),
            "{v:?}"
        );
        // Device 0 in genv's order: detaching it frees nothing while the
        // job runs there, so the job goes with it (device 1 stays attached).
        assert_eq!(asked(&v[0]), ["detach x from 0", "terminate 20"]);
        assert_eq!(n, []);
    }

    #[test]
    fn a_held_device_is_held_since_its_users_first_job_there_started() {
        // alice's job in `a` on device 0 (started at tick 500) and a stray
        // of hers there and on device 1 (tick 300); 100 ticks a second.
        let mut stray = job(11, Some("gone"), 1001, 0);
        stray.start_time = Some(300);
        stray.gpus.push(crate::model::DeviceUsage {
            index: GpuIndex(1),
            usage: mib(1),
        });
        let mut member = job(10, Some("a"), 1001, 0);
        member.start_time = Some(500);
        let mut s = live(
            host(vec![env("a", Some("alice"), None)], &[(0, "a")]),
            vec![member, stray],
        );
        let boot = crate::model::Boot {
            btime: 1_000,
            hz: 100,
        };
        s.truth.as_mut().unwrap().boot = Some(boot);
        let usage = HostUsage::of(&Attribution::of(&s, &Default::default()), false);
        let since: Vec<Option<u64>> = usage.users["alice"]
            .devices
            .iter()
            .map(|d| d.since)
            .collect();
        assert_eq!(
            since,
            [Some(boot.started_ms(300)), Some(boot.started_ms(300))]
        );
        // Without the stray, device 0 is held since her job started.
        s.processes.truncate(1);
        let usage = HostUsage::of(&Attribution::of(&s, &Default::default()), false);
        assert_eq!(
            usage.users["alice"].devices[0].since,
            Some(boot.started_ms(500))
        );
    }

    #[test]
    fn under_a_group_cap_the_working_devices_go_the_most_recent_first() {
        // alice's environment on 0 and 1, a job of it on each: the one on
        // device 0 started last.
        let mut older = job(11, Some("a"), 1001, 1);
        older.start_time = Some(300);
        let mut newer = job(10, Some("a"), 1001, 0);
        newer.start_time = Some(500);
        let mut s = live(
            host(vec![env("a", Some("alice"), None)], &[(0, "a"), (1, "a")]),
            vec![newer, older],
        );
        s.truth.as_mut().unwrap().boot = Some(crate::model::Boot {
            btime: 1_000,
            hz: 100,
        });
        let c = local(s);
        // genv's order alone: device 0 first.
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[]));
        assert_eq!(asked(user_cap(&v)), ["detach a from 0"]);
        // Beside a group cap (of a group she is not in): her newest, 0, as
        // well; with the start times swapped, device 1.
        let mut grouped = policy(Some(1), &[]);
        grouped.max_devices_per_group = [("lab".to_string(), 9)].into_iter().collect();
        let v = crate::rules::evaluate(&c, &grouped);
        assert_eq!(asked(user_cap(&v)), ["detach a from 0"]);
        let mut c = c;
        for p in c.hosts[0].1.processes.iter_mut() {
            p.start_time = Some(if p.pid.0 == 10 { 300 } else { 500 });
        }
        let v = crate::rules::evaluate(&c, &grouped);
        assert_eq!(asked(user_cap(&v)), ["detach a from 1"]);
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[]));
        assert_eq!(asked(user_cap(&v)), ["detach a from 0"]);
    }

    #[test]
    fn a_member_on_a_device_its_environment_lacks_counts_there_once() {
        // alice's job of `a` (attached to 0) runs on 0 and 1; with
        // env-devices off nothing else takes it: device 1 counts, and
        // freeing it terminates the job (which frees nothing else: 0 stays
        // attached).
        let s = live(
            host(vec![env("a", Some("alice"), None)], &[(0, "a")]),
            vec![{
                let mut p = job(10, Some("a"), 1001, 0);
                p.gpus.push(crate::model::DeviceUsage {
                    index: GpuIndex(1),
                    usage: mib(1),
                });
                p
            }],
        );
        let off = Policy {
            env_devices: false,
            ..policy(Some(1), &[])
        };
        let v = crate::rules::evaluate(&local(s.clone()), &off);
        let cap = user_cap(&v);
        assert!(
            matches!(
                &cap.finding,
                Finding::MaxDevices {
                    devices: 2,
                    over: 1,
                    ..
                }
            ),
            "{cap:?}"
        );
        assert_eq!(asked(cap), ["detach a from 0"], "genv's order");
        // With env-devices on, its termination frees device 1 this cycle:
        // the count is genv's, and nothing is over.
        let v = crate::rules::evaluate(&local(s), &policy(Some(1), &[]));
        assert!(v.iter().all(|v| v.rule != Rule::MaxDevicesPerUser), "{v:?}");
    }

    #[test]
    fn a_stray_beside_his_environment_never_shields_its_jobs_from_the_cap() {
        // bob's environment on 0..2, a job of it on each, and beside each
        // job a stray of his (an id of no record); device 3 idle.
        let s = live(
            host(
                vec![env("b", Some("bob"), None)],
                &[(0, "b"), (1, "b"), (2, "b"), (3, "b")],
            ),
            (0..3)
                .flat_map(|d| {
                    [
                        job(10 + d, Some("b"), 1002, d),
                        job(20 + d, Some("nope"), 1002, d),
                    ]
                })
                .collect(),
        );
        let c = local(s);
        let (v, n) = crate::rules::assess_cluster(&c, &policy(Some(1), &[]));
        let cap = user_cap(&v);
        assert!(
            matches!(
                &cap.finding,
                Finding::MaxDevices {
                    devices: 4,
                    over: 3,
                    ..
                }
            ),
            "{cap:?}"
        );
        // The idle device first, then the working ones in genv's order,
        // each freed: the environment's job there with the detach, the
        // stray beside it terminated.
        assert_eq!(
            asked(cap),
            [
                "detach b from 3",
                "detach b from 0",
                "terminate 20",
                "detach b from 1",
                "terminate 21"
            ]
        );
        let pids: Vec<Vec<Pid>> = (cap.actions.iter())
            .filter_map(|a| match a {
                Action::Detach { pids, .. } => Some(pids.clone()),
                Action::Terminate { .. } => None,
            })
            .collect();
        assert_eq!(pids, [vec![], vec![Pid(10)], vec![Pid(11)]]);
        assert!(
            !n.iter().any(|n| matches!(n, Notice::ExcessKept { .. })),
            "{n:?}"
        );
    }

    #[test]
    fn a_contested_env_counts_toward_each_carrier_and_is_never_detached() {
        // bob runs a job with alice's id on her device 0 and attaches her env
        // to 1..3: the env counts toward each of them, as toward the one
        // whose it is, and nothing of it is detached; each takes their own
        // job there, the rest of each one's excess borne where it stands.
        let s = live(
            host(
                vec![env("a", Some("alice"), None)],
                &[(0, "a"), (1, "a"), (2, "a"), (3, "a")],
            ),
            vec![job(10, Some("a"), 1001, 0), job(11, Some("a"), 1002, 0)],
        );
        let (v, n) = crate::rules::assess_cluster(&local(s.clone()), &policy(Some(0), &[]));
        for (user, pid) in [("alice", "10"), ("bob", "11")] {
            let v = v
                .iter()
                .find(|v| matches!(&v.finding, Finding::MaxDevices { user: u, devices: 4, .. } if u == user))
                .unwrap_or_else(|| panic!("{user}: {v:?}"));
            assert_eq!(asked(v), [format!("terminate {pid}")]);
            let kept = Notice::ExcessKept {
                user: user.into(),
                left: 4,
            };
            assert!(n.contains(&kept), "{n:?}");
        }
        // Within her cap but for bob's attachments, his contest costs her
        // nothing: the idle devices bear her excess; his job is his.
        let (v, _) = crate::rules::assess_cluster(&local(s), &policy(Some(1), &[("bob", 0)]));
        let acts: Vec<Vec<String>> = v.iter().map(asked).collect();
        assert_eq!(acts, [vec![], vec!["terminate 11".to_string()]], "{v:?}");
    }

    #[test]
    fn a_contested_env_counts_toward_none_of_a_groups_members() {
        // alice's id, carried by her job on 0 and by bob's on 1, attached to
        // 0..3: the lab counts each one's job, not the id once per carrier.
        let mut s = live(
            host(
                vec![env("a", Some("alice"), None)],
                &[(0, "a"), (1, "a"), (2, "a"), (3, "a")],
            ),
            vec![job(10, Some("a"), 1001, 0), job(11, Some("a"), 1002, 1)],
        );
        let truth = s.truth.as_mut().expect("live");
        truth.groups = [(1001, vec!["lab".into()]), (1002, vec!["lab".into()])].into();
        let lab = Policy {
            max_devices_per_group: [("lab".to_string(), 1)].into(),
            ..Policy::default()
        };
        let (v, n) = crate::rules::assess_cluster(&local(s), &lab);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            matches!(
                v[0].finding,
                Finding::MaxGroupDevices {
                    devices: 2,
                    over: 1,
                    ..
                }
            ),
            "{v:?}"
        );
        // One job goes (its own device freed), and that brings it down.
        assert_eq!(asked(&v[0]).len(), 1, "{v:?}");
        assert!(
            n.iter()
                .all(|n| !matches!(n, Notice::GroupExcessKept { .. })),
            "{n:?}"
        );
    }

    #[test]
    fn hosts_counted_are_those_with_her_environments_or_her_devices() {
        // h1: her env with two devices; h2: her env, no device; h3: her
        // stray's device only; h4: nothing of hers.
        let h1 = host(vec![env("a", Some("alice"), None)], &[(0, "a"), (1, "a")]);
        let h2 = host(vec![env("b", Some("alice"), None)], &[]);
        let h3 = live(host(vec![], &[]), vec![job(10, Some("gone"), 1001, 2)]);
        let h4 = host(vec![env("c", Some("bob"), None)], &[(0, "c")]);
        let c = Cluster {
            mode: Mode::Remote,
            hosts: [("h1", h1), ("h2", h2), ("h3", h3), ("h4", h4)]
                .into_iter()
                .map(|(n, s)| (HostId(n.into()), s))
                .collect(),
        };
        let v = crate::rules::evaluate(&c, &policy(Some(1), &[]));
        assert_eq!(
            v[0].finding,
            Finding::MaxDevices {
                user: "alice".into(),
                devices: 3,
                hosts: 3,
                over: 2
            }
        );
    }
}
