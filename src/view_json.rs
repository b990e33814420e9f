//! A cycle's view written as its JSON line, once a cycle, for the service
//! to serve ([`crate::view_socket`]): each host's part kept, written, from
//! the cycle before while what it is made of is the same (a steady fleet
//! costs its hosts' comparison, not their building and writing), and a
//! delta, the hosts that changed since the cycle before, for the readers
//! that take them (`top`). Pure: the line is the one serde writes for
//! [`crate::view::of`]'s view.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use hyper::body::Bytes;
use serde::Serialize;

use crate::ladder::Waiting;
use crate::model::{Cluster, Device, Env, GpuIndex, HashMap, HostId, HostSnapshot, Process};
use crate::outcome::Outcome;
use crate::report::CycleReport;
use crate::rules::Policy;
use crate::view::{
    self, ActionView, Counted, DoneView, GroupView, HostState, Press, Use, UserView, View, Why,
    RECENT, SCHEMA,
};

/// What the service keeps from cycle to cycle to write its views.
#[derive(Debug, Default)]
pub struct Writer {
    hosts: HashMap<HostId, Part>,
    /// The last cycle's number and its hosts, in order.
    last: Option<(u64, Vec<HostId>)>,
    /// Done actions of the last cycles, newest first.
    recent: VecDeque<DoneView>,
}

/// A host's part of the view as last written.
#[derive(Debug)]
struct Part {
    made_of: MadeOf,
    json: Bytes,
    users: Vec<(Arc<str>, Use)>,
}

/// What a host's part is made of: how it answered, what presses on its
/// GPUs, and what of its snapshot the view shows.
#[derive(Debug, PartialEq, Eq)]
struct MadeOf {
    state: (HostState, Option<String>),
    pressed: Vec<Press>,
    snap: Option<Shown>,
}

/// What of a host's snapshot the view shows: its jobs, its devices, its
/// environments, whether the kernel says whose a job is (else, in a
/// recording, the records do), how busy its GPUs were.
#[derive(Debug, PartialEq, Eq)]
struct Shown {
    processes: Vec<Process>,
    devices: Arc<Vec<Device>>,
    envs: Arc<Vec<Env>>,
    recorded: bool,
    utilization: Option<BTreeMap<GpuIndex, u32>>,
}

impl MadeOf {
    /// Whether it is what `state`, `pressed` and `snap` make.
    fn is(
        &self,
        state: &(HostState, Option<String>),
        pressed: &[Press],
        snap: Option<&HostSnapshot>,
    ) -> bool {
        self.state == *state
            && self.pressed == pressed
            && match (&self.snap, snap) {
                (None, None) => true,
                (Some(was), Some(s)) => {
                    was.processes == s.processes
                        && was.devices == s.devices
                        && was.envs == s.envs
                        && was.recorded == s.truth.is_none()
                        && was.utilization.as_ref() == s.utilization.as_ref().map(|u| &u.gpus)
                }
                _ => false,
            }
    }
}

impl Shown {
    /// What the view shows of `snap`.
    fn of(snap: &HostSnapshot) -> Self {
        Shown {
            processes: snap.processes.clone(),
            devices: Arc::clone(&snap.devices),
            envs: Arc::clone(&snap.envs),
            recorded: snap.truth.is_none(),
            utilization: snap.utilization.as_ref().map(|u| u.gpus.clone()),
        }
    }
}

/// A cycle's view, written: its JSON members, each host's part apart, and
/// which hosts changed since the cycle before.
#[derive(Debug, Clone)]
pub struct Written {
    pub cycle: u64,
    head: Bytes,
    hosts: Vec<Bytes>,
    /// The cycle before and the positions of the hosts changed since,
    /// where its hosts were these, in this order.
    changed: Option<(u64, Vec<usize>)>,
    rest: Bytes,
}

/// The members before the hosts.
#[derive(Serialize)]
struct Head {
    schema: u32,
    cycle: u64,
    at_ms: Option<u64>,
    dry_run: bool,
}

/// The members after the hosts, but the service's own (notifications).
#[derive(Serialize)]
struct Rest<'a> {
    users: &'a [UserView],
    #[serde(skip_serializing_if = "crate::model::is_zero")]
    counted_left_out: u32,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    groups: &'a [GroupView],
    waiting: &'a [ActionView],
    actions: &'a [ActionView],
    #[serde(skip_serializing_if = "crate::model::is_zero")]
    waiting_left_out: u32,
    #[serde(skip_serializing_if = "crate::model::is_zero")]
    actions_left_out: u32,
    #[serde(skip_serializing_if = "VecDeque::is_empty")]
    recent: &'a VecDeque<DoneView>,
}

/// `value`'s JSON object's members, without its braces (empty for an
/// object without members).
pub fn members<T: Serialize>(value: &T) -> Bytes {
    let mut json = serde_json::to_vec(value).expect("a view's part serializes");
    debug_assert!(json.first() == Some(&b'{') && json.last() == Some(&b'}'));
    json.pop();
    Bytes::from(json).slice(1..)
}

impl Writer {
    /// The view of `report`'s cycle over `cluster` (as [`view::of`]
    /// makes it), with the done actions of the cycles before, written;
    /// what each host's part is made of kept for the next cycle's
    /// comparison.
    pub fn write(
        &mut self,
        report: &CycleReport,
        cluster: &Cluster,
        counted: &[(HostId, Counted)],
        policy: &Policy,
        at_ms: Option<u64>,
    ) -> Written {
        let pressed = view::pressed(&report.violations, &report.waiting);
        let snaps = view::snapshots(cluster);
        let mut next = HashMap::with_capacity_and_hasher(report.hosts.len(), Default::default());
        let (mut hosts, mut rebuilt) = (Vec::with_capacity(report.hosts.len()), Vec::new());
        for (i, status) in report.hosts.iter().enumerate() {
            let state = view::host_state(status);
            let on = pressed.get(&status.host).map_or(&[][..], Vec::as_slice);
            let snap = snaps.get(&status.host).copied();
            let kept = self
                .hosts
                .remove(&status.host)
                .filter(|p| p.made_of.is(&state, on, snap));
            let part = kept.unwrap_or_else(|| {
                rebuilt.push(i);
                let json = serde_json::to_vec(&view::host_view(status, snap, on))
                    .expect("a host's view serializes");
                let users = snap.map(view::host_users).unwrap_or_default();
                Part {
                    made_of: MadeOf {
                        state,
                        pressed: on.to_vec(),
                        snap: snap.map(Shown::of),
                    },
                    json: Bytes::from(json),
                    users,
                }
            });
            hosts.push(part.json.clone());
            if let Some(dup) = next.insert(status.host.clone(), part) {
                // The same host twice: the first's part is kept.
                next.insert(status.host.clone(), dup);
            }
        }
        let order: Vec<HostId> = report.hosts.iter().map(|s| s.host.clone()).collect();
        let changed = match self.last.take() {
            Some((cycle, was)) if was == order => Some((cycle, rebuilt)),
            _ => None,
        };
        self.last = Some((report.cycle, order));
        let users = view::users(
            (report.hosts.iter())
                .filter_map(|s| next.get(&s.host))
                .map(|p: &Part| p.users.as_slice()),
            counted,
            policy,
        );
        self.hosts = next;
        let groups = view::groups(snaps.values().copied(), &users, policy);
        let why = Why::of(report.mode, &report.violations, &snaps);
        let (waiting, waiting_left_out) = view::per_host(&report.waiting, Waiting::host);
        let (outcomes, actions_left_out) = view::per_host(&report.outcomes, Outcome::host);
        let waiting: Vec<ActionView> = waiting.into_iter().map(|w| why.waiting(w)).collect();
        let actions: Vec<ActionView> = outcomes.iter().map(|o| why.done(o)).collect();
        // What was carried out (or tried), not what a dry run would do:
        // re-planned each cycle, it would push the history out.
        let done: Vec<&ActionView> = (outcomes.iter().zip(&actions))
            .filter(|(o, _)| !o.is_dry_run())
            .map(|(_, a)| a)
            .take(RECENT)
            .collect();
        for a in done.into_iter().rev() {
            self.recent.push_front(DoneView {
                cycle: report.cycle,
                at_ms,
                action: a.clone(),
            });
        }
        self.recent.truncate(RECENT);
        let head = Head {
            schema: SCHEMA,
            cycle: report.cycle,
            at_ms,
            dry_run: report.dry_run,
        };
        let rest = Rest {
            users: &users,
            counted_left_out: view::counted_left_out(counted),
            groups: &groups,
            waiting: &waiting,
            actions: &actions,
            waiting_left_out,
            actions_left_out,
            recent: &self.recent,
        };
        Written {
            cycle: report.cycle,
            head: members(&head),
            hosts,
            changed,
            rest: members(&rest),
        }
    }
}

impl Written {
    /// The whole view, one JSON line, with the service's own members
    /// (`extra`, as [`members`] writes them) last.
    pub fn line(&self, extra: &[u8]) -> Vec<u8> {
        let mut line = self.buffer(self.hosts.iter(), extra);
        line.push(b'{');
        line.extend_from_slice(&self.head);
        line.extend_from_slice(b",\"hosts\":[");
        for (i, h) in self.hosts.iter().enumerate() {
            if i > 0 {
                line.push(b',');
            }
            line.extend_from_slice(h);
        }
        line.extend_from_slice(b"],");
        self.close(&mut line, extra);
        line
    }

    /// The delta from the cycle before, one JSON line (a [`View`] whose
    /// `delta_of` is that cycle), where its hosts were these.
    pub fn delta(&self, extra: &[u8]) -> Option<(u64, Vec<u8>)> {
        let (base, changed) = self.changed.as_ref()?;
        let mut line = self.buffer(changed.iter().map(|i| &self.hosts[*i]), extra);
        line.extend_from_slice(format!("{{\"delta_of\":{base},").as_bytes());
        line.extend_from_slice(&self.head);
        line.extend_from_slice(b",\"hosts\":[],\"changed\":[");
        for (n, i) in changed.iter().enumerate() {
            if n > 0 {
                line.push(b',');
            }
            line.extend_from_slice(format!("[{i},").as_bytes());
            line.extend_from_slice(&self.hosts[*i]);
            line.push(b']');
        }
        line.extend_from_slice(b"],");
        self.close(&mut line, extra);
        Some((*base, line))
    }

    /// An empty line with room for `hosts` and the rest (a view of 1,000
    /// hosts is megabytes: grown by doubling, it would be copied again
    /// and again).
    fn buffer<'a>(&self, hosts: impl Iterator<Item = &'a Bytes>, extra: &[u8]) -> Vec<u8> {
        let hosts: usize = hosts.map(|h| h.len() + 24).sum();
        Vec::with_capacity(hosts + self.head.len() + self.rest.len() + extra.len() + 64)
    }

    /// The members after the hosts, `extra`, the closing brace, the end
    /// of the line.
    fn close(&self, line: &mut Vec<u8>, extra: &[u8]) {
        line.extend_from_slice(&self.rest);
        if !extra.is_empty() {
            line.push(b',');
            line.extend_from_slice(extra);
        }
        line.extend_from_slice(b"}\n");
    }
}

/// `view` as one JSON line, as the service serves it.
pub fn line_of(view: &View) -> Vec<u8> {
    let mut line = serde_json::to_vec(view).expect("a view serializes");
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::tests::{counted_on, recorded};

    /// The view `of` makes, with the done actions `recent` holds.
    fn expected(
        report: &CycleReport,
        cluster: &Cluster,
        policy: &Policy,
        recent: &[DoneView],
    ) -> View {
        let counted = counted_on(cluster, policy);
        View {
            recent: recent.to_vec(),
            ..view::of(report, cluster, &counted, policy, Some(7))
        }
    }

    fn write(w: &mut Writer, report: &CycleReport, cluster: &Cluster, policy: &Policy) -> Written {
        let counted = counted_on(cluster, policy);
        w.write(report, cluster, &counted, policy, Some(7))
    }

    fn parsed(line: &[u8]) -> View {
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1, "one line");
        serde_json::from_slice(line).unwrap()
    }

    /// `report` as if its actions had been carried out, but its first.
    fn carried_out(report: &mut CycleReport) {
        use crate::outcome::{DetachResult, Outcome, TerminateResult};
        for o in report.outcomes.iter_mut().skip(1) {
            match o {
                Outcome::Terminate { outcome, .. } | Outcome::Kill { outcome, .. } => {
                    *outcome = TerminateResult::Signalled;
                }
                Outcome::Detach { outcome, .. } => *outcome = DetachResult::Detached,
            }
        }
    }

    /// Each cycle's line is the one serde writes for the view `of` makes,
    /// byte for byte, the actions carried out in the cycles before in it
    /// (not a dry run's).
    #[test]
    fn the_line_is_the_views_own() {
        let (mut report, cluster, policy) = recorded();
        carried_out(&mut report);
        let mut w = Writer::default();
        let first = write(&mut w, &report, &cluster, &policy);
        assert!(first.delta(b"").is_none(), "no cycle before");
        assert!(report.outcomes[0].is_dry_run());
        let recent: Vec<DoneView> = (report.outcomes.iter().skip(1))
            .map(|o| DoneView {
                cycle: 1,
                at_ms: Some(7),
                action: view::Why::of(report.mode, &report.violations, &view::snapshots(&cluster))
                    .done(o),
            })
            .collect();
        assert!(!recent.is_empty());
        let want = expected(&report, &cluster, &policy, &recent);
        assert_eq!(
            String::from_utf8(first.line(b"")).unwrap(),
            String::from_utf8(line_of(&want)).unwrap()
        );
        report.cycle = 2;
        let second = write(&mut w, &report, &cluster, &policy);
        let mut both: Vec<DoneView> = recent
            .iter()
            .map(|d| DoneView {
                cycle: 2,
                ..d.clone()
            })
            .collect();
        both.extend(recent);
        assert_eq!(
            parsed(&second.line(b"")),
            expected(&report, &cluster, &policy, &both)
        );
    }

    /// A flood of actions on one host (thousands of records make as many)
    /// is bounded, the rest counted, the other hosts' all listed; the
    /// line is still the view's own.
    #[test]
    fn a_flood_of_actions_on_a_host_is_bounded_and_counted() {
        use crate::ladder::Waiting;
        let (mut report, cluster, policy) = recorded();
        let first = report.outcomes[0].clone();
        let Outcome::Terminate { host, .. } = &first else {
            panic!("a termination first")
        };
        let host = host.clone();
        for pid in 100_000..100_300 {
            let mut o = first.clone();
            if let Outcome::Terminate { pid: p, .. } = &mut o {
                *p = crate::model::Pid(pid);
            }
            report.outcomes.push(o);
            report.waiting.push(Waiting::Terminate {
                host: host.clone(),
                pid: crate::model::Pid(pid),
                seen: 1,
                needed: 2,
                deadline_ms: None,
                warn_only: false,
                exempt: None,
            });
        }
        let on = |o: &&Outcome| o.host() == &host;
        let (there, elsewhere) = (
            report.outcomes.iter().filter(on).count(),
            report.outcomes.iter().filter(|o| !on(o)).count(),
        );
        assert!(elsewhere > 0);
        let mut w = Writer::default();
        let line = write(&mut w, &report, &cluster, &policy).line(b"");
        let want = expected(&report, &cluster, &policy, &[]);
        assert_eq!(
            String::from_utf8(line.clone()).unwrap(),
            String::from_utf8(line_of(&want)).unwrap()
        );
        let view = parsed(&line);
        assert_eq!(view.actions.len(), view::MAX_HOST_ACTIONS + elsewhere);
        assert_eq!(
            view.actions_left_out as usize,
            there - view::MAX_HOST_ACTIONS
        );
        assert_eq!(view.waiting.len(), view::MAX_HOST_ACTIONS);
        assert_eq!(view.waiting_left_out as usize, 300 - view::MAX_HOST_ACTIONS);
        let text = crate::view_text::text(&view, 0);
        assert!(text.contains("and 44 more (over 256 a host)"), "{text}");
    }

    /// Users left out of the caps' counts are summed over hosts, in the
    /// line as in the view `of` makes.
    #[test]
    fn users_left_out_of_the_counts_are_summed_and_said() {
        let (report, cluster, policy) = recorded();
        let mut counted = crate::view::tests::counted_on(&cluster, &policy);
        for (k, (_, c)) in counted.iter_mut().enumerate() {
            c.left_out = 3 + k as u32;
        }
        let n = counted.len() as u32;
        let line = Writer::default()
            .write(&report, &cluster, &counted, &policy, Some(7))
            .line(b"");
        let want = view::of(&report, &cluster, &counted, &policy, Some(7));
        assert_eq!(want.counted_left_out, 3 * n + n * (n - 1) / 2);
        assert_eq!(
            String::from_utf8(line).unwrap(),
            String::from_utf8(line_of(&want)).unwrap()
        );
    }

    /// A host whose part is made of the same is kept as written (the same
    /// bytes); one that changed is written again, and the delta holds it
    /// alone, applying to the view before to make this one.
    #[test]
    fn an_unchanged_host_is_kept_and_the_delta_holds_the_changed_one() {
        let (mut report, mut cluster, policy) = recorded();
        let mut w = Writer::default();
        let first = write(&mut w, &report, &cluster, &policy);
        report.cycle = 2;
        let p = &mut cluster.hosts[1].1.processes[0];
        let u = p.gpus[0].usage;
        p.gpus[0].usage = crate::model::Usage::Known(u.bytes().unwrap_or(0) + (1 << 20));
        let second = write(&mut w, &report, &cluster, &policy);
        let moved = (first.hosts.iter().zip(&second.hosts))
            .map(|(a, b)| a.as_ptr() != b.as_ptr())
            .collect::<Vec<_>>();
        assert_eq!(moved, [false, true, false]);
        let (base, delta) = second.delta(b"").unwrap();
        assert_eq!(base, 1);
        let d = parsed(&delta);
        assert_eq!(d.delta_of, Some(1));
        assert!(d.hosts.is_empty());
        assert_eq!(d.changed.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1]);
        let mut view = parsed(&first.line(b""));
        view.apply(d).unwrap();
        assert_eq!(view, parsed(&second.line(b"")));
        // Nothing changed: an empty delta.
        report.cycle = 3;
        let third = write(&mut w, &report, &cluster, &policy);
        assert!(parsed(&third.delta(b"").unwrap().1).changed.is_empty());
    }

    /// Two hosts changed: both in the delta, one line that reads back; a
    /// host that failed, and fails still, is kept as written.
    #[test]
    fn a_delta_of_two_hosts_and_a_host_that_fails_still() {
        let (mut report, mut cluster, policy) = recorded();
        crate::view::tests::gpu2_failed(&mut report, &mut cluster, "unreachable");
        let mut w = Writer::default();
        let first = write(&mut w, &report, &cluster, &policy);
        report.cycle = 2;
        let second = write(&mut w, &report, &cluster, &policy);
        assert_eq!(first.hosts[1].as_ptr(), second.hosts[1].as_ptr(), "kept");
        report.cycle = 3;
        for (_, s) in cluster.hosts.iter_mut() {
            s.processes.pop();
        }
        let third = write(&mut w, &report, &cluster, &policy);
        let d = parsed(&third.delta(b"").unwrap().1);
        assert_eq!(
            d.changed.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 2]
        );
        let mut view = parsed(&second.line(b""));
        view.apply(d).unwrap();
        assert_eq!(view, parsed(&third.line(b"")));
    }

    /// What presses on a host (a wait on one of its jobs) is its part's
    /// too: the host is written again.
    #[test]
    fn a_wait_on_a_host_writes_it_again() {
        let (mut report, cluster, policy) = recorded();
        let mut w = Writer::default();
        let first = write(&mut w, &report, &cluster, &policy);
        let before = parsed(&first.line(b""));
        let (host, pid) = (cluster.hosts.iter().enumerate())
            .find_map(|(i, (h, s))| {
                let p = s.processes.iter().find(|p| {
                    let g = &before.hosts[i].gpus;
                    g.iter().any(|g| {
                        g.state == view::GpuState::InEnv
                            && g.processes.iter().any(|q| q.pid == p.pid.0)
                    })
                })?;
                Some((h.clone(), p.pid))
            })
            .expect("a job at work");
        report.cycle = 2;
        report.waiting.push(crate::ladder::Waiting::Terminate {
            host: host.clone(),
            pid,
            seen: 1,
            needed: 2,
            deadline_ms: None,
            warn_only: false,
            exempt: None,
        });
        let second = write(&mut w, &report, &cluster, &policy);
        let d = parsed(&second.delta(b"").unwrap().1);
        let at = report.hosts.iter().position(|s| s.host == host).unwrap();
        assert_eq!(d.changed.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [at]);
        assert!(d.changed[0]
            .1
            .gpus
            .iter()
            .any(|g| g.state == view::GpuState::Waiting));
        assert_eq!(
            parsed(&second.line(b"")),
            expected(
                &report,
                &cluster,
                &policy,
                &parsed(&second.line(b"")).recent
            )
        );
    }

    /// Hosts added, gone or moved: no delta, the whole view.
    #[test]
    fn another_host_list_has_no_delta() {
        let (mut report, cluster, policy) = recorded();
        let mut w = Writer::default();
        write(&mut w, &report, &cluster, &policy);
        report.cycle = 2;
        report.hosts.swap(0, 1);
        let second = write(&mut w, &report, &cluster, &policy);
        assert!(second.delta(b"").is_none());
        assert_eq!(parsed(&second.line(b"")).hosts[0].host, "gpu2");
    }

    /// The service's own members close the line, and the delta.
    #[test]
    fn the_services_members_are_in_the_line() {
        let (mut report, cluster, policy) = recorded();
        let mut w = Writer::default();
        write(&mut w, &report, &cluster, &policy);
        report.cycle = 2;
        let second = write(&mut w, &report, &cluster, &policy);
        #[derive(Serialize)]
        struct Extra {
            notifications: Vec<view::ChannelView>,
        }
        let channel = view::ChannelView {
            channel: "mail".into(),
            queued: 2,
            held_back: 3,
            dropped: 0,
            last: Vec::new(),
        };
        let extra = members(&Extra {
            notifications: vec![channel.clone()],
        });
        let notified = parsed(&second.line(&extra)).notifications;
        assert_eq!(notified, std::slice::from_ref(&channel));
        assert_eq!(
            parsed(&second.delta(&extra).unwrap().1).notifications,
            [channel]
        );
        assert_eq!(
            &members(&Extra {
                notifications: Vec::new()
            })[..],
            b"\"notifications\":[]"
        );
    }
}
