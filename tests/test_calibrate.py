"""cfp.calibration's fits: alpha and beta recovered from exact timings, not collapsed to
zero by samples whose packing is most of their time, and physically impossible fits refused."""
import pytest

from cfp import calibration


@pytest.fixture(scope="module")
def calibrate():
    return calibration


def samples(alpha, beta, packing, p=2, sizes=(4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20), noise=()):
    """(steps, volume, remainder, measured) of an allgather over p ranks, as calibrate records them."""
    out = []
    for i, m in enumerate(sizes):
        steps, volume = p - 1, (p - 1) / p * m
        measured = steps * alpha + volume * beta + packing * m + (noise[i] if i < len(noise) else 0.0)
        out.append((steps, volume, max(measured - packing * m, 0.0), measured))
    return out


def test_exact_timings_give_back_alpha_and_beta(calibrate):
    alpha, beta = calibrate.fit_alpha_beta(samples(50e-6, 1e-9, 0.1e-9))
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)


def test_remainders_near_zero_do_not_outweigh_the_rest(calibrate):
    # An all-to-all measured on a 2-core machine: packing is most of the time, and the two
    # mid-size samples came out faster than the packing alone (remainder clamped to 0). The
    # fit used to weight those zeros by 1/max(0, 1e-9), so that they alone decided it (alpha =
    # beta = 0: a 4 KiB all-to-all for free); weighted by the measurement, the small messages
    # keep their ~70 us latency.
    packing = 0.157e-9
    measured = [96.3e-6, 83.6e-6, 150e-6, 600e-6, 3970e-6]
    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
    recorded = [(1, m / 2, max(t - packing * m, 0.0), t) for m, t in zip(sizes, measured)]
    alpha, beta = calibrate.fit_alpha_beta(recorded)
    assert 50e-6 < alpha < 100e-6 and beta >= 0, (alpha, beta)


def test_impossible_fits_are_refused(calibrate):
    with pytest.raises(ValueError, match="alltoall gives zero seconds per byte.*rerun on a quiet machine"):
        calibrate.check_fits({"allgather": (5e-5, 1e-9), "alltoall": (7e-5, 0.0)}, {"alltoall": 0.0})
    calibrate.check_fits({}, {})  # one rank: no links to fit, the kernels and layers alone
    calibrate.check_fits({"allgather": (5e-5, 1e-9)}, {})  # a sound fit passes
    calibrate.check_fits({"alltoall": (7e-5, 0.0)}, {"alltoall": 0.16e-9})  # all in the packing
