//! A running host agent and the exchange of one request for one answer
//! with it, whatever carries its pipes: an SSH channel (`host::ssh`) or a
//! child of ours on this machine (`host::local`). Starting an agent sends
//! it its own text and a hello; an agent that fails, ends or overruns a
//! deadline is ended (what it said on stderr, and how it ended, are
//! reported) and a new one is started for the next request.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::protocol::{self, Answer, Hello, Request};
use super::HostError;

/// Exit statuses of an agent, or of the wrapper that bounds a command on a
/// host, when its time limit was hit.
pub const TIMED_OUT: [i32; 2] = [124, 137];

/// The process an agent runs as.
#[derive(Debug)]
pub enum Process {
    /// On a remote host, over its SSH master.
    Ssh(openssh::Child<Arc<openssh::Session>>),
    /// On this machine.
    Local(tokio::process::Child),
}

type Reader = Pin<Box<dyn AsyncRead + Send + Sync>>;
type Writer = Pin<Box<dyn AsyncWrite + Send + Sync>>;

/// A running agent that answers one request at a time.
pub struct Agent {
    process: Process,
    stdin: Writer,
    stdout: BufReader<Reader>,
    stderr: Option<Reader>,
    /// What it said of itself when it started.
    pub hello: Hello,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("process", &self.process)
            .field("hello", &self.hello)
            .finish_non_exhaustive()
    }
}

impl Process {
    /// Takes its three pipes (all piped when it was started).
    fn pipes(&mut self) -> Option<(Writer, Reader, Reader)> {
        match self {
            Process::Ssh(c) => Some((
                Box::pin(c.stdin().take()?),
                Box::pin(c.stdout().take()?),
                Box::pin(c.stderr().take()?),
            )),
            Process::Local(c) => Some((
                Box::pin(c.stdin.take()?),
                Box::pin(c.stdout.take()?),
                Box::pin(c.stderr.take()?),
            )),
        }
    }

    /// How it ended, if it has within `wait` (a local one is killed then).
    async fn status(self, wait: Duration) -> Option<std::process::ExitStatus> {
        match self {
            Process::Ssh(c) => tokio::time::timeout(wait, c.wait()).await.ok()?.ok(),
            Process::Local(mut c) => match tokio::time::timeout(wait, c.wait()).await {
                Ok(status) => status.ok(),
                Err(_) => {
                    let _ = c.start_kill();
                    tokio::time::timeout(wait, c.wait()).await.ok()?.ok()
                }
            },
        }
    }
}

impl Agent {
    /// Starts the agent `process` runs (python with [`protocol::bootstrap`],
    /// its three pipes piped): sends it its text and a hello, within
    /// `deadline`. `what` names the step in errors; `limit` is the
    /// host-side limit of a request, for reports.
    ///
    /// # Errors
    /// It ended, broke the protocol, or speaks another version.
    pub async fn start(
        mut process: Process,
        what: &str,
        deadline: Duration,
        limit: Duration,
    ) -> Result<Agent, HostError> {
        let Some((stdin, stdout, stderr)) = process.pipes() else {
            return Err(HostError::Agent {
                error: std::io::Error::other("its pipes were not set up"),
                said: String::new(),
            });
        };
        let mut agent = Agent {
            process,
            stdin,
            stdout: BufReader::new(stdout),
            stderr: Some(stderr),
            hello: Hello {
                protocol: 0,
                python: String::new(),
                pidfd: false,
                euid: u32::MAX,
            },
        };
        let hello = async {
            agent.stdin.write_all(protocol::AGENT.as_bytes()).await?;
            agent.exchange(&Request::hello()).await
        };
        let answer = match tokio::time::timeout(deadline, hello).await {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => return Err(agent.end(what, e, limit).await),
            Err(_) => {
                return Err(HostError::Timeout {
                    command: format!("{what} (starting the agent)"),
                    after: deadline,
                })
            }
        };
        agent.hello = match answer.status {
            protocol::Status::Done => Hello::read(&answer.body)?,
            protocol::Status::Failed => {
                let f = protocol::Failure::read(&answer.body)?;
                return Err(HostError::Remote {
                    fail: f.fail,
                    message: f.message,
                });
            }
        };
        Ok(agent)
    }

    /// Writes `request`, reads one answer (`@<status> <length>\n` + body);
    /// the body grows as its bytes come, never from what the agent
    /// announces.
    ///
    /// # Errors
    /// The pipes failed, the agent ended, or it broke the framing.
    pub async fn exchange(&mut self, request: &Request) -> std::io::Result<Answer> {
        self.stdin.write_all(&request.encode()).await?;
        self.stdin.flush().await?;
        let mut header = String::new();
        (&mut self.stdout).take(64).read_line(&mut header).await?;
        if header.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the agent ended",
            ));
        }
        let (status, len) = protocol::answer_header(&header)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let mut body = Vec::new();
        (&mut self.stdout).take(len).read_to_end(&mut body).await?;
        if (body.len() as u64) < len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "the agent ended after {} of the {len} bytes it announced",
                    body.len()
                ),
            ));
        }
        Ok(Answer { status, body })
    }

    /// Ends an agent that failed with `error` while doing `what`: closes
    /// its stdin, reads what it said on stderr and how it ended (briefly),
    /// for the report. An agent killed at its time limit is a timeout.
    pub async fn end(mut self, what: &str, error: std::io::Error, limit: Duration) -> HostError {
        drop(self.stdin);
        let mut said = Vec::new();
        if let Some(stderr) = self.stderr.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                stderr.take(1 << 16).read_to_end(&mut said),
            )
            .await;
        }
        let said = String::from_utf8_lossy(&said);
        let last = said
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string();
        match self.process.status(Duration::from_secs(1)).await {
            Some(status) if status.code().is_some_and(|c| TIMED_OUT.contains(&c)) => {
                HostError::Timeout {
                    command: format!("{what} (killed on the host)"),
                    after: limit,
                }
            }
            Some(status) if !status.success() => HostError::Command {
                command: what.to_string(),
                status: status.to_string(),
                output: last,
            },
            _ => HostError::Agent { error, said: last },
        }
    }

    /// Ends it: its stdin closes (it ends at the end of its input); a local
    /// one is killed if it has not within a second, and reaped.
    pub async fn close(self) {
        drop(self.stdin);
        let _ = self.process.status(Duration::from_secs(1)).await;
    }
}

/// Answers `request` with the agent in `slot`, started by `start` if there
/// is none, all within `deadline`. An agent that fails, ends or overruns
/// the deadline is ended and the slot emptied: the next request starts a
/// new one. The agent is out of the slot while it answers, so that a
/// caller that gives up on the answer (a timeout, a signal) drops it with
/// its half-read answer, never leaving it for the next request to read.
/// `limit`: the host-side limit of a request, for reports.
///
/// # Errors
/// Starting failed, the agent failed or ended (with what it said), or the
/// deadline passed.
pub async fn ask<F>(
    slot: &mut Option<Agent>,
    start: F,
    request: &Request,
    deadline: Duration,
    limit: Duration,
) -> Result<Answer, HostError>
where
    F: std::future::Future<Output = Result<Agent, HostError>>,
{
    let what = request.name();
    let started = tokio::time::Instant::now();
    if slot.is_none() {
        *slot = Some(tokio::time::timeout(deadline, start).await.map_err(|_| {
            HostError::Timeout {
                command: format!("{what} (starting the agent)"),
                after: deadline,
            }
        })??);
    }
    let left = deadline.saturating_sub(started.elapsed());
    let mut agent = slot.take().expect("started just above");
    match tokio::time::timeout(left, agent.exchange(request)).await {
        Ok(Ok(answer)) => {
            *slot = Some(agent);
            Ok(answer)
        }
        Ok(Err(e)) => Err(agent.end(what, e, limit).await),
        Err(_) => {
            agent.close().await;
            Err(HostError::Timeout {
                command: what.to_string(),
                after: deadline,
            })
        }
    }
}
