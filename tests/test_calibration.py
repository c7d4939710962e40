"""Window calibration: the layout embedder, similarity curves against analytic velocity fields whose
Tweedie estimate is known in closed form, the tiny real backbone, the window and the plot."""

import math

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.calibration import calibrate_window, cosine_similarity, similarity_curves
from cast_core.shapes.embedder import CLASSES, LayoutEmbedder
from cast_core.shapes.render import Shape, render
from cast_core.shapes.world import BACKGROUND_RGB, COLORS, PALETTE_RGB
from cast_core.window import SdeWindow
from tasks.stages.plots import plot_calibration

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE = (Shape("circle", "red", 2, 2, 8), Shape("square", "blue", 18, 18, 8))


def _image(scene: tuple[Shape, ...]) -> torch.Tensor:
    """A render as [1, 3, H, W] in [0, 1]."""
    return torch.from_numpy(render(scene).image).permute(2, 0, 1)[None].float() / 255.0


def _cos_to_base(embedder: LayoutEmbedder, scene: tuple[Shape, ...]) -> float:
    e = embedder.embed(torch.cat([_image(BASE), _image(scene)]))
    return float(cosine_similarity(e[:1], e[1:]))


# embedder --------------------------------------------------------------------------------------

def test_embedding_shape_and_identical_images_give_cosine_exactly_one():
    embedder = LayoutEmbedder()
    images = torch.cat([_image(BASE), _image(BASE[:1]), _image(())])
    e = embedder.embed(images)
    assert e.shape == (3, len(CLASSES) * 8 * 8) == (3, embedder.dim)
    assert torch.equal(cosine_similarity(e, e), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(e.norm(dim=1), torch.ones(3), rtol=0, atol=1e-6)


def test_moving_a_shape_lowers_similarity_more_the_further_it_moves():
    embedder = LayoutEmbedder()
    near = (BASE[0], Shape("square", "blue", 14, 18, 8))  # 4 px: one cell
    far = (BASE[0], Shape("square", "blue", 6, 18, 8))  # 12 px: no overlap with its old place
    s_near, s_far = _cos_to_base(embedder, near), _cos_to_base(embedder, far)
    assert s_far < s_near < 1.0 - 1e-3


def test_recolouring_lowers_similarity_more_the_more_shapes_change():
    embedder = LayoutEmbedder()
    one = (BASE[0], Shape("square", "purple", 18, 18, 8))
    two = (Shape("circle", "green", 2, 2, 8), Shape("square", "purple", 18, 18, 8))
    s_one, s_two = _cos_to_base(embedder, one), _cos_to_base(embedder, two)
    assert s_two < s_one < 1.0 - 1e-3


def test_uniform_image_embeds_to_the_softmax_of_its_colour_distances():
    temp = 0.05
    embedder = LayoutEmbedder(grid=4, temp=temp, normalize=False)
    rgb = torch.tensor(PALETTE_RGB["yellow"], dtype=torch.float64) / 255.0
    images = rgb.float().view(1, 3, 1, 1).expand(2, 3, 12, 12)
    class_rgb = torch.tensor([PALETTE_RGB[c] for c in COLORS] + [BACKGROUND_RGB],
                             dtype=torch.float64) / 255.0
    logits = -((rgb - class_rgb) ** 2).sum(dim=1) / temp  # [6]
    p = torch.exp(logits - logits.max()) / torch.exp(logits - logits.max()).sum()
    expected = p.float().repeat_interleave(4 * 4).expand(2, -1)  # class-major, 16 cells each
    torch.testing.assert_close(embedder.embed(images), expected, rtol=0, atol=1e-6)
    normalised = LayoutEmbedder(grid=4, temp=temp).embed(images)
    torch.testing.assert_close(normalised, expected / expected.norm(dim=1, keepdim=True))


def test_cosine_similarity_matches_the_formula_and_validates_shapes():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    expected = [float(a[i] @ b[i]) / (float(a[i].norm()) * float(b[i].norm())) for i in range(5)]
    torch.testing.assert_close(cosine_similarity(a, b), torch.tensor(expected, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        cosine_similarity(a, b[:4])
    with pytest.raises(ValueError, match="grid"):
        LayoutEmbedder(grid=0)
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        LayoutEmbedder().embed(torch.zeros(1, 4, 8, 8))


# analytic fake backbones -------------------------------------------------------------------------

class TweedieFake:
    """Backbone whose Tweedie estimate is target(t) by construction: v = (x_t - target(t)) / t,
    so x0_hat = x_t - t v = target(t). Linear schedule, float64 latents, prompts ignored."""

    def __init__(self, target, shape: tuple[int, ...], decode=None) -> None:
        self.target, self.shape = target, shape
        self.decode = decode or (lambda x: x)

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return torch.zeros(len(prompts))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return torch.stack([torch.randn(self.shape, generator=torch.Generator().manual_seed(s),
                                        dtype=torch.float64) for s in seeds])

    def velocity(self, x_t, t, cond, guidance_scale=1.0, uncond=None) -> torch.Tensor:
        t = t.to(x_t.dtype).view(-1, *([1] * (x_t.dim() - 1)))
        return (x_t - self.target(t)) / t


class FlattenEmbedder:
    """e(image) = the image's pixels, flattened: cosines are exact in pixel space."""

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return images.flatten(1)


def test_fixed_data_gives_a_flat_curve_and_the_threshold_fallback():
    x_star = ShapesBackbone.encode_images(_image(BASE))[0]  # [3, H, W] in [-1, 1]
    fake = TweedieFake(lambda t: x_star.double().expand(t.shape[0], -1, -1, -1),
                       tuple(x_star.shape), decode=ShapesBackbone.decode)
    out = similarity_curves(fake, LayoutEmbedder(), ["a", "b", "c"], [0, 1, 2], 12, 1.0)
    assert out.curves.shape == (3, 12) and out.curves.dtype == torch.float64
    torch.testing.assert_close(out.curves, torch.ones(3, 12, dtype=torch.float64),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(out.sigmas, 1.0 - torch.arange(12, dtype=torch.float64) / 12)
    calibration = calibrate_window(out.curves, 12, window_size=3)
    assert calibration.formation.method_used == "threshold"
    assert calibration.formation.step == 0 and calibration.window == SdeWindow(0, 3)


def _logistic_fake(num_steps: int, low: float, beta: float, x_c: float):
    """A fake whose curve is s(x) = low + (high - low) sigmoid(beta (x - x_c)) at x = k / (S - 1),
    with high chosen so that s(1) = 1: x0_hat(t) = cos(theta) u + sin(theta) g with u, g
    orthonormal, cos(theta(t)) = s(x(t)), x(t) = k(t) / (S - 1) with the step k(t) = round((1 - t) S)
    read off the float32 time, so x_final = u exactly."""
    high = low + (1 - low) / (1 / (1 + math.exp(-beta * (1 - x_c))))
    g = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(48, 2, generator=g, dtype=torch.float64))
    u, w = basis[:, 0].view(3, 4, 4), basis[:, 1].view(3, 4, 4)

    def curve(x: torch.Tensor) -> torch.Tensor:
        return low + (high - low) * torch.sigmoid(beta * (x - x_c))

    def target(t: torch.Tensor) -> torch.Tensor:
        k = torch.round((1 - t) * num_steps)  # [N, 1, 1, 1]
        c = curve(k / (num_steps - 1)).clamp(max=1.0)
        return c * u + torch.sqrt(1 - c**2) * w

    return TweedieFake(target, (3, 4, 4)), curve, high


def _analytic_upper_knee_step(num_steps, low, high, beta, x_c) -> int:
    """Most negative curvature of the logistic on a dense grid of x in [0, 1], mapped to steps."""
    x = torch.linspace(0.0, 1.0, 200001, dtype=torch.float64)
    sig = torch.sigmoid(beta * (x - x_c))
    dy = (high - low) * beta * sig * (1 - sig)
    d2y = (high - low) * beta**2 * sig * (1 - sig) * (1 - 2 * sig)
    return round(float(x[torch.argmin(d2y / (1 + dy**2) ** 1.5)]) * (num_steps - 1))


@pytest.mark.parametrize("num_steps, low, beta, x_c", [(30, 0.3, 12.0, 0.4), (24, 0.5, 16.0, 0.55)])
def test_logistic_tweedie_schedule_puts_the_knee_at_the_analytic_step(num_steps, low, beta, x_c):
    fake, curve, high = _logistic_fake(num_steps, low, beta, x_c)
    out = similarity_curves(fake, FlattenEmbedder(), ["p", "q"], [5, 6], num_steps, 1.0,
                            chunk_size=1)
    x = torch.arange(num_steps, dtype=torch.float64) / (num_steps - 1)
    torch.testing.assert_close(out.curves, curve(x).clamp(max=1.0).expand(2, -1),
                               rtol=0, atol=1e-6)
    assert torch.equal(out.curves[:, -1], torch.ones(2, dtype=torch.float64))
    calibration = calibrate_window(out.curves, num_steps, window_size=4)
    expected = _analytic_upper_knee_step(num_steps, low, high, beta, x_c)
    assert calibration.formation.method_used == "curvature"
    assert abs(calibration.formation.step - expected) <= 1
    assert calibration.window.end == calibration.formation.step + 1


# tiny real backbone ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny() -> ShapesBackbone:
    torch.manual_seed(0)
    return ShapesBackbone(TINY).eval()


PROMPTS = ["a photo of a red circle", "a photo of two blue squares", "a photo of a green triangle"]


def test_tiny_backbone_curves_are_finite_end_at_one_and_ignore_chunking(tiny):
    out = similarity_curves(tiny, LayoutEmbedder(), PROMPTS, [0, 1, 2], 5, 1.0, chunk_size=2)
    assert out.curves.shape == (3, 5) and out.sigmas.shape == (5,)
    assert bool(torch.isfinite(out.curves).all())
    assert bool((out.curves <= 1.0 + 1e-12).all() and (out.curves >= 0.0).all())
    # sigma_S = 0: the last Euler step is the Tweedie estimate, so x0_hat_{S-1} = x_final exactly
    assert torch.equal(out.curves[:, -1], torch.ones(3, dtype=torch.float64))
    one_by_one = similarity_curves(tiny, LayoutEmbedder(), PROMPTS, [0, 1, 2], 5, 1.0,
                                   chunk_size=1)
    torch.testing.assert_close(one_by_one.curves, out.curves, rtol=0, atol=1e-6)


def test_tiny_backbone_with_guidance_calibrates_and_plots(tiny):
    out = similarity_curves(tiny, LayoutEmbedder(), PROMPTS[:2], [3, 4], 6, 3.0)
    assert torch.equal(out.curves[:, -1], torch.ones(2, dtype=torch.float64))
    calibration = calibrate_window(out.curves, 6, window_size=2)
    png = plot_calibration(calibration, out.sigmas, "tiny shapes backbone")
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    with pytest.raises(ValueError, match="sigmas"):
        plot_calibration(calibration, out.sigmas[:3], "wrong sigmas")


def test_similarity_curves_validates_its_inputs(tiny):
    with pytest.raises(ValueError, match="one seed per prompt"):
        similarity_curves(tiny, LayoutEmbedder(), PROMPTS, [0, 1], 4, 1.0)


# calibrate_window --------------------------------------------------------------------------------

def _logistic_curves(num_steps: int, x_c: float) -> torch.Tensor:
    x = torch.arange(num_steps, dtype=torch.float64) / (num_steps - 1)
    base = 0.3 + 0.7 * torch.sigmoid(14.0 * (x - x_c))
    return torch.stack([base - 0.02, base, base + 0.02])  # [3, S]


@pytest.mark.parametrize("x_c", [0.2, 0.5, 0.8])
def test_window_ends_at_the_formation_step_within_bounds(x_c):
    num_steps, size = 20, 4
    curves = _logistic_curves(num_steps, x_c)
    calibration = calibrate_window(curves, num_steps, window_size=size)
    window, step = calibration.window, calibration.formation.step
    assert window.size == size and 0 <= window.start and window.end <= num_steps
    assert window.end == max(step + 1, size)
    torch.testing.assert_close(calibration.mean_curve, curves.mean(dim=0))
    expected_std = torch.sqrt(((curves - curves.mean(dim=0)) ** 2).mean(dim=0))
    torch.testing.assert_close(calibration.std_curve, expected_std)


def test_window_is_shifted_into_the_requested_bounds():
    curves = _logistic_curves(20, 0.8)
    step = calibrate_window(curves, 20, window_size=4).formation.step
    assert step + 1 > 12  # the knee lies past max_end, so the window must shift left
    window = calibrate_window(curves, 20, window_size=4, min_start=2, max_end=12).window
    assert window == SdeWindow(8, 12)
    early = calibrate_window(_logistic_curves(20, 0.2), 20, window_size=5, min_start=3).window
    assert early.start >= 3 and early.size == 5


def test_calibrate_window_rejects_curves_of_the_wrong_length():
    with pytest.raises(ValueError, match="num_steps"):
        calibrate_window(_logistic_curves(20, 0.5), 21, window_size=4)
