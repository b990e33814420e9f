//! Taking devices under a device cap (per user, per group): what the rules
//! before a cap take this cycle, and the actions that free a held device
//! from its user's count: a detach of their environments there (with
//! their jobs there) and the termination of their other jobs there
//! (strays, jobs of environments not attached there, counted jobs outside
//! genv). Devices are taken in the order given until enough no longer
//! count; a job on several devices frees each of them it alone held.

use std::collections::HashSet;

use crate::model::{EnvId, GpuIndex, HashMap, HostId, Pid};

use super::max_devices::HeldDevice;
use super::{Action, Violation, Withheld};

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
