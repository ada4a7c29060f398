"""A single-node Slurm cluster on loopback for the tests: its own munged, slurmctld and slurmd, state in a temp dir.

    with SlurmCluster(tmp_dir) as cluster:      # starts munged, slurmctld, slurmd; waits until the node is idle
        env = cluster.env                      # os.environ + SLURM_CONF: pass it to sbatch/squeue/scancel
        subprocess.run(["sbatch", "--wrap", "hostname"], env=env)

Nothing of the machine's own Slurm or munge setup is used or changed: the cluster has its own slurm.conf, munge
key and socket, ports chosen free here, and every daemon runs in the foreground as a child of this process
(stopped on exit, its job steps with it). The node is this machine's hostname at 127.0.0.1 with 2 CPUs;
process tracking is `proctrack/linuxproc` (no cgroups needed, as in a container). Needs root (slurmd starts job
steps as the submitting user) and the Debian packages `slurm-wlm` and `munge` (`make setup` installs them).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why a cluster cannot start here (None: it can)."""
    absent = [b for b in (*DAEMONS, "sbatch", "squeue", "scancel", "scontrol") if _which(b) is None]
    if absent:
        return (f"Slurm/munge not installed ({', '.join(absent)} missing); `make setup` installs slurm-wlm and munge "
                "as root with apt")
    if os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd starts job steps as the submitting user)"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/usr/bin")
                                       if os.access(f"{d}/{name}", os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """munged + slurmctld + slurmd on loopback, configured under `root` (see the module docstring)."""

    def __init__(self, root: Path, cpus: int = 2, memory_mb: int = 4000) -> None:
        self.root = Path(root)
        self.node = socket.gethostname()
        self.cpus, self.memory_mb = cpus, memory_mb
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- lifecycle --------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "munge.sock"
        self.conf.write_text(self._slurm_conf(sock))
        try:
            self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                                   f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                                   f"--seed-file={r / 'munge' / 'munged.seed'}"])
            self._wait(lambda: sock.exists(), "munged to create its socket", timeout)
            # -i: ignore saved state (a fresh cluster); -D: foreground
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), "slurmctld to answer scontrol ping", timeout)
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
            self._wait(lambda: self._ok(["sinfo", "-h", "-N", "-o", "%t"], "idle"), f"node {self.node} to be idle",
                       timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (in that order); each is waited on."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env, capture_output=True,
                           timeout=30)
        for name in reversed(DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    # -- helpers ----------------------------------------------------------
    def log(self, name: str) -> str:
        p = self.root / f"{name}.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster (`check`ed)."""
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout, check=True)

    def _slurm_conf(self, munge_socket: Path) -> str:
        r = self.root
        return "\n".join([
            "ClusterName=forgelab-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin", "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "KillWait=5", "MinJobAge=300", "InactiveLimit=0", "SlurmdTimeout=60", "SlurmctldTimeout=60",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _spawn(self, name: str, argv: list[str]) -> None:
        binary = _which(argv[0])
        if binary is None:
            raise RuntimeError(f"{argv[0]} is not installed; `make setup` installs slurm-wlm and munge (root + apt)")
        out = open(self.root / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen([binary, *argv[1:]], env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def _ok(self, argv: list[str], needle: str) -> bool:
        try:
            out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return needle in out.stdout

    def _wait(self, cond, what: str, timeout: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    out = (self.root / f"{name}.out").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}: {out}\n"
                                       f"{self.log(name)}")
            if cond():
                return
            time.sleep(0.2)  # polling a condition, bounded by the deadline
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\nslurmctld: {self.log('slurmctld')}\n"
                           f"slurmd: {self.log('slurmd')}")
