"""Real shared-store servers for the tests, on loopback only: every bind address is 127.0.0.1
(Mooncake's transfer engine too, through MC_TCP_BIND_ADDRESS; its metadata is served by the
standalone server, which honours --host, not by the master's embedded one, which listens on
every interface), checked after start-up from /proc; each server is stopped by its PID and every
wait is bounded. Without the servers installed the tests skip with the reason, unless
KVATLAS_REQUIRE_STORES is set (CI installs them: there they must run)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

LOOPBACK = "127.0.0.1"
os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)   # this process's transfer engine, and its children


def missing(what: str):
    if os.environ.get("KVATLAS_REQUIRE_STORES"):
        pytest.fail(f"{what} (KVATLAS_REQUIRE_STORES is set: CI installs the stores, so these tests must run)")
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _bin(name: str) -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def wait_port(port: int, timeout_s: float = 15.0, proc=None) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {LOOPBACK}:{port} after {timeout_s} s")


def listening(pid: int) -> set[str]:
    """Local addresses the process's TCP sockets listen on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:     # 0A: LISTEN
                    addr = cols[1].split(":")[0]
                    out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if width == 8 else addr)
    return out


class Server:
    def __init__(self, args: list[str], port: int, log) -> None:
        self.args, self.port, self.log = args, port, log
        self.proc = None

    def start(self, timeout_s: float = 15.0) -> "Server":
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port, timeout_s, self.proc)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


class Redis:
    def __init__(self, tmp, maxmemory: str | None = None, password: str | None = None,
                 policy: str = "allkeys-lru") -> None:
        exe = _bin("redis-server")
        if exe is None:
            missing("redis-server is not installed (apt-get install redis-server)")
        pytest.importorskip("redis") if not os.environ.get("KVATLAS_REQUIRE_STORES") else __import__("redis")
        self.port = free_port()
        args = [exe, "--bind", LOOPBACK, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--dir", str(tmp)]
        if maxmemory:
            args += ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
        if password:
            args += ["--requirepass", password]
        self.password = password
        self.server = Server(args, self.port, open(os.path.join(tmp, f"redis-{self.port}.log"), "ab"))
        self.servers = [self.server]

    @property
    def url(self) -> str:
        from urllib.parse import quote
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{LOOPBACK}:{self.port}?timeout=1"

    def start(self) -> "Redis":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


class Mooncake:
    """The standalone metadata server, the master (metadata only) and one memory daemon."""

    def __init__(self, tmp, segment: str = "256MB") -> None:
        exes = {n: _bin(n) for n in ("mooncake_master", "mooncake_client", "mooncake_http_metadata_server")}
        if None in exes.values():
            missing("Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            missing(f"mooncake.store cannot be imported ({exc})")
        self.rpc, self.http, self.metrics, self.daemon_port = (free_port() for _ in range(4))
        log = lambda name: open(os.path.join(tmp, f"{name}-{self.rpc}.log"), "ab")   # noqa: E731
        self.meta = Server([exes["mooncake_http_metadata_server"], "--host", LOOPBACK, "--port", str(self.http),
                            "--log-level", "WARNING"], self.http, log("metadata"))
        self.master = Server([exes["mooncake_master"], f"--rpc_address={LOOPBACK}", f"--rpc_port={self.rpc}",
                              "--enable_http_metadata_server=false", f"--metrics_host={LOOPBACK}",
                              f"--metrics_port={self.metrics}", "--client_ttl=2", "--default_kv_lease_ttl=1000"],
                             self.rpc, log("master"))
        self.daemon = Server([exes["mooncake_client"], f"--host={LOOPBACK}", f"--port={self.daemon_port}",
                              f"--global_segment_size={segment}", f"--master_server_address={LOOPBACK}:{self.rpc}",
                              f"--metadata_server=http://{LOOPBACK}:{self.http}/metadata", "--protocol=tcp"],
                             self.daemon_port, log("daemon"))
        self.servers = [self.meta, self.master, self.daemon]

    @property
    def url(self) -> str:
        return f"mooncake://{LOOPBACK}:{self.rpc}?metadata=http://{LOOPBACK}:{self.http}/metadata&buffer=32MiB"

    def start(self) -> "Mooncake":
        for s in self.servers:
            s.start()
        time.sleep(1.0)    # the daemon mounts its segment after it listens
        return self

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()


def only_loopback_here() -> bool:
    """True inside a network namespace whose one interface is `lo`."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]   # (sysfs may show the parent's)


ANY = {"0.0.0.0", "0" * 32}


def loopback_up() -> None:
    """Bring `lo` up (a new network namespace starts with it down), without iproute2."""
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]   # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))                                  # SIOCSIFFLAGS, IFF_UP


def check_loopback_only(servers) -> None:
    """Each server listens on 127.0.0.1 only, or also on every interface (Mooncake's memory
    daemon does, whatever --host says) where `lo` is the only interface there is."""
    allowed = {LOOPBACK} | (ANY if only_loopback_here() else set())
    for s in servers:
        addrs = listening(s.pid)
        assert addrs and addrs <= allowed, f"{s.args[0]} listens on {sorted(addrs)}"
