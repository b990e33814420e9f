# genv-enforce host agent: what genv-enforce runs on a GPU host as root
# (remote hosts through sudo, this machine as a child of the enforcer): one
# long-lived process per host, that answers one request at a time: a
# snapshot per cycle, and the kills and detaches that follow it. It is the
# only code that touches a live host; its protocol is also written down in
# src/host/protocol.rs, and fixtures/agent/ holds examples both sides test.
#
# Runs on: the Python 3 (3.7 or later, standard library only) that genv
# itself needs, and Linux /proc. Nothing is installed on the host: the
# command line is a constant bootstrap that reads this text from stdin,
#   python3 -I -S -c 'import sys;exec(compile(sys.stdin.buffer.read(N),...))'
# after which stdin carries requests, each "<length>\n" + a JSON object
# (unknown keys are refused):
#   {"mode": "hello", "protocol": P}
#   {"mode": "snapshot", "dir": D, "nvidia_smi": [argv], "step": S, "limit": L,
#    "max_bytes": B, "max_records": R, "proc": "/proc", "subuid": "/etc/subuid"}
#   {"mode": "terminate", "kills": [[pid, start_time], ...], "signal": "term"|"kill",
#    "limit": L, "proc": "/proc"}
#   {"mode": "detach", "dir": D, "detach": [[index, eid], ...], "step": S, "limit": L, "max_bytes": B}
#   {"mode": "doctor", "dir": D, "nvidia_smi": [argv], "step": S, "limit": L}
#   {"mode": "tell", "notes": [{"user": name, "pids": [[pid, start_time], ...],
#    "text": T}, ...], "utmp": "/var/run/utmp", "limit": L, "proc": "/proc"}
# A snapshot request may also name "groups": [name, ...] (exempt and capped
# groups) and ask "utilization": true (the idle rule). Under high
# availability, snapshot, terminate and detach requests carry the leader's
# "fence": {"epoch": E, "dir": "/run/genv-enforce"}, and doctor may ask
# about the fence with "fence_dir": D (see fence()).
# and stdout one answer per request, "@<status> <length>\n" + <length> bytes.
# Status 0: the request's result:
#   hello: {"protocol": P, "python": "3.x.y", "pidfd": bool, "euid": n}
#   snapshot: frames "@<kind> [<arg>] <length>\n" + <length> bytes:
#     gpus, apps         nvidia-smi's two answers (csv,noheader,nounits)
#     envs, devices      genv's state files, read under a shared lock on
#                        genv.lock (absent when the file does not exist)
#     state-error <part> why a state file (envs, devices) or the directory
#                        (dir) could not be read: the snapshot goes on
#     lock               who held genv.lock past LOCK_WAIT: read without it
#     proc <pid>         "seen <start> <uid|-> var|novar|notread\n<value>" or
#                        "seen <start> <uid|-> unreadable|hidden\n<why>" or
#                        "unsure\n<why>", for each GPU pid and each live pid
#                        an environment lists (absent: not alive); hidden:
#                        the environ cannot be read for a reason the
#                        process controls (see read_environ)
#     mps <pid>          (after its proc frame) a GPU process that runs the
#                        driver's MPS server file: "shared" (the machine's
#                        server, see mps_role) or "own\n<why not shared>"
#     subuid <uid>       the owner's uid of the sub-uid range holding a uid
#                        seen that has no name here, or "- <why not>"
#     user <uid>         the host's name for a uid seen (and for owners)
#     groups <uid>       (when groups are named) those of them a uid seen
#                        (a GPU process's or a listed pid's owner) is a
#                        member of, one a line
#     clock              "<btime> <hz>": boot time and clock ticks per
#                        second, for start times across hosts
#     utilization        (when asked) --query-gpu=index,utilization.gpu
#     pmon               (when asked, and it succeeded) pmon -c 1 -s u
#   terminate: {"kills": [{"pid": n, "result": "signalled"|"gone"|"reused"|"denied"|"invalid",
#               "found": start_time (reused only; null when unreadable)}, ...]}
#   detach: {"detached": [bool per pair: it was there and is gone],
#            "unlocked": who held genv.lock (only when written without it)}
#   doctor: facts about the host (see doctor())
#   tell: {"told": [terminals written per note]}
# Status 1: {"fail": "request"|"state"|"lock"|"nvidia-smi"|"fenced"|"fence"|"agent", "message": why,
#   "kills": [...] (terminate: those done before the failure)}; a detach that
#   failed changed nothing ("lock": genv.lock stayed held past the step limit).
# A request past its time limit (L) ends the agent (exit status 124), as
# does the end of stdin, a signal, or a request that is not JSON:
# genv-enforce starts a new one when it needs one. One stuck in the kernel
# past L + KILL_GRACE is SIGKILLed by its watchdog thread.
#
# Safety: genv's state directory is writable by every user. The directory
# is opened once without following a symlink and every file in it relative
# to that handle with O_NOFOLLOW | O_NONBLOCK; only regular files of at most
# max_bytes are read. A detach writes a new file, created exclusively, and
# renames it over devices.json under an exclusive lock on genv.lock (or
# without it, when a user holds it past LOCK_WAIT: see lock()); the mode
# of an existing file is never changed, and what is written back is
# bounded (see rewritten()). A process's identity (uid, environment) is
# read between two reads of its start time, from a live thread when its
# leader has exited; a process that started after nvidia-smi was asked is
# not taken for the one it listed; a kill re-checks the start time and,
# where the kernel has pidfds, signals through one (the thread group).
# What a user controls and could make hang (a process's environ, the
# state files) is read on a reader thread with a time limit. A message goes only to a terminal the kernel says is the
# user's: the controlling terminal of one of their processes (pid and
# start time re-checked) or a login terminal utmp lists for them, opened
# without following a link, without becoming ours and without blocking,
# and owned by them; its text is stripped of control characters and
# bounded. Nothing here runs a shell, and no temporary file or child
# outlives a request.

import errno
import fcntl
import json
import os
import select
import signal
import stat
import sys
import threading
import time

PROTOCOL = 7
VAR = b"GENV_ENVIRONMENT_ID="
PROC = ["/proc"]  # where procfs is, for the request at hand
SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
REFUSED = "refused (genv's state directory is writable by every user)"

children = []
temp_files = []
held = []  # fds opened for the request at hand: all closed when it ends


def keep(fd):
    held.append(fd)
    return fd


class Failure(Exception):
    """A step that failed, or a request this agent cannot carry out:
    answered with status 1, its kind ("what") and why."""

    def __init__(self, what, message):
        Exception.__init__(self, message)
        self.what = what
        self.message = message


def end(status, message):
    for p in children:
        p.kill()
    for dfd, name in temp_files:
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass
    if message:
        try:
            write_all(2, message.encode() + b"\n")
        except OSError:
            pass
    os._exit(status)


def on_signal(signum, _frame):
    if signum == signal.SIGALRM:
        end(124, "genv-enforce agent: killed at its time limit")
    end(128 + signum, "genv-enforce agent: stopped by signal %d" % signum)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def frame(out, kind, arg, body):
    head = "@%s %s%d\n" % (kind, "" if arg is None else "%s " % arg, len(body))
    out.append(head.encode())
    out.append(body)


# genv's state directory, never followed through a link.


def refuse(path, what):
    raise Failure("state", "%s is %s: %s" % (path, what, REFUSED))


def kind_of(mode):
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def open_dir(path):
    if fuse_mountpoint(path):
        refuse(path, FUSE_REFUSED)
    try:
        fd = keep(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            refuse(path, "a symbolic link" if os.path.islink(path) else "not a directory")
        raise Failure("state", "%s: %s" % (path, e.strerror))
    if on_fuse(os.fstat(fd)):
        refuse(path, FUSE_REFUSED)
    return fd


def regular(fd, path):
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        refuse(path, kind_of(st.st_mode))
    if on_fuse(st):
        os.close(fd)
        refuse(path, FUSE_REFUSED)
    return fd


FUSE_DEVICES = [None]  # this mount namespace's FUSE mounts, per request: (devices, paths)


def fuse_mounts():
    """The devices and mount points of the FUSE mounts /proc/self/mountinfo
    lists: any user may mount one (fusermount) over a directory or a file
    of theirs, and anything done there (an open, a stat, a read) can wait
    in the kernel, unkillable, for as long as their program wants."""
    if FUSE_DEVICES[0] is None:
        devices, paths = set(), set()
        try:
            with open("/proc/self/mountinfo", "rb") as f:
                text = f.read(16 << 20)
        except OSError:
            text = b""
        for line in text.split(b"\n"):
            head, _, tail = line.partition(b" - ")
            words, fstype = head.split(), tail.split(b" ", 1)[0]
            if len(words) > 4 and (fstype in (b"fuse", b"fuseblk") or fstype.startswith(b"fuse.")):
                major, _, minor = words[2].partition(b":")
                if major.isdigit() and minor.isdigit():
                    devices.add(os.makedev(int(major), int(minor)))
                # Mount points escape space, tab, newline and backslash in octal.
                paths.add(os.path.normpath(words[4].decode("unicode_escape", "replace")))
        FUSE_DEVICES[0] = (devices, paths)
    return FUSE_DEVICES[0]


def on_fuse(st):
    """Whether a file (its stat) is on a FUSE mount."""
    return st.st_dev in fuse_mounts()[0]


def fuse_mountpoint(path):
    """Whether a FUSE file system is mounted right on `path`: refused before
    it is even opened (an open there is already a request to the user's
    program)."""
    return os.path.normpath(path) in fuse_mounts()[1]


FUSE_REFUSED = "on a FUSE file system (served by a user's program, whose answers can hang)"


def open_in(dfd, path, name, flags, mode=0):
    """A file of the directory, opened safely; None when absent."""
    if fuse_mountpoint(path):
        refuse(path, FUSE_REFUSED)
    try:
        fd = os.open(name, flags | SAFE, mode, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse(path, "a symbolic link")
        if e.errno == errno.ENXIO:
            refuse(path, "a socket")
        raise Failure("state", "%s: %s" % (path, e.strerror))
    return regular(fd, path)


LOCK_WAIT = 1.0  # genv holds its lock for milliseconds; a user may hold it for ever


def lock(dfd, d, operation, deadline):
    """genv.lock, created 0666 as genv does when missing, locked within
    LOCK_WAIT (and by `deadline`): None when it was; else who holds it, and
    the caller goes on without it. A lock is only advisory: while anyone
    holds it no genv command writes the state (each waits for it), so what
    is read without it is what the holder left, and what is written without
    it can lose only the holder's own concurrent write. That way a user who
    holds it (flock -s genv.lock sleep inf) blocks nobody's enforcement."""
    path = os.path.join(d, "genv.lock")
    try:
        fd = keep(os.open("genv.lock", os.O_RDONLY | os.O_CREAT | os.O_EXCL | SAFE, 0o666, dir_fd=dfd))
        os.fchmod(fd, 0o666)
    except FileExistsError:
        fd = open_in(dfd, path, "genv.lock", os.O_RDONLY)
        if fd is None:
            raise Failure("state", "%s: vanished while opened" % path)
        keep(fd)
    until = min(deadline, time.monotonic() + LOCK_WAIT)
    waited, note = False, None
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= until:
                note = "genv.lock held for over %gs by %s" % (LOCK_WAIT, lock_holders(fd, Names(deadline)))
                break
            waited = True
            time.sleep(0.005)
    if waited:
        # A user may have mounted FUSE over a state file meanwhile (the
        # holder chose how long we wait): the mounts are read again.
        FUSE_DEVICES[0] = None
    return note


def lock_holders(fd, names):
    """Who holds locks on the file open at fd, as /proc/locks says: "pid P
    (user U)" for each (at most 8), or "another process"."""
    st = os.fstat(fd)
    inode = "%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open(os.path.join(PROC[0], "locks"), "rb") as f:
            text = f.read(1 << 20)
    except OSError:
        text = b""
    said = []
    for line in text.split(b"\n"):
        words = line.split()
        if b"->" in words or len(words) < 6 or words[5].decode("ascii", "replace") != inode:
            continue
        pid = int(words[4]) if words[4].isdigit() else None
        if pid is None or pid == os.getpid() or len(said) >= 8:
            continue
        who = "pid %d" % pid
        try:
            uid = real_uid(proc_read(pid, "status"))
            try:
                name = names.user(uid) if uid is not None else None
            except Late:
                name = None
            who += " (%s)" % (name or "uid %s" % uid)
        except OSError:
            pass
        said.append(who)
    return ", ".join(said) or "another process"


def read_file(dfd, d, name, max_bytes):
    path = os.path.join(d, name)
    fd = open_in(dfd, path, name, os.O_RDONLY)
    if fd is None:
        return None
    try:
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise Failure("state", "%s is larger than %d bytes: refused" % (path, max_bytes))
    return b"".join(chunks)


# nvidia-smi.


class Child:
    """A tool we started: its pid (and process group) and its two pipes."""

    def __init__(self, pid, out, err):
        self.pid, self.out, self.err = pid, out, err
        self.status = None

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def reap(self, block):
        """Its exit status once it has ended, else None."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            if pid:
                self.status = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        return self.status


def spawn(argv):
    """Starts argv in a session (so a process group) of its own, stdin from
    /dev/null, with genv's GENV_BYPASS=1, without forking this interpreter
    where posix_spawn can (Python 3.8+)."""
    env = dict(os.environ, GENV_BYPASS="1")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        if hasattr(os, "posix_spawnp"):
            actions = [
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ]
            pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True)
        else:
            import subprocess  # Python 3.7: no posix_spawn with setsid; imported only there

            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, env=env, start_new_session=True)
            pid = p.pid
            p.returncode = 0  # reaped by Child, not by subprocess
    finally:
        os.close(out_w)
        os.close(err_w)
    child = Child(pid, out_r, err_r)
    children.append(child)
    return child


def collect(procs, deadline, max_bytes):
    """Reads every process's stdout and stderr to the end (at most
    max_bytes each) by `deadline`; kills the stragglers' groups. Returns
    (status or None when killed, stdout, stderr) per process."""
    bufs = {}
    for p in procs:
        bufs[p.out] = []
        bufs[p.err] = []
    open_fds = set(bufs)
    sizes = dict((fd, 0) for fd in bufs)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk or sizes[fd] > max_bytes:
                open_fds.discard(fd)
                continue
            bufs[fd].append(chunk)
            sizes[fd] += len(chunk)
    results = []
    for p in procs:
        status = None
        if not open_fds & set((p.out, p.err)):
            while status is None and time.monotonic() < deadline:
                status = p.reap(False)
                if status is None:
                    time.sleep(0.001)
        if status is None:
            p.kill()
            p.reap(True)
        os.close(p.out)
        os.close(p.err)
        children.remove(p)
        results.append((status, b"".join(bufs[p.out]), b"".join(bufs[p.err])))
    return results


# /proc.


def proc_path(pid, name, tid=None):
    if tid is None:
        return "%s/%d/%s" % (PROC[0], pid, name)
    return "%s/%d/task/%d/%s" % (PROC[0], pid, tid, name)


def proc_read(pid, name, tid=None):
    """A small /proc file (stat, status): never one that reads the process's
    own memory, which it controls (see read_environ)."""
    with open(proc_path(pid, name, tid), "rb") as f:
        return f.read(1 << 16)


def stat_fields(stat_bytes):
    """The fields after the last ')' (the command name, which the user
    picks, may hold anything else): field n of proc(5) is [n - 3]."""
    close = stat_bytes.rfind(b")")
    return stat_bytes[close + 1:].split() if close >= 0 else []


def start_time(stat_bytes):
    """Field 22 of /proc/<pid>/stat: clock ticks since boot."""
    fields = stat_fields(stat_bytes)
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def environ_size(stat_bytes):
    """env_end - env_start (fields 50 and 51), or None where not said."""
    fields = stat_fields(stat_bytes)
    if len(fields) < 49 or not (fields[47].isdigit() and fields[48].isdigit()):
        return None
    start, end = int(fields[47]), int(fields[48])
    return end - start if end >= start > 0 else None


def exited(stat_bytes):
    """Whether this task has exited and only waits to be reaped."""
    rest = stat_fields(stat_bytes)
    return bool(rest) and rest[0] in (b"Z", b"X")


MAX_TASKS_LOOKED = 64


def live_thread(pid):
    """A thread of pid that still runs, when its leader (the thread whose id
    is the pid) has exited: the process lives while any thread does (its
    leader shows state Z, its own /proc files answer for nobody); None when
    none does. Threads other than the leader are reaped as they end, so
    the first one listed almost always runs: at most MAX_TASKS_LOOKED are
    looked at."""
    return threads(pid)[0]


def threads(pid):
    """(a live thread other than the leader or None, whether any thread
    other than the leader is listed at all)."""
    others = False
    try:
        tasks = os.scandir("%s/%d/task" % (PROC[0], pid))
    except OSError:
        return None, False
    with tasks:
        try:
            for looked, entry in enumerate(tasks):
                if looked >= MAX_TASKS_LOOKED:
                    break
                if not entry.name.isdigit() or int(entry.name) == pid:
                    continue
                others = True
                try:
                    if not exited(proc_read(pid, "stat", int(entry.name))):
                        return int(entry.name), True
                except OSError:
                    continue
        except OSError:
            # Reaped while listed (the kernel then answers ENOENT): no
            # live thread.
            pass
    return None, others


def alive(pid, stat_bytes):
    """Whether the process whose leader's stat this is still runs."""
    return not exited(stat_bytes) or live_thread(pid) is not None


def real_uid(status):
    for line in status.split(b"\n"):
        if line.startswith(b"Uid:"):
            parts = line.split()
            if len(parts) > 1 and parts[1].isdigit():
                return int(parts[1])
    return None


# A process's environment is its own memory, which it controls: it can
# make it any size (prctl(PR_SET_MM, PR_SET_MM_MAP) is allowed to any user),
# or map it from a file of its own that never answers (a FUSE file), so
# that reading it hangs in the kernel. So it is read only as far as needed,
# on a reader thread (see Reader), and judged by these rules, none of which
# a process can use to be judged as carrying an environment it did not set:
# - the first GENV_ENVIRONMENT_ID is taken (genv takes the last; only a
#   deliberately built environment names it twice);
# - an environment larger than EXEC_MAX (no program can be started with
#   one: execve takes at most 6 MiB of arguments and environment) is not
#   read: its process is judged as carrying none ("hidden");
# - so is one whose value is longer than VALUE_MAX, one whose read fails
#   on its memory (EIO, EFAULT), and one whose read does not end within
#   ENVIRON_WAIT (remembered: it is not read again while it lives).
EXEC_MAX = 6 << 20
VALUE_MAX = 4096
ENVIRON_CHUNK = 1 << 16
ENVIRON_WAIT = 1.0
HUNG = set()  # (pid, start time) of processes whose environ read hung


class Hidden(Exception):
    """The environment cannot be read for a reason the process controls."""


def read_environ(path, size):
    """GENV_ENVIRONMENT_ID's value in the environ at path, or None when it
    is not there; raises Hidden (see above)."""
    if size is not None and size > EXEC_MAX:
        raise Hidden("its environment is %d bytes, more than any program can be started with (%d)" % (size, EXEC_MAX))
    pattern = b"\0" + VAR
    with open(path, "rb", buffering=0) as f:
        tail = b"\0"  # the first variable has no NUL before it
        total = 0
        while total < EXEC_MAX:
            chunk = f.read(min(ENVIRON_CHUNK, EXEC_MAX - total))
            if not chunk:
                return None
            total += len(chunk)
            buf = tail + chunk
            at = buf.find(pattern)
            if at >= 0:
                value = buf[at + len(pattern):]
                while b"\0" not in value and len(value) <= VALUE_MAX:
                    more = f.read(ENVIRON_CHUNK)
                    if not more:
                        break
                    value += more
                value = value.split(b"\0", 1)[0]
                if len(value) > VALUE_MAX:
                    raise Hidden("its GENV_ENVIRONMENT_ID is longer than %d bytes" % VALUE_MAX)
                return value
            tail = buf[-len(VAR):]
        if not f.read(1):
            return None
    raise Hidden("its environment is larger than %d bytes, more than any program can be started with" % EXEC_MAX)


class Hung(Exception):
    """A read did not end in its time: its thread is left to it."""


class Reader:
    """Runs reads that may hang in the kernel (a process's environ mapped
    from a file that never answers, genv's state on such a mount) on a
    worker thread, waiting for each at most a given time: a read that hangs
    costs its thread (stuck until this agent ends), not the request."""

    def __init__(self):
        self.jobs = None
        self.stuck = 0

    def run(self, fn, timeout):
        import threading

        if self.jobs is None:
            self.jobs = start_worker()
        box, done = [], threading.Event()
        self.jobs.put((fn, box, done))
        if done.wait(max(0.0, timeout)):
            ok, value = box[0]
            if ok:
                return value
            raise value
        self.jobs.put(None)  # that worker ends if its read ever returns
        self.jobs = None
        self.stuck += 1
        raise Hung()


def start_worker():
    import queue
    import threading

    jobs = queue.Queue()

    def work():
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the waiting request
                box.append((False, e))
            done.set()

    threading.Thread(target=work, name="genv-enforce-reader", daemon=True).start()
    return jobs


READER = Reader()


class Late(Exception):
    """A lookup not asked: the name service had no time left, or was asked
    MAX_LOOKUPS times already, in this request (why)."""

    def __init__(self, why):
        Exception.__init__(self, why)
        self.why = why


class Names:
    """The host's name service (NSS: files, LDAP, SSSD...), which may be
    slow, as one request may ask it: each lookup on LOOKUPS's thread within
    the request's deadline, at most MAX_LOOKUPS of them, each answer kept
    for the request. Once one is late, every one not yet answered is
    (Late): nothing waits past the deadline, nothing is asked without
    bound, whatever uids a user's processes run under. Lookups made while
    `counted` is false (those about what nvidia-smi lists, bounded by it)
    are not counted against MAX_LOOKUPS."""

    def __init__(self, deadline):
        self.deadline = deadline
        self.known = {}
        self.asked = 0
        self.late = None
        self.counted = True

    def ask(self, key, fn):
        """fn()'s answer, None when there is no such entry, Late when not
        asked or not answered in time."""
        if key in self.known:
            return self.known[key]
        if self.late is None and self.counted and self.asked >= MAX_LOOKUPS:
            self.late = "more than %d name lookups in one request" % MAX_LOOKUPS
        left = self.deadline - time.monotonic()
        if self.late is None and left <= 0:
            self.late = "the name service was not asked: no time was left in the step"
        if self.late is not None:
            raise Late(self.late)
        self.asked += self.counted

        def lookup():
            try:
                return fn()
            except (KeyError, OSError, ValueError, UnicodeError, OverflowError):
                return None

        try:
            value = LOOKUPS.run(lookup, left)
        except Hung:
            self.late = "the name service did not answer within the step"
            raise Late(self.late)
        self.known[key] = value
        return value

    def user(self, uid):
        """The name of a uid, None when it has none here."""
        import pwd

        pw = self.ask(("uid", uid), lambda: pwd.getpwuid(uid))
        return None if pw is None else pw.pw_name

    def uid(self, name):
        """The uid of a user name, None when there is no such user."""
        import pwd

        pw = self.ask(("name", name), lambda: pwd.getpwnam(name))
        return None if pw is None else pw.pw_uid

    def gid(self, group):
        import grp

        gr = self.ask(("group", group), lambda: grp.getgrnam(group))
        return None if gr is None else gr.gr_gid

    def groups_of(self, uid):
        """The gids a uid is a member of, None when it has no name here."""
        import pwd

        def lookup():
            pw = pwd.getpwuid(uid)
            return set(os.getgrouplist(pw.pw_name, pw.pw_gid))

        return self.ask(("groups", uid), lookup)


MAX_LOOKUPS = 4096
# Lookups have their own thread: a hung one never holds up a state read.
LOOKUPS = Reader()


def proc_read_or_empty(pid):
    try:
        return proc_read(pid, "stat")
    except OSError:
        return b""


def environ_of_threads(pid, start, stat, deadline):
    """environ_of through live threads of a process whose leader exited."""
    for _ in range(3):
        tid = live_thread(pid)
        if tid is None:
            break
        found = environ_of(pid, tid, start, stat, deadline)
        if found[0] is not None:
            return found
    return "hidden", b"its main thread exited and no live thread of it could be read"


def identity(pid, want_environ, asked=None, deadline=None):
    """The identity body of a proc frame, or None when the process is gone."""
    found = identity_and_role(pid, want_environ, asked, deadline)
    return None if found is None else found[0]


def identity_and_role(pid, want_environ, asked=None, deadline=None):
    """(the identity body of a proc frame, a GPU process's MPS role: see
    mps_role), or None when the process is gone.
    `asked`: clock ticks since boot when nvidia-smi was asked; a process
    that started then or later is not the one it listed."""
    try:
        stat = proc_read(pid, "stat")
    except OSError:
        return None
    before = start_time(stat)
    if before is None:
        return (b"unsure\nits /proc stat does not parse", None)
    if asked is not None and before >= asked:
        return (b"unsure\nit started after nvidia-smi was asked: what it listed for this pid was another process's", None)
    # The leader keeps the process's credentials when it exits: its uid
    # is read there whatever the threads do.
    try:
        uid = real_uid(proc_read(pid, "status"))
    except OSError:
        uid = None
    value = b""
    if not want_environ:
        env = "notread"
    elif not exited(stat):
        env, value = environ_of(pid, None, before, stat, deadline)
    else:
        # Its leader exited: read through a live thread, another if that
        # one ends meanwhile. A process whose leader is gone and whose
        # threads cannot be read (they come and go, or exited threads no
        # one reaps hide the live ones) is judged as carrying none: never
        # absent while its /proc entry stands.
        if threads(pid) == (None, False):
            return None  # no thread left: a zombie waiting to be reaped
        env, value = environ_of_threads(pid, before, stat, deadline)
    if env is None:
        return None
    role = mps_role(pid, stat, before) if asked is not None else None
    try:
        after = start_time(proc_read(pid, "stat"))
    except OSError:
        return None
    if after != before:
        return (b"unsure\nits pid was reused while it was read", None)
    uid_text = "-" if uid is None else str(uid)
    return ("seen %d %s %s\n" % (before, uid_text, env)).encode() + value, role


# CUDA MPS. The machine's MPS server is started by root's control daemon
# (nvidia-cuda-mps-control -d) as the user of its first client, carries no
# environment, and runs every client's kernels: terminating it ends all of
# them. So it is known by what only root can arrange, never by its name
# (any user can name a process so, or run a copy of the file): a GPU
# process is the shared server when
# - the file the kernel runs for it (/proc/<pid>/exe's path) is, here, a
#   regular file named nvidia-cuda-mps-server owned by root and writable
#   by no one else, in directories that are all root's and writable by no
#   one else (so only root put it there; replaced since, "(deleted)", the
#   directories alone say so); each looked at with lstat from /, none a
#   FUSE mount point (a user can mount one only on a directory they may
#   write), so that nothing here waits on a user's program;
# - no one traces it (TracerPid 0: its user could take it over);
# - its parent (its stat's ppid) is a process of real uid root whose file
#   is such a one named nvidia-cuda-mps-control, and that started no later
#   than it and still runs (not a reused pid).
# One that runs the server file otherwise (a user's own control daemon) is
# its user's own ("own"), judged like any of their processes.
MPS_SERVER = "nvidia-cuda-mps-server"
MPS_CONTROL = "nvidia-cuda-mps-control"
DELETED = " (deleted)"


def root_file(path, name):
    """Why `path` is not a file only root could have put there, named
    `name` (see above), or None when it is."""
    deleted = path.endswith(DELETED)
    if deleted:
        path = path[: -len(DELETED)]
    if os.path.basename(path) != name:
        return "its executable is not named %s" % name
    parts = path.split("/")
    if parts[0] != "" or "" in parts[1:] or "." in parts or ".." in parts:
        return "its executable's path %r is not a plain absolute path" % path
    prefix = ""
    for i, part in enumerate(parts[1:]):
        prefix += "/" + part
        last = i == len(parts) - 2
        if last and deleted:
            break
        if fuse_mountpoint(prefix):
            return "its executable is on a FUSE file system (%s)" % prefix
        try:
            st = os.lstat(prefix)
        except OSError as e:
            return "its executable cannot be looked at (%s: %s)" % (prefix, e.strerror)
        kind = stat.S_ISREG(st.st_mode) if last else stat.S_ISDIR(st.st_mode)
        if not kind or st.st_uid != 0 or st.st_mode & 0o022:
            return "its executable is not a file only root can write (%s)" % prefix
    return None


def root_program(pid, name):
    """Why process `pid` does not run a file only root could have put
    there named `name`, or None when it does."""
    try:
        path = os.readlink(proc_path(pid, "exe"))
    except OSError as e:
        return "its executable cannot be read: %s" % e.strerror
    return root_file(path, name)


def tracer(status):
    for line in status.split(b"\n"):
        if line.startswith(b"TracerPid:"):
            value = line.split()[1:2]
            return int(value[0]) if value and value[0].isdigit() else None
    return None


def mps_role(pid, stat_bytes, start):
    """b"shared", b"own\n<why not shared>", or None for a GPU process that
    does not run the driver's MPS server file (see above)."""
    if root_program(pid, MPS_SERVER) is not None:
        return None
    fields = stat_fields(stat_bytes)
    ppid = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
    try:
        traced = tracer(proc_read(pid, "status"))
    except OSError:
        traced = None
    try:
        parent_stat = proc_read(ppid, "stat") if ppid > 1 else None
        parent_uid = real_uid(proc_read(ppid, "status")) if ppid > 1 else None
    except OSError:
        parent_stat = parent_uid = None
    parent_start = start_time(parent_stat) if parent_stat else None
    if traced:
        why = "it is traced (by pid %s)" % traced
    elif parent_stat is None or parent_uid != 0:
        why = "its parent (pid %d) is not a process of root" % ppid
    elif parent_start is None or parent_start > start:
        why = "its parent (pid %d) started after it" % ppid
    else:
        why = root_program(ppid, MPS_CONTROL)
        if why is not None:
            why = "its parent (pid %d) is not root's %s: %s" % (ppid, MPS_CONTROL, why)
        elif start_time(proc_read_or_empty(ppid)) != parent_start:
            why = "its parent (pid %d) ended while it was looked at" % ppid
    if why is None:
        return b"shared"
    return b"own\n" + why.encode()


def environ_of(pid, tid, start, stat, deadline):
    """(kind, value) for a proc frame; (None, None) when the process (or
    the thread `tid`) is gone."""
    if (pid, start) in HUNG:
        return "hidden", b"reading its environment hung (it maps it from a file that does not answer)"
    path = proc_path(pid, "environ", tid)
    size = environ_size(stat)
    wait = ENVIRON_WAIT if deadline is None else min(ENVIRON_WAIT, deadline - time.monotonic())
    if wait < 0.05:
        return "unreadable", b"not read within the snapshot's time"
    try:
        found = READER.run(lambda: read_environ(path, size), wait)
    except Hung:
        if wait < ENVIRON_WAIT:
            # Cut short by the snapshot's deadline: that says nothing of the
            # process, unread this cycle, never judged for it.
            return "unreadable", b"not read within the snapshot's time"
        HUNG.add((pid, start))
        return "hidden", ("reading its environment did not end within %gs" % ENVIRON_WAIT).encode()
    except Hidden as e:
        return "hidden", str(e).encode()
    except PermissionError:
        return "unreadable", b"not enough permissions to read its environment"
    except (FileNotFoundError, ProcessLookupError):
        # Ended, or its leader exited meanwhile: read through a live thread.
        if tid is None and exited(proc_read_or_empty(pid)):
            return environ_of_threads(pid, start, stat, deadline)
        return None, None
    except OSError as e:
        if e.errno in (errno.EIO, errno.EFAULT):
            return "hidden", ("reading its environment fails: %s" % e.strerror).encode()
        return "unreadable", ("cannot read its environment: %s" % e.strerror).encode()
    if found is None:
        return "novar", b""
    return "var", found


def bounded_int(digits):
    """An integer of JSON that a user wrote, refused past 4300 digits (as
    interpreters since the fix of CVE-2020-10735 refuse it)."""
    if len(digits) > 4300:
        raise ValueError("an integer of %d digits" % len(digits))
    return int(digits)


# Older interpreters parse an integer of n digits in time n^2, holding the
# GIL (no alarm or watchdog runs meanwhile): they get the same limit.
PARSE_INT = None if hasattr(sys, "get_int_max_str_digits") else bounded_int


def users_json(data):
    """A state file's JSON (bytes a user wrote)."""
    return json.loads(data.decode("utf-8"), parse_int=PARSE_INT)


def listed_pids(envs_text, path="envs.json", max_records=None):
    """The pids envs.json lists. What is not genv's layout lists none (the
    snapshot's parser then says what is wrong, and where); what cannot be
    parsed at all (nested too deeply) or holds more than max_records
    records fails the snapshot, naming the file."""
    try:
        envs = users_json(envs_text).get("envs") or []
    except RecursionError:
        raise Failure("state", "%s: cannot parse: nested too deeply" % path)
    except (ValueError, AttributeError, TypeError):
        return set()
    if not isinstance(envs, list):
        return set()
    # A few plain steps per record (64 MiB holds 30 million): past the
    # limit they are only counted.
    limit = float("inf") if max_records is None else max_records
    records = 0
    pids = set()
    for e in envs:
        records += 1
        if type(e) is not dict:
            continue
        listed = e.get("pids")
        kernels = e.get("kernel_ids")
        if type(kernels) is list:
            records += len(kernels)
        if type(listed) is list:
            records += len(listed)
            if records <= limit:
                for p in listed:
                    if type(p) is int and 0 < p < 1 << 31:
                        pids.add(p)
    if max_records is not None and records > max_records:
        raise Failure(
            "state",
            "%s: %d records (environments, their pids and kernel ids), more than the limit of %d (--max-records): refused"
            % (path, records, max_records),
        )
    return pids


def counted_devices(devices_text, path="devices.json", max_records=None):
    """Fails the snapshot, naming the file, when devices.json holds more
    than max_records records (devices and their attachments) or cannot be
    parsed at all: counted here, so the enforcer never receives (nor
    allocates for) a file past the limit. What is not genv's layout is the
    snapshot's parser's to say."""
    if max_records is None:
        return
    try:
        devices = users_json(devices_text).get("devices") or []
    except RecursionError:
        raise Failure("state", "%s: cannot parse: nested too deeply" % path)
    except (ValueError, AttributeError, TypeError):
        return
    if not isinstance(devices, list):
        return
    records = 0
    for d in devices:
        records += 1
        attachments = d.get("attachments") if type(d) is dict else None
        if type(attachments) is list:
            records += len(attachments)
    if records > max_records:
        raise Failure(
            "state",
            "%s: %d records (devices and attachments), more than the limit of %d (--max-records): refused"
            % (path, records, max_records),
        )


def gpu_pids(apps):
    pids = set()
    for line in apps.split(b"\n"):
        fields = line.split(b", ")
        if len(fields) >= 2 and fields[1].strip().isdigit():
            pids.add(int(fields[1].strip()))
    return pids


def boot_ticks():
    """Clock ticks since boot now, as /proc counts start times."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK") // 1000000000


STATE_WAIT = LOCK_WAIT + 4.0  # genv's state is a few KiB on a local disk


def read_state(d, max_bytes, deadline):
    """genv's state files as bytes (None: absent), the problems that kept
    any from being read ({part: why}: a refused file does not fail the
    snapshot, only what needs it), and who held genv's lock past LOCK_WAIT.
    All of it on the reader: a state directory on a mount that does not
    answer costs the state, not the snapshot."""

    def read():
        state, problems, note = {}, {}, None
        try:
            dfd = open_dir(d)
            if dfd is None:
                return state, problems, note
            note = lock(dfd, d, fcntl.LOCK_SH, deadline)
        except Failure as f:
            return state, {"dir": f.message}, note
        except OSError as e:
            return state, {"dir": "%s: %s" % (d, e.strerror)}, note
        for name in ("envs", "devices"):
            try:
                state[name] = read_file(dfd, d, name + ".json", max_bytes)
            except Failure as f:
                problems[name] = f.message
            except OSError as e:
                problems[name] = "%s: %s" % (os.path.join(d, name + ".json"), e.strerror)
        return state, problems, note

    # Its own budget: nvidia-smi, running meanwhile, keeps the rest of the step.
    wait = max(0.0, min(deadline - time.monotonic(), STATE_WAIT))
    try:
        return READER.run(read, wait)
    except Hung:
        return {}, {"dir": "%s did not answer within %gs" % (d, wait)}, None


def snapshot(req, out):
    max_bytes = req["max_bytes"]
    deadline = time.monotonic() + req["step"]
    # The GPU list (uuid -> index) is asked for every time, not kept from
    # the last cycle: indices change with a driver reload, a GPU falling off
    # the bus or MIG reconfiguration, and a stale map would put processes
    # on the wrong devices (and so kill the wrong ones). Both queries run at
    # once, so asking costs one short process, not time.
    queries = [
        ("gpus", "--query-gpu=uuid,index,memory.total"),
        ("apps", "--query-compute-apps=gpu_uuid,pid,used_gpu_memory"),
    ]
    if req.get("utilization"):
        queries.append(("utilization", "--query-gpu=index,utilization.gpu"))
    # A process that starts from now on is not one nvidia-smi can list (its
    # pid, reused, would be judged with another's GPU usage).
    asked = boot_ticks()
    try:
        procs = [spawn(req["nvidia_smi"] + [q, "--format=csv,noheader,nounits"]) for _, q in queries]
        # pmon samples for about a second; it runs beside the rest. It may
        # fail (MIG, an old driver): then no process's own figure is known.
        if req.get("utilization"):
            procs.append(spawn(req["nvidia_smi"] + ["pmon", "-c", "1", "-s", "u"]))
    except OSError as e:
        raise Failure("nvidia-smi", "cannot run %s: %s" % (req["nvidia_smi"][0], e.strerror))
    # genv's state is read while nvidia-smi runs.
    d = req["dir"]
    state, problems, lock_note = read_state(d, max_bytes, deadline)
    release()  # genv's lock, while nvidia-smi finishes
    pmon = procs[len(queries):]
    answers = collect(procs[: len(queries)], deadline, max_bytes)
    if pmon:
        # Its own short deadline: a hung pmon costs the idle rule its
        # figures (unknown: nothing reclaimed), not the snapshot its time.
        [(status, stdout, _)] = collect(pmon, min(deadline, time.monotonic() + PMON_SECONDS), max_bytes)
        if status == 0:
            frame(out, "pmon", None, stdout)
    for (name, query), (status, stdout, stderr) in zip(queries, answers):
        if status is None:
            raise Failure("nvidia-smi", "%s did not finish within %gs" % (query, req["step"]))
        if status != 0:
            said = (stderr or stdout).decode("utf-8", "replace").strip()
            raise Failure("nvidia-smi", "%s exited with status %d: %s" % (query, status, said))
        frame(out, name, None, stdout)
    listed = set()
    if state.get("envs") is not None:
        try:
            listed = listed_pids(state["envs"], os.path.join(d, "envs.json"), req.get("max_records"))
        except Failure as f:
            problems["envs"] = f.message
            del state["envs"]
    if state.get("devices") is not None:
        try:
            counted_devices(state["devices"], os.path.join(d, "devices.json"), req.get("max_records"))
        except Failure as f:
            problems["devices"] = f.message
            del state["devices"]
    for name in ("envs", "devices"):
        if state.get(name) is not None:
            frame(out, name, None, state[name])
    for part in sorted(problems):
        frame(out, "state-error", part, problems[part].encode("utf-8", "replace"))
    if lock_note:
        frame(out, "lock", None, lock_note.encode())
    live = set(int(n) for n in os.listdir(PROC[0]) if n.isdigit())
    on_gpus = gpu_pids(answers[1][1])
    uids = set()
    seen_uids = {}
    # GPU processes first: past the deadline, what is left is said unsure.
    order = sorted(on_gpus) + sorted((listed & live) - on_gpus)
    for pid in order:
        if time.monotonic() >= deadline:
            body = b"unsure\nnot read within the snapshot's %gs" % req["step"]
            role = None
        else:
            body, role = identity_and_role(pid, pid in on_gpus, asked if pid in on_gpus else None, deadline) or (None, None)
        if body is not None:
            frame(out, "proc", pid, body)
            if role is not None:
                frame(out, "mps", pid, role)
            words = body.split(b"\n", 1)[0].split()
            if words[0] == b"seen" and words[2] != b"-":
                uids.add(int(words[2]))
                seen_uids[pid] = int(words[2])
    HUNG.intersection_update(set(k for k in HUNG if k[0] in live))
    # Every lookup within the deadline (Names). The owners of GPU processes
    # first and outside the count (what nvidia-smi lists bounds them): their
    # names, the owners of their sub-uid ranges and their groups decide. Then
    # the uids of the pids that records list, at most MAX_LOOKUPS, since any
    # user can list any pid in a record. A uid whose name or range owner was
    # not looked up is said "unnamed": its processes are never acted on (a
    # name decides exemptions and overrides).
    boot = clock()
    if boot is not None:
        frame(out, "clock", None, boot)
    gpu_uids = set(seen_uids[pid] for pid in on_gpus if pid in seen_uids)
    tell_names(out, req, gpu_uids, uids - gpu_uids, Names(deadline))


def tell_names(out, req, gpu_uids, listed_uids, names):
    """Frames each uid's name (or unnamed), sub-uid range owner and asked
    groups: `gpu_uids` (those of GPU processes) first and outside the count
    of lookups, then `listed_uids` (of pids that only records list)."""
    ranges = SubUidRanges(req.get("subuid") or SUBUID)
    told = set()
    for batch, counted in ((sorted(gpu_uids), False), (sorted(listed_uids), True)):
        names.counted = counted
        owners = sub_uid_owners(ranges, batch, names)
        for uid in sorted(owners):
            owner = owners[uid]
            if isinstance(owner, Late):
                frame(out, "unnamed", uid, owner.why.encode())
            else:
                frame(out, "subuid", uid, (b"%d" % owner) if isinstance(owner, int) else b"- " + owner.encode())
        named = []
        for uid in batch:
            owner = owners.get(uid, uid)
            owner = owner if isinstance(owner, int) else uid
            if owner in told or isinstance(owners.get(uid), Late):
                continue
            told.add(owner)
            try:
                name = names.user(owner)
            except Late as late:
                frame(out, "unnamed", owner, late.why.encode())
                continue
            named.append(owner)
            if name is not None:
                frame(out, "user", owner, name.encode())
        if req.get("groups"):
            # Each uid seen once, each named group once (at most MAX_GROUPS).
            # A uid whose groups were not looked up is unnamed: no group
            # exemption lost, no group cap escaped, by a slow lookup.
            found, late = memberships(req["groups"], named, names, True)
            for uid, groups in found:
                frame(out, "groups", uid, "\n".join(groups).encode())
            for uid, why in late:
                frame(out, "unnamed", uid, ("its groups were not looked up: %s" % why).encode())


# Subordinate uids: a user with a range in /etc/subuid (Debian's adduser
# gives every user one; rootless containers need it) can run processes as
# any uid of it (newuidmap). Such a process is that user's: each uid seen
# that the host's user database does not name is resolved to the owner of
# the range that holds it. A uid in the ranges of several users, or in one
# whose owner is unknown here, is left as it is, with the reason.
SUBUID = "/etc/subuid"
MAX_SUBUID_BYTES = 16 << 20


class SubUidRanges:
    """The sub-uid ranges of `path` (root's own file), read once when first
    needed: (starts, reaches, ranges) or why the file is not believed."""

    def __init__(self, path):
        self.path = path
        self.read = None

    def get(self):
        if self.read is None:
            self.read = self.load()
        return self.read

    def load(self):
        path = self.path
        try:
            fd = keep(os.open(path, os.O_RDONLY | SAFE))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                return "in no sub-uid range (%s is not root's own regular file: not believed)" % path
            text = os.read(fd, MAX_SUBUID_BYTES)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "in no sub-uid range (%s is a symbolic link: not believed)" % path
            if e.errno == errno.ENOENT:
                return "in no sub-uid range (there is no %s)" % path
            return "in no sub-uid range (%s: %s)" % (path, e.strerror)
        ranges = []
        for line in text.split(b"\n"):
            parts = line.strip().split(b":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and parts[0] and int(parts[2]) > 0:
                ranges.append((int(parts[1]), int(parts[1]) + int(parts[2]), parts[0].decode("utf-8", "replace")))
        ranges.sort()
        # reach[i]: the furthest end among ranges[:i + 1], to stop looking back.
        reach, furthest = [], 0
        for r in ranges:
            furthest = max(furthest, r[1])
            reach.append(furthest)
        return [r[0] for r in ranges], reach, ranges


def sub_uid_owners(ranges, uids, names):
    """{uid: owner uid, why not resolved, or Late} for each uid of `uids`
    (in the order given: lookups may run out of time) that has no name here
    (`ranges`: a SubUidRanges, or the path of root's own file; a file
    anyone else may write is not believed). A uid not looked up in time is
    left out, and one whose range owner was not is Late: either is said
    unnamed."""
    import bisect

    if not isinstance(ranges, SubUidRanges):
        ranges = SubUidRanges(ranges)
    nameless = []
    for uid in uids:
        try:
            if names.user(uid) is None:
                nameless.append(uid)
        except Late:
            break
    if not nameless:
        return {}
    path, read = ranges.path, ranges.get()
    if isinstance(read, str):
        return dict((uid, read) for uid in nameless)
    starts, reach, ranges = read
    found = {}
    for uid in nameless:
        owners = set()
        i = bisect.bisect_right(starts, uid) - 1
        while i >= 0 and reach[i] > uid:
            if ranges[i][1] > uid:
                owners.add(ranges[i][2])
            i -= 1
        if len(owners) > 1:
            found[uid] = "in the sub-uid ranges of %s" % ", ".join(sorted(owners))
        elif owners:
            owner = owners.pop()
            try:
                found[uid] = int(owner) if owner.isdigit() else names.uid(owner)
            except Late as late:
                found[uid] = Late("in the sub-uid range of %s, not looked up: %s" % (owner, late.why))
            if found[uid] is None:
                found[uid] = "in the sub-uid range of %s, unknown here" % owner
        else:
            found[uid] = "in no sub-uid range of %s" % path
    return found


def clock():
    """b"<btime> <hz>": when this host booted (/proc/stat) and its clock
    ticks per second, which make start times comparable across hosts; None
    when procfs does not say (then no process here is picked by age)."""
    try:
        with open(os.path.join(PROC[0], "stat"), "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return b"%d %d" % (int(line.split()[1]), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    return None


def memberships(groups, uids, names, with_late=False):
    """(uid, the named groups it is a member of) for each uid in the order
    given, as this host's name service says (`names`: within the request's
    deadline): each group looked up once, each uid's groups once; a lookup
    that fails says nothing (no exemption), and nothing is looked up once
    one is late. With `with_late`: (that, [(uid, why)] for each uid whose
    groups were not looked up)."""
    gids = {}
    found = []
    late = []
    uids = list(uids)
    k = 0
    try:
        for name in sorted(set(g for g in groups if isinstance(g, str)))[:MAX_GROUPS]:
            gid = names.gid(name)
            if gid is not None:
                gids.setdefault(gid, []).append(name)
        for k, uid in enumerate(uids):
            if not gids:
                break
            member = names.groups_of(uid)
            if member is None:
                continue
            listed = sorted(name for gid, named in gids.items() if gid in member for name in named)
            if listed:
                found.append((uid, listed))
    except Late as e:
        late = [(uid, e.why) for uid in uids[k:]]
    return (found, late) if with_late else found


MAX_GROUPS = 64
PMON_SECONDS = 5


# Kills.


def terminate(req, kills):
    sig = signal.SIGKILL if req.get("signal") == "kill" else signal.SIGTERM
    for kill in req["kills"]:
        pid, want = (list(kill) + [None, None])[:2] if isinstance(kill, list) else (kill, None)
        if not (type(pid) is int and type(want) is int and 0 < pid < 1 << 31):
            kills.append({"pid": pid if type(pid) is int else None, "result": "invalid"})
            continue
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                kills.append({"pid": pid, "result": "gone"})
                continue
            except OSError:
                pidfd = None
        try:
            try:
                stat = proc_read(pid, "stat")
                found = start_time(stat)
            except OSError:
                kills.append({"pid": pid, "result": "gone"})
                continue
            # A process whose leader exited is signalled as a whole while
            # any other thread is listed (the live one may be past the
            # first MAX_TASKS_LOOKED, behind threads kept as zombies); one
            # with no other thread left takes no signal.
            if exited(stat) and threads(pid) == (None, False):
                kills.append({"pid": pid, "result": "gone"})
                continue
            if found != want:
                kills.append({"pid": pid, "result": "reused", "found": found})
                continue
            try:
                if pidfd is not None:
                    signal.pidfd_send_signal(pidfd, sig)
                else:
                    os.kill(pid, sig)
                kills.append({"pid": pid, "result": "signalled"})
            except ProcessLookupError:
                kills.append({"pid": pid, "result": "gone"})
            except PermissionError:
                kills.append({"pid": pid, "result": "denied"})
        finally:
            if pidfd is not None:
                os.close(pidfd)


# Fencing (high availability): the highest leader epoch this host has
# seen, in D/epoch, a file only root can reach (D is root's own 0700
# directory, created if missing, never followed through a link). A
# request with an older epoch is refused whole ("fenced"), before it
# touches anything, so a leader that lost its lease while paused cannot
# act after another has; a newer one is written down. A fence that cannot
# be used safely fails the request ("fence") and acts on nothing. The file stays locked
# (flock) while the request acts, so the check and the action are one
# step for every agent on the host.

MAX_EPOCH = 1 << 63


def fence_dir(d, create=True):
    """D, opened: root's own (the agent's euid) 0700 directory, never a link;
    made first when `create`."""
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise Failure("fence", "%s: cannot create: %s" % (d, e.strerror))
    try:
        dfd = keep(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as e:
        what = "a symbolic link" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
        raise Failure("fence", "%s: %s" % (d, what))
    st = os.fstat(dfd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise Failure("fence", "%s is not a directory of uid %d only (owner %d, mode %o)"
                      % (d, os.geteuid(), st.st_uid, stat.S_IMODE(st.st_mode)))
    return dfd


def fence_file(dfd, d, deadline=None):
    """D/epoch, opened (made, and locked by `deadline`, when one is given;
    else read only), and the epoch it holds (0: none); (None, 0) when it
    is absent and not to be made."""
    path = os.path.join(d, "epoch")
    flags = os.O_RDWR | os.O_CREAT if deadline is not None else os.O_RDONLY
    try:
        fd = keep(os.open("epoch", flags | SAFE, 0o600, dir_fd=dfd))
    except FileNotFoundError:
        return None, 0
    except OSError as e:
        raise Failure("fence", "%s: %s" % (path, "a symbolic link" if e.errno == errno.ELOOP else e.strerror))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        raise Failure("fence", "%s is not a regular file of uid %d alone" % (path, os.geteuid()))
    while deadline is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise Failure("fence", "%s stayed locked by another agent" % path)
            time.sleep(0.005)
    text = os.pread(fd, 64, 0).strip()
    if not text:
        return fd, 0
    try:
        seen = int(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        seen = -1
    if not 0 <= seen < MAX_EPOCH:
        raise Failure("fence", "%s does not hold an epoch" % path)
    return fd, seen


def fence(req, hold):
    """Checks the request's epoch against the host's, and raises the host's
    to it; the file stays locked until the request ends when `hold`."""
    f = req.get("fence")
    if f is None:
        return
    if not (isinstance(f, dict) and set(f) == {"epoch", "dir"} and type(f["epoch"]) is int
            and 0 < f["epoch"] < MAX_EPOCH and isinstance(f["dir"], str) and f["dir"].startswith("/")):
        raise Failure("request", "a fence is {\"epoch\": n > 0, \"dir\": absolute path}: %r" % (f,))
    # Another agent of ours may act under the lock: wait as long as a step.
    step = req.get("step") if type(req.get("step")) in (int, float) else 5.0
    try:
        dfd = fence_dir(f["dir"])
        fd, seen = fence_file(dfd, f["dir"], time.monotonic() + max(0.1, min(step, 30.0)))
    except Failure as e:
        raise Failure("fence", e.message + ": refused")
    if f["epoch"] < seen:
        raise Failure("fenced", "epoch %d is older than epoch %d, which another enforcer has used on this host: refused"
                      % (f["epoch"], seen))
    if f["epoch"] > seen:
        # Written over the old one (a newer epoch is never shorter), then
        # cut: a failure midway leaves an epoch no lower than before.
        data = b"%d\n" % f["epoch"]
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    if not hold:
        held.remove(fd)
        os.close(fd)


def fence_facts(d):
    """What doctor says of the fence: the directory and the epoch, or the
    problem (the checks fence() makes, nothing made or locked)."""
    facts = {"dir": d, "kind": file_kind(d), "epoch": None, "problem": None}
    if facts["kind"] == "missing":
        return facts
    try:
        _, seen = fence_file(fence_dir(d, create=False), d)
        facts["epoch"] = seen or None
    except Failure as e:
        facts["problem"] = e.message
    return facts


# Detach.


def detach(req):
    """Whether each pair of the request was there and is gone now, and who
    held genv's lock if it was written without it (see lock()). On the
    reader: a state directory that does not answer fails the request."""
    deadline = time.monotonic() + req["step"]
    try:
        return READER.run(lambda: detach_pairs(req, deadline), req["step"] + LOCK_WAIT)
    except Hung:
        raise Failure("state", "%s did not answer within %gs" % (req["dir"], req["step"]))


def detach_pairs(req, deadline):
    """Detaches the pairs from devices.json as it is now. A write made
    meanwhile that changes the file's content is never lost: the detach is
    done again on the new content, within the step; a change of its
    metadata alone (a touch, a chmod, a copy renamed over) stops nothing."""
    d = req["dir"]
    pairs = req["detach"]
    dfd = open_dir(d)
    if dfd is None:
        return [False] * len(pairs), None
    note = lock(dfd, d, fcntl.LOCK_EX, deadline)
    tries = 0
    while True:
        tries += 1
        try:
            return detach_once(req, dfd, d, pairs), note
        except Changed:
            if time.monotonic() >= deadline:
                raise Failure(
                    "state",
                    "%s: its content changed each of the %d times it was detached from within %gs: nothing detached, retried next cycle"
                    % (os.path.join(d, "devices.json"), tries, req["step"]),
                )


class Changed(Exception):
    """The file's content changed between its read and its replacement."""


def detach_once(req, dfd, d, pairs):
    seen = identity_of(dfd, "devices.json")
    text = read_file(dfd, d, "devices.json", req["max_bytes"])
    if text is None:
        return [False] * len(pairs)
    path = os.path.join(d, "devices.json")
    try:
        state = users_json(text)
        devices = state["devices"]
    except RecursionError:
        raise Failure("state", "%s: cannot parse: nested too deeply" % path)
    except (ValueError, KeyError, TypeError) as e:
        raise Failure("state", "%s: cannot parse: %s" % (path, e))
    if not isinstance(devices, list):
        raise Failure("state", "%s: cannot parse: devices is not a list" % path)
    # Every entry with a pair's index loses that environment (a user may
    # list an index twice; the snapshot reads them all): one pass.
    wanted = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and isinstance(pair[1], str)):
            raise Failure("request", "a detach pair is [index, eid]: %r" % (pair,))
        wanted.setdefault(pair[0], set()).add(pair[1])
    removed = set()
    for device in devices:
        index = device.get("index") if isinstance(device, dict) else None
        attachments = device.get("attachments") if isinstance(device, dict) else None
        if type(index) is not int or index not in wanted or not isinstance(attachments, list):
            continue
        eids = wanted[index]
        kept = []
        for a in attachments:
            eid = a.get("eid") if isinstance(a, dict) else None
            if isinstance(eid, str) and eid in eids:
                removed.add((index, eid))
            else:
                kept.append(a)
        if len(kept) != len(attachments):
            device["attachments"] = kept
    if removed:
        data = rewritten(state, len(text), req["max_bytes"], path)
        replace(dfd, d, "devices.json", data, (seen, text, req["max_bytes"]))
    return [(index, eid) in removed for index, eid in pairs]


def indent_cost(value, depth=1):
    """The bytes json.dumps(indent=2) adds to the compact form of value:
    a newline and the indent before each member, and before each closing
    bracket of a non-empty container. Linear in what value holds."""
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return 0
    if not items:
        return 0
    # Each ", " and ": " is one byte more than "," and ":".
    cost = 1 + 2 * (depth - 1) + len(items) * (1 + 2 * depth + 1)
    return cost + sum(indent_cost(v, depth + 1) for v in items)


def rewritten(state, read, max_bytes, path):
    """The new devices.json: indented as genv writes it (indent=2, ASCII),
    unless that would be more than twice what was read (arrays nested deep,
    which a user may add under any key, grow 40-fold indented; text outside
    ASCII grows up to 6-fold escaped): then compact, in UTF-8 if that is
    smaller. Over max_bytes either way fails the detach, naming the file."""
    bound = 2 * read + 4096
    try:
        compact = json.dumps(state, separators=(",", ":"), allow_nan=False).encode()
        data = compact
        if len(compact) + indent_cost(state) <= bound:
            indented = json.dumps(state, indent=2, allow_nan=False).encode()
            if len(indented) <= bound:
                data = indented
        if len(data) > bound:
            try:
                plain = json.dumps(state, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
                if len(plain) < len(data):
                    data = plain
            except UnicodeEncodeError:
                pass  # a lone surrogate: ASCII escapes only
    except (ValueError, RecursionError) as e:
        raise Failure("state", "%s: cannot be written back: %s: nothing detached" % (path, e))
    if len(data) > max_bytes:
        raise Failure("state", "%s: written back it would be %d bytes, more than %d: nothing detached" % (path, len(data), max_bytes))
    return data


def stat_in(dfd, name):
    """The lstat of `name` in the directory, None when absent."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def file_identity(st):
    """(inode, size, mtime) of a file's stat, None for none."""
    return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)


def identity_of(dfd, name):
    """(inode, size, mtime) of `name` in the directory, None when absent."""
    return file_identity(stat_in(dfd, name))


def unlike(dfd, d, name, seen):
    """Whether `name` no longer holds the content read (`seen`: its
    identity then, that content, the most to read)."""
    try:
        return read_file(dfd, d, name, seen[2]) != seen[1]
    except (Failure, OSError):
        return True


def replace(dfd, d, name, data, seen=None):
    """Writes `data` to a new file created exclusively beside `name`, then
    renames it over `name` with the owner, group and mode `name` had (as
    genv's rewrite in place keeps them; 0666 root's where there was none):
    root's file in a user's quota, or a file another user may write, is
    never made of it. When `seen` is given (see unlike()), only if `name`
    still holds the content then read: a write made meanwhile, under
    genv's lock or not, is never lost (Changed: the caller reads again)."""
    tmp = ".%s.%s" % (name, os.urandom(8).hex())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE, 0o600, dir_fd=dfd)
    temp_files.append((dfd, tmp))
    keep(fd)
    try:
        write_all(fd, data)
        os.fsync(fd)
        # One look at the file replaced: whether it is the one read, and
        # whose it is.
        old = stat_in(dfd, name)
        if seen is not None and file_identity(old) != seen[0] and unlike(dfd, d, name, seen):
            raise Changed()
        if old is not None and stat.S_ISREG(old.st_mode):
            os.fchown(fd, old.st_uid, old.st_gid)
            os.fchmod(fd, stat.S_IMODE(old.st_mode) & 0o777)
        else:
            os.fchmod(fd, 0o666)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except (OSError, Failure, Changed) as e:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        if not isinstance(e, OSError):
            raise
        raise Failure("state", "%s: cannot replace: %s" % (os.path.join(d, name), e.strerror))
    finally:
        temp_files.remove((dfd, tmp))


def release():
    """Closes every fd opened for the request (and so drops genv's lock),
    and forgets the mounts it saw."""
    FUSE_DEVICES[0] = None
    while held:
        try:
            os.close(held.pop())
        except OSError:
            pass


def finish():
    """What a request leaves is undone: tools still running are killed and
    reaped, their pipes and every fd it opened closed."""
    while children:
        c = children.pop()
        c.kill()
        c.reap(True)
        for fd in (c.out, c.err):
            try:
                os.close(fd)
            except OSError:
                pass
    release()


# Tell: a message on a user's terminals, as write(1) would put it there.

MAX_NOTES = 256
MAX_TERMINALS = 16
MAX_TEXT = 4096
UTMP_RECORD = 384  # glibc's struct utmp on Linux (x86_64, aarch64)
USER_PROCESS = 7


def terminal_path(dev):
    """/dev's name for a terminal device number: a pty (major 136, its
    minor the pts number) or a virtual console (major 4, minors 1-63);
    None for anything else."""
    major, minor = os.major(dev), os.minor(dev)
    if major == 136:
        return "/dev/pts/%d" % minor
    if major == 4 and 0 < minor < 64:
        return "/dev/tty%d" % minor
    return None


def controlling_terminal(pid, want, uid):
    """The controlling terminal (device number) of pid, if it is still the
    process started at `want` and its real uid is uid."""
    try:
        before = proc_read(pid, "stat")
        tid = live_thread(pid) if exited(before) else None
        owner = real_uid(proc_read(pid, "status", tid))
        after = proc_read(pid, "stat")
    except OSError:
        return None
    if start_time(before) != want or start_time(after) != want or not alive(pid, after) or owner != uid:
        return None
    fields = after[after.rfind(b")") + 1 :].split()
    if len(fields) < 5 or not fields[4].lstrip(b"-").isdigit():
        return None
    dev = int(fields[4])
    return dev if dev > 0 else None


def login_terminals(path):
    """The terminals utmp lists for login sessions, as {user: [/dev paths]}
    (read once per request)."""
    try:
        fd = keep(os.open(path, os.O_RDONLY | SAFE))
    except OSError:
        return {}
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return {}
    data = os.read(fd, UTMP_RECORD * 4096)
    found = {}
    for at in range(0, len(data) - UTMP_RECORD + 1, UTMP_RECORD):
        record = data[at : at + UTMP_RECORD]
        kind = int.from_bytes(record[0:2], sys.byteorder)
        line = record[8:40].split(b"\0", 1)[0]
        who = record[44:76].split(b"\0", 1)[0]
        if kind != USER_PROCESS:
            continue
        words = line.split(b"/")
        pts = len(words) == 2 and words[0] == b"pts" and words[1].isdigit()
        console = len(words) == 1 and line.startswith(b"tty") and line[3:].isdigit() and 0 < int(line[3:]) < 64
        if pts or console:
            found.setdefault(who.decode("utf-8", "replace"), []).append("/dev/" + line.decode())
    return found


def printable(text):
    """text in printable ASCII, anything else but newline and tab as "?"
    (no control, and no byte a terminal in an 8-bit mode reads as one),
    lines ended as a terminal wants them (CR LF), at most MAX_TEXT bytes."""
    kept = "".join(c if c in "\n\t" or " " <= c <= "~" else "?" for c in text)
    return kept.replace("\n", "\r\n").encode("ascii")[:MAX_TEXT]


def write_terminal(path, uid, dev, data):
    """Writes data to the terminal at path if it is one and uid's (and, when
    dev is given, that device), checked before it is opened and again on
    what was opened: one non-blocking write; whether all of it went."""

    def theirs(st):
        return stat.S_ISCHR(st.st_mode) and st.st_uid == uid and (dev is None or st.st_rdev == dev)

    try:
        if not theirs(os.lstat(path)):
            return False
        fd = keep(os.open(path, os.O_WRONLY | SAFE))
    except OSError:
        return False
    if not theirs(os.fstat(fd)):
        return False
    if not os.isatty(fd):
        return False
    try:
        return os.write(fd, data) == len(data)
    except OSError:
        return False


def tell(req):
    """Terminals written per note."""
    # Half the run's limit for lookups: a note not looked up is not told.
    names = Names(time.monotonic() + req["limit"] / 2)
    notes = req["notes"]
    if not isinstance(notes, list) or len(notes) > MAX_NOTES:
        raise Failure("request", "a tell request holds at most %d notes" % MAX_NOTES)
    logins = None
    told = []
    for note in notes:
        if not (isinstance(note, dict) and isinstance(note.get("user"), str) and isinstance(note.get("text"), str)
                and isinstance(note.get("pids"), list)):
            raise Failure("request", "a note is {user, pids, text}")
        try:
            uid = names.uid(note["user"])
        except Late:
            uid = None
        if not uid:
            # Unknown here, or root: root's terminals are the admins'.
            told.append(0)
            continue
        if logins is None:
            logins = login_terminals(req["utmp"])
        # The job's own terminals first, then the user's logins.
        terminals = []
        paths = set()
        for pair in note["pids"][:MAX_TERMINALS]:
            if isinstance(pair, list) and len(pair) == 2 and all(type(x) is int and 0 < x < 1 << 63 for x in pair):
                dev = controlling_terminal(pair[0], pair[1], uid)
                path = terminal_path(dev) if dev else None
                if path and path not in paths:
                    paths.add(path)
                    terminals.append((path, dev))
        for path in logins.get(note["user"], []):
            if len(terminals) >= MAX_TERMINALS:
                break
            if path not in paths:
                paths.add(path)
                terminals.append((path, None))
        data = printable(note["text"])
        written = 0
        for path, dev in terminals[:MAX_TERMINALS]:
            written += write_terminal(path, uid, dev, data)
        release()
        told.append(written)
    return told


# Doctor: facts about this host, as JSON, for `genv-enforce doctor`.


def file_kind(path):
    """What is at path, as a token: missing, regular, directory, symlink,
    fifo, socket, device, other; or {"unreadable": why}."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return {"unreadable": e.strerror}
    for test, token in ((stat.S_ISREG, "regular"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                        (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device")):
        if test(mode):
            return token
    return "other"


def state_facts(d):
    facts = {"dir": d, "kind": file_kind(d)}
    if facts["kind"] == "directory":
        st = os.lstat(d)
        facts["mode"] = stat.S_IMODE(st.st_mode)
        facts["uid"] = st.st_uid
        facts["files"] = dict((n, file_kind(os.path.join(d, n))) for n in ("envs.json", "devices.json", "genv.lock"))
    return facts


def genv_version():
    """genv's version as installed for this Python (its dist-info), or None."""
    import site
    import sysconfig

    dirs = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
    try:
        dirs += site.getsitepackages()
    except AttributeError:
        pass
    for d in dirs:
        try:
            names = os.listdir(d)
        except (OSError, TypeError):
            continue
        for name in sorted(names):
            low = name.lower()
            if low.startswith("genv-") and low.endswith((".dist-info", ".egg-info")):
                return name[len("genv-") :].rsplit(".", 1)[0]
    return None


def which(name):
    for d in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(os.pathsep):
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def doctor(req):
    facts = {"python": "%d.%d.%d" % tuple(sys.version_info[:3]), "euid": os.geteuid(), "time": time.time()}
    argv = req["nvidia_smi"] + ["--query-gpu=index,driver_version", "--format=csv,noheader"]
    try:
        [(status, out, err)] = collect([spawn(argv)], time.monotonic() + req["step"], 1 << 20)
        if status is None:
            gpus = {"error": "%s did not finish within %gs" % (argv[0], req["step"])}
        elif status != 0:
            said = (err or out).decode("utf-8", "replace").strip()
            gpus = {"error": "%s exited with status %d: %s" % (argv[0], status, said)}
        else:
            rows = [line.split(", ") for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
            gpus = {"gpus": len(rows), "driver": rows[0][-1].strip() if rows else None}
    except OSError as e:
        gpus = {"error": "cannot run %s: %s" % (argv[0], e.strerror)}
    facts["nvidia_smi"] = gpus
    facts["state"] = state_facts(req["dir"])
    facts["genv"] = genv_version()
    facts["tools"] = dict((t, which(t)) for t in ("timeout", "flock", "sudo"))
    if req.get("fence_dir"):
        facts["fence"] = fence_facts(req["fence_dir"])
    return json.dumps(facts).encode()


# Requests: the keys each mode takes (every one is required but those of OPTIONAL).
KEYS = {
    "hello": {"mode", "protocol"},
    "snapshot": {"mode", "dir", "nvidia_smi", "step", "limit", "max_bytes", "max_records", "proc", "groups", "utilization",
                 "fence", "subuid"},
    "terminate": {"mode", "kills", "signal", "limit", "proc", "fence"},
    "detach": {"mode", "dir", "detach", "step", "limit", "max_bytes", "fence"},
    "doctor": {"mode", "dir", "nvidia_smi", "step", "limit", "fence_dir"},
    "tell": {"mode", "notes", "utmp", "limit", "proc"},
}
OPTIONAL = {"max_records", "proc", "signal", "groups", "utilization", "fence", "fence_dir", "subuid"}


def check(req):
    """A request this agent can carry out, or a Failure saying why not."""
    if not isinstance(req, dict) or req.get("mode") not in KEYS:
        raise Failure("request", "unknown request: %r" % (req.get("mode") if isinstance(req, dict) else req,))
    keys = KEYS[req["mode"]]
    unknown = sorted(set(req) - keys)
    missing = sorted(keys - OPTIONAL - set(req))
    if unknown or missing:
        raise Failure("request", "%s request: unknown keys %s, missing keys %s" % (req["mode"], unknown, missing))


def handle(req):
    """One request: (status, answer body); nothing of it outlives it."""
    try:
        return answer(req)
    finally:
        finish()


def failed(what, message, **more):
    body = dict(more)
    body.update({"fail": what, "message": message})
    return 1, json.dumps(body).encode()


def answer(req):
    kills = []
    try:
        check(req)
        mode = req["mode"]
        PROC[0] = req.get("proc") or "/proc"
        if mode == "hello":
            facts = {"protocol": PROTOCOL, "python": "%d.%d.%d" % tuple(sys.version_info[:3]),
                     "pidfd": hasattr(os, "pidfd_open"), "euid": os.geteuid()}
            return 0, json.dumps(facts).encode()
        if mode == "snapshot":
            fence(req, False)
            out = []
            snapshot(req, out)
            return 0, b"".join(out)
        if mode == "doctor":
            return 0, doctor(req)
        if mode == "terminate":
            fence(req, True)
            terminate(req, kills)
            return 0, json.dumps({"kills": kills}).encode()
        if mode == "tell":
            return 0, json.dumps({"told": tell(req)}).encode()
        fence(req, True)
        detached, note = detach(req)
        body = {"detached": detached}
        if note:
            body["unlocked"] = note
        return 0, json.dumps(body).encode()
    except Failure as f:
        # Kills that happened are answered; a detach that failed changed nothing.
        nothing = ": nothing detached" if f.what == "lock" and req.get("mode") == "detach" else ""
        return failed(f.what, f.message + nothing, kills=kills)
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, OSError) as e:
        # What a host's state or tools did that nothing above foresaw: an
        # answer naming it, never a traceback and a dead agent.
        return failed("agent", "%s: %s" % (type(e).__name__, e), kills=kills)


KILL_GRACE = 2.0


def kill_self():
    """A request stuck past its limit and the grace: SIGKILL, which ends even
    a read stuck in the kernel (a FUSE file that does not answer)."""
    try:
        write_all(2, b"genv-enforce agent: stuck past its time limit: killed\n")
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(s, on_signal)
    stdin = sys.stdin.buffer
    while True:
        header = stdin.readline()
        if not header:
            end(0, None)
        body = stdin.read(int(header))
        req = json.loads(body.decode("utf-8"))
        limit = req.get("limit") if isinstance(req, dict) else None
        limit = max(0.1, float(limit)) if type(limit) in (int, float) else 5.0
        signal.setitimer(signal.ITIMER_REAL, limit)
        # SIGALRM's handler runs only between bytecodes: a read stuck in the
        # kernel never returns to it. This one is SIGKILL, from a thread.
        watchdog = threading.Timer(limit + KILL_GRACE, kill_self)
        watchdog.daemon = True
        watchdog.start()
        status, answer = handle(req)
        watchdog.cancel()
        signal.setitimer(signal.ITIMER_REAL, 0)
        write_all(1, b"@%d %d\n" % (status, len(answer)) + answer)
        if READER.stuck:
            # A thread stuck in the kernel may still hold or close fds of
            # the requests to come: this agent ends, a fresh one follows.
            end(0, "genv-enforce agent: a read is stuck in the kernel: ending, to be started afresh")


if __name__ == "__main__":
    main()
