//! genv's state directory on this machine: its global lock, reading
//! `envs.json` / `devices.json`, and detaching under the lock.
//!
//! The directory is world-writable by genv's design (0777, not sticky), so
//! every name in it is treated as hostile: the directory is opened once
//! without following a symlink and everything else is opened relative to
//! that handle, again without following symlinks and without blocking
//! (`O_NOFOLLOW | O_NONBLOCK`); what is opened must be a regular file
//! (checked with `fstat` on the open handle) of at most [`MAX_STATE_BYTES`].
//! A FIFO, socket, device, directory or symlink is an error naming the file.
//! We never change the mode of a file we did not create, and never write
//! into an existing file: a detach writes a new file, created exclusively
//! beside the old one, and renames it over (mode 0666, as genv writes its
//! state), while holding the same exclusive `flock(2)` on `genv.lock` that
//! every genv command takes, so a concurrent `genv attach` is serialised
//! with us and loses nothing.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;
use serde_json::Value;

use crate::error::StateError;
use crate::model::{EnvId, GpuIndex};
use crate::outcome;

pub use super::MAX_STATE_BYTES;
use crate::snapshot::genv::DEFAULT_DIR;

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
    _file: OwnedFd,
}

/// The state directory, open.
struct Dir<'a> {
    path: &'a Path,
    fd: OwnedFd,
}

/// Flags for every open in the state directory: never follow a link,
/// never block on a FIFO, never take a terminal, never leak to children.
fn safe(flags: OFlags) -> OFlags {
    flags | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC
}

impl StateDir {
    /// `$GENV_TMPDIR`, or genv's default.
    pub fn from_env() -> Self {
        StateDir {
            path: std::env::var_os("GENV_TMPDIR")
                .map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from),
        }
    }

    /// Opens the directory itself without following a symlink; `None`
    /// when it does not exist (no state yet: nothing is created).
    fn open(&self) -> Result<Option<Dir<'_>>, StateError> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::open(&self.path, flags, Mode::empty()) {
            Ok(fd) => Ok(Some(Dir {
                path: &self.path,
                fd,
            })),
            Err(Errno::NOENT) => Ok(None),
            // O_DIRECTORY meets a symlink first: tell the two apart for the report.
            Err(Errno::LOOP | Errno::NOTDIR) => Err(StateError::Unsafe {
                path: self.path.clone(),
                what: if self.path.is_symlink() {
                    "a symbolic link"
                } else {
                    "not a directory"
                },
            }),
            Err(e) => Err(StateError::io(&self.path, e.into())),
        }
    }

    /// Takes genv's global lock, creating `genv.lock` (0666, as genv does)
    /// if the directory has none; polls until `wait` has passed rather than
    /// blocking forever behind a stuck process. `None` when the directory
    /// does not exist.
    ///
    /// # Errors
    /// The lock file is not a regular file, cannot be opened, or stays
    /// locked past `wait`.
    pub fn lock(&self, wait: Duration) -> Result<Option<Lock>, StateError> {
        match self.open()? {
            Some(dir) => dir
                .lock(FlockOperation::NonBlockingLockExclusive, wait)
                .map(Some),
            None => Ok(None),
        }
    }

    /// Reads both state files under a shared lock, so that they agree with
    /// each other and no genv writer is half-way through either.
    ///
    /// # Errors
    /// The lock cannot be had, or a file is unsafe, too large or unreadable.
    pub fn read(&self, wait: Duration) -> Result<StateFiles, StateError> {
        let Some(dir) = self.open()? else {
            return Ok(StateFiles::default());
        };
        let _lock = dir.lock(FlockOperation::NonBlockingLockShared, wait)?;
        Ok(StateFiles {
            envs: dir.read("envs.json")?,
            devices: dir.read("devices.json")?,
        })
    }

    /// Detaches each (device, environment) pair from `devices.json` under
    /// genv's lock, preserving every other attachment and field.
    ///
    /// Returns one outcome per pair, in order. If the file cannot be read,
    /// parsed or replaced, every pair fails and the file is left as it was.
    pub fn detach(
        &self,
        pairs: &[(GpuIndex, EnvId)],
        wait: Duration,
    ) -> Vec<outcome::DetachResult> {
        let failed = |error: String| vec![outcome::DetachResult::Failed { error }; pairs.len()];
        let dir = match self.open() {
            Ok(Some(d)) => d,
            Ok(None) => return vec![outcome::DetachResult::NotAttached; pairs.len()],
            Err(e) => return failed(crate::error::chain(&e)),
        };
        let _lock = match dir.lock(FlockOperation::NonBlockingLockExclusive, wait) {
            Ok(l) => l,
            Err(e) => return failed(crate::error::chain(&e)),
        };
        let text = match dir.read("devices.json") {
            Ok(Some(t)) => t,
            Ok(None) => return vec![outcome::DetachResult::NotAttached; pairs.len()],
            Err(e) => return failed(crate::error::chain(&e)),
        };
        let mut json: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => return failed(format!("{}: {e}", dir.path.join("devices.json").display())),
        };
        let removed = remove_attachments(&mut json, pairs);
        let outcomes: Vec<outcome::DetachResult> = pairs
            .iter()
            .map(|(device, eid)| {
                if removed.contains(&(*device, eid)) {
                    outcome::DetachResult::Detached
                } else {
                    outcome::DetachResult::NotAttached
                }
            })
            .collect();
        if !outcomes.contains(&outcome::DetachResult::Detached) {
            return outcomes;
        }
        match dir.replace("devices.json", &json) {
            Ok(()) => outcomes,
            Err(e) => failed(crate::error::chain(&e)),
        }
    }
}

impl Dir<'_> {
    fn path_of(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Opens `name` in the directory for reading; `None` when it does not
    /// exist.
    fn open_file(&self, name: &str) -> Result<Option<File>, StateError> {
        let path = || self.path_of(name);
        let fd = match rustix::fs::openat(&self.fd, name, safe(OFlags::RDONLY), Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(Errno::LOOP) => {
                return Err(StateError::Unsafe {
                    path: path(),
                    what: "a symbolic link",
                })
            }
            // What open(2) says of a socket.
            Err(Errno::NXIO) => {
                return Err(StateError::Unsafe {
                    path: path(),
                    what: "a socket",
                })
            }
            Err(e) => return Err(StateError::io(path(), e.into())),
        };
        regular(&fd, &path())?;
        Ok(Some(File::from(fd)))
    }

    /// `genv.lock`, created (0666) if missing, then locked with `op`,
    /// retried until `wait` has passed.
    fn lock(&self, op: FlockOperation, wait: Duration) -> Result<Lock, StateError> {
        let path = self.path_of("genv.lock");
        let created = rustix::fs::openat(
            &self.fd,
            "genv.lock",
            safe(OFlags::RDONLY | OFlags::CREATE | OFlags::EXCL),
            Mode::from_raw_mode(0o666),
        );
        let fd = match created {
            Ok(fd) => {
                // Ours, just made: the umask may have narrowed genv's 0666.
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o666))
                    .map_err(|e| StateError::io(&path, e.into()))?;
                fd
            }
            Err(Errno::EXIST) => match self.open_file("genv.lock")? {
                Some(f) => OwnedFd::from(f),
                None => return Err(StateError::io(&path, Errno::NOENT.into())),
            },
            Err(e) => return Err(StateError::io(&path, e.into())),
        };
        regular(&fd, &path)?;
        let start = Instant::now();
        loop {
            match rustix::fs::flock(&fd, op) {
                Ok(()) => return Ok(Lock { _file: fd }),
                Err(Errno::WOULDBLOCK | Errno::INTR) => {
                    if start.elapsed() >= wait {
                        return Err(StateError::LockTimeout { path, after: wait });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(StateError::io(&path, e.into())),
            }
        }
    }

    /// The text of `name`, at most [`MAX_STATE_BYTES`]; `None` when absent.
    fn read(&self, name: &str) -> Result<Option<String>, StateError> {
        let Some(file) = self.open_file(name)? else {
            return Ok(None);
        };
        let path = self.path_of(name);
        let mut bytes = Vec::new();
        file.take(MAX_STATE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| StateError::io(&path, e))?;
        if bytes.len() as u64 > MAX_STATE_BYTES {
            return Err(StateError::TooLarge {
                path,
                limit: MAX_STATE_BYTES,
            });
        }
        String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| StateError::NotUtf8 { path })
    }

    /// Writes `json` as genv does (indent 2) to a file created exclusively
    /// in the directory and renames it over `name`; the new file is removed
    /// if anything fails.
    fn replace(&self, name: &str, json: &Value) -> Result<(), StateError> {
        let (tmp, fd) = self.create_temp(name)?;
        let tmp_path = self.path_of(&tmp);
        let written = (|| -> std::io::Result<()> {
            let mut file = File::from(fd);
            rustix::fs::fchmod(&file, Mode::from_raw_mode(0o666))?;
            serde_json::to_writer_pretty(&mut file, json)?;
            file.flush()?;
            file.sync_all()
        })()
        .map_err(|e| StateError::io(&tmp_path, e))
        .and_then(|()| {
            rustix::fs::renameat(&self.fd, tmp.as_str(), &self.fd, name)
                .map_err(|e| StateError::io(self.path_of(name), e.into()))
        });
        if written.is_err() {
            let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
        }
        written
    }

    /// A new, empty, private file `.<name>.<random>` in the directory.
    fn create_temp(&self, name: &str) -> Result<(String, OwnedFd), StateError> {
        let mut last = Errno::EXIST;
        for attempt in 0..16u32 {
            let tmp = format!(".{name}.{:016x}", random(attempt));
            match rustix::fs::openat(
                &self.fd,
                tmp.as_str(),
                safe(OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL),
                Mode::from_raw_mode(0o600),
            ) {
                Ok(fd) => return Ok((tmp, fd)),
                Err(Errno::EXIST) => last = Errno::EXIST,
                Err(e) => {
                    last = e;
                    break;
                }
            }
        }
        Err(StateError::io(self.path, last.into()))
    }
}

/// A fresh name part: unpredictable enough that a user cannot squat it
/// (and `O_EXCL` refuses whatever they did squat).
fn random(attempt: u32) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(attempt);
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Refuses anything but a regular file, by what the open handle is.
fn regular(fd: &OwnedFd, path: &Path) -> Result<(), StateError> {
    let stat = rustix::fs::fstat(fd).map_err(|e| StateError::io(path, e.into()))?;
    let what = match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => return Ok(()),
        FileType::Fifo => "a FIFO",
        FileType::CharacterDevice | FileType::BlockDevice => "a device",
        FileType::Directory => "a directory",
        _ => "not a regular file",
    };
    Err(StateError::Unsafe {
        path: path.to_path_buf(),
        what,
    })
}

/// Removes `eid`'s attachment from device `index`; whether one was there.
/// Removes `pairs` from `devices.json`'s JSON, from every entry with the
/// pair's index (a user may list an index twice; the snapshot reads them
/// all), in one pass; the pairs that were there.
fn remove_attachments<'a>(
    json: &mut Value,
    pairs: &'a [(GpuIndex, EnvId)],
) -> HashSet<(GpuIndex, &'a EnvId)> {
    let mut wanted: HashMap<u64, HashMap<&str, &'a EnvId>> = HashMap::new();
    for (index, eid) in pairs {
        wanted
            .entry(u64::from(index.0))
            .or_default()
            .insert(eid.0.as_str(), eid);
    }
    let mut removed = HashSet::new();
    let Some(devices) = json.get_mut("devices").and_then(Value::as_array_mut) else {
        return removed;
    };
    for device in devices {
        let Some(index) = device.get("index").and_then(Value::as_u64) else {
            continue;
        };
        let (Some(eids), Ok(gpu)) = (wanted.get(&index), u32::try_from(index)) else {
            continue;
        };
        let Some(attachments) = device.get_mut("attachments").and_then(Value::as_array_mut) else {
            continue;
        };
        attachments.retain(|a| {
            match a
                .get("eid")
                .and_then(Value::as_str)
                .and_then(|e| eids.get(e))
            {
                Some(eid) => {
                    removed.insert((GpuIndex(gpu), *eid));
                    false
                }
                None => true,
            }
        });
    }
    removed
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

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
        std::fs::write(tmp.path().join("devices.json"), devices).unwrap();
        let state = StateDir {
            path: tmp.path().to_path_buf(),
        };
        (tmp, state)
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    }

    fn a0() -> Vec<(GpuIndex, EnvId)> {
        vec![(GpuIndex(0), EnvId("a".into()))]
    }

    #[test]
    fn detach_removes_only_the_pair_and_keeps_everything_else() {
        let (t, state) = dir_with(DEVICES);
        let out = state.detach(
            &[
                (GpuIndex(0), EnvId("a".into())),
                (GpuIndex(3), EnvId("a".into())),
            ],
            Duration::from_secs(1),
        );
        assert_eq!(
            out,
            vec![
                outcome::DetachResult::Detached,
                outcome::DetachResult::NotAttached
            ]
        );
        let after: Value =
            serde_json::from_str(&std::fs::read_to_string(t.path().join("devices.json")).unwrap())
                .unwrap();
        let d0 = &after["devices"][0]["attachments"];
        assert_eq!(d0.as_array().unwrap().len(), 1);
        assert_eq!(d0[0]["eid"], "b");
        assert_eq!(d0[0]["gpu_memory"], "1gi");
        assert_eq!(after["devices"][1]["attachments"][0]["eid"], "a");
        assert_eq!(after["devices"][1]["future"], 1);
        assert_eq!(mode(&t.path().join("devices.json")), 0o666);
        assert_eq!(mode(&t.path().join("genv.lock")), 0o666);
        assert_eq!(
            names(t.path()),
            ["devices.json", "genv.lock"],
            "no temp file left"
        );
    }

    #[test]
    fn detach_removes_the_pair_from_every_entry_of_an_index_listed_twice() {
        let (t, state) = dir_with(
            r#"{"devices": [
                {"index": 0, "attachments": [{"eid": "x"}]},
                {"index": 1, "attachments": [{"eid": "a"}]},
                {"index": 0, "attachments": [{"eid": "a"}, {"eid": "b"}]},
                {"index": -1, "attachments": [{"eid": "a"}]},
                "junk"]}"#,
        );
        let pairs = [
            (GpuIndex(0), EnvId("a".into())),
            (GpuIndex(0), EnvId("x".into())),
            (GpuIndex(2), EnvId("a".into())),
        ];
        use outcome::DetachResult::{Detached, NotAttached};
        assert_eq!(
            state.detach(&pairs, Duration::from_secs(1)),
            vec![Detached, Detached, NotAttached]
        );
        let after: Value =
            serde_json::from_str(&std::fs::read_to_string(t.path().join("devices.json")).unwrap())
                .unwrap();
        assert_eq!(after["devices"][0]["attachments"], serde_json::json!([]));
        assert_eq!(after["devices"][1]["attachments"][0]["eid"], "a");
        assert_eq!(
            after["devices"][2]["attachments"],
            serde_json::json!([{"eid": "b"}])
        );
        assert_eq!(after["devices"][3]["attachments"][0]["eid"], "a");
        assert_eq!(after["devices"][4], "junk");
    }

    #[test]
    fn malformed_devices_json_fails_and_is_left_alone() {
        let (t, state) = dir_with("{\"devices\": [");
        let out = state.detach(&a0(), Duration::from_secs(1));
        assert!(matches!(&out[0], outcome::DetachResult::Failed { .. }));
        assert_eq!(
            std::fs::read_to_string(t.path().join("devices.json")).unwrap(),
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
        assert!(state.read(Duration::from_millis(50)).is_err());
    }

    #[test]
    fn an_existing_lock_keeps_its_mode_and_a_missing_dir_is_not_created() {
        let (t, state) = dir_with(DEVICES);
        let lock = t.path().join("genv.lock");
        std::fs::write(&lock, "").unwrap();
        std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o600)).unwrap();
        state.read(Duration::from_secs(1)).unwrap();
        state.detach(&a0(), Duration::from_secs(1));
        assert_eq!(
            mode(&lock),
            0o600,
            "genv never chmods an existing lock; nor do we"
        );

        let gone = StateDir {
            path: t.path().join("missing"),
        };
        assert_eq!(
            gone.read(Duration::from_secs(1)).unwrap(),
            StateFiles::default()
        );
        assert!(gone.lock(Duration::from_secs(1)).unwrap().is_none());
        assert_eq!(
            gone.detach(&a0(), Duration::from_secs(1)),
            [outcome::DetachResult::NotAttached]
        );
        assert!(!gone.path.exists());
    }

    #[test]
    fn symlinks_are_never_followed_and_their_targets_never_touched() {
        // Regression, issue 7: a symlinked genv.lock had its target chmodded 0666.
        let (t, state) = dir_with(DEVICES);
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("shadow");
        std::fs::write(&secret, "root:secret\n").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&secret, t.path().join("genv.lock")).unwrap();
        let e = state.read(Duration::from_secs(1)).unwrap_err();
        assert!(
            crate::error::chain(&e).contains("genv.lock is a symbolic link"),
            "{e}"
        );
        assert!(matches!(
            &state.detach(&a0(), Duration::from_secs(1))[0],
            outcome::DetachResult::Failed { .. }
        ));
        assert!(state.lock(Duration::from_secs(1)).is_err());
        std::fs::remove_file(t.path().join("genv.lock")).unwrap();

        // A symlinked state file: refused, on read and on detach.
        std::fs::rename(
            t.path().join("devices.json"),
            outside.path().join("devices.json"),
        )
        .unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("devices.json"),
            t.path().join("devices.json"),
        )
        .unwrap();
        let e = state.read(Duration::from_secs(1)).unwrap_err();
        assert!(
            crate::error::chain(&e).contains("devices.json is a symbolic link"),
            "{e}"
        );
        assert!(matches!(
            &state.detach(&a0(), Duration::from_secs(1))[0],
            outcome::DetachResult::Failed { .. }
        ));
        assert_eq!(
            std::fs::read_to_string(outside.path().join("devices.json")).unwrap(),
            DEVICES
        );
        assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root:secret\n");
        assert_eq!(mode(&secret), 0o600);

        // The state dir itself a symlink to elsewhere: refused.
        let link = outside.path().join("genv");
        std::os::unix::fs::symlink(t.path(), &link).unwrap();
        let e = StateDir { path: link.clone() }
            .read(Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{} is a symbolic link: refused (genv's state directory is writable by every user)",
                link.display()
            )
        );
        // Or a file.
        let file = outside.path().join("file");
        std::fs::write(&file, "").unwrap();
        let e = StateDir { path: file.clone() }
            .read(Duration::from_secs(1))
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{} is not a directory", file.display())),
            "{e}"
        );
    }

    #[test]
    fn fifos_devices_and_huge_files_are_refused_without_blocking() {
        let (t, state) = dir_with(DEVICES);
        let envs = t.path().join("envs.json");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &envs,
            FileType::Fifo,
            Mode::from_raw_mode(0o666),
            0,
        )
        .unwrap();
        let start = Instant::now();
        let e = state.read(Duration::from_secs(1)).unwrap_err();
        assert!(
            crate::error::chain(&e).contains("envs.json is a FIFO"),
            "{e}"
        );
        assert!(start.elapsed() < Duration::from_secs(1));
        std::fs::remove_file(&envs).unwrap();

        std::fs::create_dir(&envs).unwrap();
        let e = state.read(Duration::from_secs(1)).unwrap_err();
        assert!(
            crate::error::chain(&e).contains("envs.json is a directory"),
            "{e}"
        );
        std::fs::remove_dir(&envs).unwrap();

        let f = File::create(&envs).unwrap();
        f.set_len(MAX_STATE_BYTES + 1).unwrap();
        let e = state.read(Duration::from_secs(1)).unwrap_err();
        assert!(crate::error::chain(&e).contains("larger than"), "{e}");
    }

    #[test]
    fn sockets_and_devices_are_named_as_such() {
        let (t, state) = dir_with(DEVICES);
        let _listener = std::os::unix::net::UnixListener::bind(t.path().join("envs.json")).unwrap();
        let e = state.read(Duration::from_secs(1)).unwrap_err();
        assert!(
            crate::error::chain(&e).contains("envs.json is a socket"),
            "{e}"
        );
        std::fs::remove_file(t.path().join("envs.json")).unwrap();
        // A device node (only root can make one; a user could only link to
        // one, and links are refused before that).
        let null = rustix::fs::mknodat(
            rustix::fs::CWD,
            t.path().join("envs.json"),
            FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            rustix::fs::makedev(1, 3),
        );
        if null.is_ok() {
            let e = state.read(Duration::from_secs(1)).unwrap_err();
            assert!(
                crate::error::chain(&e).contains("envs.json is a device")
                    || crate::error::chain(&e).contains("Permission denied"),
                "{e}"
            );
        }
    }

    #[test]
    fn nothing_opened_leaks_into_children() {
        let (t, state) = dir_with(DEVICES);
        let cloexec = |fd: &OwnedFd| {
            rustix::io::fcntl_getfd(fd)
                .unwrap()
                .contains(rustix::io::FdFlags::CLOEXEC)
        };
        let dir = state.open().unwrap().unwrap();
        assert!(cloexec(&dir.fd));
        let file = dir.open_file("devices.json").unwrap().unwrap();
        assert!(cloexec(&OwnedFd::from(file)));
        let lock = state.lock(Duration::from_secs(1)).unwrap().unwrap();
        assert!(cloexec(&lock._file));
        let (name, tmp) = dir.create_temp("devices.json").unwrap();
        assert!(cloexec(&tmp));
        let _ = std::fs::remove_file(t.path().join(name));
    }

    #[test]
    fn a_lock_let_go_of_while_we_wait_is_taken() {
        let (_t, state) = dir_with(DEVICES);
        let held = state.lock(Duration::from_secs(1)).unwrap();
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(held);
        });
        let start = Instant::now();
        assert!(state.lock(Duration::from_secs(5)).unwrap().is_some());
        assert!(start.elapsed() >= Duration::from_millis(90));
        letting_go.join().unwrap();
    }

    #[test]
    fn a_state_file_of_exactly_the_cap_is_read() {
        let (t, state) = dir_with(DEVICES);
        let f = File::create(t.path().join("envs.json")).unwrap();
        f.set_len(MAX_STATE_BYTES).unwrap();
        let files = state.read(Duration::from_secs(1)).unwrap();
        assert_eq!(files.envs.map(|e| e.len() as u64), Some(MAX_STATE_BYTES));
    }

    #[test]
    fn temp_files_get_fresh_names() {
        let (t, state) = dir_with(DEVICES);
        let dir = state.open().unwrap().unwrap();
        let (a, _) = dir.create_temp("devices.json").unwrap();
        let (b, _) = dir.create_temp("devices.json").unwrap();
        assert_ne!(a, b);
        assert!(t.path().join(&a).exists() && t.path().join(&b).exists());
    }

    #[test]
    fn a_failed_replace_leaves_no_temp_file_and_the_old_file() {
        let (t, state) = dir_with(DEVICES);
        // devices.json becomes a directory between read and rename: rename
        // fails; simulate by making the temp file's rename target a directory.
        let dir = state.open().unwrap().unwrap();
        std::fs::create_dir(t.path().join("blocked")).unwrap();
        std::fs::write(t.path().join("blocked/x"), "").unwrap();
        let e = dir.replace("blocked", &serde_json::json!({})).unwrap_err();
        assert!(crate::error::chain(&e).contains("blocked"), "{e}");
        assert_eq!(names(t.path()), ["blocked", "devices.json"]);
    }
}
