"""A FUSE file system that never answers a read: what a user can mount
(fusermount, on a directory of theirs) to make anything that reads a file
of theirs hang in the kernel. It serves the files NAMES (comma-separated,
SIZE bytes each, readable and writable by all) over the kernel's FUSE
protocol on /dev/fuse, standard library only:

    python3 hangfs.py MOUNTPOINT SIZE NAMES

Mounts (root: the test mounts it for the user, with allow_other), prints
"ready", then answers lookups, opens and attributes, and leaves every READ
waiting for ever. Ends on SIGTERM (the mount is then detached by the test).
"""

import ctypes
import errno
import os
import struct
import sys

LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 15, 17, 18, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS, INTERRUPT, BATCH_FORGET = 27, 28, 29, 34, 36, 42
IN_HEADER = struct.Struct("<IIQQIIII")
OUT_HEADER = struct.Struct("<IiQ")
ROOT = 1


def attr(node, size):
    """struct fuse_attr."""
    mode = 0o40777 if node == ROOT else 0o100666
    nlink = 2 if node == ROOT else 1
    return struct.pack("<QQQQQQIIIIIIIIII", node, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)


def main():
    mountpoint, size = sys.argv[1], int(sys.argv[2])
    names = [n.encode() for n in sys.argv[3].split(",")]
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    options = ("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other" % fd).encode()
    if libc.mount(b"hangfs", mountpoint.encode(), b"fuse.hangfs", 0, options) != 0:
        err = ctypes.get_errno()
        sys.exit("mount: %s" % os.strerror(err))

    def reply(unique, body=b"", error=0):
        os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)

    print("ready", flush=True)
    while True:
        try:
            data = os.read(fd, 1 << 21)
        except OSError as e:
            if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            return  # unmounted
        length, opcode, unique, node, _uid, _gid, _pid, _ = IN_HEADER.unpack_from(data)
        body = data[IN_HEADER.size:length]
        if opcode == INIT:
            major, minor, readahead, _flags = struct.unpack_from("<IIII", body)
            out = struct.pack("<IIIIHHIIHHI7I", 7, min(minor, 31), readahead, 0, 16, 12, 1 << 17, 1, 32, 0, 0, *([0] * 7))
            reply(unique, out)
        elif opcode == LOOKUP:
            name = body.split(b"\0", 1)[0]
            if node == ROOT and name in names:
                child = 2 + names.index(name)
                reply(unique, struct.pack("<QQQQII", child, 1, 3600, 3600, 0, 0) + attr(child, size))
            else:
                reply(unique, error=errno.ENOENT)
        elif opcode == GETATTR:
            reply(unique, struct.pack("<QII", 3600, 0, 0) + attr(node, 0 if node == ROOT else size))
        elif opcode in (OPEN, OPENDIR):
            reply(unique, struct.pack("<QII", 1, 0, 0))
        elif opcode == READ:
            pass  # never answered: the reader waits in the kernel
        elif opcode in (FORGET, BATCH_FORGET, INTERRUPT):
            pass  # no answer expected; an interrupted read stays unanswered
        elif opcode in (RELEASE, RELEASEDIR, FLUSH, ACCESS):
            reply(unique)
        else:
            reply(unique, error=errno.ENOSYS)


if __name__ == "__main__":
    main()
