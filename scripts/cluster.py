"""A cluster on one machine: K nodes as Linux network namespaces, each with its own hostname,
joined through a bridge by links whose rate `tc` can limit, and MPI jobs launched across them.

    python scripts/cluster.py up --nodes 2 [--rate 1gbit] [--mtu 9000] [--name cfp]   # as root
    python scripts/cluster.py run [--name cfp] --ranks-per-node 2 [--placement cyclic] -- python -m mpi4py scripts/train.py ...
    python scripts/cluster.py status [--name cfp]
    python scripts/cluster.py down [--name cfp]
    python scripts/cluster.py test [--rate 1gbit] [--ranks "2 4"] [PYTEST ARGS]   # make test-cluster

Node k is the namespace NAME-nK (hostname NAME-nK inside), with one interface `cfpnet` at
198.18.0.(k+1)/24 (the range reserved for network benchmarking, RFC 2544), whose other end is
NAMEhK in the machine's own namespace, on the bridge NAMEbr. Names resolve through
/etc/netns/NAME-nK/hosts (which `ip netns exec` mounts over /etc/hosts inside the node): the
machine's own /etc/hosts is never touched. `--rate` limits what each node sends (a tbf qdisc
on its interface); without it the links are unshaped (memory speed). `--mtu` sets the links'
largest packet (the kernel's 1500 by default; 9000 is Ethernet's jumbo frames, common on
cluster networks): every packet costs this machine's cores some work in the kernel, which on a
real cluster the network card and the other node do, so at 1500 a 1 Gbit/s link here costs
the ranks about as much CPU time as wire time, and a transfer cannot hide behind computation
(BENCHMARKS.md, the overlap section).

`run` starts mpiexec inside node 0 with the ranks spread R per node, MPI told to use the
network, through a script (launch.sh) that runs each node's part of the launch in its namespace
as ssh would on a real cluster:
- MPICH (the wheel, or a system one): its OFI netmod over TCP on `cfpnet`
  (MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=cfpnet; by default its UCX netmod would
  move the data through shared memory across namespaces), hydra's ssh launcher
  (`-launcher ssh -launcher-exec launch.sh -hosts ...`).
- Open MPI 4.x: the ob1 PML with the TCP BTL on `cfpnet` between nodes and shared memory
  (vader) inside one (OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,vader,self
  OMPI_MCA_btl_tcp_if_include=cfpnet OMPI_MCA_oob_tcp_if_include=cfpnet), its rsh launcher
  (OMPI_MCA_plm_rsh_agent=launch.sh, `--host ...`), OMPI_MCA_mpi_yield_when_idle=1 (the
  nodes share this machine's cores: ranks that wait in a collective spinning took them from
  the ranks computing, a 2 x 2 step measured 3-5x slower), and, as root, OMPI_ALLOW_RUN_AS_ROOT.
  Open MPI 5 (PRRTE's launcher, other parameter names) and other MPIs are refused by name.
The environment is printed. After the run it reads the links' byte counters: a run across
nodes whose bytes did not cross a link is reported as a failure, never counted as a network
run. Ranks of one node share memory, as on a real cluster.

`up` refuses when not root, when ip, tc or unshare are missing, or when anything of the
cluster's name is already there (`down` removes it). `down` removes every namespace, link and
file of the name, whatever state a failed run left; the `test` command and the `cluster`
context always call it, also on failure and Ctrl-C. Only the addresses of the cluster's own
namespaces are used; nothing reaches outside the machine.
"""
import argparse
import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import importlib.util
import time

IFACE = "cfpnet"  # the node-side interface, the same name in every node (FI_TCP_IFACE)
SUBNET = "198.18.0"  # node k at SUBNET.(k+1)/24
STATE_ROOT = "/tmp/cfp-cluster"
PLACEMENTS = ("block", "cyclic")  # ranks to nodes: in blocks of R, or one a node in turn
RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# which MPI a launcher belongs to: the test harness's reading of `mpiexec --version`
_SPEC = importlib.util.spec_from_file_location("cfp_launcher", os.path.join(ROOT, "tests", "launcher.py"))
_launcher = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_launcher)


def check_name(name):
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"cluster name {name!r}: expected 1 to 8 lowercase letters and digits, starting with a "
                         f"letter (it prefixes the namespaces and links)")
    return name


def check_rate(rate):
    """None (unshaped) or a rate tc's tbf takes: a number and a unit (bit, kbit, mbit, gbit, bps, ...)."""
    if rate is None:
        return None
    if not isinstance(rate, str) or not RATE.match(rate):
        raise ValueError(f"link rate {rate!r}: expected a number and a unit tc understands, e.g. 1gbit, "
                         f"100mbit or 50mbps")
    return rate.lower()


def check_mtu(mtu):
    """None (the kernel's default, 1500) or a packet size from 576 to 65535 bytes."""
    if mtu is None:
        return None
    if not isinstance(mtu, int) or isinstance(mtu, bool) or not 576 <= mtu <= 65535:
        raise ValueError(f"--mtu {mtu!r}: expected a whole number of bytes from 576 to 65535 (9000: jumbo frames)")
    return mtu


def check_nodes(nodes):
    if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= 16:
        raise ValueError(f"--nodes {nodes!r}: expected a whole number of nodes from 1 to 16")
    return nodes


def ranks_per_node(nprocs, nodes):
    """R for nprocs ranks on `nodes` nodes, or ValueError naming both."""
    if nprocs < 1 or nprocs % nodes:
        raise ValueError(f"{nprocs} ranks do not divide among {nodes} nodes: expected a multiple of {nodes}")
    return nprocs // nodes


def rate_bytes(rate):
    """Bytes per second of a tc rate ('1gbit' -> 1.25e8)."""
    number, unit = re.match(r"^([\d.]+)([a-z]+)$", rate).groups()
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}.get(unit[0], 1.0) if len(unit) > 3 else 1.0
    return float(number) * scale / (8 if unit.endswith("bit") else 1)


class Cluster:
    """The namespaces, links and files of cluster `name` with `nodes` nodes."""

    def __init__(self, nodes, rate=None, name="cfp", mtu=None):
        self.nodes, self.rate, self.name = check_nodes(nodes), check_rate(rate), check_name(name)
        self.mtu = check_mtu(mtu)
        self.state = os.path.join(STATE_ROOT, self.name)

    # -- names ---------------------------------------------------------------------------------
    def node(self, k):
        return f"{self.name}-n{k}"

    def host_link(self, k):
        return f"{self.name}h{k}"

    @property
    def bridge(self):
        return f"{self.name}br"

    def address(self, k):
        return f"{SUBNET}.{k + 1}"

    @property
    def launcher(self):
        return os.path.join(self.state, "launch.sh")

    @property
    def mpiexec_wrapper(self):
        return os.path.join(self.state, "mpiexec")

    # -- making and removing --------------------------------------------------------------------
    def up(self):
        """Make the cluster; on any failure remove what was made and raise."""
        require_tools()
        found = leftovers(self.name)
        if found:
            raise RuntimeError(f"cluster {self.name!r} is already (partly) up: {', '.join(found)}; "
                               f"run `python scripts/cluster.py down --name {self.name}` first")
        try:
            self._make()
        except BaseException:
            self.down()
            raise

    def _make(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        if self.mtu:
            _ip("link", "set", self.bridge, "mtu", str(self.mtu))
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(k)} {self.node(k)}\n" for k in range(self.nodes))
        for k in range(self.nodes):
            ns, peer = self.node(k), f"{self.name}p{k}"
            _ip("netns", "add", ns)
            _ip("link", "add", self.host_link(k), "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", IFACE)
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", IFACE)
            if self.mtu:
                _ip("-n", ns, "link", "set", IFACE, "mtu", str(self.mtu))
                _ip("link", "set", self.host_link(k), "mtu", str(self.mtu))
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", self.host_link(k), "master", self.bridge)
            _ip("link", "set", self.host_link(k), "up")
            if self.rate:
                # A small bucket, as a wire has none: with 500 KB (rate / 250 at 1gbit) a step's
                # collectives of 100-300 KB each went out at memory speed between refills (its
                # reduce-scatters 8.8 ms a step where 1 Gbit/s needs 22); with 32 KB they take
                # the rate (27.2 ms) and a 16 MiB allreduce still reaches it (152 ms)
                # (and at least one packet: tbf drops a packet larger than its bucket)
                burst = max(32 << 10, int(rate_bytes(self.rate) / 4000), self.mtu or 0)
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFACE, "root", "tbf", "rate",
                      self.rate, "burst", str(burst), "latency", "50ms"])
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)
        os.makedirs(self.state, exist_ok=True)
        with open(os.path.join(self.state, "state.json"), "w") as f:
            json.dump({"name": self.name, "nodes": self.nodes, "rate": self.rate, "mtu": self.mtu}, f)
        self._write_scripts()

    def _write_scripts(self):
        # hydra's ssh launcher and Open MPI's rsh launcher run `launch.sh [ssh options] HOST
        # COMMAND...`: the command (a shell line: Open MPI's sets PATH before starting orted)
        # runs in the node's namespace under its own hostname, as ssh would run it there
        with open(self.launcher, "w") as f:
            f.write('#!/bin/sh\n# cfp cluster: run a launcher\'s proxy in its node (scripts/cluster.py)\n'
                    'while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done\n'
                    'host="$1"; shift\n'
                    'exec ip netns exec "$host" unshare --uts sh -c "hostname $host; cd $PWD; $*"\n')
        os.chmod(self.launcher, 0o755)
        with open(self.mpiexec_wrapper, "w") as f:
            f.write(f"#!/bin/sh\n# cfp cluster {self.name}: mpiexec across its nodes (scripts/cluster.py)\n"
                    f"exec {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))} "
                    f"mpiexec --name {self.name} \"$@\"\n")
        os.chmod(self.mpiexec_wrapper, 0o755)

    def down(self):
        """Remove everything of this cluster's name that exists; returns what was removed."""
        return down(self.name)

    # -- running ---------------------------------------------------------------------------------
    def counters(self):
        """{node: bytes it sent on its link} (the host side's received bytes)."""
        out = {}
        for k in range(self.nodes):
            with open(f"/sys/class/net/{self.host_link(k)}/statistics/rx_bytes") as f:
                out[self.node(k)] = int(f.read())
        return out

    def network_env(self, family=None):
        """What makes the MPI of `family` (default: the mpiexec's) use the links (module docstring)."""
        family = family or mpi_family()
        if family == _launcher.MPICH:
            return {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFACE}
        env = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,vader,self", "OMPI_MCA_btl_tcp_if_include": IFACE,
               "OMPI_MCA_oob_tcp_if_include": IFACE, "OMPI_MCA_plm_rsh_agent": self.launcher,
               "OMPI_MCA_mpi_yield_when_idle": "1"}  # the nodes share the machine's cores
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return env

    def mpiexec_argv(self, nprocs, args, mpiexec=None, placement="block", family=None):
        """The command, run in node 0, that starts `args` on nprocs ranks, nprocs / nodes a node:
        in blocks (ranks 0..R-1 on node 0, the launchers' default, what cfp's grids assume: a
        channel group's neighbours share a node) or cyclic (rank r on node r mod K: neighbours
        on different nodes, to measure a channel group across nodes)."""
        per_node = ranks_per_node(nprocs, self.nodes)
        real = mpiexec or _real_mpiexec()
        family = family or mpi_family(real)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
        env = [f"{k}={v}" for k, v in self.network_env(family).items()]
        if family == _launcher.MPICH:
            chunk = per_node if placement == "block" else 1
            hosts = ",".join(f"{self.node(k)}:{chunk}" for k in range(self.nodes))
            launch = [real, "-launcher", "ssh", "-launcher-exec", self.launcher, "-hosts", hosts]
        else:  # Open MPI 4.x: R slots a node, filled in turn (block) or one a node in turn (cyclic)
            hosts = ",".join(f"{self.node(k)}:{per_node}" for k in range(self.nodes))
            launch = [real, "--host", hosts, "--map-by", "slot" if placement == "block" else "node"]
        inner = shlex.join(["env", *env, *launch, "-n", str(nprocs), *args])
        return ["ip", "netns", "exec", self.node(0), "unshare", "--uts", "sh", "-c",
                f"hostname {self.node(0)}; cd {shlex.quote(os.getcwd())}; exec {inner}"]

    def run(self, nprocs, args, out=None, placement="block"):
        """Run `args` on nprocs ranks across the nodes; returns (exit status, {node: bytes sent}).
        Prints the environment that forces the network, and refuses to count a run across
        nodes whose bytes crossed no link (exit status 3)."""
        out = out or sys.stdout
        print(f"cluster {self.name}: {nprocs} ranks on {self.nodes} nodes ({nprocs // max(self.nodes, 1)} a node, "
              f"{placement}), {' '.join(f'{k}={v}' for k, v in self.network_env().items())}", file=out, flush=True)
        argv = self.mpiexec_argv(nprocs, args, placement=placement)
        before = self.counters()
        # os.environ, not the process's C environment: a process that has initialised Open
        # MPI as a singleton (pytest's, through mpi4py) holds its PMIx variables there, and an
        # mpiexec that inherits them exits 1 without a word
        rc = subprocess.call(argv, env=dict(os.environ))
        after = self.counters()
        sent = {node: after[node] - before[node] for node in after}
        print(f"cluster {self.name}: bytes sent on each node's link: "
              f"{', '.join(f'{n} {b}' for n, b in sent.items())}", file=out, flush=True)
        if rc == 0 and self.nodes > 1 and not all(sent.values()):
            print(f"cluster {self.name}: a node sent nothing on its link: the run did not use the network",
                  file=out, flush=True)
            rc = 3
        return rc, sent


def mpi_family(mpiexec=None):
    """'MPICH' or 'Open MPI', the family of `mpiexec` (default the one cluster runs use), or a
    RuntimeError naming the MPI and what the cluster supports."""
    real = mpiexec or _real_mpiexec()
    if real is None:
        raise RuntimeError("no mpiexec found: install an MPI (make test installs the mpich wheel)")
    return _family(real)


@functools.lru_cache(maxsize=None)
def _family(real):
    family, version = _launcher.family_of(_launcher._run([real, "--version"]))
    if family == _launcher.MPICH or (family == _launcher.OPEN_MPI and version.split(".")[0] == "4"):
        return family
    raise RuntimeError(f"{real} belongs to {family} {version}: the cluster launches MPICH (hydra) and "
                       f"Open MPI 4.x across its nodes")


def _real_mpiexec():
    """The mpiexec of mpi4py's MPI (tests/launcher.py's choice: $MPIEXEC_REAL, else the one next
    to this Python, else the PATH's)."""
    if os.environ.get("MPIEXEC_REAL"):
        return os.environ["MPIEXEC_REAL"]
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def _run(argv):
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"`{shlex.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _ip(*args):
    return _run(["ip", *args])


def require_tools():
    """RuntimeError unless this runs as root with ip, tc and unshare."""
    if os.geteuid() != 0:
        raise RuntimeError("the cluster needs root (network namespaces and links): run as root, e.g. with sudo")
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"the cluster needs {', '.join(missing)} (iproute2, util-linux): not found on the PATH")


def leftovers(name):
    """What of cluster `name` exists: its namespaces, links, /etc/netns entries and state."""
    check_name(name)
    found = []
    if shutil.which("ip"):
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        found += [n for n in namespaces if re.fullmatch(rf"{name}-n\d+", n)]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        found += sorted(set(m for m in re.findall(rf"^\d+: ({name}(?:br|[hp]\d+))[@:]", links, re.M)))
    if os.path.isdir("/etc/netns"):
        found += [f"/etc/netns/{d}" for d in sorted(os.listdir("/etc/netns")) if re.fullmatch(rf"{name}-n\d+", d)]
    if os.path.exists(os.path.join(STATE_ROOT, name)):
        found.append(os.path.join(STATE_ROOT, name))
    return found


def down(name):
    """Remove every namespace, link, /etc/netns entry and state file of cluster `name`;
    returns what it removed."""
    removed = []
    for item in leftovers(name):
        if item.startswith("/"):
            shutil.rmtree(item, ignore_errors=True)
        elif re.fullmatch(rf"{name}-n\d+", item):
            subprocess.run(["ip", "netns", "delete", item], capture_output=True)
        else:
            subprocess.run(["ip", "link", "delete", item], capture_output=True)
        removed.append(item)
    for folder in ("/etc/netns", STATE_ROOT):
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
    return removed


class _Interrupted(Exception):
    pass


@contextlib.contextmanager
def cluster(nodes, rate=None, name="cfp", mtu=None):
    """The cluster, up inside the block and removed after it, also on an error, Ctrl-C or
    SIGTERM (which are turned into an exception here, so the removal runs)."""
    def stop(signum, frame):
        raise _Interrupted(f"signal {signum}")
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    c = Cluster(nodes, rate, name, mtu)
    try:
        c.up()
        yield c
    finally:
        c.down()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _loaded(name):
    """The Cluster of a cluster that is up (its state file), or RuntimeError."""
    path = os.path.join(STATE_ROOT, check_name(name), "state.json")
    if not os.path.exists(path):
        raise RuntimeError(f"cluster {name!r} is not up: run `python scripts/cluster.py up --nodes K --name {name}`")
    with open(path) as f:
        state = json.load(f)
    return Cluster(state["nodes"], state["rate"], state["name"], state.get("mtu"))


def _nprocs(args):
    """P of the first `-n P` / `-np P` in mpiexec's arguments, and the arguments without it."""
    args = list(args)
    for k, a in enumerate(args[:-1]):
        if a in ("-n", "-np"):
            return int(args[k + 1]), args[:k] + args[k + 2:]
    raise ValueError(f"mpiexec: expected -n P among {args!r}")


TEST_FILES = ("tests/test_comm.py", "tests/test_tensor.py", "tests/test_algorithms.py", "tests/test_spatial.py",
              "tests/test_plans.py")


def cluster_test(args, out=None):
    """make test-cluster: the MPI tests at each rank count of --ranks as 2 nodes of P/2 ranks,
    through the cluster's mpiexec (tests/run_suite.py); a float64 training run on 2 x 2 ranks
    that checkpoints, resumed on 2 x 1 (another layout of ranks on nodes and another grid),
    whose ledger is held to the bytes its link carried (_ledger_against_link); the bytes the
    nodes sent on their links; and a check that nothing is left. Skipped, saying why,
    where clusters cannot be made (not root, no ip, tc or unshare)."""
    out = out or sys.stdout
    try:
        require_tools()
    except RuntimeError as e:
        print(f"test-cluster: skipped: {e}", file=out)
        return 0
    with cluster(2, args.rate, args.name, args.mtu) as c:
        start = c.counters()
        env = dict(os.environ, MPIEXEC=c.mpiexec_wrapper)
        pytest_args = args.pytest or list(TEST_FILES)
        rc = subprocess.call([sys.executable, os.path.join(ROOT, "tests", "run_suite.py"), "--no-serial",
                              "--ranks", *args.ranks.split(), "--", *pytest_args], env=env, cwd=ROOT)
        folder = os.path.join(c.state, "checkpoints")
        train = [sys.executable, "-m", "mpi4py", os.path.join(ROOT, "scripts", "train.py"), "--model", "resnet",
                 "--width", "1", "--dataset", "synthetic", "--dtype", "float64", "--batch-size", "16",
                 "--checkpoint-dir", folder, "--no-progress"]
        log = os.path.join(c.state, "resumed.json")
        for nprocs, grid, algorithm, more in ((4, "sample=2,channel=2", "w", ["--max-steps", "6"]),
                                              (2, "channel=2", "y", ["--max-steps", "12", "--resume", "--log", log])):
            if rc == 0:
                rc, moved = c.run(nprocs, [*train, "--grid", grid, "--algorithm", algorithm, *more], out)
        if rc == 0:
            rc = _ledger_against_link(log, moved[c.node(0)], out)
        end = c.counters()
        sent = {n: end[n] - start[n] for n in end}
        print(f"cluster {c.name}: bytes each node sent on its link during the tests: "
              f"{', '.join(f'{n} {b}' for n, b in sent.items())}", file=out, flush=True)
        if rc == 0 and not all(sent.values()):
            print("cluster: the tests sent nothing across a link: they did not use the network", file=out)
            rc = 3
    left = leftovers(args.name)
    if left:
        print(f"cluster: left behind: {', '.join(left)}", file=out)
        rc = rc or 4
    return rc


# What crosses a link beyond the ledger's bytes: TCP/IP headers (about 3% at a 1500-byte MTU),
# MPI's own headers and protocol messages, the barriers and agreement checks cfp's collectives
# run around the recorded ones, and the launch (PMI). Measured: a 20-step stationary-x run of the
# width-2 ResNet, 63.8 MB in rank 0's ledger, 67.2 MB on its node's link (5.4% more).
LINK_OVERHEAD = 0.10  # the link may carry up to this fraction more than the ledger
LINK_FIXED = 1 << 20  # and this many bytes (the launch)


def _ledger_against_link(log, link_bytes, out):
    """0 if the bytes node 0 sent on its link are those rank 0's ledger recorded as sent
    (train.py --log's summary; with one rank a node every one of them crosses the link), up to
    LINK_OVERHEAD and LINK_FIXED more; 5 otherwise. Prints both."""
    with open(log) as f:
        ledger = sum(row["bytes_sent"] for row in json.load(f)["summary"]["communication"])
    print(f"cluster: rank 0's ledger sent {ledger} bytes, its node's link carried {link_bytes} "
          f"({(link_bytes / ledger - 1) * 100 if ledger else float('inf'):+.1f}%; allowed 0 to "
          f"+{LINK_OVERHEAD * 100:.0f}% and {LINK_FIXED} bytes)", file=out, flush=True)
    return 0 if ledger <= link_bytes <= ledger * (1 + LINK_OVERHEAD) + LINK_FIXED else 5


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for command in ("up", "down", "status", "run", "test"):
        s = sub.add_parser(command)
        s.add_argument("--name", default="cfp", help="the cluster's name (prefix of its namespaces and links)")
        if command == "up":
            s.add_argument("--nodes", type=int, required=True, help="number of nodes")
        if command in ("up", "test"):
            s.add_argument("--rate", default=None, help="each node's link rate (tc syntax: 1gbit, 100mbit); "
                                                        "default unshaped")
            s.add_argument("--mtu", type=int, default=None,
                           help="the links' largest packet in bytes (default the kernel's 1500; 9000: jumbo frames)")
        if command == "run":
            s.add_argument("--ranks-per-node", type=int, required=True, help="ranks on each node")
            s.add_argument("--placement", default="block", choices=PLACEMENTS,
                           help="ranks to nodes: in blocks (neighbours share a node) or cyclic")
            s.add_argument("command_args", nargs=argparse.REMAINDER, help="-- COMMAND...")
        if command == "test":
            s.add_argument("--ranks", default="2 4", help="rank counts of the MPI runs (2 nodes each)")
            s.add_argument("pytest", nargs=argparse.REMAINDER, help="pytest arguments (default: the MPI test files)")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mpiexec"]:  # the wrapper: `mpiexec --name NAME` then mpiexec's own arguments
        name, rest = (argv[2], argv[3:]) if argv[1:2] == ["--name"] else ("cfp", argv[1:])
        if "--version" in rest:  # tests/launcher.py asks which MPI this is
            return subprocess.call([_real_mpiexec(), "--version"])
        try:
            nprocs, rest = _nprocs(rest)
            return subprocess.call(_loaded(name).mpiexec_argv(nprocs, rest))
        except (ValueError, RuntimeError) as e:
            print(f"cluster: {e}", file=sys.stderr)
            return 2
    args = parse_args(argv)
    try:
        if args.command == "up":
            c = Cluster(args.nodes, args.rate, args.name, args.mtu)
            c.up()
            print(f"cluster {c.name} up: {c.nodes} nodes {', '.join(c.node(k) for k in range(c.nodes))} at "
                  f"{SUBNET}.1-{c.nodes}, links {c.rate or 'unshaped'}, MTU {c.mtu or 'the default'}; mpiexec "
                  f"across them: {c.mpiexec_wrapper}")
        elif args.command == "down":
            removed = down(args.name)
            print(f"cluster {args.name}: removed {', '.join(removed) if removed else 'nothing (it was not up)'}")
        elif args.command == "status":
            found = leftovers(args.name)
            print(f"cluster {args.name}: {', '.join(found) if found else 'not up'}")
        elif args.command == "run":
            c = _loaded(args.name)
            command = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
            if not command:
                raise ValueError("run: expected a command after --")
            if args.ranks_per_node < 1:
                raise ValueError(f"--ranks-per-node {args.ranks_per_node}: expected at least 1")
            return c.run(args.ranks_per_node * c.nodes, command, placement=args.placement)[0]
        elif args.command == "test":
            args.pytest = args.pytest[1:] if args.pytest[:1] == ["--"] else args.pytest
            return cluster_test(args)
    except (ValueError, RuntimeError, _Interrupted) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
