"""Advice for operators (pure Python, no torch): which flags to start each engine with for a
workload, built on plan() and the engine models in `kvatlas.engines`."""

from .profile import Pace, Profile, profile
from .tune import TUNE_SCHEMA, TUNE_SCHEMA_VERSION, EngineAdvice, Setting, Tuning, tune

__all__ = ["EngineAdvice", "Pace", "Profile", "Setting", "TUNE_SCHEMA", "TUNE_SCHEMA_VERSION", "Tuning", "profile", "tune"]
