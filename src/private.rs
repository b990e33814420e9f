//! Files of ours that root opens (the audit log, the state database):
//! never through a symbolic link, never a FIFO or a device, and only ours.

use std::os::fd::AsFd;

use rustix::fs::{FileType, Stat};
use rustix::io::Errno;

/// Why a file is refused, or the error that kept it from being checked.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("{0}: refused")]
    Unsafe(&'static str),
    /// A secret that others may read or write.
    #[error("others may read or write it: refused (chmod 600)")]
    Shared,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl From<Errno> for Refusal {
    /// An open's error: a symlink (`O_NOFOLLOW`) or a FIFO or socket
    /// (`O_NONBLOCK` write) is a refusal; anything else an I/O error.
    fn from(e: Errno) -> Self {
        match e {
            Errno::LOOP => Refusal::Unsafe("a symbolic link"),
            Errno::NXIO => Refusal::Unsafe("a socket or FIFO"),
            e => Refusal::Io(e.into()),
        }
    }
}

/// Checks that `fd` is a regular file owned by us; its status, for more
/// checks.
///
/// # Errors
/// It is something else, or another user's, or cannot be looked at.
pub fn own_file(fd: impl AsFd) -> Result<Stat, Refusal> {
    let stat = rustix::fs::fstat(fd).map_err(|e| Refusal::Io(e.into()))?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(Refusal::Unsafe("not a regular file"));
    }
    if stat.st_uid != rustix::process::geteuid().as_raw() {
        return Err(Refusal::Unsafe("not owned by us"));
    }
    Ok(stat)
}

/// The text of a secret of ours (`--smtp-credentials`): a regular file,
/// not through a symlink, ours, that no one else may read or write; at
/// most 4 KiB.
///
/// # Errors
/// Why it is refused, or what kept it from being read.
pub fn read_secret(path: &std::path::Path) -> Result<String, Refusal> {
    use rustix::fs::{Mode, OFlags};
    use std::io::Read;
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(Refusal::from)?;
    let stat = own_file(&fd)?;
    if stat.st_mode & 0o077 != 0 {
        return Err(Refusal::Shared);
    }
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(4096)
        .read_to_string(&mut text)?;
    Ok(text)
}
