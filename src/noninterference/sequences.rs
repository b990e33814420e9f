//! Non-interference and counting over sequences of cycles (issue 42): the
//! honest cluster of the parent module, enforced cycle after cycle (8 to
//! 10) by the pure parts of a running enforcer: each host's findings with
//! the orphans it remembers, the caps over every host (group caps, shards
//! publishing their parts to each other), the ladder (confirmations, a
//! grace, warn-only rules, exemptions), and the plan carried out on the
//! world (what is terminated ends, what is detached goes). Between cycles
//! bob moves: any edit of the parent's, a garbled state file for one
//! cycle, a job of his ended, or restarted under a new pid. Alice's
//! model adds her own business: several orphans per host and jobs on GPUs
//! her environment may not be attached to.
//!
//! Left out of bob's moves, as the parent leaves out removing alice's
//! attachments: what genv cannot tell from her own edits and that only
//! changes her own violations (attaching her environment where her job
//! of it runs), and removing her record (a documented limit: her jobs of
//! it become orphans).
//!
//! It holds both ways:
//!
//! 1. nothing bob does makes any more of alice's processes terminated, or
//!    any more of her attachments detached where a job of hers works on
//!    after that cycle's plan (one whose jobs the plan ends is idle from
//!    then on: its loss is the documented limit on idle attachments), than
//!    the same sequence without him (her own violations are hers either
//!    way), nor any of them sooner. A working attachment of hers detached
//!    with him must be one detached without him in that cycle or an
//!    earlier one, working or idle (when a hold carries a cap's picks out
//!    together, her job and the attachment it ran on may go in one cycle
//!    that, without him, went in two); every job of hers a detach stops is
//!    terminated with it, and is compared as such;
//! 2. in every cycle, every GPU each live job of bob's runs on is in his
//!    count (jobs outside genv where `--count-non-env-devices`), on a
//!    healthy host or a garbled one.
//!
//! Cases: 128 per run, the same each time (`PROPTEST_CASES` and
//! `PROPTEST_RNG_SEED` override).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::assess;
use crate::ladder::{Exemption, Grace, Ladder, RuleGrace};
use crate::plan::Plan;
use crate::rules::shards::{Published, Shards};
use crate::rules::taking::BLIND_AFTER;
use crate::rules::{HeldOrder, IdleHistory, InLine, Moment, Rule, Starts};

/// A cycle's interval (ms).
const INTERVAL: u64 = 60_000;

/// When the model's hosts booted (ms since the Unix epoch; the parent's
/// `Boot`).
const BOOT_MS: u64 = 1_795_000_000_000;

/// The clock (ms) at cycle `c` (from 0), on the hosts' start times' clock:
/// cycle 0 an interval after the boot.
const fn clock(c: u64) -> u64 {
    BOOT_MS + (c + 1) * INTERVAL
}

/// What bob does between two cycles.
#[derive(Debug, Clone)]
enum Move {
    Edit(Edit),
    /// Garbles the host's state files for the next cycle only.
    Garble {
        host: usize,
    },
    /// One of his jobs ends.
    End {
        host: usize,
        job: usize,
    },
    /// One of his jobs ends and starts again under a new pid.
    Restart {
        host: usize,
        job: usize,
    },
}

/// The enforcer's settings beyond the rules.
#[derive(Debug, Clone)]
struct Setup {
    policy: Policy,
    grace: Grace,
    /// Two shards (host 0; the rest), each with its own enforcer.
    sharded: bool,
}

/// What one enforcer (a shard, or the whole run) remembers.
struct Enforcer {
    hosts: Vec<usize>,
    ladder: Ladder,
    orphans: Vec<Orphans>,
    /// The group caps' order while their picks are held.
    held_order: Option<HeldOrder>,
    /// Since when each job is in line (the group caps' order).
    in_line: InLine,
    /// Its hosts' parts, as last published.
    published: Vec<Published>,
    /// Each host's cycles in a row with its genv state unusable.
    unusable: Vec<u32>,
}

/// What a run did to alice, each with the cycle it was done in.
#[derive(Debug, Default, PartialEq, Eq)]
struct Done {
    /// (host, pid) of her processes terminated.
    terminated: BTreeMap<(usize, i64), usize>,
    /// (host, device, eid) of her attachments detached where a job of
    /// that environment of hers ran.
    detached_working: BTreeMap<(usize, u32, EnvId), usize>,
    /// (host, device, eid) of her attachments detached, working or not.
    detached: BTreeMap<(usize, u32, EnvId), usize>,
}

/// What `with` did that `alone` did not do, or did only later: a key
/// with the cycles it was done in (`None`: never, alone).
fn sooner<K: Ord + Clone>(
    with: &BTreeMap<K, usize>,
    alone: &BTreeMap<K, usize>,
) -> Vec<(K, usize, Option<usize>)> {
    (with.iter())
        .filter(|(k, c)| alone.get(*k).is_none_or(|a| a > c))
        .map(|(k, c)| (k.clone(), *c, alone.get(k).copied()))
        .collect()
}

fn id(h: usize) -> HostId {
    HostId(format!("h{h}").into())
}

impl World {
    /// The snapshot of a host whose state files bob garbled: no record
    /// and no attachment usable, said (a degraded host).
    fn garbled(&self) -> HostSnapshot {
        let mut s = self.snapshot();
        s.envs = Vec::new().into();
        s.devices = (0..self.gpus)
            .map(|i| Device {
                index: GpuIndex(i),
                total_memory: "81559mi".into(),
                attachments: Vec::new(),
            })
            .collect::<Vec<_>>()
            .into();
        if let Some(t) = s.truth.as_mut() {
            t.pid_uids = Default::default();
            t.state_problem = Some("envs.json: cannot parse: garbled by bob".into());
        }
        s
    }

    /// Bob's `job`th live job, ended; with `again`, started again under a
    /// new pid with the same environment, GPUs and usage.
    fn end(&mut self, job: usize, again: bool) {
        let live: Vec<i64> = (self.bob_jobs.iter())
            .copied()
            .filter(|p| self.live.contains_key(p))
            .collect();
        let Some(&pid) = live.get(job % live.len().max(1)) else {
            return;
        };
        self.live.remove(&pid);
        let Some(i) = self
            .processes
            .iter()
            .position(|p| i64::from(p.pid.0) == pid)
        else {
            return;
        };
        let mut p = self.processes.remove(i);
        if again {
            let new = self.pid(BOB);
            self.bob_jobs.push(new);
            p.pid = Pid(new as u32);
            p.start_time = Some(new as u64);
            self.processes.push(p);
        }
    }

    /// Whether `e` may remove one of alice's records, making her jobs of
    /// it orphans: a documented limit, like removing one of her
    /// attachments (under `--orphans-as-non-env` she is warned and has
    /// its grace to restore it; under a cap, her strays count the same,
    /// but the cap may take another of her jobs than the one env-devices
    /// was ending).
    fn orphans_hers(&self, e: &Edit) -> bool {
        let env = match e {
            Edit::Remove { env, .. }
            | Edit::List {
                env, replace: true, ..
            } => *env,
            _ => return false,
        };
        !self.envs.is_empty() && self.is_alices(&self.envs[env % self.envs.len()].eid)
    }

    /// Whether `e` attaches one of alice's environments to a device where
    /// her own job of it runs: her own `genv attach` as far as anyone can
    /// tell, which makes that job comply (it was her business, and the
    /// sequence without bob terminates it); a cap may then take another
    /// job of hers in its place. Left out, as her own edits are.
    fn attaches_her_job(&self, e: &Edit) -> bool {
        let Edit::Attach { env, device, .. } = e else {
            return false;
        };
        let Some(r) = (!self.envs.is_empty()).then(|| &self.envs[env % self.envs.len()]) else {
            return false;
        };
        let device = GpuIndex(device % (self.gpus + 1));
        self.is_alices(&r.eid)
            && (self.processes.iter()).any(|p| {
                p.uid == Some(ALICE)
                    && p.owner.eid() == Some(&r.eid)
                    && p.usage_on(device).is_some()
            })
    }

    /// What the plan carried out does: terminated processes end, detached
    /// attachments go.
    fn carry_out(&mut self, plan: &plan::HostPlan) {
        for t in &plan.terminate {
            self.processes.retain(|p| p.pid != t.pid);
            self.live.remove(&i64::from(t.pid.0));
        }
        for d in &plan.detach {
            for x in self.devices.iter_mut().filter(|x| x.index == d.device) {
                x.attachments.retain(|a| a.eid != d.eid);
            }
        }
    }
}

impl Enforcer {
    fn new(hosts: Vec<usize>, grace: &Grace, n: usize) -> Self {
        Enforcer {
            hosts,
            ladder: Ladder::new(grace.clone()),
            orphans: vec![Orphans::default(); n],
            held_order: None,
            in_line: InLine::default(),
            published: Vec::new(),
            unusable: vec![0; n],
        }
    }

    /// One cycle over its hosts of `worlds` at `now`, as `cycle::cycle`
    /// runs it (nothing early: every action waits for the whole plan):
    /// the plan due, the snapshots judged and bob's count on each host.
    fn cycle(
        &mut self,
        worlds: &[World],
        garbled: &BTreeSet<usize>,
        setup: &Setup,
        others: Option<&[Published]>,
        (n, now): (u64, u64),
    ) -> (Plan, Vec<(usize, HostSnapshot, BTreeSet<GpuIndex>)>) {
        let policy = &setup.policy;
        let mut results = Vec::new();
        let mut own = Vec::new();
        let mut seen = Vec::new();
        self.published.clear();
        for &h in &self.hosts {
            let snap = if garbled.contains(&h) {
                worlds[h].garbled()
            } else {
                worlds[h].snapshot()
            };
            // Bob's count there, as every device cap counts it (a cycle
            // works it out only when one is set).
            let usage = HostUsage::of(
                &Attribution::of(&snap, &self.orphans[h]),
                policy.count_non_env_devices,
            );
            let bob: BTreeSet<GpuIndex> = (usage.users.get("bob").into_iter())
                .flat_map(|b| b.devices.iter().map(|d| d.index))
                .collect();
            self.unusable[h] = match snap.state_problem() {
                Some(_) => self.unusable[h] + 1,
                None => 0,
            };
            let mut f = rules::assess_host(&id(h), &snap, policy, &self.orphans[h]);
            if !policy.max_devices_per_group.is_empty() {
                self.in_line.update(&id(h), &snap, &mut f.usage, now);
            }
            if let Some(order) = &self.held_order {
                order.restore(&id(h), &mut f.usage);
            }
            if std::env::var_os("SEQUENCE_HELD").is_some() {
                for (u, a) in &f.usage.users {
                    for d in &a.devices {
                        eprintln!("  held h{h} {u} {:?} eids {:?} contested {:?} pids {:?} jobs {:?} w{} s{} k{} u{} v{} off {:?} starts {:?} since {:?}", d.index.0, d.eids, d.contested, d.pids, d.jobs, d.working, d.stray, d.kept, d.unseen, d.vouched, d.off, d.starts, d.since);
                    }
                }
            }
            self.orphans[h] = std::mem::take(&mut f.orphans);
            self.published.push(Published {
                host: id(h),
                position: h,
                usage: f.usage.clone(),
                blind: self.unusable[h] >= BLIND_AFTER,
                held: false,
            });
            own.push(assess::own_plan(&id(h), &snap, &f));
            seen.push((h, snap.clone(), bob));
            results.push((id(h), Ok((snap, f))));
        }
        let starts = Starts::of(
            results
                .iter()
                .filter_map(|(h, r)| Some((h, &r.as_ref().ok()?.1.usage))),
        );
        let positions: HashMap<HostId, usize> = self.hosts.iter().map(|&h| (id(h), h)).collect();
        let idle = IdleHistory::default();
        let blind: Vec<HostId> = (self.hosts.iter())
            .filter(|&&h| self.unusable[h] >= BLIND_AFTER)
            .map(|&h| id(h))
            .collect();
        let moment = Moment {
            idle: &idle,
            now_ms: now,
            shards: others.map(|others| Shards {
                positions: &positions,
                others,
            }),
            blind: &blind,
        };
        let held = (policy.has_any_cap() && self.ladder.waits()).then(|| self.ladder.clone());
        let mut a = assess::assess_planned(
            n,
            Mode::Remote,
            false,
            policy,
            results,
            own,
            moment,
            held.as_ref(),
        );
        if std::env::var_os("SEQUENCE_TRACE").is_some() {
            for (h, p) in &a.plan.hosts {
                let t: Vec<String> = (p.terminate.iter())
                    .map(|t| format!("{}{:?}{:?}", t.pid.0, t.rules, t.gpus))
                    .collect();
                let d: Vec<String> = (p.detach.iter())
                    .map(|d| format!("{}@{}{:?}w{}", d.eid.0, d.device.0, d.rules, d.working))
                    .collect();
                eprintln!("  decided {h:?} kill {t:?} detach {d:?}");
            }
            for n in &a.notices {
                eprintln!("  notice {n:?}");
            }
            for v in &a.violations {
                eprintln!("  finding {:?}", v.finding);
            }
        }
        let mut early = crate::cycle::Early::default();
        let elsewhere = others.is_some_and(|o| o.iter().any(|p| p.held));
        let (_, hold) = crate::cycle::laddered(
            &mut a,
            &mut self.ladder,
            &mut early,
            (now, elsewhere),
            false,
        );
        let parts = std::mem::take(&mut self.published);
        (self.published, self.held_order) =
            crate::cycle::kept_for_next(&a, hold, parts, starts, self.held_order.take());
        (a.plan, seen)
    }

    /// Its part for the other shard: what it published, without what its
    /// plan detached and terminated, compact.
    fn part(&self, due: &Plan) -> Vec<Published> {
        (self.published.iter())
            .map(|p| {
                let here = || due.hosts.iter().filter(|(h, _)| *h == p.host);
                let gone: HashSet<(GpuIndex, EnvId)> = here()
                    .flat_map(|(_, hp)| hp.detach.iter().map(|d| (d.device, d.eid.clone())))
                    .collect();
                let ended: HashSet<Pid> = here()
                    .flat_map(|(_, hp)| hp.terminate.iter().map(|t| t.pid))
                    .collect();
                p.clone().without(&gone, &ended).compact()
            })
            .collect()
    }
}

/// Runs the cycles over `honest` with bob's `moves` (each cycle's moves
/// made before it; none before the first): what was done to alice, and
/// the first cycle in which a live job of bob's was not in his count.
fn run(honest: &[HonestHost], moves: &[Vec<Move>], setup: &Setup) -> (Done, Option<String>) {
    let mut worlds: Vec<World> = honest
        .iter()
        .enumerate()
        .map(|(h, x)| World::honest(h, x))
        .collect();
    let n = worlds.len();
    let mut shards = if setup.sharded && n > 1 {
        vec![
            Enforcer::new(vec![0], &setup.grace, n),
            Enforcer::new((1..n).collect(), &setup.grace, n),
        ]
    } else {
        vec![Enforcer::new((0..n).collect(), &setup.grace, n)]
    };
    let mut parts: Vec<Vec<Published>> = vec![Vec::new(); shards.len()];
    let mut done = Done::default();
    let mut uncounted = None;
    let mut run_of = vec![0u32; n];
    for (c, cycle_moves) in std::iter::once(&Vec::new()).chain(moves).enumerate() {
        let mut garbled = BTreeSet::new();
        let before: Vec<BTreeSet<Pid>> = (worlds.iter())
            .map(|w| w.processes.iter().map(|p| p.pid).collect())
            .collect();
        for m in cycle_moves {
            match m {
                Move::Edit(e) => {
                    let h = e.host() % n;
                    let skipped = worlds[h].orphans_hers(e) || worlds[h].attaches_her_job(e);
                    if !skipped {
                        worlds[h].apply(e, h);
                    }
                }
                // Garbles last fewer than BLIND_AFTER cycles in a row: a
                // host kept unusable longer is judged blind, which may take
                // another of an over-cap user's jobs there than a healthy
                // cycle would (a documented limit).
                Move::Garble { host } if run_of[host % n] + 1 < BLIND_AFTER => {
                    garbled.insert(host % n);
                }
                Move::Garble { .. } => {}
                Move::End { host, job } => worlds[host % n].end(*job, false),
                Move::Restart { host, job } => worlds[host % n].end(*job, true),
            }
        }
        // What bob started now started after everything before it, in the
        // interval before this cycle (ticks of 10 ms since the boot), on
        // every host.
        for (w, before) in worlds.iter_mut().zip(&before) {
            for p in w.processes.iter_mut().filter(|p| !before.contains(&p.pid)) {
                p.start_time = Some(c as u64 * INTERVAL / 10 + u64::from(p.pid.0));
            }
        }
        for (h, r) in run_of.iter_mut().enumerate() {
            *r = if garbled.contains(&h) { *r + 1 } else { 0 };
        }
        let now = clock(c as u64);
        let sharded = shards.len() > 1;
        let mut dues = Vec::new();
        for (k, shard) in shards.iter_mut().enumerate() {
            let others = sharded.then(|| parts[1 - k].as_slice());
            let (due, seen) = shard.cycle(&worlds, &garbled, setup, others, (c as u64 + 1, now));
            for (h, snap, bob) in &seen {
                for p in snap.processes.iter().filter(|p| p.uid == Some(BOB)) {
                    let counted =
                        !matches!(p.owner, Owner::NoEnv) || setup.policy.count_non_env_devices;
                    for d in p.indices().filter(|d| counted && !bob.contains(d)) {
                        uncounted.get_or_insert_with(|| {
                            format!("cycle {c}: bob's job {} ({:?}) on h{h} device {d} is not in his count", p.pid, p.owner)
                        });
                    }
                }
            }
            for (host, hp) in &due.hosts {
                let h: usize = host.0[1..].parse().expect("h<index>");
                let (w, snap) = (
                    &worlds[h],
                    &seen.iter().find(|s| s.0 == h).expect("judged").1,
                );
                for t in &hp.terminate {
                    let pid = i64::from(t.pid.0);
                    if w.alice_jobs.contains(&pid) || w.alice_plain.contains(&pid) {
                        done.terminated.entry((h, pid)).or_insert(c);
                    }
                }
                // Working: a job of hers there runs on after this cycle's
                // plan (one it terminates leaves the attachment idle; the
                // termination itself is compared as such).
                for d in &hp.detach {
                    let working = snap.processes.iter().any(|p| {
                        p.uid == Some(ALICE)
                            && p.owner.eid() == Some(&d.eid)
                            && p.usage_on(d.device).is_some()
                            && !hp.terminate.iter().any(|t| t.pid == p.pid)
                    });
                    if w.is_alices(&d.eid) {
                        done.detached
                            .entry((h, d.device.0, d.eid.clone()))
                            .or_insert(c);
                        if working {
                            done.detached_working
                                .entry((h, d.device.0, d.eid.clone()))
                                .or_insert(c);
                        }
                    }
                }
            }
            if std::env::var_os("SEQUENCE_TRACE").is_some() {
                eprintln!(
                    "cycle {c} shard {k} garbled {garbled:?} moves {cycle_moves:?}\n  due {:?}",
                    due.hosts
                        .iter()
                        .map(|(h, p)| (
                            h,
                            p.terminate.iter().map(|t| t.pid.0).collect::<Vec<_>>(),
                            p.detach
                                .iter()
                                .map(|d| (d.eid.0.clone(), d.device.0))
                                .collect::<Vec<_>>()
                        ))
                        .collect::<Vec<_>>()
                );
            }
            dues.push(due);
        }
        for (k, due) in dues.iter().enumerate() {
            parts[k] = shards[k].part(due);
            for (host, hp) in &due.hosts {
                let h: usize = host.0[1..].parse().expect("h<index>");
                worlds[h].carry_out(hp);
            }
        }
    }
    (done, uncounted)
}

fn moves() -> impl Strategy<Value = Move> {
    prop_oneof![
        6 => edit().prop_map(Move::Edit),
        1 => (0usize..3).prop_map(|host| Move::Garble { host }),
        1 => (0usize..3, 0usize..4).prop_map(|(host, job)| Move::End { host, job }),
        2 => (0usize..3, 0usize..4).prop_map(|(host, job)| Move::Restart { host, job }),
    ]
}

fn sequence_host() -> impl Strategy<Value = HonestHost> {
    honest_host().prop_flat_map(|h| {
        let gpus = h.gpus;
        proptest::collection::vec((0usize..2, 0..gpus), 0..=2).prop_map(move |elsewhere| {
            HonestHost {
                elsewhere,
                ..h.clone()
            }
        })
    })
}

fn setup() -> impl Strategy<Value = Setup> {
    let who = prop_oneof![Just(None), Just(Some("alice")), Just(Some("bob"))];
    (
        base_policy(),
        (
            proptest::option::of(0u32..5),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
        (1u32..=3, 0u64..=3, any::<bool>(), who, 0u64..=3),
    )
        .prop_map(
            |(
                policy,
                (group, orphans, non_env, sharded),
                (cycles, after, warn, exempt, orphan_grace),
            )| {
                // Sharded only as a run may be: `--shard` refuses the group
                // and memory caps (they would count one shard's hosts alone).
                let sharded = sharded && group.is_none() && !policy.has_memory_caps();
                let mut rules = std::collections::BTreeMap::new();
                if orphans {
                    // As `--orphans-as-non-env GRACE` sets it.
                    rules.insert(
                        Rule::OrphanedEnvProcesses,
                        RuleGrace {
                            warn_only: false,
                            after: Some(Duration::from_millis(orphan_grace * INTERVAL)),
                        },
                    );
                }
                if warn {
                    rules.insert(
                        Rule::NonEnvProcesses,
                        RuleGrace {
                            warn_only: true,
                            after: None,
                        },
                    );
                }
                Setup {
                    policy: Policy {
                        max_devices_per_group: group
                            .map(|g| ("lab".to_string(), g))
                            .into_iter()
                            .collect(),
                        orphans_as_non_env: orphans,
                        count_non_env_devices: non_env,
                        ..policy
                    },
                    grace: Grace {
                        cycles,
                        after: Duration::from_millis(after * INTERVAL),
                        rules,
                        exempt: exempt
                            .map(|u| Exemption {
                                user: Some(u.to_string()),
                                reason: "a deadline".into(),
                                ..Default::default()
                            })
                            .into_iter()
                            .collect(),
                        gap: Some(Duration::from_millis(3 * INTERVAL)),
                    },
                    sharded,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(128),
        max_shrink_iters: std::env::var("PROPTEST_MAX_SHRINK_ITERS").ok().and_then(|c| c.parse().ok()).unwrap_or(20_000),
        // The same cases in every run (PROPTEST_RNG_SEED picks others):
        // shrinking a failure of an earlier attempt found the open case
        // `a_cap_worked_out_again_after_a_hold_takes_what_it_picked` keeps
        // (issue 42, stop 52).
        rng_seed: match std::env::var("PROPTEST_RNG_SEED").ok().and_then(|s| s.parse().ok()) {
            Some(seed) => proptest::test_runner::RngSeed::Fixed(seed),
            None => proptest::test_runner::RngSeed::Fixed(42),
        },
        ..ProptestConfig::default()
    })]

    #[test]
    fn over_cycles_bob_gets_no_more_of_alice_stopped_and_every_job_of_his_counts(
        honest in proptest::collection::vec(sequence_host(), 1..=3),
        moves in proptest::collection::vec(proptest::collection::vec(moves(), 0..=2), 7..=9),
        setup in setup(),
    ) {
        let (alone, _) = run(&honest, &vec![Vec::new(); moves.len()], &setup);
        let (with_bob, uncounted) = run(&honest, &moves, &setup);
        prop_assert_eq!(
            sooner(&with_bob.terminated, &alone.terminated),
            vec![],
            "alice's processes terminated only, or sooner, because of bob (cycle with him, alone)"
        );
        prop_assert_eq!(
            sooner(&with_bob.detached_working, &alone.detached),
            vec![],
            "alice's working attachments detached only, or sooner, because of bob (cycle with him, alone)"
        );
        prop_assert_eq!(uncounted, None);
    }
}

/// A host of 2 GPUs where only bob works: one environment attached to
/// `gpus`, a job on each.
fn bobs(gpus: &[u32]) -> HonestHost {
    HonestHost {
        gpus: 2,
        alice: Vec::new(),
        orphans: Vec::new(),
        plain: Vec::new(),
        bob: vec![BobEnv {
            devices: gpus.iter().copied().collect(),
            jobs: gpus.iter().map(|&g| (vec![g], None)).collect(),
        }],
        elsewhere: Vec::new(),
    }
}

/// A per-user cap of 1 device, nothing waiting.
fn capped(sharded: bool) -> Setup {
    Setup {
        policy: Policy {
            max_devices_per_user: Some(1),
            ..Policy::default()
        },
        grace: Grace::default(),
        sharded,
    }
}

/// Review of stop 48, finding 2: bob keeps `envs.json` garbled on the host
/// his jobs run on. His excess there is kept (said) for two cycles, then
/// the host is judged blind and the cap takes it.
#[test]
fn a_host_kept_garbled_is_judged_blind_on_the_third_cycle() {
    let honest = bobs(&[0, 1]);
    let setup = capped(false);
    let worlds = vec![World::honest(0, &honest)];
    let garbled: BTreeSet<usize> = [0].into_iter().collect();
    let mut enforcer = Enforcer::new(vec![0], &setup.grace, 1);
    let terminated: Vec<usize> = (0..4u64)
        .map(|c| {
            let (due, _) = enforcer.cycle(&worlds, &garbled, &setup, None, (c + 1, clock(c)));
            due.hosts.iter().map(|(_, p)| p.terminate.len()).sum()
        })
        .collect();
    assert_eq!(
        terminated,
        [0, 0, 1, 1],
        "kept twice, then one of his two jobs taken"
    );
    // Healthy again: judged as any host.
    let (due, _) = enforcer.cycle(&worlds, &BTreeSet::new(), &setup, None, (5, clock(4)));
    assert_eq!(
        due.hosts.iter().map(|(_, p)| p.detach.len()).sum::<usize>(),
        1
    );
    assert_eq!(enforcer.unusable, [0]);
}

/// Review of this stop: under shards, every shard must order a blind
/// host's unseen jobs alike, or each picks a device only the other may
/// take and nothing is taken. Bob, 1 over his cap, keeps h0 garbled.
#[test]
fn shards_agree_on_a_blind_host() {
    let setup = capped(true);
    let worlds = vec![World::honest(0, &bobs(&[0])), World::honest(1, &bobs(&[0]))];
    let garbled: BTreeSet<usize> = [0].into_iter().collect();
    let mut shards = [
        Enforcer::new(vec![0], &setup.grace, 2),
        Enforcer::new(vec![1], &setup.grace, 2),
    ];
    let mut parts: [Vec<Published>; 2] = Default::default();
    let mut taken = 0;
    for c in 0..5u64 {
        let mut dues = Vec::new();
        for (k, shard) in shards.iter_mut().enumerate() {
            let others = Some(parts[1 - k].as_slice());
            let (due, _) = shard.cycle(&worlds, &garbled, &setup, others, (c + 1, clock(c)));
            taken += due
                .hosts
                .iter()
                .map(|(_, p)| p.terminate.len() + p.detach.len())
                .sum::<usize>();
            dues.push(due);
        }
        for (k, due) in dues.iter().enumerate() {
            parts[k] = shards[k].part(due);
        }
    }
    assert!(taken > 0, "bob's excess is taken once h0 is blind");
}

/// A shard whose cap's pick waits on a host of its own gone unseen holds
/// it and says so in its part (for the other shards' next cycle); seen
/// again, it says nothing.
#[test]
fn a_shard_holding_a_caps_pick_says_so_in_its_part() {
    let setup = Setup {
        grace: Grace {
            cycles: 2,
            ..Grace::default()
        },
        ..capped(true)
    };
    let worlds = vec![
        World::honest(0, &bobs(&[0, 1])),
        World::honest(1, &bobs(&[0])),
    ];
    let mut shard = Enforcer::new(vec![0], &setup.grace, 2);
    let garbled: BTreeSet<usize> = [0].into_iter().collect();
    let healthy = BTreeSet::new();
    let held = |shard: &Enforcer| shard.published.iter().all(|p| p.held);
    let (due, _) = shard.cycle(&worlds, &healthy, &setup, Some(&[]), (1, clock(0)));
    assert!(due.hosts.is_empty() && !held(&shard), "picked, waiting");
    shard.cycle(&worlds, &garbled, &setup, Some(&[]), (2, clock(1)));
    assert!(held(&shard), "its pick waits on h0, unseen");
    let (due, _) = shard.cycle(&worlds, &healthy, &setup, Some(&[]), (3, clock(2)));
    assert!(!held(&shard));
    assert!(!due.hosts.is_empty(), "due once h0 is seen");
    // Told another shard held: ours wait a cycle more.
    let mut shard = Enforcer::new(vec![0], &setup.grace, 2);
    let theirs = |held: bool| {
        let mut p = shard_part(&worlds[1], 1);
        p.held = held;
        vec![p]
    };
    shard.cycle(
        &worlds,
        &healthy,
        &setup,
        Some(&theirs(false)),
        (1, clock(0)),
    );
    let (due, _) = shard.cycle(
        &worlds,
        &healthy,
        &setup,
        Some(&theirs(true)),
        (2, clock(1)),
    );
    assert!(due.hosts.is_empty(), "held for the other shard");
    let (due, _) = shard.cycle(
        &worlds,
        &healthy,
        &setup,
        Some(&theirs(false)),
        (3, clock(2)),
    );
    assert!(!due.hosts.is_empty());
}

/// The part a shard publishes of host `h` of `world`, as it counts.
fn shard_part(world: &World, h: usize) -> Published {
    let snap = world.snapshot();
    let usage = HostUsage::of(&Attribution::of(&snap, &Orphans::default()), false);
    Published {
        host: id(h),
        position: h,
        usage,
        blind: false,
        held: false,
    }
    .compact()
}

/// The cross-shard hold reaches the other shard a cycle late (review of
/// stop 51, finding 1): a garble timed to any cycle of a cap's wait, on
/// a host of either shard, one cycle or two, changes neither which of
/// alice's jobs and working attachments are taken nor takes any sooner.
/// Alice, 3 over her cap of 1, works on 2 GPUs on each of two shards'
/// hosts, so the cap's picks fall on both; waits of a grace or of
/// confirmations.
#[test]
fn a_garble_timed_to_a_caps_wait_on_either_shard_takes_nothing_else_or_sooner() {
    let host = HonestHost {
        alice: vec![AliceEnv {
            devices: [0, 1].into_iter().collect(),
            gpu_memory: None,
            jobs: vec![(vec![0], None), (vec![1], None)],
        }],
        ..bobs(&[])
    };
    let honest = vec![host.clone(), host];
    let graces = [
        Grace {
            after: Duration::from_millis(2 * INTERVAL),
            ..Grace::default()
        },
        Grace {
            cycles: 3,
            ..Grace::default()
        },
    ];
    for grace in graces {
        let setup = Setup {
            policy: Policy {
                max_devices_per_user: Some(1),
                ..Policy::default()
            },
            grace: grace.clone(),
            sharded: true,
        };
        let quiet = vec![Vec::new(); 7];
        let (alone, _) = run(&honest, &quiet, &setup);
        let hosts: BTreeSet<usize> = alone.detached.keys().map(|k| k.0).collect();
        assert_eq!(
            (alone.detached.len(), hosts.len()),
            (3, 2),
            "{grace:?}: her excess is taken on both shards without bob: {alone:?}"
        );
        for (garbled, from, long) in
            (0..2).flat_map(|h| (0..6).flat_map(move |c| [(h, c, 1), (h, c, 2)]))
        {
            let mut moves = quiet.clone();
            for m in moves.iter_mut().skip(from).take(long) {
                m.push(Move::Garble { host: garbled });
            }
            let (with_bob, _) = run(&honest, &moves, &setup);
            let case = format!(
                "{grace:?}, h{garbled} garbled from cycle {} for {long}",
                from + 1
            );
            assert_eq!(
                sooner(&with_bob.terminated, &alone.terminated),
                vec![],
                "{case}"
            );
            assert_eq!(
                sooner(&with_bob.detached, &alone.detached),
                vec![],
                "{case}"
            );
        }
    }
}

/// A group `lab` capped at 1 device, alice's orphans and jobs outside
/// genv judged and counted.
fn lab_of_one() -> Policy {
    Policy {
        non_env_processes: true,
        max_devices_per_group: [("lab".to_string(), 1)].into_iter().collect(),
        orphans_as_non_env: true,
        count_non_env_devices: true,
        ..Policy::default()
    }
}

/// Found at stop 52, once the property compared cycles: a group cap's
/// pick on h2 is held while bob garbles h2; meanwhile the orphan rule
/// terminates alice's orphan on h1, which changes the group's order (by
/// when each device's first job started). Worked out again once h2 was
/// back, the cap took her job on h1 in place of its pick on h2, which the
/// run without him took. Stop 54 kept the order a hold began with; seed 3
/// then found the mirror case (the run without him moved the pick when
/// the orphan ended, the held order kept it). Closed (stop 55): the order
/// is by the first job that runs on after what is carried out in the
/// cycle ([`Taken::since`](crate::rules::taking::Taken::since)), so the
/// orphan's end moves h1's device up in the cycle it ends, held or not.
#[test]
fn a_caps_order_moves_in_the_cycle_another_rule_ends_a_job_held_or_not() {
    let empty = bobs(&[]);
    let h1 = HonestHost {
        gpus: 1,
        orphans: vec![0],
        plain: vec![0],
        ..empty.clone()
    };
    let env = AliceEnv {
        devices: [0].into_iter().collect(),
        gpu_memory: None,
        jobs: vec![(vec![0], None)],
    };
    // Her job on h2 in her environment, or outside genv beside one of
    // another environment of hers.
    let h2s = [
        HonestHost {
            gpus: 1,
            alice: vec![env.clone()],
            ..empty.clone()
        },
        HonestHost {
            gpus: 1,
            alice: vec![AliceEnv {
                jobs: Vec::new(),
                ..env
            }],
            plain: vec![0],
            elsewhere: vec![(0, 0)],
            ..empty.clone()
        },
    ];
    let rules = [
        (
            Rule::NonEnvProcesses,
            RuleGrace {
                warn_only: true,
                after: None,
            },
        ),
        (
            Rule::OrphanedEnvProcesses,
            RuleGrace {
                warn_only: false,
                after: Some(Duration::ZERO),
            },
        ),
    ];
    let setup = Setup {
        policy: lab_of_one(),
        grace: Grace {
            cycles: 3,
            rules: rules.into_iter().collect(),
            ..Grace::default()
        },
        sharded: false,
    };
    for h2 in h2s {
        let honest = vec![
            HonestHost {
                gpus: 1,
                ..empty.clone()
            },
            h1.clone(),
            h2,
        ];
        let mut moves = vec![Vec::new(); 7];
        moves[1].push(Move::Garble { host: 2 });
        let (alone, _) = run(&honest, &vec![Vec::new(); 7], &setup);
        let (with_bob, _) = run(&honest, &moves, &setup);
        assert!(alone.terminated.contains_key(&(1, 102)), "{alone:?}");
        assert!(!alone.terminated.keys().any(|k| k.0 == 2), "{alone:?}");
        let keys = |d: &Done| {
            (
                d.terminated.keys().cloned().collect::<Vec<_>>(),
                d.detached.keys().cloned().collect::<Vec<_>>(),
            )
        };
        assert_eq!(keys(&with_bob), keys(&alone), "the same taken");
        assert_eq!(sooner(&with_bob.terminated, &alone.terminated), vec![]);
    }
}

/// Found by seed 23 of the when-and-which property (stop 52): bob, exempt,
/// runs a job on alice's GPU and puts their group over. Alice's orphan
/// there waits out its grace, so the group takes her device first (it is
/// freed anyway); but the cap's own grace (none) used to win and brought
/// her orphan's termination forward. A device cap joining another rule's
/// wait no longer hastens it.
#[test]
fn a_group_put_over_by_another_member_does_not_hasten_a_users_wait() {
    let host = HonestHost {
        gpus: 1,
        orphans: vec![0],
        bob: Vec::new(),
        ..bobs(&[])
    };
    let setup = Setup {
        policy: lab_of_one(),
        grace: Grace {
            cycles: 1,
            rules: [(
                Rule::OrphanedEnvProcesses,
                RuleGrace {
                    warn_only: false,
                    after: Some(Duration::from_millis(2 * INTERVAL)),
                },
            )]
            .into_iter()
            .collect(),
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Exemption::default()
            }],
            gap: Some(Duration::from_secs(180)),
            ..Grace::default()
        },
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Edit(Edit::Job {
        host: 0,
        eid: Eid::Alice(0),
        gpus: vec![1, 2],
        mib: None,
    }));
    let honest = vec![host];
    let (alone, _) = run(&honest, &vec![Vec::new(); 7], &setup);
    let (with_bob, _) = run(&honest, &moves, &setup);
    assert_eq!(
        alone.terminated.values().collect::<Vec<_>>(),
        [&2],
        "her orphan, at its deadline"
    );
    assert_eq!(sooner(&with_bob.terminated, &alone.terminated), vec![]);
}

/// Alice's environment attached to `devices`, with `jobs` (their GPUs).
fn alices(devices: &[u32], jobs: &[&[u32]]) -> AliceEnv {
    AliceEnv {
        devices: devices.iter().copied().collect(),
        gpu_memory: None,
        jobs: jobs.iter().map(|g| (g.to_vec(), None)).collect(),
    }
}

/// A host of `gpus` GPUs where nobody works.
fn bare(gpus: u32) -> HonestHost {
    HonestHost { gpus, ..bobs(&[]) }
}

/// A grace of `cycles` confirmations and `after` intervals, with `rules`'
/// own graces.
fn graced(cycles: u32, after: u64, rules: &[(Rule, RuleGrace)]) -> Grace {
    Grace {
        cycles,
        after: Duration::from_millis(after * INTERVAL),
        rules: rules.iter().cloned().collect(),
        gap: Some(Duration::from_millis(3 * INTERVAL)),
        ..Grace::default()
    }
}

/// A rule's grace that acts after `intervals`.
fn acts_after(intervals: u64) -> RuleGrace {
    RuleGrace {
        warn_only: false,
        after: Some(Duration::from_millis(intervals * INTERVAL)),
    }
}

/// The orphan rule acting after `intervals`, the non-env rule warning.
fn orphans_wait_non_env_warns(intervals: u64) -> [(Rule, RuleGrace); 2] {
    [
        (Rule::OrphanedEnvProcesses, acts_after(intervals)),
        (
            Rule::NonEnvProcesses,
            RuleGrace {
                warn_only: true,
                after: None,
            },
        ),
    ]
}

/// Runs `honest` with and without bob's `moves` and checks the first way:
/// nothing of alice's is taken only, or sooner, with him.
fn bob_takes_nothing_of_alices(honest: &[HonestHost], setup: &Setup, moves: &[Vec<Move>]) {
    let (alone, _) = run(honest, &vec![Vec::new(); moves.len()], setup);
    let (with_bob, _) = run(honest, moves, setup);
    assert_eq!(
        sooner(&with_bob.terminated, &alone.terminated),
        vec![],
        "{alone:?}"
    );
    assert_eq!(
        sooner(&with_bob.detached_working, &alone.detached),
        vec![],
        "{alone:?}"
    );
}

/// Seed 41 of the when-and-which property (traced at stop 53): bob garbles
/// the host where alice's orphans wait out their grace in the cycle it
/// ends. Unseen, their device counted as working, so the group took her
/// plain job elsewhere, whose group wait had come due; without him, the
/// orphans' end freed enough. Closed (stop 55): a wait the ladder keeps
/// for a job no rule judges this cycle stands where it would seen
/// ([`crate::rules::Withheld::unseen_waiting`]: soon).
#[test]
fn a_garble_over_waiting_orphans_takes_nothing_else_of_the_group() {
    let orphaned = HonestHost {
        alice: vec![alices(&[0], &[]), alices(&[0], &[])],
        orphans: vec![1, 0],
        plain: vec![1, 2],
        ..bare(3)
    };
    let honest = [
        orphaned,
        HonestHost {
            orphans: vec![0],
            ..bare(3)
        },
        HonestHost {
            plain: vec![0],
            ..bare(1)
        },
    ];
    let setup = Setup {
        policy: Policy {
            max_devices_per_group: [("lab".to_string(), 3)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: graced(3, 0, &orphans_wait_non_env_warns(0)),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Garble { host: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 3 of the when-and-which property (stops 53 and 54): alice's orphan
/// ends on h1, so her device there is held since her next job started
/// and becomes the group's most recent; without bob, the cap moves onto
/// it. With him garbling h0, where the cap's first pick waited, the order
/// the hold began with was kept, and the first pick was carried out.
/// Closed (stop 55): the order is by the jobs that run on after what is
/// carried out in the cycle, held or not.
#[test]
fn a_garble_keeps_no_order_another_rule_has_changed() {
    let honest = [
        HonestHost {
            alice: vec![alices(&[0], &[&[0]])],
            ..bare(1)
        },
        HonestHost {
            alice: vec![alices(&[0, 2], &[])],
            orphans: vec![2],
            plain: vec![0],
            elsewhere: vec![(0, 2)],
            ..bare(4)
        },
    ];
    let setup = Setup {
        policy: Policy {
            count_non_env_devices: false,
            ..lab_of_one()
        },
        grace: graced(1, 3, &[(Rule::OrphanedEnvProcesses, acts_after(2))]),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Garble { host: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 59 (stop 54): bob garbles the host of alice's orphan in the cycle
/// its grace ends; alice's per-user cap then took a job of hers there
/// that the cap's pick, worked out with the orphan ended, leaves alone.
/// Closed with seed 41's fix.
#[test]
fn a_garble_over_a_waiting_orphan_moves_no_users_cap() {
    let honest = [
        HonestHost {
            alice: vec![alices(&[0], &[])],
            plain: vec![0],
            elsewhere: vec![(0, 0)],
            ..bare(1)
        },
        HonestHost {
            orphans: vec![3],
            plain: vec![0, 1],
            ..bare(4)
        },
    ];
    let setup = Setup {
        policy: Policy {
            max_devices_per_user: Some(1),
            max_devices_per_group: [("lab".to_string(), 2)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: Grace {
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Exemption::default()
            }],
            ..graced(1, 1, &orphans_wait_non_env_warns(1))
        },
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Found at stop 55 by seed 13, on a first version of the order after
/// what is carried out: bob's job carrying alice's idle id makes the
/// environment his; his own cap's wait then ends his job there, and his
/// device, held by the attachment alone, stood as the group's oldest
/// working one, so the group took alice's. A device no job of its user's
/// runs on after what is carried out is idle ([`SOON`]'s turns before).
#[test]
fn a_device_whose_jobs_end_this_cycle_is_idle_for_the_group() {
    let honest = [HonestHost {
        alice: vec![alices(&[1], &[])],
        plain: vec![0, 1],
        ..bare(2)
    }];
    let setup = Setup {
        policy: Policy {
            non_env_processes: false,
            env_devices: true,
            max_devices_for_user: [("bob".to_string(), 1)].into_iter().collect(),
            orphans_as_non_env: false,
            ..lab_of_one()
        },
        grace: graced(3, 0, &[]),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Edit(Edit::Job {
        host: 0,
        eid: Eid::Alice(0),
        gpus: vec![1, 2],
        mib: None,
    }));
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 59 at stop 55: bob relabels his idle record, attached where
/// alice's orphan waits out its grace, with her name. Her device there
/// then held a working job and an attachment left idle, so the group took
/// her working job elsewhere in its place. As under her own cap, a device
/// whose jobs all end at their deadline takes the [`SOON`] turn though an
/// attachment is left idle there (anyone can write one in her name).
#[test]
fn a_record_relabelled_where_an_orphan_waits_moves_no_group_pick() {
    let honest = [
        HonestHost {
            orphans: vec![0],
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: Vec::new(),
            }],
            ..bare(1)
        },
        HonestHost {
            alice: vec![alices(&[0], &[&[0]])],
            ..bare(1)
        },
    ];
    let setup = Setup {
        policy: Policy {
            count_non_env_devices: false,
            ..lab_of_one()
        },
        grace: graced(1, 1, &[(Rule::OrphanedEnvProcesses, acts_after(3))]),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Edit(Edit::Relabel {
        host: 2,
        env: 0,
        name: Name::Alice,
    }));
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// The setup of seed 5 (stop 55): lab capped at 2, bob exempt, orphans
/// given 3 intervals and the group 2.
fn lab_of_two_bob_exempt() -> Setup {
    Setup {
        policy: Policy {
            max_devices_per_group: [("lab".to_string(), 2)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: Grace {
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Exemption::default()
            }],
            ..graced(1, 2, &orphans_wait_non_env_warns(3))
        },
        sharded: false,
    }
}

/// Seed 5 at stop 55: bob garbles h1, where his idle record is, in the
/// cycle the group's pick of alice's job on h2 comes due. The hold kept
/// it a cycle, in which her orphan on h0 ended; the order after that end
/// put her plain job on h0 first, and the cap took it in place of the
/// pick. A pick due and carried out late is worked out in the order of
/// the cycle it was due in ([`HeldOrder`]).
#[test]
fn a_pick_held_a_cycle_is_worked_out_in_the_order_it_was_due_in() {
    let honest = [
        HonestHost {
            orphans: vec![0],
            plain: vec![0],
            ..bare(3)
        },
        HonestHost {
            plain: vec![0],
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: Vec::new(),
            }],
            ..bare(1)
        },
        HonestHost {
            alice: vec![alices(&[0], &[&[0]])],
            ..bare(1)
        },
    ];
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &lab_of_two_bob_exempt(), &moves);
}

/// Seed 5's next case: bob garbles the host of the group's pick itself in
/// the cycle it comes due; unseen, it is not in the plan, so no hold kept
/// it back, and the order after her orphan's end moved the pick onto her
/// plain job. A cap's pick due on an unseen host is carried out late too.
#[test]
fn a_pick_due_on_an_unseen_host_is_worked_out_in_the_order_it_was_due_in() {
    let honest = [
        HonestHost {
            orphans: vec![1],
            plain: vec![1],
            ..bare(3)
        },
        HonestHost {
            alice: vec![alices(&[0], &[])],
            elsewhere: vec![(0, 0)],
            ..bare(1)
        },
        HonestHost {
            plain: vec![0],
            ..bare(1)
        },
    ];
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &lab_of_two_bob_exempt(), &moves);
}

/// Seed 71 at stop 55: bob garbles h0 a cycle before the group's picks
/// come due; the hold began then, with nothing due to keep back, and the
/// order it began with kept his device where his job that env-devices
/// ended gave it, so the group took alice's job on h0 in place of his.
/// The order is kept only from a cycle that carries a due pick out late.
#[test]
fn a_hold_that_keeps_nothing_back_keeps_no_order() {
    let honest = [
        HonestHost {
            alice: vec![alices(&[0], &[&[0], &[0]]), alices(&[0], &[&[0]])],
            orphans: vec![1],
            ..bare(2)
        },
        HonestHost {
            alice: vec![alices(&[1], &[])],
            plain: vec![0],
            bob: vec![
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![1, 0], None)],
                },
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![0], None)],
                },
            ],
            elsewhere: vec![(0, 0)],
            ..bare(2)
        },
    ];
    let setup = Setup {
        policy: Policy {
            non_env_processes: false,
            env_devices: true,
            orphans_as_non_env: false,
            max_devices_per_group: [("lab".to_string(), 3)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: graced(3, 0, &[]),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Garble { host: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 67 at stop 55: two shards, alice capped at 2 of 3. Her orphan on
/// h1 waits out its grace, so h1's shard takes that device; h0's shard,
/// which did not know the wait, took her job on h0 in genv's order, and
/// dropped it only once the orphan's end was published, the cycle that
/// pick came due. Bob's garble of h1 put the orphan's end a cycle later,
/// and both were taken. A shard's part now says which devices its waits
/// free ([`Published::mark_soon`]): both shards pick the same one.
#[test]
fn shards_agree_on_a_device_another_shards_wait_frees() {
    let honest = [
        HonestHost {
            plain: vec![0],
            ..bare(1)
        },
        HonestHost {
            orphans: vec![1],
            plain: vec![0],
            ..bare(2)
        },
    ];
    let setup = Setup {
        policy: Policy {
            max_devices_per_user: Some(2),
            max_devices_per_group: BTreeMap::new(),
            ..lab_of_one()
        },
        grace: graced(1, 1, &orphans_wait_non_env_warns(1)),
        sharded: true,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 73 at stop 55: two shards, alice capped at 1 of 3; her job on h1
/// runs on both of its devices. h1's shard takes its device 0 (the job
/// with it), which leaves device 1 holding an idle attachment; h0's shard
/// took her job on h0 as well, and dropped it only when h1's was carried
/// out first. Bob garbling both hosts the cycle the picks came due put
/// them in one cycle. A device whose member processes all end at a
/// waiting deadline takes the soon turn too, so both shards take h1's.
#[test]
fn shards_agree_on_a_device_left_idle_by_another_shards_wait() {
    let honest = [
        HonestHost {
            plain: vec![0],
            ..bare(1)
        },
        HonestHost {
            alice: vec![alices(&[0, 1], &[&[0, 1]])],
            ..bare(2)
        },
    ];
    let setup = Setup {
        policy: Policy {
            max_devices_per_user: Some(1),
            count_non_env_devices: true,
            ..Policy::default()
        },
        grace: Grace {
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Exemption::default()
            }],
            ..graced(1, 2, &[])
        },
        sharded: true,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[1].extend([Move::Garble { host: 1 }, Move::Garble { host: 0 }]);
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Found at stop 55 by seed 11, on a version that counted a cap's own
/// picks on an unseen host as freed soon: the group's pick on h2, garbled
/// the cycle it came due, then stood first for alice's own cap, which so
/// left her job on h1 alone; the group took her orphan on h2 later in its
/// place. A cap's picks on an unseen host are worked out again once it is
/// seen, as a healthy cycle works them out.
#[test]
fn a_groups_pick_on_an_unseen_host_moves_no_users_cap() {
    let honest = [
        bare(1),
        HonestHost {
            plain: vec![0],
            ..bare(1)
        },
        HonestHost {
            alice: vec![alices(&[0, 1], &[])],
            orphans: vec![2],
            plain: vec![1],
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: vec![(vec![0], None), (vec![0], None)],
            }],
            elsewhere: vec![(0, 0)],
            ..bare(3)
        },
    ];
    let setup = Setup {
        policy: Policy {
            non_env_processes: false,
            orphans_as_non_env: false,
            max_devices_per_user: Some(3),
            max_devices_per_group: [("lab".to_string(), 1)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: graced(1, 1, &[]),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Garble { host: 2 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Found at stop 55 by seed 7, on the same version: alice's job on h1
/// runs on two devices; her own cap's pick of one, kept while h1 was
/// garbled, made the other look freed soon as well, so her cap took both
/// there and left her orphan on h0, and the group took her job on h2.
#[test]
fn a_users_pick_on_an_unseen_host_frees_no_other_device_of_its_job() {
    let honest = [
        HonestHost {
            orphans: vec![0],
            ..bare(1)
        },
        HonestHost {
            alice: vec![alices(&[0, 2], &[&[0, 2], &[0]])],
            ..bare(3)
        },
        HonestHost {
            alice: vec![alices(&[0, 1], &[&[0], &[1]])],
            ..bare(2)
        },
    ];
    let setup = Setup {
        policy: Policy {
            non_env_processes: false,
            orphans_as_non_env: false,
            count_non_env_devices: false,
            max_devices_per_user: Some(3),
            max_devices_per_group: [("lab".to_string(), 1)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: Grace {
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Exemption::default()
            }],
            ..graced(1, 1, &[])
        },
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 131 at stop 56: bob restarts his job (on GPUs his environment is
/// not attached to, so env-devices waits on it) in the cycle its wait
/// comes due. Worked out for the per-user caps, the restarted job's
/// termination (env-devices alone so far) did not take up the wait of
/// the one before (env-devices and the group cap), so it freed nothing;
/// the group then took alice's idle attachment as well. Closed: a
/// restart's lineage leaves the caps out where another rule asks.
#[test]
fn a_restart_of_bobs_moves_no_pick_of_alices() {
    let honest = [
        HonestHost {
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: vec![(vec![1, 2], None)],
            }],
            ..bare(4)
        },
        HonestHost {
            alice: vec![alices(&[1, 3], &[&[1, 3]])],
            ..bare(4)
        },
    ];
    let setup = Setup {
        policy: Policy {
            env_devices: true,
            max_devices_per_user: Some(1),
            max_devices_for_user: [("bob".to_string(), 2)].into_iter().collect(),
            max_devices_per_group: [("lab".to_string(), 1)].into_iter().collect(),
            ..Policy::default()
        },
        grace: graced(1, 2, &[]),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Restart { host: 0, job: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 127 at stop 56: bob, over his own cap of 1 with three devices
/// (his job on h1 runs on an attached device and one that is not), ends
/// that job himself. Without him, his cap took his h0 device first and
/// then h1's, whose job freed both there: one more than his excess, which
/// left room in the group for alice; with him, his cap took only his
/// idle h1 record and the group took alice's newest job. A pick a later
/// one makes needless is given back ([`crate::rules::taking::take_sparing`]),
/// so his cap takes his excess alone either way.
#[test]
fn a_users_cap_takes_no_more_than_the_excess_so_his_own_end_moves_no_group_pick() {
    let (honest, setup) = bob_in_alices_group(&[0], &[1, 0], 1, 2);
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::End { host: 1, job: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 127 of the sequence property: bob, over his own cap of 2 and in
/// alice's group (cap 3), ends his newest job himself. Alone, his cap took
/// his older h0 job in genv's order and the group his newest, which left
/// room for alice; with him, his own end left him at his cap with the old
/// h0 job, and the group took alice's job, newer than it. Under a group
/// cap a member's own cap takes his working devices in the group's order
/// (the most recent first), so both take his newest either way.
#[test]
fn under_a_group_cap_his_own_cap_takes_his_newest_so_his_own_end_moves_no_group_pick() {
    let (honest, setup) = bob_in_alices_group(&[1], &[2, 0], 2, 3);
    let mut moves = vec![Vec::new(); 7];
    moves[0].push(Move::End { host: 1, job: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// h0: bob's environment on its one GPU, a job there; h1 (3 GPUs): an
/// orphan of alice's on 0, her plain jobs on 1 and 2, bob's environment
/// on `devices` with one job on `job`. bob capped at `cap`, the group
/// `lab` at 3, counting jobs outside genv; confirmed over `cycles`.
fn bob_in_alices_group(
    devices: &[u32],
    job: &[u32],
    cap: u32,
    cycles: u32,
) -> ([HonestHost; 2], Setup) {
    let honest = [
        HonestHost {
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: vec![(vec![0], None)],
            }],
            ..bare(1)
        },
        HonestHost {
            orphans: vec![0],
            plain: vec![1, 2],
            bob: vec![BobEnv {
                devices: devices.iter().copied().collect(),
                jobs: vec![(job.to_vec(), None)],
            }],
            ..bare(3)
        },
    ];
    let setup = Setup {
        policy: Policy {
            non_env_processes: false,
            env_devices: false,
            env_memory: false,
            max_devices_for_user: [("bob".to_string(), cap)].into_iter().collect(),
            max_devices_per_group: [("lab".to_string(), 3)].into_iter().collect(),
            orphans_as_non_env: false,
            count_non_env_devices: true,
            ..Policy::default()
        },
        grace: graced(cycles, 0, &[]),
        sharded: false,
    };
    (honest, setup)
}

/// Seed 101's h1 (alice's plain jobs there, her environment's job on a
/// GPU it is not attached to, an orphan) and its settings: a group cap of
/// 1, bob's own cap of 0 (he is exempt), a grace of 2 cycles and 2
/// intervals, orphans acting at once, non-env processes warned of only.
fn seed_101() -> (HonestHost, Setup) {
    let h1 = HonestHost {
        alice: vec![AliceEnv {
            devices: [2].into_iter().collect(),
            gpu_memory: Some(2862),
            jobs: vec![],
        }],
        orphans: vec![1],
        plain: vec![1, 1],
        bob: vec![BobEnv {
            devices: [1, 2].into_iter().collect(),
            jobs: vec![],
        }],
        elsewhere: vec![(1, 2)],
        ..bare(3)
    };
    let setup = Setup {
        policy: Policy {
            env_devices: false,
            env_memory: true,
            max_devices_for_user: [("bob".to_string(), 0)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: Grace {
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Default::default()
            }],
            ..graced(2, 2, &orphans_wait_non_env_warns(0))
        },
        sharded: false,
    };
    (h1, setup)
}

/// Seed 101 of the sequence property: bob garbles h0 in the cycle her
/// orphan there (her oldest job on h0's device 0) comes due, then h1 in
/// the next. Alone, the orphan ended in that cycle, so her newer job on
/// that device stood first in the group's order and was taken there;
/// with him, the orphan's wait was kept through the garble, and the
/// order the hold kept had the device held since the orphan started, so
/// the group took her plain jobs on h1 in its place. A wait due on an
/// unseen host ends for the order, as a healthy cycle would end it.
#[test]
fn a_garble_that_keeps_a_due_wait_a_cycle_moves_no_members_device_back() {
    let (h1, setup) = seed_101();
    let honest = [
        HonestHost {
            alice: vec![AliceEnv {
                devices: [1, 2].into_iter().collect(),
                gpu_memory: Some(2367),
                jobs: vec![],
            }],
            orphans: vec![0, 1],
            plain: vec![2],
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: vec![(vec![2, 2], None)],
            }],
            elsewhere: vec![(0, 0)],
            ..bare(3)
        },
        h1,
    ];
    let v = std::env::var("VARIANT").unwrap_or_default();
    let mut moves = vec![Vec::new(); 8];
    if !v.contains('a') {
        moves[0].push(Move::Garble { host: 2 });
    }
    if !v.contains('b') {
        moves[0].push(Move::Restart { host: 0, job: 1 });
    }
    if !v.contains('c') {
        moves[1].push(Move::Garble { host: 1 });
    }
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// In the very cycle bob garbles h0, the group's order counts a wait due
/// there as ended, as a healthy cycle would carry it out: alice's orphan
/// on h0's device 0 (her oldest job) is due, so the device stands where
/// her newer job there puts it, before her job on h1, and bears the
/// group's excess as its share (nothing is carried out on an unseen
/// host). Counted as still running, it sheltered the device, and her h1
/// job was terminated in its place.
#[test]
fn a_wait_due_on_an_unseen_host_ends_for_the_groups_order_in_that_cycle() {
    let honest = [
        HonestHost {
            alice: vec![AliceEnv {
                devices: [0].into_iter().collect(),
                gpu_memory: None,
                jobs: vec![(vec![0], None)],
            }],
            orphans: vec![0],
            ..bare(1)
        },
        HonestHost {
            alice: vec![AliceEnv {
                devices: [0].into_iter().collect(),
                gpu_memory: None,
                jobs: vec![(vec![0], None)],
            }],
            ..bare(1)
        },
    ];
    let mut worlds: Vec<World> = (honest.iter().enumerate())
        .map(|(h, x)| World::honest(h, x))
        .collect();
    // Her orphan on h0 first, then her job on h1, then her job on h0.
    let (orphan, on_h0) = (worlds[0].alice_orphans.len(), worlds[0].alice_jobs[0]);
    assert_eq!(orphan, 1);
    for p in worlds[0].processes.iter_mut() {
        p.start_time = Some(if i64::from(p.pid.0) == on_h0 {
            105
        } else {
            103
        });
    }
    for p in worlds[1].processes.iter_mut() {
        p.start_time = Some(104);
    }
    let setup = |cap: u32| Setup {
        policy: Policy {
            non_env_processes: true,
            env_devices: false,
            env_memory: false,
            max_devices_per_group: [("lab".to_string(), cap)].into_iter().collect(),
            orphans_as_non_env: true,
            count_non_env_devices: false,
            ..Policy::default()
        },
        grace: graced(1, 0, &[(Rule::OrphanedEnvProcesses, acts_after(1))]),
        sharded: false,
    };
    let mut enforcer = Enforcer::new(vec![0, 1], &setup(2).grace, 2);
    // Seen, within the cap: the orphan's wait begins.
    let (due, _) = enforcer.cycle(&worlds, &BTreeSet::new(), &setup(2), None, (1, clock(0)));
    assert!(
        due.hosts.iter().all(|(_, p)| p.terminate.is_empty()),
        "{due:?}"
    );
    // h0 garbled as the orphan comes due, and the cap lowered to 1.
    let garbled: BTreeSet<usize> = [0].into_iter().collect();
    let (due, _) = enforcer.cycle(&worlds, &garbled, &setup(1), None, (2, clock(1)));
    let ended: Vec<(String, u32)> = (due.hosts.iter())
        .flat_map(|(h, p)| p.terminate.iter().map(move |t| (h.0.to_string(), t.pid.0)))
        .collect();
    assert_eq!(ended, [], "her h1 job is not taken for h0's share");
}

/// Seed 101 (stop 57's open case): bob garbles h1 for the cycle the
/// group's picks there come due, so the hold keeps them a cycle. In the
/// cycle it ends, alice's plain jobs on h1 (her last in the group's
/// order, their grace out only now) were worked out beside the held picks,
/// as if those had not been carried out the cycle before, and terminated.
/// Alone, the held picks were carried out in their cycle, and the group,
/// less over, no longer needed hers. Now the released picks are worked out
/// first, as done, then what the group still needs.
#[test]
fn the_picks_a_hold_releases_are_worked_out_before_any_that_came_due_since() {
    let (h1, setup) = seed_101();
    let honest = [
        HonestHost {
            alice: vec![AliceEnv {
                devices: [0, 2].into_iter().collect(),
                gpu_memory: None,
                jobs: vec![(vec![0, 2], Some(246))],
            }],
            orphans: vec![0, 1],
            plain: vec![2],
            bob: vec![BobEnv {
                devices: [0].into_iter().collect(),
                jobs: vec![(vec![2, 2], None)],
            }],
            ..bare(3)
        },
        h1,
    ];
    // One garble of h1, in the cycle before the group's picks there come
    // due (held a cycle), and nothing else.
    let mut moves = vec![Vec::new(); 9];
    moves[1].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 7, found with the first try at the release: bob garbles h0 in
/// the cycle alice's own cap's picks come due (her jobs on h0 and h1).
/// Those on h1 are held, those on h0 go unseen (the cap sees none of h0's
/// jobs; the non-env rule, which needs no genv state, still judges her
/// plain job there, so its wait is seen as the warning's alone). In the
/// cycle after, all of them were due in the cycle before, so all are
/// released and worked out first; releasing only those held had her own
/// cap, worked out again without the h0 ones, take her job on h1's GPU 2.
#[test]
fn what_came_due_on_an_unseen_host_is_released_with_what_the_hold_kept() {
    let honest = [
        HonestHost {
            orphans: vec![1, 0],
            plain: vec![0],
            bob: vec![
                BobEnv {
                    devices: [1].into_iter().collect(),
                    jobs: vec![(vec![1], Some(1128)), (vec![0, 0], None)],
                },
                BobEnv {
                    devices: [1].into_iter().collect(),
                    jobs: vec![],
                },
            ],
            ..bare(2)
        },
        HonestHost {
            alice: vec![
                AliceEnv {
                    devices: [1, 2].into_iter().collect(),
                    gpu_memory: None,
                    jobs: vec![(vec![1, 2], Some(78)), (vec![1], None)],
                },
                AliceEnv {
                    devices: [1].into_iter().collect(),
                    gpu_memory: None,
                    jobs: vec![(vec![1], None), (vec![1], Some(280))],
                },
            ],
            orphans: vec![0, 2],
            bob: vec![BobEnv {
                devices: [1, 2].into_iter().collect(),
                jobs: vec![(vec![2], None), (vec![0, 2], None)],
            }],
            ..bare(3)
        },
    ];
    let setup = Setup {
        policy: Policy {
            non_env_processes: true,
            env_devices: false,
            env_memory: true,
            max_devices_per_user: Some(2),
            max_devices_for_user: [("bob".to_string(), 1)].into_iter().collect(),
            max_memory_for_user: [("bob".to_string(), 611319808)].into_iter().collect(),
            max_devices_per_group: [("lab".to_string(), 4)].into_iter().collect(),
            count_non_env_devices: true,
            ..Policy::default()
        },
        grace: Grace {
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Default::default()
            }],
            ..graced(
                1,
                2,
                &[(
                    Rule::NonEnvProcesses,
                    RuleGrace {
                        warn_only: true,
                        after: None,
                    },
                )],
            )
        },
        sharded: false,
    };
    // One garble of h0, in the cycle alice's own cap's picks come due.
    let mut moves = vec![Vec::new(); 7];
    moves[1].push(Move::Garble { host: 0 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// The case a review of stop 57 built by hand, rebuilt: under a group
/// cap (so alice's own cap takes her working devices the most recent
/// first), her own cap's pick is her environment's job on h1, whose
/// grace ends in the cycle her orphan's does. Alone, the orphan's end
/// makes h0's device (her plain job left there) her most recent, the pick
/// moves onto it and waits anew. bob garbles h1 as the group's pick of
/// his device comes due: the hold keeps that cycle's order, and in the
/// next her h1 job, due then, stayed her most recent and was terminated.
/// Now the pick due only in that cycle is worked out in its order.
#[test]
fn a_pick_due_only_after_a_hold_is_worked_out_in_that_cycles_order() {
    let honest = [
        HonestHost {
            orphans: vec![0],
            plain: vec![1, 1, 0],
            ..bare(2)
        },
        HonestHost {
            alice: vec![alices(&[], &[]), alices(&[0], &[&[0]])],
            bob: vec![BobEnv {
                devices: [1].into_iter().collect(),
                jobs: vec![(vec![1], None)],
            }],
            ..bare(2)
        },
    ];
    let setup = Setup {
        policy: Policy {
            max_devices_per_user: Some(2),
            max_devices_per_group: [("lab".to_string(), 2)].into_iter().collect(),
            ..lab_of_one()
        },
        grace: graced(
            1,
            2,
            &[
                orphans_wait_non_env_warns(2).as_slice(),
                &[(Rule::MaxDevicesPerGroup, acts_after(1))],
            ]
            .concat(),
        ),
        sharded: false,
    };
    let mut moves = vec![Vec::new(); 6];
    moves[0].push(Move::Garble { host: 1 });
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 151: in cycle 3 alice's own cap ends her job on h1 and detaches
/// two of its devices; the one left is idle from then on, and the group
/// (lab, 2) takes it before bob's, which his job keeps working till
/// env-devices ends it a cycle later: idle attachments go first under a
/// group cap, whoever's (a documented limit). The attachment counts as
/// idle in that cycle: her job there ends in its plan.
#[test]
fn seed_151() {
    let honest = [
        HonestHost {
            bob: vec![
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![0, 1], None)],
                },
                BobEnv {
                    devices: [1].into_iter().collect(),
                    jobs: vec![(vec![0, 0], Some(2929)), (vec![0], None)],
                },
            ],
            ..bare(2)
        },
        HonestHost {
            alice: vec![AliceEnv {
                devices: [0, 1, 3].into_iter().collect(),
                gpu_memory: None,
                jobs: vec![(vec![0, 1], Some(61))],
            }],
            plain: vec![1],
            elsewhere: vec![(0, 3), (0, 3)],
            ..bare(4)
        },
    ];
    // Seed 151 shrunk to bob's one move: a job of his (itself an
    // env-devices violation) on two GPUs of h0.
    let mut moves = vec![Vec::new(); 9];
    moves[0].push(Move::Edit(Edit::Job {
        host: 2,
        eid: Eid::Bob(0),
        gpus: vec![1, 0],
        mib: None,
    }));
    let setup = Setup {
        policy: Policy {
            non_env_processes: false,
            env_devices: true,
            env_memory: false,
            max_devices_per_user: Some(1),
            max_devices_for_user: [("bob".to_string(), 2)].into_iter().collect(),
            max_devices_per_group: [("lab".to_string(), 2)].into_iter().collect(),
            orphans_as_non_env: true,
            count_non_env_devices: false,
            ..Policy::default()
        },
        grace: graced(1, 3, &[(Rule::OrphanedEnvProcesses, acts_after(0))]),
        sharded: false,
    };
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}
/// Seed 173, shrunk to one move: bob attaches his environment on h1 to
/// the device his job of it runs on without it. env-devices no longer
/// frees it, and the group (lab, 4) needs one more: by who came last his
/// job, as old as alice's orphan on h0, kept its place and hers was
/// taken. A job brought into line stands from then ([`InLine`]).
#[test]
fn seed_173() {
    let honest = [
        HonestHost {
            alice: vec![alices(&[2], &[&[2]])],
            orphans: vec![2, 0],
            plain: vec![0],
            bob: vec![BobEnv {
                devices: [0, 3].into_iter().collect(),
                jobs: vec![(vec![0, 2], None)],
            }],
            ..bare(4)
        },
        HonestHost {
            orphans: vec![0, 1],
            bob: vec![
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![2, 2], Some(611)), (vec![1, 1], Some(1549))],
                },
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![2], None)],
                },
            ],
            ..bare(3)
        },
    ];
    let mut moves = vec![Vec::new(); 8];
    moves[1].push(Move::Edit(Edit::Attach {
        host: 1,
        env: 4,
        device: 2,
    }));
    let setup = Setup {
        policy: Policy {
            non_env_processes: true,
            env_devices: true,
            env_memory: false,
            max_devices_per_group: [("lab".to_string(), 4)].into_iter().collect(),
            orphans_as_non_env: false,
            count_non_env_devices: false,
            ..Policy::default()
        },
        grace: graced(3, 2, &[]),
        sharded: false,
    };
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}

/// Seed 173 as found (its first failing case), every move of bob's.
#[test]
fn seed_173_as_found() {
    let honest = [
        HonestHost {
            alice: vec![
                AliceEnv {
                    devices: [1, 3].into_iter().collect(),
                    gpu_memory: Some(2258),
                    jobs: vec![(vec![3], Some(302))],
                },
                alices(&[2], &[&[2]]),
            ],
            elsewhere: vec![(0, 1)],
            orphans: vec![2, 0],
            plain: vec![0],
            bob: vec![BobEnv {
                devices: [0, 3].into_iter().collect(),
                jobs: vec![(vec![0, 2], None)],
            }],
            ..bare(4)
        },
        HonestHost {
            orphans: vec![0, 1],
            bob: vec![
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![2, 2], Some(611)), (vec![1, 1], Some(1549))],
                },
                BobEnv {
                    devices: [0].into_iter().collect(),
                    jobs: vec![(vec![2], None)],
                },
            ],
            ..bare(3)
        },
    ];
    let moves = vec![
        vec![
            Move::End { host: 2, job: 2 },
            Move::Edit(Edit::List {
                host: 1,
                env: 5,
                pids: vec![PidRef::Dead, PidRef::AliceShell(2)],
                replace: true,
            }),
        ],
        vec![Move::Edit(Edit::Attach {
            host: 1,
            env: 4,
            device: 2,
        })],
        vec![Move::Restart { host: 0, job: 1 }],
        vec![
            Move::Edit(Edit::Remove { host: 2, env: 3 }),
            Move::Garble { host: 2 },
        ],
        vec![Move::Edit(Edit::Forge {
            host: 1,
            eid: Eid::Orphan(1),
            name: Name::Alice,
            pids: vec![],
            gpu_memory: None,
            first: true,
        })],
        vec![
            Move::Edit(Edit::Job {
                host: 0,
                eid: Eid::Alice(2),
                gpus: vec![0, 1],
                mib: Some(2924),
            }),
            Move::Edit(Edit::List {
                host: 0,
                env: 3,
                pids: vec![],
                replace: false,
            }),
        ],
        vec![Move::Restart { host: 2, job: 2 }],
        vec![],
    ];
    let setup = Setup {
        policy: Policy {
            non_env_processes: true,
            env_devices: true,
            env_memory: false,
            max_devices_per_group: [("lab".to_string(), 4)].into_iter().collect(),
            orphans_as_non_env: false,
            count_non_env_devices: false,
            ..Policy::default()
        },
        grace: graced(3, 2, &[]),
        sharded: false,
    };
    bob_takes_nothing_of_alices(&honest, &setup, &moves);
}
