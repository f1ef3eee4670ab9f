"""Predictors behind one protocol (see `seqmoe.brain.predict.base`)."""

from seqmoe.brain.predict.base import Forecast, Predictor
from seqmoe.brain.predict.baselines.affinity import AffinityPredictor
from seqmoe.brain.predict.baselines.eam import EAMPolicy, EAMPredictor

__all__ = ["AffinityPredictor", "EAMPolicy", "EAMPredictor", "Forecast", "Predictor"]
