//! The enforcer's peak memory when every host of a fleet holds a huge
//! `devices.json` (issue 42, point 4): `hosts` answers, each with a file
//! of about `mib` MiB, arrive together (the worst case: each in memory
//! whole, as an answer is read), are parsed and assembled on `threads`
//! workers (the blocking pool), and each host's parsed state is kept for
//! the next cycle while the cycle's snapshots are all held, as the
//! assessment holds them.
//!
//!     cargo run --release --example state_memory -- [hosts] [mib] [threads] [0|1]
//!
//! Two kinds of file: `records` (0), as many attachments with 250-byte ids
//! as fit (under `--max-records`); `strings` (1), 64 attachments whose
//! `time` is a huge string (cut to 256 bytes once parsed). Prints the peak resident
//! size (VmHWM) and what stays (VmRSS) after each.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use genv_enforce::snapshot::assemble::{assemble, ParsedState};
use genv_enforce::snapshot::{frames, genv};

/// The heap in use and its peak, counted at each allocation (what the
/// process holds, whatever the allocator keeps from the system).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn frame(out: &mut Vec<u8>, kind: &str, arg: Option<&str>, body: &[u8]) {
    match arg {
        Some(a) => out.extend(format!("@{kind} {a} {}\n", body.len()).bytes()),
        None => out.extend(format!("@{kind} {}\n", body.len()).bytes()),
    }
    out.extend_from_slice(body);
}

/// One host's answer, its `devices.json` about `mib` MiB.
fn answer(mib: usize, strings: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let uuid = |g: usize| format!("GPU-{g:08x}-0000-4c3b-9a8f-7e6d5c4b3a29");
    let gpus: String = (0..8)
        .map(|g| format!("{}, {g}, 81559\n", uuid(g)))
        .collect();
    frame(&mut out, "gpus", None, gpus.as_bytes());
    frame(
        &mut out,
        "apps",
        None,
        format!("{}, 100, 1000\n", uuid(0)).as_bytes(),
    );
    frame(&mut out, "envs", None, br#"{"envs": []}"#);
    let target = mib << 20;
    let mut devices = String::with_capacity(target + 4096);
    devices.push_str(r#"{"devices": ["#);
    let per = if strings { 64 } else { usize::MAX };
    let time = if strings {
        "t".repeat(target / 64)
    } else {
        "22/11/2026 15:04:06".into()
    };
    let mut n = 0;
    for d in 0..8 {
        if d > 0 {
            devices.push_str(", ");
        }
        devices.push_str(&format!(
            r#"{{"index": {d}, "total_memory": "81559mi", "attachments": ["#
        ));
        let mut first = true;
        while devices.len() < target * (d + 1) / 8 && n < per && n < genv::DEFAULT_MAX_RECORDS - 16
        {
            if !first {
                devices.push_str(", ");
            }
            first = false;
            let eid = format!("{n:0>250}");
            devices.push_str(&format!(
                r#"{{"eid": "{eid}", "gpu_memory": null, "time": "{time}"}}"#
            ));
            n += 1;
        }
        devices.push_str("]}");
    }
    devices.push_str("]}");
    frame(&mut out, "devices", None, devices.as_bytes());
    frame(&mut out, "proc", Some("100"), b"seen 500 1001 novar\n");
    frame(&mut out, "user", Some("1001"), b"alice");
    out
}

/// (VmHWM, VmRSS) in MiB.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (kib("VmHWM:") >> 10, kib("VmRSS:") >> 10)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (hosts, mib, threads) = (
        args.first().copied().unwrap_or(32),
        args.get(1).copied().unwrap_or(64),
        args.get(2).copied().unwrap_or(2),
    );
    // One kind per process, so that each peak is its own: 0 records, 1
    // strings (default: records).
    let strings = args.get(3) == Some(&1);
    {
        let one = answer(mib, strings);
        let size = one.len() >> 20;
        let answers: Vec<Vec<u8>> = (0..hosts).map(|_| one.clone()).collect();
        drop(one);
        let answers = Arc::new(Mutex::new(
            answers.into_iter().enumerate().collect::<Vec<_>>(),
        ));
        let kept = Arc::new(Mutex::new(Vec::new()));
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let (answers, kept) = (Arc::clone(&answers), Arc::clone(&kept));
                std::thread::spawn(move || loop {
                    let Some((h, bytes)) = answers.lock().unwrap().pop() else {
                        break;
                    };
                    let source = format!("h{h}");
                    let mut parsed = ParsedState::default();
                    let snap = frames::parse_frames(&bytes, &source)
                        .and_then(|f| frames::raw_host(&f, &source))
                        .and_then(|raw| {
                            assemble(&raw, &source, &mut parsed, genv::DEFAULT_MAX_RECORDS)
                        });
                    let snap = snap.expect("parses");
                    drop(bytes);
                    kept.lock().unwrap().push((parsed, snap));
                })
            })
            .collect();
        for w in workers {
            w.join().expect("worker");
        }
        let held = kept.lock().unwrap();
        let attachments: usize = held
            .iter()
            .map(|(_, s)| genv::device_records(&s.devices))
            .sum();
        let (hwm, rss) = memory();
        let mib = |a: &AtomicUsize| a.load(Ordering::Relaxed) >> 20;
        println!(
            "{}: {hosts} hosts x {size} MiB devices.json ({} records each after clean-up), {threads} workers: heap peak {} MiB (answers {} MiB), heap kept {} MiB; resident peak {hwm} MiB, now {rss} MiB",
            if strings { "strings" } else { "records" },
            attachments / hosts.max(1),
            mib(&PEAK),
            (hosts * size),
            mib(&LIVE),
        );
    }
}
