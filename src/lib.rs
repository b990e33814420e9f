//! genv-enforce: enforcement of genv GPU environments, drop-in for
//! `genv enforce` and `genv remote enforce`, faster and safer.
//!
//! # Crate map
//!
//! Data flows one way: config -> hosts -> snapshot -> assess -> execute ->
//! report. `ARCHITECTURE.md` names every module, file by file. A pure
//! core over plain data:
//!
//! - [`snapshot`]: parsers (nvidia-smi CSV, genv JSON, the agent's
//!   frames) and [`snapshot::assemble`], which makes one host
//!   snapshot from raw parts, for every kind of host.
//! - [`model`]: ids, host snapshots, the merged [`model::Cluster`];
//!   [`clock`]: milliseconds since the epoch.
//! - [`rules`]: genv's four rules and ours (memory, group and idle caps,
//!   orphans, shards), each `Cluster -> Vec<Violation>`, and
//!   [`rules::attribution`] (who an environment is charged to).
//! - [`plan`]: violations -> per-host pids to terminate and detaches.
//! - [`assess`]: the hosts' results -> violations, notices and plan.
//! - [`ladder`]: warn, then act: confirmation, graces, exemptions.
//! - [`outcome`]: what carrying out a plan did, as data.
//! - [`report`]: a cycle's report, built once, as genv's text lines or
//!   our JSON; rendering decides nothing.
//! - [`usage`]: who used what over a period (`report`), from the
//!   cycles' usage samples.
//! - [`doctor`]: a host's facts -> checks, each with its fix.
//! - [`inventory`]: `-H`, hostfiles and inventory TOML -> host specs.
//!
//! and a thin I/O shell:
//!
//! - [`cli`]: clap types; [`config_file`]: the `--config` TOML file
//!   checked and turned into command-line arguments ([`config_check`]:
//!   `config check`); [`config`] resolves them (and the
//!   [`inventory`]'s text) into checked settings and a request, with no
//!   I/O; [`setup`] reads what they name first and opens and builds
//!   what the request asks for (secrets, hosts, audit log, database).
//! - [`host`]: one [`host::Host`] over live and recorded hosts:
//!   snapshot, execute, close. A [`host::LiveHost`] (this machine, or an
//!   SSH host) is touched only by our agent (`host/agent.py`), spoken to
//!   through [`host::protocol`] over a transport.
//! - [`fleet`]: bounded, unordered fan-out over hosts.
//! - [`ha`]: several enforcer boxes on etcd: the election, and the
//!   epoch that fences a deposed leader off the hosts.
//! - [`cycle`]: one cycle over a fleet; [`service`]: the loop around it
//!   (interval, signals, reload, systemd); [`output`]: stdout and stderr;
//!   [`jobs`]: what each resolved job does.
//! - [`notify`]: mail, webhooks and terminals for the job's owner and
//!   the admins, rate-limited, beside the cycle.
//! - [`audit`]: the audit log, written before each action;
//!   [`state_db`]: what a run keeps across restarts and records, in
//!   SQLite; [`private`]: every check that a file of ours is ours alone.
//! - [`metrics`]: Prometheus metrics over HTTP; [`web_config`]: the
//!   endpoint's TLS and basic authentication.
//! - [`docs`]: man pages and shell completions from the command line's
//!   own definitions.
//! - [`error`]: an error and its causes as one line; each layer keeps
//!   its own typed errors ([`host::HostError`], ...).

pub mod assess;
pub mod audit;
pub mod cli;
pub mod clock;
pub mod config;
pub mod config_check;
pub mod config_file;
pub mod cycle;
pub mod docs;
pub mod doctor;
pub mod error;
#[cfg(test)]
mod evasion;
pub mod fleet;
pub mod ha;
pub mod history;
pub mod host;
pub mod inventory;
pub mod jobs;
pub mod ladder;
pub mod metrics;
pub mod model;
#[cfg(test)]
mod noninterference;
pub mod notify;
pub mod outcome;
pub mod output;
pub mod peer;
pub mod plan;
pub mod private;
#[cfg(test)]
mod properties;
pub mod report;
pub mod rules;
pub mod service;
pub mod setup;
pub mod snapshot;
pub mod state_db;
pub mod top;
pub mod top_term;
pub mod usage;
pub mod view;
pub mod view_json;
pub mod view_socket;
pub mod view_text;
pub mod web_config;
