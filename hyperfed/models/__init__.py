"""Client model architectures of the papers hyperfed implements (see :mod:`hyperfed.models.zoo`)."""

from hyperfed.models.zoo import (
    MODEL_REGISTRY,
    BasicBlock,
    ClientNet,
    Fire,
    ModelEntry,
    ModelInputError,
    ModelPartError,
    ModuleNet,
    UnknownModelError,
    ZooNet,
    build_model,
    check_input,
    describe_model,
    model_names,
    param_count,
    register_model,
)

__all__ = [
    "MODEL_REGISTRY",
    "BasicBlock",
    "ClientNet",
    "Fire",
    "ModelEntry",
    "ModelInputError",
    "ModelPartError",
    "ModuleNet",
    "UnknownModelError",
    "ZooNet",
    "build_model",
    "check_input",
    "describe_model",
    "model_names",
    "param_count",
    "register_model",
]
