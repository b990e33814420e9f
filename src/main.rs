//! `genv-enforce`: parse the command line, resolve it into a job, run it,
//! map the ending to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use genv_enforce::cli::{self, Cli};
use genv_enforce::config::{self, Job};
use genv_enforce::cycle;
use genv_enforce::error::chain;
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
    let job = match config::resolve(cli) {
        Ok(job) => job,
        Err(e) => {
            complain(&chain(&e));
            return ExitCode::from(USAGE);
        }
    };
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
    let code = runtime.block_on(async {
        match job {
            Job::Snapshot(host) => match host.snapshot().await {
                Ok(s) => match serde_json::to_string_pretty(&genv::to_json(&s)) {
                    Ok(t) => {
                        cycle::print_stdout(&[t]);
                        0
                    }
                    Err(e) => {
                        complain(&e.to_string());
                        1
                    }
                },
                Err(e) => {
                    complain(&chain(&e));
                    1
                }
            },
            Job::Enforce {
                fleets,
                settings,
                control_dir,
            } => {
                let ending = cycle::run(&fleets, &settings).await;
                drop(control_dir);
                match ending {
                    Ok(ending) => ending.exit_code(),
                    Err(e) => {
                        complain(&chain(&e));
                        1
                    }
                }
            }
        }
    });
    // Work still blocked on a user's file or a hung tool must not hold the
    // exit (SIGTERM, Ctrl-C): every such step has its own deadline anyway.
    runtime.shutdown_background();
    ExitCode::from(code)
}

/// The exit status of a command line that cannot run (as clap's).
const USAGE: u8 = 2;

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

/// Prints an error on stderr; a closed stderr is not worth a panic.
fn complain(message: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "genv-enforce: {message}");
}
