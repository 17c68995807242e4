"""scripts/simulate.py on small configurations: the ResNet-50 and wide-CNN layer lists it plans
(cfp.models), the hybrid plan against data parallelism, and the files main writes (serial, no MPI)."""
import importlib.util
import json
import os

import pytest

from cfp import cli
from cfp.models import wide_cnn_layers, wide_resnet50_layers
from cfp.perfmodel import MachineProfile
from conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def simulate():
    return load_script("simulate")


@pytest.fixture(scope="module")
def profile():
    return MachineProfile.load("reference-v100")


def test_resnet50_layers_match_resnet50():
    layers = wide_resnet50_layers(1, batch=8)
    assert len(layers) == 54 and layers[-1].name == "fc"
    convs = {L.name: L for L in layers[:-1]}
    assert len(convs) == 53
    stem = convs["conv1"]
    assert (stem.C, stem.F, stem.K, stem.stride, stem.first, stem.H, stem.out_hw) == (3, 64, 7, 2, True, 224, (112, 112))
    # After the stem's max pool: 56x56, then 28, 14 and 7 from the first 3x3 of stages 2-4.
    for stage, side in zip((1, 2, 3, 4), (56, 28, 14, 7)):
        assert convs[f"layer{stage}.1.conv2"].H == side
    down = convs["layer2.0.downsample"]
    assert (down.C, down.F, down.K, down.stride, down.H, down.out_hw) == (256, 512, 1, 2, 56, (28, 28))
    last = convs["layer4.2.conv3"]
    assert (last.C, last.F, last.K, last.H, last.W) == (512, 2048, 1, 7, 7)
    assert (layers[-1].C, layers[-1].F, layers[-1].H, layers[-1].K) == (2048, 1000, 1, 1)
    # torchvision's ResNet-50 has 25,557,032 parameters: these weights plus 53,120 of batch
    # norm and the classifier's 1,000 biases.
    assert sum(L.C * L.F * L.K ** 2 for L in layers) == 25_557_032 - 53_120 - 1_000
    wide = wide_resnet50_layers(4, batch=8)
    assert [(L.C, L.F) for L in wide[1:-1]] == [(4 * L.C, 4 * L.F) for L in layers[1:-1]]
    assert (wide[0].C, wide[0].F, wide[-1].C, wide[-1].F) == (3, 256, 8192, 1000)


def test_wide_cnn_layers():
    layers = wide_cnn_layers(64, 4, batch=8, image=32)
    assert [L.name for L in layers] == ["stem.conv", "wide0.conv", "wide1.conv", "wide2.conv", "wide3.conv", "fc"]
    assert layers[0].first and (layers[0].C, layers[0].F) == (3, 64)
    assert [L.H for L in layers] == [32, 32, 32, 16, 16, 1]  # the pool after the first half
    assert (layers[-1].C, layers[-1].F, layers[-1].K) == (64, 1000, 1)


@pytest.mark.parametrize("gpus", [4, 8, 16])
def test_hybrid_is_never_slower_than_data_parallel(simulate, profile, gpus):
    """The planner may always choose data parallelism, so without a memory limit (or where data
    parallelism fits it) its plan is predicted at least as fast."""
    for layers in (wide_resnet50_layers(1, batch=32), wide_cnn_layers(512, 4, 32, 16)):
        for limit in (None, profile.data["memory_per_rank"]):
            row = simulate.simulate_scale(layers, gpus, profile, limit)
            dp, hybrid = row["data_parallel"], row["hybrid"]
            assert dp["ranks_used"] == gpus and dp["fits_memory"]
            assert hybrid["time_s"] <= dp["time_s"] * (1 + 1e-12)
            assert hybrid["memory_bytes_per_rank"] <= (limit or float("inf"))


def test_allreduce_volume_is_the_ring_formula(simulate, profile):
    layers = wide_cnn_layers(64, 2, batch=16, image=8)
    row = simulate.simulate_scale(layers, 8, profile, None)
    weights = sum(L.C * L.F * L.K ** 2 for L in layers) * profile.itemsize
    assert row["data_parallel"]["allreduce_bytes_per_rank"] == pytest.approx(2 * 7 / 8 * weights)


def test_data_parallel_above_the_batch_runs_on_batch_ranks(simulate, profile):
    row = simulate.simulate_scale(wide_cnn_layers(64, 2, batch=8, image=8), 16, profile, None)
    assert row["data_parallel"]["ranks_used"] == 8
    assert row["hybrid"]["ranks_used"] == 16
    assert "(DP on 8)" in simulate.markdown_table([row])


def test_main_writes_tables_json_and_plot(simulate, tmp_path, capsys):
    out_json, out_png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    simulate.main(["--max-gpus", "16", "--batch", "32", "--resnet-width", "1", "--cnn-width", "128",
                   "--cnn-depth", "2", "--cnn-image", "16", "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "reference-v100" in printed and "not measurements" in printed
    assert printed.count("| GPUs |") == 2
    data = json.loads(out_json.read_text())
    assert data["scales"] == [4, 8, 16] and data["batch"] == 32
    assert len(data["models"]) == 2
    for rows in data["models"].values():
        assert [r["gpus"] for r in rows] == [4, 8, 16]
        for r in rows:
            assert r["data_parallel"]["time_s"] > 0 and r["hybrid"]["time_s"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_returns_an_exit_status(simulate, capsys):
    """main returns 0 for cli.run; run_simulation returns the rows it printed."""
    argv = ["--max-gpus", "4", "--batch", "8", "--resnet-width", "1", "--cnn-width", "32", "--cnn-depth", "2",
            "--cnn-image", "8"]
    assert simulate.main(argv) == 0
    results = simulate.run_simulation(simulate.parse_args(argv))
    assert len(results) == 2 and all([r["gpus"] for r in rows] == [4] for rows in results.values())
    capsys.readouterr()


def test_bad_options_raise_value_error(simulate):
    with pytest.raises(ValueError, match="--max-gpus must be at least 4, got 2"):
        simulate.main(["--max-gpus", "2"])
    with pytest.raises(ValueError, match="--cnn-depth must be a positive integer, got 0"):
        simulate.main(["--cnn-depth", "0"])
    with pytest.raises(ValueError, match="does not exist"):
        simulate.main(["--profile", "no-such-profile"])
    with pytest.raises(cli.UsageError, match="invalid int value"):
        simulate.main(["--batch", "many"])
    with pytest.raises(cli.UsageError, match="unrecognized arguments"):
        simulate.main(["--no-such-option"])


def test_output_paths_are_checked_before_planning(simulate, tmp_path, capsys):
    with pytest.raises(ValueError, match="--json .* is a directory"):
        simulate.main(["--max-gpus", "4", "--json", str(tmp_path)])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--plot .* cannot be made"):
        simulate.main(["--max-gpus", "4", "--plot", str(blocker / "scaling.png")])
    assert capsys.readouterr().out == ""  # nothing planned or printed


def test_plot_without_matplotlib_fails_up_front(simulate, tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(simulate.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="--plot .*needs matplotlib"):
        simulate.parse_args(["--plot", str(tmp_path / "scaling.png")])


@pytest.mark.parametrize("name,magic", [("curves.png", b"\x89PNG"), ("curves.PDF", b"%PDF"), ("curves.svg", b"<?xml")])
def test_a_pictures_extension_chooses_its_format(tmp_path, name, magic):
    """save_figure writes PNG, PDF or SVG by the file name's extension (a .pdf is a PDF, not a
    PNG under a .pdf name)."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cfp.io import save_figure
    fig = plt.figure(figsize=(1, 1))
    save_figure(tmp_path / name, fig)
    plt.close(fig)
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_a_picture_of_an_unknown_format_is_refused_before_the_work(simulate, tmp_path):
    for name, got in (("scaling.jpg", "'.jpg'"), ("scaling", "none")):
        with pytest.raises(ValueError, match=rf"--plot '.*{name}': the file name's extension chooses the picture's "
                                             rf"format; expected .png, .pdf, .svg, got {got}"):
            simulate.main(["--max-gpus", "4", "--plot", str(tmp_path / name)])
    assert not list(tmp_path.iterdir())
