//! Telling a job's owner on the host itself (`--notify-terminal`), as
//! `write(1)` would: a short message on the controlling terminal of the
//! job and on the owner's login terminals there. Our agent on the host
//! writes it (`agent.py`'s `tell`: only terminals the kernel says are the
//! user's, opened without blocking, the text stripped of controls and
//! bounded), so this goes through each host's agent after the cycle's
//! actions, hosts in parallel, within [`WITHIN`]; a host that does not
//! answer delays no action, and its messages are counted, logged and
//! audited as not sent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use super::limit::RateLimit;
use super::message::{recipient, say, Medium};
use crate::audit::AuditLog;
use crate::error;
use crate::fleet::Fleet;
use crate::host::protocol::Note;
use crate::ladder::{Event, What};
use crate::metrics::Metrics;
use crate::model::HostId;

/// The channel's name in metrics and the audit log.
pub const CHANNEL: &str = "terminal";

/// How long the hosts have to write a cycle's messages.
pub const WITHIN: Duration = Duration::from_secs(5);

/// Notes in one request to an agent, at most (the agent's own limit).
const MAX_NOTES: usize = 256;

/// What a terminal shows for `e`: a header line, then the message.
pub fn text(e: &Event, link: Option<&str>) -> String {
    let said = say(e, Medium::Plain, link);
    let subject = said.subject.trim_start_matches("[genv-enforce] ");
    format!(
        "\n*** genv-enforce: {subject}\n{}",
        said.body.trim_end_matches('\n')
    ) + "\n"
}

/// The note of each event that has an owner to tell, by host: the owner,
/// the processes whose terminals to write to (a termination's own
/// process), the text. Events without an owner are left out.
pub fn notes<'a>(
    events: &[&'a Event],
    link: Option<&str>,
) -> BTreeMap<HostId, Vec<(&'a Event, Note)>> {
    let mut by_host: BTreeMap<HostId, Vec<(&Event, Note)>> = BTreeMap::new();
    for e in events {
        let Some(user) = recipient(e) else { continue };
        let pids = match &e.what {
            What::Terminate(t) => t.start_time.map(|s| (t.pid.0, s)).into_iter().collect(),
            What::Detach(_) => Vec::new(),
        };
        by_host.entry(e.host.clone()).or_default().push((
            e,
            Note {
                user: user.to_string(),
                pids,
                text: text(e, link),
            },
        ));
    }
    by_host
}

/// Writes the owner's message of each of `events` (cycle `n`) on their
/// terminals on the event's host, at most `limit` allows, within
/// [`WITHIN`]. Never fails: what is not written is counted and audited.
pub async fn tell(
    fleet: &Fleet,
    n: u64,
    events: &[&Event],
    limit: &mut RateLimit,
    link: Option<&str>,
    audit: Option<&Arc<AuditLog>>,
    metrics: Option<&Arc<Metrics>>,
) {
    let count = |result: &str, k: u64| {
        if let Some(m) = metrics {
            m.notified(CHANNEL, result, k);
        }
    };
    let mut unsent: Vec<(Event, String)> = Vec::new();
    let mut nobody = 0;
    let mut allowed = Vec::with_capacity(events.len());
    let now = crate::clock::now_ms();
    for e in events {
        let Some(user) = recipient(e) else {
            nobody += 1;
            continue;
        };
        match limit.allow(user, e, now) {
            super::limit::Verdict::Send => allowed.push(*e),
            super::limit::Verdict::Hold { first, why } => {
                count("rate_limited", 1);
                if first {
                    unsent.push(((*e).clone(), why));
                }
            }
        }
    }
    let work = notes(&allowed, link).into_iter().flat_map(|(id, notes)| {
        let host = fleet.hosts.iter().find(|h| h.id() == &id);
        let chunks: Vec<_> = notes.chunks(MAX_NOTES).map(<[_]>::to_vec).collect();
        chunks.into_iter().filter_map(move |chunk| {
            let host = host?;
            Some(async move {
                let (events, notes): (Vec<&Event>, Vec<Note>) = chunk.into_iter().unzip();
                let result = tokio::time::timeout(WITHIN, host.tell(notes)).await;
                (events, result)
            })
        })
    });
    let answers: Vec<_> = futures::stream::iter(work)
        .buffer_unordered(fleet.concurrency.max(1))
        .collect()
        .await;
    for (events, result) in answers {
        match result {
            Ok(Ok(told)) => {
                // No terminal of theirs open there: nobody to tell.
                let sent = told.iter().filter(|k| **k > 0).count() as u64;
                count("sent", sent);
                nobody += told.len() as u64 - sent;
            }
            Ok(Err(err)) => {
                let why = error::chain(&err);
                fail(&events, &why, &mut unsent);
                count("failed", events.len() as u64);
            }
            Err(_) => {
                let why = format!("the host did not write within {}s", WITHIN.as_secs());
                fail(&events, &why, &mut unsent);
                count("failed", events.len() as u64);
            }
        }
    }
    count("nobody", nobody);
    for (e, why) in unsent {
        super::unsent(&audit.cloned(), n, e, CHANNEL, why).await;
    }
}

fn fail(events: &[&Event], why: &str, unsent: &mut Vec<(Event, String)>) {
    if let Some(e) = events.first() {
        tracing::warn!(channel = CHANNEL, host = %e.host, error = %why, "notification not sent");
    }
    unsent.extend(events.iter().map(|e| ((*e).clone(), why.to_string())));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ladder::Stage;
    use crate::model::{EnvId, GpuIndex, Pid};
    use crate::plan::{Detach, Termination};
    use crate::rules::Rule;

    fn event(host: &str, what: What) -> Event {
        Event {
            stage: Stage::Warned,
            host: HostId(host.into()),
            what,
            since_ms: 0,
            deadline_ms: Some(60_000),
        }
    }

    fn terminate(pid: u32, start: Option<u64>, uid: Option<u32>, user: &str) -> What {
        let mut t = Termination::of(Pid(pid), start);
        t.uid = uid;
        t.user = Some(user.into());
        t.eid = Some(EnvId("e\u{1b}[2J".into()));
        t.gpus = smallvec::smallvec![GpuIndex(1)];
        t.rules = [Rule::EnvDevices].into_iter().collect();
        What::Terminate(t)
    }

    #[test]
    fn each_owner_gets_a_note_on_the_host_of_the_event() {
        let detach = |owner: Option<&str>| {
            What::Detach(Detach {
                rules: Default::default(),
                device: GpuIndex(2),
                eid: EnvId("x".into()),
                username: None,
                charged: Some("dave".into()),
                owner: owner.map(String::from),
                groups: Vec::new(),
                working: false,
            })
        };
        let events = [
            event("h1", terminate(10, Some(100), Some(1000), "alice")),
            event("h2", terminate(11, None, Some(1001), "bob")),
            // A name only a record gives: nobody to tell.
            event("h1", terminate(12, Some(120), None, "mallory")),
            event("h1", detach(Some("dave"))),
            event("h2", detach(None)),
        ];
        let refs: Vec<&Event> = events.iter().collect();
        let notes = notes(&refs, None);
        let h1: Vec<_> = notes[&HostId("h1".into())]
            .iter()
            .map(|(_, n)| (n.user.as_str(), n.pids.clone()))
            .collect();
        assert_eq!(h1, [("alice", vec![(10, 100)]), ("dave", vec![])]);
        let h2: Vec<_> = notes[&HostId("h2".into())]
            .iter()
            .map(|(_, n)| (n.user.as_str(), n.pids.clone()))
            .collect();
        assert_eq!(h2, [("bob", vec![])], "no pid without its start time");
    }

    #[test]
    fn a_failed_write_marks_each_of_its_events_unsent_with_why() {
        let events = [
            event("h1", terminate(10, Some(100), Some(1000), "alice")),
            event("h1", terminate(11, Some(110), Some(1001), "bob")),
        ];
        let refs: Vec<&Event> = events.iter().collect();
        let mut unsent = Vec::new();
        fail(&refs, "the host did not write within 5s", &mut unsent);
        assert_eq!(unsent.len(), 2);
        assert!(unsent
            .iter()
            .zip(&events)
            .all(|((e, why), want)| e == want && why == "the host did not write within 5s"));
    }

    #[test]
    fn the_text_is_the_plain_message_under_a_header() {
        let e = event("h1", terminate(10, Some(100), Some(1000), "alice"));
        let t = text(&e, None);
        assert!(
            t.starts_with(
                "\n*** genv-enforce: h1: process 10 breaks env-devices\nProcess 10 of user alice"
            ),
            "{t}"
        );
        assert!(t.contains("e\\u{1b}[2J"), "{t}");
        assert!(!t.contains('\u{1b}'));
        assert!(t.ends_with("or stop the process.\n"), "{t}");
    }
}
