"""What the ranks may reach on the network: their own task's ranks, nothing else.

Ranks share the host's network namespace (their peers sit on other hosts), so
the filter is the kernel's, with iptables and ip6tables. Every rank slot runs
as its own user from a pool of sandbox uids (`worker.agent.uids.UidPool`);
each of their packets jumps from OUTPUT (`-m owner --uid-owner FIRST-LAST`) to
the chain :data:`CHAIN`, which sends each uid on to its own chain
(``POLYTRAIN-U<uid>``, with goto: a RETURN there ends the filter's verdict
for the packet as "allowed"). A uid's chain rejects everything until the
agent admits the slot to a task (:func:`admit`), and again once it is
revoked (:func:`revoke`, when the slot's process has ended). An admitted uid
may send:

- new TCP connections to ports in the kernel's ephemeral range
  (`net.ipv4.ip_local_port_range`), where torch.distributed's rendezvous
  store (rank 0 binds a port the kernel picks) and gloo's pair sockets
  listen, on this host or on a host its task's agents claimed a share from
  (the peers, `worker.agent.runner.Peers`, updated as they claim); the
  connection's conntrack mark is set to the task id;
- packets of connections marked with its own task id: those it opened, and
  replies on connections that a rank of the same task on this host opened to it;
- replies on unmarked connections, which a peer host (or the agent) opened to it.

A new connection to, or a reply to, another host in that port range is
dropped without an answer (a peer may not be listed yet: TCP tries again).

Everything else is rejected (a connection the rank opens to a refused port is
reset at once): the database, the broker, the API, SSH, DNS and every service
on a fixed port, on this host or any other; and a rank of another task on this
host, whose connection carries that task's mark (the listening rank's reply is
dropped, so that connection attempt times out). What the filter cannot tell apart is a
connection from a rank of another task running on a peer host (the mark does not
travel with the packet): docs/security.md says what that leaves to the operator.

The chain layout is the same for every agent on a host; an agent changes only
the chains of the uids it holds, each change one atomic `iptables-restore
--noflush` transaction, so a uid's chain is never seen empty (which, reached by
goto, would allow everything).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

CHAIN = "POLYTRAIN-RANKS"
INSTALL_HINT = "install iptables: `apt-get install -y iptables` (make install does it)"
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
TOOLS = ("iptables", "ip6tables")
MAX_MARK = 2**32 - 1


class NetworkPolicyUnavailable(RuntimeError):
    """The rank network filter cannot be installed; the message says why and the fix."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral TCP port range (first, last), where rendezvous ports fall."""
    first, last = PORT_RANGE.read_text().split()
    return int(first), int(last)


def uid_chain(uid: int) -> str:
    """The chain holding what sandbox uid `uid` may send."""
    return f"POLYTRAIN-U{uid}"


def _reject(ipv6: bool) -> list[list[str]]:
    icmp = "icmp6-port-unreachable" if ipv6 else "icmp-port-unreachable"
    return [
        ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
        ["-j", "REJECT", "--reject-with", icmp],
    ]


def admitted_rules(
    task_id: int, ports: tuple[int, int], peers: Sequence[str] = (), *, ipv6: bool = False
) -> list[list[str]]:
    """The rules of a uid admitted to task `task_id` whose ranks on other hosts are at the
    addresses `peers` (of this rule set's family), spelt as `iptables -S` prints them.

    Connections to and from this host's own addresses are judged by the mark alone.
    A new connection to, or a reply to, a host not (yet) among `peers` is dropped
    without an answer, so TCP tries again and gets through once the peer's agent
    has claimed its share and the rules list it. Raises ValueError for a task id
    that is no valid conntrack mark (1 to 2**32 - 1).
    """
    if not 1 <= task_id <= MAX_MARK:
        raise ValueError(f"task id {task_id} is outside the conntrack mark range 1..{MAX_MARK}")
    mark, width = hex(task_id), 128 if ipv6 else 32
    places = [
        ["-m", "addrtype", "--dst-type", "LOCAL"],
        *(["-d", f"{peer}/{width}"] for peer in peers),
    ]
    new = [
        "-p",
        "tcp",
        "-m",
        "conntrack",
        "--ctstate",
        "NEW",
        "-m",
        "tcp",
        "--dport",
        f"{ports[0]}:{ports[1]}",
    ]
    reply = [
        "-p",
        "tcp",
        "-m",
        "conntrack",
        "--ctstate",
        "ESTABLISHED",
        "--ctdir",
        "REPLY",
        "-m",
        "connmark",
        "--mark",
        "0x0",
    ]
    rules = []
    for place in places:
        rules += [
            [*new[:2], *place, *new[2:], "-j", "CONNMARK", "--set-xmark", f"{mark}/0xffffffff"],
            [*new[:2], *place, *new[2:], "-j", "RETURN"],
        ]
    rules.append(
        [
            "-m",
            "conntrack",
            "--ctstate",
            "RELATED,ESTABLISHED",
            "-m",
            "connmark",
            "--mark",
            mark,
            "-j",
            "RETURN",
        ]
    )
    rules += [[*reply[:2], *place, *reply[2:], "-j", "RETURN"] for place in places]
    return [*rules, [*new, "-j", "DROP"], [*reply, "-j", "DROP"], *_reject(ipv6)]


def closed_rules(*, ipv6: bool = False) -> list[list[str]]:
    """The rules of a uid not admitted to any task: reject everything."""
    return _reject(ipv6)


def main_rules(uids: range, *, ipv6: bool = False) -> list[list[str]]:
    """The rules of :data:`CHAIN`: each pool uid to its own chain, anything else rejected."""
    return [*(_goto(uid) for uid in uids), *_reject(ipv6)]


def install(uids: range) -> None:
    """Install the filter for the sandbox uids `uids` with iptables and ip6tables.

    Idempotent: a host whose chains already match is left untouched, and the
    chains of uids another agent on this host holds are never reset, so agents
    starting together do not open a gap for each other's ranks.

    Raises:
        NetworkPolicyUnavailable: iptables missing, or the kernel refused a rule.
    """
    for tool in TOOLS:
        binary = _binary(tool)
        ipv6 = tool == "ip6tables"
        chains = {
            line.split()[1]
            for line in _run(binary, "-S").stdout.splitlines()
            if line.startswith("-N ")
        }
        missing = [uid for uid in uids if uid_chain(uid) not in chains]
        declare = [f":{uid_chain(uid)} - [0:0]" for uid in missing]
        rules = [
            _append(uid_chain(uid), rule) for uid in missing for rule in closed_rules(ipv6=ipv6)
        ]
        expected = [f"-N {CHAIN}", *(_append(CHAIN, r) for r in main_rules(uids, ipv6=ipv6))]
        if CHAIN not in chains or _run(binary, "-S", CHAIN).stdout.splitlines() != expected:
            declare.append(f":{CHAIN} - [0:0]")
            rules += expected[1:]
        if declare:
            _restore(tool, declare + rules)
        jump = _output_jump(uids)
        if _run(binary, "-C", *jump, check=False).returncode != 0:
            _run(binary, "-I", *jump)


def admit(uid: int, task_id: int, uids: range, peers: Sequence[str] = ()) -> None:
    """Let sandbox uid `uid` of the pool `uids` reach the ranks of task `task_id`: on this
    host, and on the hosts `peers` (names or addresses; again with more as they claim).

    Installs the pool's chains and jump again first if they are gone (a
    firewall reload, `iptables -F`), so a rank never runs unfiltered. Raises
    NetworkPolicyUnavailable if the kernel refused a change, ValueError for a
    task id outside 1..2**32 - 1.
    """
    if not all(_jumps_in_place(_binary(tool), uid, uids) for tool in TOOLS):
        install(uids)
    ports = ephemeral_ports()
    for tool in TOOLS:
        ipv6 = tool == "ip6tables"
        _set_chain(
            tool, uid, admitted_rules(task_id, ports, addresses(peers, ipv6=ipv6), ipv6=ipv6)
        )


def _jumps_in_place(binary: str, uid: int, uids: range) -> bool:
    """Whether OUTPUT still jumps to :data:`CHAIN` for the pool and :data:`CHAIN` still sends
    `uid` to its own chain (two `-C` checks, instead of :func:`install`'s listing)."""
    return all(
        _run(binary, "-C", *rule, check=False).returncode == 0
        for rule in (_output_jump(uids), [CHAIN, *_goto(uid)])
    )


def _output_jump(uids: range) -> list[str]:
    """The OUTPUT rule sending the pool's packets to :data:`CHAIN`."""
    return ["OUTPUT", "-m", "owner", "--uid-owner", f"{uids[0]}-{uids[-1]}", "-j", CHAIN]


def _goto(uid: int) -> list[str]:
    """The :data:`CHAIN` rule sending `uid`'s packets to its own chain."""
    return ["-m", "owner", "--uid-owner", str(uid), "-g", uid_chain(uid)]


def addresses(hosts: Sequence[str], *, ipv6: bool) -> list[str]:
    """The IPv4 (or IPv6) addresses of `hosts` (names or addresses), sorted; a name that
    does not resolve gives none (its ranks stay unreachable, so the task fails visibly)."""
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    found: set[str] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        found.update(str(info[4][0]) for info in infos)
    return sorted(found)


def revoke(uid: int) -> None:
    """Reject everything sandbox uid `uid` sends again. Raises NetworkPolicyUnavailable."""
    for tool in TOOLS:
        _set_chain(tool, uid, closed_rules(ipv6=tool == "ip6tables"))


def _set_chain(tool: str, uid: int, rules: list[list[str]]) -> None:
    chain = uid_chain(uid)
    _restore(tool, [f":{chain} - [0:0]", *(_append(chain, rule) for rule in rules)])


def _append(chain: str, rule: list[str]) -> str:
    return f"-A {chain} " + " ".join(rule)


def _binary(tool: str) -> str:
    binary = shutil.which(tool)
    if binary is None:
        raise NetworkPolicyUnavailable(f"{tool} not found: {INSTALL_HINT}")
    return binary


def _restore(tool: str, lines: list[str]) -> None:
    """Apply `lines` to the filter table in one transaction (declared chains are emptied
    first; nothing else is touched)."""
    binary = _binary(f"{tool}-restore")
    script = "\n".join(["*filter", *lines, "COMMIT", ""])
    done = subprocess.run(
        [binary, "--noflush", "-w", "10"], input=script, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise NetworkPolicyUnavailable(
            f"{Path(binary).name} failed: {done.stderr.strip()} (the agent needs root and a "
            "kernel with the owner, conntrack and connmark matches)"
        )


def _run(binary: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([binary, "-w", "10", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkPolicyUnavailable(
            f"{Path(binary).name} {' '.join(args)} failed: {done.stderr.strip()} "
            "(the agent needs root and a kernel with the owner and conntrack matches)"
        )
    return done
