//! idle-gpu: a process that holds GPU memory while its utilization stays
//! below `--idle-below` percent for all of `--idle-after` is reclaimed
//! (terminated, after the run's grace like any rule's action).
//!
//! Each cycle reads one figure per process ([`reading`]): the highest of
//! its GPUs', each the process's own SM utilization as `nvidia-smi pmon -s
//! u` prints it (`-`, no kernel of it ran in pmon's sampling window, is
//! 0), or, where pmon has no line for it (it failed, or MIG, where it is
//! unavailable), the whole GPU's `utilization.gpu` when the process is the
//! only one on that GPU (said in the finding). Otherwise its utilization
//! is unknown and it is never reclaimed: it is noticed, and its window
//! starts over.
//!
//! The windows ([`IdleHistory`]) are kept from cycle to cycle, and across
//! restarts in `--state-db`: a process (host, pid, start time) is idle
//! since the first of the consecutive cycles that saw it below the
//! threshold. One reading at or above it, one unknown, or a gap between
//! sightings longer than the run's (a stopped enforcer saw nothing) starts
//! it over. A host that did not answer keeps its windows as they were.
//! Only what the driver measures counts: nothing a user writes (records,
//! names) moves a window, and a process another user runs beside alice's
//! on her GPU only makes hers unknown (never reclaimed).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::attribution::{Attribution, Standing};
use super::{Action, Finding, Notice, Rule, Violation};
use crate::cycle::millis;
use crate::model::{HostId, HostSnapshot, Pid, Process};

/// `--idle-after`, `--idle-below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IdlePolicy {
    /// How long a process must stay idle (zero: at one reading, for
    /// replays).
    pub after: Duration,
    /// Below this many percent is idle.
    pub below: u32,
}

/// Whose utilization a process was judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Its own, from pmon.
    Process,
    /// Its GPU's, which it had to itself, on at least one of its GPUs.
    Gpu,
}

/// A process's utilization this cycle: the highest of its GPUs', and
/// whose figure it was; `None` where unknown on any of them.
pub fn reading(snap: &HostSnapshot, p: &Process) -> Option<(u32, Source)> {
    let u = snap.utilization.as_ref()?;
    let mut out: Option<(u32, Source)> = None;
    for index in p.indices() {
        let own = u.processes.as_ref().and_then(|lines| {
            lines
                .iter()
                .find(|l| l.index == index && l.pid == p.pid)
                .map(|l| l.sm.unwrap_or(0))
        });
        let (pct, source) = match own {
            Some(pct) => (pct, Source::Process),
            None => {
                let alone = snap
                    .processes
                    .iter()
                    .all(|q| q.pid == p.pid || q.usage_on(index).is_none());
                match u.gpus.get(&index) {
                    Some(&pct) if alone => (pct, Source::Gpu),
                    _ => return None,
                }
            }
        };
        out = Some(match out {
            None => (pct, source),
            Some((m, s)) => (m.max(pct), s.max(source)),
        });
    }
    out
}

/// What identifies a process from cycle to cycle.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Tracked {
    pub host: HostId,
    pub pid: Pid,
    pub start_time: u64,
}

/// A process's idle window so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// First seen below the threshold (ms since the Unix epoch).
    pub since_ms: u64,
    /// Last seen below it.
    pub last_ms: u64,
    /// Whose utilization said so (the GPU's, if it ever was).
    pub source: Source,
}

/// Every process's idle window.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IdleHistory {
    #[serde(with = "entries")]
    pub windows: BTreeMap<Tracked, Window>,
}

/// The windows as a list of pairs (JSON keys are strings).
mod entries {
    use super::{Tracked, Window};
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer>(
        m: &BTreeMap<Tracked, Window>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<Tracked, Window>, D::Error> {
        Ok(Vec::<(Tracked, Window)>::deserialize(d)?
            .into_iter()
            .collect())
    }
}

impl IdleHistory {
    /// The windows after this cycle's readings on the hosts that answered
    /// (`seen`): extended where a process is still below `below` and was
    /// last seen within `gap` (any, when `None`), started where it just
    /// went below, dropped where it is busy, unknown or gone. The windows
    /// of hosts not in `seen` are kept.
    pub fn track(
        &self,
        seen: &[(&HostId, &HostSnapshot)],
        below: u32,
        now_ms: u64,
        gap: Option<Duration>,
    ) -> IdleHistory {
        let answered: std::collections::HashSet<&HostId> = seen.iter().map(|(h, _)| *h).collect();
        let mut windows: BTreeMap<Tracked, Window> = self
            .windows
            .iter()
            .filter(|(t, _)| !answered.contains(&t.host))
            .map(|(t, w)| (t.clone(), *w))
            .collect();
        let gap_ms = gap.map(millis);
        for (host, snap) in seen {
            for p in &snap.processes {
                let Some(start_time) = p.start_time else {
                    continue;
                };
                let Some((pct, source)) = reading(snap, p) else {
                    continue;
                };
                if pct >= below {
                    continue;
                }
                let key = Tracked {
                    host: (*host).clone(),
                    pid: p.pid,
                    start_time,
                };
                let kept = self.windows.get(&key).filter(|w| {
                    w.last_ms <= now_ms && gap_ms.is_none_or(|g| now_ms - w.last_ms <= g)
                });
                let window = match kept {
                    Some(w) => Window {
                        since_ms: w.since_ms,
                        last_ms: now_ms,
                        source: w.source.max(source),
                    },
                    None => Window {
                        since_ms: now_ms,
                        last_ms: now_ms,
                        source,
                    },
                };
                windows.insert(key, window);
            }
        }
        IdleHistory { windows }
    }

    /// The window of `p` on `host`, if it has one.
    pub fn window(&self, host: &HostId, p: &Process) -> Option<&Window> {
        self.windows.get(&Tracked {
            host: host.clone(),
            pid: p.pid,
            start_time: p.start_time?,
        })
    }
}

/// The processes of one host idle for all of `policy.after` in `history`
/// (already tracked through this cycle), and a notice for each process
/// whose utilization is unknown. Never a process whose user is unknown.
pub fn evaluate(
    host: &HostId,
    a: &Attribution,
    history: &IdleHistory,
    policy: &IdlePolicy,
    now_ms: u64,
) -> (Vec<Violation>, Vec<Notice>) {
    let snap = a.snapshot();
    let mut violations = Vec::new();
    let mut notices = Vec::new();
    for (pi, p) in snap.processes.iter().enumerate() {
        if matches!(a.standing(pi), Standing::Unknown) || p.start_time.is_none() {
            continue;
        }
        if reading(snap, p).is_none() {
            notices.push(Notice::UtilizationUnknown {
                host: host.clone(),
                pid: p.pid,
                gpus: p.indices().collect(),
            });
            continue;
        }
        let Some(w) = history.window(host, p) else {
            continue;
        };
        let idle_ms = now_ms.saturating_sub(w.since_ms);
        if w.last_ms != now_ms || idle_ms < millis(policy.after) {
            continue;
        }
        violations.push(Violation {
            rule: Rule::IdleGpu,
            finding: Finding::Idle {
                host: host.clone(),
                pid: p.pid,
                user: a.user_of(pi).map(|u| u.into_owned()),
                devices: p.indices().collect(),
                since_ms: w.since_ms,
                idle_ms,
                below: policy.below,
                source: w.source,
            },
            actions: vec![Action::Terminate {
                host: host.clone(),
                pid: p.pid,
            }],
        });
    }
    (violations, notices)
}
