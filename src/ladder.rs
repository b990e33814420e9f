//! Warn, then act. Each action the rules ask for keeps its identity from
//! cycle to cycle (a process by host, pid and start time; a detach by host,
//! device and environment). It is carried out only once it has been seen in
//! `--confirm-cycles` cycles and its grace (`--grace`, or its rules' own)
//! has run out; until then it waits, its owner warned once. One that goes
//! away first is cleared (said so), but its wait is kept until its deadline
//! has passed and a gap more: seen again, or a job of the same owner,
//! rules and GPUs in its place (a restart under a new pid), it goes on
//! where it was, so no absence its owner can cause resets it. A host that
//! did not answer, or whose genv state cannot be used, moves no deadline
//! and delays no confirmation: its waits count the cycle as seen (the
//! cycle that acts still sees the action), so a garble anyone can write
//! neither resets a wait nor puts one host's actions a cycle behind the
//! others'.
//! Pure: the cycle keeps one [`Ladder`] and feeds it each cycle's whole
//! plan and the time.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::{EnvId, GpuIndex, HostId, Pid};
use crate::plan::{Detach, HostPlan, Plan, Termination};
use crate::rules::taking::BLIND_AFTER;
use crate::rules::Rule;

/// How long actions wait, and which are only warned about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grace {
    /// Consecutive cycles an action must be seen in (1: at once).
    pub cycles: u32,
    /// How long after it is first seen an action waits (zero: genv's at
    /// once).
    pub after: Duration,
    /// Per-rule overrides.
    pub rules: BTreeMap<Rule, RuleGrace>,
    /// What is never acted on (the inventory's `[[exempt]]`).
    pub exempt: Vec<Exemption>,
    /// The longest time between two sightings of an action that still
    /// counts as consecutive (a looping run: a few intervals); longer, as
    /// after a stop, it starts over. `None`: any (cron runs).
    pub gap: Option<Duration>,
}

/// An exemption: the actions on a user's jobs or environments, on a host,
/// within a window, each given or any. Never by anything a user picks
/// (a process name, an environment id).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exemption {
    pub user: Option<String>,
    /// A Unix group, as each host resolves its members.
    pub group: Option<String>,
    pub host: Option<HostId>,
    /// From (ms since the Unix epoch), inclusive.
    pub from_ms: Option<u64>,
    /// Until (ms), exclusive.
    pub until_ms: Option<u64>,
    /// Said in reports.
    pub reason: String,
}

impl Exemption {
    /// Whether it covers an action on `host` charged to `user`, a member
    /// of `groups` there, at `now`.
    pub fn covers(&self, host: &HostId, user: Option<&str>, groups: &[String], now: u64) -> bool {
        self.user.as_deref().is_none_or(|u| user == Some(u))
            && self.group.as_ref().is_none_or(|g| groups.contains(g))
            && self.host.as_ref().is_none_or(|h| h == host)
            && self.from_ms.is_none_or(|f| now >= f)
            && self.until_ms.is_none_or(|u| now < u)
    }
}

/// One rule's own grace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleGrace {
    /// Warned about, never acted on.
    pub warn_only: bool,
    /// Its grace, instead of the run's.
    pub after: Option<Duration>,
}

impl Grace {
    /// The grace of an action asked for by `rules`: the shortest of theirs
    /// (one rule that acts at once is enough to act at once); `None` when
    /// every one of them only warns. A group cap joining another rule that
    /// acts never brings that rule's wait forward: the group's excess may
    /// be another member's, who must not hasten this one's action. It
    /// takes what such a wait frees first ([`crate::rules::taking::SOON`]),
    /// so its excess comes down when the wait ends.
    fn of(&self, rules: impl IntoIterator<Item = Rule>) -> Option<Duration> {
        let after = |r: &Rule| match self.rules.get(r) {
            Some(g) if g.warn_only => None,
            Some(g) => Some(g.after.unwrap_or(self.after)),
            None => Some(self.after),
        };
        let rules: Vec<Rule> = rules.into_iter().collect();
        if rules.is_empty() {
            return Some(self.after);
        }
        let others = (rules.iter())
            .filter(|r| **r != Rule::MaxDevicesPerGroup)
            .filter_map(after)
            .min();
        others.or_else(|| rules.iter().filter_map(after).min())
    }
}

/// The device caps, whose picks are carried out together
/// ([`Ladder::hold_caps`]).
const CAPS: crate::rules::Rules =
    enumset::enum_set!(Rule::MaxDevicesPerUser | Rule::MaxDevicesPerGroup);

/// What identifies an action from one cycle to the next.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
enum Key {
    Terminate(HostId, Pid, Option<u64>),
    Detach(HostId, GpuIndex, EnvId),
}

/// The action itself, for messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum What {
    Terminate(Termination),
    Detach(Detach),
}

impl What {
    /// The rules behind it.
    pub fn rules(&self) -> Vec<Rule> {
        match self {
            What::Terminate(t) => t.rules.iter().collect(),
            What::Detach(d) if d.rules.is_empty() => vec![Rule::MaxDevicesPerUser],
            What::Detach(d) => d.rules.iter().collect(),
        }
    }

    /// Whom an exemption must name to cover it, and their groups there:
    /// a process's user; for a detach, its owner (a live process of the
    /// charged user carries the environment), never a record's name.
    fn exempted_as(&self) -> (Option<&str>, &[String]) {
        match self {
            What::Terminate(t) => (t.user.as_deref(), &t.groups),
            What::Detach(d) => match &d.owner {
                Some(o) => (Some(o), &d.groups),
                None => (None, &[]),
            },
        }
    }

    /// The user it is charged to, if known.
    pub fn user(&self) -> Option<&str> {
        match self {
            What::Terminate(t) => t.user.as_deref(),
            What::Detach(d) => d.charged.as_deref(),
        }
    }

    /// The groups of the user it is charged to on its host, as far as the
    /// host said (asked only for group exemptions).
    pub fn groups(&self) -> &[String] {
        match self {
            What::Terminate(t) => &t.groups,
            What::Detach(d) => &d.groups,
        }
    }

    /// The user the kernel says it is about (the process's uid; for a
    /// detach, a live process of the charged user carrying the
    /// environment), if any: whom to tell.
    pub fn owner(&self) -> Option<&str> {
        match self {
            What::Terminate(t) => t.uid.and(t.user.as_deref()),
            What::Detach(d) => d.owner.as_deref(),
        }
    }
}

/// One action's progress.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Track {
    /// The action as last seen.
    what: What,
    /// Consecutive cycles it was seen in.
    seen: u32,
    /// When first seen (ms since the Unix epoch).
    since: u64,
    /// When it may be carried out (ms), `None`: never (warned only).
    deadline: Option<u64>,
    warned: bool,
    acted: bool,
    /// Exempt when last seen: its grace starts anew when next seen
    /// without its exemption.
    #[serde(default)]
    exempted: bool,
    /// A rule that acts has asked for it: its wait has begun. Warned of
    /// only until then (every rule asking only warns), it begins when the
    /// first rule that acts joins, and never again while it is tracked.
    #[serde(default)]
    acts: bool,
    /// When last seen (ms), or when a cycle last passed while it was
    /// away (`absent`).
    #[serde(default)]
    last: u64,
    /// Since when it has not been seen (ms), if it is away: its wait is
    /// kept, deadline and all, until that deadline has passed and it has
    /// stayed away a while ([`Ladder::window`]); seen again (or a job of
    /// the same owner, rules and GPUs in its place), it goes on from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    absent: Option<u64>,
    /// Cycles in a row its host has gone unseen (unanswered, or its genv
    /// state unusable) since it was last seen.
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    unseen: u32,
    /// Cycles it was held back when due ([`Ladder::hold_caps`]): never
    /// more than [`MAX_HELD`], whatever a user garbles.
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    held: u32,
}

/// Cycles a due action is held back for the caps' picks that an unseen
/// host hides, at most, over its whole wait.
const MAX_HELD: u32 = BLIND_AFTER - 1;

/// What a restarted job has in common with the one before it: its host,
/// its owner's uid, the rules asking and its GPUs (none of which the owner
/// can change by restarting it). Of the rules, those that judge the job
/// itself; the device caps only where no other rule asks: whether a cap
/// joins them changes as the caps are worked out, and with what other
/// users hold, so it must not decide whether a restart takes up a wait
/// (worked out with the caps after, a restart seen as a fresh wait freed
/// nothing for the caps before, who then took more: seed 131).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Lineage(HostId, u32, crate::rules::Rules, Vec<GpuIndex>);

impl Lineage {
    /// The lineage of a termination whose owner the kernel names.
    fn of(key: &Key, what: &What) -> Option<Lineage> {
        match (key, what) {
            (Key::Terminate(host, ..), What::Terminate(t)) => {
                let mut gpus = t.gpus.to_vec();
                gpus.sort_unstable();
                let own = t.rules - CAPS;
                let rules = if own.is_empty() { t.rules } else { own };
                Some(Lineage(host.clone(), t.uid?, rules, gpus))
            }
            _ => None,
        }
    }
}

/// Where an action stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Seen, waiting; its owner was told.
    Warned,
    /// Carried out (or, in a dry run, would be).
    Acted,
    /// Gone before its deadline.
    Cleared,
}

/// Something to tell about an action, once per action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub stage: Stage,
    pub host: HostId,
    #[serde(flatten)]
    pub what: What,
    /// When first seen (ms since the Unix epoch).
    pub since_ms: u64,
    /// When it is (or was) due; `None`: warned only.
    pub deadline_ms: Option<u64>,
}

/// An action that waits: for more sightings (`--confirm-cycles`), for its
/// grace to run out, or for ever (warned only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Waiting {
    Terminate {
        host: HostId,
        pid: Pid,
        seen: u32,
        needed: u32,
        /// When it is due (ms since the Unix epoch), if a grace applies;
        /// with `warn_only`, never.
        #[serde(skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        warn_only: bool,
        /// Why it is exempt, if it is: never acted on.
        #[serde(skip_serializing_if = "Option::is_none")]
        exempt: Option<String>,
    },
    Detach {
        host: HostId,
        device: GpuIndex,
        eid: EnvId,
        seen: u32,
        needed: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        warn_only: bool,
        /// Why it is exempt, if it is: never acted on.
        #[serde(skip_serializing_if = "Option::is_none")]
        exempt: Option<String>,
    },
}

impl Waiting {
    /// The host it waits on.
    pub fn host(&self) -> &HostId {
        match self {
            Waiting::Terminate { host, .. } | Waiting::Detach { host, .. } => host,
        }
    }
}

/// The processes judged this cycle on the hosts that answered with usable
/// state: by host, pid and start time, the environment each carried.
pub type Judged = HashMap<(HostId, Pid, u64), Option<EnvId>>;

/// Every action's progress, from cycle to cycle.
#[derive(Debug, Clone, Default)]
pub struct Ladder {
    grace: Grace,
    tracks: HashMap<Key, Track>,
    /// The waits kept while away, by lineage (terminations whose owner
    /// the kernel names).
    away: HashMap<Lineage, Key>,
    /// This cycle, what only the caps ask for waits ([`Ladder::hold_caps`]).
    caps_held: bool,
    /// The last cycle held the caps or had a host unseen
    /// ([`Ladder::after_hold`]).
    after_hold: bool,
}

/// One action's progress as kept across restarts (`--state-db`): opaque
/// outside this module.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Saved {
    key: Key,
    track: Track,
}

/// The keys of every action of `plan`.
fn present(plan: &Plan) -> HashSet<Key> {
    (plan.hosts.iter())
        .flat_map(|(host, p)| keyed(host, p).map(|(k, _)| k))
        .collect()
}

/// A host plan's actions with what identifies each from cycle to cycle,
/// in plan order (terminations, then detaches).
fn keyed<'a>(host: &'a HostId, p: &'a HostPlan) -> impl Iterator<Item = (Key, What)> + 'a {
    let terminations = p.terminate.iter().map(move |t| {
        (
            Key::Terminate(host.clone(), t.pid, t.start_time),
            What::Terminate(t.clone()),
        )
    });
    let detaches = p.detach.iter().map(move |d| {
        (
            Key::Detach(host.clone(), d.device, d.eid.clone()),
            What::Detach(d.clone()),
        )
    });
    terminations.chain(detaches)
}

/// Milliseconds of `d`.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Ladder {
    /// Actions wait as `grace` says (nothing waits by default: genv).
    pub fn new(mut grace: Grace) -> Self {
        grace.cycles = grace.cycles.max(1);
        Ladder {
            grace,
            tracks: HashMap::new(),
            away: HashMap::new(),
            caps_held: false,
            after_hold: false,
        }
    }

    /// How long a wait is kept while its action is away, past its
    /// deadline: the run's gap between sightings (an hour for cron runs).
    fn window(&self) -> u64 {
        ms(self.grace.gap.unwrap_or(Duration::from_secs(3600)))
    }

    /// Whether the wait `t`, away, is over at `now`.
    fn expired(&self, t: &Track, now: u64) -> bool {
        t.absent.is_some_and(|a| {
            let from = a.max(t.deadline.unwrap_or(0));
            now.saturating_sub(from) > self.window()
        })
    }

    /// Holds back this cycle every action that only the device caps ask
    /// for, while one of theirs waits on a host of `unseen` (unanswered, or
    /// its genv state unusable), unseen fewer than [`BLIND_AFTER`] cycles
    /// in a row (then the caps go on without it: a host down or kept
    /// garbled holds nothing back for long): a cap's picks are worked out
    /// together and carried out together. Carried out in part, the cap
    /// worked out again when the unseen host is back may pick another job
    /// of the same user in place of the one carried out elsewhere, and a
    /// garble anyone can write would choose which. What is held counts the
    /// cycle as seen, and comes due with the rest once that host is seen.
    /// Sharded, another shard that held its picks last cycle (`elsewhere`)
    /// holds ours too. Returns whether a pick waits on a host of `unseen`
    /// (for our part, so that the other shards hold theirs).
    pub fn hold_caps(&mut self, unseen: &[HostId], elsewhere: bool) -> bool {
        let own = self.unseen_picks(unseen).next().is_some();
        self.caps_held = own || elsewhere;
        own
    }

    /// The caps' picks that wait on a host of `unseen`, unseen fewer than
    /// [`BLIND_AFTER`] cycles in a row.
    fn unseen_picks<'a>(&'a self, unseen: &'a [HostId]) -> impl Iterator<Item = &'a Track> + 'a {
        (self.tracks.iter())
            .filter(move |(k, t)| {
                let (Key::Terminate(host, ..) | Key::Detach(host, ..)) = k;
                unseen.contains(host)
                    && t.unseen + 1 < BLIND_AFTER
                    && !t.acted
                    && t.absent.is_none()
                    && !t.exempted
                    && t.deadline.is_some()
                    && t.what.rules().iter().any(|r| CAPS.contains(*r))
            })
            .map(|(_, t)| t)
    }

    /// Whether the action `t` tracks is carried out at `now`: due, and not
    /// one only the caps ask for while they are held (each at most
    /// [`MAX_HELD`] cycles: garbles taking turns on two hosts delay no
    /// action longer).
    fn due_now(&self, t: &Track, now: u64) -> bool {
        self.due(t, now) && !self.held_back(t, now)
    }

    /// Whether `t`'s action, due at `now`, is held back this cycle: one
    /// only the caps ask for, or one a user's own cap joins before the
    /// deadline of the other rules that act on it (a cap that a garble
    /// moves onto a job whose own wait runs must not bring that wait
    /// forward while its picks are held; a group cap never does,
    /// [`Grace::of`]).
    fn held_back(&self, t: &Track, now: u64) -> bool {
        if !self.caps_held || t.held >= MAX_HELD {
            return false;
        }
        let rules = t.what.rules();
        let others: Vec<Rule> = (rules.iter().copied())
            .filter(|r| !CAPS.contains(*r))
            .collect();
        if others.is_empty() {
            return true;
        }
        // Held only where it waits on another rule's deadline: one that
        // other rules only warn of is the cap's alone (not held, as
        // before: holding it let the cap, worked out again, move).
        let waits_on = (self.grace.of(others)).map(|g| t.since.saturating_add(ms(g)));
        rules.contains(&Rule::MaxDevicesPerUser) && waits_on.is_some_and(|d| now < d)
    }

    /// Whether a pick of the caps that is due at `now` is carried out a
    /// cycle late: one waits on a host of `unseen` (this cycle counted as
    /// a sighting), or the caps' hold keeps back one of `plan`
    /// ([`Ladder::hold_caps`] first).
    pub fn holds_back(&self, plan: &Plan, unseen: &[HostId], now: u64) -> bool {
        let cycles = self.grace.cycles;
        let unseen_due = (self.unseen_picks(unseen))
            .any(|t| t.seen + 1 >= cycles && t.deadline.is_some_and(|d| now >= d));
        unseen_due
            || self.caps_held
                && (plan.hosts.iter()).any(|(host, p)| {
                    let present: HashSet<Key> = keyed(host, p).map(|(k, _)| k).collect();
                    keyed(host, p).any(|(key, what)| {
                        let t = self.standing(&key, &what, now, &present);
                        self.exempt(host, &what, now).is_none()
                            && self.due(&t, now)
                            && self.held_back(&t, now)
                    })
                })
    }

    /// The lineage index of the waits kept while away.
    fn index_away(&mut self) {
        let mut away: HashMap<Lineage, (u64, Key)> = HashMap::new();
        for (k, t) in self.tracks.iter().filter(|(_, t)| t.absent.is_some()) {
            let Some(l) = Lineage::of(k, &t.what) else {
                continue;
            };
            // Of two away with one lineage, the longest waiting.
            match away.get(&l) {
                Some((since, _)) if *since <= t.since => {}
                _ => {
                    away.insert(l, (t.since, k.clone()));
                }
            }
        }
        self.away = away.into_iter().map(|(l, (_, k))| (l, k)).collect();
    }

    /// The track of `key`: its own, or the wait of a job of the same
    /// lineage that a restarted job takes up (with the key it was kept
    /// under): one kept while away, or one gone this cycle (not in
    /// `present`), the longest waiting.
    fn track_of(&self, key: &Key, what: &What, present: &HashSet<Key>) -> Option<(&Key, &Track)> {
        if let Some(kt) = self.tracks.get_key_value(key) {
            return Some(kt);
        }
        let lineage = Lineage::of(key, what)?;
        if let Some(kt) = (self.away.get(&lineage))
            .and_then(|old| self.tracks.get_key_value(old))
            .filter(|(_, t)| t.absent.is_some())
        {
            return Some(kt);
        }
        (self.tracks.iter())
            .filter(|(k, _)| matches!(k, Key::Terminate(h, ..) if *h == lineage.0))
            .filter(|(k, t)| !t.acted && t.absent.is_none() && !present.contains(*k))
            .filter(|(k, t)| Lineage::of(k, &t.what).as_ref() == Some(&lineage))
            .min_by_key(|(_, t)| t.since)
    }

    /// Every action's progress, to be kept across a restart.
    pub fn export(&self) -> Vec<Saved> {
        self.tracks
            .iter()
            .map(|(key, track)| Saved {
                key: key.clone(),
                track: track.clone(),
            })
            .collect()
    }

    /// Actions wait as `grace` says, each where `saved` left it: a restart
    /// neither warns again nor moves a deadline.
    pub fn restore(grace: Grace, saved: Vec<Saved>) -> Self {
        let mut ladder = Ladder::new(grace);
        ladder.tracks = saved.into_iter().map(|s| (s.key, s.track)).collect();
        ladder.index_away();
        ladder
    }

    /// Every action's progress kept, waiting now as `grace` says (a
    /// reloaded configuration).
    pub fn regrace(&mut self, mut grace: Grace) {
        grace.cycles = grace.cycles.max(1);
        self.grace = grace;
    }

    /// What of `plan` waits at `now` (ms): the actions the ladder holds
    /// back, which free nothing under the caps this cycle.
    pub fn held(&self, plan: &Plan, now: u64) -> crate::rules::Withheld {
        let mut held = crate::rules::Withheld::default();
        if self.immediate() {
            return held;
        }
        for w in self.split(plan, now).1 {
            match w {
                Waiting::Terminate {
                    host,
                    pid,
                    warn_only,
                    exempt,
                    ..
                } => {
                    if !warn_only && exempt.is_none() {
                        held.waiting_terminations.insert((host.clone(), pid));
                    }
                    held.terminations.insert((host, pid));
                }
                Waiting::Detach {
                    host,
                    device,
                    eid,
                    warn_only,
                    exempt,
                    ..
                } => {
                    if !warn_only && exempt.is_none() {
                        (held.waiting_detaches).insert((host.clone(), device, eid.clone()));
                    }
                    held.detaches.insert((host, device, eid));
                }
            }
        }
        held
    }

    /// The waits kept for `unseen` processes (host, pid, start time: ones
    /// that carry an environment id on a host whose genv state is unusable
    /// this cycle, so that no rule judges them), asked for by a rule that
    /// acts and is not a device cap, not exempt: carried out once the host
    /// is seen again (so the caps count what they free as a healthy cycle
    /// would: soon). A host unusable [`BLIND_AFTER`] cycles in a row keeps
    /// none (its unseen jobs are then taken under the caps).
    pub fn unseen_waits(
        &self,
        unseen: &HashSet<(HostId, Pid, u64)>,
        now: u64,
    ) -> HashSet<(HostId, Pid)> {
        (self.unseen_tracks(unseen, now))
            .map(|(host, pid, _)| (host.clone(), pid))
            .collect()
    }

    /// Of [`Ladder::unseen_waits`], those due this cycle (confirmed and
    /// past their deadline): a healthy cycle would carry them out now, so
    /// the group caps' order counts them as ended
    /// ([`crate::rules::Withheld::unseen_due`]), and a garble that keeps
    /// them a cycle moves no member's device back.
    pub fn unseen_due(
        &self,
        unseen: &HashSet<(HostId, Pid, u64)>,
        now: u64,
    ) -> HashSet<(HostId, Pid)> {
        let cycles = self.grace.cycles;
        (self.unseen_tracks(unseen, now))
            .filter(|(_, _, t)| t.seen + 1 >= cycles && t.deadline.is_some_and(|d| now >= d))
            .map(|(host, pid, _)| (host.clone(), pid))
            .collect()
    }

    /// Whether the last cycle held the caps' picks back or had a host
    /// unseen: then [`Ladder::released`] may find what it kept.
    pub fn after_hold(&self) -> bool {
        self.after_hold
    }

    /// The caps' picks of `plan` that were due in the last cycle and not
    /// carried out there (the caps' hold kept them back, or their host
    /// was unseen or unusable), carried out at `now`: none while a pick
    /// of the caps waits on a host of `unseen` (the hosts unusable this
    /// cycle), as the hold goes on. The caps work them out first, as done
    /// in the cycle they came due, then what they still need
    /// ([`crate::rules::Released`]).
    pub fn released(&self, plan: &Plan, unseen: &[HostId], now: u64) -> crate::rules::Released {
        let mut released = crate::rules::Released::default();
        if self.immediate() || !self.after_hold || self.unseen_picks(unseen).next().is_some() {
            return released;
        }
        let present = present(plan);
        for (host, p) in &plan.hosts {
            for (key, what) in keyed(host, p) {
                if !what.rules().iter().any(|r| CAPS.contains(*r)) {
                    continue;
                }
                let Some((_, t)) = self.track_of(&key, &what, &present) else {
                    continue;
                };
                if t.acted || t.absent.is_some() || t.last >= now {
                    continue;
                }
                // Due as it stands now, and already when last looked at.
                let s = self.standing(&key, &what, now, &present);
                let was_due = s.seen > self.grace.cycles && s.deadline.is_some_and(|d| d <= t.last);
                if !was_due || self.exempt(host, &what, now).is_some() {
                    continue;
                }
                match what {
                    What::Terminate(t) => {
                        released.terminations.insert((host.clone(), t.pid));
                    }
                    What::Detach(d) => {
                        released.detaches.insert((host.clone(), d.device, d.eid));
                    }
                }
            }
        }
        released
    }

    fn unseen_tracks<'a>(
        &'a self,
        unseen: &'a HashSet<(HostId, Pid, u64)>,
        now: u64,
    ) -> impl Iterator<Item = (&'a HostId, Pid, &'a Track)> + 'a {
        let none = self.immediate() || unseen.is_empty();
        (self.tracks.iter())
            .filter(move |_| !none)
            .filter_map(move |(k, t)| match k {
                Key::Terminate(host, pid, Some(start))
                    if unseen.contains(&(host.clone(), *pid, *start)) =>
                {
                    Some((host, *pid, t))
                }
                _ => None,
            })
            .filter(move |(host, _, t)| {
                let others: Vec<Rule> = (t.what.rules().into_iter())
                    .filter(|r| !CAPS.contains(*r))
                    .collect();
                !others.is_empty()
                    && self.grace.of(others).is_some()
                    && !t.acted
                    && t.absent.is_none()
                    && !t.exempted
                    && t.unseen + 1 < BLIND_AFTER
                    && self.exempt(host, &t.what, now).is_none()
            })
    }

    /// Whether anything may wait (a grace, confirmation or exemption).
    pub fn waits(&self) -> bool {
        !self.immediate()
    }

    /// Whether anything ever waits.
    fn immediate(&self) -> bool {
        self.grace.cycles == 1
            && self.grace.after.is_zero()
            && self.grace.rules.is_empty()
            && self.grace.exempt.is_empty()
    }

    /// How an action would stand if seen now (its track carried over).
    fn standing(&self, key: &Key, what: &What, now: u64, present: &HashSet<Key>) -> Track {
        let fresh = Track {
            what: what.clone(),
            seen: 1,
            since: now,
            deadline: None,
            warned: false,
            acted: false,
            exempted: false,
            acts: false,
            last: now,
            absent: None,
            unseen: 0,
            held: 0,
        };
        let stale = |t: &Track| {
            self.grace
                .gap
                .is_some_and(|g| now.saturating_sub(t.last) > ms(g))
        };
        let grace = self.grace.of(what.rules());
        let acting = grace.is_some();
        let found = self.track_of(key, what, present);
        // Taken up by another process: it is warned of anew.
        let other = found.is_some_and(|(k, _)| k != key);
        let mut track = match found.map(|(_, t)| t) {
            // Its wait is over: it starts anew.
            Some(t) if self.expired(t, now) => fresh,
            // Seen before a stop: it starts over.
            Some(t) if stale(t) => fresh,
            // Warned of only until now: a rule that acts joins, and its
            // wait begins, warned of anew.
            Some(t) if !t.acts && t.deadline.is_none() && acting => fresh,
            // Exempt until now: its grace starts now.
            Some(t) if t.exempted => Track {
                seen: t.seen.saturating_add(1),
                ..fresh
            },
            Some(t) => Track {
                what: what.clone(),
                seen: t.seen.saturating_add(1),
                last: now,
                absent: None,
                unseen: 0,
                warned: t.warned && !other,
                ..t.clone()
            },
            None => fresh,
        };
        // The deadline follows the rules the action is asked for by now.
        track.deadline = grace.map(|g| track.since.saturating_add(ms(g)));
        track.acts |= acting;
        track
    }

    /// Why `what` on `host` is not acted on at `now`, if it is exempt.
    fn exempt(&self, host: &HostId, what: &What, now: u64) -> Option<&str> {
        let (user, groups) = what.exempted_as();
        self.grace
            .exempt
            .iter()
            .find(|e| e.covers(host, user, groups, now))
            .map(|e| e.reason.as_str())
    }

    fn due(&self, t: &Track, now: u64) -> bool {
        t.seen >= self.grace.cycles && t.deadline.is_some_and(|d| now >= d)
    }

    /// A host's plan split into what is due at `now` (ms) and what waits.
    pub fn split_host(&self, host: &HostId, plan: &HostPlan, now: u64) -> (HostPlan, Vec<Waiting>) {
        if self.immediate() {
            return (plan.clone(), Vec::new());
        }
        let mut due = HostPlan::default();
        let mut waiting = Vec::new();
        let present: HashSet<Key> = keyed(host, plan).map(|(k, _)| k).collect();
        for (key, what) in keyed(host, plan) {
            let track = self.standing(&key, &what, now, &present);
            let exempt = self.exempt(host, &what, now);
            if exempt.is_none() && self.due_now(&track, now) {
                match what {
                    What::Terminate(t) => due.terminate.push(t),
                    What::Detach(d) => due.detach.push(d),
                }
                continue;
            }
            let (seen, needed) = (track.seen, self.grace.cycles);
            let deadline_ms = track.deadline.filter(|d| *d > track.since);
            let (warn_only, exempt) = (track.deadline.is_none(), exempt.map(String::from));
            let host = host.clone();
            waiting.push(match what {
                What::Terminate(t) => Waiting::Terminate {
                    host,
                    pid: t.pid,
                    seen,
                    needed,
                    deadline_ms,
                    warn_only,
                    exempt,
                },
                What::Detach(d) => Waiting::Detach {
                    host,
                    device: d.device,
                    eid: d.eid,
                    seen,
                    needed,
                    deadline_ms,
                    warn_only,
                    exempt,
                },
            });
        }
        (due, waiting)
    }

    /// The whole plan split into what is due at `now` (ms) and what waits.
    pub fn split(&self, plan: &Plan, now: u64) -> (Plan, Vec<Waiting>) {
        let mut due = Plan::default();
        let mut waiting = Vec::new();
        for (host, p) in &plan.hosts {
            let (d, w) = self.split_host(host, p, now);
            if !d.is_empty() {
                due.hosts.push((host.clone(), d));
            }
            waiting.extend(w);
        }
        (due, waiting)
    }

    /// Ends a cycle whose whole (unsplit) plan was `plan`, at `now` (ms):
    /// what it holds has been seen once more, what it lacks starts over.
    /// When nothing waits (genv's way, no ladder events): an `acted`
    /// event for each action of `plan`, to tell its owner what was done.
    pub fn acted_at_once(&self, plan: &Plan, now: u64) -> Vec<Event> {
        if !self.immediate() {
            return Vec::new();
        }
        plan.hosts
            .iter()
            .flat_map(|(host, p)| {
                keyed(host, p).map(move |(_, what)| Event {
                    stage: Stage::Acted,
                    host: host.clone(),
                    what,
                    since_ms: now,
                    deadline_ms: Some(now),
                })
            })
            .collect()
    }

    /// Returns what to tell, each once per action: `warned` when an action
    /// first waits on a grace (not on `--confirm-cycles` alone), `acted`
    /// when it is first due, `cleared` when a warned action goes away
    /// before it was due.
    pub fn advance(&mut self, plan: &Plan, now: u64, unanswered: &[HostId]) -> Vec<Event> {
        self.advance_seen(plan, now, unanswered, &Judged::default())
    }

    /// [`Ladder::advance`], knowing which processes were judged this cycle
    /// and found as they were (`judged`): a termination whose process is
    /// among them, same environment, has really ended (its violation
    /// resolved, by whoever), so its wait ends too. One whose process is
    /// gone, or carries another id, is kept a while (see the module).
    pub fn advance_seen(
        &mut self,
        plan: &Plan,
        now: u64,
        unanswered: &[HostId],
        judged: &Judged,
    ) -> Vec<Event> {
        if self.immediate() {
            self.tracks.clear();
            return Vec::new();
        }
        let mut events = Vec::new();
        let mut tracks = HashMap::with_capacity(self.tracks.len());
        // The waits that a restarted job takes up.
        let mut taken_up = HashSet::new();
        let present = present(plan);
        for (host, p) in &plan.hosts {
            for (key, what) in keyed(host, p) {
                if let Some((old, _)) = self.track_of(&key, &what, &present) {
                    if *old != key {
                        taken_up.insert(old.clone());
                    }
                }
                if self.exempt(host, &what, now).is_some() {
                    // Its grace starts when the exemption ends.
                    let track = Track {
                        exempted: true,
                        ..self.standing(&key, &what, now, &present)
                    };
                    tracks.insert(key, track);
                    continue;
                }
                let mut track = self.standing(&key, &what, now, &present);
                let event = |stage| Event {
                    stage,
                    host: host.clone(),
                    what: what.clone(),
                    since_ms: track.since,
                    deadline_ms: track.deadline,
                };
                if self.due(&track, now) && self.held_back(&track, now) {
                    track.held = track.held.saturating_add(1);
                } else if self.due(&track, now) {
                    if !track.acted {
                        events.push(event(Stage::Acted));
                        track.acted = true;
                    }
                } else if !track.warned && !matches!(track.deadline, Some(d) if d <= track.since) {
                    events.push(event(Stage::Warned));
                    track.warned = true;
                }
                tracks.insert(key, track);
            }
        }
        for (key, mut old) in std::mem::take(&mut self.tracks) {
            if tracks.contains_key(&key) || taken_up.contains(&key) {
                continue;
            }
            let (Key::Terminate(host, ..) | Key::Detach(host, ..)) = &key;
            if unanswered.contains(host) {
                // Not seen this cycle (its host unanswered, or its genv
                // state unusable), but not gone either: kept, the cycle
                // counted as a sighting while it was last seen (nothing
                // acts before it is seen again; a wait already away gains
                // nothing).
                old.last = now;
                if old.absent.is_none() {
                    old.seen = old.seen.saturating_add(1);
                    old.unseen = old.unseen.saturating_add(1);
                }
                tracks.insert(key, old);
                continue;
            }
            if old.acted {
                continue;
            }
            let ended = match (&key, &old.what) {
                // Only a job's wait is kept away (a restart takes it up).
                (Key::Detach(..), _) => true,
                (Key::Terminate(host, pid, Some(start)), What::Terminate(t)) => {
                    judged.get(&(host.clone(), *pid, *start)) == Some(&t.eid)
                }
                _ => false,
            };
            if old.absent.is_some() && !ended {
                // Still away: kept until its wait is over.
                if !self.expired(&old, now) {
                    old.last = now;
                    tracks.insert(key, old);
                }
                continue;
            }
            // Gone this cycle: said, and its wait kept a while, so that an
            // absence its owner causes (a job restarted under a new pid,
            // one that carries another id for a cycle) resets nothing.
            if old.warned {
                let (Key::Terminate(host, ..) | Key::Detach(host, ..)) = &key;
                events.push(Event {
                    stage: Stage::Cleared,
                    host: host.clone(),
                    what: old.what.clone(),
                    since_ms: old.since,
                    deadline_ms: old.deadline,
                });
            }
            if ended {
                continue;
            }
            old.warned = false;
            old.absent = Some(now);
            old.last = now;
            tracks.insert(key, old);
        }
        self.tracks = tracks;
        self.index_away();
        // Held for this cycle's split and advance only.
        self.after_hold = self.caps_held || !unanswered.is_empty();
        self.caps_held = false;
        events.sort_by_cached_key(|e| {
            // Terminations before detaches, as in a plan.
            let (kind, pid, device, eid) = match &e.what {
                What::Terminate(t) => (0, t.pid.0, 0, Arc::from("")),
                What::Detach(d) => (1, 0, d.device.0, d.eid.0.clone()),
            };
            (e.host.clone(), e.since_ms, kind, pid, device, eid)
        });
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::Rules;

    /// A rule's grace that only warns.
    fn warns() -> RuleGrace {
        RuleGrace {
            warn_only: true,
            after: None,
        }
    }

    /// A rule's grace that acts `after`.
    fn acts_after(after: Duration) -> RuleGrace {
        RuleGrace {
            warn_only: false,
            after: Some(after),
        }
    }

    /// The orphan rule acting after 2 minutes, the non-env rule warning.
    fn orphans_wait_non_env_warns() -> BTreeMap<Rule, RuleGrace> {
        [
            (
                Rule::OrphanedEnvProcesses,
                acts_after(Duration::from_secs(120)),
            ),
            (Rule::NonEnvProcesses, warns()),
        ]
        .into()
    }

    fn cycles(n: u32) -> Grace {
        Grace {
            cycles: n,
            ..Grace::default()
        }
    }

    fn plan(pids: &[(u32, u64)], detach: &[(u32, &str)]) -> Plan {
        Plan {
            hosts: vec![(
                HostId("h".into()),
                HostPlan {
                    terminate: pids
                        .iter()
                        .map(|&(p, s)| Termination::of(Pid(p), Some(s)))
                        .collect(),
                    detach: detach
                        .iter()
                        .map(|&(d, e)| Detach {
                            rules: Default::default(),
                            groups: Default::default(),
                            device: GpuIndex(d),
                            eid: EnvId(e.into()),
                            username: None,
                            charged: None,
                            owner: None,
                            working: false,
                        })
                        .collect(),
                },
            )],
        }
    }

    fn acted(c: &Ladder, p: &Plan) -> (Vec<u32>, Vec<u32>, usize) {
        acted_at(c, p, 0)
    }

    fn acted_at(c: &Ladder, p: &Plan, now: u64) -> (Vec<u32>, Vec<u32>, usize) {
        let (done, waiting) = c.split(p, now);
        let hp = done
            .hosts
            .first()
            .map(|(_, h)| h.clone())
            .unwrap_or_default();
        (
            hp.terminate.iter().map(|t| t.pid.0).collect(),
            hp.detach.iter().map(|d| d.device.0).collect(),
            waiting.len(),
        )
    }

    #[test]
    fn what_only_waits_is_told_from_what_is_never_carried_out() {
        // 7 waits for a second sighting; 8 is warned only; 9 is exempt;
        // the detach waits.
        let mut p = plan(&[(7, 1), (8, 1), (9, 1)], &[(2, "e")]);
        let hp = &mut p.hosts[0].1;
        hp.terminate[1].rules = Rule::NonEnvProcesses.into();
        hp.terminate[2].user = Some("bob".into());
        let warn = RuleGrace {
            warn_only: true,
            after: None,
        };
        let grace = Grace {
            cycles: 2,
            rules: [(Rule::NonEnvProcesses, warn)].into_iter().collect(),
            exempt: vec![Exemption {
                user: Some("bob".into()),
                reason: "a deadline".into(),
                ..Exemption::default()
            }],
            ..Grace::default()
        };
        let held = Ladder::new(grace).held(&p, 0);
        let h = HostId("h".into());
        let pids = |ps: &[u32]| {
            ps.iter()
                .map(|p| (h.clone(), Pid(*p)))
                .collect::<HashSet<_>>()
        };
        assert_eq!(held.terminations, pids(&[7, 8, 9]));
        assert_eq!(held.waiting_terminations, pids(&[7]));
        let detach: HashSet<_> = [(h.clone(), GpuIndex(2), EnvId("e".into()))].into();
        assert_eq!((&held.detaches, &held.waiting_detaches), (&detach, &detach));
        let lasting = held.lasting();
        assert_eq!(lasting.terminations, pids(&[8, 9]));
        assert!(lasting.detaches.is_empty() && lasting.waiting_terminations.is_empty());
        // Warned only, the detach is lasting too.
        let mut p = plan(&[], &[(2, "e")]);
        p.hosts[0].1.detach[0].rules = Rule::NonEnvProcesses.into();
        let grace = Grace {
            cycles: 2,
            rules: [(Rule::NonEnvProcesses, warn)].into_iter().collect(),
            ..Grace::default()
        };
        let held = Ladder::new(grace).held(&p, 0);
        assert_eq!(held.detaches, detach);
        assert!(held.waiting_detaches.is_empty());
        assert_eq!(held.lasting().detaches, detach);
    }

    #[test]
    fn a_reload_regraces_the_ladder_and_keeps_every_actions_progress() {
        let p = plan(&[(10, 1)], &[]);
        let mut c = Ladder::new(cycles(4));
        c.advance(&p, 0, &[]);
        c.advance(&p, 1, &[]);
        assert_eq!(
            acted_at(&c, &p, 2),
            (vec![], vec![], 1),
            "a third sighting of four"
        );
        // Three sightings now suffice: this third is due; none is lost.
        c.regrace(cycles(3));
        assert_eq!(acted_at(&c, &p, 2), (vec![10], vec![], 0));
        // Zero cycles asked: still one.
        c.regrace(cycles(0));
        assert_eq!(c.grace.cycles, 1);
    }

    #[test]
    fn acting_at_once_tells_each_action_and_a_ladder_tells_its_own() {
        let p = plan(&[(7, 1)], &[(2, "e")]);
        let at_once = Ladder::new(cycles(1)).acted_at_once(&p, 50);
        assert_eq!(at_once.len(), 2);
        assert!(at_once
            .iter()
            .all(|e| e.stage == Stage::Acted && e.since_ms == 50 && e.deadline_ms == Some(50)));
        assert!(matches!(&at_once[0].what, What::Terminate(t) if t.pid == Pid(7)));
        assert!(matches!(&at_once[1].what, What::Detach(d) if d.device == GpuIndex(2)));
        assert!(Ladder::new(cycles(2)).acted_at_once(&p, 50).is_empty());
        let graced = Grace {
            after: Duration::from_secs(1),
            ..Grace::default()
        };
        assert!(Ladder::new(graced).acted_at_once(&p, 50).is_empty());
    }

    #[test]
    fn one_cycle_is_genvs_behaviour() {
        let mut c = Ladder::new(Grace::default());
        let p = plan(&[(1, 10)], &[(0, "e")]);
        assert_eq!(acted(&c, &p), (vec![1], vec![0], 0));
        c.advance(&p, 0, &[]);
        assert_eq!(acted(&c, &p), (vec![1], vec![0], 0));
    }

    #[test]
    fn actions_wait_for_consecutive_sightings_of_the_same_thing() {
        let mut c = Ladder::new(cycles(2));
        let first = plan(&[(1, 10), (2, 20)], &[(0, "e")]);
        assert_eq!(acted(&c, &first), (vec![], vec![], 3));
        let (_, waiting) = c.split(&first, 0);
        assert!(matches!(
            waiting[0],
            Waiting::Terminate {
                seen: 1,
                needed: 2,
                ..
            }
        ));
        c.advance(&first, 0, &[]);
        // pid 1 again; pid 2 reused (other start time); the detach again.
        let second = plan(&[(1, 10), (2, 21)], &[(0, "e")]);
        assert_eq!(acted(&c, &second), (vec![1], vec![0], 1));
        c.advance(&second, 0, &[]);
        // A cycle without them starts nothing over: an absence its owner
        // could cause must not reset a wait.
        c.advance(&plan(&[], &[]), 0, &[]);
        // (pid 1 and the detach were carried out: seen again, they are
        // new; pid 2's count goes on.)
        assert_eq!(acted(&c, &second), (vec![2], vec![], 2));
        let mut three = Ladder::new(cycles(3));
        for expected in [0, 0, 2, 2] {
            assert_eq!(acted(&three, &first).0.len(), expected);
            three.advance(&first, 0, &[]);
        }
        // A cycle its host could not be read in (a garble anyone can
        // write) delays no confirmation: it counts, and the action is
        // carried out when next seen, with the others decided with it.
        let h = HostId("h".into());
        let mut garbled = Ladder::new(cycles(3));
        garbled.advance(&first, 0, &[]);
        assert_eq!(acted(&garbled, &first).0.len(), 0);
        garbled.advance(&plan(&[], &[]), 0, std::slice::from_ref(&h));
        assert_eq!(
            acted(&garbled, &first).0.len(),
            2,
            "seen, unread, seen: three"
        );
        // Never acted on while unread, however long.
        let mut unread = Ladder::new(cycles(3));
        unread.advance(&first, 0, &[]);
        for _ in 0..3 {
            unread.advance(&plan(&[], &[]), 0, std::slice::from_ref(&h));
        }
        assert!(unread.split(&plan(&[], &[]), 0).0.hosts.is_empty());
        // A wait already away (its violation gone for a cycle) gains no
        // sighting from cycles its host could not be read in.
        let mut away = Ladder::new(cycles(3));
        away.advance(&first, 0, &[]);
        away.advance(&plan(&[], &[]), 0, &[]);
        for _ in 0..2 {
            away.advance(&plan(&[], &[]), 0, std::slice::from_ref(&h));
        }
        assert_eq!(
            acted(&away, &first).0.len(),
            0,
            "seen once before, once now"
        );
    }

    fn stages(events: &[Event]) -> Vec<(Stage, String)> {
        events
            .iter()
            .map(|e| {
                let what = match &e.what {
                    What::Terminate(t) => format!("pid {}", t.pid.0),
                    What::Detach(d) => format!("{} on {}", d.eid.0, d.device.0),
                };
                (e.stage, what)
            })
            .collect()
    }

    #[test]
    fn a_grace_warns_once_then_acts_at_its_deadline() {
        let mut l = Ladder::new(Grace {
            after: Duration::from_secs(5),
            ..Grace::default()
        });
        let p = plan(&[(1, 10)], &[(0, "e")]);
        assert_eq!(acted_at(&l, &p, 1_000), (vec![], vec![], 2));
        let warned = l.advance(&p, 1_000, &[]);
        assert_eq!(
            stages(&warned),
            [
                (Stage::Warned, "pid 1".to_string()),
                (Stage::Warned, "e on 0".to_string())
            ]
        );
        assert!(warned.iter().all(|e| e.deadline_ms == Some(6_000)));
        // Still within the grace: nothing done, nothing said again.
        assert_eq!(acted_at(&l, &p, 5_999), (vec![], vec![], 2));
        assert!(l.advance(&p, 5_999, &[]).is_empty());
        // Due: acted on, said once; acted on again while it holds.
        assert_eq!(acted_at(&l, &p, 6_000), (vec![1], vec![0], 0));
        assert_eq!(stages(&l.advance(&p, 6_000, &[])).len(), 2);
        assert_eq!(acted_at(&l, &p, 7_000), (vec![1], vec![0], 0));
        assert!(l.advance(&p, 7_000, &[]).is_empty());
        // Acted on, then gone: no clearing.
        assert!(l.advance(&plan(&[], &[]), 8_000, &[]).is_empty());
    }

    #[test]
    fn a_violation_that_ends_within_its_grace_is_cleared_once() {
        let mut l = Ladder::new(Grace {
            after: Duration::from_secs(60),
            ..Grace::default()
        });
        let p = plan(&[(1, 10), (2, 20)], &[]);
        l.advance(&p, 0, &[]);
        let fixed = plan(&[(2, 20)], &[]);
        assert_eq!(
            stages(&l.advance(&fixed, 1_000, &[])),
            [(Stage::Cleared, "pid 1".to_string())]
        );
        assert!(l.advance(&fixed, 2_000, &[]).is_empty());
        // The same pid with another start time is another process: new.
        let reused = plan(&[(1, 11), (2, 20)], &[]);
        assert_eq!(
            stages(&l.advance(&reused, 3_000, &[])),
            [(Stage::Warned, "pid 1".to_string())]
        );
        assert_eq!(acted_at(&l, &reused, 60_000), (vec![2], vec![], 1));
    }

    /// bob's job `pid` (start time `start`) on GPU 0, breaking env-devices.
    fn bobs(pid: u32, start: u64) -> Plan {
        let mut p = plan(&[(pid, start)], &[]);
        let t = &mut p.hosts[0].1.terminate[0];
        t.uid = Some(1002);
        t.gpus = smallvec::smallvec![GpuIndex(0)];
        t.rules = Rule::EnvDevices.into();
        p
    }

    #[test]
    fn a_wait_survives_every_absence_its_owner_can_cause() {
        let graced = Grace {
            after: Duration::from_secs(60),
            gap: Some(Duration::from_secs(30)),
            ..Grace::default()
        };
        let h = HostId("h".into());
        let none = plan(&[], &[]);
        let deadline = |e: &[Event]| e.iter().map(|e| e.deadline_ms).collect::<Vec<_>>();
        // Away for a cycle (another id carried, the state garbled and
        // taken for healthy): cleared, then warned again, same deadline.
        let mut l = Ladder::new(graced.clone());
        assert_eq!(deadline(&l.advance(&bobs(1, 10), 0, &[])), [Some(60_000)]);
        let gone = l.advance(&none, 10_000, &[]);
        assert_eq!(stages(&gone), [(Stage::Cleared, "pid 1".to_string())]);
        let back = l.advance(&bobs(1, 10), 20_000, &[]);
        assert_eq!(stages(&back), [(Stage::Warned, "pid 1".to_string())]);
        assert_eq!(deadline(&back), [Some(60_000)]);
        // Restarted under a new pid: the new job takes the wait up.
        l.advance(&none, 30_000, &[]);
        let restarted = bobs(2, 30);
        assert_eq!(
            deadline(&l.advance(&restarted, 40_000, &[])),
            [Some(60_000)]
        );
        assert!(l.advance(&restarted, 50_000, &[]).is_empty());
        assert_eq!(acted_at(&l, &restarted, 60_000).0, [2]);
        // Another user's job, or one on other GPUs, takes up nothing.
        let mut alices = bobs(3, 40);
        alices.hosts[0].1.terminate[0].uid = Some(1001);
        let mut elsewhere = bobs(4, 40);
        elsewhere.hosts[0].1.terminate[0].gpus = smallvec::smallvec![GpuIndex(1)];
        let mut l2 = Ladder::new(graced.clone());
        l2.advance(&bobs(1, 10), 0, &[]);
        l2.advance(&none, 10_000, &[]);
        for other in [&alices, &elsewhere] {
            assert_eq!(acted_at(&l2, other, 60_000).0, Vec::<u32>::new());
        }
        // A degraded host (unanswered for genv's state): nothing moves,
        // nothing is said.
        let mut l3 = Ladder::new(graced.clone());
        l3.advance(&bobs(1, 10), 0, &[]);
        assert!(l3
            .advance(&none, 10_000, std::slice::from_ref(&h))
            .is_empty());
        assert!(l3
            .advance(&none, 40_000, std::slice::from_ref(&h))
            .is_empty());
        assert!(l3.advance(&bobs(1, 10), 50_000, &[]).is_empty());
        assert_eq!(acted_at(&l3, &bobs(1, 10), 60_000).0, [1]);
        // Away past its deadline and the run's gap: over; a job then is new.
        let mut l4 = Ladder::new(graced.clone());
        l4.advance(&bobs(1, 10), 0, &[]);
        l4.advance(&none, 10_000, &[]);
        l4.advance(&none, 60_000, &[]);
        assert_eq!(l4.export().len(), 1, "kept to its deadline and a gap past");
        l4.advance(&none, 90_001, &[]);
        assert!(l4.export().is_empty());
        let fresh = l4.advance(&bobs(5, 90), 95_000, &[]);
        assert_eq!(deadline(&fresh), [Some(155_000)]);
        // Restarted between two cycles: taken up at once, the new process
        // warned of by name, the old one not cleared.
        let mut l6 = Ladder::new(graced.clone());
        l6.advance(&bobs(1, 10), 0, &[]);
        let swapped = l6.advance(&bobs(7, 15), 10_000, &[]);
        assert_eq!(stages(&swapped), [(Stage::Warned, "pid 7".to_string())]);
        assert_eq!(deadline(&swapped), [Some(60_000)]);
        // A real end, by whoever: her job judged as it was, in the same
        // environment, no longer violating. Its wait ends; a new
        // violation is a new wait (bob's flapping of her attachment gives
        // her a fresh grace each time, never a primed one).
        let mut l7 = Ladder::new(graced.clone());
        l7.advance(&bobs(1, 10), 0, &[]);
        let judged: Judged = [((h.clone(), Pid(1), 10), None)].into_iter().collect();
        let over = l7.advance_seen(&none, 10_000, &[], &judged);
        assert_eq!(stages(&over), [(Stage::Cleared, "pid 1".to_string())]);
        assert!(l7.export().is_empty());
        assert_eq!(
            deadline(&l7.advance(&bobs(1, 10), 20_000, &[])),
            [Some(80_000)]
        );
        // Another id carried now: not an end, the wait is kept.
        let mut l8 = Ladder::new(graced.clone());
        l8.advance(&bobs(1, 10), 0, &[]);
        let other: Judged = [((h.clone(), Pid(1), 10), Some(EnvId("x".into())))]
            .into_iter()
            .collect();
        l8.advance_seen(&none, 10_000, &[], &other);
        assert_eq!(
            deadline(&l8.advance(&bobs(1, 10), 20_000, &[])),
            [Some(60_000)]
        );
        // A detach that goes away is over: only a job's wait is kept.
        let mut l9 = Ladder::new(graced.clone());
        l9.advance(&plan(&[], &[(0, "e")]), 0, &[]);
        l9.advance(&none, 10_000, &[]);
        assert!(l9.export().is_empty());
        // Kept across a restart of the enforcer, lineage and all.
        let mut l5 = Ladder::new(graced.clone());
        l5.advance(&bobs(1, 10), 0, &[]);
        l5.advance(&none, 10_000, &[]);
        let mut again = Ladder::restore(graced, l5.export());
        let taken_up = again.advance(&bobs(6, 20), 15_000, &[]);
        assert_eq!(deadline(&taken_up), [Some(60_000)]);
    }

    #[test]
    fn a_detach_is_for_its_rules_and_one_kept_without_any_for_the_per_user_cap() {
        let detach = |rules| {
            What::Detach(Detach {
                rules,
                ..Detach::of(GpuIndex(0), EnvId("e".into()))
            })
        };
        assert_eq!(
            detach(Default::default()).rules(),
            [Rule::MaxDevicesPerUser]
        );
        assert_eq!(
            detach(Rule::MaxDevicesPerGroup.into()).rules(),
            [Rule::MaxDevicesPerGroup]
        );
    }

    #[test]
    fn rules_have_their_own_grace_and_may_only_warn() {
        let grace = Grace {
            after: Duration::from_secs(60),
            rules: [
                (Rule::EnvMemory, acts_after(Duration::ZERO)),
                (Rule::NonEnvProcesses, warns()),
            ]
            .into_iter()
            .collect(),
            ..Grace::default()
        };
        let l = Ladder::new(grace.clone());
        let of = |rules: &[Rule]| grace.of(rules.iter().copied());
        assert_eq!(of(&[Rule::EnvDevices]), Some(Duration::from_secs(60)));
        assert_eq!(
            of(&[Rule::EnvMemory, Rule::EnvDevices]),
            Some(Duration::ZERO)
        );
        assert_eq!(of(&[Rule::NonEnvProcesses]), None);
        assert_eq!(
            of(&[Rule::NonEnvProcesses, Rule::EnvDevices]),
            Some(Duration::from_secs(60))
        );
        // A warn-only action waits for ever; one at once acts at once.
        let mut p = plan(&[(1, 10), (2, 20)], &[]);
        p.hosts[0].1.terminate[0].rules = [Rule::NonEnvProcesses].into_iter().collect();
        p.hosts[0].1.terminate[1].rules = [Rule::EnvMemory].into_iter().collect();
        let (due, waiting) = l.split(&p, 1_000_000);
        assert_eq!(due.hosts[0].1.terminate[0].pid, Pid(2));
        assert!(matches!(
            waiting[..],
            [Waiting::Terminate {
                warn_only: true,
                deadline_ms: None,
                ..
            }]
        ));
    }

    #[test]
    fn exempt_actions_wait_and_their_grace_starts_when_the_exemption_ends() {
        let mut p = plan(&[(1, 10), (2, 20)], &[(0, "e")]);
        p.hosts[0].1.terminate[0].user = Some("alice".into());
        p.hosts[0].1.terminate[1].user = Some("bob".into());
        p.hosts[0].1.detach[0].charged = Some("alice".into());
        p.hosts[0].1.detach[0].owner = Some("alice".into());
        let mut l = Ladder::new(Grace {
            after: Duration::from_secs(10),
            exempt: vec![Exemption {
                user: Some("alice".into()),
                group: None,
                host: Some(HostId("h".into())),
                from_ms: Some(1_000),
                until_ms: Some(50_000),
                reason: "maintenance".into(),
            }],
            ..Grace::default()
        });
        // Before the window: alice's actions warned like bob's.
        assert_eq!(stages(&l.advance(&p, 0, &[])).len(), 3);
        // Within it: hers wait, exempt, whatever their deadline; bob's acts.
        let (due, waiting) = l.split(&p, 20_000);
        assert_eq!(due.hosts[0].1.terminate.len(), 1);
        assert_eq!(due.hosts[0].1.terminate[0].pid, Pid(2));
        assert!(due.hosts[0].1.detach.is_empty());
        assert_eq!(waiting.len(), 2);
        assert!(waiting.iter().all(|w| matches!(w,
            Waiting::Terminate { exempt: Some(r), .. } | Waiting::Detach { exempt: Some(r), .. }
                if r == "maintenance")));
        let told = l.advance(&p, 20_000, &[]);
        assert_eq!(stages(&told), [(Stage::Acted, "pid 2".to_string())]);
        // The window ends at 50 s: hers are warned again, due 10 s later.
        let after = l.advance(&p, 50_000, &[]);
        assert_eq!(
            stages(&after),
            [
                (Stage::Warned, "pid 1".to_string()),
                (Stage::Warned, "e on 0".to_string())
            ]
        );
        assert!(after.iter().all(|e| e.deadline_ms == Some(60_000)));
        assert_eq!(acted_at(&l, &p, 59_999).0, vec![2]);
        assert_eq!(acted_at(&l, &p, 60_000), (vec![1, 2], vec![0], 0));
        // Another host, or a user it does not name: not covered.
        let e = &l.grace.exempt[0];
        assert!(!e.covers(&HostId("g".into()), Some("alice"), &[], 2_000));
        assert!(!e.covers(&HostId("h".into()), None, &[], 2_000));
        assert!(e.covers(&HostId("h".into()), Some("alice"), &[], 1_000));
        assert!(!e.covers(&HostId("h".into()), Some("alice"), &[], 50_000));
    }

    #[test]
    fn a_group_exemption_covers_the_members_the_host_names() {
        let mut p = plan(&[(1, 10), (2, 20), (3, 30)], &[(0, "e"), (1, "f")]);
        let lab = vec!["users".to_string(), "lab".to_string()];
        let t = &mut p.hosts[0].1.terminate;
        (t[0].user, t[0].groups) = (Some("alice".into()), lab.clone());
        (t[1].user, t[1].groups) = (Some("bob".into()), vec!["users".into()]);
        // A user the host said no groups of (not asked, or unknown there).
        t[2].user = Some("carol".into());
        let d = &mut p.hosts[0].1.detach;
        // Her job carries e: she owns it. f's record names her, no job of
        // hers carries it: anyone could have written it, so not covered
        // even with her groups on it.
        (d[0].charged, d[0].owner, d[0].groups) =
            (Some("alice".into()), Some("alice".into()), lab.clone());
        (d[1].charged, d[1].groups) = (Some("alice".into()), lab);
        let l = Ladder::new(Grace {
            exempt: vec![Exemption {
                group: Some("lab".into()),
                reason: "the lab's own machine".into(),
                ..Exemption::default()
            }],
            ..Grace::default()
        });
        let (due, waiting) = l.split(&p, 0);
        let due = &due.hosts[0].1;
        assert_eq!(
            due.terminate.iter().map(|t| t.pid.0).collect::<Vec<_>>(),
            [2, 3]
        );
        assert_eq!(due.detach.len(), 1);
        assert_eq!(&*due.detach[0].eid.0, "f");
        assert_eq!(waiting.len(), 2);
        assert!(waiting.iter().all(|w| matches!(w,
            Waiting::Terminate { exempt: Some(r), .. } | Waiting::Detach { exempt: Some(r), .. }
                if r == "the lab's own machine")));
        let both = Exemption {
            user: Some("alice".into()),
            group: Some("lab".into()),
            ..Exemption::default()
        };
        let h = HostId("h".into());
        assert!(both.covers(&h, Some("alice"), &["lab".into()], 0));
        assert!(!both.covers(&h, Some("alice"), &["users".into()], 0));
        assert!(!both.covers(&h, Some("bob"), &["lab".into()], 0));
    }

    #[test]
    fn a_deadline_follows_the_rules_an_action_is_asked_for_by_now() {
        let grace = Grace {
            after: Duration::from_secs(10),
            rules: [(
                Rule::EnvMemory,
                RuleGrace {
                    warn_only: true,
                    after: None,
                },
            )]
            .into_iter()
            .collect(),
            ..Grace::default()
        };
        let mut l = Ladder::new(grace);
        let with = |rules: &[Rule]| {
            let mut p = plan(&[(1, 10)], &[]);
            p.hosts[0].1.terminate[0].rules = rules.iter().copied().collect();
            p
        };
        // Warn-only first: no deadline.
        let memory = with(&[Rule::EnvMemory]);
        assert_eq!(l.advance(&memory, 0, &[])[0].deadline_ms, None);
        l.advance(&memory, 20_000, &[]);
        // Then also env-devices: its wait begins then, warned of anew, and
        // it is due 10 s later (not at once for having been warned of).
        let both = with(&[Rule::EnvMemory, Rule::EnvDevices]);
        assert_eq!(acted_at(&l, &both, 30_000).0, Vec::<u32>::new());
        let warned = l.advance(&both, 30_000, &[]);
        assert_eq!(warned.len(), 1);
        assert_eq!(warned[0].stage, Stage::Warned);
        assert_eq!(warned[0].deadline_ms, Some(40_000));
        assert_eq!(acted_at(&l, &both, 39_999).0, Vec::<u32>::new());
        assert_eq!(acted_at(&l, &both, 40_000).0, vec![1]);
        // Back to warn-only: never acted on, whatever time it is.
        assert_eq!(acted_at(&l, &memory, 1_000_000).0, Vec::<u32>::new());
        l.advance(&memory, 35_000, &[]);
        // A rule that acts again: its wait goes on, never begins anew.
        assert_eq!(acted_at(&l, &both, 40_000).0, vec![1]);
    }

    #[test]
    fn a_host_that_did_not_answer_keeps_its_actions_as_they_were() {
        let mut l = Ladder::new(Grace {
            after: Duration::from_secs(10),
            gap: Some(Duration::from_secs(60)),
            ..Grace::default()
        });
        let p = plan(&[(1, 10)], &[]);
        let h = HostId("h".into());
        assert_eq!(l.advance(&p, 0, &[]).len(), 1);
        // h fails (or a user makes its state unreadable): nothing cleared.
        assert!(l
            .advance(&plan(&[], &[]), 5_000, std::slice::from_ref(&h))
            .is_empty());
        // Back: no second warning, the same deadline.
        assert!(l.advance(&p, 9_000, &[]).is_empty());
        assert_eq!(acted_at(&l, &p, 10_000).0, vec![1]);
    }

    /// A group cap joining another rule that acts never brings its wait
    /// forward (a per-user cap's shorter grace still wins); alone, or
    /// beside rules that only warn, its grace is the action's.
    #[test]
    fn a_group_cap_joining_a_rules_wait_never_hastens_it() {
        let g = Grace {
            rules: orphans_wait_non_env_warns(),
            after: Duration::from_secs(10),
            ..Grace::default()
        };
        let min2 = Some(Duration::from_secs(120));
        let ten = Some(Duration::from_secs(10));
        use Rule::*;
        assert_eq!(g.of([OrphanedEnvProcesses, MaxDevicesPerUser]), ten);
        assert_eq!(g.of([MaxDevicesPerGroup, OrphanedEnvProcesses]), min2);
        assert_eq!(g.of([MaxDevicesPerGroup]), ten);
        assert_eq!(g.of([NonEnvProcesses, MaxDevicesPerGroup]), ten);
        assert_eq!(g.of([NonEnvProcesses]), None);
        assert_eq!(
            g.of([EnvDevices, OrphanedEnvProcesses]),
            ten,
            "the shortest"
        );
        assert_eq!(g.of(Vec::<Rule>::new()), ten);
    }

    /// A host's plan terminating each pid (started at 1) for its rules.
    fn asked(h: &HostId, pids: &[(u32, Rules)]) -> (HostId, HostPlan) {
        let mut p = plan(&pids.iter().map(|&(p, _)| (p, 1)).collect::<Vec<_>>(), &[]);
        p.hosts[0].0 = h.clone();
        for (t, (_, r)) in p.hosts[0].1.terminate.iter_mut().zip(pids) {
            t.rules = *r;
        }
        p.hosts.remove(0)
    }

    /// The pids `plan` terminates at `now` (ms).
    fn due_at(l: &Ladder, plan: &Plan, now: u64) -> Vec<u32> {
        let (done, _) = l.split(plan, now);
        (done.hosts.iter())
            .flat_map(|(_, h)| h.terminate.iter().map(|t| t.pid.0))
            .collect()
    }

    /// Seeds 5 and 19 of the when-and-which property (stop 53): a garble
    /// moves a user's cap onto a job of theirs whose own wait runs. While
    /// the caps' picks are held, the cap joining that wait never brings
    /// it forward; a cap joining rules that only warn is not held (a group
    /// cap never hastens an acting rule's wait anyway).
    #[test]
    fn a_users_cap_joining_a_wait_while_the_caps_are_held_never_hastens_it() {
        let grace = Grace {
            rules: orphans_wait_non_env_warns(),
            ..cycles(2)
        };
        let (h1, h2) = (HostId("h1".into()), HostId("h2".into()));
        let cap: Rules = Rule::MaxDevicesPerUser.into();
        let joined = cap | Rule::OrphanedEnvProcesses;
        let group = Rule::MaxDevicesPerGroup | Rule::NonEnvProcesses;
        let warned = cap | Rule::NonEnvProcesses;
        let whole = Plan {
            hosts: vec![
                asked(&h1, &[(1, cap)]),
                asked(&h2, &[(6, joined), (7, group), (8, warned)]),
            ],
        };
        let h2_only = Plan {
            hosts: vec![whole.hosts[1].clone()],
        };
        let run = |held: bool| {
            let mut l = Ladder::new(grace.clone());
            l.advance(&whole, 0, &[]);
            let unseen = if held { vec![h1.clone()] } else { vec![] };
            let mut due = Vec::new();
            for now in [60_000, 120_000] {
                l.hold_caps(&unseen, false);
                due.push(due_at(&l, &h2_only, now));
                l.advance(&h2_only, now, &unseen);
            }
            due
        };
        // Held: the orphan waits out its own grace; what other rules only
        // warn of is the cap's alone, carried out (held, the cap worked
        // out again could move: seed 37).
        assert_eq!(run(true), [vec![7, 8], vec![6, 7, 8]]);
        // Not held: the user's own cap (no grace) brings it forward.
        assert_eq!(run(false), [vec![6, 7, 8], vec![6, 7, 8]]);
    }

    /// What a hold kept back, and what came due on a host unseen, is
    /// released in the cycle after: due then, due now, not carried out. A
    /// pick that comes due only now, one of another rule, one carried out
    /// and an exempt one are not; nothing is while the hold goes on.
    #[test]
    fn the_cycle_after_a_hold_releases_what_was_due_in_it() {
        let grace = Grace {
            exempt: vec![Exemption {
                user: Some("carol".into()),
                reason: "a deadline".into(),
                ..Default::default()
            }],
            after: Duration::from_millis(10),
            ..cycles(1)
        };
        let mut l = Ladder::new(grace);
        let (h1, h2) = (HostId("h1".into()), HostId("h2".into()));
        let cap: Rules = Rule::MaxDevicesPerUser.into();
        // 1 (h1) and 2 (h2): the cap's, due in the second cycle; 3:
        // env-devices'; 4: the cap's, asked for only from the third.
        let whole = |with_4: bool| {
            let mut on_h2 = vec![(2, cap), (3, Rule::EnvDevices.into())];
            if with_4 {
                on_h2.push((4, cap));
            }
            Plan {
                hosts: vec![asked(&h1, &[(1, cap)]), asked(&h2, &on_h2)],
            }
        };
        let released = |l: &Ladder, p: &Plan, unseen: &[HostId], now| {
            let r = l.released(p, unseen, now);
            let mut pids: Vec<u32> = r.terminations.iter().map(|(_, p)| p.0).collect();
            pids.sort_unstable();
            pids
        };
        l.hold_caps(&[], false);
        assert!(
            released(&l, &whole(false), &[], 0).is_empty(),
            "nothing before"
        );
        // h1 unseen: 2 is held back, 1 waits unseen.
        let h2_only = Plan {
            hosts: vec![whole(false).hosts[1].clone()],
        };
        l.advance(&whole(false), 0, &[]);
        l.hold_caps(std::slice::from_ref(&h1), false);
        assert_eq!(due_at(&l, &h2_only, 10), vec![3]);
        l.advance(&h2_only, 10, std::slice::from_ref(&h1));
        assert!(l.after_hold());
        // Within the cycle that held it, nothing is released yet.
        assert!(released(&l, &whole(false), &[], 10).is_empty());
        // Still unseen: the hold goes on.
        assert!(released(&l, &whole(true), std::slice::from_ref(&h1), 20).is_empty());
        // Seen: 1 and 2 released, not 3 (not a cap's), not 4 (new).
        assert_eq!(released(&l, &whole(true), &[], 20), vec![1, 2]);
        // Carried out (a third host unseen, so the cycle after is looked
        // at): released no more, though the jobs run on.
        let h3 = HostId("h3".into());
        l.hold_caps(std::slice::from_ref(&h3), false);
        l.advance(&whole(true), 20, std::slice::from_ref(&h3));
        assert!(l.after_hold());
        assert!(released(&l, &whole(true), &[], 30).is_empty());
        l.advance(&whole(true), 30, &[]);
        assert!(!l.after_hold());
        // Exempt: never released.
        let mut l = Ladder::new(l.grace.clone());
        let mut carols = asked(&h1, &[(5, cap)]);
        carols.1.terminate[0].user = Some("carol".into());
        let carols = Plan {
            hosts: vec![carols],
        };
        l.advance(&carols, 0, &[]);
        l.advance(&Plan::default(), 10, std::slice::from_ref(&h1));
        assert!(l.after_hold());
        assert!(released(&l, &carols, &[], 20).is_empty());
        // Due only now, its confirmations counted out this cycle: not
        // released (it was not due in the last).
        let mut l = Ladder::new(cycles(2));
        let one = Plan {
            hosts: vec![asked(&h2, &[(6, cap)])],
        };
        l.advance(&one, 0, std::slice::from_ref(&h3));
        assert_eq!(due_at(&l, &one, 10), vec![6]);
        assert!(released(&l, &one, &[], 10).is_empty());
    }

    #[test]
    fn a_caps_picks_wait_for_the_one_an_unseen_host_hides() {
        let mut l = Ladder::new(cycles(2));
        let (h1, h2) = (HostId("h1".into()), HostId("h2".into()));
        // On h1 and h2, a pick of the per-user cap each; on h2, also one of
        // env-devices, and one both ask for.
        let on = asked;
        let cap: Rules = Rule::MaxDevicesPerUser.into();
        let both = cap | Rule::EnvDevices;
        let whole = Plan {
            hosts: vec![
                on(&h1, &[(1, cap)]),
                on(&h2, &[(2, cap), (3, Rule::EnvDevices.into()), (4, both)]),
            ],
        };
        let h2_only = Plan {
            hosts: vec![whole.hosts[1].clone()],
        };
        let due = |l: &Ladder, p: &Plan| due_at(l, p, 0);
        l.hold_caps(&[], false);
        l.advance(&whole, 0, &[]);
        // h1 unseen: what only the caps ask for waits on h2 too.
        l.hold_caps(std::slice::from_ref(&h1), false);
        assert_eq!(due(&l, &h2_only), vec![3, 4]);
        let acted: Vec<u32> = (l.advance(&h2_only, 0, std::slice::from_ref(&h1)).iter())
            .filter_map(|e| match &e.what {
                What::Terminate(t) if e.stage == Stage::Acted => Some(t.pid.0),
                _ => None,
            })
            .collect();
        assert_eq!(acted, vec![3, 4]);
        // h1 seen again: every pick due together.
        l.hold_caps(&[], false);
        assert_eq!(due(&l, &whole), vec![1, 2, 3, 4]);
        // Unseen longer, the caps go on without it.
        let mut l = Ladder::new(cycles(2));
        l.advance(&whole, 0, &[]);
        for held in [true, true, false] {
            l.hold_caps(std::slice::from_ref(&h1), false);
            assert_eq!(due(&l, &h2_only).contains(&2), !held);
            l.advance(&h2_only, 0, std::slice::from_ref(&h1));
        }
        // A host unseen holds nothing where no cap's pick waits on it.
        let mut l = Ladder::new(cycles(2));
        l.advance(&h2_only, 0, &[]);
        l.hold_caps(std::slice::from_ref(&h1), false);
        assert_eq!(due(&l, &h2_only), vec![2, 3, 4]);
        // Garbles taking turns on h1 and h2 hold h3's pick 2 cycles, no
        // more (each host back seen anew).
        let h3 = HostId("h3".into());
        let all = Plan {
            hosts: vec![
                whole.hosts[0].clone(),
                on(&h2, &[(2, cap)]),
                on(&h3, &[(5, cap)]),
            ],
        };
        let mut l = Ladder::new(cycles(2));
        l.advance(&all, 0, &[]);
        let mut acted_at = None;
        for cycle in 1..6 {
            let unseen = if cycle % 2 == 1 { &h1 } else { &h2 };
            let seen = Plan {
                hosts: (all.hosts.iter())
                    .filter(|(h, _)| h != unseen)
                    .cloned()
                    .collect(),
            };
            l.hold_caps(std::slice::from_ref(unseen), false);
            let acted = l.advance(&seen, 0, std::slice::from_ref(unseen));
            if acted
                .iter()
                .any(|e| matches!(&e.what, What::Terminate(t) if t.pid.0 == 5))
            {
                acted_at.get_or_insert(cycle);
            }
        }
        assert_eq!(acted_at, Some(3));
        // An exempt pick holds nothing.
        let mut l = Ladder::new(Grace {
            exempt: vec![Exemption {
                host: Some(h1.clone()),
                ..Exemption::default()
            }],
            ..cycles(2)
        });
        l.advance(&whole, 0, &[]);
        l.hold_caps(std::slice::from_ref(&h1), false);
        assert_eq!(due(&l, &h2_only), vec![2, 3, 4]);
        // Another shard held its picks: ours are held too, and none of
        // ours waits on an unseen host of ours (nothing to pass on).
        let mut l = Ladder::new(cycles(2));
        l.advance(&h2_only, 0, &[]);
        assert!(!l.hold_caps(&[], true));
        assert_eq!(due(&l, &h2_only), vec![3, 4]);
        l.advance(&h2_only, 0, &[]);
        assert!(!l.hold_caps(&[], false));
        assert_eq!(due(&l, &h2_only), vec![2, 3, 4]);
        // Ours waits on an unseen host of ours: said, for the others.
        let mut l = Ladder::new(cycles(2));
        l.advance(&whole, 0, &[]);
        assert!(l.hold_caps(std::slice::from_ref(&h1), false));
    }

    #[test]
    fn sightings_far_apart_start_over_and_nothing_is_kept_when_nothing_waits() {
        let grace = Grace {
            after: Duration::from_secs(10),
            gap: Some(Duration::from_secs(60)),
            ..Grace::default()
        };
        let mut l = Ladder::new(grace.clone());
        let p = plan(&[(1, 10)], &[]);
        l.advance(&p, 0, &[]);
        // Restored after a long stop: warned again, its grace anew.
        let mut l = Ladder::restore(grace, l.export());
        let again = l.advance(&p, 3_600_000, &[]);
        assert_eq!(stages(&again), [(Stage::Warned, "pid 1".to_string())]);
        assert_eq!(again[0].deadline_ms, Some(3_610_000));
        let mut now = Ladder::restore(Grace::default(), l.export());
        now.advance(&p, 3_700_000, &[]);
        assert!(now.export().is_empty());
    }

    #[test]
    fn an_exemption_goes_by_the_kernels_owner_not_the_record() {
        let mut p = plan(&[], &[(0, "e"), (1, "f"), (2, "g")]);
        let d = &mut p.hosts[0].1.detach;
        // mallory wrote alice's name into her record; her job carries it.
        d[0].username = Some("alice".into());
        (d[0].charged, d[0].owner) = (Some("mallory".into()), Some("mallory".into()));
        // bob forged f in alice's name; no job carries it: charged to her
        // by the record, owned by no one the kernel names.
        d[1].username = Some("alice".into());
        d[1].charged = Some("alice".into());
        // g is hers: her job carries it.
        (d[2].charged, d[2].owner) = (Some("alice".into()), Some("alice".into()));
        let l = Ladder::new(Grace {
            exempt: vec![Exemption {
                user: Some("alice".into()),
                reason: "alice's deadline".into(),
                ..Exemption::default()
            }],
            ..Grace::default()
        });
        assert_eq!(acted_at(&l, &p, 0), (vec![], vec![0, 1], 1));
    }

    /// The waits kept for jobs that no rule judges this cycle (their host's
    /// genv state unusable): those of a rule that acts after a grace, on
    /// the job started when it was, while the host is not yet blind.
    #[test]
    fn the_waits_kept_for_unjudged_jobs_are_an_acting_rules_not_yet_due() {
        let h = HostId("h".into());
        let cap: Rules = Rule::MaxDevicesPerUser.into();
        let orphan: Rules = Rule::OrphanedEnvProcesses.into();
        let whole = Plan {
            hosts: vec![asked(
                &h,
                &[
                    (1, orphan),
                    (2, Rule::NonEnvProcesses.into()),
                    (3, cap),
                    (4, orphan | Rule::MaxDevicesPerGroup),
                    // The user's own cap, without a grace, acts at once.
                    (6, orphan | cap),
                ],
            )],
        };
        let grace = Grace {
            rules: orphans_wait_non_env_warns(),
            ..cycles(1)
        };
        let mut l = Ladder::new(grace.clone());
        l.advance(&whole, 0, &[]);
        let on = |host: &HostId, pids: &[u32], start: u64| -> HashSet<(HostId, Pid, u64)> {
            pids.iter()
                .map(|p| (host.clone(), Pid(*p), start))
                .collect()
        };
        let pids = |w: HashSet<(HostId, Pid)>| {
            let mut p: Vec<u32> = w.into_iter().map(|(_, p)| p.0).collect();
            p.sort_unstable();
            p
        };
        assert_eq!(
            pids(l.unseen_waits(&on(&h, &[1, 2, 3, 4, 5, 6], 1), 0)),
            [1, 4]
        );
        assert!(
            l.unseen_waits(&on(&h, &[1, 4], 2), 0).is_empty(),
            "restarted"
        );
        let other = HostId("other".into());
        assert!(l.unseen_waits(&on(&other, &[1, 4], 1), 0).is_empty());
        assert!(l.unseen_waits(&HashSet::new(), 0).is_empty());
        // Unseen one cycle more: still kept; then blind.
        let mut away = l.clone();
        away.advance(&Plan::default(), 1_000, std::slice::from_ref(&h));
        assert_eq!(pids(away.unseen_waits(&on(&h, &[1, 4], 1), 1_000)), [1, 4]);
        away.advance(&Plan::default(), 2_000, std::slice::from_ref(&h));
        assert!(away.unseen_waits(&on(&h, &[1, 4], 1), 2_000).is_empty());
        // Of those, due once confirmed and past the deadline.
        let all = on(&h, &[1, 2, 3, 4, 5, 6], 1);
        assert!(l.unseen_due(&all, 119_999).is_empty(), "not yet");
        assert_eq!(pids(l.unseen_due(&all, 120_000)), [1, 4]);
        let mut unconfirmed = Ladder::new(Grace {
            rules: orphans_wait_non_env_warns(),
            ..cycles(3)
        });
        unconfirmed.advance(&whole, 0, &[]);
        // (6 waits here too: its cap is confirmed like any rule.)
        assert_eq!(pids(unconfirmed.unseen_waits(&all, 120_000)), [1, 4, 6]);
        assert!(
            unconfirmed.unseen_due(&all, 120_000).is_empty(),
            "seen once of 3"
        );
        unconfirmed.advance(&whole, 60_000, &[]);
        assert_eq!(pids(unconfirmed.unseen_due(&all, 120_000)), [1, 4, 6]);
        // Carried out: nothing waits.
        l.advance(&whole, 120_000, &[]);
        assert!(l.unseen_waits(&on(&h, &[1, 4], 1), 120_000).is_empty());
        // Exempt: nothing waits.
        let mut l = Ladder::new(Grace {
            exempt: vec![Exemption {
                host: Some(h.clone()),
                ..Exemption::default()
            }],
            ..grace
        });
        l.advance(&whole, 0, &[]);
        assert!(l.unseen_waits(&on(&h, &[1, 4], 1), 0).is_empty());
        // Nothing ever waits: nothing is kept.
        let mut l = Ladder::new(cycles(1));
        l.advance(&whole, 0, &[]);
        assert!(l.unseen_waits(&on(&h, &[1, 4], 1), 0).is_empty());
    }

    /// A pick of the caps that is due is carried out a cycle late where
    /// it waits on an unseen host, or the caps' hold keeps one back.
    #[test]
    fn a_due_pick_is_held_back_where_its_host_is_unseen_or_the_caps_are_held() {
        let (h1, h2) = (HostId("h1".into()), HostId("h2".into()));
        let cap: Rules = Rule::MaxDevicesPerUser.into();
        let whole = Plan {
            hosts: vec![
                asked(&h1, &[(1, cap)]),
                asked(&h2, &[(2, cap), (3, Rule::EnvDevices.into())]),
            ],
        };
        let h2_only = Plan {
            hosts: vec![whole.hosts[1].clone()],
        };
        let env_only = Plan {
            hosts: vec![asked(&h2, &[(3, Rule::EnvDevices.into())])],
        };
        let unseen = std::slice::from_ref(&h1);
        let mut l = Ladder::new(cycles(2));
        l.advance(&whole, 0, &[]);
        // Seen once of the two cycles: not due yet, held back nowhere.
        l.hold_caps(&[], false);
        assert!(!l.holds_back(&whole, &[], 0));
        // Due now (the second sighting): h1 unseen holds back its pick.
        assert!(l.holds_back(&h2_only, unseen, 0));
        l.hold_caps(unseen, false);
        assert!(l.holds_back(&h2_only, &[], 0), "held: h2's pick waits");
        assert!(!l.holds_back(&env_only, &[], 0), "no cap's pick");
        l.hold_caps(&[], false);
        assert!(!l.holds_back(&whole, &[], 0));
        // A pick not yet due is held back by nothing.
        let mut l = Ladder::new(cycles(3));
        l.advance(&whole, 0, &[]);
        l.hold_caps(unseen, false);
        assert!(!l.holds_back(&h2_only, unseen, 0));
    }

    /// A restart takes up its wait whether or not a device cap joins the
    /// rule that asks, before or after (seed 131); where only caps ask,
    /// only the same caps' wait.
    #[test]
    fn a_restart_takes_up_its_wait_whichever_caps_join() {
        let graced = Grace {
            after: Duration::from_secs(60),
            ..Grace::default()
        };
        let with = |pid: u32, start: u64, rules: Rules| {
            let mut p = bobs(pid, start);
            p.hosts[0].1.terminate[0].rules = rules;
            p
        };
        let env: Rules = Rule::EnvDevices.into();
        let group = env | Rule::MaxDevicesPerGroup;
        let user_too = env | Rule::MaxDevicesPerUser;
        for (before, after) in [(group, env), (env, group), (user_too, group)] {
            let mut l = Ladder::new(graced.clone());
            l.advance(&with(1, 10, before), 0, &[]);
            let due = acted_at(&l, &with(2, 20, after), 60_000).0;
            assert_eq!(due, [2], "{before:?} then {after:?}");
        }
        let user: Rules = Rule::MaxDevicesPerUser.into();
        let mut l = Ladder::new(graced);
        l.advance(&with(1, 10, user), 0, &[]);
        assert_eq!(acted_at(&l, &with(2, 20, user), 60_000).0, [2]);
        let group_only: Rules = Rule::MaxDevicesPerGroup.into();
        for other in [group_only, env] {
            let due = acted_at(&l, &with(2, 20, other), 60_000).0;
            assert_eq!(due, Vec::<u32>::new(), "{other:?}: a new wait");
        }
    }
}
