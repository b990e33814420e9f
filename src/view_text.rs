//! `status`'s words: a [`View`] as a few lines per host, user and action,
//! for a terminal or an SSH session. Pure: the time it is read at is
//! given (for each deadline's countdown).

use std::fmt::Write;

use crate::report::clean as c;
use crate::view::{ActionView, GpuState, HostState, View, MAX_HOST_ACTIONS};

/// `view` as read at `now` (ms since the Unix epoch).
pub fn text(view: &View, now: u64) -> String {
    let mut out = String::new();
    let at = view.at_ms.map_or_else(
        || "a replay".to_string(),
        |ms| {
            // RFC 3339 ends with the year 9999 (a view from elsewhere may
            // say anything).
            if ms >= 253_402_300_800_000 {
                return format!("at {ms} ms");
            }
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
            format!(
                "{} ({} ago)",
                humantime::format_rfc3339_seconds(t),
                span(now.saturating_sub(ms))
            )
        },
    );
    let dry = if view.dry_run {
        ", dry run: nothing is carried out"
    } else {
        ""
    };
    let _ = writeln!(out, "cycle {}, {at}{dry}", view.cycle);
    let count = |s: HostState| view.hosts.iter().filter(|h| h.state == s).count();
    let _ = writeln!(
        out,
        "\nhosts: {} ({} ok, {} degraded, {} failed)",
        view.hosts.len(),
        count(HostState::Ok),
        count(HostState::Degraded),
        count(HostState::Failed)
    );
    for h in &view.hosts {
        let state = match h.state {
            HostState::Ok => "ok",
            HostState::Degraded => "degraded",
            HostState::Failed => "failed",
        };
        let why = h
            .why
            .as_ref()
            .map(|w| format!(": {}", c(w)))
            .unwrap_or_default();
        let _ = writeln!(out, "  {} {state}{why}", c(&h.host));
        for g in &h.gpus {
            let state = match g.state {
                GpuState::Free => "free",
                GpuState::InEnv => "in an environment",
                GpuState::Idle => "idle",
                GpuState::Stray => "a stray",
                GpuState::Violating => "violating",
                GpuState::Waiting => "an action waits",
            };
            let envs = if g.envs.is_empty() {
                String::new()
            } else {
                format!(" [{}]", c(&g.envs_listed()))
            };
            let busy = g
                .utilization_percent
                .map(|u| format!(", {u}% busy"))
                .unwrap_or_default();
            let used = if g.processes.is_empty() {
                String::new()
            } else {
                format!(",{} held{busy}", mib(g.memory_bytes))
            };
            let more = g.envs_more();
            let _ = writeln!(out, "    gpu {} {state}{envs}{more}{used}", g.index);
            for p in &g.processes {
                let user = c(p.user.as_deref().unwrap_or("?"));
                let env = c(p.env.as_deref().unwrap_or("no environment"));
                let mem = p.memory_bytes.map(mib).unwrap_or_default();
                let _ = writeln!(out, "      pid {} {user} ({env}){mem}", p.pid);
            }
        }
        if let Some(more) = h.gpus_more() {
            let _ = writeln!(out, "    {more}");
        }
        for e in &h.envs {
            let _ = writeln!(out, "    env {}: {}", c(&e.env), c(&e.words()));
        }
        if let Some(more) = h.envs_more() {
            let _ = writeln!(out, "    {more}");
        }
    }
    if !view.users.is_empty() {
        let _ = writeln!(out, "\nusers:");
    }
    for u in &view.users {
        let cap = u.device_cap.map(|n| format!(" of {n}")).unwrap_or_default();
        let mem_cap = u
            .memory_cap
            .map(|n| format!(" of{}", mib(n)))
            .unwrap_or_default();
        let counted = match (u.counted, u.counted_idle) {
            (Some(n), Some(idle)) if idle > 0 => format!(", counted {n}{cap} ({idle} held idle)"),
            (Some(n), _) => format!(", counted {n}{cap}"),
            (None, _) => String::new(),
        };
        let cap = if u.counted.is_some() { "" } else { &cap };
        let _ = writeln!(
            out,
            "  {} {} GPU(s) in use{cap}{counted},{}{mem_cap}, {} process(es)",
            c(&u.user),
            u.devices,
            mib(u.memory_bytes),
            u.processes
        );
    }
    if let Some(more) = view.counted_left_out_said() {
        let _ = writeln!(out, "  {more}");
    }
    if !view.groups.is_empty() {
        let _ = writeln!(out, "\ngroups:");
    }
    for g in &view.groups {
        let users: Vec<_> = g.users.iter().map(|u| c(u)).collect();
        let _ = writeln!(
            out,
            "  {} {} GPU(s) of {}: {}",
            c(&g.group),
            g.devices,
            g.device_cap,
            users.join(", ")
        );
    }
    for (title, actions, left_out) in [
        ("waiting", &view.waiting, view.waiting_left_out),
        ("actions", &view.actions, view.actions_left_out),
    ] {
        if actions.is_empty() && left_out == 0 {
            continue;
        }
        let _ = writeln!(out, "\n{title}:");
        for a in actions {
            let _ = writeln!(out, "  {}", action(a, now));
        }
        if left_out > 0 {
            let _ = writeln!(
                out,
                "  and {left_out} more (over {MAX_HOST_ACTIONS} a host)"
            );
        }
    }
    // The cycles before this one: its own actions are above.
    let before = view.recent.iter().filter(|d| d.cycle != view.cycle);
    for (i, d) in before.take(RECENT_SHOWN).enumerate() {
        if i == 0 {
            let _ = writeln!(out, "\nrecent actions:");
        }
        let ago = d
            .at_ms
            .map(|at| format!(", {} ago", span(now.saturating_sub(at))))
            .unwrap_or_default();
        let _ = writeln!(out, "  cycle {}{ago}: {}", d.cycle, action(&d.action, now));
    }
    for ch in &view.notifications {
        let _ = writeln!(
            out,
            "\nnotifications by {}: {} queued, {} held back, {} dropped",
            c(&ch.channel),
            ch.queued,
            ch.held_back,
            ch.dropped
        );
        for h in &ch.last {
            let to = if h.to.is_empty() { "the admins" } else { &h.to };
            let _ = writeln!(
                out,
                "  {} ago to {}: {}: {}",
                span(now.saturating_sub(h.at_ms)),
                c(to),
                c(&h.what),
                c(&h.why)
            );
        }
    }
    out
}

/// How many of the recent actions of the cycles before `status` prints.
const RECENT_SHOWN: usize = 20;

/// One action on a line, its reasons after.
fn action(a: &ActionView, now: u64) -> String {
    let what = a.target.words();
    let of = a
        .owner
        .as_ref()
        .map(|o| format!(" of {}", c(o)))
        .unwrap_or_default();
    let mut line = format!("{} {what}{of} ({})", c(&a.host), c(&a.rules.join(", ")));
    if let Some(d) = a.deadline_ms {
        let _ = match d.checked_sub(now) {
            Some(left) if left > 0 => write!(line, ", due in {}", span(left)),
            _ => write!(line, ", due now"),
        };
    }
    if let Some((seen, needed)) = a.seen {
        let _ = write!(line, ", seen {seen} of {needed} cycles");
    }
    if a.warn_only {
        line.push_str(", warned only");
    }
    if let Some(why) = &a.exempt {
        let _ = write!(line, ", exempt: {}", c(why));
    }
    if let Some(r) = &a.result {
        let _ = write!(line, ": {}", c(r));
    }
    for why in &a.why {
        let _ = write!(line, "\n    {}", c(why));
    }
    line
}

/// A span to the second (`4m12s`).
pub(crate) fn span(ms: u64) -> String {
    humantime::format_duration(std::time::Duration::from_secs(ms / 1000))
        .to_string()
        .replace(' ', "")
}

/// ` 1234 MiB`.
fn mib(bytes: u64) -> String {
    format!(" {} MiB", bytes >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::*;

    #[test]
    fn a_view_in_words_with_its_countdowns() {
        let view = View {
            schema: SCHEMA,
            cycle: 7,
            at_ms: Some(1_000_000),
            dry_run: false,
            hosts: vec![
                HostView {
                    host: "h1".into(),
                    state: HostState::Ok,
                    why: None,
                    envs: vec![EnvView {
                        env: "a".into(),
                        user: Some("bob".into()),
                        devices: vec![0],
                        devices_left_out: 1,
                        gpu_memory: Some("4gi".into()),
                        pids: Vec::new(),
                    }],
                    envs_left_out: 2,
                    gpus_left_out: 3,
                    gpus: vec![GpuView {
                        index: 0,
                        state: GpuState::Waiting,
                        envs: vec!["a".into()],
                        envs_left_out: 1,
                        memory_bytes: 3 << 20,
                        utilization_percent: Some(40),
                        processes: vec![ProcessView {
                            pid: 42,
                            user: Some("bob".into()),
                            env: None,
                            memory_bytes: Some(3 << 20),
                        }],
                    }],
                },
                HostView {
                    host: "h2".into(),
                    state: HostState::Failed,
                    why: Some("unreachable".into()),
                    gpus: Vec::new(),
                    envs: Vec::new(),
                    envs_left_out: 0,
                    gpus_left_out: 0,
                },
            ],
            groups: vec![GroupView {
                group: "lab".into(),
                devices: 1,
                device_cap: 4,
                users: vec!["bob".into()],
            }],
            users: vec![UserView {
                user: "bob".into(),
                devices: 1,
                memory_bytes: 3 << 20,
                processes: 1,
                counted: Some(2),
                counted_idle: Some(1),
                device_cap: Some(1),
                memory_cap: None,
            }],
            waiting: vec![ActionView {
                host: "h1".into(),
                target: Target::Terminate { pid: 42 },
                owner: Some("bob".into()),
                rules: vec!["non-env-processes".into()],
                why: vec!["pid 42 runs outside any environment".into()],
                deadline_ms: Some(1_000_000 + 252_000),
                warn_only: false,
                exempt: None,
                seen: None,
                result: None,
            }],
            actions: vec![ActionView {
                host: "h1".into(),
                target: Target::Detach {
                    device: 1,
                    env: "b".into(),
                },
                owner: None,
                rules: vec!["env-devices".into()],
                why: Vec::new(),
                deadline_ms: None,
                warn_only: false,
                exempt: None,
                seen: Some((1, 2)),
                result: Some("detached".into()),
            }],
            counted_left_out: 5,
            waiting_left_out: 0,
            actions_left_out: 3,
            recent: vec![DoneView {
                cycle: 5,
                at_ms: Some(940_000),
                action: ActionView {
                    host: "h1".into(),
                    target: Target::Terminate { pid: 41 },
                    owner: Some("bob".into()),
                    rules: vec!["non-env-processes".into()],
                    why: Vec::new(),
                    deadline_ms: None,
                    warn_only: false,
                    exempt: None,
                    seen: None,
                    result: Some("signalled".into()),
                },
            }],
            notifications: vec![ChannelView {
                channel: "mail".into(),
                queued: 1,
                held_back: 2,
                dropped: 0,
                last: vec![HeldBackView {
                    at_ms: 1_000_000,
                    to: "bob".into(),
                    what: "[genv-enforce] h1: process 43 breaks non-env-processes".into(),
                    why: "rate limited: 3 messages an hour to bob about their jobs (--notify-rate)"
                        .into(),
                }],
            }],
            delta_of: None,
            changed: Vec::new(),
        };
        insta::assert_snapshot!(text(&view, 1_010_000));
        assert!(text(&view, 2_000_000).contains("due now"));
        let replay = View {
            at_ms: None,
            dry_run: true,
            ..view
        };
        assert!(text(&replay, 0).starts_with("cycle 7, a replay, dry run"));
    }

    /// What users write (environment ids, user names, the report's lines)
    /// cannot drive the admin's terminal nor forge a line.
    #[test]
    fn what_users_write_is_escaped() {
        let evil = "a\u{1b}]0;owned\u{7}\n  pid 1 root (x)";
        let view = View {
            schema: SCHEMA,
            cycle: 1,
            at_ms: None,
            dry_run: true,
            hosts: vec![HostView {
                host: "h".into(),
                state: HostState::Ok,
                why: None,
                envs: vec![EnvView {
                    env: evil.into(),
                    user: Some(evil.into()),
                    devices: vec![0],
                    devices_left_out: 0,
                    gpu_memory: Some(evil.into()),
                    pids: vec![1],
                }],
                envs_left_out: 0,
                gpus_left_out: 0,
                gpus: vec![GpuView {
                    index: 0,
                    state: GpuState::InEnv,
                    envs: vec![evil.into()],
                    envs_left_out: 0,
                    memory_bytes: 0,
                    utilization_percent: None,
                    processes: vec![ProcessView {
                        pid: 1,
                        user: Some(evil.into()),
                        env: Some(evil.into()),
                        memory_bytes: None,
                    }],
                }],
            }],
            users: Vec::new(),
            groups: Vec::new(),
            waiting: Vec::new(),
            actions: vec![ActionView {
                host: "h".into(),
                target: Target::Detach {
                    device: 0,
                    env: evil.into(),
                },
                owner: None,
                rules: vec!["env-devices".into()],
                why: vec![evil.into()],
                deadline_ms: None,
                warn_only: false,
                exempt: Some(evil.into()),
                seen: None,
                result: Some(evil.into()),
            }],
            counted_left_out: 0,
            waiting_left_out: 0,
            actions_left_out: 0,
            recent: Vec::new(),
            notifications: vec![ChannelView {
                channel: evil.into(),
                queued: 0,
                held_back: 1,
                dropped: 0,
                last: vec![HeldBackView {
                    at_ms: 0,
                    to: evil.into(),
                    what: evil.into(),
                    why: evil.into(),
                }],
            }],
            delta_of: None,
            changed: Vec::new(),
        };
        let mut view = view;
        view.recent = vec![DoneView {
            cycle: 0,
            at_ms: Some(u64::MAX),
            action: view.actions[0].clone(),
        }];
        view.actions[0].rules = vec![evil.into()];
        view.at_ms = Some(u64::MAX);
        let out = text(&view, 0);
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out}");
        let forged = |l: &str| l.trim_start().starts_with("pid 1 root");
        assert!(!out.lines().any(forged), "{out}");
    }
}
