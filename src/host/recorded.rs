//! A recorded host: a `genv usage snapshot` file standing for a machine,
//! for dry runs over what a fleet looked like.

use std::path::PathBuf;

use crate::error::HostError;
use crate::model::{HostId, HostSnapshot};
use crate::outcome::Outcome;
use crate::plan::HostPlan;
use crate::snapshot::genv;

/// A snapshot file and the host name it stands for.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub id: HostId,
    pub path: PathBuf,
}

impl Recorded {
    /// Reads and parses the file; errors name it.
    ///
    /// # Errors
    /// The file cannot be read or is not a genv snapshot.
    pub async fn snapshot(&self) -> Result<HostSnapshot, HostError> {
        let text = tokio::fs::read_to_string(&self.path)
            .await
            .map_err(|source| HostError::Read {
                path: self.path.clone(),
                source,
            })?;
        Ok(genv::parse_snapshot(
            &text,
            &self.path.display().to_string(),
        )?)
    }

    /// Nothing can be done to a recording: every action is a dry run.
    pub fn execute(&self, plan: &HostPlan) -> Vec<Outcome> {
        super::not_carried_out(&self.id, plan)
    }
}
