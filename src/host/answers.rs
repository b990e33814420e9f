//! What our agent's answers mean: a snapshot's frames, one outcome per
//! termination and per detach (what was done is kept even when a later
//! step failed), a tell's counts, doctor's facts, or why a step failed.
//! Pure: answers in, outcomes out.

use super::facts;
use super::protocol::{self, Answer, Failure, Status};
use super::{Fetched, HostError};
use crate::model::HostId;
use crate::outcome::{DetachResult, Outcome, TerminateResult};
use crate::plan::{HostPlan, Termination};

/// A failure answer as an error: the kind of step and why (`state: ...`).
fn failure(answer: &Answer) -> HostError {
    match Failure::read(&answer.body) {
        Ok(f) => HostError::Remote {
            fail: f.fail,
            message: f.message,
        },
        Err(e) => HostError::Protocol(e),
    }
}

/// A snapshot answer: the frames, or why the snapshot failed.
///
/// # Errors
/// A step failed on the host.
pub fn fetched(answer: Answer) -> Result<Fetched, HostError> {
    match answer.status {
        Status::Done => Ok(Fetched::Agent(answer.body)),
        Status::Failed => Err(failure(&answer)),
    }
}

/// One outcome per termination from a terminate answer: the kills done
/// are answered even when a later step failed, and the rest fail with
/// the reason.
pub fn terminated(
    answer: Result<Answer, HostError>,
    terminations: &[Termination],
) -> Vec<TerminateResult> {
    let (kills, missing) = match answer {
        Ok(a) => match a.status {
            Status::Done => match serde_json::from_slice::<protocol::Kills>(&a.body) {
                Ok(k) => (k.kills, "no answer from the host".to_string()),
                Err(e) => (
                    Vec::new(),
                    crate::error::chain(&HostError::Protocol(protocol::ProtocolError::Body {
                        what: "terminate",
                        why: e.to_string(),
                    })),
                ),
            },
            Status::Failed => match Failure::read(&a.body) {
                Ok(f) => (f.kills, format!("{}: {}", f.fail.word(), f.message)),
                Err(e) => (Vec::new(), crate::error::chain(&HostError::Protocol(e))),
            },
        },
        Err(e) => (Vec::new(), crate::error::chain(&e)),
    };
    protocol::read_terminations(&kills, terminations, &missing)
}

/// Outcomes for terminations none of which has a start time: never
/// signalled blind.
pub fn terminated_blind(terminations: &[Termination]) -> Vec<TerminateResult> {
    protocol::read_terminations(&[], terminations, "no answer from the host")
}

/// One outcome per detached pair from a detach answer; a failed detach
/// changed nothing.
pub fn detached(
    host: &HostId,
    answer: Result<Answer, HostError>,
    pairs: usize,
) -> Vec<DetachResult> {
    let failed = |error: String| vec![DetachResult::Failed { error }; pairs];
    match answer {
        Ok(a) => match a.status {
            Status::Done => match serde_json::from_slice::<protocol::Detached>(&a.body) {
                Ok(d) => {
                    if let Some(held) = &d.unlocked {
                        // A user held genv's lock: written without it (see
                        // the agent's lock()), said each time.
                        crate::output::complain(&format!(
                            "{host}: {}: devices.json was written without it",
                            crate::report::clean(held)
                        ));
                    }
                    protocol::read_detaches(&d.detached, pairs, "no answer from the host")
                }
                Err(e) => failed(format!(
                    "the agent's detach answer is not what we expect: {e}"
                )),
            },
            Status::Failed => match Failure::read(&a.body) {
                // Said as the agent says it (no kind: the action names it).
                Ok(f) => failed(f.message),
                Err(e) => failed(crate::error::chain(&HostError::Protocol(e))),
            },
        },
        Err(e) => failed(crate::error::chain(&e)),
    }
}

/// How many terminals each note reached, from a tell answer.
///
/// # Errors
/// The agent refused the notes, or its answer is not a count per note.
pub fn told(answer: Answer, notes: usize) -> Result<Vec<u32>, HostError> {
    match answer.status {
        Status::Done => match serde_json::from_slice::<protocol::Told>(&answer.body) {
            Ok(t) if t.told.len() == notes => Ok(t.told),
            Ok(t) => Err(HostError::Protocol(protocol::ProtocolError::Body {
                what: "tell",
                why: format!("{} counts for {notes} notes", t.told.len()),
            })),
            Err(e) => Err(HostError::Protocol(protocol::ProtocolError::Body {
                what: "tell",
                why: e.to_string(),
            })),
        },
        Status::Failed => Err(failure(&answer)),
    }
}

/// A doctor answer's facts.
///
/// # Errors
/// The doctor request failed, or its answer is not facts.
pub fn doctor_facts(answer: &Answer) -> Result<facts::AgentFacts, HostError> {
    match answer.status {
        Status::Done => serde_json::from_slice(&answer.body).map_err(|e| {
            HostError::Protocol(protocol::ProtocolError::Body {
                what: "doctor",
                why: e.to_string(),
            })
        }),
        Status::Failed => Err(failure(answer)),
    }
}

/// A host's outcomes for its plan: terminations, then detaches, in plan
/// order.
pub fn outcomes(
    host: &HostId,
    plan: &HostPlan,
    terminated: Vec<TerminateResult>,
    detached: Vec<DetachResult>,
) -> Vec<Outcome> {
    let t = plan
        .terminate
        .iter()
        .zip(terminated)
        .map(|(t, outcome)| Outcome::Terminate {
            host: host.clone(),
            pid: t.pid,
            outcome,
        });
    let d = plan
        .detach
        .iter()
        .zip(detached)
        .map(|(d, outcome)| Outcome::Detach {
            host: host.clone(),
            device: d.device,
            eid: d.eid.clone(),
            outcome,
        });
    t.chain(d).collect()
}
