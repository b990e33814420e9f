//! `genv-enforce`: parse the command line, resolve it into a job, run it,
//! map the ending to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use genv_enforce::cli::{self, Cli};
use genv_enforce::config::{self, Job};
use std::sync::Arc;

use genv_enforce::cycle::{self, complain, Reload, Reloaded, Service};
use genv_enforce::error::chain;
use genv_enforce::metrics::Metrics;
use genv_enforce::report::Format;
use genv_enforce::snapshot::genv;

/// A cycle makes and drops many small values per host (ids, records):
/// mimalloc does that a third faster than glibc's malloc (the 1,000-host
/// criterion bench).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::normalize_args(std::env::args_os());
    let cli = Cli::parse_from(&args);
    tracing_subscriber::fmt()
        .with_env_filter(log_filter(cli.verbose))
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
            Job::Snapshot(host) => match genv_enforce::host::Host::Local(host).snapshot().await {
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
            Job::Doctor {
                fleet,
                format,
                control_dir,
            } => {
                let code = doctor(&fleet, format).await;
                for (host, e) in fleet.close().await {
                    tracing::warn!(%host, error = %chain(&e), "closing the host's connection failed");
                }
                drop(control_dir);
                code
            }
            Job::Enforce {
                fleets,
                settings,
                control_dir,
                metrics,
            } => {
                let mut service = Service {
                    reload: Some(reloader(args)),
                    ..Service::default()
                };
                if let Some(addr) = metrics {
                    let listener = match genv_enforce::metrics::bind(addr)
                        .and_then(tokio::net::TcpListener::from_std)
                    {
                        Ok(l) => l,
                        Err(e) => {
                            complain(&format!("--metrics-listen {addr}: {e}"));
                            return USAGE;
                        }
                    };
                    let m = Arc::new(Metrics::new());
                    tokio::spawn(genv_enforce::metrics::serve(listener, Arc::clone(&m)));
                    service.metrics = Some(m);
                }
                let ending = cycle::run(fleets, settings, service).await;
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

/// Checks every host of `fleet`, a progress line on stderr if it is a
/// terminal; the report on stdout; 1 if a host failed.
async fn doctor(fleet: &genv_enforce::fleet::Fleet, format: Format) -> u8 {
    use std::io::{IsTerminal, Write};
    let tty = std::io::stderr().is_terminal();
    let progress = |done: usize, total: usize| {
        if tty {
            let _ = write!(
                std::io::stderr().lock(),
                "\rdoctor: {done}/{total} hosts checked"
            );
        }
    };
    let facts = fleet.doctor(&progress).await;
    if tty {
        let _ = write!(std::io::stderr().lock(), "\r\x1b[K");
    }
    let hosts: Vec<_> = facts
        .iter()
        .map(|f| (f.host.clone(), genv_enforce::doctor::checks(f)))
        .collect();
    let lines = match format {
        Format::Text => genv_enforce::doctor::render_text(&hosts),
        Format::Json => vec![genv_enforce::doctor::render_json(&hosts)],
    };
    cycle::print_stdout(&lines);
    u8::from(!hosts.iter().all(|(_, c)| genv_enforce::doctor::passed(c)))
}

/// The exit status of a command line that cannot run (as clap's).
const USAGE: u8 = 2;

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

/// SIGHUP: the same command line resolved again, so that the inventory
/// (or hostfile) and the audit log are read and opened anew.
fn reloader(args: Vec<std::ffi::OsString>) -> Reload {
    Box::new(move || {
        let cli = Cli::try_parse_from(&args).map_err(|e| e.to_string())?;
        match config::resolve(cli).map_err(|e| chain(&e))? {
            Job::Enforce {
                fleets,
                settings,
                control_dir,
                ..
            } => Ok(Reloaded {
                fleets,
                settings,
                keep: control_dir.map(|t| Box::new(t) as Box<dyn std::any::Any + Send>),
            }),
            Job::Snapshot(_) | Job::Doctor { .. } => Err("not an enforcing run".into()),
        }
    })
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
