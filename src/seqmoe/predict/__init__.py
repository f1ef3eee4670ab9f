"""Predictors behind one protocol (see `seqmoe.predict.base`)."""

from seqmoe.predict.base import Forecast, Predictor
from seqmoe.predict.baselines.affinity import AffinityPredictor
from seqmoe.predict.baselines.eam import EAMPolicy, EAMPredictor

__all__ = ["AffinityPredictor", "EAMPolicy", "EAMPredictor", "Forecast", "Predictor"]
