"""Unit tests of the host agent (src/host/agent.py), run by
tests/agent.rs under every Python 3 it finds (genv 1.4.3 needs 3.7+).

The agent is loaded from its source as genv-enforce sends it, without
running main(); its /proc reads and the state directory are exercised
against temporary files."""

import errno
import fcntl
import json
import os
import stat
import sys
import tempfile
import unittest

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "src", "host", "agent.py")
agent = {"__name__": "agent_under_test"}
with open(SOURCE, "rb") as f:
    exec(compile(f.read(), "genv-enforce-agent", "exec"), agent)


def stat_line(start, name=b"sleep"):
    return b"42 (" + name + b") S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 " + str(start).encode() + b" 0 0\n"


class Proc:
    """A fake /proc/42 whose files answer in turn (environ through
    read_environ, as the agent reads it)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def __call__(self, pid, name, tid=None):
        expected, answer = self.answers.pop(0)
        assert name == expected, (name, expected)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def environ(self, path, size):
        answer = self(42, "environ")
        var = b"\0" + agent["VAR"]
        text = b"\0" + answer
        if var not in text:
            return None
        return text.split(var, 1)[1].split(b"\0", 1)[0]


class Identity(unittest.TestCase):
    def setUp(self):
        self.real = agent["proc_read"], agent["read_environ"]

    def tearDown(self):
        agent["proc_read"], agent["read_environ"] = self.real
        agent["HUNG"].clear()

    def with_proc(self, answers):
        proc = Proc(answers)
        agent["proc_read"] = proc
        agent["read_environ"] = proc.environ

    def test_identity_is_read_between_two_equal_start_times(self):
        status = b"Name:\tsleep\nUid:\t1001\t1001\t1001\t1001\n"
        self.with_proc([("stat", stat_line(7)), ("status", status), ("environ", b"A=1\0GENV_ENVIRONMENT_ID=a\nb\xff\0"), ("stat", stat_line(7))])
        self.assertEqual(agent["identity"](42, True), b"seen 7 1001 var\na\nb\xff")
        self.with_proc([("stat", stat_line(7)), ("status", status), ("environ", b"X=1\0"), ("stat", stat_line(8))])
        self.assertEqual(agent["identity"](42, True), b"unsure\nits pid was reused while it was read")
        self.with_proc([("stat", OSError(errno.ENOENT, "gone"))])
        self.assertIsNone(agent["identity"](42, True))
        self.with_proc([("stat", stat_line(7)), ("status", status), ("environ", PermissionError(errno.EACCES, "no")), ("stat", stat_line(7))])
        self.assertEqual(agent["identity"](42, True), b"seen 7 1001 unreadable\nnot enough permissions to read its environment")
        self.with_proc([("stat", stat_line(7)), ("status", OSError(errno.ESRCH, "x")), ("stat", stat_line(7))])
        self.assertEqual(agent["identity"](42, False), b"seen 7 - notread\n")

    def test_a_process_that_started_once_nvidia_smi_was_asked_is_not_the_one_it_listed(self):
        self.with_proc([("stat", stat_line(500))])
        self.assertEqual(
            agent["identity"](42, True, 500),
            b"unsure\nit started after nvidia-smi was asked: what it listed for this pid was another process's",
        )
        status = b"Uid:\t1001\t1001\t1001\t1001\n"
        self.with_proc([("stat", stat_line(499)), ("status", status), ("environ", b"X=1\0"), ("stat", stat_line(499))])
        self.assertEqual(agent["identity"](42, True, 500), b"seen 499 1001 novar\n")

    def test_an_environ_that_fails_or_hangs_on_its_own_memory_is_hidden_and_a_hang_is_remembered(self):
        status = b"Uid:\t1001\t1001\t1001\t1001\n"
        self.with_proc([("stat", stat_line(7)), ("status", status), ("environ", OSError(errno.EIO, "Input/output error")), ("stat", stat_line(7))])
        self.assertEqual(agent["identity"](42, True), b"seen 7 1001 hidden\nreading its environment fails: Input/output error")
        waits = []

        def hang(path, size):
            waits.append(path)
            agent["time"].sleep(30)

        agent["proc_read"] = Proc([("stat", stat_line(7)), ("status", status), ("stat", stat_line(7))] * 2)
        agent["read_environ"] = hang
        wait, agent["ENVIRON_WAIT"] = agent["ENVIRON_WAIT"], 0.2
        self.addCleanup(agent.__setitem__, "ENVIRON_WAIT", wait)
        start = agent["time"].monotonic()
        self.assertEqual(agent["identity"](42, True), b"seen 7 1001 hidden\nreading its environment did not end within 0.2s")
        self.assertLess(agent["time"].monotonic() - start, 5)
        # The next snapshot does not wait on it again.
        self.assertEqual(
            agent["identity"](42, True),
            b"seen 7 1001 hidden\nreading its environment hung (it maps it from a file that does not answer)",
        )
        self.assertEqual(len(waits), 1)
        self.assertGreaterEqual(agent["READER"].stuck, 1)

    def test_a_process_whose_leader_exited_is_read_through_a_live_thread(self):
        proc = tempfile.TemporaryDirectory()
        self.addCleanup(proc.cleanup)
        old, agent["PROC"][0] = agent["PROC"][0], proc.name
        self.addCleanup(agent["PROC"].__setitem__, 0, old)
        agent["proc_read"], agent["read_environ"] = self.real

        def write(path, data):
            os.makedirs(os.path.dirname(os.path.join(proc.name, path)), exist_ok=True)
            with open(os.path.join(proc.name, path), "wb") as f:
                f.write(data)

        zombie = b"42 (job) Z 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 7 0 0\n"
        write("42/stat", zombie)
        write("42/task/42/stat", zombie)
        write("42/status", b"Uid:\t1002\t1002\t1002\t1002\n")
        write("42/task/43/stat", b"43 (job) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 2 0 9 0 0\n")
        write("42/task/43/status", b"Uid:\t1002\t1002\t1002\t1002\n")
        write("42/task/43/environ", b"A=1\0GENV_ENVIRONMENT_ID=bobs\0")
        self.assertEqual(agent["live_thread"](42), 43)
        self.assertTrue(agent["alive"](42, zombie))
        self.assertEqual(agent["identity"](42, True), b"seen 7 1002 var\nbobs")
        # Threads listed but none readable (they come and go, or exited
        # ones no one reaps hide the live ones): judged as carrying none,
        # never absent.
        write("42/task/43/stat", b"43 (job) Z 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 2 0 9 0 0\n")
        self.assertIsNone(agent["live_thread"](42))
        self.assertFalse(agent["alive"](42, zombie))
        self.assertEqual(
            agent["identity"](42, True),
            b"seen 7 1002 hidden\nits main thread exited and no live thread of it could be read",
        )
        # No thread left at all: a zombie waiting to be reaped is no process.
        import shutil

        shutil.rmtree(os.path.join(proc.name, "42/task/43"))
        self.assertIsNone(agent["identity"](42, True))

    def test_a_process_reaped_while_its_threads_are_listed_has_no_live_thread(self):
        class Reaped:
            """/proc/PID/task of a process reaped after it was opened."""

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def __iter__(self):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")

        real = agent["os"].scandir
        agent["os"].scandir = lambda path: Reaped()
        try:
            self.assertEqual(agent["threads"](42), (None, False))
            self.assertIsNone(agent["live_thread"](42))
        finally:
            agent["os"].scandir = real

    def test_start_time_counts_fields_after_the_last_paren(self):
        start_time = agent["start_time"]
        self.assertEqual(start_time(stat_line(987654, b"\xff) x (y) S 1 2 3")), 987654)
        self.assertEqual(start_time(stat_line(5, b"a b")), 5)
        self.assertIsNone(start_time(b"42 (x"))
        self.assertIsNone(start_time(b"42 (x) S 1"))

    def test_exited_processes_are_told_by_their_state_after_the_last_paren(self):
        exited = agent["exited"]
        self.assertFalse(exited(stat_line(5, b"Z) S")))
        self.assertTrue(exited(b"42 (a) Z) Z 1 1"))
        self.assertTrue(exited(b"42 (x) X 1"))
        self.assertFalse(exited(stat_line(5)))
        self.assertFalse(exited(b""))

    def test_pids_from_answers_and_records(self):
        self.assertEqual(agent["gpu_pids"](b"GPU-a, 100, 5\nGPU-b, x, 1\nGPU-b, 200, [N/A]\n\n"), {100, 200})
        listed = agent["listed_pids"](b'{"envs": [{"pids": [1, -2, "3", true, 4294967296, 7]}, {"pids": null}]}')
        self.assertEqual(listed, {1, 7})
        self.assertEqual(agent["listed_pids"](b"{"), set())
        self.assertEqual(agent["listed_pids"](b"[]"), set())
        self.assertEqual(agent["listed_pids"](b'{"envs": {"pids": [1]}}'), set())
        self.assertEqual(agent["listed_pids"](b'{"envs": [7, {"pids": 3}]}'), set())

    def test_state_nested_too_deeply_or_too_large_fails_naming_the_file(self):
        deep = b'{"envs": [' + b"[" * 200000 + b"]" * 200000 + b"]}"
        with self.assertRaises(agent["Failure"]) as caught:
            agent["listed_pids"](deep, "/var/tmp/genv/envs.json")
        self.assertEqual(caught.exception.message, "/var/tmp/genv/envs.json: cannot parse: nested too deeply")
        envs = b'{"envs": [{"pids": [1, 2], "kernel_ids": ["k"]}, {"pids": [3]}]}'
        self.assertEqual(agent["listed_pids"](envs, "e", 6), {1, 2, 3})
        with self.assertRaises(agent["Failure"]) as caught:
            agent["listed_pids"](envs, "e", 5)
        self.assertIn("e: 6 records (environments, their pids and kernel ids), more than the limit of 5 (--max-records): refused", caught.exception.message)


    def test_records_past_the_limit_are_counted_and_their_pids_never_gathered(self):
        envs = b'{"envs": [{"pids": [1, 2]}, 0, "x", {"pids": 3, "kernel_ids": ["k", "l"]}, {"pids": [4]}]}'
        self.assertEqual(agent["listed_pids"](envs, "e", 10), {1, 2, 4})
        with self.assertRaises(agent["Failure"]) as caught:
            agent["listed_pids"](envs, "e", 9)
        self.assertIn("e: 10 records", caught.exception.message)
        many = b'{"envs": [' + b",".join([b"0"] * 100000) + b', {"pids": [5]}]}'
        with self.assertRaises(agent["Failure"]) as caught:
            agent["listed_pids"](many, "e", 10)
        self.assertIn("e: 100002 records", caught.exception.message)

    def test_devices_json_is_counted_here_and_refused_past_the_limit(self):
        devices = b'{"devices": [{"index": 0, "attachments": [{"eid": "a"}, {"eid": "b"}]}, {"index": 1}, 7]}'
        agent["counted_devices"](devices, "d", 5)
        agent["counted_devices"](devices, "d", None)
        with self.assertRaises(agent["Failure"]) as caught:
            agent["counted_devices"](devices, "d", 4)
        self.assertIn("d: 5 records (devices and attachments), more than the limit of 4 (--max-records): refused", caught.exception.message)
        # Three million empty attachments: refused, never sent.
        many = b'{"devices": [{"index": 0, "attachments": [' + b",".join([b"{}"] * 3000000) + b"]}]}"
        with self.assertRaises(agent["Failure"]) as caught:
            agent["counted_devices"](many, "d", 250000)
        self.assertIn("d: 3000001 records", caught.exception.message)
        # Not genv's layout: the snapshot's parser says what is wrong.
        for odd in (b"{", b"[]", b'{"devices": {"index": 0}}', b'{"devices": [{"attachments": 3}]}'):
            agent["counted_devices"](odd, "d", 1)
        deep = b'{"devices": [' + b"[" * 200000 + b"]" * 200000 + b"]}"
        with self.assertRaises(agent["Failure"]) as caught:
            agent["counted_devices"](deep, "d", 10)
        self.assertEqual(caught.exception.message, "d: cannot parse: nested too deeply")

    def test_integers_of_more_than_4300_digits_are_refused_on_every_interpreter(self):
        self.assertEqual(agent["bounded_int"]("9" * 4300), int("9" * 4300))
        with self.assertRaises(ValueError):
            agent["bounded_int"]("9" * 4301)
        huge = b'{"envs": [{"pids": [7], "x": ' + b"9" * 5000 + b"}]}"
        # As an interpreter without the limit gets it, and as this one has it.
        saved = agent["PARSE_INT"]
        try:
            for parse_int in (agent["bounded_int"], saved):
                agent["PARSE_INT"] = parse_int
                self.assertEqual(agent["listed_pids"](huge), set())
                self.assertEqual(agent["listed_pids"](b'{"envs": [{"pids": [7], "x": 9}]}'), {7})
        finally:
            agent["PARSE_INT"] = saved


class Mps(unittest.TestCase):
    """mps_role against a fake /proc in a temporary directory: a server
    (pid 100) and its parent (pid 7), each with its executable, in a
    directory of root's under /run (as the driver's are: /tmp is every
    user's). Needs root (the files' owners are set)."""

    def setUp(self):
        self.real = agent["PROC"][0]
        self.tmp = tempfile.TemporaryDirectory(dir="/run")
        agent["PROC"][0] = self.tmp.name
        self.bin = os.path.join(self.tmp.name, "bin")
        os.mkdir(self.bin)

    def tearDown(self):
        agent["PROC"][0] = self.real
        agent["FUSE_DEVICES"][0] = None
        self.tmp.cleanup()

    def program(self, name, uid=0, mode=0o755, dir_uid=0, dir_mode=0o755):
        path = os.path.join(self.bin, "%s-%d-%o-%d-%o" % (name, uid, mode, dir_uid, dir_mode), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.chown(os.path.dirname(path), dir_uid, 0)
        os.chmod(os.path.dirname(path), dir_mode)
        with open(path, "wb"):
            pass
        os.chown(path, uid, 0)
        os.chmod(path, mode)
        return path

    def process(self, pid, exe, ppid, start, uid, tracer=0):
        d = os.path.join(self.tmp.name, str(pid))
        os.mkdir(d)
        os.symlink(exe, os.path.join(d, "exe"))
        with open(os.path.join(d, "stat"), "wb") as f:
            f.write(b"%d (x) S %d 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n" % (pid, ppid, start))
        with open(os.path.join(d, "status"), "wb") as f:
            f.write(b"Name:\tx\nTracerPid:\t%d\nUid:\t%d\t%d\t%d\t%d\n" % (tracer, uid, uid, uid, uid))
        return agent["proc_read"](pid, "stat")

    def role(self, server_exe, parent_exe, parent_uid=0, parent_start=400, tracer=0):
        stat_bytes = self.process(100, server_exe, 7, 500, 1001, tracer)
        if parent_exe is not None:
            self.process(7, parent_exe, 1, parent_start, parent_uid)
        return agent["mps_role"](100, stat_bytes, 500)

    def test_the_shared_server_is_roots_program_started_by_roots_control_daemon(self):
        server, control = self.program("nvidia-cuda-mps-server"), self.program("nvidia-cuda-mps-control")
        self.assertEqual(self.role(server, control), b"shared")

    def test_a_server_whose_file_root_replaced_is_still_known_by_its_directory(self):
        server, control = self.program("nvidia-cuda-mps-server"), self.program("nvidia-cuda-mps-control")
        os.unlink(server)
        self.assertEqual(self.role(server + " (deleted)", control + " (deleted)"), b"shared")
        # Deleted from a directory its user may write: anyone's.
        self.tearDown()
        self.setUp()
        server = self.program("nvidia-cuda-mps-server", dir_uid=1001)
        os.unlink(server)
        self.assertIsNone(self.role(server + " (deleted)", self.program("nvidia-cuda-mps-control")))

    def test_a_traced_server_is_no_longer_the_shared_one(self):
        server, control = self.program("nvidia-cuda-mps-server"), self.program("nvidia-cuda-mps-control")
        self.assertEqual(self.role(server, control, tracer=4242), b"own\nit is traced (by pid 4242)")

    def test_the_files_are_looked_at_without_entering_a_fuse_mount(self):
        server, control = self.program("nvidia-cuda-mps-server"), self.program("nvidia-cuda-mps-control")
        mount = os.path.dirname(os.path.dirname(server))
        agent["FUSE_DEVICES"][0] = (set(), {mount})
        self.assertEqual(agent["root_file"](server, "nvidia-cuda-mps-server"), "its executable is on a FUSE file system (%s)" % mount)
        self.assertIsNone(self.role(server, control))

    def test_a_server_not_started_by_roots_control_daemon_is_its_users_own(self):
        control = ("nvidia-cuda-mps-control", 0)
        cases = [
            (control, 1001, 400, b"own\nits parent (pid 7) is not a process of root"),
            (("bash", 0), 0, 400, b"own\nits parent (pid 7) is not root's nvidia-cuda-mps-control: its executable is not named nvidia-cuda-mps-control"),
            (("nvidia-cuda-mps-control", 1001), 0, 400, b"own\nits parent (pid 7) is not root's nvidia-cuda-mps-control: its executable is not a file only root can write (%s)"),
            (None, 0, 400, b"own\nits parent (pid 7) is not a process of root"),
            (control, 0, 600, b"own\nits parent (pid 7) started after it"),
        ]
        for parent, uid, start, said in cases:
            with self.subTest(parent=parent, uid=uid, start=start):
                self.tearDown()
                self.setUp()
                server = self.program("nvidia-cuda-mps-server")
                exe = None if parent is None else self.program(parent[0], uid=parent[1])
                if b"%s" in said:
                    said = said % exe.encode()
                self.assertEqual(self.role(server, exe, uid, start), said)

    def test_a_process_merely_named_like_the_server_or_running_a_users_copy_is_no_server(self):
        for name, uid, mode, dir_uid, dir_mode in [
            ("python3", 0, 0o755, 0, 0o755),
            ("nvidia-cuda-mps-server", 1001, 0o755, 0, 0o755),
            ("nvidia-cuda-mps-server", 0, 0o775, 0, 0o755),
            ("nvidia-cuda-mps-server", 0, 0o757, 0, 0o755),
            # Root's file in a directory a user may write (replaceable).
            ("nvidia-cuda-mps-server", 0, 0o755, 1001, 0o755),
            ("nvidia-cuda-mps-server", 0, 0o755, 0, 0o1777),
        ]:
            with self.subTest(name=name, uid=uid, mode=mode, dir_uid=dir_uid, dir_mode=dir_mode):
                self.tearDown()
                self.setUp()
                server = self.program(name, uid, mode, dir_uid, dir_mode)
                self.assertIsNone(self.role(server, self.program("nvidia-cuda-mps-control")))
        # In /tmp, every user's, as the files of a copy would be.
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            copy = os.path.join(tmp, "nvidia-cuda-mps-server")
            with open(copy, "wb"):
                pass
            os.chmod(copy, 0o755)
            os.chmod(tmp, 0o755)
            self.assertEqual(
                agent["root_file"](copy, "nvidia-cuda-mps-server"),
                "its executable is not a file only root can write (/tmp)",
            )


class Environ(unittest.TestCase):
    """read_environ on files laid out as /proc/PID/environ reads."""

    def read(self, data, size=None):
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            return agent["read_environ"](f.name, size)

    def test_the_first_value_is_read_however_the_chunks_fall(self):
        var = agent["VAR"]
        self.assertEqual(self.read(var + b"a\0B=1\0"), b"a")
        self.assertEqual(self.read(b"A=1\0" + var + b"x\0" + var + b"y\0"), b"x", "the first one")
        self.assertIsNone(self.read(b"A=1\0XGENV_ENVIRONMENT_ID=z\0"), "a longer name is another variable")
        self.assertIsNone(self.read(b""))
        chunk = agent["ENVIRON_CHUNK"]
        for cut in range(-25, 3):
            pad = b"P=" + b"p" * (chunk + cut - 3) + b"\0"
            self.assertEqual(self.read(pad + var + b"eid\0"), b"eid", cut)
            self.assertEqual(self.read(pad[:-1] + b"\0" + var + b"e" * 30), b"e" * 30, "no NUL at the end")

    def test_what_no_program_could_be_started_with_is_hidden_and_bounded(self):
        Hidden = agent["Hidden"]
        var = agent["VAR"]
        with self.assertRaises(Hidden) as caught:
            self.read(var + b"a\0", size=16 << 20)
        self.assertIn("is 16777216 bytes, more than any program can be started with", str(caught.exception))
        big = b"F=" + b"f" * agent["EXEC_MAX"] + b"\0" + var + b"late\0"
        with self.assertRaises(Hidden):
            self.read(big)
        with self.assertRaises(Hidden) as caught:
            self.read(var + b"v" * (agent["VALUE_MAX"] + 1) + b"\0")
        self.assertIn("longer than 4096 bytes", str(caught.exception))
        self.assertEqual(self.read(var + b"v" * agent["VALUE_MAX"] + b"\0"), b"v" * agent["VALUE_MAX"])


class SubUids(unittest.TestCase):
    def owners(self, text, uids, mode=0o644):
        with tempfile.NamedTemporaryFile() as f:
            f.write(text)
            f.flush()
            os.chmod(f.name, mode)
            found = agent["sub_uid_owners"](f.name, list(uids), agent["Names"](agent["time"].monotonic() + 5))
            agent["release"]()
            return found

    def test_a_sub_uid_is_its_ranges_owner_and_overlaps_or_strangers_are_said(self):
        if os.geteuid() != 0:
            self.skipTest("the file must be root's")
        text = b"root:100000:65536\n1234:300000:10\nnobody-here-xyz:400000:10\n1234:500000:10\n77:500005:10\nbad line\n"
        found = self.owners(text, [0, 100001, 300009, 300010, 400001, 500006, 500001, 999999])
        self.assertEqual(found[100001], 0)
        self.assertEqual(found[300009], 1234)
        self.assertTrue(found[300010].startswith("in no sub-uid range of "), "past the range")
        self.assertEqual(found[400001], "in the sub-uid range of nobody-here-xyz, unknown here")
        self.assertEqual(found[500006], "in the sub-uid ranges of 1234, 77")
        self.assertEqual(found[500001], 1234)
        self.assertNotIn(0, found, "a uid with a name is that user")
        self.assertTrue(found[999999].startswith("in no sub-uid range of "))
        # A file others may write is not root's word; none is none.
        self.assertIn("not root's own regular file: not believed", self.owners(text, [100001], mode=0o666)[100001])
        self.assertEqual(agent["sub_uid_owners"]("/nonexistent/subuid", [100001], agent["Names"](agent["time"].monotonic() + 5)),
                         {100001: "in no sub-uid range (there is no /nonexistent/subuid)"})
        # A long range reaches past shorter ones that start after it.
        found = self.owners(b"0:1000000:1000000\n1234:1000010:5\n", [1500000, 1000012])
        self.assertEqual(found, {1500000: 0, 1000012: "in the sub-uid ranges of 0, 1234"})


class StateDir(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = os.path.join(self.tmp.name, "genv")
        os.mkdir(self.dir)
        self.outside = os.path.join(self.tmp.name, "shadow")
        with open(self.outside, "w") as f:
            f.write("root:secret\n")
        os.chmod(self.outside, 0o600)

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.dir, name)

    def refused(self, fn, *args):
        with self.assertRaises(agent["Failure"]) as caught:
            fn(*args)
        return caught.exception.message

    def test_symlinks_fifos_and_huge_files_are_refused(self):
        dfd = agent["open_dir"](self.dir)
        os.symlink(self.outside, self.path("envs.json"))
        self.assertIn("envs.json is a symbolic link: refused", self.refused(agent["read_file"], dfd, self.dir, "envs.json", 100))
        os.unlink(self.path("envs.json"))
        os.mkfifo(self.path("envs.json"))
        self.assertIn("envs.json is a FIFO: refused", self.refused(agent["read_file"], dfd, self.dir, "envs.json", 100))
        os.unlink(self.path("envs.json"))
        import socket

        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.path("envs.json"))
        self.assertIn("envs.json is a socket: refused", self.refused(agent["read_file"], dfd, self.dir, "envs.json", 100))
        listener.close()
        os.unlink(self.path("envs.json"))
        with open(self.path("envs.json"), "wb") as f:
            f.write(b"x" * 101)
        self.assertIn("larger than 100 bytes", self.refused(agent["read_file"], dfd, self.dir, "envs.json", 100))
        self.assertIsNone(agent["read_file"](dfd, self.dir, "devices.json", 100))
        os.symlink(self.outside, self.path("genv.lock"))
        self.assertIn("genv.lock is a symbolic link", self.refused(agent["lock"], dfd, self.dir, fcntl.LOCK_SH, agent["time"].monotonic() + 1))
        with open(self.outside) as f:
            self.assertEqual(f.read(), "root:secret\n")
        self.assertEqual(stat.S_IMODE(os.stat(self.outside).st_mode), 0o600)
        link = os.path.join(self.tmp.name, "link")
        os.symlink(self.dir, link)
        self.assertIn("is a symbolic link", self.refused(agent["open_dir"], link))
        self.assertIsNone(agent["open_dir"](os.path.join(self.tmp.name, "missing")))

    def test_lock_is_created_0666_an_existing_one_keeps_its_mode_and_a_held_one_is_named_not_waited_for(self):
        import subprocess

        dfd = agent["open_dir"](self.dir)
        os.umask(0o022)
        soon = agent["time"].monotonic() + 5
        self.assertIsNone(agent["lock"](dfd, self.dir, fcntl.LOCK_EX, soon))
        self.assertEqual(stat.S_IMODE(os.stat(self.path("genv.lock")).st_mode), 0o666)
        agent["release"]()
        os.chmod(self.path("genv.lock"), 0o600)
        dfd = agent["open_dir"](self.dir)
        self.assertIsNone(agent["lock"](dfd, self.dir, fcntl.LOCK_SH, soon))
        agent["release"]()
        self.assertEqual(stat.S_IMODE(os.stat(self.path("genv.lock")).st_mode), 0o600)
        # A process that holds it (as `flock -s genv.lock sleep inf` would)
        # is named, after LOCK_WAIT at most, and nothing waits longer.
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl,sys,time;f=open(sys.argv[1]);fcntl.flock(f,fcntl.LOCK_SH);print(1,flush=True);time.sleep(60)", self.path("genv.lock")],
            stdout=subprocess.PIPE,
        )
        self.addCleanup(holder.stdout.close)
        self.addCleanup(holder.wait)
        self.addCleanup(holder.kill)
        holder.stdout.readline()
        start = agent["time"].monotonic()
        dfd = agent["open_dir"](self.dir)
        self.assertIsNotNone(agent["FUSE_DEVICES"][0], "the mounts were read by open_dir")
        note = agent["lock"](dfd, self.dir, fcntl.LOCK_EX, start + 30)
        self.assertLess(agent["time"].monotonic() - start, agent["LOCK_WAIT"] + 1)
        self.assertTrue(note.startswith("genv.lock held for over 1s by pid %d (" % holder.pid), note)
        # A FUSE mount made while it waited is seen: the mounts are read again.
        self.assertIsNone(agent["FUSE_DEVICES"][0])
        agent["release"]()
        # A shared lock is shared: a snapshot reads beside the holder,
        # without waiting, and the mounts read stand.
        dfd = agent["open_dir"](self.dir)
        self.assertIsNone(agent["lock"](dfd, self.dir, fcntl.LOCK_SH, start + 30))
        self.assertIsNotNone(agent["FUSE_DEVICES"][0])
        agent["release"]()

    def test_detach_renames_a_new_file_over_and_keeps_everything_else(self):
        devices = {"devices": [
            {"index": 0, "total_memory": "1mi", "attachments": [{"eid": "a\nb", "gpu_memory": None, "time": "t"}, {"eid": "c", "gpu_memory": "1gi", "time": "t"}]},
            {"index": 1, "total_memory": "1mi", "attachments": [{"eid": "a\nb", "gpu_memory": None, "time": "t"}], "future": 1},
        ]}
        with open(self.path("devices.json"), "w") as f:
            json.dump(devices, f)
        # Its owner, group and mode stay (a user's file, 0664).
        owner = (4242, 4343) if os.geteuid() == 0 else (os.getuid(), os.getgid())
        os.chown(self.path("devices.json"), *owner)
        os.chmod(self.path("devices.json"), 0o664)
        before = os.stat(self.path("devices.json")).st_ino
        detached = agent["detach"]({"dir": self.dir, "detach": [[0, "a\nb"], [3, "a\nb"]], "step": 1, "limit": 2, "max_bytes": 1000})
        self.assertEqual(detached, ([True, False], None))
        with open(self.path("devices.json")) as f:
            text = f.read()
        after = json.loads(text)
        self.assertEqual(after["devices"][0]["attachments"], [{"eid": "c", "gpu_memory": "1gi", "time": "t"}])
        self.assertEqual(after["devices"][1]["future"], 1)
        self.assertEqual(text, json.dumps(after, indent=2), "genv's own format")
        self.assertNotEqual(os.stat(self.path("devices.json")).st_ino, before, "a new file, renamed over")
        st = os.stat(self.path("devices.json"))
        self.assertEqual((st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)), owner + (0o664,))
        self.assertEqual(sorted(os.listdir(self.dir)), ["devices.json", "genv.lock"])

    def test_detach_removes_the_env_from_every_entry_of_an_index_listed_twice(self):
        devices = {"devices": [
            {"index": 0, "total_memory": "1mi", "attachments": [{"eid": "x", "gpu_memory": None, "time": "t"}]},
            {"index": 1, "total_memory": "1mi", "attachments": [{"eid": "a", "gpu_memory": None, "time": "t"}]},
            {"index": 0, "total_memory": "1mi", "attachments": [{"eid": "a", "gpu_memory": None, "time": "t"}, {"eid": "b"}]},
            {"index": True, "attachments": [{"eid": "a"}]},
            "junk",
        ]}
        with open(self.path("devices.json"), "w") as f:
            json.dump(devices, f)
        detached = agent["detach"]({"dir": self.dir, "detach": [[0, "a"], [0, "x"], [2, "a"]], "step": 1, "limit": 2, "max_bytes": 10000})
        self.assertEqual(detached, ([True, True, False], None))
        with open(self.path("devices.json")) as f:
            after = json.load(f)["devices"]
        self.assertEqual(after[0]["attachments"], [])
        self.assertEqual(after[1]["attachments"], [{"eid": "a", "gpu_memory": None, "time": "t"}])
        self.assertEqual(after[2]["attachments"], [{"eid": "b"}])
        self.assertEqual(after[3:], [{"index": True, "attachments": [{"eid": "a"}]}, "junk"])

    def test_a_rewrite_stays_within_twice_what_was_read_and_its_cap(self):
        # Arrays nested 120 deep under a key genv does not know: indented
        # as genv writes, they would grow 40-fold.
        deep = 1
        for _ in range(120):
            deep = [deep, deep] if isinstance(deep, int) else [deep]
        junk = [deep] * 1300
        devices = {"devices": [{"index": 0, "attachments": [{"eid": "a"}]}], "x": junk}
        with open(self.path("devices.json"), "w") as f:
            json.dump(devices, f, separators=(",", ":"))
        size = os.path.getsize(self.path("devices.json"))
        start = agent["time"].monotonic()
        detached, _ = agent["detach"]({"dir": self.dir, "detach": [[0, "a"]], "step": 5, "limit": 10, "max_bytes": 64 << 20})
        agent["release"]()
        self.assertEqual(detached, [True])
        self.assertLessEqual(os.path.getsize(self.path("devices.json")), 2 * size + 4096)
        self.assertLess(agent["time"].monotonic() - start, 3)
        with open(self.path("devices.json")) as f:
            after = json.load(f)
        self.assertEqual(after["devices"][0]["attachments"], [])
        self.assertEqual(after["x"], junk)
        # What is written back past the cap fails, naming the file.
        with open(self.path("devices.json"), "w") as f:
            json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}, {"eid": "\u00e9" * 100}]}]}, f, ensure_ascii=False)
        message = self.refused(agent["detach"], {"dir": self.dir, "detach": [[0, "a"]], "step": 1, "limit": 2, "max_bytes": 400})
        agent["release"]()
        self.assertIn("devices.json: written back it would be", message)
        self.assertIn("nothing detached", message)

    def test_a_detach_under_a_lock_a_user_holds_goes_on_and_says_who(self):
        import subprocess

        with open(self.path("devices.json"), "w") as f:
            json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}]}]}, f)
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl,sys,time;f=open(sys.argv[1],'w');fcntl.flock(f,fcntl.LOCK_SH);print(1,flush=True);time.sleep(60)", self.path("genv.lock")],
            stdout=subprocess.PIPE,
        )
        self.addCleanup(holder.stdout.close)
        self.addCleanup(holder.wait)
        self.addCleanup(holder.kill)
        holder.stdout.readline()
        detached, note = agent["detach"]({"dir": self.dir, "detach": [[0, "a"]], "step": 30, "limit": 60, "max_bytes": 1000})
        agent["release"]()
        self.assertEqual(detached, [True])
        self.assertIn("pid %d" % holder.pid, note)

    def meddling(self, meddle):
        """Calls meddle(n) each time the detach has its new content ready
        (n from 1), before it renames it over: what a user may do then."""
        real = agent["rewritten"]
        calls = []

        def rewritten(*args):
            calls.append(1)
            meddle(len(calls))
            return real(*args)

        agent["rewritten"] = rewritten
        self.addCleanup(agent.__setitem__, "rewritten", real)
        return calls

    def test_a_detach_goes_on_whatever_is_done_to_the_files_metadata_meanwhile(self):
        devices = {"devices": [{"index": 0, "attachments": [{"eid": "a"}, {"eid": "b"}]}]}
        with open(self.path("devices.json"), "w") as f:
            json.dump(devices, f)
        copy = self.path("copy")

        def meddle(n):
            # A touch, a chmod and an identical copy renamed over.
            os.utime(self.path("devices.json"), (1, 1))
            os.chmod(self.path("devices.json"), 0o644)
            with open(self.path("devices.json"), "rb") as f, open(copy, "wb") as g:
                g.write(f.read())
            os.rename(copy, self.path("devices.json"))

        calls = self.meddling(meddle)
        detached, _ = agent["detach"]({"dir": self.dir, "detach": [[0, "a"]], "step": 5, "limit": 10, "max_bytes": 1000})
        agent["release"]()
        self.assertEqual(detached, [True])
        self.assertEqual(len(calls), 1, "done at the first try")
        with open(self.path("devices.json")) as f:
            self.assertEqual(json.load(f)["devices"][0]["attachments"], [{"eid": "b"}])

    def test_a_detach_is_done_again_on_content_written_meanwhile_within_the_step(self):
        with open(self.path("devices.json"), "w") as f:
            json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}]}]}, f)

        def meddle(n):
            if n == 1:  # genv attaches c meanwhile
                with open(self.path("devices.json"), "w") as f:
                    json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}, {"eid": "c"}]}]}, f)

        calls = self.meddling(meddle)
        detached, _ = agent["detach"]({"dir": self.dir, "detach": [[0, "a"]], "step": 5, "limit": 10, "max_bytes": 1000})
        agent["release"]()
        self.assertEqual(detached, [True])
        self.assertEqual(len(calls), 2)
        with open(self.path("devices.json")) as f:
            self.assertEqual(json.load(f)["devices"][0]["attachments"], [{"eid": "c"}], "c's write kept, a detached")
        self.assertEqual(sorted(os.listdir(self.dir)), ["devices.json", "genv.lock"], "no temp file left")

    def test_content_changing_through_the_whole_step_fails_the_detach_and_loses_no_write(self):
        with open(self.path("devices.json"), "w") as f:
            json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}]}]}, f)

        def meddle(n):
            with open(self.path("devices.json"), "w") as f:
                json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}, {"eid": "w%d" % n}]}]}, f)

        calls = self.meddling(meddle)
        start = agent["time"].monotonic()
        message = self.refused(agent["detach"], {"dir": self.dir, "detach": [[0, "a"]], "step": 0.3, "limit": 1, "max_bytes": 1000})
        agent["release"]()
        self.assertLess(agent["time"].monotonic() - start, 2)
        self.assertGreater(len(calls), 1)
        self.assertIn("content changed each of the %d times" % len(calls), message)
        with open(self.path("devices.json")) as f:
            after = json.load(f)["devices"][0]["attachments"]
        self.assertEqual(after, [{"eid": "a"}, {"eid": "w%d" % len(calls)}], "the last write stands")
        self.assertEqual(sorted(os.listdir(self.dir)), ["devices.json", "genv.lock"])

    def test_a_detach_of_devices_nested_too_deeply_fails_and_changes_nothing(self):
        text = b'{"devices": ' + b"[" * 200000 + b"]" * 200000 + b"}"
        with open(self.path("devices.json"), "wb") as f:
            f.write(text)
        msg = self.refused(agent["detach"], {"dir": self.dir, "detach": [[0, "a"]], "step": 1, "limit": 2, "max_bytes": 1 << 20})
        self.assertIn("devices.json: cannot parse: nested too deeply", msg)
        with open(self.path("devices.json"), "rb") as f:
            self.assertEqual(f.read(), text)

    def test_a_failed_detach_leaves_no_temp_file(self):
        with open(self.path("devices.json"), "w") as f:
            json.dump({"devices": [{"index": 0, "attachments": [{"eid": "a"}]}]}, f)
        dfd = agent["open_dir"](self.dir)
        os.mkdir(self.path("blocked"))
        open(self.path("blocked/x"), "w").close()
        self.assertIn("cannot replace", self.refused(agent["replace"], dfd, self.dir, "blocked", b"{}"))
        self.assertEqual(sorted(os.listdir(self.dir)), ["blocked", "devices.json"])


class Tools(unittest.TestCase):
    def test_a_tool_is_read_to_the_end_and_reaped(self):
        child = agent["spawn"](["sh", "-c", "echo out; echo err >&2; exit 3"])
        [(status, out, err)] = agent["collect"]([child], agent["time"].monotonic() + 5, 1000)
        self.assertEqual((status, out, err), (3, b"out\n", b"err\n"))
        self.assertEqual(agent["children"], [])

    def test_a_hung_tool_is_killed_with_its_group_at_the_deadline(self):
        start = agent["time"].monotonic()
        child = agent["spawn"](["sh", "-c", "sleep 30 & sleep 30"])
        [(status, _, _)] = agent["collect"]([child], start + 0.3, 1000)
        self.assertIsNone(status)
        self.assertLess(agent["time"].monotonic() - start, 5)
        # The whole group dies (its orphans are reaped by init soon after).
        for _ in range(200):
            try:
                os.killpg(child.pid, 0)
            except ProcessLookupError:
                break
            agent["time"].sleep(0.01)
        else:
            self.fail("the tool's group outlived it")

    def test_genv_bypass_and_no_stdin(self):
        child = agent["spawn"](["sh", "-c", "echo $GENV_BYPASS; cat"])
        [(status, out, _)] = agent["collect"]([child], agent["time"].monotonic() + 5, 1000)
        self.assertEqual((status, out), (0, b"1\n"))


class Doctor(unittest.TestCase):
    def test_facts_about_the_state_dir_tools_and_gpus(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        d = os.path.join(tmp.name, "genv")
        os.mkdir(d, 0o755)
        with open(os.path.join(d, "envs.json"), "w") as f:
            f.write("{}")
        os.symlink("/etc/shadow", os.path.join(d, "devices.json"))
        fake = os.path.join(tmp.name, "nvidia-smi")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\necho '0, 535.1'\necho '1, 535.1'\n")
        os.chmod(fake, 0o755)
        facts = json.loads(agent["doctor"]({"nvidia_smi": [fake], "dir": d, "step": 5}).decode())
        self.assertEqual(facts["nvidia_smi"], {"gpus": 2, "driver": "535.1"})
        self.assertEqual(facts["state"]["kind"], "directory")
        self.assertEqual(facts["state"]["mode"], 0o755)
        self.assertEqual(
            facts["state"]["files"],
            {"envs.json": "regular", "devices.json": "symlink", "genv.lock": "missing"},
        )
        self.assertEqual(facts["python"].split(".")[:2], [str(v) for v in sys.version_info[:2]])
        self.assertLess(abs(facts["time"] - agent["time"].time()), 5)
        self.assertIn("timeout", facts["tools"])
        missing = json.loads(agent["doctor"]({"nvidia_smi": ["/nonexistent/nvidia-smi"], "dir": os.path.join(d, "x"), "step": 5}).decode())
        self.assertIn("cannot run /nonexistent/nvidia-smi", missing["nvidia_smi"]["error"])
        self.assertEqual(missing["state"], {"dir": os.path.join(d, "x"), "kind": "missing"})
        self.assertEqual(agent["children"], [])


class Serve(unittest.TestCase):
    def test_requests_and_answers_over_one_process_as_genv_enforce_starts_it(self):
        import subprocess

        with open(SOURCE, "rb") as f:
            source = f.read()
        boot = "import sys;exec(compile(sys.stdin.buffer.read(%d),'genv-enforce-agent','exec'))" % len(source)
        p = subprocess.Popen([sys.executable, "-I", "-S", "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def ask(request):
            body = json.dumps(request).encode()
            p.stdin.write(b"%d\n" % len(body) + body)
            p.stdin.flush()
            status, length = p.stdout.readline()[1:].split()
            return int(status), p.stdout.read(int(length))

        p.stdin.write(source)
        status, hello = ask({"mode": "hello", "protocol": agent["PROTOCOL"]})
        self.assertEqual(status, 0)
        hello = json.loads(hello)
        self.assertEqual((hello["protocol"], hello["euid"]), (agent["PROTOCOL"], os.geteuid()))
        self.assertEqual(hello["pidfd"], hasattr(os, "pidfd_open"))
        self.assertEqual(ask({"mode": "terminate", "kills": [[2 ** 40, 1]], "signal": "term", "limit": 5}), (0, b'{"kills": [{"pid": 1099511627776, "result": "invalid"}]}'))
        status, body = ask({"mode": "terminate", "kills": [], "limit": 5, "sigterm": True})
        self.assertEqual(status, 1)
        self.assertEqual(json.loads(body)["fail"], "request")
        self.assertIn("unknown keys ['sigterm']", json.loads(body)["message"])
        fds = len(os.listdir("/proc/%d/fd" % p.pid))
        # Requests that take genv's lock, succeed or fail, leave nothing
        # held: no fd, no lock, no child (the agent stays between cycles).
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "devices.json"), "w") as f:
                json.dump({"devices": [{"index": 0, "attachments": [{"eid": "e"}]}]}, f)
            smi = os.path.join(d, "smi")
            with open(smi, "w") as f:
                f.write("#!/bin/sh\nsleep 30\n")
            os.chmod(smi, 0o755)
            for request in (
                {"mode": "detach", "dir": d, "detach": [[0, "e"]], "step": 1, "limit": 5, "max_bytes": 1000},
                {"mode": "detach", "dir": d, "detach": [[0, "e"]], "step": 1, "limit": 5, "max_bytes": 10},
                {"mode": "snapshot", "dir": d, "nvidia_smi": [smi], "step": 0.3, "limit": 5, "max_bytes": 1000},
            ):
                ask(request)
            os.mkfifo(os.path.join(d, "envs.json"))
            # A refused state file fails no snapshot: it is said in a frame.
            quick = os.path.join(d, "quick")
            with open(quick, "w") as f:
                f.write("#!/bin/sh\nexit 0\n")
            os.chmod(quick, 0o755)
            status, body = ask({"mode": "snapshot", "dir": d, "nvidia_smi": [quick], "step": 1, "limit": 5, "max_bytes": 1000})
            self.assertEqual(status, 0, body)
            self.assertIn(b"@state-error envs ", body)
            self.assertIn(b"envs.json is a FIFO: refused", body)
            self.assertEqual(len(os.listdir("/proc/%d/fd" % p.pid)), fds, "an fd outlived its request")
            lock = os.open(os.path.join(d, "genv.lock"), os.O_RDONLY)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nobody holds genv's lock
            os.close(lock)
            with open("/proc/%d/task/%d/children" % (p.pid, p.pid)) as f:
                self.assertEqual(f.read().split(), [], "a tool outlived its request")
        status, body = ask({"mode": "snapshot", "dir": "/nonexistent", "nvidia_smi": ["/nonexistent/nvidia-smi"], "step": 1, "limit": 5, "max_bytes": 100})
        self.assertEqual((status, json.loads(body)["fail"]), (1, "nvidia-smi"), body)
        with tempfile.TemporaryDirectory() as d:
            status, body = ask({"mode": "detach", "dir": d, "detach": [[0, "e"]], "step": 1, "limit": 5, "max_bytes": 100})
        self.assertEqual((status, body), (0, b'{"detached": [false]}'))
        p.stdin.close()
        self.assertEqual(p.wait(5), 0, p.stderr.read())
        p.stdout.close()
        p.stderr.close()


class Watchdog(unittest.TestCase):
    def test_a_request_stuck_where_no_signal_handler_runs_is_killed_past_its_limit(self):
        import subprocess

        with open(SOURCE, "rb") as f:
            source = f.read()
        # A request whose main thread cannot run the SIGALRM handler (a read
        # stuck in the kernel looks so): the watchdog's SIGKILL ends it.
        stuck = source.replace(
            b"\nif __name__ == \"__main__\":",
            b"\ndef handle(req):\n    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n    time.sleep(60)\n"
            b"\nif __name__ == \"__main__\":",
        )
        boot = "import sys;exec(compile(sys.stdin.buffer.read(%d),'genv-enforce-agent','exec'))" % len(stuck)
        p = subprocess.Popen([sys.executable, "-I", "-S", "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        body = json.dumps({"mode": "hello", "protocol": agent["PROTOCOL"], "limit": 0.3}).encode()
        start = agent["time"].monotonic()
        p.stdin.write(stuck + b"%d\n" % len(body) + body)
        p.stdin.flush()
        status = p.wait(30)
        took = agent["time"].monotonic() - start
        p.stdin.close()
        p.stdout.close()
        err = p.stderr.read()
        p.stderr.close()
        self.assertEqual(status, -9, err)
        self.assertIn(b"stuck past its time limit: killed", err)
        self.assertLess(took, 0.3 + agent["KILL_GRACE"] + 3)


class Terminate(unittest.TestCase):
    def test_nothing_is_signalled_without_a_matching_start_time(self):
        import subprocess

        p = subprocess.Popen(["sleep", "100"])
        try:
            start = agent["start_time"](agent["proc_read"](p.pid, "stat"))
            kills = []
            agent["terminate"]({"kills": [[p.pid, start + 1], ["x", 1], [p.pid], [2 ** 40, 1]]}, kills)
            self.assertEqual(kills, [
                {"pid": p.pid, "result": "reused", "found": start},
                {"pid": None, "result": "invalid"},
                {"pid": p.pid, "result": "invalid"},
                {"pid": 2 ** 40, "result": "invalid"},
            ])
            self.assertIsNone(p.poll())
            agent["terminate"]({"kills": [[p.pid, start]]}, kills)
            self.assertEqual(kills[-1], {"pid": p.pid, "result": "signalled"})
            self.assertEqual(p.wait(5), -15)
            kills = []
            agent["terminate"]({"kills": [[p.pid, start]]}, kills)
            self.assertEqual(kills, [{"pid": p.pid, "result": "gone"}])
        finally:
            p.kill()
            p.wait()


    def test_a_process_whose_leader_exited_is_signalled_while_any_thread_is_listed(self):
        import subprocess

        p = subprocess.Popen(["sleep", "100"])
        saved = agent["proc_read"], agent["threads"]
        try:
            start = agent["start_time"](agent["proc_read"](p.pid, "stat"))
            zombie = b"%d (job) Z 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0\n" % (p.pid, start)
            agent["proc_read"] = lambda pid, name, tid=None: zombie
            # No other thread left: a zombie, not signalled.
            agent["threads"] = lambda pid: (None, False)
            kills = []
            agent["terminate"]({"kills": [[p.pid, start]]}, kills)
            self.assertEqual(kills, [{"pid": p.pid, "result": "gone"}])
            self.assertIsNone(p.poll())
            # Threads listed, none of the first ones looked at live (kept
            # as zombies ahead of the live one): signalled as a whole.
            agent["threads"] = lambda pid: (None, True)
            agent["terminate"]({"kills": [[p.pid, start]]}, kills)
            self.assertEqual(kills[-1], {"pid": p.pid, "result": "signalled"})
            self.assertEqual(p.wait(5), -15)
        finally:
            agent["proc_read"], agent["threads"] = saved
            p.kill()
            p.wait()


class Tell(unittest.TestCase):
    """Messages on a user's terminals: only theirs, only as text. Needs
    root (a job of another user, its pty given to them)."""

    def setUp(self):
        import pwd
        import time

        self.assertEqual(os.geteuid(), 0, "these tests need root")
        who = pwd.getpwnam("nobody")
        self.user = who.pw_name
        self.master, slave = os.openpty()
        self.tty = os.ttyname(slave)
        os.chown(self.tty, who.pw_uid, -1)
        self.pid = os.fork()
        if self.pid == 0:
            # A job of nobody's whose controlling terminal is the pty.
            os.close(slave)
            os.setsid()
            os.setgid(who.pw_gid)
            os.setuid(who.pw_uid)
            os.open(self.tty, os.O_RDWR)
            time.sleep(30)
            os._exit(0)
        os.close(slave)
        for _ in range(200):
            stat_now = agent["proc_read"](self.pid, "stat")
            if int(stat_now[stat_now.rfind(b")") + 1 :].split()[4]) != 0:
                break
            time.sleep(0.01)
        self.start = agent["start_time"](agent["proc_read"](self.pid, "stat"))

    def tearDown(self):
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        os.close(self.master)
        agent["finish"]()

    def told(self, notes, utmp="/nonexistent/utmp"):
        status, body = agent["answer"]({"mode": "tell", "notes": notes, "utmp": utmp, "limit": 5, "proc": "/proc"})
        agent["finish"]()
        self.assertEqual(status, 0, body)
        return json.loads(body)["told"]

    def seen(self):
        import select

        out = b""
        while select.select([self.master], [], [], 0.2)[0]:
            out += os.read(self.master, 65536)
        return out

    def test_the_jobs_terminal_gets_printable_ascii_only(self):
        text = "*** genv-enforce: gpu1\n\x1b[2Jgone \x9b1m \u202e \u00db2J ok\t."
        self.assertEqual(self.told([{"user": self.user, "pids": [[self.pid, self.start]], "text": text}]), [1])
        out = self.seen()
        self.assertIn(b"*** genv-enforce: gpu1\r", out)
        self.assertIn(b"?[2Jgone ?1m ? ?2J ok\t.", out)
        self.assertFalse([b for b in out if b >= 0x7F or (b < 0x20 and b not in b"\r\n\t")], out)

    def test_nothing_is_written_for_a_reused_pid_another_user_root_or_an_unknown_one(self):
        notes = [
            {"user": self.user, "pids": [[self.pid, self.start + 1]], "text": "reused"},
            {"user": "daemon", "pids": [[self.pid, self.start]], "text": "not daemon's"},
            {"user": "root", "pids": [[self.pid, self.start]], "text": "never root's"},
            {"user": "no-such-user-here", "pids": [[self.pid, self.start]], "text": "nobody"},
            {"user": self.user, "pids": [[0, 0], ["1", 2], [self.pid]], "text": "bad pairs"},
        ]
        self.assertEqual(self.told(notes), [0, 0, 0, 0, 0])
        self.assertEqual(self.seen(), b"")

    def test_too_many_notes_are_refused(self):
        notes = [{"user": self.user, "pids": [], "text": "x"}] * (agent["MAX_NOTES"] + 1)
        status, body = agent["answer"]({"mode": "tell", "notes": notes, "utmp": "/x", "limit": 5, "proc": "/proc"})
        self.assertEqual((status, json.loads(body)["fail"]), (1, "request"))

    def test_login_terminals_come_from_utmp_and_only_as_dev_names(self):
        def record(kind, line, user):
            r = bytearray(agent["UTMP_RECORD"])
            r[0:2] = kind.to_bytes(2, sys.byteorder)
            r[8 : 8 + len(line)] = line
            r[44 : 44 + len(user)] = user
            return bytes(r)

        line = self.tty[len("/dev/") :].encode()
        me = self.user.encode()
        with tempfile.NamedTemporaryFile() as utmp:
            utmp.write(record(7, line, me) + record(7, b"../etc/passwd", me) + record(8, line, b"x")
                       + record(7, b"tty0", me) + record(7, b"tty7", b"other") + b"short")
            utmp.flush()
            self.assertEqual(agent["login_terminals"](utmp.name), {self.user: [self.tty], "other": ["/dev/tty7"]})
            self.assertEqual(self.told([{"user": self.user, "pids": [], "text": "hi"}], utmp.name), [1])
            # Both ways to one terminal: written once.
            self.assertEqual(self.told([{"user": self.user, "pids": [[self.pid, self.start]], "text": "x"}], utmp.name), [1])
        self.assertEqual(self.seen(), b"hix")

    def test_a_terminal_the_user_does_not_own_is_not_written(self):
        os.chown(self.tty, 12345, -1)
        self.assertEqual(self.told([{"user": self.user, "pids": [[self.pid, self.start]], "text": "x"}]), [0])

    def test_ptys_and_consoles_are_named_by_their_device_numbers(self):
        self.assertEqual(agent["terminal_path"](os.makedev(136, 70000)), "/dev/pts/70000")
        self.assertEqual(agent["terminal_path"](os.makedev(4, 3)), "/dev/tty3")
        for other in (os.makedev(4, 0), os.makedev(4, 64), os.makedev(5, 1), os.makedev(137, 1)):
            self.assertIsNone(agent["terminal_path"](other))

    def test_groups_are_said_for_the_named_groups_a_user_is_in(self):
        import grp
        import pwd
        import time

        root = pwd.getpwuid(0)
        primary = grp.getgrgid(root.pw_gid).gr_name
        later = time.monotonic() + 5
        names = agent["Names"]
        found = agent["memberships"]([primary, "no-such-group-here", 7], [0, 2**31 - 7], names(later))
        self.assertEqual(found, [(0, [primary])])
        self.assertEqual(agent["memberships"]([primary], [0], names(time.monotonic() - 1)), [])
        self.assertEqual(agent["memberships"]([], [0], names(later)), [])


class Names(unittest.TestCase):
    """Point 8 of issue 42: the name service (NSS, which may be LDAP) is
    asked within the request's deadline and a bounded number of times."""

    FAKE = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "fake-nvidia-smi")

    def test_a_hung_lookup_costs_the_deadline_then_nothing_more_is_asked(self):
        import time

        names = agent["Names"](time.monotonic() + 0.3)
        self.assertEqual(names.ask("a", lambda: 1), 1)
        self.assertIsNone(names.ask("none", lambda: {}["missing"]), "no such entry")
        start = time.monotonic()
        with self.assertRaises(agent["Late"]) as late:
            names.ask("slow", lambda: time.sleep(3))
        self.assertLess(time.monotonic() - start, 1)
        self.assertIn("did not answer within the step", late.exception.why)
        asked = []
        with self.assertRaises(agent["Late"]):
            names.ask("next", lambda: asked.append(1))
        self.assertEqual(asked, [], "nothing asked once one was late")
        self.assertEqual(names.ask("a", lambda: 2), 1, "what was answered stays")

    def test_lookups_are_bounded_in_number_per_request(self):
        import time

        saved = agent["MAX_LOOKUPS"]
        agent["MAX_LOOKUPS"] = 3
        self.addCleanup(agent.__setitem__, "MAX_LOOKUPS", saved)
        names = agent["Names"](time.monotonic() + 5)
        for key in range(3):
            self.assertEqual(names.ask(key, lambda: key), key)
        self.assertEqual(names.ask(0, lambda: 9), 0, "each key asked once")
        with self.assertRaises(agent["Late"]) as late:
            names.ask(3, lambda: 3)
        self.assertIn("more than 3 name lookups", late.exception.why)

    def told(self, gpu_uids, listed_uids, subuid, limit):
        import time

        saved = agent["MAX_LOOKUPS"]
        agent["MAX_LOOKUPS"] = limit
        self.addCleanup(agent.__setitem__, "MAX_LOOKUPS", saved)
        out = []
        req = {"subuid": subuid, "groups": ["root"]}
        agent["tell_names"](out, req, set(gpu_uids), set(listed_uids), agent["Names"](time.monotonic() + 5))
        agent["release"]()
        text, said = b"".join(out), {}
        while text:
            head, rest = text.split(b"\n", 1)
            words = head.decode().split()
            n = int(words[-1])
            said[(words[0][1:], int(words[1]))] = rest[:n].decode()
            text = rest[n:]
        return said

    def test_the_owners_of_gpu_processes_are_looked_up_outside_the_count(self):
        """Review of stop 48, finding 1: pids a user lists in a record must
        not spend the lookups that decide whose a GPU job is."""
        if os.geteuid() != 0:
            self.fail("the sub-uid file must be root's: run as root")
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"root:300000:100\n")
            f.flush()
            os.chmod(f.name, 0o644)
            said = self.told([300001], range(400000, 400004), f.name, 2)
            self.assertEqual(said[("subuid", 300001)], "0", "a GPU job's range owner, whatever was listed")
            self.assertEqual(said[("user", 0)], "root")
            self.assertEqual(said[("groups", 0)], "root", "a GPU job's owner's groups")
            for uid in (400000, 400001):
                self.assertTrue(said[("subuid", uid)].startswith("- in no sub-uid range of "))
            for uid in (400002, 400003):
                self.assertIn("more than 2 name lookups", said[("unnamed", uid)])
            # A listed sub-uid whose range owner is not looked up is unnamed,
            # never a user of its own.
            # A uid whose groups were not looked up is unnamed: no group
            # exemption lost, no group cap escaped (review, finding 5).
            said = self.told([], [0], f.name, 1)
            self.assertEqual(said[("user", 0)], "root")
            self.assertNotIn(("groups", 0), said)
            self.assertEqual(said[("unnamed", 0)],
                             "its groups were not looked up: more than 1 name lookups in one request")
            said = self.told([], [300002], f.name, 1)
            self.assertNotIn(("subuid", 300002), said)
            self.assertEqual(said[("unnamed", 300002)],
                             "in the sub-uid range of root, not looked up: more than 1 name lookups in one request")

    def test_a_snapshot_with_a_hung_name_service_answers_in_its_step_saying_who_is_unnamed(self):
        import pwd
        import time

        real = pwd.getpwuid

        def hung(uid):
            time.sleep(3)
            return real(uid)

        with tempfile.TemporaryDirectory() as d:
            gpu = os.path.join(d, "gpu")
            os.mkdir(gpu)
            with open(os.path.join(gpu, "gpus.csv"), "w") as f:
                f.write("index, uuid, memory.total\n0, GPU-a, 81559\n")
            with open(os.path.join(gpu, "apps.csv"), "w") as f:
                f.write("gpu_uuid, pid, used_gpu_memory\nGPU-a, %d, 100\n" % os.getpid())
            os.environ["FAKE_GPU_DIR"] = gpu
            req = {"mode": "snapshot", "dir": os.path.join(d, "genv"), "nvidia_smi": ["sh", self.FAKE],
                   "step": 1.5, "limit": 20, "max_bytes": 100000, "groups": ["root"]}
            pwd.getpwuid = hung
            try:
                start = time.monotonic()
                kinds = Utilization.frames(self, req)
                took = time.monotonic() - start
            finally:
                pwd.getpwuid = real
            agent["release"]()
        self.assertLess(took, 2.5, "within the step, not the name service's time")
        self.assertEqual([w for w, _ in kinds["proc"]], [[str(os.getpid())]])
        self.assertNotIn("user", kinds)
        self.assertNotIn("groups", kinds)
        self.assertEqual(kinds["unnamed"], [([str(os.getuid())], b"the name service did not answer within the step")])


class Utilization(unittest.TestCase):
    """The idle rule's snapshot: pmon and the GPUs' utilization beside the
    rest, through the fake nvidia-smi the fleet tests use."""

    FAKE = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "fake-nvidia-smi")

    def frames(self, req):
        out = []
        agent["snapshot"](req, out)
        text = b"".join(out)
        kinds = {}
        while text:
            head, rest = text.split(b"\n", 1)
            words = head.decode().split()
            n = int(words[-1])
            kinds.setdefault(words[0][1:], []).append((words[1:-1], rest[:n]))
            text = rest[n:]
        return kinds

    def test_the_clock_comes_from_btime_or_is_not_said(self):
        saved = agent["PROC"][0]
        try:
            with tempfile.TemporaryDirectory() as d:
                agent["PROC"][0] = d
                self.assertIsNone(agent["clock"]())
                with open(os.path.join(d, "stat"), "wb") as f:
                    f.write(b"cpu  1 2 3\nbtime x\n")
                self.assertIsNone(agent["clock"]())
                with open(os.path.join(d, "stat"), "wb") as f:
                    f.write(b"cpu  1 2 3\nbtime 1795420800\nprocesses 9\n")
                self.assertEqual(agent["clock"](), b"1795420800 %d" % os.sysconf("SC_CLK_TCK"))
        finally:
            agent["PROC"][0] = saved

    def test_pmon_and_utilization_are_framed_when_asked_and_pmon_may_fail(self):
        with tempfile.TemporaryDirectory() as d:
            gpu = os.path.join(d, "gpu")
            os.mkdir(gpu)
            with open(os.path.join(gpu, "gpus.csv"), "w") as f:
                f.write("index, uuid, memory.total, utilization.gpu\n0, GPU-a, 81559, 7\n1, GPU-b, 81559, 0\n")
            pmon = "# gpu pid type sm mem command\n# Idx # C/G % % name\n    0  4242  C  3  1  python3\n"
            with open(os.path.join(gpu, "pmon.txt"), "w") as f:
                f.write(pmon)
            os.environ["FAKE_GPU_DIR"] = gpu
            req = {"mode": "snapshot", "dir": os.path.join(d, "genv"), "nvidia_smi": ["sh", self.FAKE],
                   "step": 10, "limit": 20, "max_bytes": 100000, "utilization": True}
            kinds = self.frames(req)
            self.assertEqual(kinds["pmon"], [([], pmon.encode())])
            self.assertEqual(kinds["utilization"], [([], b"0, 7\n1, 0\n")])
            btime, hz = kinds["clock"][0][1].split()
            self.assertGreater(int(btime), 1500000000)
            self.assertGreater(int(hz), 0)
            os.unlink(os.path.join(gpu, "pmon.txt"))
            kinds = self.frames(req)
            self.assertNotIn("pmon", kinds, "a failed pmon says nothing: no process's figure is known")
            self.assertIn("utilization", kinds)
            kinds = self.frames(dict(req, utilization=False))
            self.assertNotIn("pmon", kinds)
            self.assertNotIn("utilization", kinds)
            self.assertEqual(agent["children"], [])


class Fence(unittest.TestCase):
    """The highest epoch a host has seen, and the requests it refuses."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = os.path.join(self.tmp.name, "fence")

    def tearDown(self):
        agent["finish"]()
        self.tmp.cleanup()

    def ask(self, req):
        try:
            status, body = agent["answer"](req)
        finally:
            agent["finish"]()
        return status, json.loads(body)

    def kill(self, pid, start, epoch):
        return self.ask({"mode": "terminate", "kills": [[pid, start]], "signal": "term", "limit": 5,
                         "proc": "/proc", "fence": {"epoch": epoch, "dir": self.dir}})

    def epoch(self):
        with open(os.path.join(self.dir, "epoch")) as f:
            return int(f.read())

    def test_an_older_epoch_is_refused_before_anything_is_done_and_a_newer_one_kept(self):
        import subprocess

        p = subprocess.Popen(["sleep", "100"])
        try:
            start = agent["start_time"](agent["proc_read"](p.pid, "stat"))
            status, body = self.kill(p.pid, start + 1, 7)
            self.assertEqual((status, body["kills"][0]["result"]), (0, "reused"))
            self.assertEqual(self.epoch(), 7)
            st = os.stat(self.dir)
            self.assertEqual((stat.S_IMODE(st.st_mode), st.st_uid), (0o700, os.geteuid()))
            self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.dir, "epoch")).st_mode), 0o600)
            status, body = self.kill(p.pid, start, 6)
            self.assertEqual(status, 1)
            self.assertEqual(body["fail"], "fenced")
            self.assertIn("epoch 6 is older than epoch 7", body["message"])
            self.assertEqual(body["kills"], [])
            self.assertIsNone(p.poll())
            # A snapshot is refused the same way; the same epoch acts.
            status, body = self.ask({"mode": "snapshot", "dir": self.tmp.name, "nvidia_smi": ["/nonexistent"],
                                     "step": 1, "limit": 5, "max_bytes": 100,
                                     "fence": {"epoch": 5, "dir": self.dir}})
            self.assertEqual((status, body["fail"]), (1, "fenced"))
            status, body = self.kill(p.pid, start, 7)
            self.assertEqual((status, body["kills"][0]["result"]), (0, "signalled"))
            self.assertEqual(p.wait(5), -15)
            self.kill(p.pid, start, 9)
            self.assertEqual(self.epoch(), 9)
        finally:
            p.kill()
            p.wait()

    def test_a_detach_with_an_older_epoch_changes_nothing(self):
        state = os.path.join(self.tmp.name, "genv")
        os.mkdir(state)
        devices = {"devices": [{"index": 0, "attachments": [{"eid": "a", "time": 1.0}]}]}
        with open(os.path.join(state, "devices.json"), "w") as f:
            json.dump(devices, f)
        req = {"mode": "detach", "dir": state, "detach": [[0, "a"]], "step": 1, "limit": 5, "max_bytes": 1000}
        self.ask(dict(req, fence={"epoch": 3, "dir": self.dir}, detach=[]))
        status, body = self.ask(dict(req, fence={"epoch": 2, "dir": self.dir}))
        self.assertEqual((status, body["fail"]), (1, "fenced"))
        with open(os.path.join(state, "devices.json")) as f:
            self.assertEqual(json.load(f), devices)
        status, body = self.ask(dict(req, fence={"epoch": 3, "dir": self.dir}))
        self.assertEqual((status, body), (0, {"detached": [True]}))

    def refused(self, req_epoch=5):
        status, body = self.kill(1, 1, req_epoch)
        self.assertEqual(status, 1)
        return body

    def test_a_linked_shared_or_foreign_fence_is_refused(self):
        os.mkdir(os.path.join(self.tmp.name, "elsewhere"), 0o700)
        os.symlink(os.path.join(self.tmp.name, "elsewhere"), self.dir)
        self.assertIn("a symbolic link: refused", self.refused()["message"])
        os.unlink(self.dir)
        os.mkdir(self.dir, 0o755)
        os.chmod(self.dir, 0o755)
        self.assertIn("not a directory of uid", self.refused()["message"])
        os.chmod(self.dir, 0o700)
        os.symlink(os.path.join(self.tmp.name, "elsewhere", "x"), os.path.join(self.dir, "epoch"))
        self.assertIn("a symbolic link: refused", self.refused()["message"])
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "elsewhere", "x")))
        os.unlink(os.path.join(self.dir, "epoch"))
        with open(os.path.join(self.dir, "epoch"), "w") as f:
            f.write("nine\n")
        self.assertIn("does not hold an epoch", self.refused()["message"])
        facts = agent["fence_facts"](self.dir)
        self.assertEqual((facts["epoch"], facts["problem"]), (None, self.dir + "/epoch does not hold an epoch"))
        os.link(os.path.join(self.dir, "epoch"), os.path.join(self.tmp.name, "hard"))
        self.assertIn("not a regular file of uid", self.refused()["message"])
        self.assertEqual(self.refused()["fail"], "fence")
        for bad in ({"epoch": 0, "dir": self.dir}, {"epoch": 1, "dir": "run"}, {"epoch": "1", "dir": self.dir},
                    {"epoch": 1, "dir": self.dir, "x": 1}, [1]):
            status, body = self.ask({"mode": "terminate", "kills": [], "signal": "term", "limit": 5, "fence": bad})
            self.assertEqual((status, body["fail"]), (1, "request"), bad)

    def test_a_locked_epoch_file_is_waited_for_until_the_deadline(self):
        import time

        dfd = agent["fence_dir"](self.dir)
        fd, seen = agent["fence_file"](dfd, self.dir, time.monotonic() + 1)
        self.assertEqual(seen, 0)
        other = os.open(os.path.join(self.dir, "epoch"), os.O_RDONLY)
        try:
            with self.assertRaises(agent["Failure"]) as caught:
                agent["fence_file"](agent["fence_dir"](self.dir), self.dir, time.monotonic() + 0.2)
            self.assertIn("stayed locked by another agent", caught.exception.message)
        finally:
            os.close(other)
        agent["finish"]()
        self.assertEqual(agent["fence_facts"](self.dir), {"dir": self.dir, "kind": "directory", "epoch": None, "problem": None})
        self.assertEqual(agent["fence_facts"](self.dir + "x")["kind"], "missing")


class Golden(unittest.TestCase):
    """fixtures/agent/: the protocol by example, also read by the Rust tests."""

    DIR = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "agent")

    def load(self, name):
        with open(os.path.join(self.DIR, name)) as f:
            return json.load(f)

    def test_every_request_is_accepted_as_written(self):
        for mode in ("hello", "snapshot", "terminate", "detach", "doctor", "tell"):
            req = self.load(mode + ".request.json")
            self.assertEqual(req["mode"], mode)
            agent["check"](req)
            self.assertEqual(set(req), agent["KEYS"][mode], mode)
            extra = dict(req, extra=1)
            with self.assertRaises(agent["Failure"]):
                agent["check"](extra)

    def test_answers_carry_exactly_the_golden_keys(self):
        hello = json.loads(agent["answer"](self.load("hello.request.json"))[1])
        self.assertEqual(set(hello), set(self.load("hello.answer.json")))
        self.assertEqual(hello["protocol"], self.load("hello.answer.json")["protocol"])
        kills = self.load("terminate.answer.json")["kills"]
        self.assertEqual(set(kills[0]), {"pid", "result"})
        self.assertEqual(set(kills[2]), {"pid", "result", "found"})
        with tempfile.TemporaryDirectory() as d:
            fenced = {"epoch": 41, "dir": os.path.join(d, "fence")}
            req = dict(self.load("detach.request.json"), dir=d, fence=fenced)
            status, body = agent["answer"](req)
            agent["finish"]()  # genv's lock, released as handle() does
            self.assertEqual(status, 0)
            self.assertEqual(set(json.loads(body)), set(self.load("detach.answer.json")))
            os.mkfifo(os.path.join(d, "devices.json"))
            status, body = agent["answer"](req)
            agent["finish"]()
            self.assertEqual(status, 1)
            self.assertEqual(set(json.loads(body)), set(self.load("failure.answer.json")))
            req = dict(self.load("doctor.request.json"), dir=d, nvidia_smi=["/nonexistent/nvidia-smi"],
                       fence_dir=fenced["dir"])
            facts = json.loads(agent["answer"](req)[1])
            told = json.loads(agent["answer"](dict(self.load("tell.request.json"), utmp=d))[1])
            self.assertEqual(set(told), set(self.load("tell.answer.json")))
            golden = self.load("doctor.answer.json")
            self.assertEqual(set(facts), set(golden))
            self.assertEqual(set(facts["state"]), set(golden["state"]))
            self.assertEqual(set(facts["state"]["files"]), set(golden["state"]["files"]))
            self.assertEqual(facts["fence"], dict(golden["fence"], dir=fenced["dir"]))
            status, body = agent["answer"](dict(self.load("terminate.request.json"), fence=dict(fenced, epoch=40)))
            agent["finish"]()
            self.assertEqual(status, 1)
            self.assertEqual(json.loads(body), self.load("fenced.answer.json"))
        # The snapshot's frames, as the golden answer holds them.
        with open(os.path.join(self.DIR, "snapshot.answer"), "rb") as f:
            text = f.read()
        kinds = []
        while text:
            head, rest = text.split(b"\n", 1)
            words = head.decode().split()
            kinds.append(words[0])
            text = rest[int(words[-1]):]
        self.assertEqual(
            kinds,
            ["@pmon", "@gpus", "@apps", "@utilization", "@envs", "@devices", "@lock", "@proc", "@proc", "@proc", "@proc",
             "@subuid", "@subuid", "@user", "@user", "@clock", "@groups"],
        )


if __name__ == "__main__":
    unittest.main()
