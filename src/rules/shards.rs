//! The per-user device caps across shards (`--shard K/N`): each shard
//! enforces its own hosts, publishes what each user holds there
//! ([`Published`]), and counts the others' published parts beside its own.
//!
//! Every shard lays all hosts out in the one global order (their places in
//! the whole inventory), so all that read the same parts pick the same
//! devices; each carries out only the detaches on its own hosts. A shard
//! whose part is gone (its lease ended) counts as unseen hosts do: its
//! users' counts go down, never up.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::max_devices::HostUsage;
use super::{Action, Violation};
use crate::model::{EnvId, GpuIndex, HostId, Pid};

/// One host's part of the caps, as its shard publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Published {
    pub host: HostId,
    /// Its place in the whole inventory.
    pub position: usize,
    pub usage: HostUsage,
    /// Its genv state unusable long enough to be judged blind
    /// ([`super::taking::Taken::blind`]): every shard orders its unseen
    /// jobs alike.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub blind: bool,
    /// Its shard held back this cycle what only the device caps ask for,
    /// a pick of theirs waiting on one of its hosts gone unseen
    /// ([`crate::ladder::Ladder::hold_caps`]): the other shards hold
    /// theirs too, their next cycle, so that no shard carries out its
    /// share of a cap's picks ahead of the rest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
}

/// What a shard's waiting actions on one of its hosts free at their
/// deadline (and what it carries out now): its processes terminated, its
/// (device, environment) pairs detached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Soon {
    pub terminated: HashSet<Pid>,
    pub detached: HashSet<(GpuIndex, EnvId)>,
}

impl Published {
    /// Marks each device whose jobs, member processes or environments
    /// `soon` ends all of ([`super::taking::SoonHere`]): the other shards,
    /// which do not know our waits, then give it the turn we give it
    /// (a device whose jobs end at their deadline is taken first), and
    /// so pick what we pick.
    #[must_use]
    pub fn mark_soon(mut self, soon: &Soon) -> Published {
        for held in self.usage.users.values_mut() {
            for d in &mut held.devices {
                let all = |pids: &[Pid]| {
                    !pids.is_empty() && pids.iter().all(|p| soon.terminated.contains(p))
                };
                d.soon = super::taking::SoonHere {
                    jobs: all(&d.jobs),
                    pids: all(&d.pids),
                    eids: !d.eids.is_empty()
                        && (d.eids.iter()).all(|e| soon.detached.contains(&(d.index, e.clone()))),
                };
            }
        }
        self
    }

    /// What it holds once the `detached` (device, environment) pairs of
    /// its host are gone and its `terminated` processes have ended: a
    /// device none of a user's environments holds any more and no job of
    /// theirs runs on no longer counts (the other shards' next cycle must
    /// not take a second time what this one freed).
    #[must_use]
    pub fn without(
        mut self,
        detached: &HashSet<(GpuIndex, EnvId)>,
        terminated: &HashSet<Pid>,
    ) -> Published {
        for held in self.usage.users.values_mut() {
            for d in &mut held.devices {
                d.eids.retain(|e| !detached.contains(&(d.index, e.clone())));
                let before = (d.pids.len(), d.jobs.len());
                d.pids.retain(|p| !terminated.contains(p));
                d.jobs.retain(|p| !terminated.contains(p));
                if (d.pids.len(), d.jobs.len()) != before {
                    d.stray = d.kept || !d.jobs.is_empty();
                    d.working = d.stray || !d.pids.is_empty();
                }
            }
            held.devices
                .retain(|d| !d.eids.is_empty() || !d.contested.is_empty() || d.stray);
        }
        self
    }

    /// What counting needs of it, as a shard publishes it: each device's
    /// environments and processes are not (a user may write a great many
    /// eids; only whether there is one counts), one placeholder stands
    /// for them: the eid `""`, and for the processes a pid no process has,
    /// its own to each device (taking one device of another shard's host
    /// must never count its other devices as freed).
    #[must_use]
    pub fn compact(mut self) -> Published {
        // Only users holding devices count for the others.
        self.usage.users.retain(|_, held| !held.devices.is_empty());
        for held in self.usage.users.values_mut() {
            for d in &mut held.devices {
                if !d.eids.is_empty() {
                    d.eids = smallvec::smallvec![EnvId("".into())];
                }
                if !d.contested.is_empty() {
                    d.contested = smallvec::smallvec![EnvId("".into())];
                }
                // Never a real pid (they stay below 2^22): only counted,
                // never taken here.
                let placeholder = crate::model::Pid(u32::MAX - d.index.0);
                if !d.pids.is_empty() {
                    d.pids = smallvec::smallvec![placeholder];
                }
                if !d.jobs.is_empty() {
                    d.jobs = smallvec::smallvec![placeholder];
                }
            }
        }
        self
    }
}

impl Published {
    /// The part without what only a record says (a user's idle devices
    /// whose records list no live process of theirs: anyone can write
    /// those, in any number, under any name), for a part too large to
    /// publish whole: what jobs hold, which the kernel bounds, still
    /// counts everywhere.
    #[must_use]
    pub fn reduced(mut self) -> Published {
        for held in self.usage.users.values_mut() {
            held.devices
                .retain(|d| d.working || d.vouched || d.stray || d.kept);
        }
        self.usage.users.retain(|_, held| !held.devices.is_empty());
        self
    }
}

/// What a shard knows of the others this cycle.
#[derive(Debug, Clone, Copy)]
pub struct Shards<'a> {
    /// Our hosts' places in the whole inventory.
    pub positions: &'a HashMap<HostId, usize>,
    /// The other shards' hosts, as they last published them.
    pub others: &'a [Published],
}

impl<'a> Shards<'a> {
    /// Every host's usage in the global order: ours (this cycle's) and the
    /// others' (a host we hold ourselves is never taken from them).
    pub fn in_order(
        &self,
        ours: &[(&'a HostId, &'a HostUsage)],
    ) -> Vec<(&'a HostId, &'a HostUsage)> {
        // Each host once: ours first, then the first part naming it.
        let mut seen: HashSet<&HostId> = ours.iter().map(|(h, _)| *h).collect();
        let mut all: Vec<(usize, &HostId, &HostUsage)> = ours
            .iter()
            .map(|(h, u)| {
                (
                    self.positions.get(*h).copied().unwrap_or(usize::MAX),
                    *h,
                    *u,
                )
            })
            .collect();
        for p in self.others {
            if seen.insert(&p.host) {
                all.push((p.position, &p.host, &p.usage));
            }
        }
        all.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        all.into_iter().map(|(_, h, u)| (h, u)).collect()
    }

    /// Leaves in `violations` only the actions on our hosts: the others
    /// carry out theirs.
    pub fn ours_only(&self, violations: &mut [Violation]) {
        for v in violations {
            v.actions.retain(|a| match a {
                Action::Detach { host, .. } | Action::Terminate { host, .. } => {
                    self.positions.contains_key(host)
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvId, GpuIndex};
    use crate::rules::max_devices::{self, Held, HeldDevice};
    use crate::rules::{Policy, Rule};

    fn usage(user: &str, devices: &[(u32, bool)]) -> HostUsage {
        let held = Held {
            envs: true,
            devices: devices
                .iter()
                .map(|&(i, working)| HeldDevice {
                    index: GpuIndex(i),
                    eids: smallvec::smallvec![EnvId(format!("{user}-{i}").into())],
                    pids: smallvec::smallvec![],
                    jobs: smallvec::smallvec![],
                    contested: smallvec::smallvec![],
                    working,
                    stray: false,
                    kept: false,
                    unseen: false,
                    vouched: working,
                    since: None,
                    off: smallvec::smallvec![],
                    starts: smallvec::smallvec![],
                    held_since: None,
                    soon: Default::default(),
                })
                .collect(),
        };
        HostUsage {
            users: [(user.to_string(), held)].into_iter().collect(),
        }
    }

    fn h(s: &str) -> HostId {
        HostId(s.into())
    }

    /// The detaches shard `own` (hosts at these places) carries out when
    /// the fleet is `fleet` (host, place, usage) and alice's cap is 2.
    fn detaches(fleet: &[(&str, usize, HostUsage)], own: &[&str]) -> Vec<(String, u32)> {
        let positions: HashMap<HostId, usize> = fleet
            .iter()
            .filter(|(n, _, _)| own.contains(n))
            .map(|(n, p, _)| (h(n), *p))
            .collect();
        let ids: Vec<HostId> = fleet.iter().map(|(n, _, _)| h(n)).collect();
        let ours: Vec<(&HostId, &HostUsage)> = fleet
            .iter()
            .zip(&ids)
            .filter(|((n, _, _), _)| own.contains(n))
            .map(|((_, _, u), id)| (id, u))
            .collect();
        let others: Vec<Published> = fleet
            .iter()
            .filter(|(n, _, _)| !own.contains(n))
            .map(|(n, p, u)| Published {
                host: h(n),
                position: *p,
                usage: u.clone(),
                blind: false,
                held: false,
            })
            .collect();
        let shards = Shards {
            positions: &positions,
            others: &others,
        };
        let all = shards.in_order(&ours);
        let policy = Policy {
            max_devices_per_user: Some(2),
            ..Policy::default()
        };
        let (mut v, _) = max_devices::evaluate(&all, &policy, &mut Default::default());
        shards.ours_only(&mut v);
        assert!(v.iter().all(|v| v.rule == Rule::MaxDevicesPerUser));
        v.iter()
            .flat_map(|v| &v.actions)
            .map(|a| match a {
                Action::Detach { host, device, .. } => (host.0.to_string(), device.0),
                Action::Terminate { .. } => unreachable!(),
            })
            .collect()
    }

    #[test]
    fn two_shards_detach_the_one_global_excess_between_them_each_its_own_part() {
        // alice: working devices on h1..h4 and an idle one on h4; cap 2.
        let fleet = [
            ("h1", 0, usage("alice", &[(0, true)])),
            ("h2", 1, usage("alice", &[(0, true)])),
            ("h3", 2, usage("alice", &[(0, true)])),
            ("h4", 3, usage("alice", &[(0, true), (1, false)])),
        ];
        let one = detaches(&fleet, &["h1", "h3"]);
        let two = detaches(&fleet, &["h2", "h4"]);
        // The one box's choice: the idle device first, then genv's order.
        let whole = detaches(&fleet, &["h1", "h2", "h3", "h4"]);
        assert_eq!(
            whole,
            [("h4".into(), 1), ("h1".into(), 0), ("h2".into(), 0)]
        );
        assert_eq!(one, [("h1".to_string(), 0)]);
        assert_eq!(two, [("h4".to_string(), 1), ("h2".to_string(), 0)]);
    }

    #[test]
    fn a_gone_shard_counts_as_unseen_and_our_own_hosts_win_over_what_others_say() {
        let fleet = [
            ("h1", 0, usage("alice", &[(0, true)])),
            ("h2", 1, usage("alice", &[(0, true), (1, true)])),
        ];
        // h2's shard is gone: alice holds 1 as far as shard one knows.
        assert!(detaches(&fleet[..1], &["h1"]).is_empty());
        // Another shard claiming our host is not counted twice.
        let positions: HashMap<HostId, usize> = [(h("h1"), 0)].into_iter().collect();
        let mine = usage("alice", &[(0, true)]);
        let others = [Published {
            host: h("h1"),
            position: 0,
            usage: usage("alice", &[(0, true), (1, true), (2, true)]),
            blind: false,
            held: false,
        }];
        let shards = Shards {
            positions: &positions,
            others: &others,
        };
        let id = h("h1");
        assert_eq!(shards.in_order(&[(&id, &mine)]), vec![(&id, &mine)]);
        // Two other shards naming one host (at two places): counted once.
        let twice = [
            Published {
                host: h("h9"),
                position: 5,
                usage: usage("alice", &[(0, true)]),
                blind: false,
                held: false,
            },
            Published {
                host: h("h9"),
                position: 1,
                usage: usage("alice", &[(1, true)]),
                blind: false,
                held: false,
            },
        ];
        let shards = Shards {
            positions: &positions,
            others: &twice,
        };
        let all = shards.in_order(&[(&id, &mine)]);
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].1, &twice[0].usage);
    }

    #[test]
    fn what_is_detached_is_not_published_and_eids_and_pids_are_left_out() {
        let mut u = usage("alice", &[(0, true), (1, false)]);
        u.users.get_mut("alice").unwrap().devices[0].pids =
            smallvec::smallvec![crate::model::Pid(7)];
        let p = Published {
            host: h("h1"),
            position: 0,
            usage: u,
            blind: false,
            held: false,
        };
        let gone: HashSet<(GpuIndex, EnvId)> = [
            (GpuIndex(1), EnvId("alice-1".into())),
            (GpuIndex(0), EnvId("x".into())),
        ]
        .into_iter()
        .collect();
        let left = p.clone().without(&gone, &HashSet::new());
        let devices = &left.usage.users["alice"].devices;
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].index, GpuIndex(0));
        let small = left.compact();
        let d = &small.usage.users["alice"].devices[0];
        assert_eq!(d.eids[..], [EnvId("".into())], "a placeholder, not the eid");
        assert_eq!(
            d.pids[..],
            [crate::model::Pid(u32::MAX)],
            "a placeholder, not the pid"
        );
        assert!(d.working);
        // A stray keeps its device counted whatever is detached, and one
        // with no environment left publishes none.
        let mut stray = p;
        stray.usage.users.get_mut("alice").unwrap().devices[1].stray = true;
        let kept = stray.without(&gone, &HashSet::new()).compact();
        let devices = &kept.usage.users["alice"].devices;
        assert_eq!(devices.len(), 2);
        assert!(devices[1].eids.is_empty() && devices[1].stray);
    }

    #[test]
    fn what_is_terminated_is_not_published_but_a_job_left_running_is() {
        // alice: on 0, her environment and a job of it; on 1 only strays
        // of hers (7, 8); on 2 a stray (9) and a job never terminated.
        let mut u = usage("alice", &[(0, true), (1, true), (2, true)]);
        let d = &mut u.users.get_mut("alice").unwrap().devices;
        d[0].pids = smallvec::smallvec![Pid(5), Pid(6)];
        (d[1].eids, d[1].jobs, d[1].stray) = (
            smallvec::smallvec![],
            smallvec::smallvec![Pid(7), Pid(8)],
            true,
        );
        (d[2].eids, d[2].jobs, d[2].stray, d[2].kept) = (
            smallvec::smallvec![],
            smallvec::smallvec![Pid(9)],
            true,
            true,
        );
        let p = Published {
            host: h("h1"),
            position: 0,
            usage: u,
            blind: false,
            held: false,
        };
        let none = HashSet::new();
        let ended = |pids: &[u32]| -> HashSet<Pid> { pids.iter().map(|&p| Pid(p)).collect() };
        let indices = |p: &Published| -> Vec<u32> {
            p.usage.users.get("alice").map_or(Vec::new(), |h| {
                h.devices.iter().map(|d| d.index.0).collect()
            })
        };
        // One of the two strays on 1 ended, and one of the two jobs on 0:
        // both still count, and work.
        let one = p.clone().without(&none, &ended(&[5, 7]));
        assert_eq!(indices(&one), [0, 1, 2]);
        assert!(one.usage.users["alice"].devices.iter().all(|d| d.working));
        // Both: 1 no longer counts; 0 keeps its attachment, and 2 its job
        // that is never terminated.
        let left = p.clone().without(&none, &ended(&[5, 6, 7, 8, 9]));
        assert_eq!(indices(&left), [0, 2]);
        let devices = &left.usage.users["alice"].devices;
        assert!(!devices[0].working && devices[0].pids.is_empty());
        assert!(devices[1].stray && devices[1].kept);
    }

    #[test]
    fn a_contested_environments_device_stays_in_the_part_and_compacts_to_one() {
        // alice's stray on 0 carries an id bob's jobs carry too, attached
        // there under two records: her job ended, the device still counts
        // (never detached for a cap), published as one placeholder.
        let mut u = usage("alice", &[]);
        u.users.get_mut("alice").unwrap().devices.push(HeldDevice {
            contested: smallvec::smallvec![EnvId("x".into()), EnvId("y".into())],
            jobs: smallvec::smallvec![crate::model::Pid(50)],
            working: true,
            stray: true,
            ..HeldDevice::new(GpuIndex(0))
        });
        let p = Published {
            host: h("h9"),
            position: 0,
            usage: u,
            blind: false,
            held: false,
        };
        let ended: HashSet<crate::model::Pid> = [crate::model::Pid(50)].into();
        let left = p.without(&HashSet::new(), &ended).compact();
        let d = &left.usage.users["alice"].devices;
        assert_eq!(d.len(), 1, "{left:?}");
        assert_eq!(d[0].contested.len(), 1);
        assert!(!d[0].working && d[0].jobs.is_empty());
    }

    #[test]
    fn another_shards_waits_give_its_devices_the_turn_they_have_there() {
        // h9 (the other shard's): alice's stray on 0, whose termination
        // waits there, and her job on 1, which nothing ends; h1 (ours,
        // first in the inventory): her job on 0. Cap 2 of 3: without what
        // h9's shard waits on, genv's order takes ours; with it, both
        // shards take the device h9's wait frees anyway, so ours stays.
        let mut theirs = usage("alice", &[]);
        let held = theirs.users.get_mut("alice").unwrap();
        for (i, pid) in [(0, 50), (1, 51)] {
            held.devices.push(HeldDevice {
                jobs: smallvec::smallvec![crate::model::Pid(pid)],
                working: true,
                stray: true,
                ..HeldDevice::new(GpuIndex(i))
            });
        }
        let part = Published {
            host: h("h9"),
            position: 1,
            usage: theirs,
            blind: false,
            held: false,
        };
        let soon = Soon {
            terminated: [crate::model::Pid(50)].into(),
            detached: HashSet::new(),
        };
        let marked = part.clone().mark_soon(&soon).compact();
        let flags: Vec<bool> = marked.usage.users["alice"]
            .devices
            .iter()
            .map(|d| d.soon.jobs)
            .collect();
        assert_eq!(flags, [true, false], "compacted, each device keeps its own");
        let mut mine = usage("alice", &[(0, true)]);
        mine.users.get_mut("alice").unwrap().devices[0].pids =
            smallvec::smallvec![crate::model::Pid(7)];
        let id = h("h1");
        let positions: HashMap<HostId, usize> = [(id.clone(), 0)].into_iter().collect();
        let policy = Policy {
            max_devices_per_user: Some(2),
            ..Policy::default()
        };
        let ours = |part: Published| {
            let others = [part];
            let shards = Shards {
                positions: &positions,
                others: &others,
            };
            let all = shards.in_order(&[(&id, &mine)]);
            let (mut v, _) = max_devices::evaluate(&all, &policy, &mut Default::default());
            shards.ours_only(&mut v);
            v.iter().map(|v| v.actions.len()).sum::<usize>()
        };
        assert_eq!(ours(part.compact()), 1, "ours: the detach");
        assert_eq!(ours(marked), 0);
    }

    #[test]
    fn another_shards_working_and_stray_devices_stay_so_once_compacted() {
        // h9 (the other shard's): alice's job in her environment on 0,
        // strays of hers alone on 1 and 2; h1 (ours): her idle device 3.
        let mut theirs = usage("alice", &[(0, true)]);
        let held = theirs.users.get_mut("alice").unwrap();
        held.devices[0].pids = smallvec::smallvec![crate::model::Pid(40)];
        for i in [1, 2] {
            held.devices.push(HeldDevice {
                index: GpuIndex(i),
                eids: smallvec::smallvec![],
                pids: smallvec::smallvec![],
                jobs: smallvec::smallvec![crate::model::Pid(50)],
                contested: smallvec::smallvec![],
                working: true,
                stray: true,
                kept: false,
                unseen: false,
                vouched: false,
                since: None,
                off: smallvec::smallvec![],
                starts: smallvec::smallvec![],
                held_since: None,
                soon: Default::default(),
            });
        }
        let others = [Published {
            host: h("h9"),
            position: 0,
            usage: theirs,
            blind: false,
            held: false,
        }
        .compact()];
        let (id, mine) = (h("h1"), usage("alice", &[(3, false)]));
        let positions: HashMap<HostId, usize> = [(id.clone(), 1)].into_iter().collect();
        let shards = Shards {
            positions: &positions,
            others: &others,
        };
        let all = shards.in_order(&[(&id, &mine)]);
        // Cap 2, 4 held: ours (idle) goes first; then the other shard's
        // in order, each counted freed alone (the placeholder is each
        // device's own): one more, on h9 device 0.
        let policy = Policy {
            max_devices_per_user: Some(2),
            ..Policy::default()
        };
        let (mut v, n) = max_devices::evaluate(&all, &policy, &mut Default::default());
        assert_eq!(n, []);
        let hosts: Vec<String> = v[0]
            .actions
            .iter()
            .map(|a| match a {
                Action::Detach { host, device, .. } => format!("{}:{}", host.0, device.0),
                Action::Terminate { host, pid } => format!("{}:pid {}", host.0, pid.0),
            })
            .collect();
        assert_eq!(hosts, ["h1:3", "h9:0"], "{v:?}");
        shards.ours_only(&mut v);
        assert_eq!(v[0].actions.len(), 1);
    }

    #[test]
    fn a_reduced_part_keeps_what_jobs_hold_and_only_users_holding_devices() {
        // alice: a working device and an idle unvouched one; bob's many
        // forged names: idle, unvouched; carol: an environment, no device.
        let mut u = usage("alice", &[(0, true), (1, false)]);
        for k in 0..100 {
            let forged = usage(&format!("f{k}"), &[(2, false)]);
            u.users.extend(forged.users);
        }
        u.users.insert("carol".into(), Default::default());
        let p = Published {
            host: h("h1"),
            position: 0,
            usage: u,
            blind: false,
            held: false,
        };
        let whole = p.clone().compact();
        assert_eq!(whole.usage.users.len(), 101, "carol holds nothing");
        let reduced = whole.reduced();
        assert_eq!(
            reduced.usage.users.keys().collect::<Vec<_>>(),
            ["alice"],
            "what only records say is left out"
        );
        assert_eq!(reduced.usage.users["alice"].devices.len(), 1);
        assert!(reduced.usage.users["alice"].devices[0].working);
    }

    #[test]
    fn what_a_shard_publishes_reads_back_and_refuses_unknown_fields() {
        let p = Published {
            host: h("gpu7"),
            position: 6,
            usage: usage("bob", &[(3, false)]),
            blind: false,
            held: false,
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<Published>(&json).unwrap(), p);
        let extra = json.replacen('{', "{\"x\":1,", 1);
        assert!(serde_json::from_str::<Published>(&extra).is_err());
    }
}
