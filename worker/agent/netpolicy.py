"""What the ranks may reach on the network: their rendezvous peers, nothing else.

Ranks share the host's network namespace (their peers sit on other hosts), so
the filter is the kernel's: an iptables chain, jumped to from OUTPUT for every
packet the sandbox user sends (`-m owner --uid-owner`), that lets through only

- TCP to ports in the kernel's ephemeral range (`net.ipv4.ip_local_port_range`),
  where torch.distributed's rendezvous store (the agent picks its port with a
  bind to port 0) and gloo's pair sockets listen, and
- replies on connections a peer opened to the rank,

and rejects the rest: the database, the broker, the API, SSH, DNS and every other
service on a fixed port, on this host or any other (IPv4 and IPv6). The rules
are the same for every agent on a host and are kept as they are when present.
docs/security.md says what this leaves to the operator.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHAIN = "POLYTRAIN-RANKS"
INSTALL_HINT = "install iptables: `apt-get install -y iptables` (make install does it)"
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class NetworkPolicyUnavailable(RuntimeError):
    """The rank network filter cannot be installed; the message says why and the fix."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral TCP port range (first, last), where rendezvous ports fall."""
    first, last = PORT_RANGE.read_text().split()
    return int(first), int(last)


def chain_rules(ports: tuple[int, int], *, ipv6: bool = False) -> list[list[str]]:
    """The chain's rules, in order, as iptables arguments after `-A CHAIN` (spelt as
    `iptables -S` prints them, so an installed chain compares equal)."""
    reject = "icmp6-port-unreachable" if ipv6 else "icmp-port-unreachable"
    return [["-p", "tcp", "-m", "tcp", "--dport", f"{ports[0]}:{ports[1]}", "-j", "RETURN"],
            ["-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "RETURN"],
            ["-j", "REJECT", "--reject-with", reject]]


def apply(uid: int) -> None:
    """Install the filter for packets of `uid` (the sandbox user) with iptables and ip6tables.

    Idempotent; leaves a chain that already holds exactly these rules untouched,
    so agents starting together do not open a gap for each other's ranks.

    Raises:
        NetworkPolicyUnavailable: iptables missing, or the kernel refused a rule.
    """
    ports = ephemeral_ports()
    for tool in ("iptables", "ip6tables"):
        binary = shutil.which(tool)
        if binary is None:
            raise NetworkPolicyUnavailable(f"{tool} not found: {INSTALL_HINT}")
        _apply_one(binary, uid, chain_rules(ports, ipv6=tool == "ip6tables"))


def _apply_one(binary: str, uid: int, rules: list[list[str]]) -> None:
    expected = [f"-N {CHAIN}", *(f"-A {CHAIN} " + " ".join(rule) for rule in rules)]
    listed = _run(binary, "-S", CHAIN, check=False)
    if listed.returncode != 0:
        _run(binary, "-N", CHAIN)
    if listed.stdout.splitlines() != expected:
        _run(binary, "-F", CHAIN)
        for rule in rules:
            _run(binary, "-A", CHAIN, *rule)
    jump = ["OUTPUT", "-m", "owner", "--uid-owner", str(uid), "-j", CHAIN]
    if _run(binary, "-C", *jump, check=False).returncode != 0:
        _run(binary, "-I", *jump)


def _run(binary: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([binary, "-w", "10", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkPolicyUnavailable(
            f"{Path(binary).name} {' '.join(args)} failed: {done.stderr.strip()} "
            "(the agent needs root and a kernel with the owner and conntrack matches)")
    return done
