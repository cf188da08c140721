//! CPU time as Linux's `/proc` counts it, in its 10 ms ticks (the unit
//! serve's own `process_cpu_seconds_total` has too): this process's or one
//! of its threads', every PostgreSQL server process's together, and the
//! whole machine's busy time.
//! Read before and after a measurement, they say what each request cost
//! beyond serve's own CPU.

/// The unit of `/proc`'s CPU times (fixed at 100 for user space on Linux).
const USER_HZ: f64 = 100.0;

/// This process's CPU seconds so far (user and system).
pub fn own_seconds() -> Option<f64> {
    stat_seconds(std::path::Path::new("/proc/self/stat"))
}

/// The CPU seconds so far of the process or thread whose `stat` file
/// this is (`/proc/<pid>/stat`, `/proc/<pid>/task/<tid>/stat`).
pub fn stat_seconds(path: &std::path::Path) -> Option<f64> {
    process_seconds(&std::fs::read_to_string(path).ok()?).map(|(_, seconds)| seconds)
}

/// The CPU seconds of every process named `postgres` so far: the server
/// and its backends, which the stack's pools keep open, so a difference of
/// two readings is what PostgreSQL spent in between.
pub fn postgres_seconds() -> Option<f64> {
    let mut total = 0.0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // A process may end between listing and reading: it counts nothing.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        if let Some(("postgres", seconds)) = process_seconds(&stat) {
            total += seconds;
        }
    }
    Some(total)
}

/// The machine's busy CPU seconds so far, over all cores: every state of
/// the first line of `/proc/stat` but idle and waiting for I/O.
pub fn machine_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<f64> = stat.lines().next()?.split_whitespace().skip(1).map_while(|t| t.parse().ok()).collect();
    let (idle, iowait) = (ticks.get(3)?, ticks.get(4)?);
    // guest time is counted in user time already.
    let busy: f64 = ticks.iter().take(8).sum::<f64>() - idle - iowait;
    Some(busy / USER_HZ)
}

/// A process's command name and CPU seconds (user and system), from the
/// text of its `/proc/<pid>/stat`.
fn process_seconds(stat: &str) -> Option<(&str, f64)> {
    // The command name (field 2) is in parentheses and may hold spaces.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    let mut fields = rest.split_whitespace();
    let (utime, stime) = (fields.nth(11)?.parse::<f64>().ok()?, fields.next()?.parse::<f64>().ok()?);
    Some((name, (utime + stime) / USER_HZ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_line_gives_its_name_and_its_user_and_system_ticks() {
        let line = "4242 (postgres) S 1 2 3 4 5 6 7 8 9 10 150 50 0 0 20 0 1 0 100 200 300";
        assert_eq!(process_seconds(line), Some(("postgres", 2.0)));
        let spaced = "7 (tokio runtime) R 1 2 3 4 5 6 7 8 9 10 1 2 0 0";
        assert_eq!(process_seconds(spaced), Some(("tokio runtime", 0.03)));
    }

    #[test]
    fn this_process_and_the_machine_have_spent_some_cpu() {
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {}
        assert!(own_seconds().is_some_and(|s| s > 0.0));
        assert!(machine_seconds().is_some_and(|s| s > 0.0));
    }
}
