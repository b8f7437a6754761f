"""Image flow model on the digits, PSNR/SSIM, and guided image inpainting with the real sampler."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import load_benchmark

import guidance
from guidance import costs
from guidance.image_model import (ImageFlowConfig, ImageVelocity, load_digits_images, load_digits_split, psnr,
                                  split_indices, ssim, train_image_flow)

torch.set_num_threads(1)
TINY = ImageFlowConfig(size=16, base=16, steps=600, batch=64, lr=3e-3, ema=0.99)  # ~15-20 s on 1 core


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A briefly trained model (trained here, not read from the project cache)."""
    cache = tmp_path_factory.mktemp("image_flow")
    model = train_image_flow(TINY, cache_dir=cache, progress=False)
    return model, cache


def test_digits_are_normalized_and_split_without_overlap():
    x, labels = load_digits_images(16)
    assert x.shape == (1797, 1, 16, 16) and x.dtype == torch.float32 and labels.shape == (1797,)
    assert float(x.min()) == -1.0 and float(x.max()) == pytest.approx(1.0, abs=1e-6)
    tr, te = split_indices(300, seed=0)
    assert len(tr) == 1497 and len(te) == 300 and not set(tr.tolist()) & set(te.tolist())
    assert torch.equal(split_indices(300, seed=0)[1], te) and not torch.equal(split_indices(300, seed=1)[1], te)
    train, test = load_digits_split(16)
    assert torch.equal(test, x[te])
    with pytest.raises(ValueError, match="multiple of 8"):
        load_digits_images(12)


def test_psnr_and_ssim_on_known_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, 16, 16, generator=g) * 2 - 1
    assert torch.isinf(psnr(x, x)).all()
    assert torch.allclose(ssim(x, x), torch.ones(4))
    # a constant offset d: MSE = d^2, PSNR = 10 log10(L^2 / d^2)
    assert torch.allclose(psnr(x + 0.1, x), torch.full((4,), 10 * math.log10(4 / 0.01)), atol=1e-4)
    # constant images a, b: no variance, SSIM is the luminance term (2ab + C1) / (a^2 + b^2 + C1)
    a, b, c1 = 0.2, -0.3, (0.01 * 2) ** 2
    got = ssim(torch.full((1, 1, 16, 16), a), torch.full((1, 1, 16, 16), b))
    assert float(got) == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), rel=1e-5)
    # an inverted-contrast image (same mean brightness) is anti-correlated; more noise scores lower
    x01 = (x + 1) / 2
    assert float(ssim(1 - x01, x01, data_range=1.0).max()) < 0
    small, big = x + 0.05 * torch.randn(x.shape, generator=g), x + 0.3 * torch.randn(x.shape, generator=g)
    assert bool((ssim(small, x) > ssim(big, x)).all()) and bool((psnr(small, x) > psnr(big, x)).all())
    with pytest.raises(ValueError, match="equal shape"):
        psnr(x, x[:2])


def test_ssim_matches_an_independent_gaussian_filter_implementation():
    ndimage = pytest.importorskip("scipy.ndimage")
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1, 1, 24, 24, generator=g, dtype=torch.float64)
    y = (x + 0.2 * torch.randn(x.shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    xs, ys = x[0, 0].numpy(), y[0, 0].numpy()
    f = lambda z: ndimage.gaussian_filter(z, 1.5, truncate=5 / 1.5)[5:-5, 5:-5]  # noqa: E731  11x11, valid
    mx, my = f(xs), f(ys)
    vx, vy, cxy = f(xs * xs) - mx ** 2, f(ys * ys) - my ** 2, f(xs * ys) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    ref = ((2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))).mean()
    assert float(ssim(x.float(), y.float(), data_range=1.0)) == pytest.approx(float(ref), abs=1e-5)


def test_velocity_net_shapes_and_bad_input():
    net = ImageVelocity(1, base=16, patch=2)
    x = torch.randn(3, 1, 16, 16)
    assert net(x, torch.rand(3)).shape == x.shape
    with pytest.raises(ValueError, match="divisible by 8"):
        net(torch.randn(3, 1, 12, 12), torch.rand(3))


def test_training_is_cached_and_seeded(tiny):
    model, cache = tiny
    files = list(cache.glob("*.safetensors"))
    assert len(files) == 1 and files[0].with_suffix(".json").exists()
    again = train_image_flow(TINY, cache_dir=cache, progress=False)  # loads, does not retrain
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    info = json.loads(files[0].with_suffix(".json").read_text())
    assert info["config"]["steps"] == TINY.steps and info["n_train"] == 1497


def test_guided_inpainting_meets_the_observed_pixels_and_beats_unguided(tiny):
    model, _ = tiny
    _, test = load_digits_split(16)
    truth = test[:32]
    mask = torch.ones(16, 16)
    mask[8:] = 0                                                # bottom half missing
    y = mask * truth
    cost = costs.inpainting(mask, y, sigma=0.05)
    x0 = torch.randn(truth.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        free = guidance.sample(model, x0, 10)
        guided = guidance.sample(model, x0, 10, guide=guidance.make("coupled", cost=cost, scale=1.0,
                                                                    project=cost))
    assert torch.allclose(guided[:, :, :8], truth[:, :, :8], atol=1e-5)
    assert float(psnr(guided.clamp(-1, 1), truth).mean()) > float(psnr(free.clamp(-1, 1), truth).mean()) + 3.0
    # the model must carry the observation into the missing half, not just paste the top half
    miss = lambda z: z[:, :, 8:]  # noqa: E731
    assert float(psnr(miss(guided).clamp(-1, 1), miss(truth)).mean()) > \
        float(psnr(miss(free).clamp(-1, 1), miss(truth)).mean()) + 0.5


def test_soft_guidance_pulls_super_resolution_toward_the_measurement(tiny):
    model, _ = tiny
    _, test = load_digits_split(16)
    truth = test[:32]
    y = torch.nn.functional.avg_pool2d(truth, 4)
    cost = costs.super_resolution(y, 4, sigma=0.05)
    x0 = torch.randn(truth.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        free = guidance.sample(model, x0, 10)
        guided = guidance.sample(model, x0, 10, guide=guidance.make("coupled", cost=cost, scale=1.0,
                                                                    step="linear", s2=0.4))
    assert float(cost(guided).mean()) < 0.1 * float(cost(free).mean())
    assert float(psnr(guided.clamp(-1, 1), truth).mean()) > float(psnr(free.clamp(-1, 1), truth).mean()) + 3.0


def test_benchmark_keeps_other_sections_of_the_results_file(tmp_path, monkeypatch):
    bench = load_benchmark("guidance_images", monkeypatch)
    path = tmp_path / "guidance.json"
    path.write_text(json.dumps({"exact": {"keep": 1}, "images": {"old": 0}}))
    bench.write_json(path, {"sr4": {"coupled": {"psnr": 20.0}}}, {"n_images": 2})
    data = json.loads(path.read_text())
    assert data["exact"] == {"keep": 1} and data["images"] == {"sr4": {"coupled": {"psnr": 20.0}}}
    assert data["images_meta"] == {"n_images": 2} and not list(tmp_path.glob("*.tmp*"))
