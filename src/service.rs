//! The long-running service around cycles: the loop at `--interval`,
//! SIGTERM and SIGINT, SIGHUP's reload (hosts that did not change keep
//! their connections), systemd's readiness and watchdog, and how a run
//! ends (its exit status).

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use thiserror::Error;
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::Cli;
use crate::config::Settings;
use crate::cycle::{cycle, Memory};
use crate::error;
use crate::fleet::Fleet;
use crate::host::Host;
use crate::ladder::Ladder;
use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::output::{complain, emit, print_stdout};
use crate::report::{CycleReport, Format};
use crate::setup::{self, Job, SetupError};
use crate::state_db::StateDb;

/// How long a run that ends by itself waits for its notifications to go.
const DRAIN: Duration = Duration::from_secs(30);
/// How long a run ended by a signal does.
const DRAIN_SIGNALLED: Duration = Duration::from_millis(500);

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

/// What a long-running enforcer adds to the loop: metrics, re-reading
/// its configuration on SIGHUP, and systemd's readiness and watchdog.
#[derive(Default)]
pub struct Service {
    /// Fed each cycle's report.
    pub metrics: Option<Arc<Metrics>>,
    /// Re-reads the configuration (SIGHUP); an error keeps the old one.
    pub reload: Option<Reload>,
    /// `--ha-etcd`: this box's part in the election; it acts only while
    /// it leads.
    pub elector: Option<crate::ha::Elector>,
}

/// Makes the run's fleets and settings anew from the configuration files.
pub type Reload = Box<dyn FnMut() -> Result<Reloaded, ReloadError> + Send>;

/// Why the configuration could not be read again (the old one is kept).
#[derive(Debug, Error)]
pub enum ReloadError {
    /// The command line no longer parses (clap's words).
    #[error("{0}")]
    Usage(#[from] clap::Error),
    /// A file it names is missing, malformed or refused.
    #[error(transparent)]
    Config(#[from] SetupError),
    /// It resolves to another job than enforcing.
    #[error("not an enforcing run")]
    NotEnforcing,
}

/// A configuration read again.
pub struct Reloaded {
    pub fleets: Vec<Fleet>,
    pub settings: Settings,
    /// What must live as long as the new hosts (their socket directory).
    pub keep: Option<tempfile::TempDir>,
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
    let mut memory = remembered(&settings);
    let mut notifier = notifier(&settings, &fleets, &service);
    let mut signalled = false;
    let mut repeats = crate::notify::Repeats::default();
    let mut terminals = crate::notify::limit::RateLimit::new(
        settings.notify.as_ref().map_or(0, |s| s.per_user_hour),
    );
    // Channels replaced by a reload, letting their queues go.
    let mut draining = Vec::new();
    // High availability: the fence every fleet's hosts carry, and where
    // this box stood last cycle.
    let fencing = fleets
        .first()
        .map(|f| f.fencing.clone())
        .unwrap_or_default();
    let mut standing: Option<crate::ha::Standing> = None;
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
        // Under --ha-etcd only the leader acts: another box's cycle is a
        // dry run whose ladder moves nothing (a takeover warns afresh).
        let mut follower = None;
        if let Some(elector) = &service.elector {
            let looked = std::time::Instant::now();
            let look = tokio::select! {
                s = elector.look() => s,
                _ = term.recv() => { signalled = true; break },
                _ = interrupt.recv() => { signalled = true; break },
            };
            tracing::debug!(
                ms = looked.elapsed().as_secs_f64() * 1e3,
                "etcd: standing looked up"
            );
            let crate::ha::election::Look {
                standing: now,
                others,
                until,
            } = look;
            memory.others = others;
            fencing.set(if now.leads() { now.epoch() } else { None }, until);
            let took_over = now.leads() && !standing.as_ref().is_some_and(|s| s.leads());
            if standing.as_ref().is_none_or(|s| s.changed(&now)) {
                tracing::info!(standing = %now.describe(), "high availability");
                complain(&format!("ha: {}", now.describe()));
            }
            if let Some(m) = &service.metrics {
                m.standing(&now, took_over);
            }
            if !now.leads() {
                follower = Some((
                    Settings {
                        cycle: crate::cycle::Options {
                            dry_run: true,
                            ..settings.cycle.clone()
                        },
                        notify: None,
                        ..settings.clone()
                    },
                    memory.ladder.export(),
                ));
            }
            standing = Some(now);
        }
        let run = follower.as_ref().map_or(&settings, |(s, _)| s);
        let (report, abort) = tokio::select! {
            r = cycle(fleet, &run.cycle, n, &mut memory) => r,
            _ = term.recv() => { signalled = true; break },
            _ = interrupt.recv() => { signalled = true; break },
        };
        if let Some((_, ladder)) = follower {
            memory.ladder = Ladder::restore(settings.grace.clone(), ladder);
        } else if let Some(elector) = &service.elector {
            publish(elector, std::mem::take(&mut memory.published), &report).await;
        }
        if let (Some(elector), Some(refusal)) = (&service.elector, fencing.take_refusal()) {
            // Another leader has acted on a host since this cycle began,
            // or this box's lease ended meanwhile: it no longer leads.
            fencing.set(None, None);
            complain(&format!("ha: {refusal}; stepping down"));
            if let (Some(m), crate::ha::Refusal::Fenced { .. }) = (&service.metrics, &refusal) {
                m.fenced();
            }
            elector.step_down().await;
            standing = None;
        }
        if let Some(m) = &service.metrics {
            m.observe(&report);
        }
        let mut events = Vec::new();
        if let Some(tell) = &notifier {
            events = crate::notify::told(&report.events, &report.outcomes);
            events.extend(repeats.fresh(crate::notify::told(&report.at_once, &report.outcomes)));
            tell.send(n, &events);
        }
        if let Some(db) = &settings.state {
            record(db, &memory, &report, settings.retain, settings.interval).await;
        }
        if settings.notify.as_ref().is_some_and(|s| s.terminal) && !events.is_empty() {
            let (audit, metrics) = (fleet.audit.as_ref(), service.metrics.as_ref());
            // This cycle's actions are done and recorded; a signal still
            // ends the run at once.
            tokio::select! {
                _ = crate::notify::terminal::tell(fleet, n, &events, &mut terminals, audit, metrics) => {}
                _ = term.recv() => { signalled = true; break },
                _ = interrupt.recv() => { signalled = true; break },
            }
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
        if !emit(&report, settings.format, !settings.quiet) {
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
                                if service.elector.is_some() {
                                    // The election's options stay as the run began.
                                    for f in &mut fleets {
                                        f.set_fencing(&fencing);
                                    }
                                }
                                // Unchanged channels keep their queues and rate limits.
                                if new.settings.notify != settings.notify {
                                    if let Some(old) = notifier.take() {
                                        draining.push(tokio::spawn(old.close(DRAIN)));
                                    }
                                    notifier = self::notifier(&new.settings, &fleets, &service);
                                }
                                settings = new.settings;
                                memory.ladder = Ladder::restore(settings.grace.clone(), memory.ladder.export());
                                kept.extend(new.keep);
                                tracing::info!(hosts = fleets.first().map_or(0, |f| f.hosts.len()), "configuration reloaded");
                                complain("configuration reloaded");
                            }
                            Err(e) => complain(&format!("configuration not reloaded, the old one is kept: {}", error::chain(&e))),
                        }
                        notify(&[sd_notify::NotifyState::Ready]);
                    }
                }
            }
        };
        if stop {
            signalled = true;
            break;
        }
    }
    notify(&[sd_notify::NotifyState::Stopping]);
    if let Some(elector) = service.elector.take() {
        // Another box may lead at once.
        let _ = tokio::time::timeout(DRAIN_SIGNALLED, elector.leave()).await;
    }
    if let Some(tell) = notifier {
        // A signal is honoured within 2 s; a run that ends by itself (cron)
        // lets its mail go first.
        tell.close(if signalled { DRAIN_SIGNALLED } else { DRAIN })
            .await;
    }
    let within = if signalled { DRAIN_SIGNALLED } else { DRAIN };
    let _ = tokio::time::timeout(within, futures::future::join_all(draining)).await;
    for fleet in &fleets {
        for (host, e) in fleet.close().await {
            tracing::warn!(%host, error = %error::chain(&e), "closing the host's connection failed");
        }
    }
    drop(kept);
    Ok(ending)
}

/// The (device, environment) pairs `outcomes` detached, by host: one pass.
fn detached_by_host(
    outcomes: &[crate::outcome::Outcome],
) -> std::collections::HashMap<
    &crate::model::HostId,
    std::collections::HashSet<(crate::model::GpuIndex, crate::model::EnvId)>,
> {
    use crate::outcome::{DetachResult, Outcome};
    let mut by_host: std::collections::HashMap<_, std::collections::HashSet<_>> =
        std::collections::HashMap::new();
    for o in outcomes {
        if let Outcome::Detach {
            host,
            device,
            eid,
            outcome: DetachResult::Detached,
        } = o
        {
            by_host
                .entry(host)
                .or_default()
                .insert((*device, eid.clone()));
        }
    }
    by_host
}

/// Sharded: our hosts' part, for the other shards' next cycle, without
/// what this cycle detached (said when it cannot be published).
async fn publish(
    elector: &crate::ha::Elector,
    parts: Vec<crate::rules::shards::Published>,
    report: &CycleReport,
) {
    let detached = detached_by_host(&report.outcomes);
    let none = std::collections::HashSet::new();
    let part = parts
        .into_iter()
        .map(|p| {
            let gone = detached.get(&p.host).unwrap_or(&none);
            p.without(gone)
        })
        .collect();
    if let Err(e) = elector.publish(part).await {
        complain(&format!(
            "ha: this shard's part is not published: {}",
            error::chain(&e)
        ));
    }
}

/// What a run starts from: where the last run left off (`--state-db`: no
/// warning twice, no deadline moved, idle windows and orphans kept), or
/// afresh, said, when that cannot be read.
fn remembered(settings: &Settings) -> Memory {
    let mut memory = Memory {
        ladder: Ladder::new(settings.grace.clone()),
        ..Memory::default()
    };
    let Some(db) = &settings.state else {
        return memory;
    };
    match db.idle() {
        Ok(idle) => memory.idle = idle,
        Err(e) => complain(&format!(
            "{}: the idle windows start afresh",
            error::chain(&e)
        )),
    }
    match (db.ladder(), db.orphans()) {
        (Ok(saved), Ok(orphans)) => {
            memory.ladder = Ladder::restore(settings.grace.clone(), saved);
            memory.orphans = orphans;
        }
        (Err(e), _) | (_, Err(e)) => {
            complain(&format!("{}: starting afresh", error::chain(&e)));
        }
    }
    memory
}

/// The notification channels of `settings`, started; a channel that
/// cannot start is said and the others run.
fn notifier(settings: &Settings, fleets: &[Fleet], service: &Service) -> Option<Notifier> {
    let spec = settings.notify.as_ref()?;
    let audit = fleets.first().and_then(|f| f.audit.clone());
    match Notifier::start(spec, audit, service.metrics.clone()) {
        Ok(n) => Some(n),
        Err(e) => {
            complain(&format!("{}: no notifications", error::chain(&e)));
            None
        }
    }
}

/// Writes the cycle of `report` to `db`, off the async workers; a failure
/// is said and enforcement goes on.
async fn record(
    db: &Arc<StateDb>,
    memory: &Memory,
    report: &CycleReport,
    retain: Duration,
    interval: Duration,
) {
    let db = Arc::clone(db);
    let ladder = memory.ladder.export();
    let orphans = memory.orphans.clone();
    let idle = memory.idle.clone();
    let (events, outcomes, usage) = (
        report.events.clone(),
        crate::outcome::attributed(&report.plan, &report.outcomes),
        report.usage.clone(),
    );
    let ms = crate::clock::millis;
    let retain = ms(retain);
    // Two intervals (and a slow cycle) between samples still count.
    let max_gap = ms(if interval.is_zero() {
        crate::state_db::MAX_SAMPLE_GAP
    } else {
        interval * 2 + Duration::from_secs(60)
    });
    let now = crate::clock::now_ms();
    let written = crate::host::off_workers("recording the cycle", move || {
        db.record(
            now, &ladder, &orphans, &idle, &events, &outcomes, &usage, retain, max_gap,
        )
    })
    .await;
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => complain(&format!("{}: this cycle is not recorded", error::chain(&e))),
        Err(e) => complain(&format!("{}: this cycle is not recorded", error::chain(&e))),
    }
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

/// SIGHUP: the same command line `args` resolved again, so that the
/// inventory (or hostfile) and the audit log are read and opened anew.
pub fn reloader(args: Vec<std::ffi::OsString>) -> Reload {
    Box::new(move || {
        let cli = Cli::try_parse_from(&args)?;
        match setup::job(cli)? {
            Job::Enforce {
                fleets,
                settings,
                control_dir,
                ..
            } => Ok(Reloaded {
                fleets,
                settings,
                keep: control_dir,
            }),
            Job::Snapshot(_) | Job::Report(_) | Job::Doctor { .. } | Job::Docs(_) => {
                Err(ReloadError::NotEnforcing)
            }
        }
    })
}

/// `==> file <==` before each file's report, as `head` does.
pub fn header(fleet: &Fleet, n: u64) -> String {
    let name = match fleet.hosts.first() {
        Some(Host::Recorded(r)) => r.path.display().to_string(),
        Some(h) => h.id().to_string(),
        None => String::new(),
    };
    format!("{}==> {name} <==", if n > 1 { "\n" } else { "" })
}
