//! `genv-enforce`: parse the command line, resolve it into a job, run it
//! ([`jobs`]), map the ending to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use genv_enforce::cli::{self, Cli, Command, ConfigCommand};
use genv_enforce::error::chain;
use genv_enforce::jobs::{self, USAGE};
use genv_enforce::{config_check, config_file, output::complain, setup};

/// A cycle makes and drops many small values per host (ids, records):
/// mimalloc does that a third faster than glibc's malloc (the 1,000-host
/// criterion bench).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::normalize_args(std::env::args_os());
    // The configuration file's settings become arguments; a reload applies
    // the file to `args` anew.
    let line = match setup::config_args(args.clone()) {
        Ok(run) => setup::CommandLine { typed: args, run },
        Err(e) => {
            complain(&chain(&e));
            return ExitCode::from(USAGE);
        }
    };
    let cli = Cli::parse_from(&line.run);
    tracing_subscriber::fmt()
        .with_env_filter(log_filter(cli.verbose))
        .with_writer(std::io::stderr)
        .init();
    match &cli.command {
        Command::Config(ConfigCommand::Check(check)) => {
            return ExitCode::from(config_check::run(cli.config.clone(), check))
        }
        Command::Config(ConfigCommand::Schema) => return ExitCode::from(config_check::schema()),
        _ => {}
    }
    note_service_flags(&line.typed);
    raise_fd_limit();
    let job = match setup::job(cli) {
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
            return ExitCode::from(USAGE);
        }
    };
    let code = runtime.block_on(jobs::run(job, line));
    // Work still blocked on a user's file or a hung tool must not hold the
    // exit (SIGTERM, Ctrl-C): every such step has its own deadline anyway.
    runtime.shutdown_background();
    ExitCode::from(code)
}

/// `GENV_ENFORCE_LOG` or `RUST_LOG` (tracing's filter syntax), else `-v`:
/// warnings, then info, debug, trace.
fn log_filter(verbose: u8) -> EnvFilter {
    EnvFilter::try_from_env("GENV_ENFORCE_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| {
            EnvFilter::new(match verbose {
                0 => "warn",
                1 => "info",
                2 => "debug",
                _ => "trace",
            })
        })
}

/// The service's flags still in `GENV_ENFORCE_ARGS` (an environment file
/// from before the configuration file) keep working; the log says how to
/// move them into the file.
fn note_service_flags(args: &[std::ffi::OsString]) {
    let Ok(line) = std::env::var("GENV_ENFORCE_ARGS") else {
        return;
    };
    if line.trim().is_empty() || config_file::path_in(args).is_some() {
        return;
    }
    tracing::warn!(
        "GENV_ENFORCE_ARGS holds the service's flags: they keep working. To move them into {path}, \
         run `genv-enforce config check --effective -- $GENV_ENFORCE_ARGS > {path}.new` (secrets are \
         left out: add those keys by hand), check it and `mv {path}.new {path}`, then set \
         GENV_ENFORCE_ARGS=\"--config {path}\" in /etc/genv-enforce/genv-enforce.env",
        path = config_file::DEFAULT_PATH
    );
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
