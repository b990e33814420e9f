//! The long-running service around cycles: the loop at `--interval`,
//! SIGTERM and SIGINT, SIGHUP's reload (hosts that did not change keep
//! their connections), systemd's readiness and watchdog, and how a run
//! ends (its exit status).

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use thiserror::Error;
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::cli::Cli;
use crate::config::Settings;
use crate::config_file;
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
    /// `--view-socket`, `--metrics-listen`: each cycle's view, put up for
    /// `status` and `top`.
    pub view: Option<crate::view_socket::Board>,
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
    /// It runs another command (`remote enforce`, `enforce`): a file
    /// that named hosts no longer does, or the other way round.
    #[error("it runs `{to}`, not `{from}`: only a restart can change that")]
    Command { from: String, to: String },
    /// It changes settings that only a restart can change.
    #[error("{} cannot change without a restart (systemctl restart genv-enforce)", .0.join(", "))]
    NeedsRestart(Vec<String>),
}

/// A configuration read again.
pub struct Reloaded {
    pub fleets: Vec<Fleet>,
    pub settings: Settings,
    /// The digest of the configuration reloaded, under `--ha-etcd`.
    pub digest: Option<String>,
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
    fleets: Vec<Fleet>,
    settings: Settings,
    service: Service,
) -> std::io::Result<Ending> {
    let mut run = Run::new(fleets, settings, service)?;
    let each = run.fleets.len() > 1;
    let mut ending = Ending::Clean;
    for n in 1.. {
        let i = if each { n as usize - 1 } else { 0 };
        let Some(fleet) = run.fleets.get(i) else {
            break;
        };
        if each && run.settings.format == Format::Text && !print_stdout(&[header(fleet, n)]) {
            break;
        }
        let Ok(follower) = run.stand().await else {
            break;
        };
        let Some((report, abort)) = run.cycle(i, n, follower).await else {
            break;
        };
        if !run.tell(i, n, &report).await {
            break;
        }
        if n == 1 {
            notify(&[sd_notify::NotifyState::Ready]);
        }
        notify(&[sd_notify::NotifyState::Watchdog]);
        let go_on;
        (ending, go_on) = ended(ending, &report, abort, &run.settings);
        // Freed in the blocking pool: a fleet's report holds every host's
        // snapshot, findings and plan, and the next cycle need not wait.
        tokio::task::spawn_blocking(move || drop(report));
        if !go_on || (!each && (run.settings.interval.is_zero() || run.wait().await)) {
            break;
        }
    }
    run.finish().await;
    Ok(ending)
}

/// How a run stands after a cycle's `report` is printed (per `settings`),
/// and whether it goes on: `-e`'s abort and a reader gone end it.
fn ended(ending: Ending, report: &CycleReport, abort: bool, settings: &Settings) -> (Ending, bool) {
    if abort {
        // genv raises on the first failure whatever -q says.
        let _ = emit(report, settings.format, true);
        return (Ending::Aborted, false);
    }
    let ending = if report.failed() {
        Ending::Errors
    } else if report.dry_run && !report.violations.is_empty() && ending == Ending::Clean {
        Ending::Violations
    } else {
        ending
    };
    if !emit(report, settings.format, !settings.quiet) {
        // The reader is gone (`| head`): an ending it asked for, not a
        // finding to report.
        let ending = if ending == Ending::Violations {
            Ending::Clean
        } else {
            ending
        };
        return (ending, false);
    }
    (ending, true)
}

/// SIGTERM and SIGINT (either ends the run), SIGHUP (a reload).
struct Signals {
    term: Signal,
    interrupt: Signal,
    hangup: Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// When SIGTERM or SIGINT comes.
    async fn stop(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }

    /// When SIGTERM or SIGINT (`true`) or SIGHUP (`false`) comes.
    async fn stop_or_reload(&mut self) -> bool {
        tokio::select! {
            _ = self.term.recv() => true,
            _ = self.interrupt.recv() => true,
            _ = self.hangup.recv() => false,
        }
    }
}

/// A signal ended the run.
struct Stopped;

/// A run's state between cycles.
struct Run {
    fleets: Vec<Fleet>,
    settings: Settings,
    service: Service,
    signals: Signals,
    /// Half systemd's watchdog interval, if it watches us.
    watchdog: Option<Duration>,
    memory: Memory,
    notifier: Option<Notifier>,
    /// Channels replaced by a reload, letting their queues go.
    draining: Vec<tokio::task::JoinHandle<()>>,
    repeats: crate::notify::Repeats,
    terminals: crate::notify::limit::RateLimit,
    /// High availability: the fence every fleet's hosts carry, and where
    /// this box stood last cycle.
    fencing: crate::host::fence::Fencing,
    standing: Option<crate::ha::Standing>,
    /// What must live as long as reloaded hosts (their socket directory).
    kept: Vec<tempfile::TempDir>,
    signalled: bool,
}

impl Run {
    fn new(fleets: Vec<Fleet>, settings: Settings, service: Service) -> std::io::Result<Self> {
        let mut usec = 0;
        let watchdog = sd_notify::watchdog_enabled(false, &mut usec)
            .then(|| Duration::from_micros(usec / 2).max(Duration::from_millis(500)));
        let fencing = fleets
            .first()
            .map(|f| f.fencing.clone())
            .unwrap_or_default();
        Ok(Run {
            signals: Signals::new()?,
            watchdog,
            memory: remembered(&settings),
            notifier: notifier(&settings, &fleets, &service),
            draining: Vec::new(),
            repeats: crate::notify::Repeats::default(),
            terminals: crate::notify::limit::RateLimit::new(
                settings.notify.as_ref().map_or(0, |s| s.per_user_hour),
            ),
            fencing,
            standing: None,
            kept: Vec::new(),
            signalled: false,
            fleets,
            settings,
            service,
        })
    }

    /// Under `--ha-etcd`, where this box stands: only the leader acts,
    /// another box's cycle is a dry run (these options) whose ladder moves
    /// nothing (a takeover warns afresh).
    async fn stand(&mut self) -> Result<Option<crate::cycle::Options>, Stopped> {
        let Some(elector) = &self.service.elector else {
            return Ok(None);
        };
        let looked = std::time::Instant::now();
        let look = tokio::select! {
            s = elector.look() => s,
            () = self.signals.stop() => {
                self.signalled = true;
                return Err(Stopped);
            }
        };
        tracing::debug!(
            ms = looked.elapsed().as_secs_f64() * 1e3,
            "etcd: standing looked up"
        );
        let crate::ha::election::Look {
            standing: now,
            others,
            until,
            configs,
        } = look;
        if now.leads() {
            told_if_configs_differ(elector, &configs);
        }
        self.memory.others = others;
        self.fencing
            .set(if now.leads() { now.epoch() } else { None }, until);
        let took_over = now.leads() && !self.standing.as_ref().is_some_and(|s| s.leads());
        if self.standing.as_ref().is_none_or(|s| s.changed(&now)) {
            tracing::info!(standing = %now.describe(), "high availability");
            complain(&format!("ha: {}", now.describe()));
        }
        if let Some(m) = &self.service.metrics {
            m.standing(&now, took_over);
        }
        let follower = (!now.leads()).then(|| crate::cycle::Options {
            dry_run: true,
            follows: true,
            ..self.settings.cycle.clone()
        });
        self.standing = Some(now);
        Ok(follower)
    }

    /// Cycle `n` over fleet `i` (as a follower, under its options); `None`
    /// when a signal ended it. A leader publishes its shard's part; a
    /// refused fence steps it down.
    async fn cycle(
        &mut self,
        i: usize,
        n: u64,
        mut follower: Option<crate::cycle::Options>,
    ) -> Option<(CycleReport, bool)> {
        let view = self.service.view.is_some();
        self.settings.cycle.view = view;
        if let Some(f) = &mut follower {
            f.view = view;
        }
        let options = follower.as_ref().unwrap_or(&self.settings.cycle);
        let (report, abort) = tokio::select! {
            r = cycle(&self.fleets[i], options, n, &mut self.memory) => r,
            () = self.signals.stop() => {
                self.signalled = true;
                return None;
            }
        };
        if let (None, Some(elector)) = (&follower, &self.service.elector) {
            publish(elector, std::mem::take(&mut self.memory.published), &report).await;
        }
        if let (Some(elector), Some(refusal)) = (&self.service.elector, self.fencing.take_refusal())
        {
            // Another leader has acted on a host since this cycle began,
            // or this box's lease ended meanwhile: it no longer leads.
            self.fencing.set(None, None);
            complain(&format!("ha: {refusal}; stepping down"));
            if let (Some(m), crate::ha::Refusal::Fenced { .. }) = (&self.service.metrics, &refusal)
            {
                m.fenced();
            }
            elector.step_down().await;
            self.standing = None;
        }
        Some((report, abort))
    }

    /// `report` told: the metrics, the notification channels, the state
    /// database, the owners' terminals on fleet `i`'s hosts; `false` when
    /// a signal came meanwhile.
    async fn tell(&mut self, i: usize, n: u64, report: &CycleReport) -> bool {
        if let Some(m) = &self.service.metrics {
            m.observe(report);
            if let Some(log) = &self.fleets[i].audit {
                m.audit(log.degraded().is_some());
            }
        }
        let mut events = Vec::new();
        if let Some(tell) = &self.notifier {
            events = crate::notify::told(&report.events, &report.outcomes);
            events.extend(
                self.repeats
                    .fresh(crate::notify::told(&report.at_once, &report.outcomes)),
            );
            tell.send(n, &events);
        }
        // Put up once the channels took this cycle's events: what they
        // held back is in it.
        if let (Some(board), Some(written)) = (&self.service.view, self.memory.view.take()) {
            let channels = self.notifier.as_ref().map(Notifier::view);
            let extra = match channels {
                Some(notifications) if !notifications.is_empty() => {
                    #[derive(serde::Serialize)]
                    struct Extra {
                        notifications: Vec<crate::view::ChannelView>,
                    }
                    crate::view_json::members(&Extra { notifications })
                }
                _ => Default::default(),
            };
            board.publish(written, extra);
        }
        if let Some(db) = &self.settings.state {
            let (retain, interval) = (self.settings.retain, self.settings.interval);
            record(db, &self.memory, report, retain, interval).await;
        }
        if self.settings.notify.as_ref().is_some_and(|s| s.terminal) && !events.is_empty() {
            let fleet = &self.fleets[i];
            let (audit, metrics) = (fleet.audit.as_ref(), self.service.metrics.as_ref());
            // This cycle's actions are done and recorded; a signal still
            // ends the run at once.
            let terminals = &mut self.terminals;
            let link = self
                .settings
                .notify
                .as_ref()
                .and_then(|s| s.link.as_deref());
            tokio::select! {
                _ = crate::notify::terminal::tell(fleet, n, &events, terminals, link, audit, metrics) => {}
                () = self.signals.stop() => {
                    self.signalled = true;
                    return false;
                }
            }
        }
        true
    }

    /// Waits out the interval, telling systemd's watchdog meanwhile and
    /// reloading on SIGHUP (a reloaded interval counts from the wait's
    /// start: `30s` changed to `2s` is due 2 s after the last cycle, not
    /// 30); `true` when a signal ends the run.
    async fn wait(&mut self) -> bool {
        let start = tokio::time::Instant::now();
        let mut wake = start + self.settings.interval;
        loop {
            let tick = self
                .watchdog
                .map_or(wake, |w| wake.min(tokio::time::Instant::now() + w));
            tokio::select! {
                _ = tokio::time::sleep_until(tick) => {
                    notify(&[sd_notify::NotifyState::Watchdog]);
                    if tick >= wake {
                        return false;
                    }
                }
                stop = self.signals.stop_or_reload() => {
                    if stop {
                        self.signalled = true;
                        return true;
                    }
                    self.reload().await;
                    wake = start + self.settings.interval;
                }
            }
        }
    }

    /// SIGHUP: the configuration read again; an error keeps the old one.
    async fn reload(&mut self) {
        let Some(reload) = self.service.reload.as_mut() else {
            return;
        };
        notify(&[sd_notify::NotifyState::Reloading]);
        match reload() {
            Ok(new) => {
                let old = std::mem::take(&mut self.fleets);
                self.fleets = merge(old, new.fleets).await;
                if let Some(elector) = &self.service.elector {
                    elector.set_config(new.digest.unwrap_or_default());
                    // The election's options stay as the run began.
                    for f in &mut self.fleets {
                        f.set_fencing(&self.fencing);
                    }
                }
                // Unchanged channels keep their queues and rate limits.
                if new.settings.notify != self.settings.notify {
                    if let Some(old) = self.notifier.take() {
                        self.draining.push(tokio::spawn(old.close(DRAIN)));
                    }
                    self.notifier = notifier(&new.settings, &self.fleets, &self.service);
                }
                // The state database stays the one opened at start.
                self.settings = Settings {
                    state: self.settings.state.take(),
                    ..new.settings
                };
                self.memory.ladder.regrace(self.settings.grace.clone());
                self.kept.extend(new.keep);
                tracing::info!(
                    hosts = self.fleets.first().map_or(0, |f| f.hosts.len()),
                    "configuration reloaded"
                );
                complain("configuration reloaded");
                self.audit_reload(None);
            }
            Err(e) => {
                let why = error::chain(&e);
                tracing::warn!(error = %why, "configuration not reloaded, the old one is kept");
                complain(&format!(
                    "configuration not reloaded, the old one is kept: {why}"
                ));
                self.audit_reload(Some(&why));
            }
        }
        notify(&[sd_notify::NotifyState::Ready]);
    }

    /// A reload in the audit log, if the run keeps one.
    fn audit_reload(&self, refused: Option<&str>) {
        let Some(audit) = self.fleets.first().and_then(|f| f.audit.as_ref()) else {
            return;
        };
        if let Err(e) = audit.reload(0, refused) {
            complain(&format!("audit log: {e}"));
        }
    }

    /// The end of a run: the election left, the notifications let go (a
    /// signal is honoured within 2 s; a run that ends by itself, cron, lets
    /// its mail go first), every host closed.
    async fn finish(mut self) {
        notify(&[sd_notify::NotifyState::Stopping]);
        if let Some(elector) = self.service.elector.take() {
            // Another box may lead at once.
            let _ = tokio::time::timeout(DRAIN_SIGNALLED, elector.leave()).await;
        }
        let within = if self.signalled {
            DRAIN_SIGNALLED
        } else {
            DRAIN
        };
        if let Some(tell) = self.notifier.take() {
            tell.close(within).await;
        }
        let _ = tokio::time::timeout(within, futures::future::join_all(self.draining)).await;
        for fleet in &self.fleets {
            fleet.close_said().await;
        }
        drop(self.kept);
    }
}

/// Sharded: our hosts' part, for the other shards' next cycle, without
/// what this cycle detached and terminated (said when it cannot be published).
async fn publish(
    elector: &crate::ha::Elector,
    parts: Vec<crate::rules::shards::Published>,
    report: &CycleReport,
) {
    let freed = crate::outcome::freed_by_host(&report.outcomes);
    let none = crate::outcome::Freed::default();
    let part = parts
        .into_iter()
        .map(|p| {
            let (detached, ended) = freed.get(&p.host).unwrap_or(&none);
            p.without(detached, ended)
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
pub(crate) fn remembered(settings: &Settings) -> Memory {
    let mut memory = Memory::default();
    let mut saved = Vec::new();
    if let Some(db) = &settings.state {
        match db.idle() {
            Ok(idle) => memory.idle = idle,
            Err(e) => complain(&format!(
                "{}: the idle windows start afresh",
                error::chain(&e)
            )),
        }
        match (db.ladder(), db.orphans(), db.in_line(), db.unusable()) {
            (Ok(ladder), Ok(orphans), Ok(in_line), Ok(unusable)) => {
                saved = ladder;
                memory.orphans = orphans;
                memory.in_line = in_line;
                memory.unusable = unusable;
            }
            (Err(e), ..) | (_, Err(e), ..) | (_, _, Err(e), _) | (.., Err(e)) => {
                complain(&format!("{}: starting afresh", error::chain(&e)));
            }
        }
    }
    // The run's one ladder: a reload changes its graces, a follower's
    // cycle puts it back as it was.
    memory.ladder = Ladder::restore(settings.grace.clone(), saved);
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
    let in_line = memory.in_line.clone();
    let unusable = memory.unusable.clone();
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
            now, &ladder, &orphans, &in_line, &unusable, &idle, &events, &outcomes, &usage, retain,
            max_gap,
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

/// A leader whose configuration is not every other box's says so, each
/// cycle: the boxes would not act alike when another one leads.
fn told_if_configs_differ(elector: &crate::ha::Elector, configs: &[(String, String)]) {
    let own = elector.config();
    let name = &elector.spec().name;
    let others = crate::ha::differing(name, &own, configs);
    if others.is_empty() {
        return;
    }
    let list: Vec<String> = others
        .iter()
        .map(|(n, d)| format!("{n} runs {d}"))
        .collect();
    let said = format!(
        "ha: this box ({name}) leads with configuration {own}, and {}: run the same configuration on every box (`genv-enforce config check --effective` shows each value)",
        list.join(", ")
    );
    tracing::warn!("{said}");
    complain(&said);
}

/// SIGHUP: the same command line `args` resolved again, with the
/// configuration file read anew, whole, so that the file, the inventory
/// (or hostfile) and the audit log are read and opened anew. A file that
/// fails its check, or changes a setting only a restart can change
/// ([`config_file::restart_keys`]), is refused whole.
pub fn reloader(line: setup::CommandLine) -> Reload {
    let root = <Cli as clap::CommandFactory>::command();
    let restart = config_file::restart_keys();
    let running = config_file::values_of(&root, &line.run, &restart);
    Box::new(move || {
        let run = setup::config_args(line.typed.clone())?;
        let (from, to) = (
            config_file::command_of(&root, &line.run).join(" "),
            config_file::command_of(&root, &run).join(" "),
        );
        if from != to {
            return Err(ReloadError::Command { from, to });
        }
        let now = config_file::values_of(&root, &run, &restart);
        let changed: Vec<String> = now
            .iter()
            .filter(|(k, v)| running.get(*k) != Some(*v))
            .map(|(k, _)| k.clone())
            .collect();
        if !changed.is_empty() {
            return Err(ReloadError::NeedsRestart(changed));
        }
        let cli = Cli::try_parse_from(&run)?;
        match setup::job_again(cli)? {
            Job::Enforce {
                fleets,
                settings,
                control_dir,
                ..
            } => Ok(Reloaded {
                digest: settings.ha.is_some().then(|| setup::config_digest(&run)),
                fleets,
                settings,
                keep: control_dir,
            }),
            Job::Snapshot(_)
            | Job::Report(_)
            | Job::Status(_)
            | Job::Top(_)
            | Job::Doctor { .. }
            | Job::Docs(_) => Err(ReloadError::NotEnforcing),
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
