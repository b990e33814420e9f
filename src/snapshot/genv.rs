//! genv's JSON: `genv usage snapshot` output and the state files
//! `envs.json` / `devices.json`, into the [`crate::model`] types and back.
//!
//! Unknown fields are ignored; `null`s are accepted where genv writes them.
//! genv's pre-1.0 state layouts (objects keyed by eid/index) are not read.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{memory, nvidia_smi, ParseError};
use crate::model::{
    Attachment, Device, DeviceUsage, Env, EnvId, GpuIndex, HostSnapshot, Memory, Owner, Pid,
    Process, Usage, SMALL,
};

/// genv's default state directory (`$GENV_TMPDIR` overrides it).
pub const DEFAULT_DIR: &str = "/var/tmp/genv";

/// `genv usage snapshot` as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotJson {
    pub processes: ProcessesJson,
    pub envs: EnvsJson,
    pub devices: DevicesJson,
    /// Ours, for replays of the admin rules: `nvidia-smi pmon -c 1 -s u`
    /// as printed (the idle rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pmon: Option<String>,
    /// Ours: `--query-gpu=index,utilization.gpu --format=csv,noheader,nounits`
    /// as printed; with it, the snapshot says how busy its GPUs were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_utilization: Option<String>,
    /// Ours: each user's groups on the host (the group caps).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<String, Vec<String>>,
}

/// The `processes` part of a snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcessesJson {
    pub processes: Vec<ProcessJson>,
}

/// One process. `start_time` and `uid` are ours (genv never writes them).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessJson {
    pub pid: u32,
    pub used_gpu_memory: Vec<UsageJson>,
    pub eid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Ours: `false` for a pid the driver lists that no live process has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alive: Option<bool>,
}

/// Usage of one GPU by one process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsageJson {
    pub index: u32,
    pub gpu_memory: String,
}

/// `envs.json`, and the `envs` part of a snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EnvsJson {
    pub envs: Vec<EnvJson>,
}

/// One environment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnvJson {
    pub eid: String,
    pub uid: u32,
    pub creation: String,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub config: ConfigJson,
    #[serde(default)]
    pub pids: Vec<i64>,
    #[serde(default)]
    pub kernel_ids: Vec<String>,
}

/// An environment's configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConfigJson {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub gpu_memory: Option<String>,
    #[serde(default)]
    pub gpus: Option<u32>,
}

/// `devices.json`, and the `devices` part of a snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DevicesJson {
    pub devices: Vec<DeviceJson>,
}

/// One device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceJson {
    pub index: u32,
    pub total_memory: String,
    #[serde(default)]
    pub attachments: Vec<AttachmentJson>,
}

/// One attachment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachmentJson {
    pub eid: String,
    #[serde(default)]
    pub gpu_memory: Option<String>,
    pub time: String,
}

fn deserialize<T: DeserializeOwned>(text: &str, source: &str) -> Result<T, ParseError> {
    // The common case, fast; the path of what is wrong only when something is.
    if let Ok(value) = serde_json::from_str(text) {
        return Ok(value);
    }
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let location = if path == "." {
            "top level".to_string()
        } else {
            path
        };
        ParseError::new(source, location, e.into_inner().to_string())
    })
}

/// Parses `genv usage snapshot` output, [`normalize`]d.
///
/// # Errors
/// Invalid JSON, a missing or mistyped field, or a memory string that is
/// neither a genv amount nor nvidia-smi's `[N/A]`; the error names the JSON path.
pub fn parse_snapshot(text: &str, source: &str) -> Result<HostSnapshot, ParseError> {
    let json: SnapshotJson = deserialize(text, source)?;
    let mut envs = envs_from_json(&json.envs.envs, source, "envs.envs")?;
    let mut devices = devices_from_json(&json.devices.devices);
    normalize(&mut envs, &mut devices);
    Ok(HostSnapshot {
        processes: processes_from_json(&json.processes.processes, source)?,
        envs: envs.into(),
        devices: devices.into(),
        truth: None,
        utilization: match &json.gpu_utilization {
            Some(text) => Some(crate::model::Utilization {
                processes: json
                    .pmon
                    .as_deref()
                    .map(|t| nvidia_smi::parse_pmon(t, &format!("{source}: pmon")))
                    .transpose()?,
                gpus: nvidia_smi::parse_gpu_utilization(
                    text,
                    &format!("{source}: gpu_utilization"),
                )?,
            }),
            None => None,
        },
        recorded_groups: json.groups,
    })
}

/// Parses `envs.json`.
///
/// # Errors
/// As [`parse_snapshot`].
pub fn parse_envs(text: &str, source: &str) -> Result<Vec<Env>, ParseError> {
    let json: EnvsJson = deserialize(text, source)?;
    envs_from_json(&json.envs, source, "envs")
}

/// Parses `devices.json`.
///
/// # Errors
/// As [`parse_snapshot`].
pub fn parse_devices(text: &str, source: &str) -> Result<Vec<Device>, ParseError> {
    let json: DevicesJson = deserialize(text, source)?;
    Ok(devices_from_json(&json.devices))
}

fn processes_from_json(json: &[ProcessJson], source: &str) -> Result<Vec<Process>, ParseError> {
    json.iter()
        .enumerate()
        .map(|(i, p)| {
            let gpus = p
                .used_gpu_memory
                .iter()
                .enumerate()
                .map(|(j, u)| {
                    let usage = if memory::is_unmeasured(&u.gpu_memory) {
                        Usage::Unknown
                    } else {
                        Usage::Known(memory::parse(&u.gpu_memory).map_err(|m| {
                            ParseError::new(
                                source,
                                format!("processes.processes[{i}].used_gpu_memory[{j}].gpu_memory"),
                                m,
                            )
                        })?)
                    };
                    Ok(DeviceUsage {
                        index: GpuIndex(u.index),
                        usage,
                    })
                })
                .collect::<Result<_, _>>()?;
            let gone = p.alive == Some(false);
            Ok(Process {
                pid: Pid(p.pid),
                owner: match &p.eid {
                    _ if gone => Owner::Unknown(crate::model::EXITED.into()),
                    Some(e) => Owner::Env(EnvId(e.as_str().into())),
                    None => Owner::NoEnv,
                },
                gpus,
                start_time: p.start_time.filter(|_| !gone),
                uid: p.uid.filter(|_| !gone),
                user: None,
                sub_uid: None,
            })
        })
        .collect()
}

fn envs_from_json(json: &[EnvJson], source: &str, path: &str) -> Result<Vec<Env>, ParseError> {
    json.iter()
        .enumerate()
        .map(|(i, e)| {
            let gpu_memory = match &e.config.gpu_memory {
                None => None,
                Some(text) => Some(Memory {
                    text: text.clone(),
                    bytes: memory::parse(text).map_err(|m| {
                        ParseError::new(source, format!("{path}[{i}].config.gpu_memory"), m)
                    })?,
                }),
            };
            Ok(Env {
                eid: EnvId(e.eid.as_str().into()),
                uid: e.uid,
                username: e.username.clone(),
                creation: e.creation.clone(),
                name: e.config.name.clone(),
                gpu_memory,
                gpus: e.config.gpus,
                pids: e.pids.clone(),
                kernel_ids: e.kernel_ids.clone(),
            })
        })
        .collect()
}

fn devices_from_json(json: &[DeviceJson]) -> Vec<Device> {
    json.iter()
        .map(|d| Device {
            index: GpuIndex(d.index),
            total_memory: d.total_memory.clone(),
            attachments: d
                .attachments
                .iter()
                .map(|a| Attachment {
                    eid: EnvId(a.eid.as_str().into()),
                    gpu_memory: a.gpu_memory.clone(),
                    time: a.time.clone(),
                })
                .collect(),
        })
        .collect()
}

/// The longest environment id or user name a record may hold (bytes):
/// genv's ids and Linux user names are far shorter; a longer one is a
/// user's way to grow every line the enforcer writes about it.
pub const MAX_NAME: usize = 256;

/// `envs` and `devices` without what holds a string over [`MAX_NAME`]:
/// a record or attachment with such an id is dropped, such a user name is
/// taken as none (the record stays: its jobs stay its members), such a
/// kernel id is dropped, and such a text that only describes (a record's
/// creation time, name or memory text, an attachment's time or memory
/// text, a device's total memory) is cut to [`MAX_NAME`] bytes. The
/// number of records, attachments and devices so garbled.
pub fn bound(envs: &mut Vec<Env>, devices: &mut [Device]) -> usize {
    bound_envs(envs) + bound_devices(devices)
}

/// [`bound`] for `envs.json`'s records.
pub fn bound_envs(envs: &mut Vec<Env>) -> usize {
    let before = envs.len();
    envs.retain(|e| e.eid.0.len() <= MAX_NAME);
    let mut garbled = before - envs.len();
    for e in envs.iter_mut() {
        let mut cut = false;
        if e.username.as_ref().is_some_and(|u| u.len() > MAX_NAME) {
            e.username = None;
            cut = true;
        }
        let kernels = e.kernel_ids.len();
        e.kernel_ids.retain(|k| k.len() <= MAX_NAME);
        cut |= e.kernel_ids.len() < kernels;
        cut |= shorten(&mut e.creation);
        cut |= e.name.as_mut().is_some_and(shorten);
        cut |= e.gpu_memory.as_mut().is_some_and(|m| shorten(&mut m.text));
        garbled += usize::from(cut);
    }
    garbled
}

/// [`bound`] for `devices.json`'s devices and attachments.
pub fn bound_devices(devices: &mut [Device]) -> usize {
    let mut garbled = 0;
    for d in devices {
        let before = d.attachments.len();
        d.attachments.retain(|a| a.eid.0.len() <= MAX_NAME);
        garbled += before - d.attachments.len();
        for a in &mut d.attachments {
            let cut = shorten(&mut a.time) | a.gpu_memory.as_mut().is_some_and(shorten);
            garbled += usize::from(cut);
        }
        garbled += usize::from(shorten(&mut d.total_memory));
    }
    garbled
}

/// `text` cut to at most [`MAX_NAME`] bytes (at a character's start);
/// whether it was longer.
fn shorten(text: &mut String) -> bool {
    if text.len() <= MAX_NAME {
        return false;
    }
    let mut end = MAX_NAME;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.shrink_to_fit();
    true
}

/// Whether two of `items` have the same `key`: a scan for a few, a set
/// for more.
fn has_duplicates<T, K: std::hash::Hash + Eq>(items: &[T], key: impl Fn(&T) -> &K) -> bool {
    if items.len() <= SMALL {
        return items
            .iter()
            .enumerate()
            .any(|(i, x)| items[..i].iter().any(|y| key(y) == key(x)));
    }
    let mut seen = HashSet::with_capacity(items.len());
    !items.iter().all(|x| seen.insert(key(x)))
}

/// `items` without the later ones of equal `key`, order kept.
fn first_of_each<T, K: std::hash::Hash + Eq>(items: &mut Vec<T>, key: impl Fn(&T) -> &K) {
    let mut seen = HashSet::with_capacity(items.len());
    let keep: Vec<bool> = items.iter().map(|x| seen.insert(key(x))).collect();
    drop(seen);
    let mut k = keep.into_iter();
    items.retain(|_| k.next().unwrap_or(true));
}

/// genv's load-time clean-up: keep only live pids (and kernels), drop
/// environments left with neither, and detach devices from environments
/// that no longer exist. Linear in the state's size.
pub fn clean_up(
    envs: &mut Vec<Env>,
    devices: &mut [Device],
    pid_alive: impl Fn(i64) -> bool,
    kernel_alive: impl Fn(&str) -> bool,
) {
    for env in envs.iter_mut() {
        env.pids.retain(|p| pid_alive(*p));
        env.kernel_ids.retain(|k| kernel_alive(k));
    }
    envs.retain(|e| !e.pids.is_empty() || !e.kernel_ids.is_empty());
    if envs.len() <= SMALL {
        for device in devices.iter_mut() {
            device
                .attachments
                .retain(|a| envs.iter().any(|e| e.eid == a.eid));
        }
        return;
    }
    let alive: HashSet<&EnvId> = envs.iter().map(|e| &e.eid).collect();
    for device in devices.iter_mut() {
        device.attachments.retain(|a| alive.contains(&a.eid));
    }
}

/// Makes genv's state read the same way in every rule and action, whatever
/// a user wrote into it: one record per environment id (the first, as
/// genv looks environments up by id), one entry per device index (holding
/// the attachments of every entry with that index: genv's rules read them
/// all, and a detach removes the environment from all of them), and each
/// environment attached at most once per device. Order is kept. Linear,
/// and allocation-free when there is nothing to mend (the usual case).
pub fn normalize(envs: &mut Vec<Env>, devices: &mut Vec<Device>) {
    if has_duplicates(envs, |e| &e.eid) {
        first_of_each(envs, |e| &e.eid);
    }
    if has_duplicates(devices, |d| &d.index) {
        let mut first: HashMap<GpuIndex, usize> = HashMap::with_capacity(devices.len());
        let mut merged: Vec<Device> = Vec::with_capacity(devices.len());
        for d in devices.drain(..) {
            match first.get(&d.index) {
                Some(&i) => merged[i].attachments.extend(d.attachments),
                None => {
                    first.insert(d.index, merged.len());
                    merged.push(d);
                }
            }
        }
        *devices = merged;
    }
    for d in devices.iter_mut() {
        if has_duplicates(&d.attachments, |a| &a.eid) {
            first_of_each(&mut d.attachments, |a| &a.eid);
        }
    }
}

/// The most records a host's state may hold by default, per file
/// (`--max-records`): real state holds dozens; more is a user's doing and
/// is refused rather than worked on.
pub const DEFAULT_MAX_RECORDS: usize = 250_000;

/// The records of `envs.json`: environments, their pids and kernel ids.
pub fn env_records(envs: &[Env]) -> usize {
    envs.iter()
        .map(|e| 1 + e.pids.len() + e.kernel_ids.len())
        .fold(0, usize::saturating_add)
}

/// The records of `devices.json`: devices and their attachments.
pub fn device_records(devices: &[Device]) -> usize {
    devices
        .iter()
        .map(|d| 1 + d.attachments.len())
        .fold(0, usize::saturating_add)
}

/// An error unless `count` records are within `max`.
///
/// # Errors
/// There are more: the error names the file and both figures.
pub fn within(count: usize, max: usize, file: &str, what: &str) -> Result<(), ParseError> {
    if count <= max {
        return Ok(());
    }
    Err(ParseError::new(
        file,
        "top level",
        format!("{count} records ({what}), more than the limit of {max} (--max-records): refused"),
    ))
}

/// Renders a snapshot as `genv usage snapshot` would (plus our optional
/// per-process `start_time` and `uid`).
pub fn to_json(snapshot: &HostSnapshot) -> SnapshotJson {
    SnapshotJson {
        processes: ProcessesJson {
            processes: snapshot
                .processes
                .iter()
                .map(|p| ProcessJson {
                    pid: p.pid.0,
                    used_gpu_memory: p
                        .gpus
                        .iter()
                        .map(|g| UsageJson {
                            index: g.index.0,
                            gpu_memory: match g.usage {
                                Usage::Known(b) if b % (1024 * 1024) == 0 => {
                                    format!("{}mi", b / (1024 * 1024))
                                }
                                Usage::Known(b) => b.to_string(),
                                Usage::Unknown => "[N/A]mi".to_string(),
                            },
                        })
                        .collect(),
                    eid: p.owner.eid().map(|e| e.0.to_string()),
                    start_time: p.start_time,
                    uid: p.uid,
                    alive: matches!(&p.owner, Owner::Unknown(why) if why == crate::model::EXITED)
                        .then_some(false),
                })
                .collect(),
        },
        envs: EnvsJson {
            envs: snapshot
                .envs
                .iter()
                .map(|e| EnvJson {
                    eid: e.eid.0.to_string(),
                    uid: e.uid,
                    creation: e.creation.clone(),
                    username: e.username.clone(),
                    config: ConfigJson {
                        name: e.name.clone(),
                        gpu_memory: e.gpu_memory.as_ref().map(|m| m.text.clone()),
                        gpus: e.gpus,
                    },
                    pids: e.pids.clone(),
                    kernel_ids: e.kernel_ids.clone(),
                })
                .collect(),
        },
        pmon: None,
        gpu_utilization: None,
        groups: BTreeMap::new(),
        devices: DevicesJson {
            devices: snapshot
                .devices
                .iter()
                .map(|d| DeviceJson {
                    index: d.index.0,
                    total_memory: d.total_memory.clone(),
                    attachments: d
                        .attachments
                        .iter()
                        .map(|a| AttachmentJson {
                            eid: a.eid.0.to_string(),
                            gpu_memory: a.gpu_memory.clone(),
                            time: a.time.clone(),
                        })
                        .collect(),
                })
                .collect(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_EXAMPLE: &str = r#"{
      "processes": {"processes": [
        {"pid": 4242, "used_gpu_memory": [{"index": 0, "gpu_memory": "900mi"}], "eid": "4100"}
      ]},
      "envs": {"envs": [
        {"eid": "4100", "uid": 1001, "creation": "22/11/2026 15:04:05", "username": "alice",
         "config": {"name": "train", "gpu_memory": "2gi", "gpus": 1},
         "pids": [4100, 4242], "kernel_ids": []}
      ]},
      "devices": {"devices": [
        {"index": 0, "total_memory": "81559mi",
         "attachments": [{"eid": "4100", "gpu_memory": null, "time": "22/11/2026 15:04:06"}]}
      ]}
    }"#;

    #[test]
    fn spec_example() {
        let s = parse_snapshot(SPEC_EXAMPLE, "spec").unwrap();
        assert_eq!(s.processes[0].pid, Pid(4242));
        assert_eq!(s.processes[0].owner, Owner::Env(EnvId("4100".into())));
        assert_eq!(
            s.processes[0].gpus[0].usage,
            Usage::Known(900 * 1024 * 1024)
        );
        assert_eq!(s.envs[0].gpu_memory.as_ref().unwrap().bytes, 2 << 30);
        assert_eq!(s.envs[0].username.as_deref(), Some("alice"));
        assert_eq!(s.devices[0].attachments[0].eid, EnvId("4100".into()));
    }

    #[test]
    fn nulls_and_unknown_fields() {
        let text = r#"{"processes": {"processes": [{"pid": 1, "used_gpu_memory": [{"index": 0, "gpu_memory": "[N/A]mi"}], "eid": null, "extra": 3}]},
            "envs": {"envs": [{"eid": "a", "uid": 0, "creation": "bad", "username": null,
                "config": {"name": null, "gpu_memory": null, "gpus": null}, "pids": [], "kernel_ids": []}]},
            "devices": {"devices": []}, "future": true}"#;
        let s = parse_snapshot(text, "t").unwrap();
        assert_eq!(s.processes[0].owner, Owner::NoEnv);
        assert_eq!(s.processes[0].gpus[0].usage, Usage::Unknown);
        assert_eq!(s.envs[0].username, None);
    }

    #[test]
    fn errors_name_the_json_path() {
        let bad_uid = SPEC_EXAMPLE.replace("\"uid\": 1001", "\"uid\": \"x\"");
        let e = parse_snapshot(&bad_uid, "gpu1").unwrap_err();
        assert_eq!(e.source_name, "gpu1");
        assert_eq!(e.location, "envs.envs[0].uid");

        let bad_mem = SPEC_EXAMPLE.replace("\"2gi\"", "\"2 GB\"");
        let e = parse_snapshot(&bad_mem, "gpu1").unwrap_err();
        assert_eq!(e.location, "envs.envs[0].config.gpu_memory");

        let bad_usage = SPEC_EXAMPLE.replace("\"900mi\"", "\"lots\"");
        let e = parse_snapshot(&bad_usage, "gpu1").unwrap_err();
        assert_eq!(
            e.location,
            "processes.processes[0].used_gpu_memory[0].gpu_memory"
        );

        let e = parse_snapshot(&SPEC_EXAMPLE[..100], "gpu1").unwrap_err();
        assert!(e.message.contains("EOF"), "{e}");
        assert!(parse_snapshot("", "f").is_err());
        assert!(parse_envs("[]", "envs.json").is_err());
    }

    #[test]
    fn state_files() {
        let envs = parse_envs(r#"{"envs": [{"eid": "7", "uid": 1000, "creation": "01/01/2026 00:00:00", "username": "bob", "config": {"name": null, "gpu_memory": "1gi", "gpus": 2}, "pids": [7], "kernel_ids": []}]}"#, "envs.json").unwrap();
        assert_eq!(envs[0].gpus, Some(2));
        let devices = parse_devices(
            r#"{"devices": [{"index": 0, "total_memory": "16384mi", "attachments": []}]}"#,
            "devices.json",
        )
        .unwrap();
        assert_eq!(devices[0].index, GpuIndex(0));
    }

    #[test]
    fn clean_up_drops_dead_envs_and_their_attachments() {
        let s = parse_snapshot(SPEC_EXAMPLE, "spec").unwrap();
        let (mut envs, mut devices) = (s.envs.to_vec(), s.devices.to_vec());
        clean_up(&mut envs, &mut devices, |p| p == 4242, |_| false);
        assert_eq!(envs[0].pids, vec![4242]);
        assert_eq!(devices[0].attachments.len(), 1);
        clean_up(&mut envs, &mut devices, |_| false, |_| false);
        assert!(envs.is_empty());
        assert!(devices[0].attachments.is_empty());
    }

    #[test]
    fn normalize_keeps_the_first_record_merges_device_entries_and_dedups_attachments() {
        for n in [3, 40] {
            // n records, the last one repeating the first's id; device 0
            // listed twice, with an attachment listed twice.
            let mut envs: Vec<Env> = (0..n)
                .map(|i| {
                    let mut e = parse_envs(SPEC_EXAMPLE_ENVS, "t").unwrap().remove(0);
                    e.eid = EnvId(format!("e{i}").into());
                    e.username = Some(format!("u{i}"));
                    e
                })
                .collect();
            let mut dup = envs[0].clone();
            dup.username = Some("forger".into());
            envs.push(dup);
            let att = |e: &str| Attachment {
                eid: EnvId(e.into()),
                gpu_memory: None,
                time: String::new(),
            };
            let dev = |i: u32, a: Vec<Attachment>| Device {
                index: GpuIndex(i),
                total_memory: "1mi".into(),
                attachments: a,
            };
            let mut devices: Vec<Device> = (0..n as u32).map(|i| dev(i, vec![])).collect();
            devices.push(dev(0, vec![att("e1"), att("e2"), att("e1")]));
            normalize(&mut envs, &mut devices);
            assert_eq!(envs.len(), n, "{n}");
            assert_eq!(envs[0].username.as_deref(), Some("u0"));
            assert_eq!(devices.len(), n);
            assert_eq!(
                devices[0]
                    .attachments
                    .iter()
                    .map(|a| &*a.eid.0)
                    .collect::<Vec<_>>(),
                ["e1", "e2"]
            );
        }
    }

    const SPEC_EXAMPLE_ENVS: &str = r#"{"envs": [{"eid": "4100", "uid": 1001, "creation": "c", "username": "alice", "config": {}, "pids": [4100], "kernel_ids": []}]}"#;

    #[test]
    fn overlong_ids_and_names_are_garbled_records() {
        let long = "x".repeat(MAX_NAME + 1);
        let fits = "y".repeat(MAX_NAME);
        let mut envs = vec![
            Env {
                eid: EnvId(long.as_str().into()),
                ..crate::rules::test_support::env("a", Some("bob"), None)
            },
            crate::rules::test_support::env("b", Some(&long), None),
            crate::rules::test_support::env(&fits, Some(&fits), None),
        ];
        let mut devices =
            crate::rules::test_support::devices(1, &[(0, &long), (0, "b"), (0, &fits)]);
        assert_eq!(bound(&mut envs, &mut devices), 3);
        let eids: Vec<&str> = envs.iter().map(|e| &*e.eid.0).collect();
        assert_eq!(eids, ["b", fits.as_str()]);
        assert_eq!(envs[0].username, None, "the record stays, nameless");
        assert_eq!(envs[1].username.as_deref(), Some(fits.as_str()));
        assert_eq!(devices[0].attachments.len(), 2);
        // Every other string a user writes is bounded too: cut, said.
        let mut e = crate::rules::test_support::env("c", Some("alice"), None);
        e.creation = format!("{}é", "x".repeat(MAX_NAME - 1));
        e.name = Some(long.clone());
        e.kernel_ids = vec![long.clone(), "k".into()];
        let mut envs = vec![e];
        let mut devices = crate::rules::test_support::devices(1, &[(0, "c")]);
        devices[0].attachments[0].time = long.clone();
        devices[0].total_memory = long.clone();
        assert_eq!(
            bound(&mut envs, &mut devices),
            3,
            "a record, an attachment, a device"
        );
        assert_eq!(envs[0].creation.len(), MAX_NAME - 1, "cut at a character");
        assert_eq!(envs[0].name.as_ref().map(String::len), Some(MAX_NAME));
        assert_eq!(envs[0].kernel_ids, ["k"]);
        assert_eq!(devices[0].attachments[0].time.len(), MAX_NAME);
        assert_eq!(devices[0].total_memory.len(), MAX_NAME);
    }

    #[test]
    fn record_limits_name_the_file() {
        let envs = parse_envs(SPEC_EXAMPLE_ENVS, "t").unwrap();
        assert_eq!(env_records(&envs), 2);
        assert!(within(2, 2, "envs.json", "x").is_ok());
        let e = within(3, 2, "gpu1: envs.json", "environments").unwrap_err();
        assert_eq!(
            e.to_string(),
            "gpu1: envs.json: top level: 3 records (environments), more than the limit of 2 (--max-records): refused"
        );
        let d = parse_devices(
            r#"{"devices": [{"index": 0, "total_memory": "1mi", "attachments": [{"eid": "a", "time": "t"}]}]}"#,
            "d",
        )
        .unwrap();
        assert_eq!(device_records(&d), 2);
    }

    #[test]
    fn round_trip() {
        let s = parse_snapshot(SPEC_EXAMPLE, "spec").unwrap();
        let text = serde_json::to_string(&to_json(&s)).unwrap();
        assert_eq!(parse_snapshot(&text, "again").unwrap(), s);
    }
}
