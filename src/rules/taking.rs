//! Taking devices under a device cap (per user, per group): what the rules
//! before a cap take this cycle, and the actions that free a held device
//! from its user's count: a detach of their environments there (with
//! their jobs there) and the termination of their other jobs there
//! (strays, jobs of environments not attached there, counted jobs outside
//! genv). Devices are taken in the order given until enough no longer
//! count; a job on several devices frees each of them it alone held.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::model::{EnvId, GpuIndex, HashMap, HostId, Pid};

use super::{Action, Violation, Withheld};

/// A device counted toward a user's cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldDevice {
    pub index: GpuIndex,
    /// The user's environments attached here, detached together (nearly
    /// always one).
    pub eids: SmallVec<[EnvId; 1]>,
    /// Their member processes here, terminated with the detach.
    pub pids: SmallVec<[Pid; 2]>,
    /// The user's other jobs here, counted by the GPUs they run on (strays,
    /// jobs of environments not attached here, jobs whose environment
    /// cannot be judged, counted jobs outside genv): terminated to free it.
    #[serde(default, skip_serializing_if = "SmallVec::is_empty")]
    pub jobs: SmallVec<[Pid; 2]>,
    /// A job of one of those environments runs here (or another job of
    /// the user's).
    pub working: bool,
    /// Another job of the user's runs here (`jobs`, or one that cannot be
    /// terminated).
    pub stray: bool,
    /// A job of the user's that is never terminated runs here (its
    /// identity not pinned, or its environ unreadable): the device stays
    /// counted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kept: bool,
    /// One of the environments lists a live pid of the user
    /// ([`super::attribution::Attribution::vouched`]).
    pub vouched: bool,
    /// When the first of the user's jobs here started (ms since the Unix
    /// epoch, comparable across hosts), if any did and it is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<u64>,
}

impl HeldDevice {
    pub(super) fn new(index: GpuIndex) -> Self {
        HeldDevice {
            index,
            eids: SmallVec::new(),
            pids: SmallVec::new(),
            jobs: SmallVec::new(),
            working: false,
            stray: false,
            kept: false,
            vouched: false,
            since: None,
        }
    }

    /// A job started at `started` runs here.
    pub(super) fn started(&mut self, started: Option<u64>) {
        if let Some(t) = started {
            self.since = Some(self.since.map_or(t, |s| s.min(t)));
        }
    }
}

/// What is taken this cycle: detached (host, device, environment) and
/// terminated (host, pid), only what is carried out in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    pub detached: HashSet<(HostId, GpuIndex, EnvId)>,
    pub terminated: HashSet<(HostId, Pid)>,
}

impl Taken {
    /// What `violations` take this cycle, less what `withheld` keeps
    /// waiting (a detach any of whose environments waits terminates none
    /// of its processes).
    pub fn of(violations: &[Violation], withheld: &Withheld) -> Self {
        let mut taken = Taken::default();
        taken.add(violations, withheld);
        taken
    }

    /// Adds what `violations` take, as [`Taken::of`].
    pub fn add(&mut self, violations: &[Violation], withheld: &Withheld) {
        for a in violations.iter().flat_map(|v| &v.actions) {
            match a {
                Action::Terminate { host, pid } => {
                    let t = (host.clone(), *pid);
                    if !withheld.terminations.contains(&t) {
                        self.terminated.insert(t);
                    }
                }
                Action::Detach {
                    host,
                    device,
                    eids,
                    pids,
                    ..
                } => {
                    let mut waits = false;
                    for e in eids {
                        let d = (host.clone(), *device, e.clone());
                        if withheld.detaches.contains(&d) {
                            waits = true;
                        } else {
                            self.detached.insert(d);
                        }
                    }
                    if !waits {
                        self.terminated
                            .extend(pids.iter().map(|p| (host.clone(), *p)));
                    }
                }
            }
        }
    }

    /// The user's jobs on `d` that run on after what is taken.
    fn running<'d>(
        &'d self,
        host: &'d HostId,
        d: &'d HeldDevice,
    ) -> impl Iterator<Item = Pid> + 'd {
        (d.jobs.iter())
            .filter(move |p| !self.terminated.contains(&(host.clone(), **p)))
            .copied()
    }

    /// The environments of `d` still attached after what is taken.
    fn attached<'d>(
        &'d self,
        host: &'d HostId,
        d: &'d HeldDevice,
    ) -> impl Iterator<Item = &'d EnvId> + 'd {
        (d.eids.iter()).filter(move |e| {
            !self
                .detached
                .contains(&(host.clone(), d.index, (*e).clone()))
        })
    }

    /// Whether `d` still counts toward its user after what is taken.
    pub fn holds(&self, host: &HostId, d: &HeldDevice) -> bool {
        d.kept || self.attached(host, d).next().is_some() || self.running(host, d).next().is_some()
    }

    /// Its turn among a cap's devices: idle ones first (no job of the user
    /// runs there), unvouched (0) before vouched (1); then the working
    /// ones (2); last (3) those a job that cannot be terminated holds (its
    /// identity not pinned), whose count stays.
    pub fn turn(&self, host: &HostId, d: &HeldDevice) -> u8 {
        if d.kept {
            3
        } else if !d.pids.is_empty() || self.running(host, d).next().is_some() {
            2
        } else if d.vouched {
            1
        } else {
            0
        }
    }
}

/// A device a cap may take: its host, its user, what they hold there.
pub type Candidate<'a> = (&'a HostId, &'a str, &'a HeldDevice);

/// Takes `candidates` (each still held, in the order to take them) until
/// `over` of them no longer count, recording what is taken in `taken`:
/// the actions, and how many were freed (fewer than `over` when what is
/// left cannot be freed).
pub fn take(candidates: &[Candidate], over: usize, taken: &mut Taken) -> (Vec<Action>, usize) {
    let mut by_job: HashMap<(&HostId, Pid), Vec<usize>> = HashMap::default();
    for (k, (host, _, d)) in candidates.iter().enumerate() {
        for p in d.jobs.iter().chain(&d.pids) {
            by_job.entry((host, *p)).or_default().push(k);
        }
    }
    let mut free = vec![false; candidates.len()];
    let mut freed = 0;
    let mut actions = Vec::new();
    for k in 0..candidates.len() {
        if freed >= over {
            break;
        }
        if free[k] {
            continue;
        }
        let (host, user, d) = candidates[k];
        let eids: Vec<EnvId> = taken.attached(host, d).cloned().collect();
        let jobs: Vec<Pid> = taken.running(host, d).collect();
        let mut touched = vec![k];
        if !eids.is_empty() {
            for e in &eids {
                taken.detached.insert((host.clone(), d.index, e.clone()));
            }
            for p in &d.pids {
                taken.terminated.insert((host.clone(), *p));
                touched.extend(by_job.get(&(host, *p)).into_iter().flatten());
            }
            actions.push(Action::Detach {
                host: host.clone(),
                device: d.index,
                eids,
                pids: d.pids.to_vec(),
                user: user.to_string(),
            });
        }
        for p in jobs {
            taken.terminated.insert((host.clone(), p));
            touched.extend(by_job.get(&(host, p)).into_iter().flatten());
            actions.push(Action::Terminate {
                host: host.clone(),
                pid: p,
            });
        }
        for j in touched {
            let (h, _, dj) = candidates[j];
            if !free[j] && !taken.holds(h, dj) {
                free[j] = true;
                freed += 1;
            }
        }
    }
    (actions, freed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Finding, Rule};

    #[test]
    fn what_other_rules_terminate_is_every_terminated_pid_and_every_detachs_processes() {
        let h = HostId("h".into());
        let v = Violation {
            rule: Rule::EnvMemory,
            finding: Finding::MaxDevices {
                user: "a".into(),
                devices: 1,
                hosts: 1,
                over: 1,
            },
            actions: smallvec::smallvec![
                Action::Terminate {
                    host: h.clone(),
                    pid: Pid(1),
                },
                Action::Detach {
                    host: h.clone(),
                    device: crate::model::GpuIndex(0),
                    eids: vec![],
                    pids: vec![Pid(2), Pid(3)],
                    user: "a".into(),
                },
            ],
        };
        let t = Taken::of(std::slice::from_ref(&v), &Withheld::default()).terminated;
        assert_eq!(t.len(), 3);
        assert!(t.contains(&(h.clone(), Pid(3))));
        // What waits frees nothing: the termination, or the detach.
        let mut held = Withheld::default();
        held.terminations.insert((h.clone(), Pid(1)));
        let t = Taken::of(std::slice::from_ref(&v), &held).terminated;
        assert_eq!(t.len(), 2);
        assert!(!t.contains(&(h.clone(), Pid(1))));
        held.detaches.insert((
            h.clone(),
            crate::model::GpuIndex(0),
            crate::model::EnvId("e".into()),
        ));
        assert_eq!(
            Taken::of(std::slice::from_ref(&v), &held).terminated.len(),
            2,
            "no eid held"
        );
        let mut v = v;
        if let Action::Detach { eids, .. } = &mut v.actions[1] {
            eids.push(crate::model::EnvId("e".into()));
        }
        assert!(Taken::of(&[v], &held).terminated.is_empty());
    }

    #[test]
    fn what_waits_is_not_taken() {
        let h = HostId("h".into());
        let v = Violation {
            rule: Rule::MaxDevicesPerUser,
            finding: Finding::MaxDevices {
                user: "bob".into(),
                devices: 2,
                hosts: 1,
                over: 2,
            },
            actions: smallvec::smallvec![
                Action::Terminate {
                    host: h.clone(),
                    pid: Pid(1),
                },
                Action::Terminate {
                    host: h.clone(),
                    pid: Pid(2),
                },
                Action::Detach {
                    host: h.clone(),
                    device: GpuIndex(0),
                    eids: vec![EnvId("a".into()), EnvId("b".into())],
                    pids: vec![Pid(3)],
                    user: "bob".into(),
                },
            ],
        };
        let all = Taken::of(std::slice::from_ref(&v), &Withheld::default());
        assert_eq!(all.terminated.len(), 3);
        assert_eq!(all.detached.len(), 2);
        let mut withheld = Withheld::default();
        withheld.terminations.insert((h.clone(), Pid(1)));
        withheld
            .detaches
            .insert((h.clone(), GpuIndex(0), EnvId("b".into())));
        let some = Taken::of(&[v], &withheld);
        // Pid 1 waits; the detach of `b` waits, so its processes stay.
        let pids: Vec<u32> = some.terminated.iter().map(|(_, p)| p.0).collect();
        assert_eq!(pids, [2]);
        assert!(some
            .detached
            .contains(&(h.clone(), GpuIndex(0), EnvId("a".into()))));
        assert!(!some.detached.contains(&(h, GpuIndex(0), EnvId("b".into()))));
    }
}
