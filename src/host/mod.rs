//! Hosts: where snapshots come from and where plans are carried out. One
//! interface, [`Host`], over two kinds:
//!
//! - [`LiveHost`]: our agent (`agent.py`, speaking [`protocol`] over a
//!   [`channel`]; its answers read in [`answers`]), the only code that
//!   touches the host: it takes snapshots, signals and detaches as root.
//!   It runs on this machine as a child of ours ([`local`]), or on a
//!   machine reached over SSH ([`remote`], [`ssh`]);
//! - [`recorded::Recorded`]: a `genv usage snapshot` file, for dry runs.
//!
//! A host reports its failures as data ([`HostError`]); nothing here
//! decides what to enforce.

pub mod answers;
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
pub use live::LiveHost;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::model::{HostId, HostSnapshot};
use crate::outcome::Outcome;
use crate::plan::HostPlan;
use crate::snapshot::assemble::{assemble, ParsedState};
use crate::snapshot::{frames, genv};

/// What a host sent for one snapshot, not yet parsed: parsing is work on
/// what users wrote, done off the async workers ([`Parser`]).
#[derive(Debug)]
pub enum Fetched {
    /// Our agent's frames.
    Agent(Vec<u8>),
    /// A recorded `genv usage snapshot`.
    Recorded(String),
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

/// A host of any kind: live (our agent over a transport), or a recording.
#[derive(Debug)]
pub enum Host {
    Live(Box<LiveHost>),
    Recorded(recorded::Recorded),
}

impl Host {
    /// Its name in reports.
    pub fn id(&self) -> &HostId {
        match self {
            Host::Live(h) => h.id(),
            Host::Recorded(h) => &h.id,
        }
    }

    /// Whether `other` is the same host reached the same way (a reloaded
    /// configuration keeps such a host, and its connection).
    pub fn same_as(&self, other: &Host) -> bool {
        match (self, other) {
            (Host::Live(a), Host::Live(b)) => a.same_as(b),
            (Host::Recorded(a), Host::Recorded(b)) => a.id == b.id && a.path == b.path,
            _ => false,
        }
    }

    /// Makes its requests carry `fencing`'s epoch (a recording has none).
    pub fn set_fencing(&mut self, fencing: &fence::Fencing) {
        if let Host::Live(h) = self {
            h.agent.fencing = fencing.clone();
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
            Host::Live(h) => h.fetch().await,
            Host::Recorded(h) => h.fetch().await,
        }
    }

    /// What turns its [`Host::fetch`] into a snapshot.
    pub fn parser(&self) -> Parser {
        match self {
            Host::Live(h) => h.parser(),
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
            Host::Live(h) => h.execute(plan).await,
            Host::Recorded(h) => h.execute(plan),
        }
    }

    /// SIGKILLs each process of `terminations` still running with the same
    /// identity (`--kill-after`); one [`Outcome::Kill`] each.
    pub async fn escalate(&self, terminations: &[crate::plan::Termination]) -> Vec<Outcome> {
        match self {
            Host::Live(h) => h.escalate(terminations).await,
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
            Host::Live(h) => h.tell(notes).await,
            Host::Recorded(_) => Ok(vec![0; notes.len()]),
        }
    }

    /// Facts for `doctor` (none for a recording).
    pub async fn doctor(&self) -> Option<facts::Facts> {
        match self {
            Host::Live(h) => Some(h.doctor().await),
            Host::Recorded(_) => None,
        }
    }

    /// How long a new connection took to come up this cycle, if one was
    /// opened.
    pub fn take_connect_time(&self) -> Option<Duration> {
        match self {
            Host::Live(h) => h.take_connect_time(),
            Host::Recorded(_) => None,
        }
    }

    /// Ends what the host holds open (an SSH master, our agent on it).
    ///
    /// # Errors
    /// It could not be closed cleanly (it was killed instead).
    pub async fn close(&self) -> Result<(), HostError> {
        match self {
            Host::Live(h) => h.close().await,
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
