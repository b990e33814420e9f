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
    out.push(election_check(client.clone(), spec, timeout).await);
    out.push(configs_check(client, spec, timeout).await);
    out
}

/// The configuration each live box runs (its digest): the same on every
/// box, or which differ.
async fn configs_check(mut c: Client, spec: &HaSpec, timeout: std::time::Duration) -> Check {
    let prefix = spec.configs_prefix();
    let get = c.get(
        prefix.as_bytes(),
        Some(etcd_client::GetOptions::new().with_prefix()),
    );
    let kvs = match tokio::time::timeout(timeout, get).await {
        Ok(Ok(r)) => r.kvs().to_vec(),
        Ok(Err(e)) => return check("configuration", Status::Fail, e.to_string(), None),
        Err(_) => {
            return check(
                "configuration",
                Status::Fail,
                "etcd did not answer".into(),
                None,
            )
        }
    };
    let boxes: Vec<(String, String)> = kvs
        .iter()
        .map(|kv| {
            let name = kv.key().strip_prefix(prefix.as_bytes()).unwrap_or(kv.key());
            (
                String::from_utf8_lossy(name).into_owned(),
                String::from_utf8_lossy(kv.value()).into_owned(),
            )
        })
        .collect();
    let said = boxes
        .iter()
        .map(|(n, d)| format!("{n}: {d}"))
        .collect::<Vec<_>>()
        .join(", ");
    let digests: std::collections::BTreeSet<&str> = boxes.iter().map(|(_, d)| d.as_str()).collect();
    match digests.len() {
        0 => check(
            "configuration",
            Status::Warn,
            "no box runs now".into(),
            Some("start the enforcers with the same --ha-etcd and --ha-key"),
        ),
        1 => check(
            "configuration",
            Status::Ok,
            format!("every box runs the same configuration ({said})"),
            None,
        ),
        n => check(
            "configuration",
            Status::Warn,
            format!("{n} configurations among the boxes: {said}"),
            Some("run the same configuration file on every box (only ha-name and shard may differ); `genv-enforce config check --effective` on each shows its values"),
        ),
    }
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
