//! Files and directories of ours that root opens or trusts (the audit
//! log, the state database and its directory, secrets, the metrics
//! endpoint's key, the SSH control directory and its sockets): never
//! through a symbolic link, never a FIFO or a device, only ours, and
//! closed to others as each needs. Every such check is here, with one
//! error, [`Refusal`].

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Stat};
use rustix::io::Errno;

/// Why a file or directory of ours is refused, or the error that kept it
/// from being checked.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("a symbolic link: refused")]
    Link,
    #[error("a socket or FIFO: refused")]
    FifoOrSocket,
    #[error("not a regular file: refused")]
    NotFile,
    /// A path that names no file (`/`, `..`).
    #[error("not a file name: refused")]
    NoName,
    #[error("not a directory: refused")]
    NotDir,
    /// What a directory opened without following a link turned out to
    /// be: the kernel does not say which.
    #[error("a symbolic link or not a directory: refused")]
    LinkOrNotDir,
    #[error("not a socket: refused")]
    NotSocket,
    #[error("not owned by us: refused")]
    NotOurs,
    #[error("writable by others: refused")]
    WritableByOthers,
    /// A secret or a key that others may read or write.
    #[error("others may read or write it: refused (chmod 600)")]
    Shared,
    /// Open to others where it must be `mode`.
    #[error("open to others (must be {0:04o}): refused")]
    Open(u32),
    #[error("write-protected: refused")]
    WriteProtected,
    /// A directory above it that another user could replace.
    #[error("{} above it could be replaced by another user: refused", .0.display())]
    Ancestor(PathBuf),
    #[error("in use by another run of genv-enforce: refused")]
    InUse,
    /// A configuration file of another user than root or us.
    #[error("owned by another user than root: refused")]
    NotRootOrOurs,
    #[error("larger than {0} bytes: refused")]
    TooLarge(u64),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl From<Errno> for Refusal {
    /// An open's error: a symlink (`O_NOFOLLOW`) or a FIFO or socket
    /// (`O_NONBLOCK` write) is a refusal; anything else an I/O error.
    fn from(e: Errno) -> Self {
        match e {
            Errno::LOOP => Refusal::Link,
            Errno::NXIO => Refusal::FifoOrSocket,
            e => Refusal::Io(e.into()),
        }
    }
}

/// Checks that `stat` is of `kind`, owned by us, and has none of the
/// permission bits of `closed` (each kind of bit refused in its words).
///
/// # Errors
/// The first check that fails.
pub fn check(stat: &Stat, kind: FileType, closed: u32) -> Result<(), Refusal> {
    if FileType::from_raw_mode(stat.st_mode) != kind {
        return Err(match kind {
            FileType::Directory => Refusal::NotDir,
            FileType::Socket => Refusal::NotSocket,
            _ => Refusal::NotFile,
        });
    }
    if stat.st_uid != rustix::process::geteuid().as_raw() {
        return Err(Refusal::NotOurs);
    }
    let open = stat.st_mode & closed & 0o777;
    if open == 0 {
        return Ok(());
    }
    Err(match closed {
        0o022 => Refusal::WritableByOthers,
        _ if kind == FileType::Directory => Refusal::Open(0o700),
        _ => Refusal::Open(0o600),
    })
}

/// Checks that `fd` is a regular file owned by us that others may not
/// write; its status, for more checks.
///
/// # Errors
/// It is something else, or another user's, or cannot be looked at.
pub fn own_file(fd: impl AsFd, closed: u32) -> Result<Stat, Refusal> {
    let stat = rustix::fs::fstat(fd).map_err(|e| Refusal::Io(e.into()))?;
    check(&stat, FileType::RegularFile, closed)?;
    Ok(stat)
}

/// Checks that `fd` is a directory of ours that no one else may enter.
///
/// # Errors
/// It is something else, another user's, or open to others.
pub fn own_dir(fd: impl AsFd) -> Result<(), Refusal> {
    let stat = rustix::fs::fstat(fd).map_err(|e| Refusal::Io(e.into()))?;
    check(&stat, FileType::Directory, 0o077)
}

/// Checks what is at `path`, not following a link: `kind`, ours, none of
/// `closed`'s bits.
///
/// # Errors
/// As [`check`]; a link is not what was asked for.
pub fn own_path(path: &Path, kind: FileType, closed: u32) -> Result<(), Refusal> {
    let stat = rustix::fs::lstat(path).map_err(|e| Refusal::Io(e.into()))?;
    if FileType::from_raw_mode(stat.st_mode) == FileType::Symlink {
        return Err(Refusal::Link);
    }
    check(&stat, kind, closed)
}

/// Makes sure `dir` is a directory of ours (created 0700 if missing) that
/// no one else may write to.
///
/// # Errors
/// It cannot be made, or is refused.
pub fn writable_only_by_us(dir: &Path) -> Result<(), Refusal> {
    use std::os::unix::fs::DirBuilderExt;
    if std::fs::symlink_metadata(dir).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    own_path(dir, FileType::Directory, 0o022)
}

/// Checks that no one but root (or us) can replace a directory on the way
/// to `dir`: each one above it is ours or root's, and writable by others
/// only if sticky.
///
/// # Errors
/// The first directory that another user could replace.
pub fn ancestors(dir: &Path) -> Result<(), Refusal> {
    let full = std::fs::canonicalize(dir)?;
    match full.parent() {
        Some(up) => ancestors_from(up),
        None => Ok(()),
    }
}

/// Checks `dir` (canonical) and each directory above it as [`ancestors`]
/// does.
fn ancestors_from(dir: &Path) -> Result<(), Refusal> {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::geteuid().as_raw();
    for a in dir.ancestors() {
        let m = std::fs::metadata(a)?;
        let others_write = m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0;
        if (m.uid() != 0 && m.uid() != me) || others_write {
            return Err(Refusal::Ancestor(a.to_path_buf()));
        }
    }
    Ok(())
}

/// The text of a secret of ours (`--smtp-credentials`, a password file):
/// a regular file, not through a symlink, ours, that no one else may read
/// or write; at most 4 KiB.
///
/// # Errors
/// Why it is refused, or what kept it from being read.
pub fn read_secret(path: &Path) -> Result<String, Refusal> {
    use rustix::fs::{Mode, OFlags};
    use std::io::Read;
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(Refusal::from)?;
    secret(&rustix::fs::fstat(&fd).map_err(|e| Refusal::Io(e.into()))?)?;
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(4096)
        .read_to_string(&mut text)?;
    Ok(text)
}

/// The largest configuration file read (a real one is a few KiB; an
/// inventory of thousands of hosts, some hundred).
pub const CONFIG_MAX: u64 = 16 << 20;

/// The text of a configuration file the admin names (`--config`, an
/// inventory or hostfile): a regular file (a link is followed: config
/// management makes them) owned by root or us that no one else may write,
/// in directories no other user can replace, at most [`CONFIG_MAX`]
/// bytes. Never blocks: a FIFO is refused before it is read.
///
/// # Errors
/// Why it is refused, or what kept it from being read.
pub fn read_config(path: &Path) -> Result<String, Refusal> {
    use rustix::fs::{Mode, OFlags};
    use std::io::Read;
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(Refusal::from)?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| Refusal::Io(e.into()))?;
    match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => {}
        FileType::Fifo | FileType::Socket => return Err(Refusal::FifoOrSocket),
        _ => return Err(Refusal::NotFile),
    }
    if stat.st_uid != 0 && stat.st_uid != rustix::process::geteuid().as_raw() {
        return Err(Refusal::NotRootOrOurs);
    }
    if stat.st_mode & 0o022 != 0 {
        return Err(Refusal::WritableByOthers);
    }
    let real = std::fs::canonicalize(path)?;
    if let Some(dir) = real.parent() {
        ancestors_from(dir)?;
    }
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(CONFIG_MAX + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > CONFIG_MAX {
        return Err(Refusal::TooLarge(CONFIG_MAX));
    }
    Ok(text)
}

/// Checks that a secret (or a private key) at `path`, not followed, is a
/// regular file of ours that no one else may read or write.
///
/// # Errors
/// Why it is refused.
pub fn secret_path(path: &Path) -> Result<(), Refusal> {
    let stat = rustix::fs::lstat(path).map_err(|e| Refusal::Io(e.into()))?;
    secret(&stat)
}

/// A secret's status: a regular file of ours, closed to others.
fn secret(stat: &Stat) -> Result<(), Refusal> {
    match check(stat, FileType::RegularFile, 0o077) {
        Err(Refusal::Open(_)) => Err(Refusal::Shared),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path, m: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(m)).unwrap();
    }

    #[test]
    fn a_config_file_is_read_only_when_no_one_else_could_have_written_it() {
        let dir = tempfile::tempdir().unwrap();
        mode(dir.path(), 0o755);
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "[rules]\n").unwrap();
        mode(&file, 0o644);
        assert_eq!(read_config(&file).unwrap(), "[rules]\n");
        let link = dir.path().join("l.toml");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_config(&link).unwrap(), "[rules]\n");
        for m in [0o664, 0o646] {
            mode(&file, m);
            assert!(
                matches!(read_config(&file), Err(Refusal::WritableByOthers)),
                "{m:o}"
            );
        }
        mode(&file, 0o644);
        mode(dir.path(), 0o775);
        assert!(matches!(read_config(&file), Err(Refusal::Ancestor(d)) if d == dir.path()));
        mode(dir.path(), 0o1777);
        assert_eq!(read_config(&file).unwrap(), "[rules]\n", "sticky, as /tmp");
        mode(dir.path(), 0o755);
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(matches!(read_config(&fifo), Err(Refusal::FifoOrSocket)));
        assert!(matches!(read_config(dir.path()), Err(Refusal::NotFile)));
        assert!(matches!(
            read_config(Path::new("/dev/null")),
            Err(Refusal::NotFile)
        ));
        let full = dir.path().join("full");
        std::fs::write(&full, vec![b'#'; usize::try_from(CONFIG_MAX).unwrap()]).unwrap();
        assert_eq!(read_config(&full).unwrap().len() as u64, CONFIG_MAX);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&full)
            .unwrap()
            .set_len(CONFIG_MAX + 1)
            .unwrap();
        assert!(matches!(
            read_config(&full),
            Err(Refusal::TooLarge(CONFIG_MAX))
        ));
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
            assert!(matches!(read_config(&file), Err(Refusal::NotRootOrOurs)));
        }
    }

    #[test]
    fn each_refusal_is_told_in_its_words() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "user\npass\n").unwrap();
        mode(&file, 0o600);
        assert_eq!(read_secret(&file).unwrap(), "user\npass\n");
        assert!(secret_path(&file).is_ok());
        mode(&file, 0o640);
        assert!(matches!(read_secret(&file), Err(Refusal::Shared)));
        assert!(matches!(secret_path(&file), Err(Refusal::Shared)));
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(matches!(read_secret(&link), Err(Refusal::Link)));
        assert!(matches!(
            own_path(&link, FileType::RegularFile, 0o022),
            Err(Refusal::Link)
        ));
        assert!(matches!(
            own_path(dir.path(), FileType::RegularFile, 0o022),
            Err(Refusal::NotFile)
        ));
        assert!(matches!(
            own_path(&file, FileType::Directory, 0o022),
            Err(Refusal::NotDir)
        ));
        mode(&file, 0o662);
        assert_eq!(
            own_path(&file, FileType::RegularFile, 0o022)
                .unwrap_err()
                .to_string(),
            "writable by others: refused"
        );
        let fd = std::fs::File::open(&file).unwrap();
        assert_eq!(
            own_file(&fd, 0o077).unwrap_err().to_string(),
            "open to others (must be 0600): refused"
        );
        mode(dir.path(), 0o750);
        let d = std::fs::File::open(dir.path()).unwrap();
        assert_eq!(
            own_dir(&d).unwrap_err().to_string(),
            "open to others (must be 0700): refused"
        );
        mode(dir.path(), 0o700);
        assert!(own_dir(&d).is_ok());
        let made = dir.path().join("a/b");
        writable_only_by_us(&made).unwrap();
        assert!(own_path(&made, FileType::Directory, 0o077).is_ok());
        mode(&made, 0o777);
        assert!(matches!(
            writable_only_by_us(&made),
            Err(Refusal::WritableByOthers)
        ));
    }

    #[test]
    fn a_directory_above_that_others_may_replace_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        let inner = open.join("inner");
        std::fs::create_dir_all(&inner).unwrap();
        mode(&open, 0o777);
        match ancestors(&inner) {
            Err(Refusal::Ancestor(a)) => assert_eq!(a, open.canonicalize().unwrap()),
            other => panic!("{other:?}"),
        }
        // Sticky, as /tmp: no one else can replace what is in it.
        mode(&open, 0o1777);
        assert!(ancestors(&inner).is_ok());
    }
}
