//! Pure parsers that turn raw host output into a [`HostSnapshot`].
//!
//! `genv` reads genv's JSON (snapshots and state files), `nvidia_smi` its
//! CSV, `frames` our agent's snapshot answer (with what `/proc` said of
//! each process), `assemble` makes a host snapshot of them. Reading the
//! files and running the commands is the agent's ([`crate::host`]).
//!
//! [`HostSnapshot`]: crate::model::HostSnapshot

pub mod assemble;
pub mod frames;
pub mod genv;
pub mod memory;
pub mod nvidia_smi;
pub mod pyset;

use thiserror::Error;

/// Input that could not be understood, with where it came from.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{source_name}: {location}: {message}")]
pub struct ParseError {
    /// The host or file the input came from.
    pub source_name: String,
    /// The line (`line 3`) or JSON path (`envs.envs[0].uid`) at fault.
    pub location: String,
    /// What is wrong there.
    pub message: String,
}

impl ParseError {
    /// A new error at `location` of `source_name`.
    pub fn new(source_name: &str, location: impl Into<String>, message: impl Into<String>) -> Self {
        ParseError {
            source_name: source_name.to_string(),
            location: location.into(),
            message: message.into(),
        }
    }

    /// The same error, said to come from `source_name`.
    pub fn from(self, source_name: &str) -> Self {
        ParseError {
            source_name: source_name.to_string(),
            ..self
        }
    }
}
