//! The order in which CPython iterates a `set` of small non-negative ints.
//!
//! genv builds a host's process list from `set(pid for app in apps)`, so its
//! "snapshot order" (which env-memory walks when it picks what to kill) is
//! the slot order of CPython's hash table, not nvidia-smi's line order. This
//! replays CPython's `set_add_entry`, `set_insert_clean` and
//! `set_table_resize` for keys whose hash is the value itself, so that we
//! pick the same pids as genv does. The orders in
//! `fixtures/pyset-orders.txt` are those of every CPython from 3.7 (genv
//! 1.4.3's minimum) to 3.13; 3.6 differs.

/// `PySet_MINSIZE`.
const MIN_SIZE: usize = 8;
/// `LINEAR_PROBES`.
const LINEAR_PROBES: usize = 9;
/// `PERTURB_SHIFT`.
const PERTURB_SHIFT: u32 = 5;

/// `keys` (duplicates ignored) in the order CPython iterates
/// `set(keys)` when the keys are added one by one in the given order.
pub fn set_order(keys: &[u32]) -> Vec<u32> {
    let mut table: Vec<Option<u32>> = vec![None; MIN_SIZE];
    let mut used = 0usize;
    for &key in keys {
        if !add(&mut table, key) {
            continue;
        }
        used += 1;
        let mask = table.len() - 1;
        // No deletions happen, so `fill == used`.
        if used * 5 >= mask * 3 {
            table = resize(&table, if used > 50_000 { used * 2 } else { used * 4 });
        }
    }
    let mut order = Vec::with_capacity(used);
    order.extend(table.into_iter().flatten());
    order
}

/// `set_add_entry` without the resize; false when `key` was present.
fn add(table: &mut [Option<u32>], key: u32) -> bool {
    let mask = table.len() - 1;
    let mut i = key as usize & mask;
    let mut perturb = key as usize;
    loop {
        let probes = if i + LINEAR_PROBES <= mask {
            LINEAR_PROBES
        } else {
            0
        };
        for slot in &mut table[i..=i + probes] {
            match *slot {
                None => {
                    *slot = Some(key);
                    return true;
                }
                Some(k) if k == key => return false,
                Some(_) => {}
            }
        }
        perturb >>= PERTURB_SHIFT;
        i = (i * 5 + 1 + perturb) & mask;
    }
}

/// `set_table_resize`: the smallest power of two above `min_used`, the old
/// entries re-inserted in slot order with `set_insert_clean`.
fn resize(old: &[Option<u32>], min_used: usize) -> Vec<Option<u32>> {
    let mut size = MIN_SIZE;
    while size <= min_used {
        size <<= 1;
    }
    let mut table = vec![None; size];
    for key in old.iter().flatten() {
        // All keys are distinct, so `add` is `set_insert_clean` here.
        add(&mut table, *key);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers(s: &str) -> Vec<u32> {
        s.split_whitespace().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn collisions_probe_away_from_the_home_slot() {
        assert_eq!(set_order(&[3, 3, 11, 3]), [11, 3]);
        assert_eq!(set_order(&[17, 9, 1]), [17, 9, 1]);
        assert_eq!(set_order(&[19895, 19896]), [19896, 19895]);
        assert_eq!(set_order(&[]), Vec::<u32>::new());
    }

    /// Orders printed by CPython 3.11 for sets of 1 to 3000 keys, with
    /// duplicates, dense and sparse.
    #[test]
    fn matches_cpython() {
        let cases = include_str!("../../fixtures/pyset-orders.txt");
        let mut n = 0;
        for line in cases.lines().filter(|l| !l.starts_with('#')) {
            let (keys, want) = line.split_once('|').unwrap();
            let keys = numbers(keys);
            assert_eq!(set_order(&keys), numbers(want), "set({keys:?})");
            n += 1;
        }
        assert!(n > 100);
    }
}
