"""Estimate: an online regression of power on what the proxy controls and sees."""

from powerbatch.estimate.features import Features
from powerbatch.estimate.power_model import PowerModel, PowerPrior, Prediction

__all__ = ["Features", "PowerModel", "PowerPrior", "Prediction"]
