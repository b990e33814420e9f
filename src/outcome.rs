//! What happened when a plan was carried out: plain data for the report.

use serde::Serialize;

use crate::model::{EnvId, GpuIndex, HostId, Pid};

/// The result of one planned termination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Termination {
    /// SIGTERM was delivered to the same process the snapshot saw.
    Signalled,
    /// Nothing done: `--dry-run` or a recorded snapshot.
    DryRun,
    /// The pid no longer exists.
    AlreadyGone,
    /// The pid now belongs to another process: left alone.
    PidReused { expected: u64, found: u64 },
    /// The snapshot did not record a start time: never signalled blind.
    NoIdentity,
    /// The kernel refused the signal.
    PermissionDenied,
    /// Anything else.
    Failed { error: String },
}

/// The result of one planned detach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Detach {
    /// Removed from devices.json.
    Detached,
    /// Nothing done: `--dry-run` or a recorded snapshot.
    DryRun,
    /// The attachment was already gone.
    NotAttached,
    /// devices.json could not be updated; it was left as it was.
    Failed { error: String },
}

/// One outcome, located.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Outcome {
    Terminate {
        host: HostId,
        pid: Pid,
        outcome: Termination,
    },
    Detach {
        host: HostId,
        device: GpuIndex,
        eid: EnvId,
        outcome: Detach,
    },
}

impl Outcome {
    /// Whether this outcome should make the run's exit status non-zero.
    pub fn is_error(&self) -> bool {
        matches!(
            self,
            Outcome::Terminate {
                outcome: Termination::PermissionDenied | Termination::Failed { .. },
                ..
            } | Outcome::Detach {
                outcome: Detach::Failed { .. },
                ..
            }
        )
    }
}
