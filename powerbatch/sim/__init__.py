"""Simulated GPU + vLLM-like OpenAI-compatible server, for running powerbatch without a GPU."""

from powerbatch.sim.engine import SimEngine
from powerbatch.sim.gpu_model import PROFILES, GpuProfile
from powerbatch.sim.power_source import ModelPowerSource, SimPowerSource
from powerbatch.sim.server import create_sim_app, run_sim_server

__all__ = [
    "PROFILES",
    "GpuProfile",
    "ModelPowerSource",
    "SimEngine",
    "SimPowerSource",
    "create_sim_app",
    "run_sim_server",
]
