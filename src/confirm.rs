//! `--confirm-cycles N`: an action is carried out only once the violation
//! behind it has been seen in N consecutive cycles (the same process, by
//! pid and start time, or the same environment on the same device), so
//! that a transient state (a job mid-attach) is not punished. Pure: the
//! cycle keeps one [`Confirmations`] and feeds it each cycle's plan.

use std::collections::HashMap;

use serde::Serialize;

use crate::model::{EnvId, GpuIndex, HostId, Pid};
use crate::plan::{HostPlan, Plan};

/// What identifies an action from one cycle to the next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Terminate(HostId, Pid, Option<u64>),
    Detach(HostId, GpuIndex, EnvId),
}

/// An action that waits for its violation to be seen again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Waiting {
    Terminate {
        host: HostId,
        pid: Pid,
        seen: u32,
        needed: u32,
    },
    Detach {
        host: HostId,
        device: GpuIndex,
        eid: EnvId,
        seen: u32,
        needed: u32,
    },
}

/// How many consecutive cycles each action's violation has been seen in.
#[derive(Debug, Clone, Default)]
pub struct Confirmations {
    needed: u32,
    seen: HashMap<Key, u32>,
}

impl Confirmations {
    /// Actions need `needed` consecutive sightings (1: at once, as genv).
    pub fn new(needed: u32) -> Self {
        Confirmations {
            needed: needed.max(1),
            seen: HashMap::new(),
        }
    }

    /// Cycles in a row this action will have been seen in, this one included.
    fn count(&self, key: &Key) -> u32 {
        self.seen.get(key).map_or(1, |n| n.saturating_add(1))
    }

    /// A host's plan split into what is confirmed this cycle and what waits.
    pub fn split_host(&self, host: &HostId, plan: &HostPlan) -> (HostPlan, Vec<Waiting>) {
        if self.needed == 1 {
            return (plan.clone(), Vec::new());
        }
        let mut confirmed = HostPlan::default();
        let mut waiting = Vec::new();
        for t in &plan.terminate {
            let seen = self.count(&Key::Terminate(host.clone(), t.pid, t.start_time));
            if seen >= self.needed {
                confirmed.terminate.push(t.clone());
            } else {
                waiting.push(Waiting::Terminate {
                    host: host.clone(),
                    pid: t.pid,
                    seen,
                    needed: self.needed,
                });
            }
        }
        for d in &plan.detach {
            let seen = self.count(&Key::Detach(host.clone(), d.device, d.eid.clone()));
            if seen >= self.needed {
                confirmed.detach.push(d.clone());
            } else {
                waiting.push(Waiting::Detach {
                    host: host.clone(),
                    device: d.device,
                    eid: d.eid.clone(),
                    seen,
                    needed: self.needed,
                });
            }
        }
        (confirmed, waiting)
    }

    /// The whole plan split into what is confirmed and what waits.
    pub fn split(&self, plan: &Plan) -> (Plan, Vec<Waiting>) {
        let mut confirmed = Plan::default();
        let mut waiting = Vec::new();
        for (host, p) in &plan.hosts {
            let (c, w) = self.split_host(host, p);
            if !c.is_empty() {
                confirmed.hosts.push((host.clone(), c));
            }
            waiting.extend(w);
        }
        (confirmed, waiting)
    }

    /// Ends a cycle whose (whole, unsplit) plan was `plan`: what it holds
    /// has been seen once more; anything else starts over.
    pub fn advance(&mut self, plan: &Plan) {
        if self.needed == 1 {
            return;
        }
        let mut seen = HashMap::new();
        for (host, p) in &plan.hosts {
            for t in &p.terminate {
                let k = Key::Terminate(host.clone(), t.pid, t.start_time);
                seen.insert(k.clone(), self.count(&k));
            }
            for d in &p.detach {
                let k = Key::Detach(host.clone(), d.device, d.eid.clone());
                seen.insert(k.clone(), self.count(&k));
            }
        }
        self.seen = seen;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Detach, Termination};

    fn plan(pids: &[(u32, u64)], detach: &[(u32, &str)]) -> Plan {
        Plan {
            hosts: vec![(
                HostId("h".into()),
                HostPlan {
                    terminate: pids
                        .iter()
                        .map(|&(p, s)| Termination::of(Pid(p), Some(s)))
                        .collect(),
                    detach: detach
                        .iter()
                        .map(|&(d, e)| Detach {
                            device: GpuIndex(d),
                            eid: EnvId(e.into()),
                            username: None,
                        })
                        .collect(),
                },
            )],
        }
    }

    fn acted(c: &Confirmations, p: &Plan) -> (Vec<u32>, Vec<u32>, usize) {
        let (done, waiting) = c.split(p);
        let hp = done
            .hosts
            .first()
            .map(|(_, h)| h.clone())
            .unwrap_or_default();
        (
            hp.terminate.iter().map(|t| t.pid.0).collect(),
            hp.detach.iter().map(|d| d.device.0).collect(),
            waiting.len(),
        )
    }

    #[test]
    fn one_cycle_is_genvs_behaviour() {
        let mut c = Confirmations::new(1);
        let p = plan(&[(1, 10)], &[(0, "e")]);
        assert_eq!(acted(&c, &p), (vec![1], vec![0], 0));
        c.advance(&p);
        assert_eq!(acted(&c, &p), (vec![1], vec![0], 0));
    }

    #[test]
    fn actions_wait_for_consecutive_sightings_of_the_same_thing() {
        let mut c = Confirmations::new(2);
        let first = plan(&[(1, 10), (2, 20)], &[(0, "e")]);
        assert_eq!(acted(&c, &first), (vec![], vec![], 3));
        let (_, waiting) = c.split(&first);
        assert!(matches!(
            waiting[0],
            Waiting::Terminate {
                seen: 1,
                needed: 2,
                ..
            }
        ));
        c.advance(&first);
        // pid 1 again; pid 2 reused (other start time); the detach again.
        let second = plan(&[(1, 10), (2, 21)], &[(0, "e")]);
        assert_eq!(acted(&c, &second), (vec![1], vec![0], 1));
        c.advance(&second);
        // A cycle without them starts the count over.
        c.advance(&plan(&[], &[]));
        assert_eq!(acted(&c, &second), (vec![], vec![], 3));
        let mut three = Confirmations::new(3);
        for expected in [0, 0, 2, 2] {
            assert_eq!(acted(&three, &first).0.len(), expected);
            three.advance(&first);
        }
    }
}
