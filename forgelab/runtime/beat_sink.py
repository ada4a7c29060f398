"""Heartbeats from other hosts: the controller's UDP sink for the records `forgelab.runtime.liveness` sends.

    sink = beat_sink()                        # started on first use; one per controller process
    sink.address                              # what a process on another host is given: (addresses, port, key)
    sink.record(pid)                          # the newest record from that process (None: none heard)
    sink.stacks(pid, timeout_s=3.0)           # its Python stacks, dumped by its own heartbeat thread

A process on this host writes its heartbeat to a file the watchdog reads (`liveness.liveness_dir`). A process
on another host (an ssh or Slurm job's worker) cannot: its files are on its own disk. So its heartbeat thread
also sends each record, as one UDP datagram, to this sink, over whatever network the job's own channel uses.
A datagram is ``HMAC-SHA256(key, body) + body`` with a JSON body; the key is made here, handed to each process
in its spawn message (Monarch's channel) and never written anywhere, so a datagram from anyone else is dropped
(a forged heartbeat could hide a hang). The sink answers a beat with a request for a stack dump when one is
wanted; the process's heartbeat thread then writes its `faulthandler` dump and sends it back: the stacks of a
deadlocked process on a host where neither py-spy nor a signal from here can reach it. A stopped process (SIGSTOP,
a frozen host) sends nothing, which is how it is found, and cannot dump until it runs again.

Listeners (docs/security.md): one UDP socket on all interfaces, port chosen by the kernel, started only when a
part is spawned on a job's hosts.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["BeatSink", "beat_sink", "controller_addresses", "pack", "running_sink", "unpack"]

MAX_DATAGRAM = 60_000
"""A datagram's largest body (bytes); a longer stack dump is cut to fit, its end kept."""


def pack(key: bytes, body: dict[str, object]) -> bytes:
    """A signed datagram: the HMAC-SHA256 of the JSON body under `key`, then the body."""
    data = json.dumps(body).encode()
    return hmac.new(key, data, hashlib.sha256).digest() + data


def unpack(key: bytes, datagram: bytes) -> dict[str, object] | None:
    """The body of a datagram signed with `key` (None: forged, damaged or not JSON)."""
    mac, data = datagram[:32], datagram[32:]
    if not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).digest()):
        return None
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def controller_addresses() -> list[str]:
    """The IPv4 addresses a process on another host may reach this one at: ``FORGELAB_HEARTBEAT_HOST`` if set
    (a comma-separated list), else the address of the default route's interface, this host name's addresses,
    and loopback (for "hosts" that are this machine)."""
    override = os.environ.get("FORGELAB_HEARTBEAT_HOST")
    if override:
        return [a.strip() for a in override.split(",") if a.strip()]
    found: list[str] = []
    try:  # no packet is sent: connecting a UDP socket only picks the interface of the route
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))
            found.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        found += [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    found.append("127.0.0.1")
    return list(dict.fromkeys(a for a in found if a and a != "0.0.0.0"))


def sink_bind_address() -> str:
    """Where the sink listens: loopback unless ``FORGELAB_HEARTBEAT_HOST`` names the address(es) the job's hosts
    reach this controller at (one address: that one; several: every interface). Loopback by default, as every
    other forgelab listener (docs/security.md): hosts that are this machine (ProcessJob, ssh or Slurm on
    localhost) reach it there; a real cluster sets the variable."""
    override = [a.strip() for a in os.environ.get("FORGELAB_HEARTBEAT_HOST", "").split(",") if a.strip()]
    if not override:
        return "127.0.0.1"
    return override[0] if len(override) == 1 else "0.0.0.0"


class BeatSink:
    """Receives signed heartbeat records and stack dumps (a daemon thread on one UDP socket)."""

    def __init__(self, bind: str | None = None):
        self.key = secrets.token_bytes(32)
        self.bind = bind or sink_bind_address()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((self.bind, 0))
        self.port: int = self.sock.getsockname()[1]
        self.records: dict[int, dict[str, object]] = {}
        """pid -> the newest record heard from it."""
        self.heard_at: dict[int, float] = {}
        """pid -> when its newest record came (this host's monotonic clock)."""
        self.dropped = 0
        """Datagrams that failed the signature check."""
        self._want: dict[int, str] = {}  # pid -> nonce of a stack dump asked for and not yet answered
        self._dumps: dict[str, str] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._serve, name="forgelab-beat-sink", daemon=True).start()

    @property
    def address(self) -> tuple[list[str], int, str]:
        """What a process is given to send its heartbeats here: (addresses to try, port, key in hex)."""
        return ([self.bind] if self.bind != "0.0.0.0" else controller_addresses()), self.port, self.key.hex()

    def record(self, pid: int) -> dict[str, object] | None:
        """The newest heartbeat record of process `pid` (None: none heard)."""
        with self._cond:
            rec = self.records.get(pid)
            return dict(rec) if rec is not None else None

    def wait_record(self, pid: int, until: Callable[[dict[str, object]], bool],
                    timeout_s: float) -> dict[str, object] | None:
        """The first record of process `pid` (its newest, or one arriving within `timeout_s`) for which
        ``until(record)`` holds; None when none did in time. Woken by each record that arrives, no polling."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                rec = self.records.get(pid)
                if rec is not None and until(rec):
                    return dict(rec)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def stacks(self, pid: int, timeout_s: float) -> str | None:
        """Ask process `pid` for its `faulthandler` dump (sent with its next heartbeat's answer) and wait up to
        `timeout_s` for it; None if none came (the process is stopped, or its host is gone)."""
        nonce = secrets.token_hex(8)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._want[pid] = nonce
            while nonce not in self._dumps:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._want.pop(pid, None)
                    return None
                self._cond.wait(left)
            return self._dumps.pop(nonce)

    def _serve(self) -> None:
        while True:
            try:
                datagram, addr = self.sock.recvfrom(65536)
            except OSError:
                return
            body = unpack(self.key, datagram)
            if body is None:
                self.dropped += 1
                continue
            pid = body.get("pid")
            if not isinstance(pid, int):
                continue
            with self._cond:
                if body.get("kind") == "stacks":
                    self._dumps[str(body.get("nonce"))] = str(body.get("text", ""))
                    self._want.pop(pid, None)
                    self._cond.notify_all()
                    continue
                self.heard_at[pid] = time.monotonic()
                self.records[pid] = body
                self._cond.notify_all()  # `wait_record`
                nonce = self._want.get(pid)
            if nonce is not None:
                try:
                    self.sock.sendto(pack(self.key, {"kind": "dump", "nonce": nonce}), addr)
                except OSError:
                    pass


_sink: list[BeatSink] = []
_sink_lock = threading.Lock()


def beat_sink() -> BeatSink:
    """This controller's sink, started on first use."""
    with _sink_lock:
        if not _sink:
            _sink.append(BeatSink())
        return _sink[0]


def running_sink() -> BeatSink | None:
    """This controller's sink if one was started (None: no part on another host yet)."""
    return _sink[0] if _sink else None
