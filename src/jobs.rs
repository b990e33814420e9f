//! What each job does once resolved: print this machine's snapshot,
//! check the hosts (`doctor`), or enforce (with metrics and reload).

use std::sync::Arc;

use crate::error::chain;
use crate::fleet::Fleet;
use crate::host::Host;
use crate::metrics::{self, Metrics};
use crate::output::{complain, print_stdout};
use crate::report::Format;
use crate::service::{self, Service};
use crate::setup::Job;
use crate::snapshot::genv;
use crate::view_socket::{self, Board};

/// The exit status of a command line that cannot run (as clap's).
pub const USAGE: u8 = 2;

/// Runs `job` (resolved from the command line `line`, which SIGHUP
/// resolves again); returns the exit status.
pub async fn run(job: Job, line: crate::setup::CommandLine) -> u8 {
    match job {
        Job::Snapshot(host) => match Host::Live(host).snapshot().await {
            // genv's state is what `genv usage snapshot` shows: without it
            // there is no snapshot to print.
            Ok(s) if s.state_problem().is_some() => {
                complain(&format!(
                    "genv's state cannot be used: {}",
                    crate::report::clean(s.state_problem().unwrap_or_default())
                ));
                1
            }
            Ok(s) => match serde_json::to_string_pretty(&genv::to_json(&s)) {
                Ok(t) => {
                    print_stdout(&[t]);
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
        Job::Report(args) => report(&args),
        Job::Status(args) => status(&args).await,
        Job::Top(args) => match crate::top_term::run(args).await {
            Ok(()) => 0,
            Err(e) => {
                complain(&format!("top: {e}"));
                1
            }
        },
        Job::Docs(dir) => match crate::docs::write(&dir) {
            Ok(written) => {
                let lines: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
                print_stdout(&lines);
                0
            }
            Err(e) => {
                complain(&format!("{}: {e}", dir.display()));
                1
            }
        },
        Job::Doctor {
            fleet,
            format,
            control_dir,
            ha,
            device_caps,
        } => {
            let code = doctor(&fleet, format, ha.as_ref(), device_caps).await;
            fleet.close_said().await;
            drop(control_dir);
            code
        }
        Job::Enforce {
            fleets,
            settings,
            control_dir,
            metrics,
            web,
            view,
        } => {
            if let Some(hole) = crate::doctor::policy_hole(&settings.cycle.policy) {
                complain(&format!("warning: {hole}"));
            }
            // Published beside the election, for the boxes to compare.
            let digest = settings
                .ha
                .is_some()
                .then(|| crate::setup::config_digest(&line.run));
            let mut service = Service {
                reload: Some(service::reloader(line)),
                ..Service::default()
            };
            // /view on the metrics endpoint only behind its basic
            // authentication: any local user can reach the port.
            let behind_auth = web.as_ref().is_some_and(|w| !w.users.is_empty());
            let board = (view.is_some() || (metrics.is_some() && behind_auth)).then(Board::default);
            let mut view_server = None;
            if let (Some((path, group)), Some(board)) = (view, &board) {
                match view_socket::bind(&path, group.as_deref()) {
                    Ok(bound) => {
                        view_server = Some(tokio::spawn(view_socket::serve(bound, board.clone())))
                    }
                    Err(e) => complain(&format!(
                        "--view-socket: {}: enforcing without it",
                        chain(&e)
                    )),
                }
            }
            service.view.clone_from(&board);
            let mut server = None;
            if let Some(addr) = metrics {
                let m = Arc::new(Metrics::new());
                // Bound before the first cycle, so that it is scraped after.
                let bound = metrics::listen(addr);
                server = Some(tokio::spawn(metrics::serve_at(
                    addr,
                    bound,
                    Arc::clone(&m),
                    web.map(Arc::new),
                    board,
                )));
                service.metrics = Some(m);
            }
            if let Some(spec) = &settings.ha {
                let fencing = fleets
                    .first()
                    .map(|f| f.fencing.clone())
                    .unwrap_or_default();
                let spec = crate::ha::HaSpec {
                    config: digest.unwrap_or_default(),
                    ..(**spec).clone()
                };
                match crate::ha::Elector::start(spec, fencing).await {
                    Ok(e) => service.elector = Some(e),
                    Err(e) => {
                        complain(&format!("--ha-etcd: {}", chain(&e)));
                        return USAGE;
                    }
                }
            }
            let ending = service::run(fleets, settings, service).await;
            for server in [server, view_server].into_iter().flatten() {
                server.abort();
                let _ = server.await;
            }
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
}

/// Prints the running service's view once; 1 if none can be had.
async fn status(args: &crate::cli::StatusArgs) -> u8 {
    if args.schema {
        let schema = schemars::schema_for!(crate::view::View);
        println!(
            "{}",
            serde_json::to_string_pretty(&schema).expect("a schema serializes")
        );
        return 0;
    }
    let login = match args
        .credentials
        .as_deref()
        .map(view_socket::credentials)
        .transpose()
    {
        Ok(login) => login,
        Err(e) => {
            complain(&chain(&e));
            return USAGE;
        }
    };
    match view_socket::fetch(&args.connect, login.as_ref(), args.timeout).await {
        Ok((view, line)) => {
            let out = match args.output {
                // Safe for a terminal too (DEL, C1 controls, bidi overrides).
                crate::cli::StatusOutput::Json => {
                    let json = String::from_utf8_lossy(line.trim_ascii_end()).into_owned();
                    crate::report::json_safe(json) + "\n"
                }
                crate::cli::StatusOutput::Text => {
                    crate::view_text::text(&view, crate::clock::now_ms())
                }
            };
            print!("{out}");
            0
        }
        Err(e) => {
            complain(&chain(&e));
            1
        }
    }
}

/// Prints what `args.state_db` recorded since `args.since`; 1 if it
/// cannot be read, 2 if it is refused.
fn report(args: &crate::cli::ReportArgs) -> u8 {
    use crate::cli::{ReportBy, ReportOutput};
    use crate::state_db::StateDb;
    let db = match StateDb::open_existing(&args.state_db) {
        Ok(db) => db,
        Err(e) => {
            complain(&chain(&e));
            return if e.is_refusal() { USAGE } else { 1 };
        }
    };
    let since = crate::clock::now_ms()
        .saturating_sub(u64::try_from(args.since.as_millis()).unwrap_or(u64::MAX));
    let recorded = match db.since(since) {
        Ok(r) => r,
        Err(e) => {
            complain(&chain(&e));
            return 1;
        }
    };
    let by_host = args.by == ReportBy::Host;
    let lines = crate::usage::summarize(&recorded, by_host);
    let text = match args.output {
        ReportOutput::Text => crate::usage::render_text(&lines, by_host),
        ReportOutput::Csv => crate::usage::render_csv(&lines, by_host),
        ReportOutput::Json => crate::usage::render_json(&lines),
    };
    print_stdout(&[text.trim_end().to_string()]);
    0
}

/// Checks every host of `fleet`, a progress line on stderr if it is a
/// terminal; the report on stdout; 1 if a host failed.
async fn doctor(
    fleet: &Fleet,
    format: Format,
    ha: Option<&crate::ha::HaSpec>,
    device_caps: bool,
) -> u8 {
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
    let mut hosts: Vec<_> = facts
        .iter()
        .map(|f| (f.host.clone(), crate::doctor::checks(f)))
        .collect();
    if let Some(spec) = ha {
        hosts.insert(
            0,
            (
                crate::model::HostId("etcd".into()),
                crate::ha::doctor::checks(spec).await,
            ),
        );
    }
    if device_caps {
        hosts.insert(
            0,
            (
                crate::model::HostId("policy".into()),
                vec![crate::doctor::device_cap_check()],
            ),
        );
    }
    let lines = match format {
        Format::Text => crate::doctor::render_text(&hosts),
        Format::Json => vec![crate::doctor::render_json(&hosts)],
    };
    print_stdout(&lines);
    u8::from(!hosts.iter().all(|(_, c)| crate::doctor::passed(c)))
}
