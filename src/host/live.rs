//! What every live host does the same way, whatever carries our agent's
//! requests (this machine's pipes, or an SSH host's master): a snapshot,
//! signals, detaches. A transport says only how to reach the agent and
//! where things are on its host ([`Live`]); the steps are written once.

use std::future::Future;
use std::sync::{Arc, Mutex};

use super::fence::Fencing;
use super::protocol::{Answer, Limits, Note, Request};
use super::HostError;
use super::{Fetched, Parser};
use crate::model::HostId;
use crate::outcome::{Outcome, TerminateResult};
use crate::plan::{HostPlan, Signal, Termination};
use crate::snapshot::assemble::ParsedState;

/// A host our agent answers for.
pub trait Live: Sync {
    /// Its name in reports.
    fn id(&self) -> &HostId;
    /// genv's state directory there.
    fn genv_dir(&self) -> String;
    /// Where its procfs is mounted.
    fn proc_root(&self) -> String;
    /// Its nvidia-smi command.
    fn nvidia_smi(&self) -> &[String];
    /// `--max-records`.
    fn max_records(&self) -> usize;
    /// The groups whose members snapshots say (group exemptions, caps).
    fn groups(&self) -> &[String];
    /// Whether snapshots say how busy GPUs and processes are (idle rule).
    fn utilization(&self) -> bool;
    /// The limits of each request there.
    fn limits(&self) -> Limits;
    /// The epoch its snapshots and actions carry (high availability).
    fn fencing(&self) -> &Fencing;
    /// What parse errors name (the host, or this machine's state directory).
    fn source(&self) -> String;
    /// Its state files as parsed last cycle.
    fn parsed(&self) -> &Arc<Mutex<ParsedState>>;
    /// Asks the agent (started if needed) to carry out `request`.
    fn ask(&self, request: &Request) -> impl Future<Output = Result<Answer, HostError>> + Send;

    /// [`Live::ask`], and a refusal for an older epoch noted in
    /// [`Live::fencing`].
    fn asked(&self, request: &Request) -> impl Future<Output = Result<Answer, HostError>> + Send {
        async move {
            let answer = self.ask(request).await;
            self.fencing().observe(self.id(), &answer);
            answer
        }
    }

    /// See [`Host::fetch`](super::Host::fetch): the agent's frames.
    ///
    /// # Errors
    /// The transport or the agent failed, or a step failed on the host.
    fn fetch(&self) -> impl Future<Output = Result<Fetched, HostError>> + Send {
        async move {
            let request = Request::snapshot(
                &self.genv_dir(),
                self.nvidia_smi(),
                self.limits(),
                self.max_records(),
                &self.proc_root(),
                self.groups(),
                self.utilization(),
            )
            .fenced(self.fencing().current());
            super::fetched(self.asked(&request).await?)
        }
    }

    /// What turns [`Live::fetch`] into a snapshot.
    fn parser(&self) -> Parser {
        Parser::new(self.source(), Arc::clone(self.parsed()), self.max_records())
    }

    /// See [`Host::execute`](super::Host::execute): all terminations (the
    /// start times re-checked by the agent right before each signal), then
    /// all detaches, genv's order; one outcome per action.
    fn execute(&self, plan: &HostPlan) -> impl Future<Output = Vec<Outcome>> + Send {
        async move {
            if let Err(why) = self.fencing().may_act(std::time::Instant::now()) {
                return crate::outcome::failed(self.id(), plan, &why);
            }
            let terminated = signal(self, &plan.terminate, Signal::Term).await;
            let pairs: Vec<(u32, String)> = plan
                .detach
                .iter()
                .map(|d| (d.device.0, d.eid.0.clone()))
                .collect();
            let detached = if pairs.is_empty() {
                Vec::new()
            } else {
                let request = Request::detach(&self.genv_dir(), &pairs, self.limits())
                    .fenced(self.fencing().current());
                super::detached(self.id(), self.asked(&request).await, pairs.len())
            };
            super::outcomes(self.id(), plan, terminated, detached)
        }
    }

    /// See [`Host::tell`](super::Host::tell).
    ///
    /// # Errors
    /// The transport or the agent failed, or the agent refused the notes.
    fn tell(&self, notes: Vec<Note>) -> impl Future<Output = Result<Vec<u32>, HostError>> + Send {
        async move {
            let count = notes.len();
            let request = Request::tell(notes, self.limits(), &self.proc_root());
            super::told(self.ask(&request).await?, count)
        }
    }

    /// See [`Host::escalate`](super::Host::escalate).
    fn escalate(&self, terminations: &[Termination]) -> impl Future<Output = Vec<Outcome>> + Send {
        async move {
            if let Err(why) = self.fencing().may_act(std::time::Instant::now()) {
                return crate::outcome::failed_kills(self.id(), terminations, &why);
            }
            signal(self, terminations, Signal::Kill)
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
    }
}

/// Sends `signal` to each of `terminations` whose start time still matches
/// (re-checked by the agent right before, through a pidfd where it can).
async fn signal<H: Live + ?Sized>(
    host: &H,
    terminations: &[Termination],
    signal: Signal,
) -> Vec<TerminateResult> {
    match Request::terminate(terminations, signal, host.limits(), &host.proc_root()) {
        Some(request) => {
            let request = request.fenced(host.fencing().current());
            super::terminated(host.asked(&request).await, terminations)
        }
        None => super::terminated_blind(terminations),
    }
}
