//! Renders a cycle as genv's text lines or as one JSON object.
//!
//! stdout carries exactly the lines genv prints (violations, then each
//! host's `Terminating ...` and `Detaching ...` lines); our additions
//! (warnings, outcomes, host errors) go to stderr in genv's `[LEVEL]` style.
//! Nothing here decides anything.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::assess::Assessment;
pub use crate::assess::HostStatus;
use crate::ladder::{Event, Stage, Waiting, What};
use crate::model::{comma_list, Cluster, HostId, Mode};
use crate::outcome::{self, Outcome};
use crate::plan::{Detach, Plan, Termination};
use crate::rules::attribution::{Stray, Unconfirmed};
use crate::rules::{Finding, Notice, Violation};
use crate::snapshot::memory::megabytes;

/// Everything one cycle found and did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CycleReport {
    pub cycle: u64,
    pub mode: Mode,
    pub dry_run: bool,
    pub hosts: Vec<HostStatus>,
    pub notices: Vec<Notice>,
    /// Serialized by [`render_json`] with each violation's message.
    #[serde(skip)]
    pub violations: Vec<Violation>,
    pub plan: Plan,
    /// `--confirm-cycles`: actions whose violation is not yet confirmed.
    #[serde(
        rename = "awaiting_confirmation",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub waiting: Vec<Waiting>,
    /// Warned, acted on, cleared: each once per action (`--grace`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<Event>,
    /// Who uses what, per host and user (kept by `--state-db`).
    #[serde(skip)]
    pub usage: Vec<Sample>,
    /// Actions carried out at once (no grace, nothing waits: no ladder
    /// events), as `acted` events, for notifications only.
    #[serde(skip)]
    pub at_once: Vec<Event>,
    pub outcomes: Vec<Outcome>,
    /// Wall time of the cycle (none for a replay).
    pub duration_ms: Option<u64>,
    /// Where the cycle's time went (none for a replay).
    pub timing: Option<Timing>,
}

impl CycleReport {
    /// The report of a cycle: what it found and decided, what was done
    /// (in plan order), and where its time went.
    pub fn new(a: Assessment, outcomes: Vec<Outcome>, timing: Option<Timing>) -> Self {
        CycleReport {
            cycle: a.cycle,
            mode: a.mode,
            dry_run: a.dry_run,
            hosts: a.hosts,
            notices: a.notices,
            violations: a.violations,
            outcomes: {
                // Kills (`--kill-after`) follow every planned action.
                let (kills, planned) = outcomes
                    .into_iter()
                    .partition(|o| matches!(o, Outcome::Kill { .. }));
                let mut ordered = outcome::in_plan_order(&a.plan, planned);
                ordered.extend::<Vec<Outcome>>(kills);
                ordered
            },
            plan: a.plan,
            waiting: a.waiting,
            events: Vec::new(),
            usage: Vec::new(),
            at_once: Vec::new(),
            duration_ms: timing.as_ref().map(|t| t.total_ms),
            timing,
        }
    }

    /// Whether it shows a failure (exit status 1): a host or an action
    /// failed, or a host's genv state could not be used (degraded).
    pub fn failed(&self) -> bool {
        self.hosts
            .iter()
            .any(|h| h.error.is_some() || h.degraded.is_some())
            || self.outcomes.iter().any(Outcome::is_error)
    }
}

/// One line that sums a cycle up, for the text output's stderr.
pub fn summary_line(r: &CycleReport) -> String {
    let failed = r.hosts.iter().filter(|h| h.error.is_some()).count();
    let degraded = r.hosts.iter().filter(|h| h.degraded.is_some()).count();
    let degraded = if degraded > 0 {
        format!(" ({degraded} degraded)")
    } else {
        String::new()
    };
    let sum = |f: fn(&HostStatus) -> usize| r.hosts.iter().map(f).sum::<usize>();
    let acted = r.outcomes.len();
    let action_errors = r.outcomes.iter().filter(|o| o.is_error()).count();
    let actions = if r.dry_run {
        format!("{acted} actions planned (dry run)")
    } else if action_errors > 0 {
        format!("{acted} actions ({action_errors} failed)")
    } else {
        format!("{acted} actions")
    };
    let took = r
        .duration_ms
        .map_or_else(String::new, |ms| format!(" in {ms} ms"));
    format!(
        "[SUMMARY] cycle {}: {} hosts ok{degraded}, {failed} failed; {} GPUs, {} processes, {} environments; {} violations; {actions}{took}",
        r.cycle,
        r.hosts.len() - failed,
        sum(|h| h.devices),
        sum(|h| h.processes),
        sum(|h| h.envs),
        r.violations.len(),
    )
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// genv's lines on stdout; warnings and errors on stderr.
    Text,
    /// One JSON object per cycle on stdout.
    Json,
}

/// Where one cycle's time went, phase by phase (milliseconds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Timing {
    /// SSH masters opened this cycle, and the longest of those handshakes.
    pub connects: usize,
    pub connect_ms: u64,
    /// All hosts' snapshots (handshakes included), and what each host's own
    /// snapshot decided, enforced right after it.
    pub snapshot_ms: u64,
    /// The host whose snapshot took longest, and how long.
    pub slowest_host: Option<HostId>,
    pub slowest_ms: u64,
    /// Rules and plan over the merged snapshots.
    pub assess_ms: u64,
    /// What could only be done once every host had answered.
    pub dispatch_ms: u64,
    pub total_ms: u64,
    /// Each host's snapshot time (for metrics; the JSON has the slowest).
    #[serde(skip)]
    pub hosts_ms: Vec<(HostId, u64)>,
}

/// Text for the two output streams.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Text {
    pub stdout: Vec<String>,
    pub stderr: Vec<String>,
}

/// Whether a terminal could take `c` for something else than a glyph:
/// control characters (ESC, CR, LF, C1 controls such as CSI), bidi
/// overrides, zero-width and unassigned characters.
fn unprintable(c: char) -> bool {
    !matches!(c, '\\' | '"' | '\'') && c.escape_debug().next() == Some('\\')
}

/// Text a user or a host chose (eids, usernames, reasons) made safe to
/// print: if it holds anything [`unprintable`], all of it is escaped as
/// Rust's `escape_debug` does, so that it cannot forge or break output
/// lines nor drive the terminal. Bytes that were not UTF-8 arrive here as
/// U+FFFD.
pub fn clean(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(unprintable) {
        text.escape_debug().to_string().into()
    } else {
        text.into()
    }
}

/// JSON text made safe for a terminal too: serde escapes C0 controls in
/// strings but not DEL, C1 controls or bidi overrides; they become `\uXXXX`
/// here (outside strings JSON is ASCII, so this changes strings only).
pub fn json_safe(json: String) -> String {
    if !json.chars().any(unprintable) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if unprintable(c) {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn prefix(mode: Mode, host: &HostId) -> String {
    match mode {
        Mode::Local => String::new(),
        Mode::Remote => format!("[{host}] "),
    }
}

/// Bytes in genv's spelling of MiB, rounded up (`1500mi`).
fn mebibytes(bytes: u64) -> String {
    format!("{}mi", bytes.div_ceil(1 << 20))
}

/// genv's message for a violation.
pub fn violation_line(mode: Mode, v: &Violation) -> String {
    match &v.finding {
        Finding::NonEnvProcess { host, pid } => {
            format!("{}Process {pid} is not running in a GPU environment", prefix(mode, host))
        }
        Finding::OrphanedEnvProcess { host, pid, eid, user } => format!(
            "{}Process {pid}{} carries environment {}, which does not exist: it is not running in a GPU environment",
            prefix(mode, host),
            user.as_deref().map_or(String::new(), |u| format!(" (user {})", clean(u))),
            clean(&eid.0)
        ),
        Finding::NonAttachedDevices { host, pid, eid, devices } => format!(
            "{}Process {pid} from environment {} is using non-attached GPU(s) {}",
            prefix(mode, host),
            clean(&eid.0),
            comma_list(devices)
        ),
        Finding::EnvMemory { host, eid, device, used, over, capacity } => format!(
            "{}Environment {} is using {}m on device {device} which is {}m over its capacity of {}",
            prefix(mode, host),
            clean(&eid.0),
            megabytes(*used),
            megabytes(*over),
            clean(capacity)
        ),
        Finding::MaxDevices { user, devices, hosts, over } => match mode {
            Mode::Remote => format!(
                "User {} is using {devices} devices on {hosts} hosts which is {over} more than the maximum allowed",
                clean(user)
            ),
            Mode::Local => {
                format!("User {} is using {devices} devices which is {over} more than the maximum allowed", clean(user))
            }
        },
        Finding::MaxGroupDevices { group, devices, cap, over } => format!(
            "Group {} is using {devices} devices which is {over} more than its maximum of {cap}",
            clean(group)
        ),
        Finding::MaxMemory { user, used, cap, over, hosts } => format!(
            "User {} is using {} of GPU memory{} which is {} more than the maximum of {}",
            clean(user),
            mebibytes(*used),
            match mode {
                Mode::Remote => format!(" on {hosts} hosts"),
                Mode::Local => String::new(),
            },
            mebibytes(*over),
            mebibytes(*cap)
        ),
        Finding::Idle { host, pid, user, devices, idle_ms, below, source, .. } => format!(
            "{}Process {pid}{} holds GPU memory on GPU(s) {} and has been below {below}% utilization{} for {}",
            prefix(mode, host),
            user.as_deref().map_or(String::new(), |u| format!(" of user {}", clean(u))),
            comma_list(devices),
            match source {
                crate::rules::idle::Source::Process => "",
                crate::rules::idle::Source::Gpu => " (its GPU's, which it has to itself: pmon has no figure for it)",
                crate::rules::idle::Source::Mps => " (a CUDA MPS client: its MPS server's figure, or its idle GPU's; pmon shows a client's work on its server's line)",
            },
            humantime::format_duration(std::time::Duration::from_secs(idle_ms / 1000))
        ),
    }
}

/// genv's line for a termination.
pub fn termination_line(t: &Termination) -> String {
    format!(
        "Terminating process {} from environment {} that is running on GPU(s) {}",
        t.pid,
        t.eid.as_ref().map_or("N/A".into(), |e| clean(&e.0)),
        comma_list(&t.gpus)
    )
}

/// genv's line for a detach.
pub fn detach_line(d: &Detach) -> String {
    format!(
        "Detaching environment {} of user {} from device {}",
        clean(&d.eid.0),
        clean(d.username.as_deref().unwrap_or("N/A")),
        d.device
    )
}

/// Our line for a notice (stderr).
pub fn notice_line(mode: Mode, n: &Notice) -> String {
    match n {
        Notice::UnknownOwner { host, pid, gpus, reason } => format!(
            "{}[WARNING] Process {pid} on GPU(s) {} has unknown ownership ({}); it is not terminated",
            prefix(mode, host),
            comma_list(gpus),
            clean(reason)
        ),
        Notice::Stray { host, pid, eid, user, gpus, why, .. } => format!(
            "{}[WARNING] Process {pid}{} on GPU(s) {} carries environment {}, {}: it is left alone",
            prefix(mode, host),
            user.as_deref().map_or(String::new(), |u| format!(" (user {})", clean(u))),
            comma_list(gpus),
            clean(&eid.0),
            match why {
                Stray::Orphaned => "which does not exist (its record is gone)".to_string(),
                Stray::Reclaimed => {
                    "whose record was gone when it was first seen; one that appeared since is not its own"
                        .to_string()
                }
                Stray::Contested { users } => format!(
                    "which processes of several users carry ({}): it is nobody's",
                    list(users)
                ),
            }
        ),
        Notice::UnmeasuredUsage { host, pid, eid, device } => format!(
            "{}[WARNING] Memory usage of process {pid} from environment {} on device {device} is unknown to nvidia-smi; it is not counted against the capacity",
            prefix(mode, host),
            clean(&eid.0)
        ),
        Notice::Recharged { host, eid, recorded, charged } => format!(
            "{}[WARNING] Environment {} is recorded as {} but its processes are {}'s: its devices count toward {}'s cap",
            prefix(mode, host),
            clean(&eid.0),
            recorded.as_deref().map_or("nobody's".into(), |r| format!("{}'s", clean(r))),
            clean(charged),
            clean(charged)
        ),
        Notice::Uncharged { host, eid, recorded, why } => format!(
            "{}[WARNING] Environment {} (recorded user {}) counts toward no user's device cap: {}",
            prefix(mode, host),
            clean(&eid.0),
            clean(recorded.as_deref().unwrap_or("N/A")),
            match why {
                Unconfirmed::Nameless => "it names no user".to_string(),
                Unconfirmed::Duplicate => "another record has its id".to_string(),
                Unconfirmed::Contested { users } => format!(
                    "processes of several users carry it ({})",
                    list(users)
                ),
            }
        ),
        Notice::ExcessKept { user, left } => format!(
            "[WARNING] User {} stays {left} over the device cap: the rest is held by jobs of theirs that cannot be terminated (their start time or environ unknown), or by environments whose id several users' jobs carry, which are never detached for a cap",
            clean(user)
        ),
        Notice::GroupExcessKept { group, left } => format!(
            "[WARNING] Group {} stays {left} over its device cap: the rest is held by jobs of its members that cannot be terminated (their start time or environ unknown), or by environments whose id several users' jobs carry, which are never detached for a cap",
            clean(group)
        ),
        Notice::MemoryExcessKept { user, left } => format!(
            "[WARNING] User {} stays {} over the memory cap: the rest is held by processes whose usage or start time is unknown, which are never terminated for a cap",
            clean(user),
            mebibytes(*left)
        ),
        Notice::UnownedMemory { host, device, pid, bytes } => format!(
            "{}[WARNING] {} GPU memory on device {device} is listed for pid {pid}, which no live process has (held by no process, or it just ended); nothing is done",
            prefix(mode, host),
            bytes.map_or("Unmeasured".to_string(), |b| format!("{} of", mebibytes(b)))
        ),
        Notice::UtilizationUnknown { host, pid, gpus } => format!(
            "{}[WARNING] Utilization of process {pid} on GPU(s) {} is unknown (pmon has no figure of its own for it: it shares its GPU, or it is a CUDA MPS client whose kernels run on the busy MPS server): it is never reclaimed as idle",
            prefix(mode, host),
            comma_list(gpus)
        ),
        Notice::HiddenEnviron { host, pid, user, gpus, reason } => format!(
            "{}[WARNING] Process {pid}{} on GPU(s) {} is judged as carrying no environment: {}",
            prefix(mode, host),
            user.as_deref().map_or(String::new(), |u| format!(" (user {})", clean(u))),
            comma_list(gpus),
            clean(reason)
        ),
        Notice::StateUnusable { host, reason } => format!(
            "{}[ERROR] genv's state cannot be used ({}): the host is degraded; only processes outside genv, per-user memory caps, idle reclaim and the devices the kernel vouches for are judged there",
            prefix(mode, host),
            clean(reason)
        ),
        Notice::GarbledRecords { host, records } => format!(
            "{}[WARNING] {records} record(s) of genv's state hold a string over {} bytes: garbled (a record or attachment with such an id is dropped, such a user name taken as none, such a kernel id dropped, any other such text cut)",
            prefix(mode, host),
            crate::snapshot::genv::MAX_NAME
        ),
        Notice::LockHeld { host, holders } => format!(
            "{}[WARNING] {}: genv's state was read without it",
            prefix(mode, host),
            clean(holders)
        ),
        Notice::MpsServer { host, device, pid, user, bytes } => format!(
            "{}[INFO] Process {pid}{} on device {device} is the machine's CUDA MPS server (root's nvidia-cuda-mps-control started it): it is never judged, and its {} GPU memory there is overhead, in no one's count",
            prefix(mode, host),
            user.as_deref().map_or(String::new(), |u| format!(" (user {})", clean(u))),
            bytes.map_or("unmeasured".to_string(), mebibytes)
        ),
        Notice::OwnMpsServer { host, pid, user, gpus, reason } => format!(
            "{}[INFO] Process {pid}{} on GPU(s) {} runs the CUDA MPS server but is not the machine's shared one ({}): it is judged as its user's, as any process",
            prefix(mode, host),
            user.as_deref().map_or(String::new(), |u| format!(" (user {})", clean(u))),
            comma_list(gpus),
            clean(reason)
        ),
        Notice::UnresolvedUid { host, uid, reason } => format!(
            "{}[WARNING] uid {uid} has no name here and is {}: its processes count as their own user's",
            prefix(mode, host),
            clean(reason)
        ),
    }
}

/// Names, escaped, comma-separated.
fn list(names: &[String]) -> String {
    names
        .iter()
        .map(|u| clean(u))
        .collect::<Vec<_>>()
        .join(", ")
}

fn outcome_line(mode: Mode, o: &Outcome) -> Option<String> {
    use outcome::{DetachResult as D, TerminateResult as T};
    let line = match o {
        Outcome::Terminate { host, pid, outcome } => {
            let p = prefix(mode, host);
            match outcome {
                T::Signalled | T::DryRun => return None,
                T::AlreadyGone => format!("{p}[DEBUG] Process {pid} already terminated"),
                T::PermissionDenied => format!("{p}[ERROR] Not enough permissions to terminate process {pid}"),
                T::PidReused { expected, found } => format!(
                    "{p}[WARNING] Process {pid} was not terminated: the pid now belongs to another process (start time {found}, expected {expected})"
                ),
                T::NoIdentity => format!("{p}[WARNING] Process {pid} was not terminated: its start time is unknown"),
                T::Failed { error } => format!("{p}[ERROR] Failed terminating process {pid}: {}", clean(error)),
            }
        }
        Outcome::Kill { host, pid, outcome } => {
            let p = prefix(mode, host);
            match outcome {
                T::Signalled => format!(
                    "{p}[WARNING] Process {pid} was still running after SIGTERM: killed (SIGKILL)"
                ),
                T::DryRun | T::AlreadyGone | T::NoIdentity | T::PidReused { .. } => return None,
                T::PermissionDenied => {
                    format!("{p}[ERROR] Not enough permissions to kill process {pid}")
                }
                T::Failed { error } => {
                    format!("{p}[ERROR] Failed killing process {pid}: {}", clean(error))
                }
            }
        }
        Outcome::Detach {
            host,
            device,
            eid,
            outcome,
        } => {
            let p = prefix(mode, host);
            match outcome {
                D::Detached | D::DryRun => return None,
                D::NotAttached => format!(
                    "{p}[DEBUG] Environment {} was already detached from device {device}",
                    clean(&eid.0)
                ),
                D::Failed { error } => {
                    format!(
                        "{p}[ERROR] Failed detaching environment {} from device {device}: {}",
                        clean(&eid.0),
                        clean(error)
                    )
                }
            }
        }
    };
    Some(line)
}

/// A time in ms since the Unix epoch, as RFC 3339 (UTC, seconds).
pub fn when(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

fn waiting_line(mode: Mode, w: &Waiting) -> Option<String> {
    let why = |seen: u32, needed: u32, deadline: Option<u64>| match deadline {
        Some(d) => format!("its grace ends at {}", when(d)),
        None => {
            format!("its violation is confirmed after {needed} cycles (seen in {seen})")
        }
    };
    Some(match w {
        Waiting::Terminate {
            host,
            pid,
            exempt: Some(why),
            ..
        } => format!(
            "{}[INFO] Process {pid} is exempt ({}): it is not terminated",
            prefix(mode, host),
            clean(why)
        ),
        Waiting::Detach {
            host,
            device,
            eid,
            exempt: Some(why),
            ..
        } => format!(
            "{}[INFO] Environment {} is exempt ({}): it is not detached from device {device}",
            prefix(mode, host),
            clean(&eid.0),
            clean(why)
        ),
        Waiting::Terminate {
            warn_only: true, ..
        }
        | Waiting::Detach {
            warn_only: true, ..
        } => return None,
        Waiting::Terminate {
            host,
            pid,
            seen,
            needed,
            deadline_ms,
            ..
        } => format!(
            "{}[INFO] Process {pid} is not terminated yet: {}",
            prefix(mode, host),
            why(*seen, *needed, *deadline_ms)
        ),
        Waiting::Detach {
            host,
            device,
            eid,
            seen,
            needed,
            deadline_ms,
            ..
        } => format!(
            "{}[INFO] Environment {} is not detached from device {device} yet: {}",
            prefix(mode, host),
            clean(&eid.0),
            why(*seen, *needed, *deadline_ms)
        ),
    })
}

/// The rules of `what`, named, comma-separated.
fn rule_names(what: &What) -> String {
    what.rules()
        .iter()
        .map(|r| r.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a warning or a clearing says on stderr (acting says genv's line on
/// stdout already).
pub fn event_line(mode: Mode, e: &Event) -> Option<String> {
    let p = prefix(mode, &e.host);
    let user = e
        .what
        .user()
        .map_or(String::new(), |u| format!(" of user {}", clean(u)));
    match (e.stage, &e.what) {
        (Stage::Acted, _) => None,
        (Stage::Warned, What::Terminate(t)) => Some(format!(
            "{p}[WARNING] Process {}{user} from environment {} on GPU(s) {} violates {}: {}",
            t.pid,
            t.eid.as_ref().map_or("N/A".into(), |e| clean(&e.0)),
            comma_list(&t.gpus),
            rule_names(&e.what),
            match e.deadline_ms {
                Some(d) => format!("it will be terminated at {} unless that ends", when(d)),
                None => "warned only, nothing will be done".into(),
            }
        )),
        (Stage::Warned, What::Detach(d)) => Some(format!(
            "{p}[WARNING] Environment {}{user} is over the device cap: {}",
            clean(&d.eid.0),
            match e.deadline_ms {
                Some(t) => format!(
                    "it will be detached from device {} at {} unless its user gives devices up",
                    d.device,
                    when(t)
                ),
                None => format!("device {} is warned about only", d.device),
            }
        )),
        (Stage::Cleared, What::Terminate(t)) => Some(format!(
            "{p}[INFO] Process {} no longer violates {}: nothing will be done",
            t.pid,
            rule_names(&e.what),
        )),
        (Stage::Cleared, What::Detach(d)) => Some(format!(
            "{p}[INFO] Environment {} no longer needs detaching from device {}: nothing will be done",
            clean(&d.eid.0),
            d.device
        )),
    }
}

fn host_error_line(mode: Mode, h: &HostStatus, error: &str) -> String {
    match mode {
        Mode::Remote if h.recorded => format!(
            "Failed reading the recorded snapshot of {} ({})",
            h.host,
            clean(error)
        ),
        Mode::Local if h.recorded => {
            format!(
                "[ERROR] Failed reading a recorded snapshot: {}",
                clean(error)
            )
        }
        Mode::Remote => format!(
            "Failed running SSH command on {} ({})",
            h.host,
            clean(error)
        ),
        Mode::Local => format!("[ERROR] Failed taking a snapshot: {}", clean(error)),
    }
}

/// The report as genv-style text.
pub fn render_text(r: &CycleReport) -> Text {
    render_text_with(r, true)
}

/// The report as genv-style text, host failures left out unless
/// `host_errors` (genv's `-q`).
pub fn render_text_with(r: &CycleReport, host_errors: bool) -> Text {
    let mut text = Text::default();
    for h in r.hosts.iter().filter(|_| host_errors) {
        if let Some(e) = &h.error {
            text.stderr.push(host_error_line(r.mode, h, &e.message));
        }
    }
    text.stderr
        .extend(r.notices.iter().map(|n| notice_line(r.mode, n)));
    text.stdout
        .extend(r.violations.iter().map(|v| violation_line(r.mode, v)));
    for (host, plan) in &r.plan.hosts {
        let p = prefix(r.mode, host);
        text.stdout.extend(
            plan.terminate
                .iter()
                .map(|t| format!("{p}{}", termination_line(t))),
        );
        text.stdout
            .extend(plan.detach.iter().map(|d| format!("{p}{}", detach_line(d))));
    }
    text.stderr
        .extend(r.outcomes.iter().filter_map(|o| outcome_line(r.mode, o)));
    text.stderr
        .extend(r.events.iter().filter_map(|e| event_line(r.mode, e)));
    text.stderr
        .extend(r.waiting.iter().filter_map(|w| waiting_line(r.mode, w)));
    if r.dry_run && !r.plan.hosts.is_empty() {
        text.stderr
            .push("[DRY RUN] nothing was terminated or detached".to_string());
    }
    text
}

/// The report as one JSON object (one line).
pub fn render_json(r: &CycleReport) -> String {
    #[derive(Serialize)]
    struct Described<'a> {
        message: String,
        #[serde(flatten)]
        violation: &'a Violation,
    }
    #[derive(Serialize)]
    struct Json<'a> {
        #[serde(flatten)]
        report: &'a CycleReport,
        violations: Vec<Described<'a>>,
    }
    let json = Json {
        report: r,
        violations: r
            .violations
            .iter()
            .map(|v| Described {
                message: violation_line(r.mode, v),
                violation: v,
            })
            .collect(),
    };
    json_safe(
        serde_json::to_string(&json)
            .unwrap_or_else(|e| format!("{{\"error\":\"cannot render report: {e}\"}}")),
    )
}

/// One user's use of one host at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sample {
    pub host: HostId,
    pub user: String,
    /// GPUs their processes run on.
    pub devices: u32,
    /// GPU memory their processes hold (what nvidia-smi could measure).
    pub memory_bytes: u64,
    /// Their GPU processes.
    pub processes: u32,
}

/// The samples of `cluster`: per host, per user whose GPU processes run
/// there (a process whose user the host could not tell is left out), in
/// host then user order.
pub fn samples(cluster: &Cluster) -> Vec<Sample> {
    let mut out = Vec::new();
    for (host, snap) in &cluster.hosts {
        let mut by_user: BTreeMap<&str, (BTreeSet<u32>, u64, u32)> = BTreeMap::new();
        for p in &snap.processes {
            let Some(user) = p.user.as_deref() else {
                continue;
            };
            let entry = by_user.entry(user).or_default();
            entry.2 = entry.2.saturating_add(1);
            for g in &p.gpus {
                entry.0.insert(g.index.0);
                entry.1 = entry.1.saturating_add(g.usage.bytes().unwrap_or(0));
            }
        }
        out.extend(
            by_user
                .into_iter()
                .map(|(user, (devices, memory_bytes, processes))| Sample {
                    host: host.clone(),
                    user: user.to_string(),
                    devices: u32::try_from(devices.len()).unwrap_or(u32::MAX),
                    memory_bytes,
                    processes,
                }),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GpuIndex;

    #[test]
    fn terminal_controls_bidi_and_bad_bytes_are_escaped_everywhere() {
        let hostile = String::from_utf8_lossy(b"a\x1b]0;pwned\x07\rb\nc\xff\xfe").into_owned()
            + "\u{9b}2J\u{202e}gpj.exe";
        let c = clean(&hostile);
        assert!(c.chars().all(|c| !unprintable(c)), "{c:?}");
        assert_eq!(
            c,
            "a\\u{1b}]0;pwned\\u{7}\\rb\\nc\u{fffd}\u{fffd}\\u{9b}2J\\u{202e}gpj.exe"
        );
        assert_eq!(clean("alice"), "alice");
        assert_eq!(clean("Zoë 中"), "Zoë 中");
        let json = json_safe(serde_json::to_string(&serde_json::json!({"eid": hostile})).unwrap());
        assert!(json.chars().all(|c| !unprintable(c)), "{json:?}");
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back["eid"], hostile, "the same string, escaped");
        assert_eq!(json_safe("{\"a\":\"b\\\"c\"}".into()), "{\"a\":\"b\\\"c\"}");
    }

    #[test]
    fn control_characters_cannot_forge_lines() {
        assert_eq!(clean("4100"), "4100");
        assert_eq!(clean("a\nFake line"), "a\\nFake line");
        let d = Detach {
            rules: Default::default(),
            groups: Default::default(),
            device: GpuIndex(0),
            eid: crate::model::EnvId("x\ny".into()),
            username: Some("u\r".into()),
            charged: None,
            owner: None,
            working: false,
        };
        assert!(!detach_line(&d).contains('\n') && !detach_line(&d).contains('\r'));
    }
}
