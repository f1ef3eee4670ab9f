"""This process's memory, as Linux reports it in /proc (None elsewhere)."""

from __future__ import annotations


def status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes (`VmRSS`: resident now, `VmHWM`: the peak since
    `reset_peak`), or None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> None:
    """Start `VmHWM` again from the resident memory now (Linux; a no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
