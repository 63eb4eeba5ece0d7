"""Which of a test's processes listen on a network address other than loopback (issue: nothing may, unless
configured)."""

LOOPBACK = ("127.", "::1", "::ffff:127.")


def off_loopback_listeners(marks: tuple[str, ...] = (), roots: tuple[int, ...] = ()) -> set:
    """Listening sockets off loopback held by processes whose command line contains one of `marks` (or reads
    ray::ACTOR when marks are given), or by `roots` and their descendants."""
    import psutil

    tree = set()
    for pid in roots:
        try:
            root = psutil.Process(pid)
            tree |= {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.Error:
            continue
    found = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or conn.laddr.ip.startswith(LOOPBACK) or conn.pid is None:
            continue
        try:
            cmd = " ".join(psutil.Process(conn.pid).cmdline())
        except psutil.Error:
            continue
        if conn.pid in tree or (marks and (cmd.startswith("ray::") or any(m in cmd for m in marks))):
            found.add((conn.laddr.ip, conn.laddr.port, cmd[:120]))
    return found


class SampledRun:
    """A command run with its output (stdout and stderr) read by a thread, while `sample(proc)` is called every
    `every_s` seconds until it exits or `deadline_s` passes; the union of what sample returned is `found`."""

    def __init__(self, cmd: list[str], *, cwd, env: dict, sample, deadline_s: float, every_s: float):
        import subprocess
        import threading
        import time

        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.found, deadline = set(), time.monotonic() + deadline_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.found |= sample(self.proc)
            time.sleep(every_s)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self) -> tuple[int, str]:
        """Kill it if still running; its exit code and whole output."""
        if self.running:
            self.proc.kill()
        code = self.proc.wait()
        self._reader.join(timeout=30)
        return code, "".join(self.lines)
