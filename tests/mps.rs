//! CUDA MPS end to end on the sshd fleet (`scripts/fleet`): a host with a
//! fake MPS setup as the driver makes it (root's control daemon, a root
//! process running the driver's root-owned `nvidia-cuda-mps-control` file,
//! starts the server from the root-owned `nvidia-cuda-mps-server` file as
//! the first client's user), the fake nvidia-smi listing the server as a
//! `C` process and the client as `M+C` with the client's work on the
//! server's pmon line, and real processes of real users really signalled.
//! Needs root (CI runs as root).

mod util;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use util::fleet::Fleet;
use util::{ensure_user, env, lines, uuid};

const SIGTERM: i32 = 15;
const WAIT: Duration = Duration::from_secs(10);

/// Copies `from` to `to` as a program of `uid` (mode 0755).
fn program(from: &str, to: &Path, uid: u32) {
    std::fs::copy(from, to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(to, Some(uid), Some(0)).unwrap();
}

/// A directory of `uid` that everyone may enter.
fn dir_of(path: &Path, uid: u32) {
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(path, Some(uid), Some(0)).unwrap();
}

/// The pid a file will hold, once written.
fn wait_for_pid(path: &Path) -> u32 {
    let start = Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            return pid;
        }
        assert!(start.elapsed() < WAIT, "no pid in {}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `gpus.csv` with each GPU's `utilization.gpu`.
fn set_gpus(h: &util::Host, percents: &[u32]) {
    let mut table = String::from("index, uuid, memory.total, utilization.gpu\n");
    for (i, pct) in percents.iter().enumerate() {
        table.push_str(&format!("{i}, {}, 143771, {pct}\n", uuid(i as u32)));
    }
    std::fs::write(h.gpu_dir().join("gpus.csv"), table).unwrap();
}

/// `apps.csv` with each process's type and SM figure, from which the
/// fake nvidia-smi prints pmon's table: (pid, gpu, MiB, type, sm, name).
fn set_apps(h: &util::Host, apps: &[(u32, u32, u32, &str, &str, &str)]) {
    let mut table = String::from("gpu_uuid, pid, used_gpu_memory, type, sm, name\n");
    for (pid, gpu, mib, kind, sm, name) in apps {
        table.push_str(&format!(
            "{}, {pid}, {mib}, {kind}, {sm}, {name}\n",
            uuid(*gpu)
        ));
    }
    std::fs::write(h.gpu_dir().join("apps.csv"), table).unwrap();
}

#[test]
fn the_shared_mps_server_is_never_terminated_and_each_client_is_judged_by_its_own_work() {
    let Some(mut f) = Fleet::up(1) else { return };
    let (alice, _) = ensure_user("alice");
    let (bob, _) = ensure_user("bob");
    // The driver's programs, root's files (copies of sh and sleep) in
    // root's directories, where every user may run them.
    let driver_dir = util::driver_dir();
    let driver = driver_dir.path();
    let control = driver.join("nvidia-cuda-mps-control");
    let server = driver.join("nvidia-cuda-mps-server");
    program("/bin/sh", &control, 0);
    program("/bin/sleep", &server, 0);
    // Bob's copy of the server file, his own (the fleet's directory is
    // root's alone: he may enter it to run it).
    std::fs::set_permissions(f.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let h1 = f.dir.path().join("h1");
    let bobs = h1.join("bob");
    dir_of(&bobs, bob);
    let copy = bobs.join("nvidia-cuda-mps-server");
    program("/bin/sleep", &copy, bob);

    // Root's control daemon starts the server as alice, its first client's
    // user, and waits for it (so it lives exactly as long as the server).
    let pid_file = h1.join("mps-server.pid");
    let script = format!(
        "setpriv --reuid={alice} --regid={alice} --clear-groups {} 1000 & echo $! > {}; wait",
        server.display(),
        pid_file.display()
    );
    let daemon = f
        .host(0)
        .start("root", None, &[control.to_str().unwrap(), "-c", &script]);
    let mps_server = wait_for_pid(&pid_file);
    // Alice's client in her environment; bob's copy named like the server;
    // bob running the driver's server file himself (his own MPS).
    let client = f.host(0).spawn_as("alice", Some("ea"));
    let named = f
        .host(0)
        .start("bob", None, &[copy.to_str().unwrap(), "1000"]);
    let own = f
        .host(0)
        .start("bob", None, &[server.to_str().unwrap(), "1000"]);
    let h = f.host(0);
    h.write_envs(&[env("ea", Some("alice"), None, client)]);
    h.write_devices(4, &[(0, "ea")]);
    // The client computes: its work is on the server's line.
    set_gpus(h, &[100, 0, 0, 0]);
    set_apps(
        h,
        &[
            (client, 0, 1540, "M+C", "-", "python3"),
            (mps_server, 0, 66, "C", "99", "nvidia-cuda-mps-server"),
            (named, 1, 100, "C", "-", "nvidia-cuda-mps-server"),
            (own, 2, 100, "C", "-", "nvidia-cuda-mps-server"),
        ],
    );

    let run = |f: &Fleet| {
        f.ours(&[
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
            "--idle-after",
            "0s",
        ])
    };
    let out = run(&f);
    let (stdout, stderr) = (lines(&out).join("\n"), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Outside genv and busy or not, the shared server is never judged.
    assert!(
        !stdout.contains(&format!("process {mps_server} ")),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!(
            "[INFO] Process {mps_server} (user alice) on device 0 is the machine's CUDA MPS server"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("its 66mi GPU memory there is overhead"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "[INFO] Process {own} (user bob) on GPU(s) 2 runs the CUDA MPS server but is not the machine's shared one (its parent"
        )),
        "{stderr}"
    );
    // Bob's two are judged as themselves: outside genv.
    for pid in [named, own] {
        assert!(
            stdout.contains(&format!(
                "Process {pid} is not running in a GPU environment"
            )),
            "{pid}: {stdout}"
        );
        assert_eq!(f.host(0).wait_signal(pid, WAIT), Some(SIGTERM), "{pid}");
    }
    // The busy client is not idle: the server's figure bounds its own.
    assert!(!stdout.contains(&format!("Process {client} ")), "{stdout}");
    std::thread::sleep(Duration::from_millis(500));
    assert!(f.host(0).running(client));
    assert!(
        f.host(0).running(daemon),
        "the server lives (its daemon waits for it)"
    );

    // The client stops computing: its server did nothing, so neither did
    // it, whatever bob's job beside it does.
    let busy = f.host(0).spawn_as("bob", None);
    let h = f.host(0);
    set_gpus(h, &[100, 0, 0, 0]);
    set_apps(
        h,
        &[
            (client, 0, 1540, "M+C", "-", "python3"),
            (mps_server, 0, 66, "C", "-", "nvidia-cuda-mps-server"),
            (busy, 0, 100, "C", "97", "python3"),
        ],
    );
    let out = f.ours(&["enforce", "--interval", "0", "--idle-after", "0s"]);
    let stdout = lines(&out).join("\n");
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "Process {client} of user alice holds GPU memory on GPU(s) 0 and has been below 5% utilization (a CUDA MPS client: its MPS server's figure"
        )),
        "{stdout}"
    );
    assert_eq!(f.host(0).wait_signal(client, WAIT), Some(SIGTERM));
    for pid in [mps_server, busy] {
        assert!(!stdout.contains(&format!("process {pid} ")), "{stdout}");
    }
    assert!(f.host(0).running(busy));
    std::thread::sleep(Duration::from_millis(500));
    assert!(f.host(0).running(daemon), "the server lives on");
}
