//! One enforcement cycle, and the loop around it:
//! collect -> merge -> rules -> plan -> execute -> report.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::Instrument;

use tokio::signal::unix::{signal, SignalKind};

use crate::cli::OutputFormat;
use crate::error::HostError;
use crate::local::LocalHost;
use crate::model::{Cluster, HostId, HostSnapshot, Mode};
use crate::outcome::{self, Outcome};
use crate::plan::{self, HostPlan, Plan};
use crate::report::{self, CycleReport, HostStatus, Timing};
use crate::rules::{self, Policy};
use crate::snapshot::genv;

/// Whole milliseconds of `d`, for reports.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How cycles run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub policy: Policy,
    pub interval: Duration,
    pub dry_run: bool,
    pub output: OutputFormat,
}

/// Assesses the hosts' results: rules, plan, and the report without
/// outcomes. Pure.
pub fn assess<E: ToString>(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    policy: &Policy,
    results: Vec<(HostId, Result<HostSnapshot, E>)>,
) -> (Cluster, CycleReport) {
    let hosts = results
        .iter()
        .map(|(host, r)| match r {
            Ok(s) => HostStatus {
                host: host.clone(),
                error: None,
                processes: s.processes.len(),
                envs: s.envs.len(),
                devices: s.devices.len(),
            },
            Err(e) => HostStatus {
                host: host.clone(),
                error: Some(e.to_string()),
                processes: 0,
                envs: 0,
                devices: 0,
            },
        })
        .collect();
    let cluster = Cluster::merge(mode, results);
    let charges = rules::Charges::of(&cluster, policy);
    let violations = rules::evaluate_with(&cluster, policy, &charges);
    let plan = plan::build(&cluster, &violations);
    let report = CycleReport {
        cycle,
        mode,
        dry_run,
        hosts,
        notices: rules::notices_with(&cluster, &charges),
        violations,
        plan,
        outcomes: Vec::new(),
        duration_ms: None,
        timing: None,
    };
    (cluster, report)
}

/// Outcomes for a plan that is not carried out.
pub fn dry_run_outcomes(plan: &Plan) -> Vec<Outcome> {
    plan.hosts
        .iter()
        .flat_map(|(host, p)| {
            let t = p.terminate.iter().map(move |t| Outcome::Terminate {
                host: host.clone(),
                pid: t.pid,
                outcome: outcome::Termination::DryRun,
            });
            let d = p.detach.iter().map(move |d| Outcome::Detach {
                host: host.clone(),
                device: d.device,
                eid: d.eid.clone(),
                outcome: outcome::Detach::DryRun,
            });
            t.chain(d)
        })
        .collect()
}

/// Whether the report shows a failure (exit status 1).
pub fn failed(report: &CycleReport) -> bool {
    report.hosts.iter().any(|h| h.error.is_some()) || report.outcomes.iter().any(Outcome::is_error)
}

/// Writes lines to stdout; false when stdout is gone (a closed pipe), so
/// that the caller ends the run as `| head` expects. Other write errors are
/// ignored: enforcement goes on.
pub fn print_stdout(lines: &[String]) -> bool {
    let mut out = std::io::stdout().lock();
    let written = lines
        .iter()
        .try_for_each(|l| writeln!(out, "{l}"))
        .and_then(|()| out.flush());
    !matches!(written, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// Writes a report to stdout/stderr in the chosen format. Returns false
/// when stdout is gone (a closed pipe): the run then ends, as `| head`
/// expects. Other write errors are ignored: enforcement goes on.
pub fn emit(report: &CycleReport, format: OutputFormat) -> bool {
    let mut out = std::io::stdout().lock();
    let written = match format {
        OutputFormat::Json => writeln!(out, "{}", report::render_json(report)),
        OutputFormat::Text => {
            let text = report::render_text(report);
            {
                let mut err = std::io::stderr().lock();
                for l in &text.stderr {
                    let _ = writeln!(err, "{l}");
                }
            }
            text.stdout.iter().try_for_each(|l| writeln!(out, "{l}"))
        }
    };
    let flushed = written.and_then(|()| out.flush());
    !matches!(flushed, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// This machine's name for reports.
pub fn local_host_id() -> HostId {
    HostId(
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_string()),
    )
}

/// One cycle on this machine.
pub async fn local_cycle(
    host: &LocalHost,
    id: &HostId,
    settings: &Settings,
    cycle: u64,
) -> CycleReport {
    let start = Instant::now();
    let result: Result<HostSnapshot, HostError> = host
        .snapshot()
        .instrument(tracing::info_span!("snapshot", cycle))
        .await;
    let snapshot_ms = millis(start.elapsed());
    let assessed = Instant::now();
    let (_, mut report) = tracing::info_span!("assess", cycle).in_scope(|| {
        assess(
            cycle,
            Mode::Local,
            settings.dry_run,
            &settings.policy,
            vec![(id.clone(), result)],
        )
    });
    let assess_ms = millis(assessed.elapsed());
    let dispatched = Instant::now();
    report.outcomes = if settings.dry_run {
        dry_run_outcomes(&report.plan)
    } else {
        let mut out = Vec::new();
        for (h, p) in &report.plan.hosts {
            out.extend(host.execute(h, p).await);
        }
        out
    };
    let total_ms = millis(start.elapsed());
    report.duration_ms = Some(total_ms);
    report.timing = Some(Timing {
        snapshot_ms,
        slowest_host: Some(id.clone()),
        slowest_ms: snapshot_ms,
        assess_ms,
        dispatch_ms: millis(dispatched.elapsed()),
        total_ms,
        ..Timing::default()
    });
    report
}

/// Enforces on this machine every `interval` (once if zero) until a
/// signal; returns whether every cycle went without error.
///
/// # Errors
/// Signal handlers cannot be installed.
pub async fn run_local(host: LocalHost, settings: Settings) -> std::io::Result<bool> {
    let id = local_host_id();
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut ok = true;
    for cycle in 1.. {
        let report = tokio::select! {
            r = local_cycle(&host, &id, &settings, cycle) => r,
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
        };
        ok &= !failed(&report);
        if !emit(&report, settings.output) || settings.interval.is_zero() {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(settings.interval) => {}
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    Ok(ok)
}

/// Reads a recorded `genv usage snapshot` file; errors name the file.
fn read_recorded(path: &std::path::Path) -> Result<HostSnapshot, String> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: {e}"))?;
    genv::parse_snapshot(&text, &name).map_err(|e| e.to_string())
}

/// A dry run over recorded `genv usage snapshot` files, each as a local
/// host of its own; returns whether every file could be read.
pub fn replay(files: &[PathBuf], settings: &Settings) -> bool {
    let mut ok = true;
    for (i, path) in files.iter().enumerate() {
        let name = path.display().to_string();
        let result = read_recorded(path);
        let host = HostId(
            path.file_stem()
                .map_or(name.clone(), |s| s.to_string_lossy().into_owned()),
        );
        if files.len() > 1
            && settings.output == OutputFormat::Text
            && !print_stdout(&[format!("{}==> {name} <==", if i > 0 { "\n" } else { "" })])
        {
            break;
        }
        let (_, mut report) = assess(
            i as u64 + 1,
            Mode::Local,
            true,
            &settings.policy,
            vec![(host, result)],
        );
        report.outcomes = dry_run_outcomes(&report.plan);
        ok &= !failed(&report);
        if !emit(&report, settings.output) {
            break;
        }
    }
    ok
}

/// How a remote run treats failing hosts (genv's `-e` and `-q`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Failures {
    /// Abort before enforcing anything when a host fails.
    pub exit_on_error: bool,
    /// Do not print host failures (JSON output still carries them).
    pub quiet: bool,
}

/// What ended a remote run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Every cycle went without error.
    Clean,
    /// Some host or action failed in some cycle.
    Errors,
    /// `-e`: a host failed and nothing was enforced.
    Aborted,
}

/// One remote cycle: snapshot all hosts, assess the cluster, dispatch the
/// plans (unless dry run, or `-e` and a host failed).
pub async fn remote_cycle(
    fleet: &crate::remote::Fleet,
    settings: &Settings,
    failures: Failures,
    cycle: u64,
) -> (CycleReport, bool) {
    let start = Instant::now();
    // What a host's own snapshot decides is enforced on it at once (not
    // with -e: nothing is enforced before every host has answered).
    let early = !settings.dry_run && !failures.exit_on_error;
    let own = |host: &HostId, snap: &HostSnapshot| {
        if early {
            plan::for_host(
                host,
                snap,
                &rules::evaluate_host(host, snap, &settings.policy),
            )
        } else {
            HostPlan::default()
        }
    };
    let rounds = fleet
        .snapshots_and(own)
        .instrument(tracing::info_span!("snapshot", cycle))
        .await;
    let mut timing = Timing {
        snapshot_ms: millis(start.elapsed()),
        ..Timing::default()
    };
    let mut done = Plan::default();
    let mut outcomes = Vec::new();
    let mut results = Vec::new();
    for round in rounds {
        if let Some(c) = round.connect {
            timing.connects += 1;
            timing.connect_ms = timing.connect_ms.max(millis(c));
        }
        if timing.slowest_host.is_none() || millis(round.elapsed) > timing.slowest_ms {
            timing.slowest_ms = millis(round.elapsed);
            timing.slowest_host = Some(round.host.clone());
        }
        if !round.plan.is_empty() {
            done.hosts.push((round.host.clone(), round.plan));
        }
        outcomes.extend(round.outcomes);
        results.push((round.host, round.snapshot));
    }
    let assessed = Instant::now();
    let (_, mut report) = tracing::info_span!("assess", cycle).in_scope(|| {
        assess(
            cycle,
            Mode::Remote,
            settings.dry_run,
            &settings.policy,
            results,
        )
    });
    timing.assess_ms = millis(assessed.elapsed());
    let abort = failures.exit_on_error && report.hosts.iter().any(|h| h.error.is_some());
    let dispatched = Instant::now();
    if abort {
        // genv raises on the first failed host, before any rule runs.
        report.plan = Plan::default();
        report.violations.clear();
        report.notices.clear();
    } else if settings.dry_run {
        report.outcomes = dry_run_outcomes(&report.plan);
    } else {
        let rest = Plan {
            hosts: report
                .plan
                .hosts
                .iter()
                .map(|(h, p)| match done.hosts.iter().find(|(d, _)| d == h) {
                    Some((_, d)) => (h.clone(), p.without(d)),
                    None => (h.clone(), p.clone()),
                })
                .filter(|(_, p)| !p.is_empty())
                .collect(),
        };
        outcomes.extend(
            fleet
                .dispatch(&rest)
                .instrument(tracing::info_span!("dispatch", cycle))
                .await,
        );
        report.outcomes = outcome::in_plan_order(&report.plan, outcomes);
    }
    timing.dispatch_ms = millis(dispatched.elapsed());
    timing.total_ms = millis(start.elapsed());
    report.duration_ms = Some(timing.total_ms);
    report.timing = Some(timing);
    (report, abort)
}

/// Writes a remote report; `quiet` drops host failures from the text.
/// Returns false when stdout is gone.
pub fn emit_remote(report: &CycleReport, format: OutputFormat, quiet: bool) -> bool {
    if quiet && format == OutputFormat::Text {
        let mut r = report.clone();
        r.hosts.iter_mut().for_each(|h| h.error = None);
        emit(&r, format)
    } else {
        emit(report, format)
    }
}

/// Enforces on the fleet every `interval` (once if zero) until a signal,
/// then closes every master connection.
///
/// # Errors
/// Signal handlers cannot be installed.
pub async fn run_remote(
    fleet: &crate::remote::Fleet,
    settings: &Settings,
    failures: Failures,
) -> std::io::Result<Ending> {
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut ending = Ending::Clean;
    for cycle in 1.. {
        let (report, abort) = tokio::select! {
            r = remote_cycle(fleet, settings, failures, cycle) => r,
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
        };
        if abort {
            // genv raises on the first failure whatever -q says.
            let _ = emit_remote(&report, settings.output, false);
            ending = Ending::Aborted;
            break;
        }
        if failed(&report) {
            ending = Ending::Errors;
        }
        if !emit_remote(&report, settings.output, failures.quiet) || settings.interval.is_zero() {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(settings.interval) => {}
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    for (host, e) in fleet.close().await {
        tracing::warn!(%host, error = %e, "closing the SSH master failed");
    }
    Ok(ending)
}

/// A dry run over a recorded fleet: `<dir>/<host>.json` for each host
/// (all files in `dir`, by name, when `hosts` is `None`). Returns whether
/// every host's file could be read.
pub fn replay_fleet(
    dir: &std::path::Path,
    hosts: Option<Vec<HostId>>,
    settings: &Settings,
    failures: Failures,
) -> bool {
    let hosts = hosts.unwrap_or_else(|| {
        let mut names: Vec<HostId> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let p = e.path();
                let stem = p.file_stem()?.to_string_lossy().into_owned();
                (p.extension()? == "json").then_some(HostId(stem))
            })
            .collect();
        names.sort();
        names
    });
    let results = hosts
        .into_iter()
        .map(|h| {
            let r = read_recorded(&dir.join(format!("{h}.json")));
            (h, r)
        })
        .collect();
    let (_, mut report) = assess(1, Mode::Remote, true, &settings.policy, results);
    report.outcomes = dry_run_outcomes(&report.plan);
    let _ = emit_remote(&report, settings.output, failures.quiet);
    !failed(&report)
}
