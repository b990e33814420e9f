//! A live host: our agent, reached over a transport (this machine's pipes,
//! or an SSH host's master). What the agent is told of its host is one
//! [`AgentSpec`]; the steps (a snapshot, signals, detaches, notes,
//! `doctor`) are written once here, over the transport's `ask`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::answers;
use super::facts::{self, Facts};
use super::fence::Fencing;
use super::local::{self, Pipes};
use super::protocol::{Answer, Hello, Limits, Note, Request};
use super::remote::{AgentLifetime, Ssh};
use super::ssh::{Connection, HostSpec, SshOptions};
use super::{parsed, Fetched, HostError, Parser};
use crate::error;
use crate::model::HostId;
use crate::outcome::{Outcome, TerminateResult};
use crate::plan::{HostPlan, Signal, Termination};
use crate::snapshot::assemble::ParsedState;

/// What our agent is told of the host it answers for, whatever carries
/// its requests.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    /// Its name in reports.
    pub id: HostId,
    /// genv's state directory there.
    pub genv_dir: String,
    /// Where its procfs is mounted.
    pub proc_root: String,
    /// Its nvidia-smi command, as words.
    pub nvidia_smi: Vec<String>,
    /// `--max-records`.
    pub max_records: usize,
    /// The groups whose members snapshots say (group exemptions, caps).
    pub groups: Vec<String>,
    /// Whether snapshots say how busy GPUs and processes are (idle rule).
    pub utilization: bool,
    /// The epoch its snapshots and actions carry (high availability).
    pub fencing: Fencing,
    /// Its state files as parsed last cycle.
    pub parsed: Arc<Mutex<ParsedState>>,
}

impl AgentSpec {
    /// The host `id` with genv's state in `genv_dir`, nvidia-smi on its
    /// PATH, and the defaults.
    pub fn new(id: HostId, genv_dir: String) -> Self {
        AgentSpec {
            id,
            genv_dir,
            proc_root: "/proc".into(),
            nvidia_smi: vec!["nvidia-smi".into()],
            max_records: crate::snapshot::genv::DEFAULT_MAX_RECORDS,
            groups: Vec::new(),
            utilization: false,
            fencing: Fencing::default(),
            parsed: Arc::default(),
        }
    }

    /// Whether `other` tells the agent the same.
    fn same_as(&self, other: &AgentSpec) -> bool {
        self.id == other.id
            && self.genv_dir == other.genv_dir
            && self.proc_root == other.proc_root
            && self.nvidia_smi == other.nvidia_smi
            && self.max_records == other.max_records
            && self.groups == other.groups
            && self.utilization == other.utilization
    }
}

/// What carries the agent's requests.
// One per host, inside a boxed host: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Transport {
    /// This machine: the agent a child of ours, over pipes.
    Local(Pipes),
    /// A remote host: the agent under its sudo, over its SSH master.
    Ssh(Ssh),
}

impl Transport {
    /// Whether `other` reaches the host the same way.
    fn same_as(&self, other: &Transport) -> bool {
        match (self, other) {
            (Transport::Local(a), Transport::Local(b)) => a.same_as(b),
            (Transport::Ssh(a), Transport::Ssh(b)) => a.same_as(b),
            _ => false,
        }
    }

    /// The limits of each request there.
    fn limits(&self) -> Limits {
        match self {
            Transport::Local(p) => p.limits(),
            Transport::Ssh(s) => s.limits(),
        }
    }

    /// Asks the agent (started if needed) to carry out `request`.
    async fn ask(&self, request: &Request) -> Result<Answer, HostError> {
        match self {
            Transport::Local(p) => p.ask(request).await,
            Transport::Ssh(s) => s.ask(request).await,
        }
    }

    /// What the running agent said of itself, if one runs.
    async fn hello(&self) -> Option<Hello> {
        match self {
            Transport::Local(p) => p.hello().await,
            Transport::Ssh(s) => s.conn.hello().await,
        }
    }
}

/// A host our agent answers for.
#[derive(Debug)]
pub struct LiveHost {
    pub agent: AgentSpec,
    pub via: Transport,
}

impl LiveHost {
    /// This machine with genv's defaults, from the environment; each
    /// request within `timeout`.
    pub fn this_machine(timeout: Duration) -> Self {
        LiveHost::local(local::hostname(), local::state_dir_from_env(), timeout)
    }

    /// This machine, named `id`, with genv's state in `state_dir`.
    pub fn local(id: HostId, state_dir: PathBuf, timeout: Duration) -> Self {
        LiveHost {
            agent: AgentSpec::new(id, state_dir.display().to_string()),
            via: Transport::Local(Pipes::new(timeout)),
        }
    }

    /// The host `spec` names, reached over SSH with `ssh`'s options; each
    /// request within `command_timeout`.
    pub fn ssh(
        spec: HostSpec,
        ssh: Arc<SshOptions>,
        command_timeout: Duration,
        lifetime: AgentLifetime,
    ) -> Self {
        let mut agent = AgentSpec::new(spec.id.clone(), spec.genv_dir.clone());
        agent.nvidia_smi.clone_from(&spec.nvidia_smi);
        LiveHost {
            agent,
            via: Transport::Ssh(Ssh {
                conn: Connection::new(spec),
                ssh,
                command_timeout,
                lifetime,
            }),
        }
    }

    /// Its name in reports.
    pub fn id(&self) -> &HostId {
        &self.agent.id
    }

    /// Whether `other` is the same host reached the same way (a reloaded
    /// configuration keeps it, and its connection).
    pub fn same_as(&self, other: &LiveHost) -> bool {
        self.agent.same_as(&other.agent) && self.via.same_as(&other.via)
    }

    /// The limits of each request there.
    pub fn limits(&self) -> Limits {
        self.via.limits()
    }

    /// [`Transport::ask`], and a refusal for an older epoch noted in the
    /// fence.
    async fn asked(&self, request: &Request) -> Result<Answer, HostError> {
        let answer = self.via.ask(request).await;
        self.agent.fencing.observe(self.id(), &answer);
        answer
    }

    /// See [`Host::fetch`](super::Host::fetch): the agent's frames.
    ///
    /// # Errors
    /// The transport or the agent failed, or a step failed on the host.
    pub async fn fetch(&self) -> Result<Fetched, HostError> {
        let a = &self.agent;
        let request = Request::snapshot(
            &a.genv_dir,
            &a.nvidia_smi,
            self.limits(),
            a.max_records,
            &a.proc_root,
            &a.groups,
            a.utilization,
        )
        .fenced(a.fencing.current());
        answers::fetched(self.asked(&request).await?)
    }

    /// What turns [`LiveHost::fetch`] into a snapshot; its errors name the
    /// host (this machine's: its state directory).
    pub fn parser(&self) -> Parser {
        let source = match &self.via {
            Transport::Local(_) => self.agent.genv_dir.clone(),
            Transport::Ssh(_) => self.agent.id.0.to_string(),
        };
        Parser::new(
            source,
            Arc::clone(&self.agent.parsed),
            self.agent.max_records,
        )
    }

    /// See [`Host::execute`](super::Host::execute): all terminations (the
    /// start times re-checked by the agent right before each signal), then
    /// all detaches, genv's order; one outcome per action.
    pub async fn execute(&self, plan: &HostPlan) -> Vec<Outcome> {
        if let Err(why) = self.agent.fencing.may_act(std::time::Instant::now()) {
            return crate::outcome::failed(self.id(), plan, &why.to_string());
        }
        let terminated = self.signal(&plan.terminate, Signal::Term).await;
        let pairs: Vec<(u32, String)> = plan
            .detach
            .iter()
            .map(|d| (d.device.0, d.eid.0.to_string()))
            .collect();
        let detached = if pairs.is_empty() {
            Vec::new()
        } else {
            let request = Request::detach(&self.agent.genv_dir, &pairs, self.limits())
                .fenced(self.agent.fencing.current());
            answers::detached(self.id(), self.asked(&request).await, pairs.len())
        };
        answers::outcomes(self.id(), plan, terminated, detached)
    }

    /// See [`Host::tell`](super::Host::tell).
    ///
    /// # Errors
    /// The transport or the agent failed, or the agent refused the notes.
    pub async fn tell(&self, notes: Vec<Note>) -> Result<Vec<u32>, HostError> {
        let count = notes.len();
        let request = Request::tell(notes, self.limits(), &self.agent.proc_root);
        answers::told(self.via.ask(&request).await?, count)
    }

    /// See [`Host::escalate`](super::Host::escalate).
    pub async fn escalate(&self, terminations: &[Termination]) -> Vec<Outcome> {
        if let Err(why) = self.agent.fencing.may_act(std::time::Instant::now()) {
            return crate::outcome::failed_kills(self.id(), terminations, &why.to_string());
        }
        self.signal(terminations, Signal::Kill)
            .await
            .into_iter()
            .zip(terminations)
            .map(|(outcome, t)| Outcome::Kill {
                host: self.id().clone(),
                pid: t.pid,
                outcome,
            })
            .collect()
    }

    /// Sends `signal` to each of `terminations` whose start time still
    /// matches (re-checked by the agent right before, through a pidfd
    /// where it can).
    async fn signal(&self, terminations: &[Termination], signal: Signal) -> Vec<TerminateResult> {
        let a = &self.agent;
        match Request::terminate(terminations, signal, self.limits(), &a.proc_root) {
            Some(request) => {
                let request = request.fenced(a.fencing.current());
                answers::terminated(self.asked(&request).await, terminations)
            }
            None => answers::terminated_blind(terminations),
        }
    }

    /// Facts for `doctor`: how the host was reached (SSH: the connection,
    /// then sudo; each step only if the one before went through), our
    /// agent's account of the host, and a real snapshot.
    pub async fn doctor(&self) -> Facts {
        let mut f = match &self.via {
            Transport::Local(p) => p.facts(self.id()),
            Transport::Ssh(s) => match s.reach().await {
                Ok(f) => f,
                Err(f) => return *f,
            },
        };
        let a = &self.agent;
        let request = Request::doctor(&a.genv_dir, &a.nvidia_smi, self.limits(), a.fencing.dir());
        let asked = std::time::SystemTime::now();
        let answer = self
            .via
            .ask(&request)
            .await
            .and_then(|a| answers::doctor_facts(&a));
        let answered = std::time::SystemTime::now();
        f.hello = self.via.hello().await;
        match &self.via {
            Transport::Local(p) => {
                f.root = Some(match (&answer, &f.hello) {
                    (Ok(a), _) => a.euid == 0,
                    (_, Some(h)) => h.euid == 0,
                    _ => rustix::process::geteuid().is_root(),
                });
                f.agent = Some(answer.map_err(|e| {
                    format!("{} could not run the agent: {}", p.python, error::chain(&e))
                }));
            }
            Transport::Ssh(_) => {
                if let Ok(a) = &answer {
                    f.skew = Some(a.time - (secs(asked) + secs(answered)) / 2.0);
                }
                f.agent = Some(answer.map_err(|e| error::chain(&e)));
            }
        }
        f.snapshot = Some(
            async { parsed(self.fetch().await?, self.parser()).await }
                .await
                .map_err(|e| error::chain(&e))
                .and_then(|s| facts::snapshot_counts(&s)),
        );
        f
    }

    /// How long a new connection took to come up this cycle, if one was
    /// opened.
    pub fn take_connect_time(&self) -> Option<Duration> {
        match &self.via {
            Transport::Ssh(s) => s.conn.take_connect_time(),
            Transport::Local(_) => None,
        }
    }

    /// Ends what it holds open: our agent, and an SSH master (which
    /// `--control-persist` leaves for the next run).
    ///
    /// # Errors
    /// The master did not close when asked and was killed.
    pub async fn close(&self) -> Result<(), HostError> {
        match &self.via {
            Transport::Local(p) => {
                p.close().await;
                Ok(())
            }
            Transport::Ssh(s) => s.close().await,
        }
    }
}

/// Seconds since the Unix epoch, as the agent tells its clock.
fn secs(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
