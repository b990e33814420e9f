//! Prometheus metrics (`--metrics-listen ADDR`): what each cycle's report
//! says, as counters and gauges, served in the OpenMetrics text format
//! over HTTP (`GET /metrics`).

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::outcome::{DetachResult, Outcome, TerminateResult};
use crate::report::CycleReport;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostLabel {
    host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ViolationLabels {
    rule: String,
    /// Empty for the cluster-wide per-user cap.
    host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
    host: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NotifyLabels {
    /// `mail` or `webhook`.
    channel: String,
    /// `sent`, `nobody`, `failed`, `dropped`, `rate_limited`.
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UserLabel {
    user: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    host: String,
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    host: String,
    /// [`FailureKind::name`](crate::model::FailureKind::name).
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: String,
}

/// Every metric we keep.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    cycles: Counter,
    duration: Histogram,
    up: Family<HostLabel, Gauge>,
    snapshot_seconds: Family<HostLabel, Gauge<f64, AtomicU64>>,
    violations: Family<ViolationLabels, Counter>,
    actions: Family<ActionLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    host_failures: Family<FailureLabels, Counter>,
    user_devices: Family<UserLabel, Gauge>,
    user_memory: Family<UserLabel, Gauge>,
    unowned_memory: Family<GpuLabels, Gauge>,
    mps_memory: Family<GpuLabels, Gauge>,
    degraded: Family<HostLabel, Gauge>,
    unjudged: Family<HostLabel, Gauge>,
    notifications: Family<NotifyLabels, Counter>,
    last_success: Gauge<f64, AtomicU64>,
    ha_leader: Gauge,
    ha_epoch: Gauge,
    audit_degraded: Gauge,
    ha_takeovers: Counter,
    ha_fenced: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric, at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("genv_enforce");
        let m = Metrics {
            cycles: Counter::default(),
            duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            up: Family::default(),
            snapshot_seconds: Family::default(),
            violations: Family::default(),
            actions: Family::default(),
            errors: Family::default(),
            host_failures: Family::default(),
            user_devices: Family::default(),
            user_memory: Family::default(),
            unowned_memory: Family::default(),
            mps_memory: Family::default(),
            degraded: Family::default(),
            unjudged: Family::default(),
            notifications: Family::default(),
            last_success: Gauge::default(),
            ha_leader: Gauge::default(),
            ha_epoch: Gauge::default(),
            audit_degraded: Gauge::default(),
            ha_takeovers: Counter::default(),
            ha_fenced: Counter::default(),
            registry: Registry::default(),
        };
        registry.register("cycles", "Enforcement cycles run", m.cycles.clone());
        registry.register(
            "cycle_duration_seconds",
            "Wall time of a cycle",
            m.duration.clone(),
        );
        registry.register(
            "host_up",
            "Whether the host's last snapshot succeeded",
            m.up.clone(),
        );
        registry.register(
            "host_snapshot_seconds",
            "How long the host's last snapshot took (connection included)",
            m.snapshot_seconds.clone(),
        );
        registry.register(
            "violations",
            "Violations found, by rule and host",
            m.violations.clone(),
        );
        registry.register(
            "actions",
            "Actions carried out (or planned in a dry run), by action, host and result",
            m.actions.clone(),
        );
        registry.register("errors", "Failures, by kind", m.errors.clone());
        registry.register(
            "host_failures",
            "Failed host snapshots, by host and the kind of step that failed (connect, sudo, timeout, agent, state, lock, nvidia-smi, parse, recorded, internal)",
            m.host_failures.clone(),
        );
        registry.register(
            "user_devices",
            "GPUs the user's processes run on, over all hosts, last cycle",
            m.user_devices.clone(),
        );
        registry.register(
            "user_gpu_memory_bytes",
            "GPU memory the user's processes hold, over all hosts, last cycle",
            m.user_memory.clone(),
        );
        registry.register(
            "unowned_gpu_memory_bytes",
            "GPU memory the driver lists for pids no live process has, by host and GPU, last cycle (never acted on)",
            m.unowned_memory.clone(),
        );
        registry.register(
            "mps_server_gpu_memory_bytes",
            "GPU memory the machine's shared CUDA MPS server holds, by host and GPU, last cycle (overhead: never judged, in no one's count)",
            m.mps_memory.clone(),
        );
        registry.register(
            "host_degraded",
            "Whether the host's genv state could not be used last cycle (only what needs no genv state was judged there)",
            m.degraded.clone(),
        );
        registry.register(
            "unjudged_gpu_processes",
            "GPU processes of the host left unjudged last cycle (their environment or user unknown), each also said in the report",
            m.unjudged.clone(),
        );
        registry.register(
            "notifications",
            "Notifications, by channel and result (sent, nobody to send to, failed, dropped from a full queue, rate_limited)",
            m.notifications.clone(),
        );
        registry.register(
            "last_success_timestamp_seconds",
            "When the last cycle without any failure ended (Unix time)",
            m.last_success.clone(),
        );
        registry.register(
            "ha_leader",
            "High availability: 1 while this box leads (acts), 0 while it follows",
            m.ha_leader.clone(),
        );
        registry.register(
            "ha_epoch",
            "High availability: the epoch of the leader this box knows of (its own while it leads)",
            m.ha_epoch.clone(),
        );
        registry.register(
            "audit_degraded",
            "1 while the audit log cannot be written (a full disk, a read-only file system, a failed sync): actions go on, unrecorded",
            m.audit_degraded.clone(),
        );
        registry.register(
            "ha_takeovers",
            "High availability: times this box became the leader",
            m.ha_takeovers.clone(),
        );
        registry.register(
            "ha_fenced",
            "High availability: times a host's agent refused this box's epoch (another leader acted there) and it stepped down",
            m.ha_fenced.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Where this box stands in the election, before a cycle; `took_over`:
    /// it has just become the leader.
    pub fn standing(&self, s: &crate::ha::Standing, took_over: bool) {
        self.ha_leader.set(i64::from(s.leads()));
        if let Some(e) = s.epoch() {
            self.ha_epoch.set(i64::try_from(e).unwrap_or(i64::MAX));
        }
        if took_over {
            self.ha_takeovers.inc();
        }
    }

    /// Whether the audit log is degraded (cannot be written).
    pub fn audit(&self, degraded: bool) {
        self.audit_degraded.set(i64::from(degraded));
    }

    /// A host's agent refused this box's epoch.
    pub fn fenced(&self) {
        self.ha_fenced.inc();
    }

    /// Counts `n` notifications of `channel` that ended as `result`.
    pub fn notified(&self, channel: &str, result: &str, n: u64) {
        self.notifications
            .get_or_create(&NotifyLabels {
                channel: channel.to_string(),
                result: result.to_string(),
            })
            .inc_by(n);
    }

    /// Counts what a cycle's report says.
    pub fn observe(&self, r: &CycleReport) {
        self.cycles.inc();
        // Users of the last cycle only: one gone is no longer listed.
        self.user_devices.clear();
        self.user_memory.clear();
        for s in &r.usage {
            let label = UserLabel {
                user: s.user.clone(),
            };
            self.user_devices
                .get_or_create(&label)
                .inc_by(i64::from(s.devices));
            self.user_memory
                .get_or_create(&label)
                .inc_by(i64::try_from(s.memory_bytes).unwrap_or(i64::MAX));
        }
        self.unowned_memory.clear();
        self.mps_memory.clear();
        self.unjudged.clear();
        for n in &r.notices {
            if let crate::rules::Notice::UnknownOwner { host, .. } = n {
                self.unjudged
                    .get_or_create(&HostLabel {
                        host: host.0.to_string(),
                    })
                    .inc();
            }
            if let crate::rules::Notice::UnownedMemory {
                host,
                device,
                bytes: Some(b),
                ..
            } = n
            {
                self.unowned_memory
                    .get_or_create(&GpuLabels {
                        host: host.0.to_string(),
                        gpu: device.to_string(),
                    })
                    .inc_by(i64::try_from(*b).unwrap_or(i64::MAX));
            }
            if let crate::rules::Notice::MpsServer {
                host,
                device,
                bytes: Some(b),
                ..
            } = n
            {
                self.mps_memory
                    .get_or_create(&GpuLabels {
                        host: host.0.to_string(),
                        gpu: device.to_string(),
                    })
                    .inc_by(i64::try_from(*b).unwrap_or(i64::MAX));
            }
        }
        if let Some(ms) = r.duration_ms {
            self.duration.observe(ms as f64 / 1000.0);
        }
        for h in &r.hosts {
            let label = HostLabel {
                host: h.host.0.to_string(),
            };
            self.up
                .get_or_create(&label)
                .set(i64::from(h.error.is_none()));
            self.degraded
                .get_or_create(&label)
                .set(i64::from(h.degraded.is_some()));
            if let Some(e) = &h.error {
                self.error("snapshot");
                self.host_failures
                    .get_or_create(&FailureLabels {
                        host: h.host.0.to_string(),
                        kind: e.kind.name().into(),
                    })
                    .inc();
            }
        }
        if let Some(t) = &r.timing {
            for (host, ms) in &t.hosts_ms {
                self.snapshot_seconds
                    .get_or_create(&HostLabel {
                        host: host.0.to_string(),
                    })
                    .set(*ms as f64 / 1000.0);
            }
        }
        for v in &r.violations {
            let host = v
                .finding
                .host()
                .map(|h| h.0.to_string())
                .unwrap_or_default();
            self.violations
                .get_or_create(&ViolationLabels {
                    rule: v.rule.name().into(),
                    host,
                })
                .inc();
        }
        for o in &r.outcomes {
            let (action, host, result) = match o {
                Outcome::Terminate { host, outcome, .. } => {
                    ("terminate", host, term_result(outcome))
                }
                Outcome::Kill { host, outcome, .. } => ("kill", host, term_result(outcome)),
                Outcome::Detach { host, outcome, .. } => ("detach", host, detach_result(outcome)),
            };
            if o.is_error() {
                self.error(action);
            }
            self.actions
                .get_or_create(&ActionLabels {
                    action: action.into(),
                    host: host.0.to_string(),
                    result: result.into(),
                })
                .inc();
        }
        if !r.failed() {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.last_success.set(now);
        }
    }

    fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&ErrorLabels { kind: kind.into() })
            .inc();
    }

    /// The metrics in the OpenMetrics text format.
    pub fn render(&self) -> String {
        let mut text = String::new();
        if encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}

fn term_result(t: &TerminateResult) -> &'static str {
    match t {
        TerminateResult::Signalled => "signalled",
        TerminateResult::DryRun => "dry_run",
        TerminateResult::AlreadyGone => "already_gone",
        TerminateResult::PidReused { .. } => "pid_reused",
        TerminateResult::NoIdentity => "no_identity",
        TerminateResult::PermissionDenied => "permission_denied",
        TerminateResult::Failed { .. } => "failed",
    }
}

fn detach_result(d: &DetachResult) -> &'static str {
    match d {
        DetachResult::Detached => "detached",
        DetachResult::DryRun => "dry_run",
        DetachResult::NotAttached => "not_attached",
        DetachResult::Failed { .. } => "failed",
    }
}

/// At most this many connections are served at once; more are closed as
/// soon as accepted. Enough for a crowd of stalled clients and a scraper.
pub const MAX_CONNECTIONS: usize = 2048;
/// At most this many of them one peer holds (a local user, their sub-uids
/// included, or a remote address): more are closed as soon as accepted.
pub const PER_PEER: usize = 64;
/// A request's head may take this long to arrive, and this many bytes.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
pub const MAX_HEADER_BYTES: usize = 16 << 10;
/// No connection lives longer than this.
const CONNECTION_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The connections each peer holds now.
type Shares = Arc<std::sync::Mutex<std::collections::HashMap<crate::peer::Peer, usize>>>;

/// One connection's part of its peer's share, given back when dropped.
struct Share(Shares, crate::peer::Peer);

impl Share {
    /// A part of `peer`'s share, unless it holds [`PER_PEER`] already.
    fn take(shares: &Shares, peer: crate::peer::Peer) -> Option<Share> {
        let mut held = shares.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(peer.clone()).or_default();
        if *n >= PER_PEER {
            return None;
        }
        *n += 1;
        Some(Share(Arc::clone(shares), peer))
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.1) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.1);
            }
        }
    }
}

/// Serves `metrics` on `listener` until the runtime ends: `GET /metrics`
/// answers the text format, another path 404, another method 405. Any
/// local user can connect, so each connection is bounded: at most
/// [`MAX_CONNECTIONS`] at once and [`PER_PEER`] of one peer (a local user
/// as the kernel names the owner of their socket, or a remote address), a
/// head of at most [`MAX_HEADER_BYTES`] within [`HEADER_TIMEOUT`], and
/// 30 s in all.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    web: Option<Arc<crate::web_config::WebConfig>>,
    view: Option<crate::view_socket::Board>,
) {
    // The view only behind basic authentication (any local user can
    // connect to the port).
    let view = view.filter(|_| web.as_ref().is_some_and(|w| !w.users.is_empty()));
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let shares = Shares::default();
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let peer = crate::peer::of(from, local, std::path::Path::new("/etc/subuid"));
        let Some(share) = Share::take(&shares, peer) else {
            // Its peer's share is full: closed at once.
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Full: closed at once rather than left in the backlog.
            drop(stream);
            continue;
        };
        let metrics = Arc::clone(&metrics);
        let web = web.clone();
        let view = view.clone();
        tokio::spawn(async move {
            let tls = web.as_ref().and_then(|w| w.tls.clone());
            let users = web.filter(|w| !w.users.is_empty());
            let service = service_fn(move |req: Request<Incoming>| {
                let metrics = Arc::clone(&metrics);
                let users = users.clone();
                let view = view.clone();
                async move {
                    if let Some(users) = users {
                        let said = req
                            .headers()
                            .get(hyper::header::AUTHORIZATION)
                            .map(|v| v.as_bytes().to_vec());
                        match users.admission(said.as_deref()).await {
                            crate::web_config::Admission::In => {}
                            crate::web_config::Admission::Out => return Ok(unauthorized()),
                            crate::web_config::Admission::Busy => return Ok(busy()),
                        }
                    }
                    Ok::<_, std::convert::Infallible>(respond(&req, &metrics, view.as_ref()))
                }
            });
            let http = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEADER_BYTES)
                .clone();
            let served = async {
                match tls {
                    // The handshake within the header's time limit.
                    Some(acceptor) => {
                        let Ok(Ok(stream)) =
                            tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await
                        else {
                            return;
                        };
                        let _ = http.serve_connection(TokioIo::new(stream), service).await;
                    }
                    None => {
                        let _ = http.serve_connection(TokioIo::new(stream), service).await;
                    }
                }
            };
            let _ = tokio::time::timeout(CONNECTION_LIMIT, served).await;
            drop((slot, share));
        });
    }
}

/// 503: every credential check is busy.
fn busy() -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(b"Busy\n")));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    r.headers_mut().insert(
        hyper::header::RETRY_AFTER,
        hyper::header::HeaderValue::from_static("1"),
    );
    r
}

/// 401, asking for basic authentication.
fn unauthorized() -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(b"Unauthorized\n")));
    *r.status_mut() = StatusCode::UNAUTHORIZED;
    r.headers_mut().insert(
        hyper::header::WWW_AUTHENTICATE,
        hyper::header::HeaderValue::from_static("Basic realm=\"genv-enforce\""),
    );
    r
}

/// The answer to one request.
fn respond(
    req: &Request<Incoming>,
    metrics: &Metrics,
    view: Option<&crate::view_socket::Board>,
) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, text: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
        *r.status_mut() = status;
        r
    };
    let path = req.uri().path();
    if path != "/metrics" && path != "/view" {
        return plain(StatusCode::NOT_FOUND, "see /metrics or /view\n");
    }
    if req.method() != hyper::Method::GET && req.method() != hyper::Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics or /view\n");
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return r;
    }
    if path == "/view" {
        // The last cycle's view (`status --connect URL`), as the socket
        // serves it.
        let Some(board) = view else {
            return plain(
                StatusCode::NOT_FOUND,
                "/view is served only behind basic authentication (--web.config.file with basic_auth_users); or read --view-socket\n",
            );
        };
        let Some(line) = board.latest() else {
            return plain(StatusCode::SERVICE_UNAVAILABLE, "no cycle has ended yet\n");
        };
        let mut r = Response::new(Full::new(line));
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        return r;
    }
    let mut r = Response::new(Full::new(Bytes::from(metrics.render())));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    r
}

/// Binds `addr` now (a bad address is a usage error, before anything runs).
///
/// # Errors
/// The address cannot be bound.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// How often an endpoint that could not be bound is tried again.
pub const BIND_RETRY: std::time::Duration = std::time::Duration::from_secs(10);

/// `addr` bound for [`serve`].
///
/// # Errors
/// The address cannot be bound (taken, not ours).
pub fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    bind(addr).and_then(tokio::net::TcpListener::from_std)
}

/// Serves `metrics` at `addr` ([`serve`]) on `bound`, or once `addr` can
/// be bound. An address another process holds (any local user can take a
/// port first) never stops enforcement: it is said once, on stderr, and
/// tried again every [`BIND_RETRY`] meanwhile.
pub async fn serve_at(
    addr: SocketAddr,
    mut bound: std::io::Result<tokio::net::TcpListener>,
    metrics: Arc<Metrics>,
    web: Option<Arc<crate::web_config::WebConfig>>,
    view: Option<crate::view_socket::Board>,
) {
    let mut said = false;
    loop {
        match bound {
            Ok(listener) => {
                if said {
                    crate::output::complain(&format!("--metrics-listen {addr}: serving now"));
                }
                return serve(listener, metrics, web, view).await;
            }
            Err(e) if !said => {
                crate::output::complain(&format!(
                    "--metrics-listen {addr}: {e}: enforcing without the metrics endpoint meanwhile, trying again every {} s",
                    BIND_RETRY.as_secs()
                ));
                said = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(BIND_RETRY).await;
        bound = listen(addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assess::statuses;
    use crate::model::{ConnectFailure, FailureKind, HostFailure, HostId, Mode};

    #[test]
    fn failed_hosts_are_counted_by_the_kind_of_step_that_failed() {
        let m = Metrics::new();
        let failed =
            |name: &str, kind| (HostId(name.into()), Err(HostFailure::new(kind, "it broke")));
        let a = statuses(
            1,
            Mode::Remote,
            false,
            vec![
                failed("a", FailureKind::Connect(ConnectFailure::HostKey)),
                failed("b", FailureKind::Sudo),
            ],
        );
        let mut report = CycleReport::new(a, Vec::new(), None);
        report.usage = ["h1", "h2"]
            .into_iter()
            .map(|h| crate::usage::Sample {
                host: HostId(h.into()),
                user: "alice".into(),
                devices: 2,
                memory_bytes: 1 << 30,
                processes: 1,
            })
            .collect();
        report.notices = [(0, 3 << 20), (0, 1 << 20), (1, 5 << 20)]
            .into_iter()
            .map(|(gpu, b)| crate::rules::Notice::UnownedMemory {
                host: HostId("h1".into()),
                device: crate::model::GpuIndex(gpu),
                pid: crate::model::Pid(9),
                bytes: Some(b),
            })
            .collect();
        report.notices.push(crate::rules::Notice::MpsServer {
            host: HostId("h1".into()),
            device: crate::model::GpuIndex(1),
            pid: crate::model::Pid(8),
            user: Some("alice".into()),
            bytes: Some(66 << 20),
        });
        m.observe(&report);
        let text = m.render();
        for line in [
            "genv_enforce_mps_server_gpu_memory_bytes{host=\"h1\",gpu=\"1\"} 69206016",
            "genv_enforce_unowned_gpu_memory_bytes{host=\"h1\",gpu=\"0\"} 4194304",
            "genv_enforce_unowned_gpu_memory_bytes{host=\"h1\",gpu=\"1\"} 5242880",
            "genv_enforce_host_failures_total{host=\"a\",kind=\"host-key\"} 1",
            "genv_enforce_host_failures_total{host=\"b\",kind=\"sudo\"} 1",
            "genv_enforce_errors_total{kind=\"snapshot\"} 2",
            "genv_enforce_host_up{host=\"a\"} 0",
            "genv_enforce_user_devices{user=\"alice\"} 4",
            "genv_enforce_user_gpu_memory_bytes{user=\"alice\"} 2147483648",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        // Next cycle without her: she is no longer listed.
        m.observe(&CycleReport::new(
            statuses(2, Mode::Remote, false, vec![]),
            Vec::new(),
            None,
        ));
        assert!(!m.render().contains("alice"));
        assert!(!m.render().contains("unowned_gpu_memory_bytes{"));
        assert!(!m.render().contains("mps_server_gpu_memory_bytes{"));
    }
}
