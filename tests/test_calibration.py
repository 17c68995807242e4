"""The calibrated cost model's bookkeeping (cfp/calibration.py, docs/design.md section 4): the
machine record and its differences, the kernel version, the profile cache (hit, miss, an
unreadable, foreign or newer file recalibrated over with one warning), the profile format, the
calibration shapes reaching every kernel path, and the model's kernel path of each layer equal
to the path the kernels take."""
import json
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from cfp import calibration
from cfp.grid import ProcessGrid
from cfp.kernels import conv_geometry
from cfp.kernels import settings as kernel_settings
from cfp.kernels.conv import paths
from cfp.models import MODELS, layer_shapes
from cfp.nn import Conv2d, Linear
from cfp.perfmodel import FORMAT, MachineProfile, layer_cost


def fake_profile(record, name="fake"):
    """A small valid profile dict for machine record `record`."""
    points = {"*": [[1e6, 64, 1e9], [1e9, 4096, 1e10]]}
    return {"format": FORMAT, "name": name, "itemsize": 4, "ranks_per_node": 1, "machine": record,
            "links": {}, "packing": {}, "kernels": {p: points for p in paths.PASSES}, "layers": {}}


@pytest.fixture
def counted(monkeypatch):
    """calibration.calibrate replaced by a counter returning fake_profile (no timing)."""
    calls = []

    def calibrate(world, quick=False, repeats=5, threads=1, name=None, progress=None):
        calls.append(threads)
        return fake_profile(calibration.machine_record(world.Get_size(), threads), f"calibrated {len(calls)}")
    monkeypatch.setattr(calibration, "calibrate", calibrate)
    return calls


def test_the_record_names_what_differs():
    here = calibration.machine_record(2, 1)
    assert set(calibration.MACHINE_KEYS) <= set(here)
    assert calibration.differences(dict(here), here) == []
    assert calibration.differences(None, here) == []  # a model of a machine: nothing to compare
    there = dict(here, cores=here["cores"] + 1, kernels="0" * 16)
    lines = calibration.differences(there, here)
    assert len(lines) == 2 and lines[0].startswith("cores ") and lines[1].startswith("kernels '0000")
    assert calibration.differences(dict(here, host="elsewhere"), here) == []  # the host's name is for people


def test_the_record_names_the_blas_kernels_that_run(monkeypatch):
    """One BLAS library runs at different rates with different kernels (OpenBLAS's Haswell and
    SkylakeX kernels, chosen by OPENBLAS_CORETYPE): the record names those of NumPy's library,
    so that a profile measured with one set differs from a machine running the other, and
    SciPy's OpenBLAS, loaded or not, changes nothing."""
    kernels = [arch for _, _, _, arch in calibration.backend.numpy_blas_info() if arch]
    here = calibration.machine_record(1, 1)
    assert all(f"({arch})" in here["blas"] or arch in here["blas"] for arch in kernels), (kernels, here["blas"])
    import scipy.linalg  # noqa: F401 (SciPy's own OpenBLAS, loaded now: the record stays NumPy's)
    assert calibration.machine_record(1, 1)["blas"] == here["blas"]
    assert len(calibration.backend.numpy_blas_info()) == 1
    monkeypatch.setattr(calibration.backend, "numpy_blas_info", lambda: [("openblas", "0.3.31", 1, "Haswell")])
    haswell = calibration.machine_record(1, 1)
    monkeypatch.setattr(calibration.backend, "numpy_blas_info", lambda: [("openblas", "0.3.31", 1, "SkylakeX")])
    skylakex = calibration.machine_record(1, 1)
    assert haswell["blas"].endswith("(Haswell)") and skylakex["blas"].endswith("(SkylakeX)")
    assert [line.split()[0] for line in calibration.differences(haswell, skylakex)] == ["blas"]


def test_the_kernel_version_follows_the_sources_and_the_settings(tmp_path, monkeypatch):
    before = calibration.kernels_version()
    assert calibration.kernels_version() == before
    with kernel_settings.winograd(False):
        assert calibration.kernels_version() != before
    copy = tmp_path / "cfp"
    shutil.copytree(calibration.os.path.dirname(calibration.__file__) + "/kernels", copy / "kernels")
    shutil.copy(calibration.__file__, copy / "calibration.py")
    shutil.copytree(calibration.os.path.dirname(calibration.__file__) + "/nn", copy / "nn")
    for name in ("comm.py", "optim.py"):
        shutil.copy(calibration.os.path.dirname(calibration.__file__) + "/" + name, copy / name)
    monkeypatch.setattr(calibration, "__file__", str(copy / "calibration.py"))
    assert calibration.kernels_version() == before  # the same sources
    # a kernel, the measuring, the collectives' packing, a layer, an optimizer
    for source in (copy / "kernels" / "conv" / "paths.py", copy / "calibration.py", copy / "comm.py",
                   copy / "nn" / "layers.py", copy / "optim.py"):
        text = source.read_text()
        source.write_text(text + "\n#")
        assert calibration.kernels_version() != before, source
        source.write_text(text)
        assert calibration.kernels_version() == before


def test_a_missing_profile_is_calibrated_once_and_cached(tmp_path, counted, capsys):
    first = calibration.profile_for(MPI.COMM_SELF, 1, directory=str(tmp_path))
    out = capsys.readouterr().out
    assert counted == [1] and "calibrating (quick" in out and "cached in" in out
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and cached[0].name.startswith(f"profile-v{FORMAT}-")
    second = calibration.profile_for(MPI.COMM_SELF, 1, directory=str(tmp_path))
    assert counted == [1] and capsys.readouterr().out == ""
    assert second.name == first.name == "calibrated 1"
    calibration.profile_for(MPI.COMM_SELF, 2, directory=str(tmp_path))  # other threads: another profile
    assert counted == [1, 2] and len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize("content, says", [
    ("{not json", "is not valid JSON"),
    ('["a", "list"]', "not a valid machine profile"),
    (None, "describes another machine or kernels: cores"),
    ("newer", f"is format {FORMAT + 1}, newer than this cfp reads"),
])
def test_a_bad_cache_file_is_calibrated_over_with_one_warning(tmp_path, counted, capsys, content, says):
    record = calibration.machine_record(1, 1)
    path = calibration.cache_path(record, str(tmp_path))
    if content is None:
        content = json.dumps(fake_profile(dict(record, cores=record["cores"] + 7)))
    elif content == "newer":
        content = json.dumps(dict(fake_profile(record), format=FORMAT + 1))
    with open(path, "w") as f:
        f.write(content)
    profile = calibration.profile_for(MPI.COMM_SELF, 1, directory=str(tmp_path))
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "ignoring the cached machine profile" in line]
    assert len(warnings) == 1 and says in warnings[0], out
    assert counted == [1] and profile.name == "calibrated 1"
    assert json.load(open(path))["name"] == "calibrated 1"  # the cache now holds the new one


def test_an_unwritable_cache_is_said_and_skipped(tmp_path, counted, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    profile = calibration.profile_for(MPI.COMM_SELF, 1, directory=str(blocked / "cache"))
    assert profile.name == "calibrated 1" and "not cached" in capsys.readouterr().out


def test_a_named_profile_from_elsewhere_warns_in_one_line(capsys):
    profile = MachineProfile(fake_profile(dict(calibration.machine_record(1, 1), numpy="0.0")))
    calibration.warn_if_foreign(profile, MPI.COMM_SELF, 1)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "measured elsewhere (numpy '0.0'" in out[0]
    calibration.warn_if_foreign(MachineProfile.load("reference-v100"), MPI.COMM_SELF, 1)  # no record
    assert capsys.readouterr().out == ""


def test_profile_formats():
    record = calibration.machine_record(1, 1)
    with pytest.raises(ValueError, match=f"is format {FORMAT + 1}, newer than this cfp reads \\(format {FORMAT}\\)"):
        MachineProfile(dict(fake_profile(record), format=FORMAT + 1))
    old = fake_profile(record)
    del old["format"]
    with pytest.raises(ValueError, match="is format 1 \\(kernel rates per kernel size"):
        MachineProfile(old)
    one_rank = MachineProfile(fake_profile(record))
    assert one_rank.collective_time("allgather", 1, 100) == 0.0
    with pytest.raises(ValueError, match="calibrated on one rank and has no link constants"):
        one_rank.collective_time("allgather", 2, 100)
    with pytest.raises(ValueError, match="layers.dropout \\(not one of batchnorm"):
        MachineProfile(dict(fake_profile(record), layers={"dropout": [0, 0]}))


def model_layers():
    """Every convolution of every model, at batch 8 (width 2; the wide CNN 32 channels): images,
    volumes and transposed convolutions."""
    out = []
    for name, kind in MODELS.items():
        out += layer_shapes(name, 8, 32 if kind.depth else 2)
    assert {L.op for L in out} == {"conv2d", "conv3d", "conv_transpose2d"}
    return out


def test_calibration_reaches_every_path_the_models_take():
    """Every (pass, path) a model layer takes under any algorithm on 1, 2 and 4 ranks is among
    those the quick calibration measures, so no layer is priced by another path's rates."""
    measured = set()
    for N, C, F, H, K, stride, dilation, groups in calibration.kernel_shapes(quick=True):
        g = conv_geometry((N, C, H, H), (F, C // groups, K, K), stride, dilation * (K // 2), dilation, groups)
        measured |= {(p, paths.rate_key(p, g, np.dtype(np.float32))[0]) for p in paths.PASSES}
    wanted = set()
    for layer in model_layers():
        for ranks in (1, 2, 4):
            for P_c in (c for c in (1, 2, 4) if ranks % c == 0):
                for algorithm in ("sample",) if P_c == 1 else ("x", "y", "w"):
                    if layer.F < P_c:
                        continue
                    cost = layer_cost(layer, algorithm, ranks // P_c, P_c, MachineProfile.load("cpu-dev"))
                    wanted |= {(cost["passes"][p], path) for p, path in cost["paths"].items()}
    assert wanted - measured == set()


@pytest.fixture
def ran(monkeypatch):
    """The kernel path table with every pass recording the path that runs it (its variant
    included: 'winograd F(2x2)'): ran() gives the names per pass since the last call, a full
    convolution named with its forward's path."""
    log = []

    def recording(path, pass_name, run):
        def call(*args, **kwargs):  # (every path's passes take the geometry third: KernelPath)
            log.append((pass_name, path.named(args[2])))
            return run(*args, **kwargs)
        return call
    table = tuple(path._replace(**{field: recording(path, p, path.run(p)) for field, p in
                                   (("forward", "forward"), ("backward_data", "backward-data"),
                                    ("backward_filter", "backward-filter")) if path.run(p) is not None})
                  for path in paths.PATHS)
    monkeypatch.setattr(paths, "PATHS", table)

    def names():
        out = {}
        for i, (pass_name, name) in enumerate(log):
            if name == "full-convolution":
                out[pass_name] = f"{name}/{log[i + 1][1]}"
            elif pass_name not in out and not (i and log[i - 1][1] == "full-convolution"):
                out[pass_name] = name
        log.clear()
        return out
    return names


def test_the_model_takes_the_kernels_own_path_for_every_layer(ran):
    """Each convolution of the models, run as cfp's layer on one rank (float32), takes in each
    pass the kernel path perfmodel.layer_cost prices it by: a volume's its stacked planes', a
    transposed one's its adjoint's (its forward by the adjoint's backward-data path)."""
    from cfp.nn import Conv3d, ConvTranspose2d
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    profile = MachineProfile.load("cpu-dev")
    rng = np.random.default_rng(0)
    classes = {"conv2d": Conv2d, "conv3d": Conv3d, "conv_transpose2d": ConvTranspose2d}
    for layer in model_layers():
        cls = Linear if layer.name == "fc" else classes[layer.op]
        options = {} if cls is Linear else dict(kernel_size=layer.K, stride=layer.stride, padding=layer.pad,
                                                 dilation=layer.dilation, groups=layer.groups)
        if layer.output_padding:
            options["output_padding"] = layer.output_padding
        conv = cls(grid, layer.C, layer.F, algorithm="sample", bias=False, name=layer.name,
                   need_dx=not layer.first, **options)
        shape = (layer.N, layer.C) if cls is Linear else layer.x_shape
        x = rng.standard_normal(shape).astype(np.float32)
        conv.input_shape = x.shape
        y = conv.forward(x)
        conv.backward(np.ones_like(y))
        taken = ran()
        cost = layer_cost(layer, "sample", 1, 1, profile)
        priced = {cost["passes"][p]: path for p, path in cost["paths"].items()
                  if not (layer.first and p == "backward-data")}
        assert taken == priced, layer.name
    grid.free()


def test_measure_steps_goes_round_the_plans(monkeypatch):
    """benchtools.measure_steps (validate_model's and bench_plans' step timing) builds every
    plan's model first and takes one step of each in turn, warm-up rounds included, so that a
    drift of the host slows all plans alike; it returns a time for every plan, by label."""
    from cfp import train
    from cfp.benchtools import measure_steps, single_grid_plans
    arch = dict(width=1, in_channels=1, classes=10, image=8)
    names = [s.name for s in layer_shapes("resnet", 4, **arch)]
    entries = single_grid_plans(names, 1)["sample=1 sample"]
    plans = {"first": entries, "second": entries, "third": entries}
    order, real = [], train.train_step

    def recording(model, *args):
        order.append(id(model))
        return real(model, *args)
    monkeypatch.setattr(train, "train_step", recording)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 4)
    seconds = measure_steps(MPI.COMM_SELF, "resnet", plans, arch, 4, x, y, steps=2, warmup=1)
    assert list(seconds) == ["first", "second", "third"] and all(s > 0 for s in seconds.values())
    models = order[:3]
    assert len(set(models)) == 3 and order == models * 3  # 1 warm-up and 2 timed rounds, in turn


def test_top_up_measures_each_geometry_once_even_where_two_share_flops_and_rows():
    """Two 1x1 layers of one path, flops and rows (4 -> 2 and 8 -> 1 channels over 2x16x16
    pixels) are two shapes to measure, each measured once: the profile then has a point of
    each, named by its geometry, and prices each at its own."""
    narrow, thin = (conv_geometry((2, c, 16, 16), (f, c, 1, 1), 1, 0, 1, 1) for c, f in ((4, 2), (8, 1)))
    assert paths.rate_key("forward", narrow, np.dtype(np.float32)) == paths.rate_key("forward", thin, np.dtype(np.float32))
    data = fake_profile(calibration.machine_record(1, 1))
    data["kernels"] = {p: {"*": [[1e6, 64, 1e9]]} for p in paths.PASSES}
    assert not calibration.measured(data, narrow) and not calibration.measured(data, thin)
    assert calibration.top_up(MPI.COMM_SELF, data, [narrow, thin, narrow], repeats=1) == 2
    assert calibration.measured(data, narrow) and calibration.measured(data, thin)
    assert calibration.top_up(MPI.COMM_SELF, data, [thin, narrow], repeats=1) == 0
    profile = MachineProfile(data)
    for g in (narrow, thin):
        path, rows = paths.rate_key("forward", g, np.dtype(np.float32))
        point = next(p for p in data["kernels"]["forward"][path] if p[3] == paths.geometry_key(g))
        assert profile.kernel_time("forward", path, point[0], rows, paths.geometry_key(g)) == \
            pytest.approx(point[0] / point[2], rel=1e-12)


def test_a_volume_is_measured_on_its_own_block_and_priced_at_it():
    """A Conv3d layer's local block (perfmodel.local_block) is timed as a volume by top_up, once
    however many options share it, and its passes are then priced at those points (its ring's
    or its stack's own time, copies included), not at its stacked 2-D convolution's rate plus
    the copies; a Conv2d layer has no block to time."""
    from cfp.perfmodel import LayerShape, volume_key
    from cfp.planner import geometries
    layer = LayerShape("v", 2, 8, 8, 12, 12, 3, op="conv3d", D=12)
    data = fake_profile(calibration.machine_record(1, 1))
    data["kernels"] = {p: {"*": [[1e6, 64, 1e9]]} for p in paths.PASSES}
    data["layers"] = dict(data.get("layers", {}), volume=[1.0, 1.0])  # copies priced at 1 s + 1 s an element
    before = layer_cost(layer, "sample", 1, 1, MachineProfile(data))
    assert before["compute"]["forward"] > 1.0  # the stack's copies, at the made-up rate
    planes, volumes = geometries([layer], 1, MachineProfile(data))
    assert len(volumes) >= 1 and all(block == before["block"] for block, _ in volumes)
    assert calibration.top_up(MPI.COMM_SELF, data, planes, repeats=1, volumes=volumes + volumes) == len(set(planes)) + 1
    assert calibration.volume_measured(data, before["block"], before["geometry"])
    assert calibration.top_up(MPI.COMM_SELF, data, planes, repeats=1, volumes=volumes) == 0
    after = layer_cost(layer, "sample", 1, 1, MachineProfile(data))
    for p in paths.PASSES:
        path, key = volume_key(p, before["block"], before["geometry"])
        point = next(q for q in data["kernels"][p][path] if q[3] == key)
        assert after["compute"][p] == pytest.approx(point[0] / point[2], rel=1e-12) and after["compute"][p] < 0.5
    flat = LayerShape("c", 2, 8, 8, 12, 12, 3)
    assert layer_cost(flat, "sample", 1, 1, MachineProfile(data))["block"] is None


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_a_failure_on_rank0_alone_stops_every_rank():
    """benchtools.on_rank0 (a one-rank baseline inside a P-rank job): its result on every rank;
    where the work raises on rank 0, rank 0 raises it and every other rank a RuntimeError with
    its message, instead of waiting in the barrier for a rank that has gone."""
    from cfp.benchtools import on_rank0
    from conftest import WORLD, assert_all_ranks, raises_on_all_ranks
    assert_all_ranks(on_rank0(WORLD, lambda: {"seconds": 1.5}) == {"seconds": 1.5}, "the result on every rank")

    def fails():
        raise MemoryError("the baseline's arrays do not fit")
    for _ in range(3):  # and the ranks stay in step for the next collective
        e = raises_on_all_ranks(Exception, lambda: on_rank0(WORLD, fails), match="the baseline's arrays do not fit")
        expected = MemoryError if WORLD.Get_rank() == 0 else RuntimeError
        assert_all_ranks(type(e) is expected and (WORLD.Get_rank() == 0 or str(e).startswith("rank 0 failed: MemoryError")),
                         f"rank {WORLD.Get_rank()} raised {type(e).__name__}: {e}")
    assert_all_ranks(WORLD.allreduce(1) == WORLD.Get_size(), "the ranks in step after the failures")


@pytest.mark.mpi
def test_ranks_of_one_machine_are_one_node():
    """Under a plain mpiexec every rank shares one node's memory: one node of P ranks, and the
    machine record says so (tests/test_cluster.py: 2 nodes of 2 on the emulated cluster)."""
    world = MPI.COMM_WORLD
    assert calibration.node_layout(world) == (world.Get_size(), 1)
    assert calibration.machine_record(world.Get_size(), 1)["ranks_per_node"] == world.Get_size()


@pytest.mark.mpi
def test_the_progress_of_a_started_allreduce_is_one_fraction_on_every_rank():
    """calibrate_progress: none on one rank (no link); on several, a fraction in [0, 1] (how
    much of a started allreduce moved while its ranks computed), the same on every rank, as
    the profile's `progress` of that link."""
    world = MPI.COMM_WORLD
    got = calibration.calibrate_progress(world, 1, "intra")
    if world.Get_size() == 1:
        assert got == {}
        return
    assert set(got) == {"intra"} and 0.0 <= got["intra"] <= 1.0
    assert world.allgather(got) == [got] * world.Get_size()


@pytest.mark.mpi
def test_the_collectives_measured_times_price_them_at_the_sizes_measured():
    """calibrate_collectives keeps each group's time of every collective and message size (less
    the packing): on P ranks groups of 2..P, every size of MESSAGE_BYTES, the same on every rank;
    a profile holding them prices each collective over a measured group at a measured size at
    that time plus the packing (perfmodel.MachineProfile.collective_time). None on one rank."""
    world = MPI.COMM_WORLD
    P = world.Get_size()
    links, packing, times = calibration.calibrate_collectives(world, 1)
    if P == 1:
        assert links == {} and times == {}
        return
    assert set(times) == {"intra"} and set(times["intra"]) == set(calibration.COLLECTIVE_NAMES)
    for name, points in times["intra"].items():
        assert sorted((p, m) for p, m, _ in points) == sorted(
            (p, m) for p in range(2, P + 1) for m in calibration.MESSAGE_BYTES)
        assert all(t >= 0 for *_, t in points)
    assert world.allgather(times) == [times] * P
    data = fake_profile(None)
    data.update(links=links, packing=packing, collective_times=times, ranks_per_node=P)
    profile = MachineProfile(data)
    for name, points in times["intra"].items():
        by_size = {}
        for p, m, t in points:
            by_size.setdefault(p, []).append((m, t))
        for p, measured in by_size.items():
            measured.sort()
            most = 0.0
            for m, t in measured:  # the profile lifts a time below a smaller size's to it
                most = max(most, t)
                assert profile.collective_time(name, p, m) == pytest.approx(most + packing[name] * m)
