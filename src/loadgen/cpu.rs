//! CPU time of a process as the kernel accounts it (`/proc/<pid>/stat`: user and system
//! time), so that a run can report what each operation cost the server and the driver.
//! Wall-clock throughput depends on everything else the machine does; CPU per operation
//! drifts less and says what a request costs. The server's is also reported split: its own
//! code (user time) against the kernel's work for it (system time: sockets, `fdatasync`,
//! page writes), which on a virtual machine drifts most from run to run.

use std::time::Duration;

use serde_json::{Value, json};

/// `/proc` reports times in `USER_HZ` ticks, which the kernel fixes at 100 on every
/// architecture Leasehold is built for (x86_64, aarch64), whatever its internal `HZ`.
const USER_HZ: u64 = 100;

/// A process's CPU time, split as the kernel accounts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cpu {
    pub user: Duration,
    pub system: Duration,
}

impl Cpu {
    pub fn total(self) -> Duration {
        self.user + self.system
    }
}

/// The CPU time of `pid`, or of this process when `None`; `None` when the process or
/// `/proc` is not there.
pub fn cpu_time(pid: Option<u32>) -> Option<Cpu> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let stat = std::fs::read_to_string(path).ok()?;
    parse_stat(&stat)
}

/// Fields 14 and 15 (`utime`, `stime`) of a stat line. The command name (field 2) is in
/// parentheses and may hold spaces, so fields are counted from the last `)`.
fn parse_stat(stat: &str) -> Option<Cpu> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let ticks = |t: u64| Duration::from_micros(t * 1_000_000 / USER_HZ);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Cpu {
        user: ticks(utime),
        system: ticks(stime),
    })
}

/// The server's and the driver's CPU time at one instant.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuMark {
    pub server: Option<Cpu>,
    pub driver: Option<Cpu>,
}

impl CpuMark {
    pub fn now(server_pid: Option<u32>) -> CpuMark {
        CpuMark {
            server: server_pid.and_then(|pid| cpu_time(Some(pid))),
            driver: cpu_time(None),
        }
    }
}

/// The CPU spent between two marks per operation, in µs, as report fields:
/// `server_cpu_us_per_op` with its split `server_user_us_per_op` and
/// `server_system_us_per_op` (when the server's pid was given), and `driver_cpu_us_per_op`.
pub fn per_op(from: CpuMark, to: CpuMark, ops: u64, extra: &mut serde_json::Map<String, Value>) {
    if ops == 0 {
        return;
    }
    let mut put = |name: &str, a: Duration, b: Duration| {
        let us = b.saturating_sub(a).as_secs_f64() * 1e6 / ops as f64;
        extra.insert(name.into(), json!((us * 100.0).round() / 100.0));
    };
    if let Some((a, b)) = from.server.zip(to.server) {
        put("server_cpu_us_per_op", a.total(), b.total());
        put("server_user_us_per_op", a.user, b.user);
        put("server_system_us_per_op", a.system, b.system);
    }
    if let Some((a, b)) = from.driver.zip(to.driver) {
        put("driver_cpu_us_per_op", a.total(), b.total());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4242 (leasehold (x) y) S 1 4242 4242 0 -1 4194560 5000 0 0 0 250 75 0 0 20 0 \
                    9 0 123 0 0";
        let cpu = parse_stat(line).unwrap();
        assert_eq!(cpu.user, Duration::from_millis(2_500));
        assert_eq!(cpu.system, Duration::from_millis(750));
        assert_eq!(cpu.total(), Duration::from_millis(3_250));
        assert_eq!(parse_stat("4242 (short) S 1"), None);
        assert!(cpu_time(None).is_some());
    }

    #[test]
    fn per_op_divides_the_window_by_the_operations() {
        let ms = |user, system| Cpu {
            user: Duration::from_millis(user),
            system: Duration::from_millis(system),
        };
        let from = CpuMark {
            server: Some(ms(60, 40)),
            driver: Some(ms(10, 0)),
        };
        let to = CpuMark {
            server: Some(ms(210, 90)),
            driver: None,
        };
        let mut extra = serde_json::Map::new();
        per_op(from, to, 1_000, &mut extra);
        assert_eq!(extra["server_cpu_us_per_op"], json!(200.0));
        assert_eq!(extra["server_user_us_per_op"], json!(150.0));
        assert_eq!(extra["server_system_us_per_op"], json!(50.0));
        assert!(!extra.contains_key("driver_cpu_us_per_op"));
    }
}
