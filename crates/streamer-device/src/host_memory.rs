//! How much host memory is there to use.

/// `MemAvailable` of `/proc/meminfo` in bytes (memory the kernel can hand
/// out without swapping), or `None` where that file or line is missing.
pub fn host_available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
