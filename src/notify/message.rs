//! What a notification says: one event of the ladder (warned, acted,
//! cleared) told to the job's owner, rendered for each medium with the
//! user's text (environment ids, user and host names) escaped for it.
//! Pure: no I/O.

use crate::ladder::{Event, Stage, What};
use crate::model::comma_list;
use crate::report::{clean, when};
use crate::rules::Rule;

/// How user text is made safe for a medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// A terminal or a plain-text mail: controls, bidi overrides and
    /// zero-width characters escaped (they cannot drive the terminal or
    /// forge lines).
    Plain,
    /// Slack's and Mattermost's `text`: as [`Medium::Plain`], then `&`,
    /// `<` and `>` as entities (no `<!channel>`, no link) and each value
    /// in a code span (no formatting), its backticks replaced.
    Chat,
}

impl Medium {
    /// `text`, a value a user or a host chose, safe in this medium.
    pub fn value(self, text: &str) -> String {
        let plain = clean(text);
        match self {
            Medium::Plain => plain.into_owned(),
            Medium::Chat => {
                let mut out = String::with_capacity(plain.len() + 2);
                out.push('`');
                for c in plain.chars() {
                    match c {
                        '&' => out.push_str("&amp;"),
                        '<' => out.push_str("&lt;"),
                        '>' => out.push_str("&gt;"),
                        '`' => out.push('\''),
                        c => out.push(c),
                    }
                }
                out.push('`');
                out
            }
        }
    }
}

/// One event, said: a subject line and a few lines of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Said {
    pub subject: String,
    pub body: String,
}

/// Who an event is for: the user the kernel says the action is about
/// (see [`What::owner`]); never a name only a record gives (a record's
/// `username`, which anyone writes), so that nobody can have mail sent to
/// someone else. None: the admins alone are told.
pub fn recipient(e: &Event) -> Option<&str> {
    e.what.owner()
}

/// Why a process breaks `rule`, in words.
fn why(rule: Rule) -> &'static str {
    match rule {
        Rule::NonEnvProcesses => "it uses GPUs outside any genv environment",
        Rule::EnvDevices => "it uses GPUs its environment is not attached to",
        Rule::EnvMemory => "its environment uses more GPU memory than it set aside",
        Rule::MaxDevicesPerUser => "its user has more GPUs attached than the cap allows",
        Rule::MaxDevicesPerGroup => "its user's group has more GPUs attached than its quota allows",
        Rule::MaxMemoryPerUser => "its user's processes hold more GPU memory than the cap allows",
        Rule::IdleGpu => "it holds GPU memory but has left its GPU idle for the whole idle window",
        Rule::OrphanedEnvProcesses => {
            "it carries an environment id that names no environment, so it runs outside genv"
        }
    }
}

/// How its owner fixes it.
fn fix(rule: Rule, eid: &str, gpus: &str) -> String {
    match rule {
        Rule::NonEnvProcesses => {
            "run it in a genv environment with those GPUs attached (`genv activate`, `genv attach`), or stop it".into()
        }
        Rule::EnvDevices => format!(
            "attach GPU(s) {gpus} to environment {eid} (`genv attach --index N` in it, once per GPU), or stop the process"
        ),
        Rule::EnvMemory => format!(
            "keep environment {eid}'s processes within its GPU memory (`genv config gpu-memory`), or stop some of them"
        ),
        Rule::MaxDevicesPerUser | Rule::MaxDevicesPerGroup => {
            "detach the GPUs you do not need (`genv detach --index N` in their environment)".into()
        }
        Rule::MaxMemoryPerUser => {
            "stop the GPU processes you do not need, or make them hold less GPU memory".into()
        }
        Rule::IdleGpu => "end GPU processes once they stop computing, so that others can use the GPU".into(),
        Rule::OrphanedEnvProcesses => format!(
            "environment {eid} does not exist: run the job in a genv environment of yours with those GPUs attached, or stop it"
        ),
    }
}

/// What `e` says in `medium`, times in UTC (RFC 3339). Every stage says
/// why (its rules, in words) and what to do; `link` (`--notify-link`: the
/// admin's page for users, e.g. docs/users.md) closes each message.
pub fn say(e: &Event, medium: Medium, link: Option<&str>) -> Said {
    let mut said = said(e, medium);
    if let Some(link) = link {
        said.body.push_str(&format!(
            "What the rules are and what you can do: {}\n",
            clean(link)
        ));
    }
    said
}

fn said(e: &Event, medium: Medium) -> Said {
    let v = |s: &str| medium.value(s);
    let host = v(&e.host.0);
    let user = e.what.user().map_or_else(|| "unknown".into(), v);
    let rules = e.what.rules();
    let names = rules
        .iter()
        .map(|r| r.name())
        .collect::<Vec<_>>()
        .join(", ");
    let whys = rules.iter().map(|r| why(*r)).collect::<Vec<_>>().join("; ");
    let due = |what: &str| match e.deadline_ms {
        Some(d) => format!("{what} at {} unless this ends first.", when(d)),
        None => "This is a warning only: nothing will be done, but please fix it.".into(),
    };
    match &e.what {
        What::Terminate(t) => {
            let eid = t.eid.as_ref().map_or_else(|| "none".into(), |x| v(&x.0));
            let gpus = comma_list(&t.gpus);
            let held = t.memory.map_or_else(String::new, |b| {
                format!(" It holds {} MiB of GPU memory.", b.div_ceil(1 << 20))
            });
            let seen = format!(
                "Process {} of user {user} (environment {eid}) on host {host}, GPU(s) {gpus}, breaks the rule {names}: {whys}.{held}",
                t.pid,
            );
            let fixes = rules
                .iter()
                .map(|r| fix(*r, &eid, &gpus))
                .collect::<Vec<_>>()
                .join("; or ");
            match e.stage {
                Stage::Warned => Said {
                    subject: format!("[genv-enforce] {host}: process {} breaks {names}", t.pid),
                    body: format!(
                        "{seen}\n{}\nTo fix it: {fixes}.\n",
                        due("It will be terminated (SIGTERM)")
                    ),
                },
                Stage::Acted => Said {
                    subject: format!("[genv-enforce] {host}: process {} terminated", t.pid),
                    body: format!(
                        "{seen}\nIt was terminated (SIGTERM).\nNext time: {fixes}.\n"
                    ),
                },
                Stage::Cleared => Said {
                    subject: format!("[genv-enforce] {host}: process {} is fine now", t.pid),
                    body: format!(
                        "Process {} of user {user} on host {host} no longer breaks {names} ({whys}): nothing will be done, and there is nothing to do.\n",
                        t.pid
                    ),
                },
            }
        }
        What::Detach(d) => {
            let eid = v(&d.eid.0);
            let seen = format!(
                "User {user} is over a GPU cap ({whys}); environment {eid} is attached to GPU {} on host {host}.",
                d.device
            );
            let fixes = fix(Rule::MaxDevicesPerUser, &eid, "");
            match e.stage {
                Stage::Warned => Said {
                    subject: format!(
                        "[genv-enforce] {host}: environment {eid} is over the GPU cap"
                    ),
                    body: format!(
                        "{seen}\n{}\nTo fix it: {fixes}.\n",
                        due(&format!("It will be detached from GPU {}", d.device))
                    ),
                },
                Stage::Acted => Said {
                    subject: format!(
                        "[genv-enforce] {host}: environment {eid} detached from GPU {}",
                        d.device
                    ),
                    body: format!(
                        "{seen}\nIt was detached from GPU {}.\nNext time: {fixes}.\n",
                        d.device
                    ),
                },
                Stage::Cleared => Said {
                    subject: format!("[genv-enforce] {host}: environment {eid} is fine now"),
                    body: format!(
                        "Environment {eid} of user {user} on host {host} no longer needs detaching from GPU {} ({whys}): nothing will be done, and there is nothing to do.\n",
                        d.device
                    ),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvId, GpuIndex, HostId, Pid};
    use crate::plan::{Detach, Termination};

    fn termination(eid: &str, user: &str) -> What {
        let mut t = Termination::of(Pid(4242), Some(7));
        t.eid = Some(EnvId(eid.into()));
        t.gpus = smallvec::smallvec![GpuIndex(0), GpuIndex(2)];
        t.uid = Some(1000);
        t.user = Some(user.into());
        t.rules = [Rule::EnvDevices].into_iter().collect();
        t.memory = Some(1536 << 20);
        What::Terminate(t)
    }

    fn event(stage: Stage, what: What, deadline: Option<u64>) -> Event {
        Event {
            stage,
            host: HostId("gpu-01".into()),
            what,
            since_ms: 0,
            deadline_ms: deadline,
        }
    }

    #[test]
    fn a_warning_says_what_was_seen_when_it_is_due_and_how_to_fix_it() {
        let e = event(Stage::Warned, termination("exp1", "alice"), Some(900_000));
        let s = say(&e, Medium::Plain, None);
        assert_eq!(
            s.subject,
            "[genv-enforce] gpu-01: process 4242 breaks env-devices"
        );
        assert_eq!(
            s.body,
            "Process 4242 of user alice (environment exp1) on host gpu-01, GPU(s) 0,2, breaks the rule env-devices: it uses GPUs its environment is not attached to. It holds 1536 MiB of GPU memory.\n\
             It will be terminated (SIGTERM) at 1970-01-01T00:15:00Z unless this ends first.\n\
             To fix it: attach GPU(s) 0,2 to environment exp1 (`genv attach --index N` in it, once per GPU), or stop the process.\n"
        );
        let w = say(
            &event(Stage::Warned, termination("exp1", "alice"), None),
            Medium::Plain,
            None,
        );
        assert!(
            w.body.contains("a warning only: nothing will be done"),
            "{}",
            w.body
        );
    }

    #[test]
    fn acting_and_clearing_say_what_was_done() {
        let acted = say(
            &event(Stage::Acted, termination("e", "bob"), Some(1)),
            Medium::Plain,
            None,
        );
        assert_eq!(
            acted.subject,
            "[genv-enforce] gpu-01: process 4242 terminated"
        );
        assert!(
            acted.body.ends_with(
                "It was terminated (SIGTERM).\nNext time: attach GPU(s) 0,2 to environment e (`genv attach --index N` in it, once per GPU), or stop the process.\n"
            ),
            "{}",
            acted.body
        );
        let cleared = say(
            &event(Stage::Cleared, termination("e", "bob"), Some(1)),
            Medium::Plain,
            None,
        );
        assert!(cleared.body.contains(
            "no longer breaks env-devices (it uses GPUs its environment is not attached to): nothing will be done"
        ));
        let d = What::Detach(Detach {
            rules: Default::default(),
            groups: Default::default(),
            device: GpuIndex(3),
            eid: EnvId("big".into()),
            username: Some("mallory".into()),
            charged: Some("carol".into()),
            owner: Some("carol".into()),
            working: false,
        });
        let warned = say(
            &event(Stage::Warned, d.clone(), Some(60_000)),
            Medium::Plain,
            None,
        );
        assert!(
            warned.body.starts_with(
                "User carol is over a GPU cap (its user has more GPUs attached than the cap allows)"
            ),
            "{}",
            warned.body
        );
        assert!(warned
            .body
            .contains("It will be detached from GPU 3 at 1970-01-01T00:01:00Z"));
        let acted = say(
            &event(Stage::Acted, d.clone(), Some(60_000)),
            Medium::Plain,
            None,
        );
        assert!(acted
            .body
            .contains("It was detached from GPU 3.\nNext time: detach the GPUs you do not need"));
        let cleared = say(&event(Stage::Cleared, d, None), Medium::Plain, None);
        assert!(cleared
            .body
            .contains("no longer needs detaching from GPU 3"));
        assert_eq!(
            recipient(&event(Stage::Acted, termination("e", "bob"), None)),
            Some("bob")
        );
    }

    #[test]
    fn every_message_ends_with_the_admins_page_for_users_when_one_is_set() {
        let link = "https://gpu.example.edu/users.md";
        for stage in [Stage::Warned, Stage::Acted, Stage::Cleared] {
            for what in [
                termination("e", "bob"),
                What::Detach(Detach {
                    rules: Default::default(),
                    groups: Default::default(),
                    device: GpuIndex(1),
                    eid: EnvId("e".into()),
                    username: None,
                    charged: Some("bob".into()),
                    owner: Some("bob".into()),
                    working: false,
                }),
            ] {
                let e = event(stage, what, Some(1));
                let with = say(&e, Medium::Chat, Some(link));
                let without = say(&e, Medium::Chat, None);
                assert_eq!(
                    with.body,
                    format!(
                        "{}What the rules are and what you can do: {link}\n",
                        without.body
                    )
                );
                assert!(!without.body.contains("What the rules are"));
            }
        }
    }

    #[test]
    fn user_text_is_escaped_for_each_medium() {
        let hostile = "x\u{1b}[2J\n<!channel> `rm` & *b*\u{202e}";
        let e = event(Stage::Warned, termination(hostile, "alice"), Some(1));
        let plain = say(&e, Medium::Plain, None);
        assert!(!plain.body.contains('\u{1b}') && !plain.body.contains('\u{202e}'));
        assert_eq!(plain.body.lines().count(), 3, "{}", plain.body);
        assert!(
            plain.body.contains(r"x\u{1b}[2J\n<!channel>"),
            "{}",
            plain.body
        );
        let chat = say(&e, Medium::Chat, None);
        assert!(!chat.body.contains("<!channel>") && !chat.body.contains('\u{1b}'));
        assert!(
            chat.body
                .contains(r"`x\u{1b}[2J\n&lt;!channel&gt; 'rm' &amp; *b*\u{202e}`"),
            "{}",
            chat.body
        );
    }
}
