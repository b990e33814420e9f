//! One cycle: every host's snapshot, the assessment, the plan carried out
//! (unless a dry run), the report. The loop around it is in
//! [`service`](crate::service).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::assess;
use crate::clock::{millis, now_ms};
use crate::error;
use crate::fleet::{Fleet, Own};
use crate::ladder::{Ladder, Waiting};
use crate::model::{FailureKind, HostFailure, HostId, Mode};
use crate::outcome::{self, Outcome};
use crate::plan::{HostPlan, Plan, Termination};
use crate::report::{CycleReport, Timing};
use crate::rules::shards::{Published, Shards};
use crate::rules::taking::BLIND_AFTER;
use crate::rules::{HeldOrder, IdleHistory, InLine, Moment, Orphans, Policy, Starts};

/// What one cycle is told of the run (built by `config`).
#[derive(Debug, Clone)]
pub struct Options {
    /// genv's local or remote wording.
    pub mode: Mode,
    pub policy: Policy,
    /// Report the plan, carry out nothing.
    pub dry_run: bool,
    /// A follower in high availability: a dry run that reads the ladder
    /// and leaves it as it was, so it warns, clears and tells nothing.
    pub follows: bool,
    /// genv's `-e`: abort before enforcing anything when a host fails.
    pub exit_on_error: bool,
    /// SIGKILL what still runs this long after its SIGTERM.
    pub kill_after: Option<Duration>,
    /// Whether the cycle samples who uses what (for `--state-db` and the
    /// per-user metrics).
    pub sample_usage: bool,
    /// The longest time between two readings of a process that keeps its
    /// idle window: the run's gap between sightings, an hour for cron runs
    /// (a paused cron or an unreachable host saw nothing meanwhile).
    pub idle_gap: Duration,
    /// Whether the report carries the cycle's view (a view is served).
    pub view: bool,
}

/// What a run carries from one cycle to the next.
#[derive(Debug, Default)]
pub struct Memory {
    /// Each action's progress: seen in a row, warned, due (`--grace`,
    /// `--confirm-cycles`).
    pub ladder: Ladder,
    /// Each host's processes seen orphaned: strays for life (a record that
    /// appears later with their id does not make them members).
    pub orphans: HashMap<HostId, Orphans>,
    /// Each process's idle window (the idle rule).
    pub idle: IdleHistory,
    /// Since when each job is in line on each device (the group caps'
    /// order).
    pub in_line: InLine,
    /// The group caps' order while their picks are held (and for the
    /// cycle that works them out again).
    pub held_order: Option<HeldOrder>,
    /// `--shard`: the other shards' parts of the device caps, read before
    /// the cycle.
    pub others: Vec<Published>,
    /// `--shard`: our hosts' parts, to publish after the cycle.
    pub published: Vec<Published>,
    /// Each host's cycles in a row with its genv state unusable (a host
    /// that failed keeps its count): from [`BLIND_AFTER`], its jobs that
    /// cannot be judged are taken under the caps.
    pub unusable: HashMap<HostId, u32>,
    /// The last cycle's view, written, where [`Options::view`] asks for it
    /// (taken by the service to serve).
    pub view: Option<crate::view_json::Written>,
    /// What writes the views, kept from cycle to cycle.
    pub view_writer: crate::view_json::Writer,
}

impl Memory {
    /// The hosts unusable [`BLIND_AFTER`] cycles in a row or more.
    fn blind(&self) -> Vec<HostId> {
        (self.unusable.iter())
            .filter(|(_, n)| **n >= BLIND_AFTER)
            .map(|(h, _)| h.clone())
            .collect()
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
    options: &Options,
    n: u64,
    memory: &mut Memory,
) -> (CycleReport, bool) {
    let start = Instant::now();
    let now = now_ms();
    let policy = Arc::new(options.policy.clone());
    let (rounds, orphans) = snapshots(fleet, options, n, &policy, memory, now).await;
    let mut timing = Timing {
        snapshot_ms: millis(start.elapsed()),
        ..Timing::default()
    };
    let mut g = gather(rounds, &orphans, &mut timing, memory);
    // Only a group cap orders by who came last: none, nothing to keep.
    let grouped = !options.policy.max_devices_per_group.is_empty();
    if grouped {
        let fleet_hosts: std::collections::HashSet<&HostId> =
            g.results.iter().map(|(h, _)| h).collect();
        memory.in_line.keep_hosts(|h| fleet_hosts.contains(h));
        for (host, r) in &mut g.results {
            if let Ok((snap, findings)) = r {
                memory.in_line.update(host, snap, &mut findings.usage, now);
            }
        }
    }
    if let Some(order) = &memory.held_order {
        for (host, r) in &mut g.results {
            if let Ok((_, findings)) = r {
                order.restore(host, &mut findings.usage);
            }
        }
    }
    let starts = if grouped {
        Starts::of((g.results.iter()).filter_map(|(h, r)| Some((h, &r.as_ref().ok()?.1.usage))))
    } else {
        Starts::default()
    };
    let abort = options.exit_on_error && g.results.iter().any(|(_, r)| r.is_err());
    if !abort {
        let gap = Some(options.idle_gap);
        memory.idle = assess::track_idle(&memory.idle, &policy, &g.results, now, gap);
    }
    memory.published = published(fleet, &g.results, &memory.unusable);
    // What the device caps count on each host, for the view: ours, and
    // (`--shard`) the other shards', as the caps count them.
    let counted: Vec<(HostId, crate::view::Counted)> = if options.view {
        let ours = (g.results.iter()).filter_map(|(h, r)| {
            let (snap, findings) = r.as_ref().ok()?;
            Some((
                h.clone(),
                crate::view::counted(&findings.usage, Some(snap), &policy),
            ))
        });
        let theirs = (memory.others.iter()).map(|p| {
            (
                p.host.clone(),
                crate::view::counted(&p.usage, None, &policy),
            )
        });
        ours.chain(theirs).collect()
    } else {
        Vec::new()
    };
    let assessed = Instant::now();
    let found = (std::mem::take(&mut g.results), std::mem::take(&mut g.own));
    let mut a = assessed_off_workers(fleet, options, n, abort, found, policy, memory, now).await;
    let kept = options.follows.then(|| memory.ladder.clone());
    let elsewhere = memory.others.iter().any(|p| p.held);
    let ladder = &mut memory.ladder;
    let (mut events, hold) = laddered(&mut a, ladder, &mut g.early, (now, elsewhere), abort);
    let parts = std::mem::take(&mut memory.published);
    (memory.published, memory.held_order) =
        kept_for_next(&a, hold, parts, starts, memory.held_order.take());
    if let Some(ladder) = kept {
        memory.ladder = ladder;
        events = Default::default();
    }
    audit_cycle(fleet, n, options.mode, &a, &events.0);
    timing.assess_ms = millis(assessed.elapsed());
    let dispatched = Instant::now();
    if options.dry_run {
        g.outcomes = outcome::dry_run(&a.plan);
    } else if !abort {
        let more = carry_out(fleet, options, n, &a.plan, &g.done, &g.outcomes).await;
        g.outcomes.extend(more);
    }
    timing.dispatch_ms = millis(dispatched.elapsed());
    timing.total_ms = millis(start.elapsed());
    let writer = options
        .view
        .then_some((&mut memory.view_writer, counted.as_slice()));
    let (report, view) = reported(fleet, options, a, g.outcomes, timing, events, writer);
    memory.view = view;
    (report, abort)
}

/// The cycle's report: `a` with its outcomes, ladder events (and what was
/// acted on at once), timing and usage samples; and its view, written by
/// `writer` with what the device caps counted, if asked.
fn reported(
    fleet: &Fleet,
    options: &Options,
    mut a: assess::Assessment,
    outcomes: Vec<Outcome>,
    timing: Timing,
    (events, at_once): (Vec<crate::ladder::Event>, Vec<crate::ladder::Event>),
    writer: Option<(
        &mut crate::view_json::Writer,
        &[(HostId, crate::view::Counted)],
    )>,
) -> (CycleReport, Option<crate::view_json::Written>) {
    for (status, host) in a.hosts.iter_mut().zip(&fleet.hosts) {
        status.recorded = host.is_recorded();
    }
    // A replay's report is the same every time: no clock in it.
    let recorded = fleet.is_recorded();
    let timing = (!recorded).then_some(timing);
    let usage = if options.sample_usage {
        crate::report::samples(&a.cluster)
    } else {
        Vec::new()
    };
    let cluster = writer.is_some().then(|| crate::model::Cluster {
        mode: a.cluster.mode,
        hosts: std::mem::take(&mut a.cluster.hosts),
    });
    let mut report = CycleReport::new(a, outcomes, timing);
    report.events = events;
    report.at_once = at_once;
    report.usage = usage;
    let view = cluster.zip(writer).map(|(cluster, (writer, counted))| {
        let at = (!recorded).then(now_ms);
        writer.write(&report, &cluster, counted, &options.policy, at)
    });
    (report, view)
}

/// Every host's snapshot and own findings; what a host's own findings
/// decide is carried out on it at once (not with `-e`, where nothing is
/// enforced before every host has answered, nor in a dry run). Also the
/// orphans known before, taken out of `memory` (see [`gather`]).
async fn snapshots(
    fleet: &Fleet,
    options: &Options,
    n: u64,
    policy: &Arc<Policy>,
    memory: &mut Memory,
    now: u64,
) -> (Vec<crate::fleet::Round>, Arc<HashMap<HostId, Orphans>>) {
    let early = !options.dry_run && !options.exit_on_error;
    let held: &Ladder = &memory.ladder;
    let own = |host: &_, plan: HostPlan| {
        let early = early.then(|| held.split_host(host, &plan, now));
        Own { plan, early }
    };
    let orphans = Arc::new(std::mem::take(&mut memory.orphans));
    let rounds = fleet
        .snapshots_and(n, policy, &orphans, own)
        .instrument(tracing::info_span!("snapshot", cycle = n))
        .await;
    (rounds, orphans)
}

/// What the hosts' rounds gave: what was carried out early, its outcomes,
/// each host's result, the own plans of those that answered (in host
/// order), and the ladder's split of each own plan acted on early.
struct Gathered {
    done: Plan,
    outcomes: Vec<Outcome>,
    results: Vec<(HostId, assess::HostResult)>,
    own: Vec<HostPlan>,
    early: Early,
}

/// A host's cycles in a row with its genv state unusable, after one whose
/// snapshot had usable state (`Some(true)`), unusable (`Some(false)`), or
/// failed (`None`: the streak stays as it was).
fn unusable_streak(before: u32, usable: Option<bool>) -> u32 {
    match usable {
        Some(true) => 0,
        Some(false) => before.saturating_add(1),
        None => before,
    }
}

/// Each host's own plan as the ladder split it beside its snapshot.
pub(crate) type Early = HashMap<HostId, (HostPlan, Vec<Waiting>)>;

/// The rounds' timings into `timing`, their orphans into `memory` (a host
/// that failed keeps what it had; a host no longer in the fleet is
/// forgotten), their results in host order.
fn gather(
    rounds: Vec<crate::fleet::Round>,
    before: &HashMap<HostId, Orphans>,
    timing: &mut Timing,
    memory: &mut Memory,
) -> Gathered {
    let mut done = Plan::default();
    let mut outcomes = Vec::new();
    let mut results = Vec::new();
    let mut own = Vec::new();
    let mut early = Early::new();
    let mut unusable = HashMap::new();
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
        if let Some(due) = round.own.due().filter(|d| !d.is_empty()) {
            done.hosts.push((round.host.clone(), due.clone()));
        }
        if let Some(split) = round.own.early {
            early.insert(round.host.clone(), split);
        }
        outcomes.extend(round.outcomes);
        let mut result = round.result.map_err(|e| e.failure());
        let orphans = match &mut result {
            Ok((_, findings)) => {
                own.push(round.own.plan);
                Some(std::mem::take(&mut findings.orphans))
            }
            // Unseen this cycle: what it had is kept.
            Err(_) => before.get(&round.host).cloned(),
        };
        if let Some(o) = orphans {
            memory.orphans.insert(round.host.clone(), o);
        }
        let before = memory.unusable.get(&round.host).copied().unwrap_or(0);
        let usable = result
            .as_ref()
            .ok()
            .map(|(s, _)| s.state_problem().is_none());
        let now = unusable_streak(before, usable);
        if now > 0 {
            unusable.insert(round.host.clone(), now);
        }
        results.push((round.host, result));
    }
    memory.unusable = unusable;
    Gathered {
        done,
        outcomes,
        results,
        own,
        early,
    }
}

/// Sharded: what our hosts hold, for the other shards.
fn published(
    fleet: &Fleet,
    results: &[(HostId, assess::HostResult)],
    unusable: &HashMap<HostId, u32>,
) -> Vec<Published> {
    if fleet.positions.is_empty() {
        return Vec::new();
    }
    results
        .iter()
        .filter_map(|(host, r)| {
            let (_, findings) = r.as_ref().ok()?;
            Some(Published {
                host: host.clone(),
                position: *fleet.positions.get(host)?,
                usage: findings.usage.clone(),
                blind: unusable.get(host).is_some_and(|n| *n >= BLIND_AFTER),
                held: false,
            })
        })
        .collect()
}

/// The caps and the plan over every host, off the async workers; with
/// `-e`'s abort, the hosts' statuses only (genv raises on the first failed
/// host, before any rule runs). A panic there is every host's failure.
#[allow(clippy::too_many_arguments)]
async fn assessed_off_workers(
    fleet: &Fleet,
    options: &Options,
    n: u64,
    abort: bool,
    (results, own): (Vec<(HostId, assess::HostResult)>, Vec<HostPlan>),
    policy: Arc<Policy>,
    memory: &Memory,
    now: u64,
) -> assess::Assessment {
    let (mode, dry_run) = (options.mode, options.dry_run);
    let idle = memory.idle.clone();
    let sharded = !fleet.positions.is_empty();
    let (positions, others) = (fleet.positions.clone(), memory.others.clone());
    let blind = memory.blind();
    // What waits frees no room under the caps that count what others free.
    let ladder = (policy.has_any_cap() && memory.ladder.waits()).then(|| memory.ladder.clone());
    let assessing = crate::host::off_workers("assessing the cycle", move || {
        tracing::info_span!("assess", cycle = n).in_scope(|| {
            if abort {
                let results = results
                    .into_iter()
                    .map(|(h, r)| (h, r.map(|(s, _)| s)))
                    .collect();
                assess::statuses(n, mode, dry_run, results)
            } else {
                let moment = Moment {
                    idle: &idle,
                    now_ms: now,
                    shards: sharded.then_some(Shards {
                        positions: &positions,
                        others: &others,
                    }),
                    blind: &blind,
                };
                let ladder = ladder.as_ref();
                assess::assess_planned(n, mode, dry_run, &policy, results, own, moment, ladder)
            }
        })
    });
    match assessing.await {
        Ok(a) => a,
        Err(e) => {
            let why = HostFailure::new(FailureKind::Internal, error::chain(&e));
            let results = fleet
                .hosts
                .iter()
                .map(|h| (h.id().clone(), Err(why.clone())))
                .collect();
            assess::statuses(n, mode, dry_run, results)
        }
    }
}

/// `a`'s plan split by the ladder into what is due and what waits, each
/// host's once: a host whose whole plan is its own keeps the split made
/// beside its snapshot (`early`); the ladder advanced over the whole plan:
/// the events to tell, and (without a ladder) what was acted on at once.
/// A host that did not answer keeps its actions' progress as it was;
/// `-e`'s abort decides nothing, so nothing moves. What only the caps ask
/// for is held while a pick of theirs waits on an unseen host, ours or
/// (`elsewhere`) another shard's: returns how.
pub(crate) fn laddered(
    a: &mut assess::Assessment,
    ladder: &mut Ladder,
    early: &mut Early,
    (now, elsewhere): (u64, bool),
    abort: bool,
) -> (Events, Hold) {
    // A host whose genv state cannot be used this cycle is as good as
    // unanswered for the waits that need it: none of them moves.
    let unanswered = assess::unusable(&a.hosts);
    let whole = std::mem::take(&mut a.plan);
    let unseen: &[HostId] = if abort { &[] } else { &unanswered };
    let hold = Hold {
        own: ladder.hold_caps(unseen, elsewhere && !abort),
        back: ladder.holds_back(&whole, unseen, now),
    };
    let extended: std::collections::HashSet<&HostId> = a.extended.iter().collect();
    for (host, p) in &whole.hosts {
        let (due, waiting) = match early.remove(host) {
            Some(split) if !extended.contains(host) => split,
            _ => ladder.split_host(host, p, now),
        };
        if !due.is_empty() {
            a.plan.hosts.push((host.clone(), due));
        }
        a.waiting.extend(waiting);
    }
    if abort {
        return (Events::default(), hold);
    }
    let judged: crate::ladder::Judged = (a.cluster.hosts.iter())
        .filter(|(h, _)| !unanswered.contains(h))
        .flat_map(|(h, s)| {
            s.processes.iter().filter_map(move |p| {
                Some(((h.clone(), p.pid, p.start_time?), p.owner.eid().cloned()))
            })
        })
        .collect();
    let events = (
        ladder.advance_seen(&whole, now, &unanswered, &judged),
        ladder.acted_at_once(&a.plan, now),
    );
    (events, hold)
}

/// What a cycle keeps for the next once its ladder has run: its parts
/// (`published`), marked held as `hold` says and soon where the cycle's
/// waits free devices; and the group caps' order while a hold keeps a
/// due pick back (`before`, or this cycle's, taken from `starts` after
/// what the cycle carried out).
pub(crate) fn kept_for_next(
    a: &assess::Assessment,
    hold: Hold,
    published: Vec<Published>,
    starts: Starts,
    before: Option<HeldOrder>,
) -> (Vec<Published>, Option<HeldOrder>) {
    let soon = assess::soon(a);
    let published = (published.into_iter())
        .map(|p| {
            let p = Published {
                held: hold.own,
                ..p
            };
            match soon.get(&p.host) {
                Some(s) => p.mark_soon(s),
                None => p,
            }
        })
        .collect();
    // A due wait kept for an unseen host ends for the order, as a healthy
    // cycle would carry it out.
    let due = a.unseen_due.iter().map(|(h, p)| (h, *p));
    let order = starts.after(a.plan.terminated().chain(due));
    (published, HeldOrder::kept(before, order, hold.back))
}

/// How the caps' picks are held this cycle ([`Ladder::hold_caps`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Hold {
    /// One of ours waits on an unseen host of ours (the other shards hold
    /// theirs next cycle).
    pub own: bool,
    /// A pick due now is kept back: carried out a cycle late.
    pub back: bool,
}

/// A cycle's ladder events, and (without a ladder) what was acted on at
/// once.
type Events = (Vec<crate::ladder::Event>, Vec<crate::ladder::Event>);

/// The cycle's strays, failed hosts and ladder events in the audit log,
/// if there is one (a failed write is logged; enforcement goes on).
fn audit_cycle(
    fleet: &Fleet,
    n: u64,
    mode: Mode,
    a: &assess::Assessment,
    events: &[crate::ladder::Event],
) {
    let Some(log) = &fleet.audit else {
        return;
    };
    if let Err(e) = log.strays(n, mode, &a.notices) {
        tracing::error!(error = %e, "cannot record stray processes in the audit log");
    }
    if let Err(e) = log.failures(n, &a.hosts) {
        tracing::error!(error = %e, "cannot record failed hosts in the audit log");
    }
    if let Err(e) = log.events(n, events) {
        tracing::error!(error = %e, "cannot record warnings in the audit log");
    }
}

/// Carries out what is due of `plan` that the hosts' own rounds (`done`)
/// did not, then `--kill-after`'s SIGKILLs of what the SIGTERMs (`so_far`
/// and these) reached; the new outcomes.
async fn carry_out(
    fleet: &Fleet,
    options: &Options,
    n: u64,
    plan: &Plan,
    done: &Plan,
    so_far: &[Outcome],
) -> Vec<Outcome> {
    let rest = assess::remaining(plan, done);
    let mut outcomes = fleet
        .dispatch(n, &rest)
        .instrument(tracing::info_span!("dispatch", cycle = n))
        .await;
    if let Some(grace) = options.kill_after {
        let all: Vec<Outcome> = so_far.iter().chain(&outcomes).cloned().collect();
        let kills = signalled(plan, &all);
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
    outcomes
}

/// The planned terminations whose SIGTERM was delivered, by host.
fn signalled(plan: &Plan, outcomes: &[Outcome]) -> Vec<(HostId, Vec<Termination>)> {
    let done = outcome::CarriedOut::of(outcomes);
    plan.hosts
        .iter()
        .map(|(host, p)| {
            let ts = p
                .terminate
                .iter()
                .filter(|t| done.signalled(host, t.pid))
                .cloned()
                .collect::<Vec<_>>();
            (host.clone(), ts)
        })
        .filter(|(_, ts)| !ts.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unusable_streak_grows_with_each_unusable_cycle_and_a_failure_keeps_it() {
        let mut n = 0;
        for (usable, want) in [
            (Some(false), 1),
            (None, 1),
            (Some(false), 2),
            (Some(false), BLIND_AFTER),
            (Some(true), 0),
            (None, 0),
        ] {
            n = unusable_streak(n, usable);
            assert_eq!(n, want);
        }
        assert_eq!(unusable_streak(u32::MAX, Some(false)), u32::MAX);
    }
}
