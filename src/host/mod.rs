//! Hosts: where snapshots come from and where plans are carried out. One
//! interface, [`Host`], over three kinds:
//!
//! - [`local::LocalHost`]: this machine, and [`remote::SshHost`]: a
//!   machine reached over SSH ([`ssh`]); on both, our agent (`agent.py`,
//!   speaking [`protocol`] over a [`channel`]) is the only code that
//!   touches the host: it takes snapshots, signals and detaches as root;
//! - [`recorded::Recorded`]: a `genv usage snapshot` file, for dry runs.
//!
//! A host reports its failures as data ([`HostError`]); nothing here
//! decides what to enforce.

pub mod channel;
mod error;
pub mod facts;
pub mod fence;
pub mod live;
pub mod local;
pub mod protocol;
pub mod recorded;
pub mod remote;
pub mod ssh;

pub use error::HostError;
use live::Live;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::model::{HostId, HostSnapshot};
use crate::outcome::{DetachResult, Outcome, TerminateResult};
use crate::plan::{HostPlan, Termination};
use crate::snapshot::assemble::{assemble, ParsedState};
use crate::snapshot::{frames, genv};
use protocol::{Answer, Failure, Status};

/// What a host sent for one snapshot, not yet parsed: parsing is work on
/// what users wrote, done off the async workers ([`Parser`]).
#[derive(Debug)]
pub enum Fetched {
    /// Our agent's frames.
    Agent(Vec<u8>),
    /// A recorded `genv usage snapshot`.
    Recorded(String),
}

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
pub(crate) fn fetched(answer: Answer) -> Result<Fetched, HostError> {
    match answer.status {
        Status::Done => Ok(Fetched::Agent(answer.body)),
        Status::Failed => Err(failure(&answer)),
    }
}

/// One outcome per termination from a terminate answer: the kills done
/// are answered even when a later step failed, and the rest fail with
/// the reason.
pub(crate) fn terminated(
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
pub(crate) fn terminated_blind(terminations: &[Termination]) -> Vec<TerminateResult> {
    protocol::read_terminations(&[], terminations, "no answer from the host")
}

/// One outcome per detached pair from a detach answer; a failed detach
/// changed nothing.
pub(crate) fn detached(
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
pub(crate) fn told(answer: Answer, notes: usize) -> Result<Vec<u32>, HostError> {
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
pub(crate) fn doctor_facts(answer: &Answer) -> Result<facts::AgentFacts, HostError> {
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
pub(crate) fn outcomes(
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

/// Turns what one host sent into its snapshot. Owned and cheap to clone,
/// so that parsing runs in the blocking pool, never on the task that
/// polls signals or other hosts' I/O.
#[derive(Debug, Clone)]
pub struct Parser {
    /// Names the host (or file) in errors.
    source: String,
    /// The host's state files as parsed last time.
    cache: Arc<Mutex<ParsedState>>,
    /// `--max-records`.
    max_records: usize,
}

impl Parser {
    /// A parser for `source`, keeping its state files' parse in `cache`.
    pub fn new(source: String, cache: Arc<Mutex<ParsedState>>, max_records: usize) -> Self {
        Parser {
            source,
            cache,
            max_records,
        }
    }

    /// The snapshot `fetched` describes.
    ///
    /// # Errors
    /// What was sent does not parse, or holds too many records.
    pub fn parse(&self, fetched: Fetched) -> Result<HostSnapshot, HostError> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match fetched {
            Fetched::Agent(body) => {
                let frames = frames::parse_frames(&body, &self.source)?;
                let raw = frames::raw_host(&frames, &self.source)?;
                assemble(&raw, &self.source, &mut cache, self.max_records)?
            }
            Fetched::Recorded(text) => genv::parse_snapshot(&text, &self.source)?,
        })
    }
}

/// `fetched` parsed by `parser` in the blocking pool.
///
/// # Errors
/// As [`Parser::parse`].
pub async fn parsed(fetched: Fetched, parser: Parser) -> Result<HostSnapshot, HostError> {
    off_workers("parsing the snapshot", move || parser.parse(fetched)).await?
}

/// Runs `work` in the blocking pool.
///
/// # Errors
/// The work panicked.
pub async fn off_workers<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, HostError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|source| HostError::Join { what, source })
}

/// A host of any kind.
#[derive(Debug)]
pub enum Host {
    Local(Box<local::LocalHost>),
    Ssh(Box<remote::SshHost>),
    Recorded(recorded::Recorded),
}

impl Host {
    /// Its name in reports.
    pub fn id(&self) -> &crate::model::HostId {
        match self {
            Host::Local(h) => &h.id,
            Host::Ssh(h) => &h.conn.spec.id,
            Host::Recorded(h) => &h.id,
        }
    }

    /// Whether `other` is the same host reached the same way (a reloaded
    /// configuration keeps such a host, and its connection).
    pub fn same_as(&self, other: &Host) -> bool {
        match (self, other) {
            (Host::Local(a), Host::Local(b)) => a.same_as(b),
            (Host::Ssh(a), Host::Ssh(b)) => {
                a.conn.spec == b.conn.spec
                    && a.command_timeout == b.command_timeout
                    && a.lifetime == b.lifetime
                    && a.max_records == b.max_records
                    && a.groups == b.groups
                    && a.utilization == b.utilization
                    && a.ssh.same_connection(&b.ssh)
            }
            (Host::Recorded(a), Host::Recorded(b)) => a.id == b.id && a.path == b.path,
            _ => false,
        }
    }

    /// Makes its requests carry `fencing`'s epoch (a recording has none).
    pub fn set_fencing(&mut self, fencing: &crate::host::fence::Fencing) {
        match self {
            Host::Local(h) => h.fencing = fencing.clone(),
            Host::Ssh(h) => h.fencing = fencing.clone(),
            Host::Recorded(_) => {}
        }
    }

    /// Whether it is a recording (nothing can be carried out on it, and
    /// its cycles are not timed).
    pub fn is_recorded(&self) -> bool {
        matches!(self, Host::Recorded(_))
    }

    /// What it says of itself now, to be parsed by its [`Host::parser`].
    ///
    /// # Errors
    /// Whatever kept it from being taken, naming the step.
    pub async fn fetch(&self) -> Result<Fetched, HostError> {
        match self {
            Host::Local(h) => h.fetch().await,
            Host::Ssh(h) => h.fetch().await,
            Host::Recorded(h) => h.fetch().await,
        }
    }

    /// What turns its [`Host::fetch`] into a snapshot.
    pub fn parser(&self) -> Parser {
        match self {
            Host::Local(h) => h.parser(),
            Host::Ssh(h) => h.parser(),
            Host::Recorded(h) => h.parser(),
        }
    }

    /// Its snapshot now: GPU processes with their identity, genv's state,
    /// and who runs what (parsed off the async workers).
    ///
    /// # Errors
    /// Whatever kept it from being taken, naming the step.
    pub async fn snapshot(&self) -> Result<HostSnapshot, HostError> {
        parsed(self.fetch().await?, self.parser()).await
    }

    /// Carries out its plan: terminations (each pid's identity re-checked
    /// first), then detaches, as genv does; one outcome per action.
    pub async fn execute(&self, plan: &HostPlan) -> Vec<Outcome> {
        match self {
            Host::Local(h) => h.execute(plan).await,
            Host::Ssh(h) => h.execute(plan).await,
            Host::Recorded(h) => h.execute(plan),
        }
    }

    /// SIGKILLs each process of `terminations` still running with the same
    /// identity (`--kill-after`); one [`Outcome::Kill`] each.
    pub async fn escalate(&self, terminations: &[crate::plan::Termination]) -> Vec<Outcome> {
        match self {
            Host::Local(h) => h.escalate(terminations).await,
            Host::Ssh(h) => h.escalate(terminations).await,
            Host::Recorded(_) => Vec::new(),
        }
    }

    /// Writes each note to its user's terminals there (the controlling
    /// terminals of its processes, their login terminals); how many
    /// terminals each reached. A recording has none.
    ///
    /// # Errors
    /// The transport or the agent failed.
    pub async fn tell(&self, notes: Vec<protocol::Note>) -> Result<Vec<u32>, HostError> {
        match self {
            Host::Local(h) => h.tell(notes).await,
            Host::Ssh(h) => h.tell(notes).await,
            Host::Recorded(_) => Ok(vec![0; notes.len()]),
        }
    }

    /// Facts for `doctor` (none for a recording).
    pub async fn doctor(&self) -> Option<facts::Facts> {
        match self {
            Host::Local(h) => Some(h.doctor().await),
            Host::Ssh(h) => Some(h.doctor().await),
            Host::Recorded(_) => None,
        }
    }

    /// How long a new connection took to come up this cycle, if one was
    /// opened.
    pub fn take_connect_time(&self) -> Option<Duration> {
        match self {
            Host::Ssh(h) => h.conn.take_connect_time(),
            Host::Local(_) | Host::Recorded(_) => None,
        }
    }

    /// Ends what the host holds open (an SSH master, our agent on it).
    ///
    /// # Errors
    /// It could not be closed cleanly (it was killed instead).
    pub async fn close(&self) -> Result<(), HostError> {
        match self {
            Host::Ssh(h) => h.close().await,
            Host::Local(h) => {
                h.close().await;
                Ok(())
            }
            Host::Recorded(_) => Ok(()),
        }
    }
}

/// Outcomes for actions that were not carried out, e.g. a dry run.
pub fn not_carried_out(host: &HostId, plan: &HostPlan) -> Vec<Outcome> {
    crate::outcome::dry_run(&crate::plan::Plan {
        hosts: vec![(host.clone(), plan.clone())],
    })
}
