//! `genv-enforce`: parse arguments, set up logging, run, map to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use genv_enforce::cli::{
    self, Cli, Command, CycleArgs, EnforceArgs, HostKeyCheck, RemoteArgs, RemoteCommand,
};
use genv_enforce::cycle::{self, Ending, Failures, Settings};
use genv_enforce::inventory::{self, Inventory, Overrides};
use genv_enforce::local::LocalHost;
use genv_enforce::model::HostId;
use genv_enforce::remote::{ssh::SshOptions, Fleet};
use genv_enforce::rules::Policy;
use genv_enforce::snapshot::genv;

/// A cycle makes and drops many small values per host (ids, records):
/// mimalloc does that a third faster than glibc's malloc (the 1,000-host
/// criterion bench).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse_from(cli::normalize_args(std::env::args_os()));
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("GENV_ENFORCE_LOG").unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    raise_fd_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            complain(&format!("cannot start the runtime: {e}"));
            return ExitCode::from(2);
        }
    };
    let ok = match cli.command {
        Command::Enforce(args) => runtime.block_on(enforce(args)),
        Command::Remote(args) => runtime.block_on(remote(*args)),
        Command::Snapshot(args) => runtime.block_on(async {
            match LocalHost::from_env(args.command_timeout).snapshot().await {
                Ok(s) => serde_json::to_string_pretty(&genv::to_json(&s))
                    .map(|t| cycle::print_stdout(&[t]))
                    .is_ok(),
                Err(e) => {
                    complain(&chain(&e));
                    false
                }
            }
        }),
    };
    // Work still blocked on a user's file or a hung tool must not hold the
    // exit (SIGTERM, Ctrl-C): every such step has its own deadline anyway.
    runtime.shutdown_background();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn enforce(args: EnforceArgs) -> bool {
    let settings = settings(&args.cycle, args.rules.policy(), !args.snapshot.is_empty());
    if !args.snapshot.is_empty() {
        return cycle::replay(&args.snapshot, &settings);
    }
    match cycle::run_local(LocalHost::from_env(args.command_timeout), settings).await {
        Ok(ok) => ok,
        Err(e) => {
            complain(&chain(&e));
            false
        }
    }
}

/// Cycle settings from the flags; a replay of recorded snapshots is always a dry run.
fn settings(c: &CycleArgs, policy: Policy, replay: bool) -> Settings {
    Settings {
        policy,
        interval: c.interval,
        dry_run: c.dry_run || replay,
        output: c.output,
    }
}

/// The hosts named by -H, --hostfile or --inventory, if any.
fn load_hosts(args: &RemoteArgs) -> Result<Option<Inventory>, String> {
    let overrides = Overrides {
        user: args.username.clone(),
    };
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))
    };
    if let Some(list) = &args.host {
        let hosts = inventory::parse_host_list(list, &overrides).map_err(|e| format!("-H: {e}"))?;
        return Ok(Some(Inventory {
            hosts,
            ..Inventory::default()
        }));
    }
    if let Some(path) = &args.hostfile {
        let hosts =
            inventory::parse_hostfile(&read(path)?, &path.display().to_string(), &overrides)
                .map_err(|e| e.to_string())?;
        if hosts.is_empty() {
            return Err(format!("{}: no hosts", path.display()));
        }
        return Ok(Some(Inventory {
            hosts,
            ..Inventory::default()
        }));
    }
    if let Some(path) = &args.inventory {
        return inventory::parse_inventory(&read(path)?, &path.display().to_string(), &overrides)
            .map(Some)
            .map_err(|e| e.to_string());
    }
    Ok(None)
}

async fn remote(args: RemoteArgs) -> bool {
    let RemoteCommand::Enforce(enforce) = &args.command;
    let inventory = match load_hosts(&args) {
        Ok(mut i) => {
            for h in i.iter_mut().flat_map(|i| i.hosts.iter_mut()) {
                h.identity_file = h
                    .identity_file
                    .take()
                    .or_else(|| args.identity_file.clone());
            }
            i
        }
        Err(e) => {
            complain(&e);
            return false;
        }
    };
    let mut policy = enforce.rules.policy();
    if let Some(inv) = &inventory {
        policy.max_devices_per_user = policy
            .max_devices_per_user
            .or(inv.caps.max_devices_per_user);
        let mut caps = inv.caps.max_devices_for_user.clone();
        caps.extend(policy.max_devices_for_user);
        policy.max_devices_for_user = caps;
    }
    let settings = settings(&enforce.cycle, policy, enforce.snapshot_dir.is_some());
    let failures = Failures {
        exit_on_error: args.exit_on_error,
        quiet: args.quiet,
    };
    if let Some(dir) = &enforce.snapshot_dir {
        let hosts = inventory.map(|i| i.hosts.into_iter().map(|h| h.id).collect::<Vec<HostId>>());
        return cycle::replay_fleet(dir, hosts, &settings, failures);
    }
    let Some(inventory) = inventory else {
        complain("remote: one of -H/--host, --hostfile or --inventory is required");
        return false;
    };
    let temp;
    let control_dir = match &args.control_dir {
        Some(d) => match private_dir(d) {
            Ok(()) => d.clone(),
            Err(e) => {
                complain(&format!("--control-dir {}: {e}", d.display()));
                return false;
            }
        },
        None => match tempfile::Builder::new().prefix("genv-enforce-").tempdir() {
            Ok(t) => {
                temp = t;
                temp.path().to_path_buf()
            }
            Err(e) => {
                complain(&format!("cannot create a directory for SSH sockets: {e}"));
                return false;
            }
        },
    };
    let ssh = SshOptions {
        connect_timeout: args.timeout.map(std::time::Duration::from_secs),
        control_dir,
        // Masters left by a crash exit on their own once idle this long.
        persist: args
            .control_persist
            .unwrap_or((settings.interval * 3).max(std::time::Duration::from_secs(60))),
        reuse: args.control_persist.is_some(),
        known_hosts: match args.host_key_check {
            HostKeyCheck::Strict => openssh::KnownHosts::Strict,
            HostKeyCheck::AcceptNew => openssh::KnownHosts::Add,
        },
        known_hosts_file: args.known_hosts_file.clone(),
    };
    let fleet = Fleet::new(
        inventory.hosts,
        ssh,
        usize::from(args.concurrency),
        args.command_timeout,
        settings.interval.is_zero(),
    );
    match cycle::run_remote(&fleet, &settings, failures).await {
        Ok(Ending::Clean) => true,
        Ok(Ending::Errors | Ending::Aborted) => false,
        Err(e) => {
            complain(&chain(&e));
            false
        }
    }
}

/// A fleet costs a few file descriptors per host (the mux connection and
/// the agent's pipes): take the whole hard limit rather than the usual soft
/// 1024, which a few hundred hosts would exhaust.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::debug!(error = %e, "cannot raise the open-file limit");
        }
    }
}

/// Makes sure `dir` can hold our master sockets: a directory (created 0700
/// if missing) owned by us that no one else may write to.
fn private_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| e.to_string())?;
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() {
        return Err("not a directory".into());
    }
    if meta.uid() != rustix::process::geteuid().as_raw() {
        return Err("not owned by us: another user could replace our sockets".into());
    }
    if meta.mode() & 0o022 != 0 {
        return Err("writable by others: another user could replace our sockets".into());
    }
    Ok(())
}

/// Prints an error on stderr; a closed stderr is not worth a panic.
fn complain(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "genv-enforce: {message}");
}

/// An error with all its causes, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}
