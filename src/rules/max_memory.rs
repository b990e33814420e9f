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
//! Processes the other rules already terminate this cycle (their own or a
//! device cap's detach) count as freed, so two rules never take two bites
//! of one excess.

use std::collections::{BTreeMap, HashSet};

use super::attribution::{Attribution, Standing};
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
        for (pi, p) in snap.processes.iter().enumerate() {
            if matches!(a.standing(pi), Standing::Unknown) {
                continue;
            }
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
            actions,
        });
    }
    (violations, notices)
}

/// The processes `violations` terminate, by host: themselves or with a
/// detach.
pub fn terminated(violations: &[Violation]) -> HashSet<(HostId, Pid)> {
    violations
        .iter()
        .flat_map(|v| &v.actions)
        .flat_map(|a| match a {
            Action::Terminate { host, pid } => vec![(host.clone(), *pid)],
            Action::Detach { host, pids, .. } => pids.iter().map(|p| (host.clone(), *p)).collect(),
        })
        .collect()
}
