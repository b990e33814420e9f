//! `--state-db`: what a run keeps across restarts, in an embedded SQLite
//! database (WAL, schema versions in `user_version`): each action's
//! progress (warned, deadline), the processes seen orphaned, and a record
//! of what happened (events, actions) and of who used what (one sample per
//! cycle, per host and user). Root's alone: the file is 0600 in a 0700
//! directory of ours, neither ever followed through a symlink; anything
//! else is refused. Rows older than `--retain` are dropped.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use rustix::fs::{Mode, OFlags};
use thiserror::Error;

use crate::ladder::{Event, Saved};
use crate::model::HostId;
use crate::outcome::Acted;
use crate::private::{ancestors, own_dir, own_file, Refusal};
use crate::rules::{IdleHistory, InLine, Orphans};
use crate::usage::{ActionRow, EventRow, Recorded, Sample, UsageRow};

/// Why the database cannot be used.
#[derive(Debug, Error)]
pub enum StateDbError {
    /// The file is refused, or could not be opened.
    #[error("--state-db {}", path.display())]
    Refused {
        path: PathBuf,
        #[source]
        source: Refusal,
    },
    /// Its directory (or one above) is refused, or could not be opened.
    #[error("--state-db {}: its directory", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: Refusal,
    },
    #[error("--state-db {}: written by a newer genv-enforce (schema {found}, we know {known}): refused", path.display())]
    Newer {
        path: PathBuf,
        found: usize,
        known: usize,
    },
    #[error("--state-db {}: its {what} cannot be read back: {why}", path.display())]
    Corrupt {
        path: PathBuf,
        what: String,
        why: String,
    },
    #[error("--state-db {}", path.display())]
    Sql {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
}

impl StateDbError {
    /// Whether the database was refused (a usage error), rather than
    /// unreadable.
    pub fn is_refusal(&self) -> bool {
        match self {
            StateDbError::Refused { source, .. } | StateDbError::Dir { source, .. } => {
                !matches!(source, Refusal::Io(_))
            }
            StateDbError::Newer { .. } => true,
            StateDbError::Corrupt { .. } | StateDbError::Sql { .. } => false,
        }
    }
}

/// The schema, one step per version (`PRAGMA user_version`).
const MIGRATIONS: &[&str] = &[
    // 1: kept state; events, actions and usage with their time.
    "CREATE TABLE kept (name TEXT PRIMARY KEY, value TEXT NOT NULL);
     CREATE TABLE events (time_ms INTEGER NOT NULL, host TEXT NOT NULL, stage TEXT NOT NULL,
        action TEXT NOT NULL, pid INTEGER, start_time INTEGER, device INTEGER, eid TEXT,
        user TEXT, rules TEXT NOT NULL, since_ms INTEGER NOT NULL, deadline_ms INTEGER);
     CREATE INDEX events_time ON events (time_ms);
     CREATE TABLE actions (time_ms INTEGER NOT NULL, host TEXT NOT NULL, action TEXT NOT NULL,
        pid INTEGER, device INTEGER, eid TEXT, result TEXT NOT NULL);
     CREATE INDEX actions_time ON actions (time_ms);
     CREATE TABLE usage (time_ms INTEGER NOT NULL, seconds REAL NOT NULL, host TEXT NOT NULL,
        user TEXT NOT NULL, devices INTEGER NOT NULL, memory_bytes INTEGER NOT NULL,
        processes INTEGER NOT NULL);
     CREATE INDEX usage_time ON usage (time_ms);",
    // 2: whose each action was, and why.
    "ALTER TABLE actions ADD COLUMN user TEXT;
     ALTER TABLE actions ADD COLUMN rules TEXT NOT NULL DEFAULT '';",
    // 3: how many events or actions a row stands for (those left out of a
    // cycle's rows one by one, [`crate::history`]).
    "ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
     ALTER TABLE actions ADD COLUMN count INTEGER NOT NULL DEFAULT 1;",
];

/// The longest gap between two samples that counts as usage when the
/// caller gives none (cron runs): longer, the enforcer was stopped and
/// what happened meanwhile was not seen.
pub const MAX_SAMPLE_GAP: std::time::Duration = std::time::Duration::from_secs(3600);

/// An open state database.
#[derive(Debug)]
pub struct StateDb {
    path: PathBuf,
    conn: Mutex<Connection>,
    /// The actions the last cycle recorded carried out: one carried out
    /// again as then is counted, not written again.
    before: Mutex<HashSet<crate::history::Done>>,
    /// A writer holds the file locked (flock) for as long as it runs: two
    /// runs never both write it (a dry run beside the service included).
    _lock: Option<std::os::fd::OwnedFd>,
}

impl StateDb {
    /// Opens (creating it 0600 if missing) the database at `path`, whose
    /// directory must be ours and 0700; brings its schema up to date.
    ///
    /// # Errors
    /// The file or its directory is refused, or cannot be opened or
    /// migrated.
    pub fn open(path: &Path) -> Result<Self, StateDbError> {
        StateDb::open_with(path, true)
    }

    /// Opens an existing database at `path` (checked as [`StateDb::open`]
    /// does), for reading what runs recorded.
    ///
    /// # Errors
    /// It is missing, refused, or cannot be opened or migrated.
    pub fn open_existing(path: &Path) -> Result<Self, StateDbError> {
        StateDb::open_with(path, false)
    }

    fn open_with(path: &Path, create: bool) -> Result<Self, StateDbError> {
        let refused = |source: Refusal| StateDbError::Refused {
            path: path.to_path_buf(),
            source,
        };
        let dir_refused = |source: Refusal| StateDbError::Dir {
            path: path.to_path_buf(),
            source,
        };
        let name = path.file_name().ok_or_else(|| refused(Refusal::NoName))?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = rustix::fs::open(
            parent,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            dir_refused(match e {
                rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => Refusal::LinkOrNotDir,
                e => Refusal::Io(e.into()),
            })
        })?;
        own_dir(&dir).map_err(dir_refused)?;
        // The directory is ours alone: what we check here stays so.
        let file = rustix::fs::openat(
            &dir,
            name,
            OFlags::RDWR
                | if create {
                    OFlags::CREATE
                } else {
                    OFlags::empty()
                }
                | OFlags::NOFOLLOW
                | OFlags::NONBLOCK
                | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| refused(e.into()))?;
        own_file(&file, 0o077).map_err(refused)?;
        let lock = if create {
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                .map_err(|e| {
                    refused(match e {
                        rustix::io::Errno::WOULDBLOCK => Refusal::InUse,
                        e => Refusal::Io(e.into()),
                    })
                })?;
            Some(file)
        } else {
            drop(file);
            None
        };
        ancestors(parent).map_err(dir_refused)?;
        let sql = |source| StateDbError::Sql {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX
                | OpenFlags::SQLITE_OPEN_NOFOLLOW,
        )
        .map_err(sql)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(sql)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sql)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(sql)?;
        let version: usize = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(sql)?;
        if version > MIGRATIONS.len() {
            return Err(StateDbError::Newer {
                path: path.to_path_buf(),
                found: version,
                known: MIGRATIONS.len(),
            });
        }
        for (i, step) in MIGRATIONS.iter().enumerate().skip(version) {
            let tx = conn.unchecked_transaction().map_err(sql)?;
            tx.execute_batch(step).map_err(sql)?;
            tx.pragma_update(None, "user_version", i + 1).map_err(sql)?;
            tx.commit().map_err(sql)?;
        }
        Ok(StateDb {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
            before: Mutex::new(HashSet::new()),
            _lock: lock,
        })
    }

    fn sql(&self, source: rusqlite::Error) -> StateDbError {
        StateDbError::Sql {
            path: self.path.clone(),
            source,
        }
    }

    fn kept<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StateDbError> {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let text: Option<String> = conn
            .query_row("SELECT value FROM kept WHERE name = ?1", [name], |r| {
                r.get(0)
            })
            .optional()
            .map_err(|e| self.sql(e))?;
        text.map(|t| serde_json::from_str(&t))
            .transpose()
            .map_err(|e| StateDbError::Corrupt {
                path: self.path.clone(),
                what: name.to_string(),
                why: e.to_string(),
            })
    }

    /// Each action's progress as the last run left it.
    ///
    /// # Errors
    /// The database cannot be read.
    pub fn ladder(&self) -> Result<Vec<Saved>, StateDbError> {
        Ok(self.kept("ladder")?.unwrap_or_default())
    }

    /// Each host's processes seen orphaned, as the last run left them.
    ///
    /// # Errors
    /// The database cannot be read.
    pub fn orphans(&self) -> Result<HashMap<HostId, Orphans>, StateDbError> {
        Ok(self.kept("orphans")?.unwrap_or_default())
    }

    /// Since when each job is in line, as the last run left it (a restart
    /// must not make a stray brought into line look in line all along).
    ///
    /// # Errors
    /// The database cannot be read.
    pub fn in_line(&self) -> Result<InLine, StateDbError> {
        Ok(self.kept("in_line")?.unwrap_or_default())
    }

    /// Each host's cycles in a row with its genv state unusable, as the
    /// last run left them (a restart, or a cron run, must not make a host
    /// kept garbled look fresh).
    ///
    /// # Errors
    /// The database cannot be read.
    pub fn unusable(&self) -> Result<HashMap<HostId, u32>, StateDbError> {
        Ok(self.kept("unusable")?.unwrap_or_default())
    }

    /// Each process's idle window, as the last run left them (the idle
    /// rule's window survives a restart).
    ///
    /// # Errors
    /// The database cannot be read.
    pub fn idle(&self) -> Result<IdleHistory, StateDbError> {
        Ok(self.kept("idle")?.unwrap_or_default())
    }

    /// Records one cycle at `now` (ms): what is kept (each action's
    /// progress, the orphans, since when jobs are in line, the unusable streaks, the idle windows), its
    /// events and the actions' outcomes (a bounded number of rows a user,
    /// [`crate::history`]) and the usage samples; drops rows older than
    /// `retain_ms`. One transaction.
    ///
    /// # Errors
    /// The database cannot be written (nothing of the cycle is).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        now: u64,
        ladder: &[Saved],
        orphans: &HashMap<HostId, Orphans>,
        in_line: &InLine,
        unusable: &HashMap<HostId, u32>,
        idle: &IdleHistory,
        events: &[Event],
        acted: &[Acted],
        usage: &[Sample],
        retain_ms: u64,
        max_gap_ms: u64,
    ) -> Result<(), StateDbError> {
        let mut before = self.before.lock().unwrap_or_else(|e| e.into_inner());
        let events = crate::history::events(events);
        let (actions, done) = crate::history::actions(acted, &before);
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let tx = conn.transaction().map_err(|e| self.sql(e))?;
        let run = || -> rusqlite::Result<()> {
            let last: Option<i64> = tx
                .query_row(
                    "SELECT value FROM kept WHERE name = 'last_sample_ms'",
                    [],
                    |r| r.get::<_, String>(0),
                )
                .optional()?
                .and_then(|t| t.parse().ok());
            // Usage since the sample before, if it was seen: a gap longer
            // than `max_gap_ms` (a stop) counts nothing.
            let seconds = match last {
                Some(l) if (0..=max_gap_ms as i64).contains(&(now as i64 - l)) => {
                    (now as i64 - l) as f64 / 1000.0
                }
                _ => 0.0,
            };
            let mut keep = tx.prepare_cached(
                "INSERT INTO kept (name, value) VALUES (?1, ?2)
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            )?;
            keep.execute(params!["ladder", json(&ladder)])?;
            keep.execute(params!["orphans", json(&orphans)])?;
            keep.execute(params!["in_line", json(&in_line)])?;
            keep.execute(params!["unusable", json(&unusable)])?;
            keep.execute(params!["idle", json(&idle)])?;
            keep.execute(params!["last_sample_ms", now.to_string()])?;
            let mut event = tx.prepare_cached(
                "INSERT INTO events VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            )?;
            for e in &events {
                let big = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                event.execute(params![
                    now as i64,
                    e.host,
                    e.stage,
                    e.action,
                    e.pid,
                    e.start_time.map(big),
                    e.device,
                    e.eid,
                    e.user,
                    e.rules,
                    big(e.since_ms),
                    e.deadline_ms.map(big),
                    big(e.count),
                ])?;
            }
            let mut action = tx.prepare_cached(
                "INSERT INTO actions (time_ms, host, action, pid, device, eid, result, user, rules, count)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            )?;
            for a in &actions {
                action.execute(params![
                    now as i64,
                    a.host,
                    a.action,
                    a.pid,
                    a.device,
                    a.eid,
                    a.result,
                    a.user,
                    a.rules,
                    i64::try_from(a.count).unwrap_or(i64::MAX),
                ])?;
            }
            let mut sample =
                tx.prepare_cached("INSERT INTO usage VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)")?;
            for s in usage {
                sample.execute(params![
                    now as i64,
                    seconds,
                    s.host.0,
                    s.user,
                    s.devices,
                    s.memory_bytes as i64,
                    s.processes
                ])?;
            }
            let before = now.saturating_sub(retain_ms) as i64;
            for table in ["events", "actions", "usage"] {
                tx.execute(&format!("DELETE FROM {table} WHERE time_ms < ?1"), [before])?;
            }
            Ok(())
        };
        run().map_err(|e| self.sql(e))?;
        tx.commit().map_err(|e| self.sql(e))?;
        *before = done;
        Ok(())
    }
}

impl StateDb {
    /// What was recorded from `since_ms` on, for `report`.
    ///
    /// # Errors
    /// The database cannot be read.
    pub fn since(&self, since_ms: u64) -> Result<Recorded, StateDbError> {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let since = since_ms as i64;
        let read = || -> rusqlite::Result<Recorded> {
            let mut usage = conn.prepare(
                "SELECT time_ms, seconds, host, user, devices, memory_bytes FROM usage
                 WHERE time_ms >= ?1 ORDER BY time_ms",
            )?;
            let usage = usage
                .query_map([since], |r| {
                    Ok(UsageRow {
                        time_ms: r.get::<_, i64>(0)? as u64,
                        seconds: r.get(1)?,
                        host: r.get(2)?,
                        user: r.get(3)?,
                        devices: r.get(4)?,
                        memory_bytes: r.get::<_, i64>(5)? as u64,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut events = conn.prepare(
                "SELECT host, user, stage, rules, pid, device, eid, count FROM events
                 WHERE time_ms >= ?1 ORDER BY time_ms",
            )?;
            let events = events
                .query_map([since], |r| {
                    Ok(EventRow {
                        host: r.get(0)?,
                        user: r.get(1)?,
                        stage: r.get(2)?,
                        rules: r.get(3)?,
                        target: target(r.get(4)?, r.get(5)?, r.get(6)?),
                        count: r.get::<_, i64>(7)?.max(0) as u64,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut actions = conn.prepare(
                "SELECT host, user, action, result, rules, pid, device, eid, count FROM actions
                 WHERE time_ms >= ?1 ORDER BY time_ms",
            )?;
            let actions = actions
                .query_map([since], |r| {
                    Ok(ActionRow {
                        host: r.get(0)?,
                        user: r.get(1)?,
                        action: r.get(2)?,
                        result: r.get(3)?,
                        rules: r.get(4)?,
                        target: target(r.get(5)?, r.get(6)?, r.get(7)?),
                        count: r.get::<_, i64>(8)?.max(0) as u64,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            Ok(Recorded {
                usage,
                events,
                actions,
            })
        };
        read().map_err(|e| self.sql(e))
    }
}

/// What an action is done to: a pid, or an environment on a device.
/// None: a row that counts those left out.
fn target(pid: Option<i64>, device: Option<i64>, eid: Option<String>) -> String {
    match (pid, device, eid) {
        (Some(p), ..) => format!("pid {p}"),
        (None, None, None) => String::new(),
        (None, device, eid) => format!("{} on {}", eid.unwrap_or_default(), device.unwrap_or(-1)),
    }
}

/// JSON text of a kept value.
fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".into())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    use super::*;
    use crate::ladder::{Grace, Ladder};
    use crate::model::Pid;
    use crate::plan::{HostPlan, Plan, Termination};

    fn private_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        dir
    }

    #[test]
    fn only_a_private_file_in_a_private_directory_is_used() {
        let dir = private_dir();
        let path = dir.path().join("state.db");
        let writer = StateDb::open(&path).unwrap();
        // One writer at a time; a reader (report) beside it is fine.
        match StateDb::open(&path) {
            Err(e @ StateDbError::Refused { .. }) => {
                let why = crate::error::chain(&e);
                assert!(why.contains("in use"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        StateDb::open_existing(&path).unwrap();
        drop(writer);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let refused = |path: &Path| match StateDb::open(path) {
            Err(e @ (StateDbError::Refused { .. } | StateDbError::Dir { .. })) => {
                crate::error::chain(&e)
            }
            other => panic!("{other:?}"),
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(refused(&path).contains("open to others"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("link.db");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(refused(&link).contains("symbolic link"));
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(refused(&open.path().join("s.db")).contains("its directory: open to others"));
        let linked_dir = dir.path().join("d");
        std::os::unix::fs::symlink(open.path(), &linked_dir).unwrap();
        assert!(refused(&linked_dir.join("s.db")).contains("symbolic link"));
    }

    #[test]
    fn a_newer_schema_is_refused_and_an_older_one_migrated() {
        let dir = private_dir();
        let path = dir.path().join("state.db");
        drop(StateDb::open(&path).unwrap());
        let c = Connection::open(&path).unwrap();
        let v: usize = c
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(v, MIGRATIONS.len());
        c.pragma_update(None, "user_version", 99).unwrap();
        drop(c);
        // One written by the release before (schema 2), with a row: brought
        // up to date, its row counting once.
        let old = dir.path().join("old.db");
        let c = Connection::open(&old).unwrap();
        for step in &MIGRATIONS[..2] {
            c.execute_batch(step).unwrap();
        }
        c.pragma_update(None, "user_version", 2).unwrap();
        c.execute(
            "INSERT INTO actions VALUES (5, 'h', 'detach', NULL, 0, 'e', 'detached', 'alice', '')",
            [],
        )
        .unwrap();
        drop(c);
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o600)).unwrap();
        let recorded = StateDb::open(&old).unwrap().since(0).unwrap();
        assert_eq!(recorded.actions[0].count, 1);
        match StateDb::open(&path) {
            Err(e @ StateDbError::Newer { .. }) => {
                assert!(e.to_string().contains("newer"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn progress_and_orphans_survive_a_reopen_and_old_rows_go() {
        let dir = private_dir();
        let path = dir.path().join("state.db");
        let db = StateDb::open(&path).unwrap();
        let grace = Grace {
            after: Duration::from_secs(60),
            ..Grace::default()
        };
        let mut ladder = Ladder::new(grace.clone());
        let host = HostId("h".into());
        let plan = Plan {
            hosts: vec![(
                host.clone(),
                HostPlan {
                    terminate: vec![Termination::of(Pid(7), Some(70))],
                    detach: vec![],
                },
            )],
        };
        let warned = ladder.advance(&plan, 1_000, &[]);
        assert_eq!(warned.len(), 1);
        let orphans: HashMap<HostId, Orphans> =
            [(host.clone(), [(Pid(9), 90)].into_iter().collect())]
                .into_iter()
                .collect();
        let in_line: InLine = serde_json::from_value(serde_json::json!([
            [host.0, 4_000, [[9, {"start": 90, "last": 4_000, "devices": [[1, {"since": 5_000}]]}]]]
        ]))
        .unwrap();
        assert_eq!(in_line.len(), 1);
        let unusable: HashMap<HostId, u32> = [(host.clone(), 2)].into_iter().collect();
        let usage = [Sample {
            host: host.clone(),
            user: "alice".into(),
            devices: 2,
            memory_bytes: 1 << 30,
            processes: 1,
        }];
        db.record(
            1_000,
            &ladder.export(),
            &orphans,
            &in_line,
            &unusable,
            &IdleHistory::default(),
            &warned,
            &[],
            &usage,
            10_000,
            60_000,
        )
        .unwrap();
        db.record(
            5_000,
            &ladder.export(),
            &orphans,
            &in_line,
            &unusable,
            &IdleHistory::default(),
            &[],
            &[],
            &usage,
            10_000,
            60_000,
        )
        .unwrap();
        drop(db);
        let db = StateDb::open(&path).unwrap();
        assert_eq!(db.orphans().unwrap(), orphans);
        assert_eq!(db.in_line().unwrap(), in_line);
        assert_eq!(db.unusable().unwrap(), unusable);
        let mut again = Ladder::restore(grace, db.ladder().unwrap());
        // Not warned again; due at the same deadline.
        assert!(again.advance(&plan, 30_000, &[]).is_empty());
        assert!(again.split(&plan, 60_999).0.hosts.is_empty());
        assert_eq!(again.split(&plan, 61_000).0.hosts.len(), 1);
        let count = |table: &str| -> i64 {
            let c = db.conn.lock().unwrap();
            c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!((count("events"), count("usage")), (1, 2));
        let seconds: Vec<f64> = {
            let c = db.conn.lock().unwrap();
            let mut s = c
                .prepare("SELECT seconds FROM usage ORDER BY time_ms")
                .unwrap();
            s.query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        assert_eq!(seconds, [0.0, 4.0]);

        // Past --retain: the first cycle's rows go.
        db.record(
            12_000,
            &again.export(),
            &orphans,
            &InLine::default(),
            &unusable,
            &IdleHistory::default(),
            &[],
            &[],
            &[],
            10_000,
            60_000,
        )
        .unwrap();
        assert_eq!((count("events"), count("usage")), (0, 1));
        // After a stop longer than the gap allowed, nothing is counted.
        db.record(
            200_000,
            &again.export(),
            &orphans,
            &InLine::default(),
            &unusable,
            &IdleHistory::default(),
            &[],
            &[],
            &usage,
            1_000_000,
            60_000,
        )
        .unwrap();
        let last: f64 = db
            .conn
            .lock()
            .unwrap()
            .query_row("SELECT seconds FROM usage ORDER BY time_ms DESC", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(last, 0.0);
    }

    #[test]
    fn a_users_rows_are_bounded_a_cycle_and_the_report_still_counts_them() {
        use crate::model::{EnvId, GpuIndex};
        use crate::outcome::{DetachResult, Outcome};
        let dir = private_dir();
        let db = StateDb::open(&dir.path().join("state.db")).unwrap();
        let host = HostId("h".into());
        let mut ladder = Ladder::new(Grace {
            after: Duration::from_secs(60),
            ..Grace::default()
        });
        // 40 of bob's jobs warned of; 40 records with made-up names
        // detached, in two cycles alike.
        let terminate = (0..40)
            .map(|p| {
                let mut t = Termination::of(Pid(100 + p), Some(7));
                (t.uid, t.user) = (Some(1001), Some("bob".into()));
                t
            })
            .collect();
        let plan = Plan {
            hosts: vec![(
                host.clone(),
                HostPlan {
                    terminate,
                    detach: vec![],
                },
            )],
        };
        let warned = ladder.advance(&plan, 1_000, &[]);
        assert_eq!(warned.len(), 40);
        let acted: Vec<Acted> = (0..40)
            .map(|i| Acted {
                outcome: Outcome::Detach {
                    host: host.clone(),
                    device: GpuIndex(0),
                    eid: EnvId(format!("forged-{i}").into()),
                    outcome: DetachResult::Detached,
                },
                user: Some(format!("made-up-{i}")),
                rules: vec![crate::rules::Rule::MaxDevicesPerUser],
                owner: None,
            })
            .collect();
        let (orphans, unusable) = (HashMap::new(), HashMap::new());
        let idle = IdleHistory::default();
        let record = |now: u64, events: &[Event]| {
            db.record(
                now,
                &[],
                &orphans,
                &InLine::default(),
                &unusable,
                &idle,
                events,
                &acted,
                &[],
                1 << 40,
                60_000,
            )
            .unwrap();
        };
        record(1_000, &warned);
        record(2_000, &[]);
        let count = |table: &str| -> i64 {
            let c = db.conn.lock().unwrap();
            c.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
                .unwrap()
        };
        // 32 one by one and one row for the rest; the second cycle's
        // detaches, as the first's, in one row.
        assert_eq!((count("events"), count("actions")), (33, 34));
        let recorded = db.since(0).unwrap();
        let targets: Vec<&str> = recorded.actions.iter().map(|a| a.target.as_str()).collect();
        assert_eq!(
            (targets[0], targets[32], targets[33]),
            ("forged-0 on 0", "", "")
        );
        assert_eq!(recorded.events[0].target, "pid 100");
        let lines = crate::usage::summarize(&recorded, false);
        let total = |f: fn(&crate::usage::Line) -> u64| lines.iter().map(f).sum::<u64>();
        assert_eq!(total(|l| l.warnings), 40);
        assert_eq!(total(|l| l.detaches), 80);
    }

    #[test]
    fn kept_state_that_cannot_be_read_back_is_an_error_not_a_silent_reset() {
        let dir = private_dir();
        let path = dir.path().join("state.db");
        let db = StateDb::open(&path).unwrap();
        db.conn
            .lock()
            .unwrap()
            .execute("INSERT INTO kept VALUES ('ladder', '{not json')", [])
            .unwrap();
        match db.ladder() {
            Err(StateDbError::Corrupt { what, .. }) => assert_eq!(what, "ladder"),
            other => panic!("{other:?}"),
        }
        assert!(db.orphans().unwrap().is_empty());
    }
}
