//! Who is at the other end of a TCP connection: for a peer on this machine,
//! the uid owning its socket, as the kernel says (sock_diag, asked by the
//! connection's exact addresses); a sub-uid counts as its range's owner.
//! The metrics endpoint gives each such owner, and each remote address,
//! its own share of its connections, so no local user can crowd out the
//! scraper however many connections they open.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rustix::net::{netlink, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// Whose a connection is, for its share of the endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A local user, by uid (a sub-uid's range owner's name when the range
    /// names one).
    Uid(u32),
    Owner(String),
    /// A peer the kernel names no owner of here: by address.
    Address(IpAddr),
}

/// `nlmsghdr` (16 bytes) then `inet_diag_req_v2` (56).
const REQUEST_LEN: usize = 16 + 56;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
const IPPROTO_TCP: u8 = 6;
/// `inet_diag_msg`'s `idiag_uid`, after the 16-byte header.
const UID_AT: usize = 16 + 64;

/// The peer of a connection accepted at `local` from `peer`.
pub fn of(peer: SocketAddr, local: SocketAddr, subuid: &Path) -> Peer {
    let (peer, local) = (unmapped(peer), unmapped(local));
    match socket_uid(peer, local) {
        Some(uid) => of_uid(uid, subuid),
        None => Peer::Address(peer.ip()),
    }
}

/// The local user `uid` counts as: its range's owner where `subuid` puts
/// it in one (a user's rootless container), else itself.
pub fn of_uid(uid: u32, subuid: &Path) -> Peer {
    match range_owner(uid, subuid) {
        Some(owner) => Peer::Owner(owner),
        None => Peer::Uid(uid),
    }
}

/// `a` with an IPv4-mapped IPv6 address as the IPv4 one (the client's
/// socket is IPv4).
fn unmapped(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// The uid owning the TCP socket at `peer` connected to `local`, if it is
/// on this machine and the kernel answers.
fn socket_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let fd = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        Some(netlink::SOCK_DIAG),
    )
    .ok()?;
    let timeout = Some(Duration::from_millis(200));
    rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Recv, timeout)
        .ok()?;
    rustix::net::send(&fd, &request(peer, local)?, SendFlags::empty()).ok()?;
    let mut reply = [0u8; 512];
    let (n, _) = rustix::net::recv(&fd, &mut reply[..], RecvFlags::empty()).ok()?;
    answer(&reply[..n.min(reply.len())], peer, local)
}

/// The sock_diag request for the socket at `peer` whose other end is
/// `local` (the same family), by its exact addresses.
fn request(peer: SocketAddr, local: SocketAddr) -> Option<[u8; REQUEST_LEN]> {
    let family = match (peer.ip(), local.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => 2u8,
        (IpAddr::V6(_), IpAddr::V6(_)) => 10,
        _ => return None,
    };
    let mut m = [0u8; REQUEST_LEN];
    m[0..4].copy_from_slice(&(REQUEST_LEN as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    m[16] = family;
    m[17] = IPPROTO_TCP;
    // Every state.
    m[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
    m[24..72].copy_from_slice(&sockid(peer, local));
    Some(m)
}

/// `inet_diag_sockid` of the socket at `src` connected to `dst`, no
/// cookie.
fn sockid(src: SocketAddr, dst: SocketAddr) -> [u8; 48] {
    let mut id = [0u8; 48];
    id[0..2].copy_from_slice(&src.port().to_be_bytes());
    id[2..4].copy_from_slice(&dst.port().to_be_bytes());
    let octets = |a: IpAddr| -> [u8; 16] {
        match a {
            IpAddr::V4(v4) => {
                let mut o = [0u8; 16];
                o[..4].copy_from_slice(&v4.octets());
                o
            }
            IpAddr::V6(v6) => v6.octets(),
        }
    };
    id[4..20].copy_from_slice(&octets(src.ip()));
    id[20..36].copy_from_slice(&octets(dst.ip()));
    // INET_DIAG_NOCOOKIE.
    id[40..48].copy_from_slice(&[0xff; 8]);
    id
}

/// The uid in a sock_diag reply about the socket at `peer` connected to
/// `local`; none for an error, or a reply about another socket.
fn answer(reply: &[u8], peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let kind = u16::from_ne_bytes(reply.get(4..6)?.try_into().ok()?);
    if kind != SOCK_DIAG_BY_FAMILY {
        return None;
    }
    let asked = sockid(peer, local);
    // Ports and addresses as asked (the interface and cookie may differ).
    if reply.get(20..56)? != &asked[..36] {
        return None;
    }
    Some(u32::from_ne_bytes(
        reply.get(UID_AT..UID_AT + 4)?.try_into().ok()?,
    ))
}

/// The owner of the subordinate range `uid` falls in, as `subuid` (the
/// format of `/etc/subuid`: `owner:first:count` lines) names it.
fn range_owner(uid: u32, subuid: &Path) -> Option<String> {
    owner_in(&ranges(subuid)?, uid)
}

/// The file of sub-uid ranges as last read, with its modification time
/// and size.
type Ranges = (PathBuf, (SystemTime, u64), Arc<str>);
static RANGES: Mutex<Option<Ranges>> = Mutex::new(None);

/// The text of `subuid` as it is now (a range added later counts), read
/// again only when its modification time or size changed: a flood of
/// connections costs a stat each, not a read.
fn ranges(subuid: &Path) -> Option<Arc<str>> {
    let meta = std::fs::metadata(subuid).ok()?;
    let stamp = (meta.modified().ok()?, meta.len());
    let mut last = RANGES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((path, at, text)) = last.as_ref() {
        if path == subuid && *at == stamp {
            return Some(text.clone());
        }
    }
    let text: Arc<str> = std::fs::read_to_string(subuid).ok()?.into();
    *last = Some((subuid.to_path_buf(), stamp, text.clone()));
    Some(text)
}

fn owner_in(text: &str, uid: u32) -> Option<String> {
    text.lines().find_map(|line| {
        let mut f = line.trim().split(':');
        let (owner, first, count) = (f.next()?, f.next()?, f.next()?);
        let (first, count): (u64, u64) = (first.parse().ok()?, count.parse().ok()?);
        let uid = u64::from(uid);
        (!owner.is_empty() && uid >= first && uid < first + count).then(|| owner.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_names_a_local_peers_uid_and_a_sub_uid_its_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, from) = listener.accept().unwrap();
        assert_eq!(from, client.local_addr().unwrap());
        let local = listener.local_addr().unwrap();
        let me = rustix::process::geteuid().as_raw();
        let none = Path::new("/nonexistent/subuid");
        assert_eq!(of(from, local, none), Peer::Uid(me));
        // Another port: no such socket.
        let elsewhere = SocketAddr::new(from.ip(), from.port().wrapping_add(1));
        assert_eq!(of(elsewhere, local, none), Peer::Address(from.ip()));
        let dir = tempfile::tempdir().unwrap();
        let subuid = dir.path().join("subuid");
        std::fs::write(&subuid, format!("bob:{}:1\n", me)).unwrap();
        assert_eq!(of(from, local, &subuid), Peer::Owner("bob".into()));
        // Read again once it changed.
        std::fs::write(&subuid, format!("carol:{}:1\n", me)).unwrap();
        assert_eq!(of(from, local, &subuid), Peer::Owner("carol".into()));
    }

    #[test]
    fn a_sub_uid_belongs_to_the_range_it_falls_in() {
        let text = "alice:100000:65536\n\nbad\nbob:165536:65536\n:1:5\n";
        assert_eq!(owner_in(text, 100_000).as_deref(), Some("alice"));
        assert_eq!(owner_in(text, 165_535).as_deref(), Some("alice"));
        assert_eq!(owner_in(text, 165_536).as_deref(), Some("bob"));
        assert_eq!(owner_in(text, 231_072), None);
        assert_eq!(owner_in(text, 3), None);
    }
}
