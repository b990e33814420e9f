//! genv's state directory on this machine: its global lock, reading
//! `envs.json` / `devices.json`, and detaching under the lock.
//!
//! Detach rewrites `devices.json` the way genv would have, while holding
//! the same exclusive `flock(2)` on `genv.lock` that every genv command
//! takes, so a concurrent `genv attach` is serialised with us and loses
//! nothing. The new file is written beside the old one and renamed over it
//! (mode 0666, as genv writes its state), so a crash never leaves half a file.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};
use serde_json::Value;

use crate::error::StateError;
use crate::model::{EnvId, GpuIndex};
use crate::outcome;

/// genv's default state directory.
pub const DEFAULT_DIR: &str = "/var/tmp/genv";

/// The state files of one genv installation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir {
    pub path: PathBuf,
}

/// The raw contents of the state files; `None` where a file does not exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateFiles {
    pub envs: Option<String>,
    pub devices: Option<String>,
}

/// Holds genv's global lock until dropped.
#[derive(Debug)]
pub struct Lock {
    _file: File,
}

impl StateDir {
    /// `$GENV_TMPDIR`, or genv's default.
    pub fn from_env() -> Self {
        StateDir {
            path: std::env::var_os("GENV_TMPDIR")
                .map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from),
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Takes genv's global lock, creating `genv.lock` (0666) and the
    /// directory if missing; polls until `wait` has passed rather than
    /// blocking forever behind a stuck process.
    ///
    /// # Errors
    /// The file cannot be created or opened, or stays locked past `wait`.
    pub fn lock(&self, wait: Duration) -> Result<Lock, StateError> {
        let path = self.file("genv.lock");
        if !self.path.exists() {
            fs::create_dir_all(&self.path).map_err(|e| StateError::io(&self.path, e))?;
            let _ = fs::set_permissions(&self.path, Permissions::from_mode(0o777));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .open(&path)
            .map_err(|e| StateError::io(&path, e))?;
        // The umask may have narrowed the mode; genv's lock must stay 0666.
        if file
            .metadata()
            .is_ok_and(|m| m.permissions().mode() & 0o777 != 0o666)
        {
            let _ = file.set_permissions(Permissions::from_mode(0o666));
        }
        let start = Instant::now();
        loop {
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(Lock { _file: file }),
                Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                    if start.elapsed() >= wait {
                        return Err(StateError::LockTimeout { path, after: wait });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(StateError::io(&path, e.into())),
            }
        }
    }

    fn read_optional(&self, name: &str) -> Result<Option<String>, StateError> {
        let path = self.file(name);
        match fs::read_to_string(&path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StateError::io(path, e)),
        }
    }

    /// Reads both state files under the lock, so they agree with each other.
    ///
    /// # Errors
    /// The lock cannot be had, or a file exists but cannot be read.
    pub fn read(&self, wait: Duration) -> Result<StateFiles, StateError> {
        let _lock = self.lock(wait)?;
        Ok(StateFiles {
            envs: self.read_optional("envs.json")?,
            devices: self.read_optional("devices.json")?,
        })
    }

    /// Detaches each (device, environment) pair from `devices.json` under
    /// genv's lock, preserving every other attachment and field.
    ///
    /// Returns one outcome per pair, in order. If the file cannot be read,
    /// parsed or replaced, every pair fails and the file is left as it was.
    pub fn detach(&self, pairs: &[(GpuIndex, EnvId)], wait: Duration) -> Vec<outcome::Detach> {
        let failed = |error: String| vec![outcome::Detach::Failed { error }; pairs.len()];
        let _lock = match self.lock(wait) {
            Ok(l) => l,
            Err(e) => return failed(e.to_string()),
        };
        let path = self.file("devices.json");
        let text = match self.read_optional("devices.json") {
            Ok(Some(t)) => t,
            Ok(None) => return vec![outcome::Detach::NotAttached; pairs.len()],
            Err(e) => return failed(e.to_string()),
        };
        let mut json: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => return failed(format!("{}: {e}", path.display())),
        };
        let outcomes: Vec<outcome::Detach> = pairs
            .iter()
            .map(|(device, eid)| {
                if remove_attachment(&mut json, *device, eid) {
                    outcome::Detach::Detached
                } else {
                    outcome::Detach::NotAttached
                }
            })
            .collect();
        if !outcomes.contains(&outcome::Detach::Detached) {
            return outcomes;
        }
        match write_replacing(&path, &json) {
            Ok(()) => outcomes,
            Err(e) => failed(e.to_string()),
        }
    }
}

/// Removes `eid`'s attachment from device `index`; whether one was there.
fn remove_attachment(json: &mut Value, index: GpuIndex, eid: &EnvId) -> bool {
    let Some(devices) = json.get_mut("devices").and_then(Value::as_array_mut) else {
        return false;
    };
    let Some(device) = devices
        .iter_mut()
        .find(|d| d.get("index").and_then(Value::as_u64) == Some(u64::from(index.0)))
    else {
        return false;
    };
    let Some(attachments) = device.get_mut("attachments").and_then(Value::as_array_mut) else {
        return false;
    };
    let before = attachments.len();
    attachments.retain(|a| a.get("eid").and_then(Value::as_str) != Some(eid.0.as_str()));
    attachments.len() != before
}

/// Writes `json` as genv does (indent 2) to a temporary file beside `path`
/// and renames it over `path`.
fn write_replacing(path: &Path, json: &Value) -> Result<(), StateError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".devices.json.")
        .tempfile_in(dir)
        .map_err(|e| StateError::io(dir, e))?;
    let tmp_path = tmp.path().to_path_buf();
    let io = |e| StateError::io(&tmp_path, e);
    serde_json::to_writer_pretty(tmp.as_file_mut(), json).map_err(|e| io(e.into()))?;
    tmp.as_file_mut().flush().map_err(io)?;
    tmp.as_file()
        .set_permissions(Permissions::from_mode(0o666))
        .map_err(io)?;
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path)
        .map_err(|e| StateError::io(path, e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICES: &str = r#"{
  "devices": [
    {"index": 0, "total_memory": "16384mi", "attachments": [
      {"eid": "a", "gpu_memory": null, "time": "22/11/2026 15:04:06"},
      {"eid": "b", "gpu_memory": "1gi", "time": "22/11/2026 15:04:07"}]},
    {"index": 1, "total_memory": "16384mi", "attachments": [{"eid": "a", "gpu_memory": null, "time": "t"}], "future": 1}
  ]
}"#;

    fn dir_with(devices: &str) -> (tempfile::TempDir, StateDir) {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("devices.json"), devices).unwrap();
        let state = StateDir {
            path: tmp.path().to_path_buf(),
        };
        (tmp, state)
    }

    #[test]
    fn detach_removes_only_the_pair_and_keeps_everything_else() {
        let (_t, state) = dir_with(DEVICES);
        let out = state.detach(
            &[
                (GpuIndex(0), EnvId("a".into())),
                (GpuIndex(3), EnvId("a".into())),
            ],
            Duration::from_secs(1),
        );
        assert_eq!(
            out,
            vec![outcome::Detach::Detached, outcome::Detach::NotAttached]
        );
        let after: Value =
            serde_json::from_str(&fs::read_to_string(state.file("devices.json")).unwrap()).unwrap();
        let d0 = &after["devices"][0]["attachments"];
        assert_eq!(d0.as_array().unwrap().len(), 1);
        assert_eq!(d0[0]["eid"], "b");
        assert_eq!(d0[0]["gpu_memory"], "1gi");
        assert_eq!(after["devices"][1]["attachments"][0]["eid"], "a");
        assert_eq!(after["devices"][1]["future"], 1);
        let mode = fs::metadata(state.file("devices.json"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o666);
        assert_eq!(
            fs::metadata(state.file("genv.lock"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o666
        );
    }

    #[test]
    fn malformed_devices_json_fails_and_is_left_alone() {
        let (_t, state) = dir_with("{\"devices\": [");
        let out = state.detach(&[(GpuIndex(0), EnvId("a".into()))], Duration::from_secs(1));
        assert!(matches!(&out[0], outcome::Detach::Failed { .. }));
        assert_eq!(
            fs::read_to_string(state.file("devices.json")).unwrap(),
            "{\"devices\": ["
        );
    }

    #[test]
    fn held_lock_times_out_instead_of_hanging() {
        let (_t, state) = dir_with(DEVICES);
        let _held = state.lock(Duration::from_secs(1)).unwrap();
        // flock locks belong to the open file description: a second open conflicts.
        let e = state.lock(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(e, StateError::LockTimeout { .. }), "{e}");
    }
}
