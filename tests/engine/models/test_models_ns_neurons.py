"""PLIF neuron populations: the leak's bound, the soft reset and the sigmoid surrogate's gradient."""

from __future__ import annotations

import math

import torch

from engine.models.ns.neurons import PLIFNeurons


def neurons(channels=5, threshold=0.5, alpha=4.0):
    return PLIFNeurons(
        channels, beta_max=0.99, alpha=alpha, threshold_init=threshold, tau_min=1.0, tau_max=16.0
    ).double()


def test_initial_leaks_follow_log_spaced_time_constants_and_stay_below_the_bound():
    population = neurons()
    tau = torch.exp(torch.linspace(0.0, math.log(16.0), 5, dtype=torch.float64))
    torch.testing.assert_close(population.beta(), torch.exp(-1.0 / tau))
    torch.testing.assert_close(population.threshold(), torch.full((5,), 0.5, dtype=torch.float64))
    with torch.no_grad():
        population.beta_logit.fill_(1e4)  # however far training pushes it
    assert population.beta().max() <= 0.99


def test_soft_reset_subtracts_the_threshold_after_a_spike():
    population = neurons(channels=1, threshold=0.5)
    beta = float(population.beta().detach())
    x = torch.tensor([[[2.0], [0.0]]], dtype=torch.float64)  # (1, 2, 1)
    spikes, membrane, last = population(x, None)
    first = (1 - beta) * 2.0
    assert first > 0.5 and spikes[0, 0, 0] == 1
    torch.testing.assert_close(membrane[0, 1, 0], torch.tensor(beta * (first - 0.5), dtype=torch.float64))
    assert spikes[0, 1, 0] == 0
    torch.testing.assert_close(last[0, 0], membrane[0, 1, 0])


def test_the_surrogate_gradient_equals_its_formula():
    population = neurons(channels=6, threshold=0.5, alpha=4.0)
    x = torch.linspace(-1.0, 3.0, 6, dtype=torch.float64).view(1, 1, 6).requires_grad_()
    v0 = torch.linspace(-0.5, 0.8, 6, dtype=torch.float64).view(1, 6)
    spikes, _, _ = population(x, v0)
    spikes.sum().backward()
    beta, threshold = population.beta().detach(), population.threshold().detach()
    v_pre = beta * v0[0] + (1 - beta) * x.detach()[0, 0]
    sig = torch.sigmoid(4.0 * (v_pre - threshold))
    # ds/dx = ds/dv_pre * dv_pre/dx with ds/dv_pre = alpha sig (1 - sig).
    torch.testing.assert_close(x.grad[0, 0], 4.0 * sig * (1 - sig) * (1 - beta))


def test_the_membrane_reading_reaches_the_leak_without_the_surrogate():
    population = neurons(channels=3, threshold=100.0)  # never fires
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    _, membrane, _ = population(x, None)
    membrane.sum().backward()
    assert population.beta_logit.grad.abs().min() > 0
    assert torch.autograd.gradcheck(lambda inputs: population(inputs, None)[1], (x.requires_grad_(),))
