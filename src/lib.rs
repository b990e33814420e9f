//! genv-enforce: enforcement of genv GPU environments, drop-in for
//! `genv enforce`, faster and safer.
//!
//! # Layout
//!
//! A pure core over plain data:
//!
//! - [`snapshot`]: parsers for nvidia-smi CSV, genv JSON and `/proc` text.
//! - [`model`]: ids, host snapshots, the merged [`model::Cluster`].
//! - [`rules`]: the four genv rules, each `Cluster -> Vec<Violation>`.
//! - [`plan`]: violations -> per-host pids to terminate and detaches.
//! - [`report`]: genv's text lines and our JSON; never decides.
//! - [`outcome`]: what execution did, as data.
//!
//! and a thin I/O shell:
//!
//! - [`local`]: this machine's snapshot and execution (pidfd SIGTERM after a
//!   start-time re-check; detach under genv's lock via [`state`]).
//! - [`cycle`]: collect -> assess -> execute -> emit, and the loop.
//! - [`cli`]: clap types; `main.rs` wires them to the above.

pub mod cli;
pub mod cycle;
pub mod error;
pub mod inventory;
pub mod local;
pub mod model;
pub mod outcome;
pub mod plan;
#[cfg(test)]
mod properties;
pub mod remote;
pub mod report;
pub mod rules;
pub mod snapshot;
pub mod state;
