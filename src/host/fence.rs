//! The epoch a fleet's requests carry (high availability), and what the
//! hosts' agents answered to it.
//!
//! The leader sets its epoch before each cycle; every snapshot,
//! termination and detach then carries it, and each host's agent keeps the
//! highest it has seen and refuses anything older (see `agent.py`'s
//! `fence`). A follower's requests carry none (it acts on nothing), and
//! neither do a run's without `--ha-etcd`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::protocol::{Answer, FailKind, Failure, Fence, Status};
use super::HostError;
use crate::model::HostId;

/// Where agents keep the highest epoch they have seen, by default.
pub const FENCE_DIR: &str = "/run/genv-enforce";

/// The fleet's fence, shared by the fleet's hosts (cheap to clone); the
/// default fences nothing (runs without `--ha-etcd`).
#[derive(Debug, Clone, Default)]
pub struct Fencing(Arc<State>);

#[derive(Debug, Default)]
struct State {
    /// Where the agents keep their epoch; empty: no fencing.
    dir: String,
    /// The epoch requests carry now; 0: none.
    epoch: AtomicU64,
    /// Until when this cycle's lease holds, on our clock.
    until: Mutex<Option<Instant>>,
    /// Why this box must stop acting, since the last
    /// [`Fencing::take_refusal`]: the first refusal, or its lease ended.
    refused: Mutex<Option<Refusal>>,
}

/// Why a leader must stop acting now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A host's agent refused its epoch: another leader has acted there.
    Fenced { host: HostId, message: String },
    /// Its lease ended during the cycle (it was paused, or slow).
    Lapsed,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Fenced { host, message } => write!(f, "fenced on {host}: {message}"),
            Refusal::Lapsed => f.write_str("its etcd lease ended during the cycle"),
        }
    }
}

/// An action not sent: this box no longer leads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not sent: this box no longer leads ({0})")]
pub struct NotLeading(pub Refusal);

impl Fencing {
    /// A fence kept by agents in `dir` on their hosts, carrying nothing yet.
    pub fn new(dir: impl Into<String>) -> Self {
        Fencing(Arc::new(State {
            dir: dir.into(),
            ..State::default()
        }))
    }

    /// Where agents keep the epoch, when fencing is on.
    pub fn dir(&self) -> Option<&str> {
        (!self.0.dir.is_empty()).then_some(self.0.dir.as_str())
    }

    /// From now on requests carry `epoch` (a leader's, whose lease holds
    /// `until`), or none.
    pub fn set(&self, epoch: Option<u64>, until: Option<Instant>) {
        self.0.epoch.store(epoch.unwrap_or(0), Ordering::SeqCst);
        self.lease_until(until);
    }

    /// Until when the lease holds now (the keep-alive task says, after
    /// each renewal; `None`: it ended).
    pub fn lease_until(&self, until: Option<Instant>) {
        *self.0.until.lock().unwrap_or_else(|e| e.into_inner()) = until;
    }

    /// Whether a termination or detach may be sent now: always without
    /// fencing; for a leader, while no host has refused it this cycle
    /// and its lease holds (else it is noted, and the leader steps down).
    ///
    /// # Errors
    /// Why not, for the action's outcome.
    pub fn may_act(&self, now: Instant) -> Result<(), NotLeading> {
        if self.current().is_none() {
            return Ok(());
        }
        let mut refused = self.0.refused.lock().unwrap_or_else(|e| e.into_inner());
        if refused.is_none() {
            let until = *self.0.until.lock().unwrap_or_else(|e| e.into_inner());
            if until.is_none_or(|u| now >= u) {
                *refused = Some(Refusal::Lapsed);
            }
        }
        match &*refused {
            None => Ok(()),
            Some(r) => Err(NotLeading(r.clone())),
        }
    }

    /// What a request carries now.
    pub fn current(&self) -> Option<Fence> {
        let epoch = self.0.epoch.load(Ordering::SeqCst);
        match self.dir() {
            Some(dir) if epoch > 0 => Some(Fence {
                epoch,
                dir: dir.to_string(),
            }),
            _ => None,
        }
    }

    /// Notes `host`'s answer if it is a refusal for an older epoch.
    pub fn observe(&self, host: &HostId, answer: &Result<Answer, HostError>) {
        let Ok(a) = answer else { return };
        if a.status != Status::Failed {
            return;
        }
        if let Ok(Failure {
            fail: FailKind::Fenced,
            message,
            ..
        }) = Failure::read(&a.body)
        {
            let mut refused = self.0.refused.lock().unwrap_or_else(|e| e.into_inner());
            refused.get_or_insert(Refusal::Fenced {
                host: host.clone(),
                message,
            });
        }
    }

    /// The first refusal since the last call, if any.
    pub fn take_refusal(&self) -> Option<Refusal> {
        self.0
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: Status, body: &str) -> Result<Answer, HostError> {
        Ok(Answer {
            status,
            body: body.as_bytes().to_vec(),
        })
    }

    #[test]
    fn requests_carry_the_leaders_epoch_only_while_set_and_fencing_is_on() {
        let off = Fencing::default();
        off.set(Some(5), None);
        assert_eq!(off.current(), None);
        let f = Fencing::new(FENCE_DIR);
        assert_eq!(f.current(), None);
        f.set(Some(5), None);
        let shared = f.clone();
        assert_eq!(
            shared.current(),
            Some(Fence {
                epoch: 5,
                dir: FENCE_DIR.into()
            })
        );
        f.set(None, None);
        assert_eq!(shared.current(), None);
    }

    #[test]
    fn a_leader_acts_until_its_lease_ends_or_a_host_refuses_it() {
        let now = Instant::now();
        let later = now + std::time::Duration::from_secs(3);
        // Without fencing (no HA, or a follower's dry run): always.
        assert_eq!(Fencing::default().may_act(later), Ok(()));
        let f = Fencing::new(FENCE_DIR);
        f.set(None, Some(now));
        assert_eq!(f.may_act(later), Ok(()));
        f.set(Some(4), Some(later));
        assert_eq!(f.may_act(now), Ok(()));
        let e = f.may_act(later).unwrap_err().to_string();
        assert!(e.contains("lease ended"), "{e}");
        // It stays refused, even before the deadline, until taken.
        assert!(f.may_act(now).is_err());
        assert_eq!(f.take_refusal(), Some(Refusal::Lapsed));
        assert_eq!(f.may_act(now), Ok(()));
        f.observe(
            &HostId::new("h").unwrap(),
            &answer(
                Status::Failed,
                r#"{"fail":"fenced","message":"epoch 4 is older"}"#,
            ),
        );
        let e = f.may_act(now).unwrap_err().to_string();
        assert!(e.contains("fenced on h: epoch 4 is older"), "{e}");
        f.set(Some(4), None);
        assert!(f.take_refusal().is_some());
        assert!(f
            .may_act(now)
            .unwrap_err()
            .to_string()
            .contains("lease ended"));
    }

    #[test]
    fn only_a_fenced_failure_is_a_refusal_and_the_first_is_kept() {
        let f = Fencing::new(FENCE_DIR);
        let h = |s: &str| HostId::new(s).unwrap();
        f.observe(&h("a"), &answer(Status::Done, "{}"));
        f.observe(
            &h("a"),
            &answer(Status::Failed, r#"{"fail":"lock","message":"held"}"#),
        );
        f.observe(
            &h("a"),
            &Err(HostError::Remote {
                fail: FailKind::Lock,
                message: "x".into(),
            }),
        );
        assert_eq!(f.take_refusal(), None);
        f.observe(
            &h("b"),
            &answer(
                Status::Failed,
                r#"{"fail":"fenced","message":"epoch 1 is older"}"#,
            ),
        );
        f.observe(
            &h("c"),
            &answer(
                Status::Failed,
                r#"{"fail":"fenced","message":"epoch 1 is older"}"#,
            ),
        );
        assert_eq!(
            f.take_refusal(),
            Some(Refusal::Fenced {
                host: h("b"),
                message: "epoch 1 is older".into()
            })
        );
        assert_eq!(f.take_refusal(), None);
    }
}
