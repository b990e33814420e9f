//! idle-gpu: a process that holds GPU memory while its utilization stays
//! below `--idle-below` percent for all of `--idle-after` is reclaimed
//! (terminated, after the run's grace like any rule's action).
//!
//! Each cycle reads one figure per process ([`reading`]): the highest of
//! its GPUs', each the process's own SM utilization as `nvidia-smi pmon -s
//! u` prints it (`-`, no kernel of it ran in pmon's sampling window, is
//! 0), or, where pmon has no line for it (it failed, or MIG, where it is
//! unavailable), the whole GPU's `utilization.gpu` when the process is the
//! only one on that GPU (said in the finding). A CUDA MPS client (pmon's
//! type `M+C`) runs its kernels on the MPS server, whose line carries them:
//! for its own `-`, the highest figure of the servers on its GPU that run
//! as its user or as root, a bound on its own work, where there is one and
//! pmon gave each one; else 0 where the whole GPU's figure is 0 (said in
//! the finding); a number pmon gives it is its own. A driver whose pmon
//! names no type makes every `-` such a reading. Otherwise its utilization
//! is unknown and it is never reclaimed: it is noticed, and its window
//! starts over. The machine's shared MPS server is no process here (see
//! [`crate::model::MpsServer`]): never reclaimed.
//!
//! The windows ([`IdleHistory`]) are kept from cycle to cycle, and across
//! restarts in `--state-db`: a process (host, pid, start time) is idle
//! since the first of the consecutive cycles that saw it below the
//! threshold. One reading at or above it, one unknown, or a gap between
//! sightings longer than the run's (a few intervals; an hour for cron
//! runs: a stopped enforcer or an unreachable host saw nothing) starts it
//! over. Each reading is pmon's sample of about a second, once a cycle. A host that did not answer keeps its windows as they were.
//! Only what the driver measures counts: nothing a user writes (records,
//! names) moves a window, and a process another user runs beside alice's
//! on her GPU only makes hers unknown (never reclaimed).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::attribution::{Attribution, Standing};
use super::{Finding, Notice, Rule, Violation};
use crate::clock::millis;
use crate::model::{GpuIndex, HostId, HostSnapshot, Pid, Process};

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
    /// A CUDA MPS client's, on at least one of its GPUs: the figure of the
    /// MPS servers that may serve it (pmon shows a client's work on its
    /// server's line), a bound on its own, or its GPU's when that is 0.
    Mps,
}

/// A process's utilization this cycle: the highest of its GPUs', and
/// whose figure it was; `None` where unknown on any of them. For every
/// process of a host, [`readings`] works them out at once.
pub fn reading(snap: &HostSnapshot, p: &Process) -> Option<(u32, Source)> {
    readings(snap).get(&p.pid).copied().flatten()
}

/// What pmon said of one process on one GPU.
#[derive(Clone, Copy)]
enum Line {
    /// Its SM figure (`None`: `-`), and whether it is an MPS client.
    Sm(Option<u32>, bool),
    /// Listed twice: a process name can hold a newline and forge a line,
    /// so neither is believed.
    Twice,
}

/// Every process's reading on one host ([`reading`]), in one pass over
/// pmon's lines and the processes. Where pmon lists a (GPU, pid) twice,
/// that process is unknown; `-` is 0 only where the GPU's own figure is
/// known (a GPU that cannot say, such as MIG, says nothing by `-`).
pub fn readings(snap: &HostSnapshot) -> HashMap<Pid, Option<(u32, Source)>> {
    let Some(u) = snap.utilization.as_ref() else {
        return HashMap::new();
    };
    let mut lines: HashMap<(GpuIndex, Pid), Line> = HashMap::new();
    for l in u.processes.iter().flatten() {
        lines
            .entry((l.index, l.pid))
            .and_modify(|seen| *seen = Line::Twice)
            .or_insert(Line::Sm(l.sm, l.mps_client));
    }
    let mut on_gpu: HashMap<GpuIndex, usize> = HashMap::new();
    for p in &snap.processes {
        for index in p.indices() {
            *on_gpu.entry(index).or_default() += 1;
        }
    }
    let servers = mps_servers(snap);
    // An MPS client's work is on the line of the server that serves it,
    // which runs as its user (a server serves one user's clients) or as
    // root: the highest figure of those on its GPU, where pmon gave each
    // one; none where none runs. A bound on the client's own: its work is
    // some of theirs.
    let served = |p: &Process, index: GpuIndex| -> Option<u32> {
        let mut bound = None;
        let serving = servers
            .iter()
            .filter(|s| s.0 == index && (s.1 == p.uid || s.1 == Some(0)));
        for s in serving {
            let Some(Line::Sm(sm, _)) = lines.get(&(index, s.2)) else {
                return None;
            };
            bound = Some(bound.unwrap_or(0).max(sm.unwrap_or(0)));
        }
        bound
    };
    let of = |p: &Process| {
        let mut out: Option<(u32, Source)> = None;
        for index in p.indices() {
            let gpu = u.gpus.get(&index).copied();
            // A line listed twice, like no figure at all, is unknown.
            let (pct, source) = match (lines.get(&(index, p.pid)), gpu) {
                (Some(Line::Sm(Some(pct), _)), _) => (*pct, Source::Process),
                (Some(Line::Sm(None, false)), Some(_)) => (0, Source::Process),
                // An MPS client's kernels run on the server, whose line has
                // them: its own `-` says nothing; its servers' figure, or
                // its GPU's when that is 0, does.
                (Some(Line::Sm(None, true)), gpu) => match (served(p, index), gpu) {
                    (Some(pct), _) | (None, Some(pct @ 0)) => (pct, Source::Mps),
                    _ => return None,
                },
                (None, Some(pct)) if on_gpu.get(&index) == Some(&1) => (pct, Source::Gpu),
                _ => return None,
            };
            out = Some(match out {
                None => (pct, source),
                Some((m, s)) => (m.max(pct), s.max(source)),
            });
        }
        out
    };
    snap.processes.iter().map(|p| (p.pid, of(p))).collect()
}

/// The MPS servers of a host, each (GPU, its uid, pid) it runs on: the
/// shared ones and the users' own.
fn mps_servers(snap: &HostSnapshot) -> Vec<(GpuIndex, Option<u32>, Pid)> {
    let Some(truth) = &snap.truth else {
        return Vec::new();
    };
    let shared = truth
        .mps_servers
        .iter()
        .flat_map(|s| s.gpus.iter().map(|g| (g.index, s.uid, s.pid)));
    let own = snap
        .processes
        .iter()
        .filter(|p| truth.own_mps_servers.contains_key(&p.pid))
        .flat_map(|p| p.indices().map(|i| (i, p.uid, p.pid)));
    shared.chain(own).collect()
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
    /// of hosts not in `seen` are kept while within `gap` (a host long
    /// gone, or left out of the inventory, is forgotten).
    pub fn track(
        &self,
        seen: &[(&HostId, &HostSnapshot)],
        below: u32,
        now_ms: u64,
        gap: Option<Duration>,
    ) -> IdleHistory {
        let gap_ms = gap.map(millis);
        let answered: std::collections::HashSet<&HostId> = seen.iter().map(|(h, _)| *h).collect();
        let mut windows: BTreeMap<Tracked, Window> = self
            .windows
            .iter()
            .filter(|(t, w)| {
                !answered.contains(&t.host)
                    && gap_ms.is_none_or(|g| now_ms.saturating_sub(w.last_ms) <= g)
            })
            .map(|(t, w)| (t.clone(), *w))
            .collect();
        for (host, snap) in seen {
            let readings = readings(snap);
            for p in &snap.processes {
                let Some(start_time) = p.start_time else {
                    continue;
                };
                let Some((pct, source)) = readings.get(&p.pid).copied().flatten() else {
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

/// Whose a process is, as the idle rule needs it: worked out once with the
/// host's attribution, beside its snapshot ([`owners`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdleOwner {
    /// Neither its environment nor its user can be told: never reclaimed.
    Unknown,
    /// Its user, as the caps count users (none: a record's nobody).
    Known(Option<String>),
}

/// Each process's [`IdleOwner`], in snapshot order.
pub fn owners(a: &Attribution) -> Vec<IdleOwner> {
    (0..a.snapshot().processes.len())
        .map(|pi| match (a.standing(pi), a.user_of(pi)) {
            (Standing::Unknown, None) => IdleOwner::Unknown,
            (_, user) => IdleOwner::Known(user.map(|u| u.into_owned())),
        })
        .collect()
}

/// The processes of `snap` idle for all of `policy.after` in `history`
/// (already tracked through this cycle), and a notice for each process
/// whose utilization is unknown. Never a process whose user is unknown.
/// `owners`: each process's, from [`owners`].
pub fn evaluate(
    host: &HostId,
    snap: &HostSnapshot,
    owners: &[IdleOwner],
    history: &IdleHistory,
    policy: &IdlePolicy,
    now_ms: u64,
) -> (Vec<Violation>, Vec<Notice>) {
    let readings = readings(snap);
    let mut violations = Vec::new();
    let mut notices = Vec::new();
    for (p, owner) in snap.processes.iter().zip(owners) {
        let IdleOwner::Known(user) = owner else {
            continue;
        };
        if p.start_time.is_none() {
            continue;
        }
        if readings.get(&p.pid).copied().flatten().is_none() {
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
        let finding = Finding::Idle {
            host: host.clone(),
            pid: p.pid,
            user: user.clone(),
            devices: p.indices().collect(),
            since_ms: w.since_ms,
            idle_ms,
            below: policy.below,
            source: w.source,
        };
        violations.push(Violation::terminating(Rule::IdleGpu, finding, host, p.pid));
    }
    (violations, notices)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{ProcessUtilization, Utilization};
    use crate::rules::Action;
    use proptest::prelude::*;

    /// A snapshot's pmon lines, to change.
    fn pmon_of(snap: &mut HostSnapshot) -> &mut Vec<ProcessUtilization> {
        snap.utilization
            .as_mut()
            .unwrap()
            .processes
            .as_mut()
            .unwrap()
    }

    fn capture(name: &str) -> String {
        recorded(&format!("h100/pmon/{name}"))
    }

    fn host_with(
        processes: Vec<Process>,
        pmon: Option<Vec<(u32, u32, Option<u32>)>>,
        gpus: &[(u32, u32)],
    ) -> HostSnapshot {
        HostSnapshot {
            processes,
            envs: vec![env("e", Some("alice"), None)].into(),
            devices: devices(2, &[(0, "e"), (1, "e")]).into(),
            utilization: Some(Utilization {
                processes: pmon.map(|lines| {
                    lines
                        .into_iter()
                        .map(|(g, pid, sm)| ProcessUtilization {
                            index: GpuIndex(g),
                            pid: Pid(pid),
                            sm,
                            mps_client: false,
                        })
                        .collect()
                }),
                gpus: gpus.iter().map(|&(g, u)| (GpuIndex(g), u)).collect(),
            }),
            ..Default::default()
        }
    }

    use crate::model::GpuIndex;

    #[test]
    fn the_h100_captures_read_idle_for_no_kernel_and_busy_for_matrix_products() {
        let pmon = crate::snapshot::nvidia_smi::parse_pmon(
            &capture("1-idle-and-busy-pmon-c1-su.txt"),
            "h100",
        )
        .unwrap();
        let snap = HostSnapshot {
            processes: vec![
                proc_(470, Some("e"), &[(0, mib(1024))]),
                proc_(471, Some("e"), &[(0, mib(512))]),
            ],
            utilization: Some(Utilization {
                processes: Some(pmon),
                gpus: crate::snapshot::nvidia_smi::parse_gpu_utilization("0, 100\n", "").unwrap(),
            }),
            ..Default::default()
        };
        assert_eq!(
            reading(&snap, &snap.processes[0]),
            Some((0, Source::Process))
        );
        assert_eq!(
            reading(&snap, &snap.processes[1]),
            Some((99, Source::Process))
        );
        // Bursty work (3 % SM) is below 5; one that was busy seconds ago
        // and is not now prints `-`.
        let later = crate::snapshot::nvidia_smi::parse_pmon(
            &capture("4-low-and-was-busy-pmon-c1-sum-t2.txt"),
            "h100",
        )
        .unwrap();
        assert_eq!(
            later.iter().map(|l| (l.pid.0, l.sm)).collect::<Vec<_>>(),
            [(641, Some(3)), (642, None)]
        );
        // No process: pmon's line of `-` is no process.
        let none =
            crate::snapshot::nvidia_smi::parse_pmon(&capture("0-none-pmon-c1-su.txt"), "h100")
                .unwrap();
        assert!(none.is_empty());
    }

    /// Issue 44's second row, from `fixtures/nvidia-smi/mps/`: alice's MPS
    /// client 1040 computes; pmon puts its work on the server's line (the
    /// shared server is no process of the snapshot) and prints `-` for it.
    #[test]
    fn an_mps_clients_figure_is_its_servers_or_its_idle_gpus() {
        let mps = |name: &str| recorded(&format!("mps/{name}"));
        let client = proc_(1040, Some("e"), &[(0, mib(1540))]);
        let with = |phase: &str| HostSnapshot {
            processes: vec![client.clone()],
            utilization: Some(Utilization {
                processes: Some(
                    crate::snapshot::nvidia_smi::parse_pmon(
                        &mps(&format!("{phase}-pmon-c1-su.txt")),
                        "",
                    )
                    .unwrap(),
                ),
                gpus: crate::snapshot::nvidia_smi::parse_gpu_utilization(
                    &mps(&format!("{phase}-query-gpu-util.csv")),
                    "",
                )
                .unwrap(),
            }),
            ..Default::default()
        };
        let busy = with("1-busy");
        let lines = busy
            .utilization
            .as_ref()
            .unwrap()
            .processes
            .clone()
            .unwrap();
        assert_eq!(
            lines
                .iter()
                .map(|l| (l.pid.0, l.sm, l.mps_client))
                .collect::<Vec<_>>(),
            [(1040, None, true), (1048, Some(99), false)]
        );
        assert_eq!(reading(&busy, &client), None, "busy: unknown, never idle");
        let idle = with("2-idle");
        assert_eq!(reading(&idle, &client), Some((0, Source::Mps)));
        // Where the host names the server (1048, alice's), its line bounds
        // its clients': busy, the client is at most as busy; idle, the
        // client is idle whatever else runs on the GPU.
        let server = |uid: u32| crate::model::MpsServer {
            pid: Pid(1048),
            start_time: Some(1),
            uid: Some(uid),
            user: None,
            gpus: smallvec::smallvec![crate::model::DeviceUsage {
                index: GpuIndex(0),
                usage: mib(66),
            }],
        };
        let named = |mut snap: HostSnapshot, uid: u32| {
            snap.processes[0].uid = Some(1001);
            snap.truth = Some(crate::model::HostTruth {
                mps_servers: vec![server(uid)],
                ..Default::default()
            });
            snap
        };
        assert_eq!(
            reading(&named(busy.clone(), 1001), &client),
            Some((99, Source::Mps))
        );
        let mut beside = named(idle.clone(), 1001);
        beside
            .utilization
            .as_mut()
            .unwrap()
            .gpus
            .insert(GpuIndex(0), 100);
        assert_eq!(reading(&beside, &client), Some((0, Source::Mps)));
        // A server of another user serves none of its clients: it says
        // nothing of the client, idle or busy; the GPU's figure decides.
        assert_eq!(reading(&named(busy.clone(), 1002), &client), None);
        let mut other = named(idle.clone(), 1002);
        other
            .utilization
            .as_mut()
            .unwrap()
            .gpus
            .insert(GpuIndex(0), 100);
        assert_eq!(reading(&other, &client), None, "bob's idle server");
        let mut two = named(busy.clone(), 1002);
        let own = crate::model::MpsServer {
            pid: Pid(2000),
            uid: Some(1001),
            ..server(1001)
        };
        two.truth.as_mut().unwrap().mps_servers.push(own);
        pmon_of(&mut two).push(ProcessUtilization {
            index: GpuIndex(0),
            pid: Pid(2000),
            sm: None,
            mps_client: false,
        });
        assert_eq!(
            reading(&two, &client),
            Some((0, Source::Mps)),
            "its own server is idle"
        );
        // A server pmon has no line for: no bound; the GPU's figure only.
        pmon_of(&mut two).pop();
        assert_eq!(reading(&two, &client), None);
        // Its own figure, where the driver gives one, is its own.
        let mut own = busy.clone();
        pmon_of(&mut own)[0].sm = Some(40);
        assert_eq!(reading(&own, &client), Some((40, Source::Process)));
        // The GPU's figure unknown: so is the client's.
        let mut blind = idle.clone();
        blind.utilization.as_mut().unwrap().gpus.clear();
        assert_eq!(reading(&blind, &client), None);
    }

    #[test]
    fn the_gpus_figure_stands_in_only_for_a_process_alone_on_it() {
        let alone = proc_(1, Some("e"), &[(0, mib(10))]);
        let a = proc_(2, Some("e"), &[(1, mib(10))]);
        let b = proc_(3, Some("e"), &[(1, mib(10))]);
        // pmon failed (MIG): GPU 0 has one process, GPU 1 two.
        let snap = host_with(vec![alone.clone(), a.clone(), b], None, &[(0, 2), (1, 0)]);
        assert_eq!(reading(&snap, &alone), Some((2, Source::Gpu)));
        assert_eq!(reading(&snap, &a), None, "shared GPU, no figure of its own");
        // Its own figure wins; on two GPUs the busiest counts.
        let both = proc_(4, Some("e"), &[(0, mib(1)), (1, mib(1))]);
        let snap = host_with(
            vec![both.clone()],
            Some(vec![(0, 4, Some(1)), (1, 4, None)]),
            &[(0, 90), (1, 90)],
        );
        assert_eq!(reading(&snap, &both), Some((1, Source::Process)));
        let snap = host_with(vec![both.clone()], Some(vec![(0, 4, Some(1))]), &[(1, 30)]);
        assert_eq!(reading(&snap, &both), Some((30, Source::Gpu)));
        // A forged line (a process name can hold a newline): the pid listed
        // twice on a GPU is unknown, whatever either line says.
        let forged = host_with(
            vec![a.clone()],
            Some(vec![(1, 2, Some(0)), (1, 2, Some(99))]),
            &[(1, 0)],
        );
        assert_eq!(reading(&forged, &a), None);
        // `-` where the GPU cannot say its own figure (MIG): unknown.
        let mig = host_with(vec![a.clone()], Some(vec![(1, 2, None)]), &[]);
        assert_eq!(reading(&mig, &a), None);
        let known = host_with(vec![a.clone()], Some(vec![(1, 2, None)]), &[(1, 0)]);
        assert_eq!(reading(&known, &a), Some((0, Source::Process)));
        // Not asked: unknown.
        let mut plain = snap.clone();
        plain.utilization = None;
        assert_eq!(reading(&plain, &both), None);
    }

    fn cycle(
        history: &IdleHistory,
        snap: &HostSnapshot,
        now: u64,
        gap: Option<Duration>,
    ) -> (IdleHistory, Vec<Violation>, Vec<Notice>) {
        let h = HostId("h".into());
        let tracked = history.track(&[(&h, snap)], 5, now, gap);
        let a = Attribution::of(snap, &Default::default());
        let policy = IdlePolicy {
            after: Duration::from_secs(3600),
            below: 5,
        };
        let (v, n) = evaluate(&h, snap, &owners(&a), &tracked, &policy, now);
        (tracked, v, n)
    }

    #[test]
    fn a_process_idle_for_the_whole_window_is_reclaimed_and_one_busy_moment_spares_it() {
        let p = proc_(7, Some("e"), &[(0, mib(100))]);
        let idle = host_with(vec![p.clone()], Some(vec![(0, 7, None)]), &[(0, 0)]);
        let busy = host_with(vec![p.clone()], Some(vec![(0, 7, Some(40))]), &[(0, 40)]);
        let min = 60_000;
        let mut h = IdleHistory::default();
        let mut found = Vec::new();
        for t in 0..=60 {
            let v;
            (h, v, _) = cycle(&h, &idle, 1_000_000 + t * min, None);
            found.push(!v.is_empty());
        }
        assert!(!found[..60].iter().any(|f| *f), "not before the hour");
        assert!(found[60], "at the hour");
        // Busy at minute 30: the window starts over there.
        let mut h = IdleHistory::default();
        for t in 0..=90 {
            let snap = if t == 30 { &busy } else { &idle };
            let v;
            (h, v, _) = cycle(&h, snap, 1_000_000 + t * min, None);
            assert_eq!(!v.is_empty(), t >= 91, "minute {t}");
        }
        let (_, v, _) = cycle(&h, &idle, 1_000_000 + 91 * min, None);
        assert_eq!(
            v[0].finding,
            Finding::Idle {
                host: HostId("h".into()),
                pid: Pid(7),
                user: Some("alice".into()),
                devices: smallvec::smallvec![GpuIndex(0)],
                since_ms: 1_000_000 + 31 * min,
                idle_ms: 60 * min,
                below: 5,
                source: Source::Process,
            }
        );
        assert_eq!(
            v[0].actions[..],
            [Action::Terminate {
                host: HostId("h".into()),
                pid: Pid(7)
            }]
        );
    }

    #[test]
    fn a_gap_an_unknown_reading_or_a_new_process_starts_the_window_over() {
        let p = proc_(7, Some("e"), &[(0, mib(100))]);
        let other = proc_(8, Some("e"), &[(0, mib(100))]);
        let idle = host_with(vec![p.clone()], Some(vec![(0, 7, Some(0))]), &[(0, 0)]);
        let unknown = host_with(vec![p.clone(), other], None, &[(0, 0)]);
        let gap = Some(Duration::from_secs(300));
        let (h, _, _) = cycle(&IdleHistory::default(), &idle, 0, gap);
        let (h2, _, _) = cycle(&h, &idle, 200_000, gap);
        assert_eq!(h2.windows.values().next().unwrap().since_ms, 0);
        let (h3, _, _) = cycle(&h2, &idle, 600_000, gap);
        assert_eq!(
            h3.windows.values().next().unwrap().since_ms,
            600_000,
            "a gap of 400 s"
        );
        let (h4, v, n) = cycle(&h3, &unknown, 700_000, gap);
        assert!(h4.windows.is_empty() && v.is_empty());
        assert_eq!(n.len(), 2, "both processes on the shared GPU: unknown");
        // The same pid, another start time: another process.
        let mut reborn = idle.clone();
        reborn.processes[0].start_time = Some(99_999);
        let (h5, _, _) = cycle(&h2, &reborn, 250_000, gap);
        assert_eq!(h5.windows.values().next().unwrap().since_ms, 250_000);
        // A host that did not answer keeps its windows; they survive JSON
        // (the state database).
        let kept = h2.track(&[], 5, 400_000, gap);
        assert_eq!(kept, h2);
        // ... until a gap has passed: a host long gone is forgotten.
        assert!(h2.track(&[], 5, 600_000, gap).windows.is_empty());
        let json = serde_json::to_string(&h2).unwrap();
        assert_eq!(serde_json::from_str::<IdleHistory>(&json).unwrap(), h2);
    }

    #[test]
    fn a_process_whose_user_is_unknown_is_never_reclaimed_but_an_unknown_environ_is_no_escape() {
        let reclaimed = |uid: Option<u32>| {
            let mut p = proc_(7, Some("e"), &[(0, mib(100))]);
            p.owner = crate::model::Owner::Unknown("unreadable".into());
            p.uid = uid;
            let mut snap = host_with(vec![p], Some(vec![(0, 7, None)]), &[(0, 0)]);
            snap.truth = Some(Default::default());
            let h = HostId("h".into());
            let tracked = IdleHistory::default().track(&[(&h, &snap)], 5, 0, None);
            let a = Attribution::of(&snap, &Default::default());
            let policy = IdlePolicy {
                after: Duration::ZERO,
                below: 5,
            };
            evaluate(&h, &snap, &owners(&a), &tracked, &policy, 0)
                .0
                .len()
        };
        assert_eq!(reclaimed(None), 0, "nobody's: never");
        assert_eq!(reclaimed(Some(1000)), 1, "the kernel names its owner");
    }

    proptest! {
        /// Whatever the readings, a process is reclaimed at a cycle only if
        /// every reading of the last `after` was known and below the
        /// threshold, with no gap; and it always is then.
        #[test]
        fn reclaimed_exactly_when_idle_for_the_whole_window(
            readings in proptest::collection::vec((proptest::option::of(0u32..20), 1u64..8), 1..40),
        ) {
            let p = proc_(7, Some("e"), &[(0, mib(100))]);
            let shared = proc_(8, Some("e"), &[(0, mib(100))]);
            let gap = Some(Duration::from_secs(300));
            let after = 10 * 60_000; // ms
            let mut h = IdleHistory::default();
            let mut now = 0u64;
            let mut since: Option<u64> = None;
            for (sm, minutes) in readings {
                let last = now;
                now += minutes * 60_000;
                let snap = match sm {
                    Some(sm) => host_with(vec![p.clone()], Some(vec![(0, 7, Some(sm))]), &[(0, sm)]),
                    None => host_with(vec![p.clone(), shared.clone()], None, &[(0, 0)]),
                };
                let tracked = h.track(&[(&HostId("h".into()), &snap)], 5, now, gap);
                let a = Attribution::of(&snap, &Default::default());
                let policy = IdlePolicy { after: Duration::from_millis(after), below: 5 };
                let (v, _) = evaluate(&HostId("h".into()), &snap, &owners(&a), &tracked, &policy, now);
                // The model: idle since the first of the consecutive low readings.
                since = match sm {
                    Some(s) if s < 5 => match since {
                        Some(t) if now - last <= 300_000 => Some(t),
                        _ => Some(now),
                    },
                    _ => None,
                };
                let want = since.is_some_and(|t| now - t >= after);
                prop_assert_eq!(v.iter().any(|v| v.actions[..] == [Action::Terminate { host: HostId("h".into()), pid: Pid(7) }]), want);
                prop_assert!(v.len() <= 1);
                h = tracked;
            }
        }
    }
}
