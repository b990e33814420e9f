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
#    "max_bytes": B, "max_records": R, "proc": "/proc"}
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
#     proc <pid>         "seen <start> <uid|-> var|novar|notread\n<value>" or
#                        "seen <start> <uid|-> unreadable\n<why>" or
#                        "unsure\n<why>", for each GPU pid and each live pid
#                        an environment lists (absent: not alive)
#     user <uid>         the host's name for a uid seen
#     groups <uid>       (when groups are named) those of them a uid seen
#                        (a GPU process's or a listed pid's owner) is a
#                        member of, one a line
#     clock              "<btime> <hz>": boot time and clock ticks per
#                        second, for start times across hosts
#     utilization        (when asked) --query-gpu=index,utilization.gpu
#     pmon               (when asked, and it succeeded) pmon -c 1 -s u
#   terminate: {"kills": [{"pid": n, "result": "signalled"|"gone"|"reused"|"denied"|"invalid",
#               "found": start_time (reused only; null when unreadable)}, ...]}
#   detach: {"detached": [bool per pair: it was there and is gone]}
#   doctor: facts about the host (see doctor())
#   tell: {"told": [terminals written per note]}
# Status 1: {"fail": "request"|"state"|"lock"|"nvidia-smi"|"fenced"|"fence"|"agent", "message": why,
#   "kills": [...] (terminate: those done before the failure)}; a detach that
#   failed changed nothing ("lock": genv.lock stayed held past the step limit).
# A request past its time limit (L) ends the agent (exit status 124), as
# does the end of stdin, a signal, or a request that is not JSON:
# genv-enforce starts a new one when it needs one.
#
# Safety: genv's state directory is writable by every user. The directory
# is opened once without following a symlink and every file in it relative
# to that handle with O_NOFOLLOW | O_NONBLOCK; only regular files of at most
# max_bytes are read. A detach writes a new file, created exclusively, and
# renames it over devices.json under an exclusive lock on genv.lock; the
# mode of an existing file is never changed. A process's identity (uid,
# environment) is read between two reads of its start time; a kill
# re-checks the start time and, where the kernel has pidfds, signals
# through one. A message goes only to a terminal the kernel says is the
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
import time

PROTOCOL = 5
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
    try:
        return keep(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            refuse(path, "a symbolic link" if os.path.islink(path) else "not a directory")
        raise Failure("state", "%s: %s" % (path, e.strerror))


def regular(fd, path):
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        refuse(path, kind_of(mode))
    return fd


def open_in(dfd, path, name, flags, mode=0):
    """A file of the directory, opened safely; None when absent."""
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


def lock(dfd, d, operation, step, deadline):
    """genv.lock, created 0666 as genv does when missing, locked by `deadline`."""
    path = os.path.join(d, "genv.lock")
    try:
        fd = keep(os.open("genv.lock", os.O_RDONLY | os.O_CREAT | os.O_EXCL | SAFE, 0o666, dir_fd=dfd))
        os.fchmod(fd, 0o666)
    except FileExistsError:
        fd = open_in(dfd, path, "genv.lock", os.O_RDONLY)
        if fd is None:
            raise Failure("state", "%s: vanished while opened" % path)
        keep(fd)
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise Failure("lock", "genv.lock held by another process for %gs" % step)
            time.sleep(0.005)


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


def proc_read(pid, name):
    with open("%s/%d/%s" % (PROC[0], pid, name), "rb") as f:
        return f.read(16 << 20)


def start_time(stat_bytes):
    """Field 22 of /proc/<pid>/stat, counted after the last ')' (the
    command name, which the user picks, may hold anything else)."""
    close = stat_bytes.rfind(b")")
    if close < 0:
        return None
    fields = stat_bytes[close + 1:].split()
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def exited(stat_bytes):
    """Whether the process has exited and only waits to be reaped (a signal does nothing)."""
    rest = stat_bytes[stat_bytes.rfind(b")") + 1 :].split()
    return bool(rest) and rest[0] in (b"Z", b"X")


def real_uid(status):
    for line in status.split(b"\n"):
        if line.startswith(b"Uid:"):
            parts = line.split()
            if len(parts) > 1 and parts[1].isdigit():
                return int(parts[1])
    return None


def identity(pid, want_environ):
    """The identity body of a proc frame, or None when the process is gone."""
    try:
        before = start_time(proc_read(pid, "stat"))
    except OSError:
        return None
    if before is None:
        return b"unsure\nits /proc stat does not parse"
    try:
        uid = real_uid(proc_read(pid, "status"))
    except OSError:
        uid = None
    value = b""
    if want_environ:
        try:
            environ = proc_read(pid, "environ")
            found = [v for v in environ.split(b"\0") if v.startswith(VAR)]
            if found:
                env, value = "var", found[-1][len(VAR):]
            else:
                env = "novar"
        except PermissionError:
            env, value = "unreadable", b"not enough permissions to read its environment"
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError as e:
            env, value = "unreadable", ("cannot read its environment: %s" % e.strerror).encode()
    else:
        env = "notread"
    try:
        after = start_time(proc_read(pid, "stat"))
    except OSError:
        return None
    if after != before:
        return b"unsure\nits pid was reused while it was read"
    uid_text = "-" if uid is None else str(uid)
    return ("seen %d %s %s\n" % (before, uid_text, env)).encode() + value


def listed_pids(envs_text, path="envs.json", max_records=None):
    """The pids envs.json lists. What is not genv's layout lists none (the
    snapshot's parser then says what is wrong, and where); what cannot be
    parsed at all (nested too deeply) or holds more than max_records
    records fails the snapshot, naming the file."""
    try:
        envs = json.loads(envs_text.decode("utf-8")).get("envs") or []
    except RecursionError:
        raise Failure("state", "%s: cannot parse: nested too deeply" % path)
    except (ValueError, AttributeError, TypeError):
        return set()
    if not isinstance(envs, list):
        return set()
    records = 0
    pids = set()
    for e in envs:
        listed = e.get("pids") if isinstance(e, dict) else None
        listed = listed if isinstance(listed, list) else []
        kernels = e.get("kernel_ids") if isinstance(e, dict) else None
        records += 1 + len(listed) + (len(kernels) if isinstance(kernels, list) else 0)
        pids.update(p for p in listed if type(p) is int and 0 < p < 1 << 31)
    if max_records is not None and records > max_records:
        raise Failure(
            "state",
            "%s: %d records (environments, their pids and kernel ids), more than the limit of %d (--max-records): refused"
            % (path, records, max_records),
        )
    return pids


def gpu_pids(apps):
    pids = set()
    for line in apps.split(b"\n"):
        fields = line.split(b", ")
        if len(fields) >= 2 and fields[1].strip().isdigit():
            pids.add(int(fields[1].strip()))
    return pids


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
    dfd = open_dir(d)
    state = {}
    if dfd is not None:
        lfd = lock(dfd, d, fcntl.LOCK_SH, req["step"], deadline)
        for name in ("envs", "devices"):
            state[name] = read_file(dfd, d, name + ".json", max_bytes)
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
    for name in ("envs", "devices"):
        if state.get(name) is not None:
            frame(out, name, None, state[name])
    live = set(int(n) for n in os.listdir(PROC[0]) if n.isdigit())
    on_gpus = gpu_pids(answers[1][1])
    uids = set()
    seen_uids = {}
    listed = listed_pids(state.get("envs") or b"{}", os.path.join(d, "envs.json"), req.get("max_records"))
    for pid in sorted(on_gpus | (listed & live)):
        body = identity(pid, pid in on_gpus)
        if body is not None:
            frame(out, "proc", pid, body)
            words = body.split(b"\n", 1)[0].split()
            if words[0] == b"seen" and words[2] != b"-":
                uids.add(int(words[2]))
                seen_uids[pid] = int(words[2])
    import pwd

    for uid in sorted(uids):
        try:
            frame(out, "user", uid, pwd.getpwuid(uid).pw_name.encode())
        except KeyError:
            pass
    boot = clock()
    if boot is not None:
        frame(out, "clock", None, boot)
    if req.get("groups"):
        # Each uid seen once, each named group once (at most MAX_GROUPS),
        # and nothing past the deadline: lookups may be slow.
        # The owners of GPU processes first: any user can list any pid in
        # a record, and lookups stop at the deadline.
        gpu_uids = set()
        for pid in on_gpus:
            body = seen_uids.get(pid)
            if body is not None:
                gpu_uids.add(body)
        ordered = sorted(gpu_uids) + sorted(uids - gpu_uids)
        for uid, names in memberships(req["groups"], ordered, deadline):
            frame(out, "groups", uid, "\n".join(names).encode())


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


def memberships(groups, uids, deadline):
    """(uid, the named groups it is a member of) for each uid in the order
    given, as this host's name service says: each group looked up once,
    each uid's groups once; a lookup that fails says nothing (no exemption), and nothing is
    looked up past the deadline."""
    import grp
    import pwd

    gids = {}
    for name in sorted(set(g for g in groups if isinstance(g, str)))[:MAX_GROUPS]:
        if time.monotonic() >= deadline:
            return []
        try:
            gids.setdefault(grp.getgrnam(name).gr_gid, []).append(name)
        except (KeyError, OSError, ValueError, UnicodeError):
            pass
    found = []
    for uid in uids:
        if not gids or time.monotonic() >= deadline:
            break
        try:
            pw = pwd.getpwuid(uid)
            member = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
        except (KeyError, OSError, ValueError, UnicodeError):
            continue
        names = sorted(name for gid, named in gids.items() if gid in member for name in named)
        if names:
            found.append((uid, names))
    return found


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
            if exited(stat):
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
    """Whether each pair of the request was there and is gone now."""
    d = req["dir"]
    pairs = req["detach"]
    dfd = open_dir(d)
    if dfd is None:
        return [False] * len(pairs)
    lock(dfd, d, fcntl.LOCK_EX, req["step"], time.monotonic() + req["step"])
    text = read_file(dfd, d, "devices.json", req["max_bytes"])
    if text is None:
        return [False] * len(pairs)
    path = os.path.join(d, "devices.json")
    try:
        state = json.loads(text.decode("utf-8"))
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
        replace(dfd, d, "devices.json", json.dumps(state, indent=2).encode())
    return [(index, eid) in removed for index, eid in pairs]


def replace(dfd, d, name, data):
    """Writes `data` to a new file created exclusively beside `name`, then
    renames it over `name` (mode 0666, as genv writes its state)."""
    tmp = ".%s.%s" % (name, os.urandom(8).hex())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE, 0o600, dir_fd=dfd)
    temp_files.append((dfd, tmp))
    keep(fd)
    try:
        os.fchmod(fd, 0o666)
        write_all(fd, data)
        os.fsync(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as e:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise Failure("state", "%s: cannot replace: %s" % (os.path.join(d, name), e.strerror))
    finally:
        temp_files.remove((dfd, tmp))


def release():
    """Closes every fd opened for the request (and so drops genv's lock)."""
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
        owner = real_uid(proc_read(pid, "status"))
        after = proc_read(pid, "stat")
    except OSError:
        return None
    if start_time(before) != want or start_time(after) != want or exited(after) or owner != uid:
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
    import pwd

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
            uid = pwd.getpwnam(note["user"]).pw_uid
        except (KeyError, ValueError):
            uid = None
        if not uid:
            # Unknown here, or root: root's terminals are the admins'.
            told.append(0)
            continue
        if logins is None:
            logins = login_terminals(req["utmp"])
        # The job's own terminals first, then the user's logins.
        terminals = []
        for pair in note["pids"][:MAX_TERMINALS]:
            if isinstance(pair, list) and len(pair) == 2 and all(type(x) is int and 0 < x < 1 << 63 for x in pair):
                dev = controlling_terminal(pair[0], pair[1], uid)
                path = terminal_path(dev) if dev else None
                if path and path not in [p for p, _ in terminals]:
                    terminals.append((path, dev))
        for path in logins.get(note["user"], []):
            if path not in [p for p, _ in terminals]:
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
                 "fence"},
    "terminate": {"mode", "kills", "signal", "limit", "proc", "fence"},
    "detach": {"mode", "dir", "detach", "step", "limit", "max_bytes", "fence"},
    "doctor": {"mode", "dir", "nvidia_smi", "step", "limit", "fence_dir"},
    "tell": {"mode", "notes", "utmp", "limit", "proc"},
}
OPTIONAL = {"max_records", "proc", "signal", "groups", "utilization", "fence", "fence_dir"}


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
        return 0, json.dumps({"detached": detach(req)}).encode()
    except Failure as f:
        # Kills that happened are answered; a detach that failed changed nothing.
        nothing = ": nothing detached" if f.what == "lock" and req.get("mode") == "detach" else ""
        return failed(f.what, f.message + nothing, kills=kills)
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, OSError) as e:
        # What a host's state or tools did that nothing above foresaw: an
        # answer naming it, never a traceback and a dead agent.
        return failed("agent", "%s: %s" % (type(e).__name__, e), kills=kills)


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
        signal.setitimer(signal.ITIMER_REAL, max(0.1, float(limit)) if type(limit) in (int, float) else 5.0)
        status, answer = handle(req)
        signal.setitimer(signal.ITIMER_REAL, 0)
        write_all(1, b"@%d %d\n" % (status, len(answer)) + answer)


if __name__ == "__main__":
    main()
