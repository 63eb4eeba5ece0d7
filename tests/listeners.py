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
