//! Telling a job's owner, and the admins, what the ladder does: each
//! event (warned, acted, cleared) goes once to each channel (mail,
//! webhook), beside the cycle. A cycle only hands its events to each
//! channel and never waits: the rate limits apply there, then each event
//! waits in its recipient's own bounded line ([`queue::Fair`]), so no
//! user's events can push out another's warning; a dead mail server or a
//! hanging webhook delays no enforcement; what cannot be queued or sent is
//! counted in the metrics, logged and written to the audit log (a run of
//! held-back or dropped ones said once).

pub mod limit;
pub mod mail;
pub mod message;
pub mod queue;
pub mod terminal;
mod webhook;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::audit::AuditLog;
use crate::ladder::{Event, Stage, What};
use crate::metrics::Metrics;
use crate::model::{EnvId, GpuIndex, HostId, Pid};
use crate::outcome::{CarriedOut, Outcome};

pub use mail::MailSpec;
pub use webhook::WebhookSpec;

/// Where notifications go, from the flags and the inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Notify {
    pub mail: Option<MailSpec>,
    pub webhook: Option<WebhookSpec>,
    /// `--notify-terminal`: on the owner's terminals on the host.
    pub terminal: bool,
    /// Messages per user and channel in any hour, at most.
    pub per_user_hour: u32,
    /// `--notify-link`: the admin's page for users, closing each message.
    pub link: Option<String>,
}

impl Notify {
    /// Whether any channel is set.
    pub fn any(&self) -> bool {
        self.mail.is_some() || self.webhook.is_some() || self.terminal
    }
}

/// A channel that cannot be set up (before anything runs).
#[derive(Debug, Error)]
pub enum NotifyError {
    #[error("--smtp {url}")]
    Smtp {
        url: String,
        #[source]
        source: UrlError,
    },
    #[error("--smtp-credentials {path}")]
    Credentials {
        path: String,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("--smtp-credentials {path}: not a user name on one line and a password on the next")]
    CredentialsText { path: String },
    #[error("{flag} {value}: not a mail address ({why})")]
    Address {
        flag: &'static str,
        value: String,
        why: lettre::address::AddressError,
    },
    #[error("--mail-to {0}: not a mail address (no {{user}} in it: every owner would get the same address)")]
    MailTo(String),
    #[error("--webhook {url}")]
    Webhook {
        url: String,
        #[source]
        source: UrlError,
    },
    #[error("--webhook-file {path}")]
    WebhookFile {
        path: String,
        #[source]
        source: crate::private::Refusal,
    },
    #[error("--smtp needs --mail-from")]
    NoSender,
    #[error("{0} needs --smtp")]
    NoSmtp(&'static str),
}

/// Why a channel's URL cannot be used.
#[derive(Debug, Error)]
pub enum UrlError {
    #[error(transparent)]
    Parse(#[from] url::ParseError),
    /// A secret where it would be printed and logged.
    #[error("credentials in the URL: refused{hint}")]
    Credentials { hint: &'static str },
    #[error("not an http:// or https:// URL")]
    Scheme,
    /// lettre's words, which already tell their cause.
    #[error("{0}")]
    Smtp(lettre::transport::smtp::Error),
    /// The HTTP client could not be built (the system's CA store).
    #[error(transparent)]
    Client(reqwest::Error),
}

/// Why a notification was not delivered.
#[derive(Debug, Error)]
pub enum DeliveryError {
    /// The mail could not be made (an address lettre refuses).
    #[error("{0}")]
    Mail(lettre::error::Error),
    /// lettre's words, which already tell their cause.
    #[error("{0}")]
    Smtp(lettre::transport::smtp::Error),
    /// The server gave no answer in time.
    #[error("no answer within {}s", .0.as_secs())]
    Timeout(std::time::Duration),
    /// The webhook's receiver answered with an error.
    #[error("HTTP {0}")]
    Status(reqwest::StatusCode),
    /// The webhook could not be reached (its URL left out: a secret).
    #[error(transparent)]
    Http(reqwest::Error),
    /// Every attempt failed: the last one's error, all told.
    #[error("{} (after {attempts} attempts)", crate::error::chain(&**last))]
    GaveUp {
        attempts: u32,
        last: Box<DeliveryError>,
    },
}

/// How one delivery went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    Sent,
    /// No one to send it to (an owner without an address and no admins).
    Nobody,
}

/// A channel, ready to deliver.
enum Channel {
    Mail(Box<mail::Mailer>),
    Webhook(webhook::Hook),
}

impl Channel {
    fn name(&self) -> &'static str {
        match self {
            Channel::Mail(_) => "mail",
            Channel::Webhook(_) => "webhook",
        }
    }

    async fn deliver(&self, e: &Event, link: Option<&str>) -> Result<Delivery, DeliveryError> {
        match self {
            Channel::Mail(m) => m.deliver(e, link).await,
            Channel::Webhook(h) => h.deliver(e, link).await,
        }
    }
}

/// Checks every channel of `spec` for errors (a URL that cannot be used)
/// before anything runs. The webhook's client (it reads the system's CA
/// store) is built once, when the channels start.
///
/// # Errors
/// The first channel that cannot be set up.
pub fn check(spec: &Notify) -> Result<(), NotifyError> {
    if let Some(m) = &spec.mail {
        mail::Mailer::new(m)?;
    }
    if let Some(w) = &spec.webhook {
        webhook::url(w)?;
    }
    Ok(())
}

/// The running channels: a rate limit, a fair queue and a worker task
/// each.
pub struct Notifier {
    queues: Vec<Line>,
    workers: Vec<tokio::task::JoinHandle<()>>,
    metrics: Option<Arc<Metrics>>,
    audit: Option<Arc<AuditLog>>,
}

/// One channel's way in: its name, rate limit and queue.
struct Line {
    name: &'static str,
    limit: std::sync::Mutex<limit::RateLimit>,
    queue: Arc<queue::Fair<(u64, Event)>>,
    /// Recipients whose line was full, said once per run of drops.
    full: std::sync::Mutex<HashSet<String>>,
    /// What it held back and dropped since the run began, and the last of
    /// those messages (for the view).
    held_back: std::sync::atomic::AtomicU64,
    dropped: std::sync::atomic::AtomicU64,
    last: std::sync::Mutex<std::collections::VecDeque<crate::view::HeldBackView>>,
}

/// How many held-back or dropped messages each channel shows in the view.
pub const LAST_HELD: usize = 20;

impl Line {
    /// The last of `unsent` (each an event, to whom, why not sent) kept
    /// for the view; only those kept are put in words.
    fn unsent(&self, unsent: &[(&Event, &str, String)], now: u64) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let newest = unsent.iter().skip(unsent.len().saturating_sub(LAST_HELD));
        for (e, who, why) in newest {
            last.push_front(crate::view::HeldBackView {
                at_ms: now,
                to: (*who).to_string(),
                what: message::say(e, message::Medium::Plain, None).subject,
                why: why.clone(),
            });
        }
        last.truncate(LAST_HELD);
    }
}

impl Notifier {
    /// Starts a worker per channel of `spec` (in the current runtime).
    ///
    /// # Errors
    /// A channel cannot be set up (its URL, TLS).
    pub fn start(
        spec: &Notify,
        audit: Option<Arc<AuditLog>>,
        metrics: Option<Arc<Metrics>>,
    ) -> Result<Self, NotifyError> {
        let mut channels = Vec::new();
        if let Some(m) = &spec.mail {
            channels.push(Channel::Mail(Box::new(mail::Mailer::new(m)?)));
        }
        if let Some(w) = &spec.webhook {
            channels.push(Channel::Webhook(webhook::Hook::new(w)?));
        }
        let (mut queues, mut workers) = (Vec::new(), Vec::new());
        for channel in channels {
            let queue = Arc::new(queue::Fair::new(queue::PER_RECIPIENT));
            queues.push(Line {
                name: channel.name(),
                limit: std::sync::Mutex::new(limit::RateLimit::new(spec.per_user_hour)),
                queue: Arc::clone(&queue),
                full: std::sync::Mutex::default(),
                held_back: std::sync::atomic::AtomicU64::new(0),
                dropped: std::sync::atomic::AtomicU64::new(0),
                last: std::sync::Mutex::default(),
            });
            workers.push(tokio::spawn(work(
                queue,
                channel,
                spec.link.clone(),
                audit.clone(),
                metrics.clone(),
            )));
        }
        Ok(Notifier {
            queues,
            workers,
            metrics,
            audit,
        })
    }

    /// Lets what is queued go out, for at most `within` (a run ending:
    /// a cron run's mail must leave before it exits); what is left then is
    /// said and abandoned.
    pub async fn close(self, within: Duration) {
        for line in &self.queues {
            line.queue.close();
        }
        let waiting = futures::future::join_all(self.workers);
        if tokio::time::timeout(within, waiting).await.is_err() {
            tracing::warn!(
                seconds = within.as_secs_f64(),
                "notifications still undelivered at exit are abandoned"
            );
            crate::output::complain(&format!(
                "notifications still undelivered after {}s are abandoned",
                within.as_secs_f64()
            ));
        }
    }

    /// Hands `events` of cycle `n` to every channel; never waits. Each is
    /// rate limited there, then queued in its recipient's line; one a
    /// full line cannot take is dropped and counted, the first of a run
    /// said in the audit log.
    pub fn send(&self, n: u64, events: &[&Event]) {
        let now = crate::clock::now_ms();
        for line in &self.queues {
            let name = line.name;
            let (mut held, mut dropped) = (0u64, 0u64);
            let mut unsent = Vec::new();
            for e in events {
                // Owners unknown share one allowance, and one line.
                let who = message::recipient(e).unwrap_or_default();
                let verdict =
                    (line.limit.lock().unwrap_or_else(|p| p.into_inner())).allow(who, e, now);
                if let limit::Verdict::Hold { first, why } = verdict {
                    held += 1;
                    if first {
                        let said = format!("{why}; further ones held back are not said again");
                        self.unsent_later(n, e, name, said);
                    }
                    unsent.push((*e, who, why));
                    continue;
                }
                let mut full = line.full.lock().unwrap_or_else(|p| p.into_inner());
                if line.queue.push(who, (n, (*e).clone())) {
                    full.remove(who);
                    continue;
                }
                dropped += 1;
                unsent.push((*e, who, "dropped: its recipient's line is full".into()));
                if full.insert(who.to_string()) {
                    let why = format!(
                        "dropped: {} messages already wait for {}; further ones dropped are counted, not said",
                        queue::PER_RECIPIENT,
                        if who.is_empty() { "owners unknown" } else { who }
                    );
                    self.unsent_later(n, e, name, why);
                }
            }
            line.unsent(&unsent, now);
            let count = std::sync::atomic::Ordering::Relaxed;
            line.held_back.fetch_add(held, count);
            line.dropped.fetch_add(dropped, count);
            if dropped > 0 {
                tracing::warn!(
                    channel = name,
                    dropped,
                    "notification line full: events dropped"
                );
            }
            if let Some(m) = &self.metrics {
                if held > 0 {
                    m.notified(name, "rate_limited", held);
                }
                if dropped > 0 {
                    m.notified(name, "dropped", dropped);
                }
            }
        }
    }

    /// Each channel as the view shows it: what waits to go, what was
    /// held back and dropped, the last of those.
    pub fn view(&self) -> Vec<crate::view::ChannelView> {
        let count = std::sync::atomic::Ordering::Relaxed;
        (self.queues.iter())
            .map(|line| crate::view::ChannelView {
                channel: line.name.to_string(),
                queued: line.queue.len() as u64,
                held_back: line.held_back.load(count),
                dropped: line.dropped.load(count),
                last: (line.last.lock().unwrap_or_else(|p| p.into_inner()))
                    .iter()
                    .cloned()
                    .collect(),
            })
            .collect()
    }

    /// An `unsent` line for `e` in the audit log, written off the cycle.
    fn unsent_later(&self, n: u64, e: &Event, channel: &'static str, why: String) {
        if self.audit.is_some() {
            let audit = self.audit.clone();
            let e = e.clone();
            tokio::spawn(async move { unsent(&audit, n, e, channel, why).await });
        }
    }
}

/// Delivers what comes out of `queue`, one at a time, each within the
/// channel's own time limits.
async fn work(
    queue: Arc<queue::Fair<(u64, Event)>>,
    channel: Channel,
    link: Option<String>,
    audit: Option<Arc<AuditLog>>,
    metrics: Option<Arc<Metrics>>,
) {
    let name = channel.name();
    let count = |result: &str| {
        if let Some(m) = &metrics {
            m.notified(name, result, 1);
        }
    };
    while let Some((n, e)) = queue.next().await {
        match channel.deliver(&e, link.as_deref()).await {
            Ok(Delivery::Sent) => count("sent"),
            Ok(Delivery::Nobody) => count("nobody"),
            Err(err) => {
                count("failed");
                let why = crate::error::chain(&err);
                tracing::warn!(channel = name, host = %e.host, error = %why, "notification not sent");
                unsent(&audit, n, e, name, why).await;
            }
        }
    }
}

/// An `unsent` line in the audit log, if there is one.
pub(crate) async fn unsent(
    audit: &Option<Arc<AuditLog>>,
    n: u64,
    e: Event,
    channel: &'static str,
    why: String,
) {
    if let Some(log) = audit {
        let log = Arc::clone(log);
        let written = tokio::task::spawn_blocking(move || log.unsent(n, &e, channel, &why)).await;
        if let Ok(Err(err)) = written {
            tracing::error!(error = %err, "cannot record an unsent notification in the audit log");
        }
    }
}

/// The backoff before retry `attempt` (1-based): 1 s, 2 s, 4 s, ... up to
/// 30 s.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_secs(1u64 << attempt.saturating_sub(1).min(5)).min(Duration::from_secs(30))
}

/// The events worth telling: warnings and clearings, and actions that
/// were carried out (an action that failed, or found its pid reused or
/// gone, is not said to be done).
pub fn told<'a>(events: &'a [Event], outcomes: &[Outcome]) -> Vec<&'a Event> {
    let done = CarriedOut::of(outcomes);
    events
        .iter()
        .filter(|e| match &e.what {
            _ if e.stage != Stage::Acted => true,
            What::Terminate(t) => done.signalled(&e.host, t.pid),
            What::Detach(d) => done.detached(&e.host, d.device, &d.eid),
        })
        .collect()
}

/// What identifies an action from cycle to cycle.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Told {
    Terminate(HostId, Pid, Option<u64>),
    Detach(HostId, GpuIndex, EnvId),
}

impl Told {
    fn of(e: &Event) -> Told {
        match &e.what {
            What::Terminate(t) => Told::Terminate(e.host.clone(), t.pid, t.start_time),
            What::Detach(d) => Told::Detach(e.host.clone(), d.device, d.eid.clone()),
        }
    }
}

/// Actions carried out at once (no grace, genv's way) told once each: one
/// carried out again the next cycle (a process that ignores SIGTERM is
/// signalled each cycle, as genv does) is not told again.
#[derive(Debug, Default)]
pub struct Repeats {
    last: HashSet<Told>,
}

impl Repeats {
    /// Those of `acted` (this cycle's) not told last cycle; remembers
    /// this cycle's.
    pub fn fresh<'a>(&mut self, acted: Vec<&'a Event>) -> Vec<&'a Event> {
        let now: HashSet<Told> = acted.iter().map(|e| Told::of(e)).collect();
        let fresh = acted
            .into_iter()
            .filter(|e| !self.last.contains(&Told::of(e)))
            .collect();
        self.last = now;
        fresh
    }
}

/// A user's address: the inventory's `[users]` entry, else `template`
/// with `{user}` replaced by the name.
pub fn address_of(
    user: &str,
    users: &BTreeMap<String, String>,
    template: Option<&str>,
) -> Option<String> {
    if let Some(a) = users.get(user) {
        return Some(a.clone());
    }
    // Only a plain user name goes into an address.
    template
        .filter(|_| plain_name(user))
        .map(|t| t.replace("{user}", user))
}

/// Whether `name` is a plain user or group name: letters, digits, `_`,
/// `.` and `-`, not first.
fn plain_name(name: &str) -> bool {
    name.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        && !name.is_empty()
        && !name.starts_with(['-', '.'])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::{DetachResult, TerminateResult};

    #[test]
    fn backoff_doubles_up_to_thirty_seconds() {
        let secs: Vec<u64> = (1..=8).map(|a| backoff(a).as_secs()).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn an_action_is_told_only_once_carried_out() {
        use crate::plan::{Detach, Termination};
        let h = HostId("h".into());
        let ev = |stage, what| Event {
            stage,
            host: h.clone(),
            what,
            since_ms: 0,
            deadline_ms: None,
        };
        let term = |pid| What::Terminate(Termination::of(Pid(pid), Some(1)));
        let det = |device| {
            What::Detach(Detach {
                rules: Default::default(),
                groups: Default::default(),
                device: GpuIndex(device),
                eid: EnvId("e".into()),
                username: None,
                charged: None,
                owner: None,
                working: false,
            })
        };
        let events = vec![
            ev(Stage::Acted, term(1)),
            ev(Stage::Acted, term(2)),
            ev(Stage::Acted, det(0)),
            ev(Stage::Acted, det(1)),
            ev(Stage::Warned, term(3)),
            ev(Stage::Cleared, det(2)),
            ev(Stage::Acted, term(4)),
        ];
        let outcomes = vec![
            Outcome::Terminate {
                host: h.clone(),
                pid: Pid(1),
                outcome: TerminateResult::Signalled,
            },
            Outcome::Terminate {
                host: h.clone(),
                pid: Pid(2),
                outcome: TerminateResult::PidReused {
                    expected: 1,
                    found: 2,
                },
            },
            Outcome::Detach {
                host: h.clone(),
                device: GpuIndex(0),
                eid: EnvId("e".into()),
                outcome: DetachResult::Detached,
            },
            Outcome::Detach {
                host: h.clone(),
                device: GpuIndex(1),
                eid: EnvId("e".into()),
                outcome: DetachResult::Failed { error: "x".into() },
            },
            // Another host's pid 4.
            Outcome::Terminate {
                host: HostId("other".into()),
                pid: Pid(4),
                outcome: TerminateResult::Signalled,
            },
        ];
        let kept: Vec<&Event> = told(&events, &outcomes);
        let want: Vec<&Event> = [0, 2, 4, 5].iter().map(|i| &events[*i]).collect();
        assert_eq!(kept, want);
    }

    #[test]
    fn an_action_carried_out_cycle_after_cycle_is_told_once() {
        let ev = |pid, start| Event {
            stage: Stage::Acted,
            host: HostId("h".into()),
            what: What::Terminate(crate::plan::Termination::of(Pid(pid), Some(start))),
            since_ms: 0,
            deadline_ms: None,
        };
        let (a, b, a_again, a_new) = (ev(1, 10), ev(2, 10), ev(1, 10), ev(1, 11));
        let mut r = Repeats::default();
        assert_eq!(r.fresh(vec![&a]), vec![&a]);
        // Signalled again: not told; another one is.
        assert_eq!(r.fresh(vec![&a_again, &b]), vec![&b]);
        // The same pid, another process: told.
        assert_eq!(r.fresh(vec![&a_new, &b]), vec![&a_new]);
        // A cycle without it, then it again: told again.
        assert_eq!(r.fresh(vec![]), Vec::<&Event>::new());
        assert_eq!(r.fresh(vec![&b]), vec![&b]);
    }

    #[test]
    fn the_inventory_names_an_address_before_the_template() {
        let users = BTreeMap::from([("alice".to_string(), "a.smith@lab.example".to_string())]);
        assert_eq!(
            address_of("alice", &users, Some("{user}@uni.example")).as_deref(),
            Some("a.smith@lab.example")
        );
        assert_eq!(
            address_of("bob", &users, Some("{user}@uni.example")).as_deref(),
            Some("bob@uni.example")
        );
        assert_eq!(address_of("bob", &users, None), None);
        for odd in ["", "a,b", "a@evil.example", "a b", "-x", ".x", "a\nb"] {
            assert_eq!(
                address_of(odd, &users, Some("{user}@uni.example")),
                None,
                "{odd:?}"
            );
        }
        assert_eq!(
            address_of("j.doe-2_x", &users, Some("{user}@uni.example")).as_deref(),
            Some("j.doe-2_x@uni.example")
        );
    }

    #[tokio::test]
    async fn a_full_line_drops_and_counts_its_own_and_never_waits() {
        let metrics = Arc::new(Metrics::new());
        let queue = Arc::new(queue::Fair::new(2));
        let n = Notifier {
            queues: vec![Line {
                name: "mail",
                limit: std::sync::Mutex::new(limit::RateLimit::new(1000)),
                queue: Arc::clone(&queue),
                full: std::sync::Mutex::default(),
                held_back: std::sync::atomic::AtomicU64::new(0),
                dropped: std::sync::atomic::AtomicU64::new(0),
                last: std::sync::Mutex::default(),
            }],
            workers: Vec::new(),
            metrics: Some(Arc::clone(&metrics)),
            audit: None,
        };
        let event = |pid: u32, owner: Option<&str>| {
            let mut t = crate::plan::Termination::of(crate::model::Pid(pid), Some(1));
            if let Some(o) = owner {
                (t.uid, t.user) = (Some(1001), Some(o.into()));
            }
            Event {
                stage: Stage::Warned,
                host: crate::model::HostId("h".into()),
                what: What::Terminate(t),
                since_ms: 0,
                deadline_ms: owner.map(|_| 60_000),
            }
        };
        // Events whose owner no one knows (anyone can make them): one line.
        let unknown: Vec<Event> = (0..6).map(|pid| event(pid, None)).collect();
        n.send(7, &[&unknown[0]]);
        let text = metrics.render();
        assert!(!text.contains("result=\"dropped\""), "{text}");
        n.send(7, &unknown[1..].iter().collect::<Vec<_>>());
        let text = metrics.render();
        assert!(
            text.contains(
                "genv_enforce_notifications_total{channel=\"mail\",result=\"dropped\"} 4"
            ),
            "{text}"
        );
        // The view says what waits and what was dropped, the last first.
        let seen = n.view();
        assert_eq!(seen.len(), 1);
        assert_eq!(
            (seen[0].queued, seen[0].held_back, seen[0].dropped),
            (2, 0, 4)
        );
        assert_eq!(seen[0].last.len(), 4);
        assert!(seen[0]
            .last
            .iter()
            .all(|h| h.to.is_empty() && h.why.starts_with("dropped")));
        assert!(seen[0].last[0].what.contains('5'), "{:?}", seen[0].last[0]);
        // alice's warning about her job has a line of its own.
        let hers = event(99, Some("alice"));
        n.send(8, &[&hers]);
        assert_eq!(n.view()[0].queued, 3);
        let mut got = Vec::new();
        n.close(Duration::from_secs(1)).await;
        while let Some((c, e)) = queue.next().await {
            got.push((c, e.what.owner().map(String::from)));
        }
        assert_eq!(
            got,
            [(7, None), (8, Some("alice".to_string())), (7, None)],
            "in turn"
        );
    }

    #[test]
    fn any_channel_is_one_of_them() {
        let mail = Notify {
            mail: Some(MailSpec {
                url: "smtp://127.0.0.1:25".into(),
                credentials: None,
                from: "a@b.example".parse().unwrap(),
                to: None,
                users: BTreeMap::new(),
                admins: Vec::new(),
            }),
            ..Notify::default()
        };
        let hook = Notify {
            webhook: Some(WebhookSpec {
                url: "http://127.0.0.1/".into(),
                timeout: Duration::from_secs(1),
                attempts: 1,
            }),
            ..Notify::default()
        };
        assert!(mail.any() && hook.any() && !Notify::default().any());
        check(&mail).unwrap();
        let bad = Notify {
            webhook: Some(WebhookSpec {
                url: "ftp://x/".into(),
                timeout: Duration::from_secs(1),
                attempts: 1,
            }),
            ..Notify::default()
        };
        assert!(check(&bad).is_err());
    }
}
