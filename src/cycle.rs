//! The loop: for every kind of host, each cycle snapshots the fleet,
//! assesses it, carries out the plan (unless a dry run) and writes the
//! report; between cycles it sleeps, and SIGTERM or SIGINT end it.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::{signal, SignalKind};
use tracing::Instrument;

use crate::assess;
use crate::confirm::Confirmations;
use crate::error;
use crate::fleet::Fleet;
use crate::host::Host;
use crate::metrics::Metrics;
use crate::model::{FailureKind, HostFailure, HostId, Mode};
use crate::outcome::{self, Outcome, TerminateResult};
use crate::plan::{HostPlan, Plan, Termination};
use crate::report::{self, CycleReport, Format, Timing};
use crate::rules::{Orphans, Policy};

/// Whole milliseconds of `d`, for reports.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How a run treats failing hosts (genv's `-e` and `-q`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Failures {
    /// Abort before enforcing anything when a host fails.
    pub exit_on_error: bool,
    /// Do not print host failures (JSON output still carries them).
    pub quiet: bool,
}

/// How cycles run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// genv's local or remote wording.
    pub mode: Mode,
    pub policy: Policy,
    /// Between cycles; zero: one cycle.
    pub interval: Duration,
    /// Report the plan, carry out nothing.
    pub dry_run: bool,
    pub format: Format,
    pub failures: Failures,
    /// SIGKILL what still runs this long after its SIGTERM.
    pub kill_after: Option<Duration>,
    /// Consecutive cycles a violation must be seen in before it is acted on.
    pub confirm_cycles: u32,
}

/// What a run carries from one cycle to the next.
#[derive(Debug, Default)]
pub struct Memory {
    /// `--confirm-cycles`: violations seen in a row.
    pub confirm: Confirmations,
    /// Each host's processes seen orphaned: strays for life (a record that
    /// appears later with their id does not make them members).
    pub orphans: HashMap<HostId, Orphans>,
}

/// What ended a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Every cycle went without error.
    Clean,
    /// Some host or action failed in some cycle.
    Errors,
    /// `-e`: a host failed and nothing was enforced.
    Aborted,
    /// A dry run found violations (and nothing failed).
    Violations,
}

impl Ending {
    /// The exit status for cron: 0 clean, 1 a host or an action failed,
    /// 3 a dry run found violations (2 is for usage errors).
    pub fn exit_code(self) -> u8 {
        match self {
            Ending::Clean => 0,
            Ending::Errors | Ending::Aborted => 1,
            Ending::Violations => 3,
        }
    }
}

/// One cycle over `fleet`: every host's snapshot, the assessment, the plan
/// carried out (unless a dry run, or `-e` and a host failed). What a
/// host's own snapshot decides is carried out on it right after that
/// snapshot; what needs every host (the per-user cap) once all answered.
/// Actions wait for confirmation in `memory` (`--confirm-cycles`), and
/// what still runs `--kill-after` its SIGTERM is killed before the cycle
/// ends. Returns the report and whether `-e` aborted the cycle.
pub async fn cycle(
    fleet: &Fleet,
    settings: &Settings,
    n: u64,
    memory: &mut Memory,
) -> (CycleReport, bool) {
    let start = Instant::now();
    // Not with -e: nothing is enforced before every host has answered.
    let early = !settings.dry_run && !settings.failures.exit_on_error;
    let held: &Confirmations = &memory.confirm;
    let own = |host: &_, snap: &_, findings: &_| {
        if early {
            held.split_host(host, &assess::own_plan(host, snap, findings))
                .0
        } else {
            HostPlan::default()
        }
    };
    let policy = Arc::new(settings.policy.clone());
    let orphans = Arc::new(std::mem::take(&mut memory.orphans));
    let rounds = fleet
        .snapshots_and(n, &policy, &orphans, own)
        .instrument(tracing::info_span!("snapshot", cycle = n))
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
        timing
            .hosts_ms
            .push((round.host.clone(), millis(round.elapsed)));
        if timing.slowest_host.is_none() || millis(round.elapsed) > timing.slowest_ms {
            timing.slowest_ms = millis(round.elapsed);
            timing.slowest_host = Some(round.host.clone());
        }
        if !round.plan.is_empty() {
            done.hosts.push((round.host.clone(), round.plan));
        }
        outcomes.extend(round.outcomes);
        let mut result = round.result.map_err(|e| e.failure());
        match &mut result {
            Ok((_, findings)) => {
                memory
                    .orphans
                    .insert(round.host.clone(), std::mem::take(&mut findings.orphans));
            }
            // Unseen this cycle: what it had is kept.
            Err(_) => {
                if let Some(o) = orphans.get(&round.host) {
                    memory.orphans.insert(round.host.clone(), o.clone());
                }
            }
        }
        results.push((round.host, result));
    }
    let abort = settings.failures.exit_on_error && results.iter().any(|(_, r)| r.is_err());
    let assessed = Instant::now();
    let (mode, dry_run) = (settings.mode, settings.dry_run);
    // The caps and the plan over every host: off the async workers too.
    let assessing = crate::host::off_workers("assessing the cycle", move || {
        tracing::info_span!("assess", cycle = n).in_scope(|| {
            if abort {
                // genv raises on the first failed host, before any rule runs.
                let results = results
                    .into_iter()
                    .map(|(h, r)| (h, r.map(|(s, _)| s)))
                    .collect();
                assess::statuses(n, mode, dry_run, results)
            } else {
                assess::assess_found(n, mode, dry_run, &policy, results)
            }
        })
    });
    let mut a = match assessing.await {
        Ok(a) => a,
        Err(e) => {
            // Only a panic gets here: report it as every host's failure.
            let why = HostFailure::new(FailureKind::Internal, error::chain(&e));
            let results = fleet
                .hosts
                .iter()
                .map(|h| (h.id().clone(), Err(why.clone())))
                .collect();
            assess::statuses(n, mode, dry_run, results)
        }
    };
    for (status, host) in a.hosts.iter_mut().zip(&fleet.hosts) {
        status.recorded = host.is_recorded();
    }
    if let Some(log) = &fleet.audit {
        if let Err(e) = log.strays(n, mode, &a.notices) {
            tracing::error!(error = %e, "cannot record stray processes in the audit log");
        }
        if let Err(e) = log.failures(n, &a.hosts) {
            tracing::error!(error = %e, "cannot record failed hosts in the audit log");
        }
    }
    let whole = std::mem::take(&mut a.plan);
    (a.plan, a.waiting) = memory.confirm.split(&whole);
    memory.confirm.advance(&whole);
    timing.assess_ms = millis(assessed.elapsed());
    let dispatched = Instant::now();
    if settings.dry_run {
        outcomes = outcome::dry_run(&a.plan);
    } else if !abort {
        let rest = assess::remaining(&a.plan, &done);
        outcomes.extend(
            fleet
                .dispatch(n, &rest)
                .instrument(tracing::info_span!("dispatch", cycle = n))
                .await,
        );
        if let Some(grace) = settings.kill_after {
            let kills = signalled(&a.plan, &outcomes);
            if !kills.is_empty() {
                tokio::time::sleep(grace).await;
                outcomes.extend(
                    fleet
                        .escalate(n, &kills)
                        .instrument(tracing::info_span!("escalate", cycle = n))
                        .await,
                );
            }
        }
    }
    timing.dispatch_ms = millis(dispatched.elapsed());
    timing.total_ms = millis(start.elapsed());
    // A replay's report is the same every time: no clock in it.
    let timing = (!fleet.is_recorded()).then_some(timing);
    (CycleReport::new(a, outcomes, timing), abort)
}

/// The planned terminations whose SIGTERM was delivered, by host.
fn signalled(plan: &Plan, outcomes: &[Outcome]) -> Vec<(HostId, Vec<Termination>)> {
    plan.hosts
        .iter()
        .map(|(host, p)| {
            let ts = p
                .terminate
                .iter()
                .filter(|t| {
                    outcomes.iter().any(|o| {
                        matches!(o, Outcome::Terminate { host: h, pid, outcome: TerminateResult::Signalled }
                            if h == host && *pid == t.pid)
                    })
                })
                .cloned()
                .collect::<Vec<_>>();
            (host.clone(), ts)
        })
        .filter(|(_, ts)| !ts.is_empty())
        .collect()
}

/// What a long-running enforcer adds to the loop: metrics, re-reading
/// its configuration on SIGHUP, and systemd's readiness and watchdog.
#[derive(Default)]
pub struct Service {
    /// Fed each cycle's report.
    pub metrics: Option<Arc<Metrics>>,
    /// Re-reads the configuration (SIGHUP); an error keeps the old one.
    pub reload: Option<Reload>,
}

/// Makes the run's fleets and settings anew from the configuration files.
pub type Reload = Box<dyn FnMut() -> Result<Reloaded, String> + Send>;

/// A configuration read again.
pub struct Reloaded {
    pub fleets: Vec<Fleet>,
    pub settings: Settings,
    /// What must live as long as the new hosts (their socket directory).
    pub keep: Option<Box<dyn std::any::Any + Send>>,
}

/// Tells systemd (when it started us with `Type=notify`) how we are.
fn notify(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

/// Runs cycles until done, then closes every host. One fleet: a cycle
/// every `interval` (once if zero) until SIGTERM or SIGINT; SIGHUP reloads
/// the configuration between cycles (hosts that did not change keep their
/// connections). Several fleets (a replay of several files): one cycle
/// each, in turn, each under a header naming its file.
///
/// # Errors
/// Signal handlers cannot be installed.
pub async fn run(
    mut fleets: Vec<Fleet>,
    mut settings: Settings,
    mut service: Service,
) -> std::io::Result<Ending> {
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut hangup = signal(SignalKind::hangup())?;
    let mut watchdog_usec = 0;
    let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec)
        .then(|| Duration::from_micros(watchdog_usec / 2).max(Duration::from_millis(500)));
    let mut kept = Vec::new();
    let each = fleets.len() > 1;
    let mut ending = Ending::Clean;
    let mut memory = Memory {
        confirm: Confirmations::new(settings.confirm_cycles),
        ..Memory::default()
    };
    for n in 1.. {
        let fleet = if each {
            match fleets.get(n as usize - 1) {
                Some(f) => f,
                None => break,
            }
        } else {
            match fleets.first() {
                Some(f) => f,
                None => break,
            }
        };
        if each && settings.format == Format::Text && !print_stdout(&[header(fleet, n)]) {
            break;
        }
        let (report, abort) = tokio::select! {
            r = cycle(fleet, &settings, n, &mut memory) => r,
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
        };
        if let Some(m) = &service.metrics {
            m.observe(&report);
        }
        if n == 1 {
            notify(&[sd_notify::NotifyState::Ready]);
        }
        notify(&[sd_notify::NotifyState::Watchdog]);
        if abort {
            // genv raises on the first failure whatever -q says.
            let _ = emit(&report, settings.format, true);
            ending = Ending::Aborted;
            break;
        }
        if report.failed() {
            ending = Ending::Errors;
        } else if report.dry_run && !report.violations.is_empty() && ending == Ending::Clean {
            ending = Ending::Violations;
        }
        if !emit(&report, settings.format, !settings.failures.quiet) {
            // The reader is gone (`| head`): an ending it asked for, not
            // a finding to report.
            if ending == Ending::Violations {
                ending = Ending::Clean;
            }
            break;
        }
        if each {
            continue;
        }
        if settings.interval.is_zero() {
            break;
        }
        let wake = tokio::time::Instant::now() + settings.interval;
        let stop = loop {
            let tick = watchdog.map_or(wake, |w| wake.min(tokio::time::Instant::now() + w));
            tokio::select! {
                _ = tokio::time::sleep_until(tick) => {
                    notify(&[sd_notify::NotifyState::Watchdog]);
                    if tick >= wake {
                        break false;
                    }
                }
                _ = term.recv() => break true,
                _ = interrupt.recv() => break true,
                _ = hangup.recv() => {
                    if let Some(reload) = service.reload.as_mut() {
                        notify(&[sd_notify::NotifyState::Reloading]);
                        match reload() {
                            Ok(new) => {
                                let old = std::mem::take(&mut fleets);
                                fleets = merge(old, new.fleets).await;
                                settings = new.settings;
                                memory.confirm = Confirmations::new(settings.confirm_cycles);
                                kept.extend(new.keep);
                                tracing::info!(hosts = fleets.first().map_or(0, |f| f.hosts.len()), "configuration reloaded");
                                complain("configuration reloaded");
                            }
                            Err(e) => complain(&format!("configuration not reloaded, the old one is kept: {e}")),
                        }
                        notify(&[sd_notify::NotifyState::Ready]);
                    }
                }
            }
        };
        if stop {
            break;
        }
    }
    notify(&[sd_notify::NotifyState::Stopping]);
    for fleet in &fleets {
        for (host, e) in fleet.close().await {
            tracing::warn!(%host, error = %error::chain(&e), "closing the host's connection failed");
        }
    }
    drop(kept);
    Ok(ending)
}

/// The new fleets, each host that did not change taken from the old ones
/// with its connection; the old hosts left over are closed.
async fn merge(mut old: Vec<Fleet>, mut new: Vec<Fleet>) -> Vec<Fleet> {
    for (o, n) in old.iter_mut().zip(new.iter_mut()) {
        for slot in &mut n.hosts {
            if let Some(i) = o.hosts.iter().position(|h| h.same_as(slot)) {
                *slot = o.hosts.swap_remove(i);
            }
        }
    }
    for fleet in &old {
        for (host, e) in fleet.close().await {
            tracing::warn!(%host, error = %error::chain(&e), "closing a removed host's connection failed");
        }
    }
    new
}

/// A line on stderr, as all our messages; a closed stderr is not worth a
/// panic.
pub fn complain(message: &str) {
    let _ = writeln!(std::io::stderr().lock(), "genv-enforce: {message}");
}

/// `==> file <==` before each file's report, as `head` does.
fn header(fleet: &Fleet, n: u64) -> String {
    let name = match fleet.hosts.first() {
        Some(Host::Recorded(r)) => r.path.display().to_string(),
        Some(h) => h.id().to_string(),
        None => String::new(),
    };
    format!("{}==> {name} <==", if n > 1 { "\n" } else { "" })
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

/// Writes a report to stdout/stderr in `format`, host failures in text
/// only if `host_errors`. Returns false when stdout is gone (a closed
/// pipe): the run then ends, as `| head` expects. Other write errors are
/// ignored: enforcement goes on.
pub fn emit(report: &CycleReport, format: Format, host_errors: bool) -> bool {
    let mut out = std::io::stdout().lock();
    let written = match format {
        Format::Json => writeln!(out, "{}", report::render_json(report)),
        Format::Text => {
            let text = report::render_text_with(report, host_errors);
            {
                let mut err = std::io::stderr().lock();
                for l in &text.stderr {
                    let _ = writeln!(err, "{l}");
                }
                if host_errors {
                    let _ = writeln!(err, "{}", report::summary_line(report));
                }
            }
            text.stdout.iter().try_for_each(|l| writeln!(out, "{l}"))
        }
    };
    let flushed = written.and_then(|()| out.flush());
    !matches!(flushed, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}
