"""scripts/cluster.py, the emulated cluster: its checks of bad input (no root needed), and, as
root with ip, tc and unshare, a cluster of 2 nodes made, a 2-rank job run across them whose
bytes crossed the links, and everything removed afterwards, also after an error or Ctrl-C."""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location("cfp_cluster", os.path.join(ROOT, "scripts", "cluster.py"))
cluster = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cluster)

NAME = "cfptest"  # not the default name: a user's own cluster is left alone


def test_bad_input_is_refused_before_anything_is_made():
    for rate in ("1gbit", "100mbit", "50mbps", "2.5Gbit", None):
        cluster.check_rate(rate)
    for rate in ("fast", "1 gbit", "10", "gbit", ""):
        with pytest.raises(ValueError, match=f"link rate {rate!r}: expected a number and a unit"):
            cluster.check_rate(rate)
    for name in ("Cfp", "1cfp", "cfp-a", "toolongname"):
        with pytest.raises(ValueError, match="cluster name"):
            cluster.check_name(name)
    for mtu in (None, 576, 1500, 9000, 65535):
        assert cluster.check_mtu(mtu) == mtu
    for mtu in (575, 65536, 9000.0, True, "9000"):
        with pytest.raises(ValueError, match=f"--mtu {mtu!r}: expected a whole number of bytes from 576 to 65535"):
            cluster.check_mtu(mtu)
    for nodes in (0, 17, 1.5, True):
        with pytest.raises(ValueError, match="--nodes"):
            cluster.check_nodes(nodes)
    with pytest.raises(ValueError, match="3 ranks do not divide among 2 nodes"):
        cluster.ranks_per_node(3, 2)
    assert cluster.ranks_per_node(4, 2) == 2
    assert cluster.rate_bytes("1gbit") == 1.25e8 and cluster.rate_bytes("50mbps") == 5e7


def test_up_refuses_without_root(monkeypatch):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="the cluster needs root"):
        cluster.Cluster(2, name=NAME).up()
    assert cluster.leftovers(NAME) == [] or os.geteuid() == 0


def _can_make_clusters():
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} missing"
    probe = subprocess.run(["ip", "netns", "add", f"{NAME}-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", f"{NAME}-probe"], capture_output=True)
    return None if probe.returncode == 0 else f"ip netns add failed here: {probe.stderr.strip()}"


needs_root = pytest.mark.skipif(_can_make_clusters() is not None, reason=str(_can_make_clusters()))

ALLREDUCE = textwrap.dedent("""
    import numpy as np
    from mpi4py import MPI
    a = np.ones(1 << 18, np.float32)  # 1 MiB
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, a)
    assert a[0] == MPI.COMM_WORLD.Get_size()
""")


@pytest.fixture
def clean():
    cluster.down(NAME)  # what an earlier, killed run may have left
    yield
    left = cluster.leftovers(NAME)
    cluster.down(NAME)
    assert left == [], f"left behind: {left}"


@needs_root
def test_a_job_across_two_nodes_crosses_the_links_and_nothing_is_left(clean, tmp_path, capsys):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    with cluster.cluster(2, "1gbit", NAME) as c:
        assert cluster.leftovers(NAME)  # it is up
        with pytest.raises(RuntimeError, match=f"cluster {NAME!r} is already \\(partly\\) up"):
            cluster.Cluster(2, name=NAME).up()
        assert cluster.leftovers(NAME)  # a refused second up removed nothing
        env_before = dict(os.environ)
        rc, sent = c.run(2, [sys.executable, "-m", "mpi4py", str(script)])
        assert dict(os.environ) == env_before
        assert rc == 0 and all(b >= 1 << 20 for b in sent.values()), sent
        # 2 ranks a node: calibration sees 2 nodes of 2 neighbouring ranks (each rank checks)
        layout = tmp_path / "layout.py"
        layout.write_text("from mpi4py import MPI\nfrom cfp.grid import node_layout\n"
                          "assert node_layout(MPI.COMM_WORLD) == (2, 2), node_layout(MPI.COMM_WORLD)\n")
        assert c.run(4, [sys.executable, "-m", "mpi4py", str(layout)])[0] == 0
    out = capsys.readouterr().out
    forced = {cluster._launcher.MPICH: "MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=cfpnet",
              cluster._launcher.OPEN_MPI: "OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,vader,self "
                                          "OMPI_MCA_btl_tcp_if_include=cfpnet"}[cluster.mpi_family()]
    assert forced in out, out


@needs_root
def test_the_links_take_the_mtu_asked_for(clean, tmp_path):
    """--mtu 9000: the nodes' interfaces, their host ends and the bridge carry jumbo frames, the
    rate's bucket holds one (tbf drops a packet larger than its burst), and a job crosses."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    with cluster.cluster(2, "1gbit", NAME, mtu=9000) as c:
        shown = [subprocess.run(argv, capture_output=True, text=True, check=True).stdout for argv in (
            ["ip", "-n", c.node(0), "link", "show", cluster.IFACE], ["ip", "link", "show", c.host_link(1)],
            ["ip", "link", "show", c.bridge])]
        assert all(" mtu 9000 " in text for text in shown), shown
        qdisc = subprocess.run(["ip", "netns", "exec", c.node(1), "tc", "qdisc", "show", "dev", cluster.IFACE],
                               capture_output=True, text=True, check=True).stdout
        burst = re.search(r"burst (\d+)b", qdisc)
        assert burst and int(burst.group(1)) >= 9000, qdisc
        rc, sent = c.run(2, [sys.executable, "-m", "mpi4py", str(script)])
        assert rc == 0 and all(b >= 1 << 20 for b in sent.values()), sent


@needs_root
def test_an_error_or_ctrl_c_inside_the_cluster_removes_it(clean):
    with pytest.raises(ZeroDivisionError):
        with cluster.cluster(1, name=NAME):
            1 / 0
    assert cluster.leftovers(NAME) == []
    # Ctrl-C in a process that made a cluster: its context removes it before the process ends
    code = textwrap.dedent(f"""
        import importlib.util, os, signal, sys, time
        spec = importlib.util.spec_from_file_location("c", {os.path.join(ROOT, "scripts", "cluster.py")!r})
        c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
        with c.cluster(2, name={NAME!r}):
            print("up", flush=True)
            time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode != 0 and cluster.leftovers(NAME) == []


@pytest.mark.parametrize("family", ["MPICH", "Open MPI"])
def test_ranks_are_placed_in_blocks_or_in_turn(family):
    """mpiexec's hosts: R ranks a node in blocks (cfp's grids' neighbours share a node), or one
    a node in turn (cyclic: a channel group across nodes), in each MPI's words; anything else
    refused."""
    c = cluster.Cluster(2, name=NAME)
    block, cyclic = (" ".join(c.mpiexec_argv(4, ["prog"], mpiexec="mpiexec", placement=p, family=family))
                     for p in ("block", "cyclic"))
    if family == "MPICH":
        assert f"-hosts {NAME}-n0:2,{NAME}-n1:2 -n 4 prog" in block and "FI_TCP_IFACE=cfpnet" in block
        assert f"-hosts {NAME}-n0:1,{NAME}-n1:1 -n 4 prog" in cyclic
    else:
        assert f"--host {NAME}-n0:2,{NAME}-n1:2 --map-by slot -n 4 prog" in block
        assert f"--host {NAME}-n0:2,{NAME}-n1:2 --map-by node -n 4 prog" in cyclic
        assert f"OMPI_MCA_plm_rsh_agent={c.launcher}" in block and "OMPI_MCA_btl_tcp_if_include=cfpnet" in block
        assert "OMPI_MCA_mpi_yield_when_idle=1" in block  # the nodes share the cores
    with pytest.raises(ValueError, match="placement 'random': expected one of block, cyclic"):
        c.mpiexec_argv(4, ["prog"], mpiexec="mpiexec", placement="random", family=family)
    with pytest.raises(ValueError, match="3 ranks do not divide among 2 nodes"):
        c.mpiexec_argv(3, ["prog"], mpiexec="mpiexec", family=family)


def test_an_mpi_the_cluster_cannot_launch_is_refused_by_name(tmp_path):
    for version in ("mpirun (Open MPI) 5.0.3", "Intel(R) MPI Library for Linux* OS, Version 2021.6"):
        fake = tmp_path / "mpiexec"
        fake.write_text(f"#!/bin/sh\necho '{version}'\n")
        fake.chmod(0o755)
        cluster._family.cache_clear()
        with pytest.raises(RuntimeError, match="the cluster launches MPICH \\(hydra\\) and Open MPI 4.x"):
            cluster.mpi_family(str(fake))
    cluster._family.cache_clear()
