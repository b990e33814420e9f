//! Rate limits on messages, so that a user whose jobs keep breaking a rule
//! is not flooded (nor the mail server), and so that nobody can spend
//! another user's allowance. Pure: time comes in.
//!
//! - Each recipient has two allowances of `--notify-rate` messages over a
//!   sliding hour: one for actions on their work (their processes, and
//!   detaches of devices their processes use) and one for detaches of
//!   attachments no process of theirs uses. Anyone can write such an
//!   attachment in their name (genv's state is world-writable), so another
//!   user's edits can spend only the second.
//! - Each target (a process; an environment on a host) gets at most
//!   [`PER_TARGET`] messages an hour of each class, whoever it goes to:
//!   flapping one environment's idle attachments costs a few messages, not
//!   the allowance, nor the messages about devices its jobs use.
//! - A warning with a deadline about the recipient's work (a job that will
//!   be terminated, a device in use that will be detached) is never held
//!   back by an allowance: it is counted, and sent. Repeated about one
//!   target within the hour (its violation flapping, as another user can
//!   make it), it is folded into the first: held back unless its deadline
//!   is earlier than the one told.
//! - A message held back is counted each time; the first of a run of them
//!   says so ([`Verdict::Hold`] with `first`), for the audit log, so that
//!   a flood is said once.

use std::collections::{HashMap, VecDeque};

use crate::ladder::{Event, Stage, What};
use crate::model::{EnvId, GpuIndex, HostId, Pid};

const HOUR_MS: u64 = 3_600_000;

/// Messages about one target in any hour, at most.
pub const PER_TARGET: usize = 3;

/// What a message is about, as its recipient's allowance counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// Their processes, or a device one of them uses.
    Work,
    /// An attachment none of their processes uses (anyone can make one).
    Idle,
}

impl Class {
    /// The class of `e`'s action.
    pub fn of(e: &Event) -> Class {
        match &e.what {
            What::Terminate(_) => Class::Work,
            What::Detach(d) if d.working => Class::Work,
            What::Detach(_) => Class::Idle,
        }
    }

    fn words(self) -> &'static str {
        match self {
            Class::Work => "their jobs",
            Class::Idle => "attachments none of their jobs uses",
        }
    }
}

/// The thing a message is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Target {
    Process(HostId, Pid, Option<u64>),
    Env(HostId, EnvId),
}

impl Target {
    fn of(e: &Event) -> Target {
        match &e.what {
            What::Terminate(t) => Target::Process(e.host.clone(), t.pid, t.start_time),
            What::Detach(d) => Target::Env(e.host.clone(), d.eid.clone()),
        }
    }
}

/// What a limit says of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Send,
    /// Held back; `first` of a run of held-back messages (to say once),
    /// and why.
    Hold {
        first: bool,
        why: String,
    },
}

/// Messages sent over the last hour, by recipient and class, and by target.
#[derive(Debug, Clone)]
pub struct RateLimit {
    per_hour: u32,
    sent: HashMap<(String, Class), VecDeque<u64>>,
    targets: HashMap<(Target, Class), VecDeque<u64>>,
    /// The allowances (by recipient and class) and targets holding back
    /// now, since when: the first held-back message of each is said, not
    /// the rest (forgotten after an hour).
    holding: HashMap<String, u64>,
    /// The deadline last told of each target's warning never held back
    /// (a detach's on each device), and when (forgotten after an hour, or
    /// once its clearing is told).
    told: HashMap<(Target, Option<GpuIndex>), (u64, u64)>,
}

/// Drops the times an hour old or more; whether any is left.
fn recent(times: &mut VecDeque<u64>, now_ms: u64) -> bool {
    while times
        .front()
        .is_some_and(|t| now_ms.saturating_sub(*t) >= HOUR_MS)
    {
        times.pop_front();
    }
    !times.is_empty()
}

impl RateLimit {
    /// At most `per_hour` messages per recipient and class in any hour
    /// (0: none but the warnings never held back).
    pub fn new(per_hour: u32) -> Self {
        RateLimit {
            per_hour,
            sent: HashMap::new(),
            targets: HashMap::new(),
            holding: HashMap::new(),
            told: HashMap::new(),
        }
    }

    /// Whether `e`, for `recipient` (the empty name: owners unknown, who
    /// share one allowance), may go at `now_ms`; if so it is counted.
    /// Recipients and targets quiet for an hour are forgotten, so the
    /// tables hold only the last hour's.
    pub fn allow(&mut self, recipient: &str, e: &Event, now_ms: u64) -> Verdict {
        self.sent.retain(|_, times| recent(times, now_ms));
        self.targets.retain(|_, times| recent(times, now_ms));
        self.holding
            .retain(|_, since| now_ms.saturating_sub(*since) < HOUR_MS);
        self.told
            .retain(|_, (_, at)| now_ms.saturating_sub(*at) < HOUR_MS);
        let class = Class::of(e);
        let target = (Target::of(e), class);
        let never_held =
            class == Class::Work && e.stage == Stage::Warned && e.deadline_ms.is_some();
        let bucket = (recipient.to_string(), class);
        let by_recipient = self.sent.get(&bucket).map_or(0, VecDeque::len);
        let by_target = self.targets.get(&target).map_or(0, VecDeque::len);
        let who = if recipient.is_empty() {
            "owners unknown".to_string()
        } else {
            recipient.to_string()
        };
        let device = match &e.what {
            What::Detach(d) => Some(d.device),
            What::Terminate(_) => None,
        };
        let told_key = (target.0.clone(), device);
        let folded = never_held
            && (self.told.get(&told_key))
                .is_some_and(|(told, _)| e.deadline_ms.is_some_and(|d| d >= *told));
        let held = if folded {
            Some((
                format!("told:{target:?}"),
                "one warning an hour about one process or environment, unless its deadline comes sooner".to_string(),
            ))
        } else if never_held {
            None
        } else if by_target >= PER_TARGET {
            Some((
                format!("target:{target:?}"),
                format!("{PER_TARGET} messages an hour about one process or environment"),
            ))
        } else if by_recipient >= self.per_hour as usize {
            Some((
                format!("recipient:{recipient}:{class:?}"),
                format!(
                    "{} messages an hour to {who} about {} (--notify-rate)",
                    self.per_hour,
                    class.words()
                ),
            ))
        } else {
            None
        };
        if let Some((key, why)) = held {
            let first = !self.holding.contains_key(&key);
            self.holding.entry(key).or_insert(now_ms);
            return Verdict::Hold {
                first,
                why: format!("rate limited: {why}"),
            };
        }
        self.holding.remove(&format!("target:{target:?}"));
        self.holding
            .remove(&format!("recipient:{recipient}:{class:?}"));
        if let (true, Some(d)) = (never_held, e.deadline_ms) {
            self.told.insert(told_key, (d, now_ms));
        } else if e.stage == Stage::Cleared {
            // Told it is over: a new wait is news.
            self.told.remove(&told_key);
        }
        self.sent.entry(bucket).or_default().push_back(now_ms);
        self.targets.entry(target).or_default().push_back(now_ms);
        Verdict::Send
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GpuIndex;
    use crate::plan::{Detach, Termination};

    fn terminate(pid: u32, stage: Stage, deadline: Option<u64>) -> Event {
        Event {
            stage,
            host: HostId("h".into()),
            what: What::Terminate(Termination::of(Pid(pid), Some(1))),
            since_ms: 0,
            deadline_ms: deadline,
        }
    }

    fn detach(eid: &str, device: u32, working: bool, stage: Stage) -> Event {
        Event {
            stage,
            host: HostId("h".into()),
            what: What::Detach(Detach {
                device: GpuIndex(device),
                eid: EnvId(eid.into()),
                rules: Default::default(),
                username: None,
                charged: None,
                owner: None,
                groups: Vec::new(),
                working,
            }),
            since_ms: 0,
            deadline_ms: Some(9),
        }
    }

    fn sent(v: &Verdict) -> bool {
        *v == Verdict::Send
    }

    #[test]
    fn each_recipient_gets_at_most_n_an_hour_and_an_hour_later_more() {
        let mut l = RateLimit::new(2);
        let acted = |pid| terminate(pid, Stage::Acted, None);
        assert!(sent(&l.allow("alice", &acted(1), 0)));
        assert!(sent(&l.allow("alice", &acted(2), 1_000)));
        assert!(!sent(&l.allow("alice", &acted(3), 2_000)));
        // Another recipient has their own count.
        assert!(sent(&l.allow("bob", &acted(4), 2_000)));
        assert!(!sent(&l.allow("alice", &acted(5), HOUR_MS - 1)));
        // Exactly an hour after the first: it no longer counts.
        assert!(sent(&l.allow("alice", &acted(6), HOUR_MS)));
        assert!(!sent(&l.allow("alice", &acted(7), HOUR_MS + 1)));
        assert!(sent(&l.allow("alice", &acted(8), HOUR_MS + 1_000)));
    }

    #[test]
    fn a_held_back_run_is_said_once_and_again_after_a_message_goes() {
        let mut l = RateLimit::new(1);
        let acted = |pid| terminate(pid, Stage::Acted, None);
        assert!(sent(&l.allow("alice", &acted(1), 0)));
        let first = l.allow("alice", &acted(2), 1);
        assert!(
            matches!(&first, Verdict::Hold { first: true, why } if why.contains("1 messages an hour to alice about their jobs"))
        );
        assert!(matches!(
            l.allow("alice", &acted(3), 2),
            Verdict::Hold { first: false, .. }
        ));
        assert!(sent(&l.allow("alice", &acted(4), HOUR_MS)));
        assert!(matches!(
            l.allow("alice", &acted(5), HOUR_MS + 1),
            Verdict::Hold { first: true, .. }
        ));
    }

    #[test]
    fn a_warning_with_a_deadline_about_their_work_is_never_held_back() {
        let mut l = RateLimit::new(0);
        for pid in 0..50 {
            let warned = terminate(pid, Stage::Warned, Some(10));
            assert!(sent(&l.allow("alice", &warned, 0)));
        }
        assert!(sent(&l.allow(
            "alice",
            &detach("e", 0, true, Stage::Warned),
            0
        )));
        // Without a deadline (warned only), or about an idle attachment: held.
        assert!(!sent(&l.allow(
            "alice",
            &terminate(99, Stage::Warned, None),
            0
        )));
        assert!(!sent(&l.allow(
            "alice",
            &detach("e", 1, false, Stage::Warned),
            0
        )));
    }

    #[test]
    fn a_flapping_warning_about_one_target_is_told_once_an_hour_unless_sooner() {
        let mut l = RateLimit::new(0);
        let warned = |pid, deadline| terminate(pid, Stage::Warned, Some(deadline));
        assert!(sent(&l.allow("alice", &warned(1, 100_000), 0)));
        // bob flaps her attachment: the same warning again and again.
        for k in 1..8 {
            let again = l.allow("alice", &warned(1, 100_000), k * 5_000);
            assert!(
                matches!(&again, Verdict::Hold { first, why } if *first == (k == 1) && why.contains("one warning an hour")),
                "{again:?}"
            );
        }
        // A sooner deadline is news; a later one is not.
        assert!(sent(&l.allow("alice", &warned(1, 50_000), 40_000)));
        assert!(!sent(&l.allow("alice", &warned(1, 60_000), 41_000)));
        // Another target is told at once; an hour on, this one again.
        assert!(sent(&l.allow("alice", &warned(2, 100_000), 42_000)));
        assert!(sent(&l.allow(
            "alice",
            &warned(1, 50_000),
            40_000 + HOUR_MS
        )));
        // Once its clearing is told, a new wait is news, whatever its
        // deadline.
        let mut l = RateLimit::new(20);
        assert!(sent(&l.allow("alice", &warned(3, 100_000), 0)));
        let cleared = terminate(3, Stage::Cleared, Some(100_000));
        assert!(sent(&l.allow("alice", &cleared, 1_000)));
        assert!(sent(&l.allow("alice", &warned(3, 200_000), 2_000)));
        // A detach's warning is about one device: another is news.
        let on = |device| Event {
            deadline_ms: Some(100_000),
            ..detach("e", device, true, Stage::Warned)
        };
        assert!(sent(&l.allow("alice", &on(0), 3_000)));
        assert!(sent(&l.allow("alice", &on(1), 3_000)));
        assert!(!sent(&l.allow("alice", &on(0), 4_000)));
    }

    #[test]
    fn flapping_one_environment_spends_neither_her_work_allowance_nor_more_than_a_few() {
        let mut l = RateLimit::new(20);
        let mut told = 0;
        // bob attaches alice's environment to spare devices, again and
        // again: warned, acted, cleared, for each.
        for round in 0..40u64 {
            for stage in [Stage::Warned, Stage::Acted, Stage::Cleared] {
                let e = detach("alices", (round % 7) as u32, false, stage);
                told += usize::from(sent(&l.allow("alice", &e, round * 1_000)));
            }
        }
        assert_eq!(told, PER_TARGET);
        // Her real warning, and what happens to her jobs, still go (19 of
        // her 20 for her work: the 20th is below).
        for pid in 0..19 {
            assert!(sent(&l.allow(
                "alice",
                &terminate(pid, Stage::Acted, None),
                50_000
            )));
        }
        // Other environments of hers have their own few, and so have the
        // devices her jobs use in the flapped one.
        assert!(sent(&l.allow(
            "alice",
            &detach("other", 0, false, Stage::Acted),
            50_000
        )));
        assert!(sent(&l.allow(
            "alice",
            &detach("alices", 0, true, Stage::Acted),
            50_000
        )));
    }

    #[test]
    fn quiet_recipients_and_targets_are_forgotten() {
        let mut l = RateLimit::new(1);
        assert!(sent(&l.allow(
            "alice",
            &terminate(1, Stage::Acted, None),
            0
        )));
        assert!(sent(&l.allow(
            "bob",
            &terminate(2, Stage::Acted, None),
            HOUR_MS + 1
        )));
        assert_eq!((l.sent.len(), l.targets.len()), (1, 1));
    }
}
