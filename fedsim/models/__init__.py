"""The model zoo: importing this package registers every built-in architecture."""

from fedsim.models import resnet, small  # noqa: F401  (registration side effects)
from fedsim.models.params import count_parameters, state_nbytes
from fedsim.models.registry import Classifier, build_model, model_names, register_model

__all__ = ["Classifier", "build_model", "count_parameters", "model_names", "register_model", "state_nbytes"]
