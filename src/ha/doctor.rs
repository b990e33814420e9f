//! `doctor --ha-etcd ...`: etcd as the election needs it. Each endpoint
//! answers (with its version and its Raft leader), a lease can be granted
//! and revoked, and who holds the election key, with which epoch. Each
//! host's fence is checked with the host (see [`crate::doctor`]).

use etcd_client::Client;

use super::election::connect;
use super::HaSpec;
use crate::doctor::{Check, Status};

fn check(name: &'static str, status: Status, detail: String, fix: Option<&str>) -> Check {
    Check {
        check: name,
        status,
        detail,
        fix: fix.map(str::to_string),
    }
}

/// The checks of etcd, in the order they depend on each other.
pub async fn checks(spec: &HaSpec) -> Vec<Check> {
    let timeout = spec
        .request_timeout()
        .max(std::time::Duration::from_secs(2));
    let mut out = Vec::new();
    // Each endpoint alone: a cluster with one member down still elects.
    let mut up = 0;
    let mut said = Vec::new();
    for url in &spec.endpoints {
        let one = HaSpec {
            endpoints: vec![url.clone()],
            ..spec.clone()
        };
        let status = async {
            let mut c = connect(&one).await.map_err(|e| crate::error::chain(&e))?;
            c.status().await.map_err(|e| e.to_string())
        };
        match tokio::time::timeout(timeout, status).await {
            Ok(Ok(s)) => {
                up += 1;
                said.push(format!(
                    "{url}: etcd {}, {}",
                    s.version(),
                    if s.leader() == 0 {
                        "no Raft leader".to_string()
                    } else {
                        format!("Raft leader {:x}", s.leader())
                    }
                ));
            }
            Ok(Err(e)) => said.push(format!("{url}: {e}")),
            Err(_) => said.push(format!(
                "{url}: no answer within {}",
                humantime::format_duration(timeout)
            )),
        }
    }
    let n = spec.endpoints.len();
    out.push(match up {
        0 => check(
            "etcd",
            Status::Fail,
            said.join("; "),
            Some("start etcd, or fix --ha-etcd (client URLs, TLS, --ha-user)"),
        ),
        u if u < n => check(
            "etcd",
            Status::Warn,
            format!("{u} of {n} answer: {}", said.join("; ")),
            Some("a member is down: the cluster elects while a majority answers"),
        ),
        _ => check("etcd", Status::Ok, said.join("; "), None),
    });
    if up == 0 {
        for name in ["lease", "election"] {
            out.push(check(
                name,
                Status::Skip,
                "etcd does not answer".into(),
                None,
            ));
        }
        return out;
    }
    let client = match connect(spec).await {
        Ok(c) => c,
        Err(e) => {
            out.push(check("lease", Status::Fail, crate::error::chain(&e), None));
            return out;
        }
    };
    out.push(lease_check(client.clone(), spec, timeout).await);
    out.push(election_check(client, spec, timeout).await);
    out
}

/// A lease of the election's time to live, granted and revoked.
async fn lease_check(mut c: Client, spec: &HaSpec, timeout: std::time::Duration) -> Check {
    let ttl = i64::try_from(spec.ttl_secs().max(2)).unwrap_or(i64::MAX);
    let tried = async {
        let g = c.lease_grant(ttl, None).await?;
        c.lease_revoke(g.id()).await?;
        Ok::<i64, etcd_client::Error>(g.ttl())
    };
    match tokio::time::timeout(timeout * 2, tried).await {
        Ok(Ok(granted)) => check(
            "lease",
            Status::Ok,
            format!("a {granted} s lease granted and revoked"),
            None,
        ),
        Ok(Err(e)) => check(
            "lease",
            Status::Fail,
            e.to_string(),
            Some("with auth on, --ha-user's role needs leases and read-write on the election key"),
        ),
        Err(_) => check("lease", Status::Fail, "etcd did not answer".into(), None),
    }
}

/// Who holds the election key now, and the epoch they act with.
async fn election_check(mut c: Client, spec: &HaSpec, timeout: std::time::Duration) -> Check {
    let key = spec.election_key();
    match tokio::time::timeout(timeout, c.get(key.as_bytes(), None)).await {
        Ok(Ok(r)) => match r.kvs().first() {
            Some(kv) => check(
                "election",
                Status::Ok,
                format!(
                    "{}: {} leads, epoch {} (lease {:x})",
                    key,
                    String::from_utf8_lossy(kv.value()),
                    kv.create_revision(),
                    kv.lease()
                ),
                None,
            ),
            None => check(
                "election",
                Status::Warn,
                format!("{key}: nobody leads now"),
                Some("start an enforcer with the same --ha-etcd and --ha-key"),
            ),
        },
        Ok(Err(e)) => check(
            "election",
            Status::Fail,
            e.to_string(),
            Some("with auth on, --ha-user's role needs read on the election key"),
        ),
        Err(_) => check("election", Status::Fail, "etcd did not answer".into(), None),
    }
}
