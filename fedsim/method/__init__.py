"""The authoring kit: everything a method or plugin imports, from this one module.

    from fedsim.method import Algorithm, Phase, Broadcast, ClientResult, register_algorithm, knob, ...

- the contract: `Algorithm` and its hooks, `Phase`, `Broadcast`, `Message`, `ClientContext`, `ClientData`,
  `ClientResult`, `SummedUpdate`, `RoundInfo`, `Env`;
- registration: `register_algorithm`, `register_state` (dataclasses kept in server or client state),
  `register_model`, `register_dataset`, and `knob` for a method's parameters;
- local training as data (`LocalTraining`, `Stage`), which workers may batch (`Phase(..., local_training=True)`);
- aggregation (exact, order-independent weighted sums), server optimisers (FedAdam, FedYogi, FedAdagrad,
  FedAvgM: `ServerOptimizer`, `server_opt_by_arch`), global-model helpers, knowledge distillation, the
  training loop's pieces (optimizers, batches, evaluation), the mechanism-column helpers (`mechanism`) and the
  personal methods' split models and personal scores (`personal`, `PersonalMethod`);
- asynchronous methods: `AsyncAlgorithm`, the `Arrival` its server step gets, `NEW_VERSION`, staleness weights.

Importing this module imports no method (built-ins register when a config first names one).
"""

from fedsim import rng
from fedsim.config.knobs import knob
from fedsim.data.registry import Dataset, register_dataset
from fedsim.errors import AlgorithmError, ConfigError
from fedsim.method import mechanism, personal, toolkit
from fedsim.method.aggregate import (
    WEIGHT_KEY,
    as_summable,
    average_by_arch,
    move_toward,
    split_by_arch,
    sum_by_arch,
    weighted_average,
    weighted_sum,
)
from fedsim.method.asynchronous import (
    NEW_VERSION,
    Arrival,
    AsyncAlgorithm,
    StalenessParams,
    staleness_weight,
)
from fedsim.method.contract import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientData,
    ClientResult,
    Env,
    Message,
    Models,
    Phase,
    RoundInfo,
    SummedUpdate,
    algorithm_names,
    get_algorithm,
    register_algorithm,
)
from fedsim.method.distill import (
    DistillConfig,
    distill,
    domain_weights,
    ensemble_teacher,
    kd_loss,
    leave_one_out,
    soften,
)
from fedsim.method.personal import PersonalMethod, PersonalServer
from fedsim.method.server_opt import STEP_RATIO_COLUMNS, ServerOptimizer, server_opt_by_arch, server_opt_step
from fedsim.method.toolkit import (
    GlobalModels,
    State,
    clone_state,
    evaluate_models,
    evaluation_model,
    init_global_models,
    loaded_model,
    new_model,
    seeded_model,
)
from fedsim.models.registry import Classifier, register_model
from fedsim.persist.checkpoint import register_state
from fedsim.training.local import LocalTraining, Stage
from fedsim.training.optim import SGD, Adam, CosineAnnealing
from fedsim.training.train import (
    batch_indices,
    batchnorm_stats_kept,
    clip_logits,
    evaluate_classifier,
    make_optimizer,
    predict_logits,
    train_classifier,
)

__all__ = [
    "SGD", "Adam", "AlgorithmError", "ConfigError", "CosineAnnealing", "batch_indices", "batchnorm_stats_kept",
    "evaluate_classifier", "make_optimizer", "predict_logits", "train_classifier",
    "WEIGHT_KEY", "Algorithm", "Broadcast", "Classifier", "ClientContext", "ClientData", "ClientResult", "Dataset",
    "DistillConfig", "Env", "GlobalModels", "LocalTraining", "Message", "Models", "Phase", "RoundInfo", "Stage",
    "State", "SummedUpdate", "algorithm_names", "as_summable", "average_by_arch", "clip_logits", "clone_state",
    "distill", "domain_weights", "ensemble_teacher", "evaluate_models", "evaluation_model", "get_algorithm",
    "init_global_models", "kd_loss", "knob", "leave_one_out", "loaded_model", "mechanism", "move_toward", "toolkit",
    "new_model", "personal", "PersonalMethod", "PersonalServer", "register_algorithm", "register_dataset",
    "register_model", "register_state", "rng",
    "seeded_model", "soften", "split_by_arch", "sum_by_arch", "weighted_average", "weighted_sum",
    "STEP_RATIO_COLUMNS", "ServerOptimizer", "server_opt_by_arch", "server_opt_step",
    "NEW_VERSION", "Arrival", "AsyncAlgorithm", "StalenessParams", "staleness_weight",
]
