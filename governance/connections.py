"""The cap on idle connections per source address, in each server process (SPEC 10).

granian accepts connections in its Rust code and holds each one as a slot of its
backpressure (``--max-connections``) until it ends, so the application never sees a
connection that sends nothing, and one source holding thousands of them would take every
slot: new connections, an agent's check among them, would wait in the kernel's queue. Such a
connection is closed by granian after ``REQUEST_BODY_SECONDS`` (its header read timeout);
within that time, how many of them one address may hold is capped here.

A thread of each process (`IdleCap`) looks a few times a second, at a cost that stays small
until someone is over the cap:

1. While the process holds no more descriptors than the cap, no address can be over it: the
   look is one directory read (``/proc/self/fd``).
2. Otherwise it asks the kernel (``sock_diag``, filtered in the kernel on the listening port)
   for the established connections to the server, and counts them by peer address.
3. Only when an address holds more than the cap does it find which of them are this
   process's own, and which of those are **idle** (`Connection.idle`, from ``TCP_INFO``):
   no request of it is in the application (`in_flight`, kept by governance/asgi.py), nothing
   is left unsent or unacknowledged, and nothing went either way for `IDLE_AFTER_MS`, or for
   `AWAITING_AFTER_MS` when the client spoke last (headers never finished, or a request not
   yet handed to the application: given longer). That is a connection that sent nothing yet
   or one byte and no more, a keep-alive one between requests. Beyond
   ``MAX_IDLE_CONNECTIONS_PER_ADDRESS`` of them, the ones silent longest are shut down
   (``shutdown(2)`` on a duplicate of the descriptor, once its ``TCP_INFO`` has been read
   again and still says idle: granian reads the end of the stream and closes the connection
   itself, freeing its slot and descriptor; nothing is closed behind its back).

A request in progress (a long poll, a live stream, a body being read) is never cut. Addresses
in ``TRUSTED_PROXIES`` are not counted: a reverse proxy carries many clients, and its own
limits apply. Linux only (``/proc``, ``sock_diag``, ``TCP_INFO``); elsewhere the cap is off,
and the server says so when it starts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Silent this long before a connection may count as idle: one that sent nothing, or whose
# last request was answered.
IDLE_AFTER_MS = 500
# The same when the client spoke after the server's last answer, which is a request not yet
# whole (headers sent a byte at a time, or one byte and no more) or one whole but not yet
# handed to the application by a busy process: given longer, so a request is never cut for
# waiting on the event loop.
AWAITING_AFTER_MS = 1000
# How often the sweep looks. A source over the cap is cut back within this plus the above,
# inside the 2 s in which a new valid connection must be answered.
EVERY_S = 0.25

# The peers (the ASGI scope's "client": host and port, which granian gives as text) of the
# connections whose request is in the application. Written on the event loop, copied by the
# sweep's thread (a set's copy holds the GIL throughout).
in_flight: set[tuple[str, int | str]] = set()


@dataclass(frozen=True)
class Connection:
    """One of this process's connections from an address over the cap, with what the kernel
    says of it."""

    fd: int
    inode: int
    port: int  # the peer's
    silent_ms: int  # since data last went either way
    awaiting: bool  # the client spoke after the server last did
    pending: bool  # bytes unsent or unacknowledged

    @property
    def idle(self) -> bool:
        """Idle by what the kernel says (a request in the application is not seen here)."""
        wait = AWAITING_AFTER_MS if self.awaiting else IDLE_AFTER_MS
        return not self.pending and self.silent_ms >= wait


def normal(host: str | bytes) -> Address | None:
    """An address as compared here (from text, or the 4 or 16 bytes of the kernel's): an
    IPv4 address mapped into IPv6 is the IPv4 one."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_trusted(address: Address, trusted: Sequence[Network]) -> bool:
    return any(address in network for network in trusted if network.version == address.version)


def to_cut(connections: Iterable[Connection], cap: int, busy: set[int]) -> list[Connection]:
    """Of one address's connections, the idle ones beyond ``cap``, silent longest first.
    ``busy``: the peer ports of that address whose request is in the application."""
    idle = sorted((c for c in connections if c.port not in busy and c.idle),
                  key=lambda c: c.silent_ms, reverse=True)
    return idle[:max(0, len(idle) - cap)]


def busy_ports(address: Address) -> set[int]:
    """The ports of ``address`` whose request is in the application now."""
    ports: set[int] = set()
    for host, port in in_flight.copy():
        if normal(host) == address:
            with contextlib.suppress(TypeError, ValueError):
                ports.add(int(port))
    return ports


# --- sock_diag (linux/inet_diag.h, linux/netlink.h) -------------------------------------------
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY = 4, 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_REQ_BYTECODE = 1
_INET_DIAG_BC_S_GE, _INET_DIAG_BC_S_LE = 2, 3
_TCP_ESTABLISHED = 1
_NLMSG_HEADER = struct.Struct("=IHHII")
# struct inet_diag_msg: family, state, timer, retrans, sport, dport (network order), src, dst,
# interface, cookie, expires, rqueue, wqueue, uid, inode.
_DIAG_MESSAGE = struct.Struct("=BBBB2s2s16s16sI8xIIIII")

# The peer's address (4 bytes for IPv4, mapped ones included, else 16), its port, the inode.
Peer = tuple[bytes, int, int]
_MAPPED = bytes(10) + b"\xff\xff"  # ::ffff:a.b.c.d


def _diag_request(family: int, port: int, seq: int) -> bytes:
    """A dump of the established TCP connections whose local port is ``port``. The filter is
    the kernel's bytecode: "sport >= port", then "sport <= port"; a failed test jumps past the
    end (its length + 4), which rejects the socket."""
    ops = (struct.pack("=BBH", _INET_DIAG_BC_S_GE, 8, 20) + struct.pack("=BBH", 0, 0, port)
           + struct.pack("=BBH", _INET_DIAG_BC_S_LE, 8, 12) + struct.pack("=BBH", 0, 0, port))
    body = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_ESTABLISHED)
            + bytes(48)  # struct inet_diag_sockid: unused by a dump
            + struct.pack("=HH", 4 + len(ops), _INET_DIAG_REQ_BYTECODE) + ops)
    return _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY,
                              _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0) + body


def parse_diag(data: bytes, seq: int) -> tuple[list[Peer], bool]:
    """The connections in one netlink read of the dump ``seq``, and whether it is over."""
    found: list[Peer] = []
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(data):
        length, kind, _, message_seq, _ = _NLMSG_HEADER.unpack_from(data, offset)
        if length < _NLMSG_HEADER.size:
            break
        if message_seq == seq:
            if kind == _NLMSG_DONE:
                return found, True
            if kind == _NLMSG_ERROR:
                (error,) = struct.unpack_from("=i", data, offset + _NLMSG_HEADER.size)
                raise OSError(-error, f"sock_diag: {os.strerror(-error)}")
            if kind == _SOCK_DIAG_BY_FAMILY:
                family, _, _, _, _, port, _, peer, *_, inode = _DIAG_MESSAGE.unpack_from(
                    data, offset + _NLMSG_HEADER.size)
                if family == socket.AF_INET or peer[:12] == _MAPPED:
                    peer = peer[12:] if family != socket.AF_INET else peer[:4]
                found.append((peer, int.from_bytes(port, "big"), inode))
        offset += (length + 3) & ~3
    return found, False


def established(listeners: Iterable[tuple[int, int]]) -> list[Peer]:
    """The established connections to ``listeners`` (family, port): every process's
    (granian's workers share the port), so a count per address is at least this process's.
    (An IPv6 listener's IPv4 clients are IPv6 sockets, their addresses mapped.)"""
    found: list[Peer] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as netlink:
        netlink.settimeout(2)
        for seq, (family, port) in enumerate(listeners, start=1):
            netlink.send(_diag_request(family, port, seq))
            done = False
            while not done:
                part, done = parse_diag(netlink.recv(1 << 17), seq)
                found.extend(part)
    return found


def crowded(peers: Iterable[Peer], cap: int, trusted: Sequence[Network]
            ) -> dict[Address, list[Peer]]:
    """The untrusted addresses holding more than ``cap`` connections, with them: a necessary
    condition of holding more than ``cap`` idle ones."""
    by_peer: dict[bytes, list[Peer]] = defaultdict(list)
    for peer in peers:
        by_peer[peer[0]].append(peer)
    over: dict[Address, list[Peer]] = {}
    for raw, held in by_peer.items():
        if len(held) > cap:
            address = normal(raw)
            if address is not None and not is_trusted(address, trusted):
                over[address] = held
    return over


# --- the process's own sockets ----------------------------------------------------------------
# struct tcp_info (linux/tcp.h): offsets of the fields read, __u32 but the __u64 byte count.
_UNACKED, _LAST_DATA_SENT, _LAST_DATA_RECV, _BYTES_RECEIVED, _NOTSENT_BYTES = 24, 44, 52, 128, 144


def _descriptors() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _sockets(fds: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(descriptor, inode) of each socket among ``fds``."""
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            status = os.fstat(fd)
            if stat.S_ISSOCK(status.st_mode):
                yield fd, status.st_ino


@contextlib.contextmanager
def _same_socket(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd`` if it is still the socket ``inode`` (granian may have closed the
    descriptor and reused its number meanwhile), else None."""
    try:
        copy = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        dup = socket.socket(fileno=copy)
    except OSError:  # no longer a socket: the number was reused
        os.close(copy)
        yield None
        return
    with dup:
        try:
            same = os.fstat(dup.fileno()).st_ino == inode
        except OSError:
            same = False
        yield dup if same else None


def listeners(fds: Iterable[int]) -> set[tuple[int, int]]:
    """(family, port) of the TCP sockets the process listens on (granian's worker holds its
    listener)."""
    found: set[tuple[int, int]] = set()
    for fd, inode in _sockets(fds):
        with _same_socket(fd, inode) as sock, contextlib.suppress(OSError):
            if (sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                found.add((sock.family, sock.getsockname()[1]))
    return found


def _read(sock: socket.socket, fd: int, inode: int, port: int) -> Connection:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    (unacked,) = struct.unpack_from("=I", info, _UNACKED)
    # Milliseconds since data was last sent, and received; both count from the connection's
    # start while there was none.
    (sent,) = struct.unpack_from("=I", info, _LAST_DATA_SENT)
    (received,) = struct.unpack_from("=I", info, _LAST_DATA_RECV)
    spoke = (struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]
             if len(info) >= _BYTES_RECEIVED + 8 else 1)  # before Linux 4.1: assume it spoke
    notsent = (struct.unpack_from("=I", info, _NOTSENT_BYTES)[0]
               if len(info) >= _NOTSENT_BYTES + 4 else 0)
    # A request sent with the connection's first packets counts from the same start as
    # "nothing sent": equal times with bytes received are the client speaking last.
    return Connection(fd=fd, inode=inode, port=port, silent_ms=min(sent, received),
                      awaiting=spoke > 0 and received <= sent,
                      pending=bool(unacked or notsent))


def looked_at(fd: int, inode: int, port: int) -> Connection | None:
    """The connection behind ``fd``, with its TCP_INFO; None if it is gone."""
    with _same_socket(fd, inode) as sock:
        if sock is None:
            return None
        try:
            return _read(sock, fd, inode, port)
        except OSError:
            return None


def shut(connection: Connection) -> bool:
    """End ``connection`` if its descriptor is still it and it is still idle (its TCP_INFO
    read again: the look that chose it may have taken a while), without closing the
    descriptor."""
    with _same_socket(connection.fd, connection.inode) as sock:
        if sock is None:
            return False
        try:
            if not _read(sock, connection.fd, connection.inode, connection.port).idle:
                return False
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # it ended meanwhile
            return False
        return True


class IdleCap:
    """The sweep of one process (module docstring). `sweep` is one look; `start` runs it
    every `EVERY_S` on a daemon thread."""

    def __init__(self, cap: int, trusted: Sequence[Network]) -> None:
        self.cap = cap
        self.trusted = list(trusted)
        self.listeners: set[tuple[int, int]] = set()  # found once there are connections
        self._listeners_looked_at = -60.0
        self.closed = 0  # connections cut since the start, for the log
        self._reported_at = -60.0

    def sweep(self) -> int:
        """One look; returns how many connections were cut."""
        fds = _descriptors()
        if len(fds) <= self.cap:
            return 0
        if not self.listeners and time.monotonic() - self._listeners_looked_at >= 10:
            self._listeners_looked_at = time.monotonic()
            self.listeners = listeners(fds)
        if not self.listeners:
            return 0  # serving no TCP port (a Unix socket): nothing to count
        over = crowded(established(self.listeners), self.cap, self.trusted)
        if not over:
            return 0
        own = {inode: fd for fd, inode in _sockets(fds)}
        cut: dict[Address, int] = {}
        for address, held in over.items():
            # Those with a request in the application are never idle: no need to ask the
            # kernel about them (an address's streams and long polls, say).
            busy = busy_ports(address)
            mine = [(own[inode], inode, port) for _, port, inode in held
                    if inode in own and port not in busy]
            if len(mine) <= self.cap:
                continue
            looked = [c for c in (looked_at(*m) for m in mine) if c is not None]
            # Asked again after the looks: a request that came in while they were made shows
            # there, or as fresh data when it is cut.
            chosen = to_cut(looked, self.cap, busy_ports(address))
            cut[address] = sum(shut(c) for c in chosen)
        self.closed += sum(cut.values())
        self._report(cut)
        return sum(cut.values())

    def _report(self, cut: dict[Address, int]) -> None:
        # Once a minute at most: an attack must not fill the log.
        now = time.monotonic()
        if any(cut.values()) and now - self._reported_at >= 60:
            self._reported_at = now
            which = ", ".join(f"{peer} ({n})" for peer, n in list(cut.items())[:5] if n)
            log.warning("idle connections over MAX_IDLE_CONNECTIONS_PER_ADDRESS=%d closed: "
                        "%s; %d by this process since it started", self.cap, which,
                        self.closed)

    def run(self) -> None:
        failed_at = -60.0
        while True:
            time.sleep(EVERY_S)
            try:
                self.sweep()
            except Exception:
                if time.monotonic() - failed_at >= 60:
                    failed_at = time.monotonic()
                    log.exception("the idle connection sweep failed; it goes on")

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="idle-connection-cap", daemon=True)
        thread.start()
        return thread


_started: IdleCap | None = None
_start_lock = threading.Lock()


def supported() -> bool:
    return (os.path.isdir("/proc/self/fd") and hasattr(socket, "TCP_INFO")
            and hasattr(socket, "AF_NETLINK"))


def start(cap: int, trusted: Sequence[Network]) -> IdleCap | None:
    """The process's sweep, started once (by the ASGI lifespan's startup); None where the
    kernel offers no way to see the connections (not Linux)."""
    global _started
    with _start_lock:
        if _started is None:
            if not supported():
                log.warning("MAX_IDLE_CONNECTIONS_PER_ADDRESS is not enforced on this system "
                            "(it needs Linux: /proc, sock_diag and TCP_INFO)")
                return None
            _started = IdleCap(cap, trusted)
            _started.start()
        return _started


def _reset() -> None:
    # A forked child has none of the parent's threads: it starts its own sweep.
    global _started, _start_lock
    _started, _start_lock = None, threading.Lock()
    in_flight.clear()


os.register_at_fork(after_in_child=_reset)
