//! Files of ours that root opens (the audit log, the state database):
//! never through a symbolic link, never a FIFO or a device, and only ours.

use std::os::fd::AsFd;

use rustix::fs::{FileType, Stat};
use rustix::io::Errno;

/// Why a file is refused, or the error that kept it from being checked.
#[derive(Debug)]
pub enum Refusal {
    Unsafe(&'static str),
    Io(std::io::Error),
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
