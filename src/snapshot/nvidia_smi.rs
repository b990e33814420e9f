//! nvidia-smi CSV: `--query-gpu=uuid,index[,memory.total]` and
//! `--query-compute-apps=gpu_uuid,pid,used_gpu_memory`, with or without
//! header and units, fields separated by `", "` as real drivers print them.
//! Parsed values borrow from the text (a cycle parses thousands of lines).

use super::{pyset, ParseError};
use crate::model::{Device, DeviceUsage, Few, GpuIndex, Gpus, Pid, ProcessUtilization, Usage};

const MIB: u64 = 1024 * 1024;

/// One GPU from `--query-gpu`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu<'a> {
    pub uuid: &'a str,
    pub index: GpuIndex,
    /// `memory.total` in MiB, when queried and known.
    pub total_mib: Option<u64>,
}

/// One line of `--query-compute-apps`: one process on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeApp<'a> {
    pub gpu_uuid: &'a str,
    pub pid: Pid,
    pub usage: Usage,
}

/// The first fields of a line (as many as a query asks for), trimmed,
/// and how many of them the line has.
struct Fields<'a> {
    f: [&'a str; 3],
    n: usize,
}

/// The data lines of a CSV answer with their 1-based line numbers and
/// first fields, the header (recognised by its first column name) left out.
fn rows<'a>(
    text: &'a str,
    first_column: &'a str,
) -> impl Iterator<Item = (usize, &'a str, Fields<'a>)> {
    lines(text)
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty())
        .filter(move |(n, l)| {
            !(*n == 1 && column_name(l.split(", ").next().unwrap_or("")) == first_column)
        })
        .map(|(n, l)| (n, l, fields(l)))
}

/// `text` split at each newline, as `str::split('\n')` splits it, but
/// with the newlines found by memchr (a host's answer holds thousands of
/// short lines).
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let mut ends = memchr::memchr_iter(b'\n', text.as_bytes());
    std::iter::from_fn(move || {
        let end = ends
            .next()
            .or((start <= text.len()).then_some(text.len()))?;
        let line = &text[start..end];
        start = end + 1;
        Some(line)
    })
}

/// What `item` makes of each of [`rows`], in a list sized once for a
/// host's usual answer (a row per line, up to a thousand rows; a blank
/// line makes no row, so a text of blank lines is not taken at its word).
fn parsed_rows<'a, T>(
    text: &'a str,
    first_column: &'a str,
    mut item: impl FnMut((usize, &'a str, Fields<'a>)) -> Result<T, ParseError>,
) -> Result<Vec<T>, ParseError> {
    let newlines = memchr::memchr_iter(b'\n', text.as_bytes()).count();
    let mut out = Vec::with_capacity((newlines + 1).min(1000));
    for row in rows(text, first_column) {
        out.push(item(row)?);
    }
    Ok(out)
}

/// The first three `, `-separated fields of `line`, trimmed, as
/// `line.split(", ")` gives them (a comma alone separates nothing).
fn fields(line: &str) -> Fields<'_> {
    let mut fields = Fields { f: [""; 3], n: 0 };
    let bytes = line.as_bytes();
    let mut start = 0;
    while fields.n < 3 {
        // The next ", ": commas are few (a uuid has none), found by memchr.
        let sep = memchr::memchr_iter(b',', &bytes[start..])
            .map(|i| start + i)
            .find(|&i| bytes.get(i + 1) == Some(&b' '));
        let end = sep.unwrap_or(line.len());
        fields.f[fields.n] = line[start..end].trim();
        fields.n += 1;
        match sep {
            Some(i) => start = i + 2,
            None => break,
        }
    }
    fields
}

/// A header field without its unit: `used_gpu_memory [MiB]` -> `used_gpu_memory`.
fn column_name(field: &str) -> &str {
    field.split(" [").next().unwrap_or(field).trim()
}

/// A memory value in MiB: `81559`, `81559 MiB`; `None` for `[N/A]`-like values.
fn mib(field: &str) -> Result<Option<u64>, String> {
    if field.starts_with('[') && field.ends_with(']') {
        return Ok(None);
    }
    let digits = field.strip_suffix(" MiB").unwrap_or(field).trim();
    digits
        .parse::<u64>()
        .map(Some)
        .map_err(|_| format!("not a memory value in MiB: {field:?}"))
}

fn bad(source: &str, line: usize, message: impl Into<String>) -> ParseError {
    ParseError::new(source, format!("line {line}"), message)
}

/// Parses `--query-gpu=uuid,index` (optionally `,memory.total`).
///
/// # Errors
/// A line with too few fields or a non-integer index, naming the line.
pub fn parse_gpus<'a>(text: &'a str, source: &str) -> Result<Vec<Gpu<'a>>, ParseError> {
    parsed_rows(text, "uuid", |(n, line, Fields { f, n: count })| {
        if count < 2 {
            return Err(bad(
                source,
                n,
                format!("expected `uuid, index`, got {line:?}"),
            ));
        }
        let index = f[1]
            .parse()
            .map_err(|_| bad(source, n, format!("not a GPU index: {:?}", f[1])))?;
        let total_mib = if count > 2 {
            mib(f[2]).map_err(|e| bad(source, n, e))?
        } else {
            None
        };
        Ok(Gpu {
            uuid: f[0],
            index: GpuIndex(index),
            total_mib,
        })
    })
}

/// Parses `--query-compute-apps=gpu_uuid,pid,used_gpu_memory`. Usage that
/// nvidia-smi cannot measure (`[N/A]`, `[Not Supported]`) is [`Usage::Unknown`].
///
/// # Errors
/// A line with too few fields, a bad pid or a bad memory value, naming the line.
pub fn parse_compute_apps<'a>(
    text: &'a str,
    source: &str,
) -> Result<Vec<ComputeApp<'a>>, ParseError> {
    parsed_rows(text, "gpu_uuid", |(n, line, Fields { f, n: count })| {
        if count < 3 {
            return Err(bad(
                source,
                n,
                format!("expected `gpu_uuid, pid, used_gpu_memory`, got {line:?}"),
            ));
        }
        let pid = f[1]
            .parse()
            .map_err(|_| bad(source, n, format!("not a pid: {:?}", f[1])))?;
        let usage = match mib(f[2]).map_err(|e| bad(source, n, e))? {
            Some(m) => Usage::Known(
                m.checked_mul(MIB)
                    .ok_or_else(|| bad(source, n, "memory value too large"))?,
            ),
            None => Usage::Unknown,
        };
        Ok(ComputeApp {
            gpu_uuid: f[0],
            pid: Pid(pid),
            usage,
        })
    })
}

/// Groups compute apps by pid and maps GPU uuids to indices: one entry per
/// process, one usage per GPU it runs on (in line order). Processes come in
/// genv's order, that of a CPython set of the pids (see [`pyset`]), since
/// env-memory terminates in that order.
///
/// # Errors
/// An app on a GPU uuid that `--query-gpu` did not list.
pub fn processes(
    gpus: &[Gpu<'_>],
    apps: &[ComputeApp<'_>],
    source: &str,
) -> Result<Vec<(Pid, Gpus)>, ParseError> {
    // Linear in the apps: a user may start thousands of GPU processes.
    let mut by_pid: Few<Pid, Gpus> = Few::with_capacity(apps.len());
    // nvidia-smi lists apps GPU by GPU: the last app's GPU is tried first.
    let mut last: Option<&Gpu> = None;
    for app in apps {
        let gpu = last
            .filter(|g| g.uuid == app.gpu_uuid)
            .or_else(|| gpus.iter().find(|g| g.uuid == app.gpu_uuid))
            .ok_or_else(|| {
                ParseError::new(
                    source,
                    format!("pid {}", app.pid),
                    format!("unknown GPU uuid {:?}", app.gpu_uuid),
                )
            })?;
        last = Some(gpu);
        let usage = DeviceUsage {
            index: gpu.index,
            usage: app.usage,
        };
        by_pid.get_or_insert_with(app.pid, Gpus::new).push(usage);
    }
    let pids: Vec<u32> = by_pid.keys().map(|p| p.0).collect();
    let mut ordered = Vec::with_capacity(pids.len());
    for pid in pyset::set_order(&pids) {
        if let Some(gpus) = by_pid.get_mut(&Pid(pid)) {
            ordered.push((Pid(pid), std::mem::take(gpus)));
        }
    }
    Ok(ordered)
}

/// Devices as genv creates `devices.json` on first use: every GPU, none attached.
pub fn devices(gpus: &[Gpu<'_>]) -> Vec<Device> {
    gpus.iter()
        .map(|g| Device {
            index: g.index,
            total_memory: format!("{}mi", g.total_mib.unwrap_or(0)),
            attachments: Vec::new(),
        })
        .collect()
}

/// `nvidia-smi pmon -c 1 -s u`: each (GPU, pid) line, with its SM
/// utilization (`-`: no kernel of it ran in the sampling window) and
/// whether its type says it is a CUDA MPS client (`M+C`, `M`). Columns
/// are found by the header (`# gpu  pid  type  sm ...`; drivers add
/// columns); a GPU without processes prints a line of `-`, skipped.
/// Bounded: one pass over the text.
///
/// The last column is each process's name, which its user picks and which
/// may hold a newline: a line of at most eight fields short of
/// the header's columns is such a name's tail, skipped (a forged line must
/// fill every column but the name, more than the 15 bytes of a name hold
/// on pmon's tables of 10 columns and more), and a line short of its name
/// alone is read. A name costs its process nothing and no one else
/// anything; a (GPU, pid) a forged line repeats is the idle rule's to
/// doubt.
///
/// # Errors
/// No header naming `gpu`, `pid` and `sm`, a line short of the header's
/// columns that no name's tail can be, or whose fields are not numbers
/// (or `-` for `sm`).
pub fn parse_pmon(text: &str, source: &str) -> Result<Vec<ProcessUtilization>, ParseError> {
    /// The most whitespace-separated fields a process name (15 bytes) holds.
    const TAIL_FIELDS: usize = 8;
    // The columns of gpu, pid, sm and type (where named), and how many
    // there are.
    let mut columns: Option<(usize, usize, usize, Option<usize>, usize)> = None;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        if let Some(header) = line.strip_prefix('#') {
            if columns.is_none() {
                let names: Vec<&str> = header.split_whitespace().collect();
                let at = |name: &str| names.iter().position(|c| *c == name);
                if let (Some(g), Some(p), Some(sm)) = (at("gpu"), at("pid"), at("sm")) {
                    columns = Some((g, p, sm, at("type"), names.len()));
                }
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let Some((g, p, sm, kind, width)) = columns else {
            return Err(bad(
                source,
                line_no,
                "no header naming gpu, pid and sm before it",
            ));
        };
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Short of the header's columns: a name's tail (it holds at most
        // TAIL_FIELDS fields), skipped; or, one field short of a table
        // wider than a tail can fill, a line whose name is blank or began
        // with a newline, every other column there.
        let nameless = fields.len() + 1 == width && width > TAIL_FIELDS + 1;
        if fields.len() < width && !nameless && fields.len() <= TAIL_FIELDS {
            continue;
        }
        // Each of gpu, pid and sm is a column before the last.
        let (Some(&gpu), Some(&pid), Some(&sm), true) = (
            fields.get(g),
            fields.get(p),
            fields.get(sm),
            fields.len() >= width || nameless,
        ) else {
            return Err(bad(
                source,
                line_no,
                format!("{} fields where the header has {width}", fields.len()),
            ));
        };
        if pid == "-" {
            continue;
        }
        let number = |f: &str| -> Result<u32, ParseError> {
            f.parse()
                .map_err(|_| bad(source, line_no, format!("not a number: {f:?}")))
        };
        let index = GpuIndex(number(gpu)?);
        let pid = Pid(number(pid)?);
        let sm = match sm {
            "-" => None,
            _ => Some(number(sm)?),
        };
        // Without a type column, any process may be a client.
        let mps_client = kind
            .map_or(Some("M"), |k| fields.get(k).copied())
            .is_some_and(|t| t.contains('M'));
        out.push(ProcessUtilization {
            index,
            pid,
            sm,
            mps_client,
        });
    }
    Ok(out)
}

/// `--query-gpu=index,utilization.gpu --format=csv,noheader,nounits`:
/// each GPU's utilization in percent, where a number (`[N/A]` is left
/// out: unknown).
///
/// # Errors
/// A line that is not `index, value`, or an index that is not a number.
pub fn parse_gpu_utilization(
    text: &str,
    source: &str,
) -> Result<std::collections::BTreeMap<GpuIndex, u32>, ParseError> {
    let mut out = std::collections::BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (index, value) = line
            .split_once(',')
            .ok_or_else(|| bad(source, n + 1, "not \"index, utilization.gpu\""))?;
        let index: u32 = index.trim().parse().map_err(|_| {
            bad(
                source,
                n + 1,
                format!("not a GPU index: {:?}", index.trim()),
            )
        })?;
        if let Ok(pct) = value.trim().trim_end_matches(" %").parse::<u32>() {
            out.insert(GpuIndex(index), pct);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_names_tail_is_skipped_and_costs_no_other_line() {
        let head = "# gpu  pid  type  sm  mem  enc  dec  jpg  ofa  command\n\
                    # Idx    #   C/G   %    %    %    %    %    %  name\n";
        let line = |rest: &str| format!("{head}    0  470  C  -  -  -  -  -  -  {rest}\n");
        let ok = parse_pmon(&line("python3"), "h").unwrap();
        assert_eq!((ok[0].pid, ok[0].sm), (Pid(470), None));
        // A name with spaces: more fields, as many as it takes.
        assert_eq!(parse_pmon(&line("a b (c)"), "h").unwrap().len(), 1);
        // A name holding a newline and a line of its own (15 bytes at
        // most): the tail is skipped, the table stands, every process read.
        let busy = "    0  471  C  97  -  -  -  -  -  python3\n";
        for name in ["x\n0 471 C 0 -", "x\n0 1 C 0 - - -", "\nx", "x\ny", "x\n"] {
            let read = parse_pmon(&format!("{}{busy}", line(name)), "h").unwrap();
            assert_eq!(
                read.iter().map(|l| (l.pid.0, l.sm)).collect::<Vec<_>>(),
                [(470, None), (471, Some(97))],
                "{name:?}"
            );
        }
        // A line short of more than its name, yet more than a tail holds
        // (pmon -s um: 12 columns).
        let um = "# gpu pid type sm mem enc dec jpg ofa fb ccpm command\n";
        let short = format!("{um}    0  12  C  -  -  -  -  -  -  5\n");
        assert_eq!(
            parse_pmon(&short, "h").unwrap_err().to_string(),
            "h: line 2: 10 fields where the header has 12"
        );
        // A narrow table (no real pmon's) skips a short line alike.
        assert_eq!(parse_pmon("# gpu pid type sm\n 0 12\n", "h").unwrap(), []);
        let bad = parse_pmon("# gpu pid type sm\n 0 12 C x\n", "h").unwrap_err();
        assert_eq!(bad.to_string(), "h: line 2: not a number: \"x\"");
        // A GPU without processes.
        let none = parse_pmon(&format!("{head}    1  -  -  -  -  -  -  -  -  -\n"), "h");
        assert_eq!(none.unwrap(), []);
    }

    #[test]
    fn lines_are_split_as_split_on_newline_splits_them() {
        for text in [
            "",
            "\n",
            "a",
            "a\n",
            "a\nb",
            "\n\na\r\n\nb\n\n",
            "é\nü\n",
            "\r",
        ] {
            let want: Vec<&str> = text.split('\n').collect();
            assert_eq!(lines(text).collect::<Vec<_>>(), want, "{text:?}");
        }
    }

    #[test]
    fn fields_are_split_as_split_on_comma_space_splits_them() {
        for line in [
            "GPU-1, 123, 1000 MiB",
            "a, b, c, d",
            "a,b, c",
            ",, x",
            "a, , b",
            ", ",
            "",
            "a,",
            " a ,  b , c ",
            "é, ü, ñ",
        ] {
            let want: Vec<&str> = line.split(", ").take(3).map(str::trim).collect();
            let got = fields(line);
            assert_eq!(&got.f[..got.n], &want[..], "{line:?}");
        }
    }

    const GPUS: &str = include_str!("../../fixtures/nvidia-smi/query-gpu.csv");
    const GPUS_HEADER: &str = include_str!("../../fixtures/nvidia-smi/query-gpu-header-units.csv");
    const APPS: &str = include_str!("../../fixtures/nvidia-smi/query-compute-apps.csv");
    const APPS_HEADER: &str =
        include_str!("../../fixtures/nvidia-smi/query-compute-apps-header-units.csv");
    const APPS_MIG: &str = include_str!("../../fixtures/nvidia-smi/query-compute-apps-mig-na.csv");

    #[test]
    fn gpus_plain_and_with_header() {
        let plain = parse_gpus(GPUS, "f").unwrap();
        assert_eq!(plain.len(), 4);
        assert_eq!(plain[3].index, GpuIndex(3));
        assert!(plain[0].uuid.starts_with("GPU-"));
        let header = parse_gpus(GPUS_HEADER, "f").unwrap();
        assert_eq!(header.len(), 4);
        assert_eq!(header[0].total_mib, Some(81559));
        assert_eq!(header[0].uuid, plain[0].uuid);
    }

    #[test]
    fn apps_plain_with_header_and_na() {
        let plain = parse_compute_apps(APPS, "f").unwrap();
        let header = parse_compute_apps(APPS_HEADER, "f").unwrap();
        assert_eq!(plain, header);
        assert_eq!(plain[0].usage, Usage::Known(4312 * MIB));
        let mig = parse_compute_apps(APPS_MIG, "f").unwrap();
        assert!(mig.iter().any(|a| a.usage == Usage::Unknown));
        assert!(mig.iter().any(|a| a.gpu_uuid.starts_with("MIG-")));
    }

    /// Captured on a real H100 (driver 580.159.04) with two CUDA processes
    /// running (`fixtures/nvidia-smi/h100/`).
    #[test]
    fn real_h100_captures() {
        const GPUS: &str = include_str!("../../fixtures/nvidia-smi/h100/query-gpu.csv");
        const GPUS_MEM: &str = include_str!("../../fixtures/nvidia-smi/h100/query-gpu-memory.csv");
        const GPUS_HEADER: &str =
            include_str!("../../fixtures/nvidia-smi/h100/query-gpu-header-units.csv");
        const APPS: &str = include_str!("../../fixtures/nvidia-smi/h100/query-compute-apps.csv");
        const APPS_HEADER: &str =
            include_str!("../../fixtures/nvidia-smi/h100/query-compute-apps-header-units.csv");
        const IDLE: &str =
            include_str!("../../fixtures/nvidia-smi/h100/query-compute-apps-idle.csv");
        let uuid = "GPU-3f95f012-ea54-7e19-f150-6a675c4f82b5";
        let plain = parse_gpus(GPUS, "h100").unwrap();
        assert_eq!((plain[0].uuid, plain[0].index), (uuid, GpuIndex(0)));
        assert_eq!(
            parse_gpus(GPUS_MEM, "h100").unwrap()[0].total_mib,
            Some(81559)
        );
        assert_eq!(
            parse_gpus(GPUS_HEADER, "h100").unwrap()[0].total_mib,
            Some(81559)
        );
        let apps = parse_compute_apps(APPS, "h100").unwrap();
        assert_eq!(apps, parse_compute_apps(APPS_HEADER, "h100").unwrap());
        assert_eq!(
            apps.iter().map(|a| (a.pid, a.usage)).collect::<Vec<_>>(),
            vec![
                (Pid(511), Usage::Known(1122 << 20)),
                (Pid(510), Usage::Known(2658 << 20))
            ]
        );
        assert!(parse_compute_apps(IDLE, "h100").unwrap().is_empty());
        let procs = processes(&plain, &apps, "h100").unwrap();
        assert_eq!(procs.len(), 2);
    }

    #[test]
    fn empty_and_header_only() {
        assert!(parse_compute_apps("", "f").unwrap().is_empty());
        assert!(
            parse_compute_apps("gpu_uuid, pid, used_gpu_memory [MiB]\n", "f")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn process_name_with_commas_is_ignored() {
        let a = parse_compute_apps("GPU-1, 12, 100 MiB, python a,b, c\n", "f").unwrap();
        assert_eq!(a[0].pid, Pid(12));
    }

    #[test]
    fn malformed_lines_are_named() {
        let e = parse_compute_apps("GPU-1, 12, 100\nGPU-1, twelve, 100\n", "gpu7").unwrap_err();
        assert_eq!(
            (e.source_name.as_str(), e.location.as_str()),
            ("gpu7", "line 2")
        );
        let short = parse_compute_apps("GPU-1, 12\n", "f").unwrap_err();
        assert!(
            short
                .message
                .contains("expected `gpu_uuid, pid, used_gpu_memory`"),
            "{short}"
        );
        let short = parse_gpus("GPU-1\n", "f").unwrap_err();
        assert!(short.message.contains("expected `uuid, index`"), "{short}");
        assert_eq!(mib("[N/A]"), Ok(None));
        assert!(mib("[N/A").is_err() && mib("N/A]").is_err());
        assert_eq!(mib("81559 MiB"), Ok(Some(81559)));
        assert!(parse_compute_apps("GPU-1, 12, 1.5 GiB\n", "f").is_err());
        assert!(parse_gpus("GPU-1, x\n", "f").is_err());
        assert!(parse_gpus(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            "f"
        )
        .is_err());
    }

    #[test]
    fn grouping_by_pid() {
        let gpus = parse_gpus(GPUS, "f").unwrap();
        let apps = parse_compute_apps(APPS, "f").unwrap();
        let procs = processes(&gpus, &apps, "f").unwrap();
        let multi = procs
            .iter()
            .find(|(_, u)| u.len() > 1)
            .expect("fixture has a multi-GPU process");
        assert!(multi.1.windows(2).all(|w| w[0].index != w[1].index));
        let unknown = [ComputeApp {
            gpu_uuid: "GPU-x",
            pid: Pid(1),
            usage: Usage::Unknown,
        }];
        assert!(processes(&gpus, &unknown, "f").is_err());
    }

    /// Each pid once, with its GPUs in line order, the pids in the order
    /// of a CPython set: the same whether the apps are few (scanned) or
    /// many (hashed), and the many take the hashed path.
    #[test]
    fn grouping_is_the_same_for_few_and_many_apps() {
        let gpus: Vec<Gpu> = (0..4)
            .map(|i| Gpu {
                uuid: ["GPU-a", "GPU-b", "GPU-c", "GPU-d"][i],
                index: GpuIndex(i as u32),
                total_mib: None,
            })
            .collect();
        assert!(!Few::<Pid, Gpus>::with_capacity(16).hashed());
        assert!(Few::<Pid, Gpus>::with_capacity(17).hashed());
        for count in [1, 2, 5, 15, 16, 17, 40, 1000] {
            // Pids in a scrambled order, each on one to three GPUs,
            // listed GPU by GPU as nvidia-smi does.
            let pids: Vec<u32> = (0..count).map(|k| 1000 + (k * 7919) % 4099).collect();
            let mut apps = Vec::new();
            for (g, gpu) in gpus.iter().enumerate() {
                for (k, &pid) in pids.iter().enumerate() {
                    if g == 0 || (k + g) % 3 == 0 {
                        apps.push(ComputeApp {
                            gpu_uuid: gpu.uuid,
                            pid: Pid(pid),
                            usage: Usage::Known(k as u64),
                        });
                    }
                }
            }
            let got = processes(&gpus, &apps, "f").unwrap();
            let order: Vec<u32> = got.iter().map(|(p, _)| p.0).collect();
            assert_eq!(order, pyset::set_order(&pids), "{count} pids");
            for (pid, usages) in &got {
                let want: Vec<DeviceUsage> = apps
                    .iter()
                    .filter(|a| a.pid == *pid)
                    .map(|a| DeviceUsage {
                        index: gpus.iter().find(|g| g.uuid == a.gpu_uuid).unwrap().index,
                        usage: a.usage,
                    })
                    .collect();
                assert_eq!(usages.as_slice(), want.as_slice(), "pid {pid} of {count}");
            }
            let many = Few::<Pid, Gpus>::with_capacity(apps.len()).hashed();
            assert_eq!(many, apps.len() > 16, "{} apps", apps.len());
        }
    }
}
