"""Depth metrics and the SILog loss against values computed by hand."""
import math

import numpy as np
import pytest
import torch

from gradzip_converge.losses import silog_loss
from gradzip_converge.metrics import NAMES, MetricAccumulator, image_metrics


def test_one_image_by_hand():
    # valid: (1.1 vs 1), (2 vs 2), (3 vs 4); the last pixel has no ground truth (0 = missing)
    gt = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    pred = torch.tensor([[1.1, 2.0, 3.0, 5.0]])
    m, n = image_metrics(pred, gt)
    assert n.tolist() == [3]
    expected = {
        "abs_rel": (0.1 / 1 + 0 + 1 / 4) / 3,
        "abs_rel_med": (0.1 / 1 + 0 + 1 / 4) / 3,  # both medians are 2: the scale is 1
        "sq_rel": (0.01 / 1 + 0 + 1 / 4) / 3,
        "rmse": math.sqrt((0.01 + 0 + 1) / 3),
        "rmse_log": math.sqrt((math.log(1.1) ** 2 + math.log(0.75) ** 2) / 3),
        "delta1": 2 / 3,  # ratios 1.1, 1, 4/3
        "delta2": 1.0,
        "delta3": 1.0,
    }
    for k in NAMES:
        assert m[k].item() == pytest.approx(expected[k], rel=1e-6), k


def test_median_scaled_abs_rel_against_float64():
    rng = np.random.default_rng(7)
    b, n, max_depth = 5, 37, 10.0
    gt = rng.uniform(0.5, 12.0, (b, n))  # some beyond the cap: invalid
    gt[rng.random((b, n)) < 0.2] = 0.0  # missing
    gt[1] = 0.0
    gt[1, 1:37:2] = rng.uniform(1, 9, 18)  # 18 valid pixels: an even count
    pred = gt * rng.uniform(1.5, 3.0) * rng.uniform(0.8, 1.25, (b, n))  # off by a global scale
    pred[2, :4] = 25.0  # beyond the cap: clamped before the medians and after scaling
    expected = []
    for g, d in zip(gt, pred):
        valid = (g > 1e-3) & (g <= max_depth)
        g, d = g[valid], np.clip(d[valid], 1e-3, max_depth)
        s = np.median(g) / np.median(d)  # numpy: the mean of the middle two for an even count
        expected.append(np.mean(np.abs(np.clip(s * d, 1e-3, max_depth) - g) / g))
    m, _ = image_metrics(torch.tensor(pred), torch.tensor(gt), max_depth=max_depth)
    assert m["abs_rel_med"].tolist() == pytest.approx(expected, rel=1e-12)
    assert (m["abs_rel_med"] < m["abs_rel"]).all()  # the scale error is taken out
    m32, _ = image_metrics(torch.tensor(pred).float(), torch.tensor(gt).float(),
                           max_depth=max_depth)  # float32, as a model gives them
    assert m32["abs_rel_med"].tolist() == pytest.approx(expected, rel=1e-5)
    acc = MetricAccumulator(max_depth=max_depth)
    acc.update(torch.tensor(pred), torch.tensor(gt))
    assert acc.compute()["abs_rel_med"] == pytest.approx(np.mean(expected), rel=1e-12)


def test_set_metrics_average_images_and_skip_empty_ones():
    gt = torch.tensor([[2.0, 2.0], [4.0, 4.0], [0.0, float("nan")]])
    pred = torch.tensor([[3.0, 2.0], [4.0, 4.0], [1.0, 1.0]])
    acc = MetricAccumulator()
    acc.update(pred[:2], gt[:2])
    acc.update(pred[2:], gt[2:])  # no valid pixel: not counted
    out = acc.compute()
    assert acc.images == 2
    assert out["abs_rel"] == pytest.approx((0.5 / 2 + 0) / 2)  # image means 0.25 and 0
    assert out["rmse"] == pytest.approx((math.sqrt(0.5) + 0) / 2)
    assert out["delta1"] == pytest.approx((0.5 + 1) / 2)


def test_depth_cap_masks_ground_truth_and_clamps_predictions():
    gt = torch.tensor([[5.0, 20.0]])  # 20 m is beyond the 10 m cap: ignored
    pred = torch.tensor([[12.0, 1.0]])  # 12 m is clamped to 10 m
    m, n = image_metrics(pred, gt, max_depth=10.0)
    assert n.item() == 1
    assert m["abs_rel"].item() == pytest.approx(1.0)
    mask = torch.tensor([[False, True]])
    assert image_metrics(pred, gt, mask=mask)[1].item() == 1
    assert image_metrics(pred, gt, mask=mask)[0]["abs_rel"].item() == pytest.approx(19 / 20)


def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match="differ"):
        image_metrics(torch.ones(1, 3), torch.ones(1, 4))
    with pytest.raises(ValueError, match="no image"):
        MetricAccumulator().compute()


def test_silog_by_hand():
    gt = torch.tensor([[2.0, 3.0, 0.0]])
    pred = gt * torch.tensor([[math.exp(0.1), math.exp(-0.1), 1.0]])
    # g = (0.1, -0.1): mean 0, mean g^2 = 0.01 -> 10 * sqrt(0.01) = 1
    assert silog_loss(pred, gt).item() == pytest.approx(1.0, rel=1e-5)
    # g = (0.2, 0.2): 10 * sqrt(0.04 - 0.85 * 0.04)
    assert silog_loss(gt * math.exp(0.2), gt).item() == pytest.approx(10 * math.sqrt(0.04 * 0.15),
                                                                        rel=1e-4)
    # lam = 1: a global scale costs nothing
    assert silog_loss(gt * 2, gt, lam=1.0).item() < 1e-4
    with pytest.raises(ValueError, match="no valid"):
        silog_loss(pred, torch.zeros_like(gt))
