//! A recorded host: a `genv usage snapshot` file standing for a machine,
//! for dry runs over what a fleet looked like.

use std::path::PathBuf;

use super::HostError;
use crate::model::HostId;
use crate::outcome::Outcome;
use crate::plan::HostPlan;

/// A snapshot file and the host name it stands for.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub id: HostId,
    pub path: PathBuf,
}

impl Recorded {
    /// Reads the file.
    ///
    /// # Errors
    /// The file cannot be read.
    pub async fn fetch(&self) -> Result<super::Fetched, HostError> {
        let text = tokio::fs::read_to_string(&self.path)
            .await
            .map_err(|source| HostError::Read {
                path: self.path.clone(),
                source,
            })?;
        Ok(super::Fetched::Recorded(text))
    }

    /// Parses the file's text; errors name it.
    pub fn parser(&self) -> super::Parser {
        super::Parser::new(
            self.path.display().to_string(),
            Default::default(),
            usize::MAX,
        )
    }

    /// Nothing can be done to a recording: every action is a dry run.
    pub fn execute(&self, plan: &HostPlan) -> Vec<Outcome> {
        super::not_carried_out(&self.id, plan)
    }
}
